"""ggpo: offline and online RL with verifiable rewards as a DAG of cached stages.

`pipeline` is the library, in layers (each imports only its own level or below;
tests/test_imports.py checks it): core (0), tasks and models (1), services (2), training
and dag (3), then the stages/ modules (4), reports (5), flows/ (6) and the CLI (cli.py, 7).
"""
