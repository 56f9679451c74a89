"""Services (level 2): the local Prefect and MLflow servers (servers.py: ggpo up/down/status),
the Prefect API client (prefect_client.py), progress display and MLflow tracking. Imports
pipeline.core, pipeline.tasks, pipeline.models and its own modules.
"""
