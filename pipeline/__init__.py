"""ggpo: offline RL with verifiable rewards as a DAG of cached stages.

`pipeline` is the flat library every stage shares: typed config and presets, Arrow
schemas, the content-addressed store, rollout engines, grading, the built-in task and
tiny model, MLflow tracking helpers and the CLI.
"""
