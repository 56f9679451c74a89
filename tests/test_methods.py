"""One record per method (pipeline/core/methods.py): the table and the losses agree, config reads
it, and a method added from outside (one loss function, one entry, GGPO_PLUGINS) trains
through `ggpo stage train`."""
from __future__ import annotations

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
from pipeline.training.losses import LOSSES, get_loss

from conftest import BIN, REPO


def test_losses_are_keyed_as_the_method_table():
    assert tuple(LOSSES) == methods.BUILT_IN
    for name in methods.BUILT_IN:
        module, _, fn = methods.METHODS[name].loss.partition(":")
        assert module == "pipeline.training.losses" and LOSSES[name].__name__ == fn and get_loss(name) is LOSSES[name]


# what each method needed before the table, as config hard-coded it (the table must keep it):
# (overrides, default t_ref, step anchor, behavior log-probs, beta > 0 required)
FACTS = [
    (["train.method=grpo"], None, False, True, False),
    (["train.method=grpo", "train.anchor=old"], None, True, False, False),
    (["train.method=grpo_tis"], None, True, True, False),
    (["train.method=agro"], 160, False, False, True),
    (["train.method=ggpo"], 160, False, False, True),
    (["train.method=ggpo", "train.ggpo_clip_delta=0.05"], 160, True, False, True),
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


def test_an_unknown_method_names_the_field_and_the_known_methods():
    with pytest.raises(ConfigError) as err:
        load_config("smoke", ["train.method=ppo"])
    assert "train.method: unknown 'ppo'; known: agro, ggpo, grpo, grpo_tis" in str(err.value)


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
