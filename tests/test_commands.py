"""Every command a user types, as they type it: the real `ggpo` CLI in subprocesses, with
the servers up (`ggpo up` on free ports), tracking on and a fresh cache of this module's
own. Each command must exit 0, print no traceback, and every link it prints must open
what it names: an MLflow run link answers 200 and its run exists in that experiment, a
Prefect flow-run link answers 200 and its flow run exists.

The commands run in the order a user would (each test builds on the previous ones), so
the module reads as a session: up, every stage, pool import and scoring, the online cell,
the flows (in-process, as a deployment, and through `prefect deployment run`), the
reports, the cache tools, down."""
from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import BIN, REPO, free_port

pytestmark = pytest.mark.servers

EXAMPLE = REPO / "data" / "example_completions.jsonl"
LINK = re.compile(r"https?://127\.0\.0\.1:\d+[^\s)'\"]*")
# an online cell wrecked by its first round (lr 1): round 1 finds no mixed group and the
# cell stops there (online.on_stall=stop): its report reads the stop policy and evaluation
STALL = ["train.lr=1.0", "train.updates=6", "online.max_draws=2", "experiment.methods=[grpo]"]
# its row of the final table: cell grpo, N 2, one seed, final at update 2 (of 6)
STOPPED = re.compile(r"\| grpo \| 2 \| \w+ \| 1 \| 2 \| [\d.]+ \|")


def sets(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """A user's shell: its own cache, state folder and ports; `ggpo up` first, `ggpo down`
    at the end whatever happened."""
    root = tmp_path_factory.mktemp("commands")
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    env |= {"GGPO_CACHE": str(root / "cache"), "GGPO_HOME": str(root / "home"),
            "GGPO_PREFECT_PORT": str(free_port()), "GGPO_MLFLOW_PORT": str(free_port())}
    state = {"env": env, "root": root}
    yield state
    subprocess.run([str(BIN / "ggpo"), "down"], cwd=REPO, env=env, capture_output=True, timeout=120)


def run(session, *argv: str, program: str = "ggpo", timeout: int = 900) -> subprocess.CompletedProcess:
    """One command as typed; exit 0, no traceback, and every link it prints opens."""
    res = subprocess.run([str(BIN / program), *argv], cwd=REPO, env=session["env"], capture_output=True,
                         text=True, timeout=timeout)
    shown = f"$ {program} {' '.join(argv)}\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    assert res.returncode == 0, shown
    assert "Traceback" not in res.stdout + res.stderr, shown
    for link in LINK.findall(res.stdout + res.stderr):
        check_link(session, link, shown)
    return res


def get(url: str) -> tuple[int, bytes]:
    """GET as a browser asks for a page (Prefect's UI serves its deep links to text/html only)."""
    req = urllib.request.Request(url, headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


def check_link(session, link: str, shown: str) -> None:
    """The page answers 200, and the run, experiment or flow run it names exists there."""
    if re.search(r"/api(/|$)", link):
        return          # an API base printed for `export PREFECT_API_URL=...`, not a page
    status, _ = get(link.split("#")[0])
    assert status == 200, f"{link} answered {status}\n{shown}"
    urls = session.get("urls")
    if urls and link.startswith(urls["mlflow"]):
        fragment = link.partition("#")[2]
        exp = re.search(r"/experiments/(\d+)", fragment)
        run_id = re.search(r"/runs/([0-9a-f]{32})", fragment)
        if run_id:
            status, body = get(f"{urls['mlflow']}/api/2.0/mlflow/runs/get?run_id={run_id.group(1)}")
            assert status == 200, f"{link}: the run it names is not on the server\n{shown}"
            assert exp and json.loads(body)["run"]["info"]["experiment_id"] == exp.group(1), link
        elif exp:
            status, _ = get(f"{urls['mlflow']}/api/2.0/mlflow/experiments/get?experiment_id={exp.group(1)}")
            assert status == 200, f"{link}: its experiment is not on the server\n{shown}"
    if urls and link.startswith(urls["prefect_ui"]) and "/flow-run/" in link:
        flow_run = link.rsplit("/flow-run/", 1)[1]
        status, _ = get(f"{urls['prefect_api']}/flow_runs/{flow_run}")
        assert status == 200, f"{link}: the flow run it names is not on the server\n{shown}"


def mlflow_links(res) -> list[str]:
    return [link for link in LINK.findall(res.stdout) if "/runs/" in link]


# --------------------------------------------------------------------------- the servers

def test_up_status_env(session):
    res = run(session, "up")
    session["urls"] = json.loads((Path(session["env"]["GGPO_HOME"]) / "services.json").read_text())["urls"]
    assert session["urls"]["mlflow"] in res.stdout
    run(session, "status")
    exports = run(session, "env").stdout
    assert f"PREFECT_API_URL={session['urls']['prefect_api']}" in exports.replace("'", "").replace('"', "")


# --------------------------------------------------------------------------- single stages

@pytest.mark.parametrize("stage", ["base", "rollout", "verify", "filter", "train", "evaluate"])
def test_stage(session, stage):
    """`ggpo stage NAME` builds from the cache its predecessors left, logs the result to
    MLflow and prints the run's page; the second call is a cache hit."""
    res = run(session, "stage", stage, "--preset", "smoke")
    assert f"{stage}: built" in res.stdout, res.stdout
    assert len(mlflow_links(res)) == 1, res.stdout
    assert f"{stage}: cache hit" in run(session, "stage", stage, "--preset", "smoke").stdout


def test_pool_import_and_score(session):
    src = sets(f"pool.source={EXAMPLE}")
    res = run(session, "pool", "import", str(EXAMPLE), "--preset", "smoke")
    assert "pool_import: built" in res.stdout and len(mlflow_links(res)) == 1, res.stdout
    res = run(session, "stage", "pool_import", "--preset", "smoke", *src)
    assert "pool_import: cache hit" in res.stdout
    model = re.search(r"folder (\S+)", run(session, "stage", "base", "--preset", "smoke").stdout).group(1)
    res = run(session, "stage", "score", "--preset", "smoke", "--model", f"{model}/model", *src)
    assert "score: built" in res.stdout and len(mlflow_links(res)) == 1, res.stdout


def test_stage_online_and_its_rounds(session):
    res = run(session, "stage", "online", "--preset", "smoke-online")
    assert "online cell grpo seed 42: 2 rounds, 4 updates" in res.stdout and len(mlflow_links(res)) == 1, res.stdout
    for stage in ("online_pool", "online_train"):
        res = run(session, "stage", stage, "--preset", "smoke-online", *sets("online.round=1"))
        assert f"{stage}: cache hit" in res.stdout, res.stdout
    res = run(session, "stage", "online_policy", "--preset", "smoke-online", *sets("eval.update=4"))
    assert "online_policy: cache hit" in res.stdout, res.stdout


# --------------------------------------------------------------------------- flows

def test_run_offline(session):
    res = run(session, "run", "offline", "--preset", "smoke")
    assert "MLflow parent run: http" in res.stdout, res.stdout[-3000:]


def test_run_offline_as_the_deployment(session):
    res = run(session, "run", "offline", "--preset", "smoke", "--deployment")
    assert "/runs/flow-run/" in res.stdout, res.stdout[-3000:]


def test_prefect_deployment_run(session):
    env = session["env"] | {"PREFECT_API_URL": session["urls"]["prefect_api"]}
    res = run({**session, "env": env}, "deployment", "run", "ggpo/offline", "-p", "preset=smoke", "--watch",
              "--watch-timeout", "600", program="prefect")
    assert "Completed" in res.stdout, res.stdout[-3000:]


def test_run_online_with_a_cell_that_stops(session):
    res = run(session, "run", "online", "--preset", "smoke-online", *sets(*STALL))
    assert STOPPED.search(res.stdout), res.stdout[-3000:]


# --------------------------------------------------------------------------- reports and the cache

def test_reports(session):
    offline = run(session, "report", "--preset", "smoke").stdout
    assert "| grpo |" in offline and "| ggpo |" in offline, offline
    online = run(session, "report", "--preset", "smoke-online", *sets(*STALL)).stdout
    assert STOPPED.search(online), online
    session["reports"] = (table_lines(offline), table_lines(online))


def table_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("|")]


def test_cache_verify_and_gc_keep_every_result(session):
    """`cache gc --unreferenced --yes` removes what leads to no result, never a result: the
    reports print the same tables afterwards (the stopped cell's policy and evaluation too)."""
    assert "all intact" in run(session, "cache", "verify").stdout
    run(session, "cache", "gc")
    res = run(session, "cache", "gc", "--unreferenced", "--yes")
    removed = [line.split()[1] for line in res.stdout.splitlines() if line.startswith("removing ")]
    # the imported and scored pool led to nothing trained: removed; no result is
    assert any(name.startswith("score-") for name in removed), res.stdout
    assert not [n for n in removed if n.startswith(("train-", "evaluate-", "online_policy-"))], res.stdout
    offline = run(session, "report", "--preset", "smoke").stdout
    online = run(session, "report", "--preset", "smoke-online", *sets(*STALL)).stdout
    assert (table_lines(offline), table_lines(online)) == session["reports"]
    assert "all intact" in run(session, "cache", "verify").stdout


def test_down(session):
    assert "ggpo services stopped" in run(session, "down").stdout
    res = subprocess.run([str(BIN / "ggpo"), "status"], cwd=REPO, env=session["env"], capture_output=True, text=True)
    assert res.returncode == 1 and "down" in res.stdout
