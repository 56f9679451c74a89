"""Serve the deployments of this project (run by `ggpo up`): `ggpo/offline` (the offline
comparison, flows/offline.py) and `ggpo/online` (Algorithm 1, flows/online.py), one process."""
from __future__ import annotations

from prefect import serve

from flows.offline import ggpo
from flows.online import ggpo_online


def main() -> None:
    serve(ggpo.to_deployment(name="offline", parameters={"preset": "tiny", "overrides": {}, "force": []}),
          ggpo_online.to_deployment(name="online", parameters={"preset": "tiny-online", "overrides": {}, "force": []}))


if __name__ == "__main__":
    main()
