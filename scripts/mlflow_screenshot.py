"""Screenshot the MLflow page a ggpo user lands on: the `ggpo-offline` experiment's runs
table with the chart view (the link `ggpo up` prints), in headless Chromium.

    python scripts/mlflow_screenshot.py http://127.0.0.1:5000 /tmp/mlflow_view.png

Starts no server: it reads a running MLflow server (`ggpo up`, or any MLFLOW server that
holds the experiment). Needs the Debian package `chromium` (apt-get install -y chromium).
Exits 2 with one line if the server does not answer, the experiment is missing or
Chromium is not installed. A fresh browser profile each time, because the UI remembers
the last view in the browser and would hide what a first-time user sees.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

EXPERIMENT = "ggpo-offline"
RUNS_VIEW_QUERY = "workflowType=machine_learning&compareRunsMode=CHART"     # same as pipeline.services.tracking.RUNS_VIEW_QUERY
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars"]


def die(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def experiment_id(server: str, name: str) -> str:
    """Looked up through the REST API, so this script does not need mlflow installed."""
    query = urllib.parse.urlencode({"experiment_name": name})
    url = f"{server}/api/2.0/mlflow/experiments/get-by-name?{query}"
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.load(r)["experiment"]["experiment_id"]
    except urllib.error.HTTPError as e:
        die(f"experiment {name!r} not found on {server} ({e.code}); run a ggpo flow or stage first")
    except OSError as e:
        die(f"no MLflow server answers at {server} ({e}); start one with `ggpo up`")


def screenshot(url: str, out: Path, width: int, height: int, budget_ms: int) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        die("chromium not found; install it with `apt-get install -y chromium`")
    with tempfile.TemporaryDirectory(prefix="ggpo-chromium-") as profile:
        # without a virtual-time budget only the UI's loading skeleton is captured
        argv = [browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}",
                f"--screenshot={out}", f"--window-size={width},{height}", url]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    if done.returncode != 0 or not out.exists():
        die(f"chromium exited {done.returncode} without writing {out}:\n{done.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("server", help="MLflow tracking server, e.g. http://127.0.0.1:5000")
    ap.add_argument("out", type=Path, help="PNG to write")
    ap.add_argument("--experiment", default=EXPERIMENT)
    ap.add_argument("--size", default="1800x1100", help="window WIDTHxHEIGHT")
    ap.add_argument("--budget-ms", type=int, default=30000, help="virtual time for the page to render")
    args = ap.parse_args(argv)
    server = args.server.rstrip("/")
    url = f"{server}/#/experiments/{experiment_id(server, args.experiment)}/runs?{RUNS_VIEW_QUERY}"
    width, height = (int(v) for v in args.size.lower().split("x"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.unlink(missing_ok=True)
    screenshot(url, args.out.resolve(), width, height, args.budget_ms)
    print(f"{url}\n-> {args.out} ({args.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
