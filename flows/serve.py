"""Serve the deployments of this project (run by `ggpo up`): `ggpo/offline`."""
from __future__ import annotations

from flows.offline import ggpo


def main() -> None:
    ggpo.serve(name="offline", parameters={"preset": "tiny", "overrides": {}, "force": []})


if __name__ == "__main__":
    main()
