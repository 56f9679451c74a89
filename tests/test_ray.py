"""Stages on Ray workers (pipeline/dag/placement.py): the offline flow on a local Ray cluster
started here (`ray start --head` on 127.0.0.1, free ports, 2 CPUs: two workers) builds the
same keys, byte-identical pools and identical weights as the threads runner, and logs the
same MLflow runs; bad Ray settings are one line before any work.

Slow (1.5-3 min on 2 cores): one Prefect server for both flows, Ray worker processes
start cold (torch, transformers, Prefect and MLflow imports). Marked `servers` and `ray`.
"""
from __future__ import annotations

import re
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import REPO, free_port

sys.path.insert(0, str(REPO / "benchmarks"))
from ray_overhead import digests, local_cluster, prefect_server, run_flow, seed_store  # noqa: E402

from pipeline.cli import main  # noqa: E402
from pipeline.core.config import load_config  # noqa: E402
from pipeline.core.store import Store  # noqa: E402

# one trained method and a short evaluation: every stage runs, in few tasks
FAST = ["experiment.methods=[ggpo]", "eval.limit=8"]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with prefect_server(tmp_path_factory.mktemp("prefect")) as url:
        yield url


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(num_cpus=2) as address:
        yield address


def mlflow_runs(home) -> list[str]:
    """The run names of a store's MLflow experiment, the parent run's start minute
    (" · 2026-12-04 13:21", tracking.run_title) cut: the two flows run at once and may start
    in different minutes."""
    from mlflow import MlflowClient

    from pipeline.services import tracking
    c = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    names = [r.info.run_name for r in c.search_runs([tracking.experiment_id(c)], max_results=1000)]
    return sorted(re.sub(r" · \d{4}-\d{2}-\d{2} \d{2}:\d{2}$", " · <minute>", n) for n in names)


@pytest.mark.servers
@pytest.mark.ray
def test_ray_flow_matches_threads(base_manifest, tmp_path, api, cluster):
    def run(runner: str) -> str:
        seed_store(tmp_path / runner / "cache", Store().folder("base", base_manifest.key))   # the session's base model
        return run_flow(runner, tmp_path / runner / "cache", tmp_path / runner / "home", api,
                        overrides=FAST, address=cluster if runner == "ray" else None)[1]
    with ThreadPoolExecutor(2) as pool:         # at once: Ray's workers start while threads compute
        out = dict(zip(("threads", "ray"), pool.map(run, ("threads", "ray"))))
    assert f"Connecting to an existing Ray instance at {cluster}" in out["ray"]
    assert "(run_stage_task pid=" in out["ray"]            # stage logs came back from Ray workers
    threads, ray = tmp_path / "threads" / "cache", tmp_path / "ray" / "cache"
    assert sorted(p.name for p in ray.iterdir()) == sorted(p.name for p in threads.iterdir())     # same keys
    d = digests(ray)
    assert len(d) == 3 and sum(k.startswith("train-") for k in d) == 1, d     # rollouts, train pool, weights
    assert d == digests(threads)
    assert mlflow_runs(tmp_path / "ray" / "home") == mlflow_runs(tmp_path / "threads" / "home")


@pytest.mark.servers
@pytest.mark.ray
def test_stage_failure_on_a_worker_is_one_line(tmp_path, api, cluster):
    """The stage's own error, raised in a Ray worker, is the CLI's line (not the flow's
    "upstream task did not complete")."""
    bad = tmp_path / "noanswer.jsonl"
    bad.write_text('{"problem": "1+1"}\n')
    with pytest.raises(RuntimeError) as failed:
        run_flow("ray", tmp_path / "cache", tmp_path / "home", api, overrides=[f"task.name={bad}"], address=cluster)
    lines = [line for line in str(failed.value).splitlines() if line.startswith("ggpo:")]
    assert len(lines) == 1 and lines[0].startswith(f"ggpo: {bad}: missing required column 'answer'"), lines
    assert "exit 2" in str(failed.value) and "Traceback" not in str(failed.value)


@pytest.mark.servers
def test_unreachable_ray_address_fails_before_any_work(tmp_path, api):
    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(RuntimeError) as failed:
        run_flow("ray", tmp_path / "cache", tmp_path / "home", api, address=dead, timeout=300)
    lines = [line for line in str(failed.value).splitlines() if line.startswith("ggpo:")]
    assert lines == [f"ggpo: experiment.ray_address={dead}: no Ray cluster answers at {dead} (Connection refused); "
                     f"start one (ray start --head --port={dead.split(':')[1]}) or point experiment.ray_address "
                     "at a running head node"]
    assert "exit 2" in str(failed.value) and "Traceback" not in str(failed.value)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())   # no artifact
    assert not (tmp_path / "home" / "mlflow.db").exists()                                  # no MLflow run


def test_ray_stage_settings_at_the_cli(tmp_path, monkeypatch, capsys):
    """`ggpo stage` preflights the same settings: RAY_ADDRESS names itself, and a missing
    ray install names the pip extra."""
    monkeypatch.setenv("GGPO_CACHE", str(tmp_path / "cache"))
    dead = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("RAY_ADDRESS", dead)
    argv = ["stage", "base", "--preset", "smoke", "--no-track", "--set", "experiment.task_runner=ray"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"ggpo: RAY_ADDRESS={dead}: no Ray cluster answers"), err
    monkeypatch.setitem(sys.modules, "ray", None)          # import ray -> ImportError, as without the package
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ggpo: experiment.task_runner=ray needs ray and prefect-ray, which are not installed "
                   "(ray is missing): pip install -e '.[ray]'"]
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())    # no artifact


def test_stage_resources():
    from pipeline.dag.placement import stage_resources
    cpu = load_config("smoke", {"train.device": "cpu", "verify.workers": 3})
    assert [stage_resources(s, cpu) for s in ("rollout", "verify", "filter", "train", "evaluate")] == [
        {"num_cpus": 1}, {"num_cpus": 3}, {"num_cpus": 1}, {"num_cpus": 1}, {"num_cpus": 1}]
    cuda = load_config("smoke", {"train.device": "cuda"})
    assert stage_resources("train", cuda) == stage_resources("evaluate", cuda) == {"num_gpus": 1, "num_cpus": 1}
    assert stage_resources("verify", cuda) == {"num_cpus": 1}
    vllm = load_config("smoke", {"rollout.engine": "vllm", "rollout.data_parallel": 2,
                                 "rollout.tensor_parallel_size": 2, "train.device": "cuda"})
    assert stage_resources("rollout", vllm) == {"num_gpus": 4, "num_cpus": 1}
