"""Progress of long work: periodic log lines off a terminal, nothing when disabled, the
engine's callback, and Prefect progress / report artifacts inside a real (temporary)
Prefect server."""
from __future__ import annotations

import logging
import re

import pytest

from pipeline.models.engines import SamplingParams
from pipeline.services import progress
from pipeline.services.progress import Progress


@pytest.fixture
def lines(monkeypatch, caplog):
    """Log-line mode with a 50 ms period; returns the captured ggpo INFO messages."""
    monkeypatch.setenv("GGPO_PROGRESS", "lines")
    monkeypatch.setenv("GGPO_PROGRESS_SECONDS", "0.05")
    caplog.set_level(logging.INFO, logger="ggpo")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "ggpo"]


def test_lines_show_count_rate_eta_and_postfix_then_a_final_line(lines, monkeypatch):
    """An update every 20 ms of a clock the test drives (the machine's speed plays no part):
    a line every 50 ms period, the rate 50 updates/s."""
    now = [1000.0]
    monkeypatch.setattr(progress, "clock", lambda: now[0])
    with Progress("train grpo seed 42", total=10, unit="update", start=2) as bar:
        for _ in range(8):
            now[0] += 0.02
            bar.update(1, loss=0.125, reward=0.5)
    got = lines()
    periodic, final = got[:-1], got[-1]
    assert len(periodic) == 2, got        # throttled: at 60 and 120 ms, not one line per update
    m = re.fullmatch(r"train grpo seed 42: (\d+)/10 updates \((\d+)%\), ([\d.]+) update/s, ETA (\d+)s, "
                     r"loss=0\.125 reward=0\.5", periodic[0])
    assert m, periodic[0]
    n = int(m[1])
    assert n == 5 and int(m[2]) == 50
    assert float(m[3]) == 50.0               # 1 update per 20 ms; the resumed 2 are not in the rate
    assert re.fullmatch(r"train grpo seed 42: 10/10 updates \(100%\), in 0s, [\d.]+ update/s, "
                        r"loss=0\.125 reward=0\.5", final), final


def test_open_ended_count_and_a_failed_run_say_so(lines):
    with pytest.raises(RuntimeError):
        with Progress("grading", unit="response") as bar:
            bar.update(300)
            raise RuntimeError("boom")
    assert re.fullmatch(r"grading: stopped at 300 responses, in 0s, \d+ response/s", lines()[-1]), lines()


def test_disabled_prints_nothing(monkeypatch, caplog, capsys):
    monkeypatch.setenv("GGPO_PROGRESS", "0")
    monkeypatch.setenv("GGPO_PROGRESS_SECONDS", "0")
    caplog.set_level(logging.DEBUG)
    with Progress("rollout seed 1", total=3, unit="prompt") as bar:
        for _ in range(3):
            bar.update(1, resp_s=1.0)
    out = capsys.readouterr()
    assert caplog.records == [] and out.out == "" and out.err == ""


def test_bar_mode_draws_a_tqdm_bar_with_postfix(monkeypatch, capsys):
    monkeypatch.setenv("GGPO_PROGRESS", "bar")
    with Progress("rollout seed 1", total=4, unit="prompt") as bar:
        for _ in range(4):
            bar.update(1, resp_s=12.5)
    err = capsys.readouterr().err
    assert "rollout seed 1: 100%" in err and "4/4" in err and "resp_s=12.5" in err, err


def test_artifact_keys_are_prefect_safe():
    assert progress.artifact_key("Evaluate grpo seed 1 update 8: generate") == "evaluate-grpo-seed-1-update-8-generate"
    assert progress.artifact_key("ggpo /tmp/My_Preset.yaml") == "ggpo-tmp-my-preset-yaml"


def test_engine_reports_each_batch_and_samples_the_same(lines, tmp_path):
    """The callback counts prompts per internal batch and leaves the random stream alone
    (an untrained tiny model: sampling is all that matters here)."""
    from pipeline.core.config import ModelConfig
    from pipeline.models import tiny_model
    from pipeline.models.engines.hf import TransformersEngine
    tok = tiny_model.build_tokenizer()
    tiny_model.save(tiny_model.build_model(ModelConfig(), len(tok)), tok, tmp_path)
    engine = TransformersEngine(str(tmp_path), batch_prompts=2)
    prompts, params = ["Q:12+3\nA:"] * 5, SamplingParams(2, 1.0, 1.0, 8, 7)
    plain = engine.generate(prompts, params)
    seen = []
    assert engine.generate(prompts, params, progress=seen.append) == plain
    assert seen == [2, 2, 1]
    with Progress("rollout seed 7", total=5, unit="prompt") as bar:
        assert progress.generate(engine, prompts, params, bar) == plain
    assert re.fullmatch(r"rollout seed 7: 5/5 prompts \(100%\), in \d+s, [\d.]+ prompt/s, resp_s=[\d.]+",
                        lines()[-1]), lines()


@pytest.mark.servers
def test_prefect_run_gets_progress_and_report_artifacts(monkeypatch):
    """One temporary Prefect server (its start is most of this test's 10-30 s): a stage's
    progress artifact ends at 100 %, and the flow's report tables are artifacts of the run."""
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.testing.utilities import prefect_test_harness

    from flows.common import publish_report
    monkeypatch.setenv("GGPO_PROGRESS", "lines")
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")     # no telemetry writes racing the test

    @task
    def stage():
        monkeypatch.setenv("GGPO_PROGRESS_SECONDS", "0")        # outlasts its period: an artifact
        with Progress("Rollout seed 3", total=4, unit="prompt") as bar:
            for _ in range(4):
                bar.update(1)
        monkeypatch.setenv("GGPO_PROGRESS_SECONDS", "3600")     # ends within its period: none
        with Progress("Verify seed 3", total=4, unit="response") as bar:
            bar.update(4)

    @flow
    def pipeline():
        stage()
        publish_report({"table": "| method | acc |\n|---|---|\n| grpo | 50.00 |\n", "summary": {"final/grpo": 0.5}},
                       [{"method": "grpo", "seed": 3, "update": 4, "accuracy": 0.5}], "smoke")

    with prefect_test_harness(server_startup_timeout=120):
        pipeline()
        with get_client(sync_client=True) as client:
            def latest(key):
                found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
                assert found, f"no artifact {key}"
                return found[0]
            bar = latest("rollout-seed-3")
            assert bar.type == "progress" and bar.data == 100.0 and bar.task_run_id is not None
            assert "4/4 prompts" in bar.description
            assert not client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["verify-seed-3"])))
            assert latest("ggpo-smoke-report").type == "markdown"
            evals = latest("ggpo-smoke-evaluations")
            assert evals.type == "table" and "grpo" in str(evals.data)
            assert latest("ggpo-smoke-summary").type == "table"
