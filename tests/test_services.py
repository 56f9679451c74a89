"""Real servers: `ggpo up` on free ports, the deployment ggpo/offline run through the
Prefect server, and what the MLflow REST API then shows."""
import json
import os
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest

from conftest import BIN, REPO, assert_interrupted_cleanly, free_port, interrupt_offline_run

pytestmark = pytest.mark.servers


def sh(argv, env=None, timeout=900):
    return subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=os.environ | (env or {}), timeout=timeout)


def api(base, path, body=None):
    req = urllib.request.Request(f"{base}{path}", method="POST" if body is not None else "GET",
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def services(base_manifest):
    res = sh([str(BIN / "ggpo"), "up"])
    assert res.returncode == 0, res.stdout + res.stderr
    state = json.loads((Path(os.environ["GGPO_HOME"]) / "services.json").read_text())
    yield state
    sh([str(BIN / "ggpo"), "down"])


def run_deployment(state):
    return sh([str(BIN / "prefect"), "deployment", "run", "ggpo/offline", "-p", "preset=smoke",
               "--watch", "--watch-timeout", "600"], env={"PREFECT_API_URL": state["urls"]["prefect_api"]})


def runs_of(mlflow, exp_id, filter_string=""):
    return api(mlflow, "/api/2.0/mlflow/runs/search",
               {"experiment_ids": [exp_id], "filter": filter_string, "max_results": 200}).get("runs", [])


def tag(run, key):
    return {t["key"]: t["value"] for t in run["data"].get("tags", [])}.get(key)


def test_deployment_runs_and_mlflow_shows_everything(services):
    res = run_deployment(services)
    assert res.returncode == 0 and "Completed" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
    mlflow = services["urls"]["mlflow"]
    exp_id = api(mlflow, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=ggpo-offline")["experiment"]["experiment_id"]
    parents = runs_of(mlflow, exp_id, "tags.`ggpo.preset` = 'smoke'")
    assert len(parents) == 1 and parents[0]["info"]["status"] == "FINISHED"
    parent = parents[0]
    parent_metrics = {m["key"] for m in parent["data"]["metrics"]}
    assert {"base_mean_at_4", "final_mean_at_4/grpo", "final_mean_at_4/ggpo"} <= parent_metrics
    children = runs_of(mlflow, exp_id, f"tags.mlflow.parentRunId = '{parent['info']['run_id']}'")
    names = sorted(r["info"]["run_name"] for r in children)
    assert names == sorted(["base", "rollout-seed42", "verify-seed42", "filter-seed42", "evaluate-base-seed42",
                            "train-grpo-seed42", "evaluate-grpo-seed42-u4", "train-ggpo-seed42", "evaluate-ggpo-seed42-u4"])
    by_name = {r["info"]["run_name"]: r for r in children}
    for method in ("grpo", "ggpo"):
        run = by_name[f"train-{method}-seed42"]
        for metric in ("train/loss", "train/grad_norm", "train/k3_mismatch", "train/abs_log_ratio"):
            history = api(mlflow, f"/api/2.0/mlflow/metrics/get-history?run_id={run['info']['run_id']}&metric_key={metric}")
            assert sorted(m["step"] for m in history["metrics"]) == [1, 2, 3, 4], (method, metric)
    # both methods saw the same groups in the same order
    assert tag(by_name["train-grpo-seed42"], "ggpo.group_order_sha256") == tag(by_name["train-ggpo-seed42"], "ggpo.group_order_sha256")
    for run_name, expected in [("filter-seed42", "train_pool.parquet"), ("rollout-seed42", "rollouts.parquet"),
                               ("verify-seed42", "rewards.parquet"), ("train-grpo-seed42", "metrics.parquet")]:
        files = api(mlflow, f"/api/2.0/mlflow/artifacts/list?run_id={by_name[run_name]['info']['run_id']}")["files"]
        assert {expected, "manifest.json"} <= {f["path"] for f in files}, (run_name, files)
    inputs = by_name["filter-seed42"].get("inputs", {}).get("dataset_inputs", [])
    assert inputs and inputs[0]["dataset"]["name"].startswith("train_pool-")
    report = api(mlflow, f"/api/2.0/mlflow/artifacts/list?run_id={parent['info']['run_id']}&path=report")["files"]
    assert {"report/report.md", "report/report.csv", "report/curves.png", "report/benchmarks.md",
            "report/benchmarks.csv", "report/pass_at_k.md", "report/pass_at_k.csv", "report/pass_at_k.png"} \
        <= {f["path"] for f in report}


def test_second_deployment_run_is_all_cache_hits(services):
    # runs after the test above (same module, file order): everything is cached now
    res = run_deployment(services)
    assert res.returncode == 0, res.stdout[-3000:]
    mlflow = services["urls"]["mlflow"]
    exp_id = api(mlflow, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=ggpo-offline")["experiment"]["experiment_id"]
    newest = runs_of(mlflow, exp_id, "tags.`ggpo.preset` = 'smoke'")[0]
    children = runs_of(mlflow, exp_id, f"tags.mlflow.parentRunId = '{newest['info']['run_id']}'")
    assert len(children) == 9 and all(tag(r, "ggpo.cache_hit") == "true" for r in children)


def run_online(state):
    return sh([str(BIN / "prefect"), "deployment", "run", "ggpo/online", "-p", "preset=smoke-online",
               "--watch", "--watch-timeout", "600"], env={"PREFECT_API_URL": state["urls"]["prefect_api"]})


def history(mlflow, run, metric):
    got = api(mlflow, f"/api/2.0/mlflow/metrics/get-history?run_id={run['info']['run_id']}&metric_key={metric}")
    return sorted((m["step"], m["value"]) for m in got.get("metrics", []))


def test_online_deployment_runs_then_is_all_cache_hits(services):
    """ggpo/online (Algorithm 1) through the Prefect server; a second run builds nothing."""
    for attempt in (1, 2):
        res = run_online(services)
        assert res.returncode == 0 and "Completed" in res.stdout, (attempt, res.stdout[-3000:] + res.stderr[-3000:])
    mlflow = services["urls"]["mlflow"]
    exp_id = api(mlflow, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=ggpo-online")["experiment"]["experiment_id"]
    parents = runs_of(mlflow, exp_id, "tags.`ggpo.preset` = 'smoke-online'")
    assert all(p["info"]["run_name"].startswith("online smoke-online · ") and tag(p, "ggpo.methods") == "grpo,ggpo"
               and tag(p, "ggpo.seeds") == "42" and len(tag(p, "ggpo.git_commit")) >= 40 for p in parents)
    assert len(parents) == 2 and all(p["info"]["status"] == "FINISHED" for p in parents)
    for parent, hit in ((parents[1], 0.0), (parents[0], 1.0)):       # newest first
        children = runs_of(mlflow, exp_id, f"tags.mlflow.parentRunId = '{parent['info']['run_id']}'")
        cells = {r["info"]["run_name"]: r for r in children if tag(r, "ggpo.stage") == "online"}
        assert sorted(cells) == ["ggpo N=2 seed=42", "grpo N=2 seed=42"]
        for run in cells.values():
            assert [v for _, v in history(mlflow, run, "round/cache_hit_train")] == [hit, hit]     # 2 rounds of N = 2
            spent = history(mlflow, run, "train/responses_generated")
            assert [s for s, _ in spent] == [1, 2, 3, 4] and spent[0][1] > 0 and spent[2][1] > spent[1][1]
            assert [s for s, _ in history(mlflow, run, "eval/mean_at_4")] == [0, 3, 4]
        evals = [r for r in children if tag(r, "ggpo.stage") == "evaluate"]
        assert evals and all(tag(r, "ggpo.cache_hit") == ("true" if hit else "false") or r["info"]["run_name"]
                             .startswith("evaluate-base") for r in evals)
    report = api(mlflow, f"/api/2.0/mlflow/artifacts/list?run_id={parents[0]['info']['run_id']}&path=report")["files"]
    assert {"report/report.md", "report/final.csv", "report/figure1.png", "report/figure2.png",
            "report/diagnostics.csv"} <= {f["path"] for f in report}


def test_parallel_training_in_the_flow_equals_a_sequential_build(services, tmp_path, base_manifest, pool):
    """The flow trained grpo and ggpo concurrently (threads); one at a time gives the same bytes."""
    from pipeline.core.config import load_config
    from pipeline.core.store import Store
    from pipeline.dag import graph
    from stages import train
    for method in ("grpo", "ggpo"):
        cfg = load_config("smoke", {"train.method": method})
        in_flow = Store().load("train", graph.expected_key("train", cfg))
        alone = train.run(cfg, {"base": base_manifest, "pool": pool[2]}, store=Store(tmp_path / method))
        assert in_flow is not None and in_flow.files["weights"].sha256 == alone.files["weights"].sha256


def test_up_is_idempotent_and_status_healthy(services):
    res = sh([str(BIN / "ggpo"), "up"])
    assert res.returncode == 0 and "already up" in res.stdout
    status = sh([str(BIN / "ggpo"), "status"])
    assert status.returncode == 0 and status.stdout.count("healthy") == 3


def test_up_refuses_a_taken_port_and_starts_nothing(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        home = tmp_path / "home"
        res = sh([str(BIN / "ggpo"), "up", "--prefect-port", str(free_port()), "--mlflow-port", str(port)],
                 env={"GGPO_HOME": str(home)})
    assert res.returncode == 2
    assert f"port {port}" in res.stderr and "taken" in res.stderr and "Nothing was started" in res.stderr
    assert not (home / "services.json").exists() and not (home / "logs").exists()


def latest_flow_run(state) -> dict:
    return api(state["urls"]["prefect_api"], "/flow_runs/filter", {"sort": "START_TIME_DESC", "limit": 1})[0]


def test_sigint_with_servers_up_cancels_the_flow_run(services):
    """`ggpo run` on ggpo's Prefect server: Ctrl-C ends the flow run Cancelled there."""
    env = os.environ | {"PREFECT_API_URL": services["urls"]["prefect_api"]}
    proc, err, state, rerun = interrupt_offline_run(env, seed=2, extra=["train.lr=3e-5"])
    assert_interrupted_cleanly(proc, err, state, rerun)
    assert latest_flow_run(services)["state_type"] == "COMPLETED"          # the rerun
    runs = api(services["urls"]["prefect_api"], "/flow_runs/filter", {"sort": "START_TIME_DESC", "limit": 2})
    assert runs[1]["state_type"] == "CANCELLED" and "interrupted (train grpo" in runs[1]["state"]["message"]


def test_ctrl_c_on_the_deployment_cancels_its_work(services):
    """`ggpo run offline --deployment` (what make demo runs): its logs stream here; Ctrl-C
    cancels the Prefect run, the serve process's run stops at its safe points, checkpoints
    and ends Cancelled; the next run resumes from the checkpoint."""
    proc, err, state, rerun = interrupt_offline_run(os.environ, seed=3, extra=["train.lr=4e-5"], deployment=True)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("ggpo: interrupted (train grpo seed 42 at update "), err[-3000:]
    assert state is not None and 1 <= state["update"] < 60
    assert rerun.returncode == 0 and f"resuming after update {state['update']}" in rerun.stdout, rerun.stdout[-3000:]
    runs = api(services["urls"]["prefect_api"], "/flow_runs/filter", {"sort": "START_TIME_DESC", "limit": 2})
    assert [r["state_type"] for r in runs] == ["COMPLETED", "CANCELLED"]


def test_a_new_shell_finds_the_ports_ggpo_up_chose(services):
    """No GGPO_*_PORT, PREFECT_API_URL or MLFLOW_TRACKING_URI: every ggpo command still uses
    the servers `ggpo up` started on its (free, non-default) ports, and `ggpo env` prints the
    exact lines that point the prefect CLI there."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("GGPO_PREFECT_PORT", "GGPO_MLFLOW_PORT", "PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    res = subprocess.run([str(BIN / "ggpo"), "env"], capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert res.returncode == 0
    assert f"export PREFECT_API_URL={services['urls']['prefect_api']}" in res.stdout.splitlines()
    probe = subprocess.run([str(BIN / "python"), "-c", "from pipeline.core import paths; from pipeline.services import tracking; "
                            "print(paths.prefect_port(), tracking.tracking_uri())"],
                           capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert probe.stdout.split() == [str(services["ports"]["prefect"]), services["urls"]["mlflow"]], probe.stderr


def test_a_server_that_is_not_ggpos_gets_nothing_and_is_named(tmp_path):
    """Something else answers /health on ggpo's MLflow port: tracking goes to the local file,
    and one note says why."""
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"OK")

        def log_message(self, *args):
            pass
    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
        env |= {"GGPO_HOME": str(tmp_path / "home"), "GGPO_MLFLOW_PORT": str(server.server_port)}
        res = subprocess.run([str(BIN / "python"), "-c", "from pipeline.services import tracking; print(tracking.tracking_uri())"],
                             capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    finally:
        server.shutdown()
    assert res.stdout.strip() == f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}"
    assert (f"something answers at http://127.0.0.1:{server.server_port}, but it is not the MLflow server "
            "`ggpo up` started") in res.stderr
