"""The bad day, a served deployment's side: a deployment run (the process `ggpo up` starts,
flows/serve.py) survives its Prefect server dying as `ggpo run` does
(tests/test_bad_day_prefect.py): the run goes on to its end with one warning line in
serve.log, and once `ggpo up` brings the server back the UI shows it Completed.

Commands run as `python -m pipeline.cli` from the repository (this checkout's code)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, api, prefect_dies_mid_training, state

GGPO = [sys.executable, "-m", "pipeline.cli"]
# its own train key (test_bad_day_prefect trains 48 updates of seed 12): the fault lands mid-training
SETS = ["experiment.seeds=[12]", "experiment.methods=[grpo]", "train.updates=40", "train.eval_every=null",
        "train.checkpoint_every=4"]


@pytest.mark.servers
def test_a_deployment_run_survives_its_prefect_server_dying(shell):
    home = Path(shell["GGPO_HOME"])
    watcher = prefect_dies_mid_training(shell, SETS, deployment=True)
    out, err = watcher.communicate(timeout=600)
    # the watching command cannot watch any more: one line, and the run is not its to end
    assert watcher.returncode == 2 and "stopped answering while this command watched" in err, err[-3000:]
    unreported = home / "prefect" / "unreported"
    deadline = time.monotonic() + 1800          # a safety net, not a verdict
    while not list(unreported.glob("*.json")) and time.monotonic() < deadline:
        time.sleep(0.5)
    kept = list(unreported.glob("*.json"))
    log = (home / "logs" / "serve.log").read_text()
    assert len(kept) == 1, log[-4000:]
    assert json.loads(kept[0].read_text())["type"] == "COMPLETED", log[-4000:]
    assert log.count("stopped answering; the run goes on without it") == 1, log[-4000:]
    assert "Finished in state Completed()" in log, log[-4000:]
    # serve.log holds the serve process's own lines too: its runner's services log their
    # failures to reach the server (Prefect's frames only, and Prefect's noise, which this
    # test does not judge); no traceback comes from the run's code
    ours = [t for t in re.findall(r"Traceback \(most recent call last\):\n(?:[ \t].*\n)*.*", log)
            if any(f"{REPO}/{part}/" in t for part in ("pipeline", "flows", "stages"))]
    assert not ours, ours
    up = subprocess.run(GGPO + ["up"], cwd=REPO, env=shell, capture_output=True, text=True, timeout=600)
    assert up.returncode == 0 and "recorded Completed" in up.stdout, up.stdout + up.stderr
    prefect = state(shell)["urls"]["prefect_api"]
    assert api(prefect, f"/flow_runs/{kept[0].stem}")["state"]["type"] == "COMPLETED"
