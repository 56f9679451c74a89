"""Serve the deployments of this project (run by `ggpo up`): `ggpo/offline` (the offline
comparison, flows/offline.py) and `ggpo/online` (Algorithm 1, flows/online.py), one process."""
from __future__ import annotations

from typing import cast

from prefect import serve
from prefect.deployments.runner import RunnerDeployment

from flows.offline import ggpo
from flows.online import ggpo_online


def main() -> None:
    offline = ggpo.to_deployment(name="offline", parameters={"preset": "tiny", "overrides": {}, "force": []})
    online = ggpo_online.to_deployment(name="online", parameters={"preset": "tiny-online", "overrides": {}, "force": []})
    # called from sync code, to_deployment returns the deployment (prefect's async_dispatch types the coroutine too)
    serve(cast(RunnerDeployment, offline), cast(RunnerDeployment, online))


if __name__ == "__main__":
    main()
