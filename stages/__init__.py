"""One module per DAG stage, each exposing `SPEC` and `run(config, inputs) -> Manifest`."""
