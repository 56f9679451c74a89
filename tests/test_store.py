"""The content-addressed store: hit, miss, force, incomplete folders, key chaining."""
from pathlib import Path

import pytest

from pipeline.core.config import load_config
from pipeline.core.store import MANIFEST
from pipeline.dag import graph
from pipeline.dag.spec import Built, StageSpec, run_stage


def counting_spec(calls: list, fail: bool = False) -> StageSpec:
    def build(cfg, inputs, folder: Path) -> Built:
        calls.append(folder)
        (folder / "out.txt").write_text(f"lr={cfg.train.lr}")
        if fail:
            raise RuntimeError("crash mid-write")
        return Built(files={"out": ("out.txt", 1)}, summary={"lr": cfg.train.lr})
    return StageSpec(name="toy", version=1, reads=("train.lr",), build=build)


def test_miss_then_hit_then_force(store):
    calls, cfg = [], load_config("smoke")
    first = run_stage(counting_spec(calls), cfg, {}, store)
    assert not first.cache_hit and len(calls) == 1
    again = run_stage(counting_spec(calls), cfg, {}, store)
    assert again.cache_hit and len(calls) == 1 and again.key == first.key
    forced = run_stage(counting_spec(calls), cfg, {}, store, force=True)
    assert not forced.cache_hit and len(calls) == 2
    assert forced.files["out"].sha256 == first.files["out"].sha256


def test_key_depends_on_read_fields_only(store):
    calls = []
    a = run_stage(counting_spec(calls), load_config("smoke"), {}, store)
    b = run_stage(counting_spec(calls), load_config("smoke", ["train.lr=3e-5"]), {}, store)
    c = run_stage(counting_spec(calls), load_config("smoke", ["rollout.temperature=0.5"]), {}, store)
    assert a.key != b.key and c.key == a.key and c.cache_hit


def test_incomplete_folder_is_never_read_and_is_rebuilt(store):
    calls, cfg = [], load_config("smoke")
    with pytest.raises(RuntimeError, match="crash"):
        run_stage(counting_spec(calls, fail=True), cfg, {}, store)
    folder = calls[0]
    assert (folder / "out.txt").exists() and not (folder / MANIFEST).exists()
    assert store.load("toy", folder.name) is None
    rebuilt = run_stage(counting_spec(calls), cfg, {}, store)
    assert not rebuilt.cache_hit and len(calls) == 2 and (folder / MANIFEST).exists()


def test_retraining_config_keeps_pool_key():
    a, b = load_config("tiny"), load_config("tiny", ["train.lr=3e-5"])
    for stage in ("base", "rollout", "verify", "filter"):
        assert graph.expected_key(stage, a) == graph.expected_key(stage, b)
    assert graph.expected_key("train", a) != graph.expected_key("train", b)
    assert graph.expected_key("evaluate", a) != graph.expected_key("evaluate", b)
    # a new seed is a new pool, but the same base model
    c = load_config("tiny", ["seed=1234"])
    assert graph.expected_key("base", a) == graph.expected_key("base", c)
    assert graph.expected_key("rollout", a) != graph.expected_key("rollout", c)


def test_missing_input_names_stage_and_command(store):
    with pytest.raises(graph.MissingInput, match=r"(?s)input 'pool' from stage 'filter'.*`ggpo stage filter --preset smoke"):
        graph.cached_inputs("train", load_config("smoke"), store, "smoke")
