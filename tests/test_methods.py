"""One record per method (pipeline/core/methods.py): the table and the losses agree, config reads
it, and a method added from outside (one loss function, one entry, GGPO_PLUGINS) trains
through `ggpo stage train`."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import polars as pl
import pytest

from pipeline.core import methods
from pipeline.core.config import load_config
from pipeline.core.errors import ConfigError
from pipeline.core.store import Store
from pipeline.dag import graph
from pipeline.training import corrections
from pipeline.training.losses import LOSSES, get_loss

from conftest import BIN, REPO


def test_losses_are_keyed_as_the_method_table():
    assert tuple(LOSSES) == methods.BUILT_IN[:len(LOSSES)]
    for name in methods.BUILT_IN:
        module, _, fn = methods.METHODS[name].loss.partition(":")
        if name in LOSSES:
            assert module == "pipeline.training.losses" and LOSSES[name].__name__ == fn and get_loss(name) is LOSSES[name]
        else:        # the off-policy corrections: one module beside losses.py, `<name>_loss` each
            assert module == "pipeline.training.corrections" and fn == f"{name}_loss"
            assert get_loss(name) is getattr(corrections, fn)


# what each method needed before the table, as config hard-coded it (the table must keep it):
# (overrides, default t_ref, step anchor, behavior log-probs, beta > 0 required)
FACTS = [
    (["train.method=grpo"], None, False, True, False),
    (["train.method=grpo", "train.anchor=old"], None, True, False, False),
    (["train.method=grpo_tis"], None, True, True, False),
    (["train.method=agro"], 160, False, False, True),
    (["train.method=ggpo"], 160, False, False, True),
    (["train.method=ggpo", "train.ggpo_clip_delta=0.05"], 160, True, False, True),
    # the off-policy corrections: each reads what its source's default anchor is
    *[([f"train.method={name}"], None, old, beh, False) for name, old, beh in (
        ("tis_seq", True, True), ("icepop", True, True), ("geo_mask", True, True), ("opsm", True, True),
        ("cispo", True, False), ("gspo", True, False), ("m2po", True, True), ("dppo_tv", False, True),
        ("decoupled_ppo", True, True), ("topr", True, False), ("plain_is", False, True), ("sapo", True, False),
        ("vespo", True, True), ("dppo_kl", True, False), ("gmpo", True, False), ("opmd", False, False))],
]


@pytest.mark.parametrize("sets, t_ref, anchor, behavior, beta", FACTS)
def test_config_reads_each_methods_needs_from_the_table(sets, t_ref, anchor, behavior, beta):
    tc = load_config("smoke", sets).train
    assert (tc.refresh_every(), tc.needs_step_anchor(), tc.needs_behavior_logprobs()) == (t_ref, anchor, behavior)
    if beta:
        with pytest.raises(ConfigError, match=f"train.beta must be > 0 for {tc.method}"):
            load_config("smoke", sets + ["train.beta=0"])
    else:
        assert load_config("smoke", sets + ["train.beta=0"]).train.beta == 0


def test_aggregation_only_for_a_method_that_honors_it():
    """Issue 34 item 5: AGRO and GGPO compute token-mean only; setting another aggregation for
    them is an error, not a silently ignored option."""
    for name in ("grpo", "grpo_tis", "cispo", "gspo"):
        assert load_config("smoke", [f"train.method={name}", "train.aggregation=seq-mean-token-mean"])
    for name in ("agro", "ggpo"):
        with pytest.raises(ConfigError, match=f"train.aggregation='seq-mean-token-mean': {name} computes token-mean only"):
            load_config("smoke", [f"train.method={name}", "train.aggregation=seq-mean-token-mean"])


def test_a_correction_option_applies_to_its_methods_only_and_is_key_neutral_at_its_default():
    with pytest.raises(ConfigError, match="train.opsm_delta applies to method 'opsm' only, not 'grpo'"):
        load_config("smoke", ["train.opsm_delta=0.5"])
    with pytest.raises(ConfigError, match="train.behave_imp_weight_cap applies to method 'm2po' or 'decoupled_ppo'"):
        load_config("smoke", ["train.method=icepop", "train.behave_imp_weight_cap=3"])
    with pytest.raises(ConfigError, match="train.is_threshold_low must be < train.is_threshold_high"):
        load_config("smoke", ["train.method=icepop", "train.is_threshold_low=5"])
    plain = load_config("smoke", ["train.method=opsm"]).slice(("train",))
    assert "opsm_delta" not in plain["train"]          # at its default: not in the key
    assert load_config("smoke", ["train.method=opsm", "train.opsm_delta=0.0001"]).slice(("train",)) == plain
    assert load_config("smoke", ["train.method=opsm", "train.opsm_delta=0.5"]).slice(("train",))["train"]["opsm_delta"] == 0.5


def test_an_unknown_method_names_the_field_and_the_known_methods():
    with pytest.raises(ConfigError) as err:
        load_config("smoke", ["train.method=ppo"])
    assert "train.method: unknown 'ppo'; known: agro, cispo, decoupled_ppo, dppo_kl, dppo_tv, geo_mask, ggpo, gmpo, grpo, grpo_tis, gspo, icepop, m2po, opmd, opsm, plain_is, sapo, tis_seq, topr, vespo" in str(err.value)


PLUGIN = textwrap.dedent('''
    """A toy method from outside the project: REINFORCE with the group-mean baseline."""
    import os

    from pipeline.core.methods import Method, register_method


    def toy_loss(inp, cfg):
        adv = inp.rewards - inp.rewards.mean(dim=1, keepdim=True)          # [G, m]
        loss = ((-adv[..., None] * inp.lp) * inp.mask).sum() / inp.t_tot
        with open(os.environ["TOY_CALLS"], "a") as f:                      # the trainer called it
            f.write("call\\n")
        return loss, {"pg_loss": loss.detach()}


    register_method(Method("toy", "Toy REINFORCE", "toy_method:toy_loss", default_t_ref=3))
    register_method(Method("toy_beh", "Toy with behavior", "toy_method:toy_loss", needs_lp_beh=True))
''')


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The toy plugin module on the path and named in GGPO_PLUGINS, here and in subprocesses."""
    (tmp_path / "toy_method.py").write_text(PLUGIN)
    calls = tmp_path / "calls.txt"
    env = dict(os.environ, GGPO_PLUGINS="toy_method", TOY_CALLS=str(calls),
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("GGPO_PLUGINS", "toy_method")
    yield env, calls
    for name in ("toy", "toy_beh"):
        methods.METHODS.pop(name, None)
    methods._loaded.discard("toy_method")
    sys.modules.pop("toy_method", None)


def test_a_toy_method_registered_by_a_plugin_trains_through_the_cli(plugin, base_manifest, pool):
    env, calls = plugin
    argv = [str(BIN / "ggpo"), "stage", "train", "--preset", "smoke", "--no-track", "--set", "train.method=toy",
            "--set", "train.updates=2"]
    res = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "train: built" in res.stdout
    cfg = load_config("smoke", ["train.method=toy", "train.updates=2"])
    trained = Store().load("train", graph.expected_key("train", cfg))
    assert trained.summary["method"] == "toy" and trained.summary["t_ref"] == 3     # the entry's default
    assert pl.read_parquet(trained.path("metrics"))["update"].to_list() == [1, 2]
    assert calls.read_text().count("call") >= 2          # its loss, at least once per update


CORRECTIONS = [name for name in methods.BUILT_IN if name not in LOSSES]


@pytest.mark.parametrize("name", CORRECTIONS)
def test_each_correction_trains_through_ggpo_stage_train_and_online(name, base_manifest, pool, capsys):
    """`ggpo stage train` (2 updates on the smoke pool) and `ggpo stage online` (one round of
    N = 2 updates) with the method, through the CLI's main in this process (its session cache
    holds the base and the pool already): each exits 0 with every update's loss finite."""
    from pipeline.cli import main
    sets = [f"train.method={name}", "train.updates=2"]
    flags = [a for s in sets for a in ("--set", s)]
    assert main(["stage", "train", "--preset", "smoke", "--no-track", *flags]) == 0
    trained = Store().load("train", graph.expected_key("train", load_config("smoke", sets)))
    rows = pl.read_parquet(trained.path("metrics"))
    assert trained.summary["method"] == name and rows["update"].to_list() == [1, 2]
    assert all(math.isfinite(x) for x in rows["loss"].to_list())
    assert main(["stage", "online", "--preset", "smoke-online", "--no-track", *flags]) == 0
    assert f"online cell {name} seed 42: 1 rounds, 2 updates" in capsys.readouterr().out


def test_a_pool_without_what_a_method_needs_is_refused_in_one_line(plugin, tmp_path, pool):
    from pipeline.core.errors import TrainingError
    from pipeline.training.loop import load_pool
    path = tmp_path / "pool.parquet"
    pl.read_parquet(pool[2].path("train_pool")).with_columns(pl.lit(None).alias("behavior_logprobs")).write_parquet(path)
    tc = load_config("smoke", ["train.method=toy_beh"]).train
    with pytest.raises(TrainingError) as err:
        load_pool(path, 8, tc)
    line = str(err.value)
    assert "\n" not in line and str(path) in line and "behavior_logprobs" in line and "train.method=toy_beh" in line
    assert load_pool(path, 8, load_config("smoke", ["train.method=toy"]).train).lp_beh is None   # never zeros


def test_a_plugin_that_does_not_import_is_one_config_line(monkeypatch):
    monkeypatch.setenv("GGPO_PLUGINS", "no_such_plugin_module")
    with pytest.raises(ConfigError, match="GGPO_PLUGINS: cannot import plugin module 'no_such_plugin_module'"):
        load_config("smoke", ["train.method=toy"])
    methods._loaded.discard("no_such_plugin_module")


def test_a_plugin_method_is_in_all_and_in_the_corrections_table(plugin, tmp_path):
    """experiment.methods=["all"] holds the plugin's methods after the built-in ones, and the
    corrections table (pipeline/reports/corrections.py) has a row for it under its title, paired
    to GRPO+TIS; real cells and metrics files (tests/test_corrections_report.py). Costs about a
    second beyond imports."""
    from test_corrections_report import corrections_cache

    from pipeline.reports import corrections as table
    cfg = load_config("corrections")
    assert cfg.experiment.methods[-2:] == ["toy", "toy_beh"] and cfg.experiment.methods[:20] == list(methods.BUILT_IN)
    on_evals, on_curves, off_evals, off_curves = corrections_cache(tmp_path / "cache", methods=("grpo_tis", "toy"))
    text, _, csv = table.write(on_evals, on_curves, off_evals, off_curves, tmp_path / "r", "mean@8")
    assert "| Toy REINFORCE (`toy`) | " in text and "| toy | N=1 | 3 | " in text
    row = csv.filter((pl.col("method") == "toy") & (pl.col("setting") == "offline")).row(0, named=True)
    assert row["title"] == "Toy REINFORCE" and row["reference"] == "grpo_tis" and row["diff_n"] == 3
