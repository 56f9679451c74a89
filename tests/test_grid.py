"""Experiments as a grid (pipeline/core/grid.py) and the offline flow's loop over its cells.

The flow's submission logic (flows/offline.py `Runner`, `submit_seed`, `collect`) is tested
without Prefect: a Runner subclass records each stage it is asked to submit, or builds it
at once with the real stages (`graph.run`), so no temporary Prefect server is started here
(the suite already has one slow flow test through Prefect, tests/test_quiet_run.py).
"""
import polars as pl
import pytest

from flows.offline import Runner, collect, submit_seed
from pipeline.core import grid
from pipeline.core.config import ConfigError, load_config
from pipeline.core.store import Store
from pipeline.dag import graph
from pipeline.reports import offline

CLIP = {"ggpo_clip": {"train.method": "ggpo", "train.ggpo_clip_delta": 0.05}}


def smoke(**experiment):
    return load_config("smoke", {f"experiment.{k}": v for k, v in experiment.items()})


def test_cells_are_the_product_in_order_with_labels():
    cfg = smoke(methods=["grpo_tis", "ggpo"], seeds=[1, 2], grid={"train.t_ref": ["fixed", 8], "train.lr": [1e-5, 1e-4]})
    cells = grid.cells(cfg)
    assert len(cells) == 2 * 2 * 2 * 2
    assert [c.seed for c in cells] == [1] * 8 + [2] * 8          # seed outermost
    assert [c.label for c in cells[:4]] == ["grpo_tis t_ref=fixed lr=1e-5", "grpo_tis t_ref=fixed lr=1e-4",
                                            "grpo_tis t_ref=8 lr=1e-5", "grpo_tis t_ref=8 lr=1e-4"]
    assert [c.label for c in cells[8:]] == [c.label for c in cells[:8]]
    last = cells[-1]
    assert (last.method, last.config.train.method, last.config.train.t_ref, last.config.train.lr, last.config.seed) \
        == ("ggpo", "ggpo", 8, 1e-4, 2)
    assert last.slug == "ggpo-t_ref:8-lr:1e-4"
    assert grid.columns(last, cfg) == {"cell": "ggpo t_ref=8 lr=1e-4", "train.t_ref": "8", "train.lr": 1e-4}


def test_default_cells_are_the_configs_the_comparison_always_trained():
    cfg = load_config("smoke")
    cells = grid.cells(cfg)
    assert [c.label for c in cells] == ["grpo", "ggpo"] and grid.columns(cells[0], cfg) == {}
    for cell, method in zip(cells, ["grpo", "ggpo"]):
        assert cell.config == cfg.updated({"seed": 42}).updated({"train.method": method})


def test_variant_is_a_method_entry_with_its_overrides():
    with pytest.raises(ConfigError, match="ggpo_clip_delta applies to method 'ggpo' only"):
        load_config("smoke", ["train.ggpo_clip_delta=0.05", "experiment.methods=[ggpo]"])   # why variants exist
    cfg = smoke(methods=["grpo_tis", "ggpo", "ggpo_clip"], variants=CLIP)
    by = {c.label: c for c in grid.cells(cfg)}
    assert list(by) == ["grpo_tis", "ggpo", "ggpo_clip"]
    assert (by["ggpo_clip"].method, by["ggpo_clip"].config.train.method) == ("ggpo_clip", "ggpo")
    assert by["ggpo_clip"].config.train.ggpo_clip_delta == 0.05 and by["ggpo"].config.train.ggpo_clip_delta is None
    assert by["ggpo_clip"].overrides == {"train.method": "ggpo", "train.ggpo_clip_delta": 0.05, "seed": 42}


def test_invalid_cell_is_named_before_any_work():
    cfg = smoke(methods=["grpo", "ggpo"], grid={"train.ggpo_clip_delta": [0.05]})      # valid for ggpo only
    with pytest.raises(ConfigError, match=r"experiment cell 'grpo ggpo_clip_delta=0.05' is not a valid config"):
        grid.cells(cfg)
    with pytest.raises(ConfigError, match=r"(?s)cell 'grpo nope=1'.*train.nope: Extra inputs are not permitted"):
        grid.cells(smoke(grid={"train.nope": [1]}))
    for bad, message in [({"methods": ["ggpo_clip"]}, "unknown \\['ggpo_clip'\\]"),
                         ({"variants": {"ggpo": {"train.lr": 1e-4}}}, "are method names"),
                         ({"grid": {"seed": [1, 2]}}, "'seed' is set by the flow"),
                         ({"grid": {"train.method": ["ggpo"]}}, "use experiment.seeds, experiment.methods"),
                         ({"grid": {"train.lr": []}}, "non-empty list of distinct values")]:
        with pytest.raises(ConfigError, match=message):
            smoke(**bad)


def test_train_grid_shares_the_pool_and_rollout_grid_does_not():
    def keys(stage, cfg):
        return [(c.seed, graph.expected_key(stage, c.config)) for c in grid.cells(cfg)]
    lr = smoke(seeds=[1, 2], methods=["grpo"], grid={"train.lr": [1e-5, 1e-4]})
    pools = keys("filter", lr)
    assert len(pools) == 4 and len(set(pools)) == 2 and pools[0][1] != pools[2][1]   # one per seed
    assert len(set(keys("train", lr))) == 4
    temp = smoke(seeds=[1], methods=["grpo"], grid={"rollout.temperature": [1.0, 0.7]})
    assert len(set(keys("filter", temp))) == 2


class Recorder(Runner):
    """Records (stage, name, key) instead of submitting to Prefect."""

    def __init__(self):
        super().__init__(set(), "no-parent")
        self.calls = []

    def submit(self, stage, cfg, inputs, name):
        self.calls.append((stage, name, graph.expected_key(stage, cfg)))
        return name


def submit_all(runner, cfg):
    """The flow's loop (flows/offline.py `ggpo`): the base model, then each seed's cells."""
    runner("base", cfg, {}, "base")
    cells = grid.cells(cfg)
    return [p for seed in cfg.experiment.seeds for p in submit_seed(runner, [c for c in cells if c.seed == seed])]


def test_default_flow_submits_todays_stages():
    cfg = smoke(seeds=[42, 7])
    rec = Recorder()
    pending = submit_all(rec, cfg)
    names = [n for _, n, _ in rec.calls]
    per_seed = ["rollout-seed{s}", "verify-seed{s}", "filter-seed{s}", "evaluate-base-seed{s}", "train-grpo-seed{s}",
                "evaluate-grpo-seed{s}-u4", "train-ggpo-seed{s}", "evaluate-ggpo-seed{s}-u4"]
    assert names == ["base"] + [n.format(s=s) for s in (42, 7) for n in per_seed]
    assert {(stage, key) for stage, _, key in rec.calls} == graph.experiment_keys(cfg)
    assert [(stub["method"], stub["kind"], future) for stub, future in pending[:3]] == [
        ("grpo", "train", "train-grpo-seed42"), ("grpo", "eval", "evaluate-base-seed42"),
        ("grpo", "eval", "evaluate-grpo-seed42-u4")]


def test_grid_flow_builds_each_pool_once_and_names_cells():
    cfg = smoke(methods=["grpo", "ggpo_clip"], variants=CLIP,
                grid={"rollout.temperature": [1.0, 0.7], "train.lr": [1e-5, 1e-4]})
    rec = Recorder()
    submit_all(rec, cfg)
    names = [n for _, n, _ in rec.calls]
    assert [n for n in names if n.startswith("filter")] == ["filter-seed42-temperature:1", "filter-seed42-temperature:0.7"]
    assert names.count("evaluate-base-seed42") == 1           # the base evaluation reads no swept field
    trains = [n for n in names if n.startswith("train")]
    assert trains[:2] == ["train-grpo-temperature:1-lr:1e-5-seed42", "train-grpo-temperature:1-lr:1e-4-seed42"]
    assert len(trains) == 8 and len(set(k for s, _, k in rec.calls if s == "train")) == 8


class Inline(Recorder):
    """Builds each stage at once with the real stage code, in the session's cache."""

    def submit(self, stage, cfg, inputs, name):
        super().submit(stage, cfg, inputs, name)
        manifest = graph.run(stage, cfg, {k: v.result() for k, v in inputs.items()}, Store())
        return type("Done", (), {"result": lambda self: manifest})()


def test_grid_run_shares_pool_and_group_order_and_reports_cells(base_manifest, tmp_path):
    """Real stages on the smoke preset: two methods (one a variant) x two learning rates
    on one pool; the report has one row per cell."""
    cfg = smoke(methods=["grpo", "ggpo_clip"], variants=CLIP, grid={"train.lr": [1e-5, 1e-4]})
    rec = Inline()
    pending = submit_all(rec, cfg)
    assert [s for s, _, _ in rec.calls].count("filter") == 1
    trained = [f.result() for stub, f in pending if stub["kind"] == "train"]
    assert len(trained) == 4 and len({t.key for t in trained}) == 4
    assert len({t.summary["group_order_sha256"] for t in trained}) == 1      # same seeded group order
    records, curves, finals = collect(pending, cfg)
    evals = pl.DataFrame(records)
    assert evals.columns == ["method", "seed", "update", "accuracy", "cell", "train.lr"]
    assert evals.filter(pl.col("update") == 4)["cell"].to_list() == [
        "grpo lr=1e-5", "grpo lr=1e-4", "ggpo_clip lr=1e-5", "ggpo_clip lr=1e-4"]
    paths = offline.write(evals, pl.concat(curves), tmp_path, "mean@4")
    md = paths["markdown"].read_text()
    assert "| cell | update 0 | update 4 |" in md and "| ggpo_clip lr=1e-4 |" in md
    summary = pl.read_csv(paths["csv"])
    assert summary.height == 8 and set(summary["train.lr"]) == {1e-5, 1e-4}
    assert {f["method"][0] for f in finals} == {"grpo lr=1e-5", "grpo lr=1e-4", "ggpo_clip lr=1e-5", "ggpo_clip lr=1e-4"}


@pytest.mark.parametrize("flow, sets, cells_per_seed", [
    ("online", ['experiment.grid={"train.updates_per_step": [1, 4, 16, 64]}'], 16),                 # the ladder
    ("online", ['experiment.methods=["agro","ggpo"]', 'experiment.grid={"train.t_ref": ["fixed", 10]}'], 4),  # ablation
    ("offline", ["experiment.flow=offline"], 4),                                                    # the comparison
])
def test_the_testbeds_commands_run_the_papers_three_seeds_in_one_command(flow, sets, cells_per_seed):
    """README's testbed commands with --set 'experiment.seeds=[42,1234,2027]': every cell once
    per seed (seed outermost), each seed's cells the one-seed command's, and the report's
    tables group the seeds of a cell (same label) into mean ± std."""
    from pipeline.core.config import parse_overrides
    from pipeline.dag.preflight import flow_overrides
    one = grid.cells(load_config("tiny-regime", flow_overrides(parse_overrides(sets + ["experiment.seeds=[42]"]))))
    three = grid.cells(load_config("tiny-regime", flow_overrides(parse_overrides(sets + ["experiment.seeds=[42,1234,2027]"]))))
    assert len(one) == cells_per_seed and len(three) == 3 * cells_per_seed
    assert [c.seed for c in three] == [42] * cells_per_seed + [1234] * cells_per_seed + [2027] * cells_per_seed
    assert [c.label for c in three] == [c.label for c in one] * 3
    # what each cell trains (its config but the experiment section): the one-seed cell's
    assert [c.config.model_dump(exclude={"experiment"}) for c in three[:cells_per_seed]] \
        == [c.config.model_dump(exclude={"experiment"}) for c in one]
    assert {c.config.seed for c in three} == {42, 1234, 2027}


def test_all_is_every_registered_method_and_refused_where_ambiguous():
    """experiment.methods=["all"]: every method of the table in its order (the built-in
    twenty here; a plugin's too, tests/test_methods.py), variants named beside it after;
    a method named beside it, or "all" twice, is one config error."""
    from pipeline.core import methods
    cfg = smoke(methods=["all"])
    assert cfg.experiment.methods == list(methods.names()) and len(methods.names()) >= 20
    assert [c.method for c in grid.cells(cfg)] == list(methods.names())
    with_variant = smoke(methods=["all", "ggpo_clip"], variants=CLIP)
    assert with_variant.experiment.methods == list(methods.names()) + ["ggpo_clip"]
    assert with_variant.updated({"seed": 7}).experiment.methods == with_variant.experiment.methods   # stays expanded
    with pytest.raises(ConfigError, match=r"experiment.methods: \['grpo'\] named beside 'all'"):
        smoke(methods=["all", "grpo"])
    with pytest.raises(ConfigError, match="experiment.methods: 'all' given 2 times"):
        smoke(methods=["all", "all"])
    with pytest.raises(ConfigError, match="experiment.methods: 'all' is also the name of a variant"):
        smoke(methods=["all"], variants={"all": {"train.method": "ggpo"}})
