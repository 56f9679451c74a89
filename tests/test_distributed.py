"""Data-parallel training (pipeline/training/distributed.py): two gloo ranks under torchrun
against one process on the tiny model, a rank killed mid-run, and bad placement settings.

The config exercises every distributed path: GRPO+TIS (the step anchor lp_old is computed
per shard and gathered), a reference refresh at update 2 (the gathered policy copied into
the replicated reference, and stored in the checkpoint), 7 groups per update over 2 ranks
(shards of 4 and 3 groups, 2 and 1 micro-batches: the short rank runs a padding pass).
It trains in float64, so ranks and one process are compared within rounding
(tests/tolerance.py), not within a tolerance tuned to one machine.
"""
import shutil

import polars as pl
import pytest
import torch
from safetensors.torch import load_file

from pipeline.core.config import ConfigError, load_config
from pipeline.core.errors import TrainingError
from pipeline.core.store import MANIFEST, Store
from pipeline.dag import graph
from pipeline.dag.preflight import preflight
from pipeline.training import checkpoint, distributed
from stages import train

from tolerance import assert_same_training

CFG = ["train.method=grpo_tis", "train.updates=4", "train.updates_per_step=2", "train.t_ref=2",
       "train.groups_per_update=7", "train.micro_batch_groups=3", "train.checkpoint_every=1",
       "train.diagnostics_block=2", "train.dtype=float64"]


def _assert_same_run(a, b):
    """Two training manifests of CFG: the same metrics and weights within rounding."""
    ma, mb = pl.read_parquet(a.path("metrics")), pl.read_parquet(b.path("metrics"))
    assert mb["update"].to_list() == [1, 2, 3, 4] and mb["tokens"].to_list() == ma["tokens"].to_list()
    assert_same_training(ma, load_file(a.path("weights")), mb, load_file(b.path("weights")),
                         lr=load_config("smoke", CFG).train.lr)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, base_manifest, pool):
    """One process and two uninterrupted gloo ranks, same config: (single, double) manifests."""
    inputs = {"base": base_manifest, "pool": pool[2]}
    single = train.run(load_config("smoke", CFG), inputs, store=Store(tmp_path_factory.mktemp("one")))
    double = train.run(load_config("smoke", CFG + ["train.nproc=2"]), inputs,
                       store=Store(tmp_path_factory.mktemp("two")))
    return single, double


def test_two_ranks_equal_one_process(runs):
    single, double = runs
    assert double.key == single.key                 # placement is not in the key
    assert "nproc" not in double.config["train"]
    _assert_same_run(single, double)
    a = pl.read_parquet(single.path("metrics"))
    assert a["ess"].drop_nulls().len() == 2 and a["ref_refreshed"].to_list() == [False, True, False, True]


def test_killed_rank_fails_without_manifest_then_resumes(tmp_path, monkeypatch, runs, base_manifest, pool):
    """Rank 1 dies right after the checkpoint of update 2: the stage raises one line, no
    manifest; the same call resumes from the DCP checkpoint to the uninterrupted result.
    The same checkpoint also resumes in one process (DCP reshards)."""
    inputs, store = {"base": base_manifest, "pool": pool[2]}, Store(tmp_path / "a")
    cfg = load_config("smoke", CFG + ["train.nproc=2"])
    folder = store.folder("train", graph.expected_key("train", cfg))
    monkeypatch.setenv(distributed.KILL_ENV, "1:2")
    with pytest.raises(TrainingError, match=r"torchrun \(2 x 1 ranks\) exited 1") as err:
        train.run(cfg, inputs, store=store)
    assert "\n" not in str(err.value)
    assert not (folder / MANIFEST).exists()
    assert checkpoint.load(folder / "checkpoints")["update"] == 2
    other = Store(tmp_path / "b").folder("train", graph.expected_key("train", cfg))
    shutil.copytree(folder / "checkpoints", other / "checkpoints")
    monkeypatch.delenv(distributed.KILL_ENV)
    resumed = train.run(cfg, inputs, store=store)
    _, double = runs
    _assert_same_run(resumed, double)
    assert pl.read_parquet(resumed.path("metrics")).drop("seconds").equals(
        pl.read_parquet(double.path("metrics")).drop("seconds"))
    one = train.run(load_config("smoke", CFG), inputs, store=Store(tmp_path / "b"))
    _assert_same_run(one, double)


@pytest.mark.parametrize("overrides, message", [
    (["train.nproc=99", "train.device=cpu"], r"train.nproc=99 CPU ranks on \d+ cores"),
    (["train.nnodes=2"], r"train.nnodes=2 needs train.rdzv_endpoint"),
])
def test_bad_placement_fails_before_work(overrides, message):
    with pytest.raises(ConfigError, match=message):
        preflight(load_config("smoke", overrides))


def test_nproc_leaves_keys_alone():
    a, b = load_config("smoke"), load_config("smoke", ["train.nproc=4", "train.nnodes=2",
                                                       "train.rdzv_endpoint=node0:29500"])
    assert graph.expected_key("train", a) == graph.expected_key("train", b)


RANK_SCRIPT = '''
import json, sys, types
import torch
from safetensors.torch import save_file
from pipeline.models.hf import load_model
from stages.online_cell import learner_weights
from stages.train import distributed
d = distributed.init("cpu")
model = distributed.shard_policy(load_model(sys.argv[1]), None)
named = learner_weights(types.SimpleNamespace(model=model))
if d.is_main:
    save_file({n: t.contiguous() for n, t in named}, sys.argv[2] + "/rank0.safetensors")
with open(f"{sys.argv[2]}/rank{d.rank}.json", "w") as f:
    json.dump({"kept": len(named), "fsdp": distributed.is_sharded(model)}, f)
distributed.finish(d)
'''


def test_only_rank_0_keeps_the_gathered_weights_of_a_sync(tmp_path, base_manifest):
    """An online cell's sync under torchrun (2 gloo ranks, FSDP2): rank 0 gets every
    parameter whole (the one-process model's, tied weights once); rank 1, which never
    syncs, keeps nothing (it used to gather the full fp32 state too)."""
    import json
    import os
    import subprocess
    import sys

    from pipeline.models.hf import load_model
    from stages.base_model import model_path

    from conftest import REPO, free_port
    (tmp_path / "rank.py").write_text(RANK_SCRIPT)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(tmp_path / "rank.py"), model_path(base_manifest),
            str(tmp_path)]
    res = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600,
                         env=os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    whole = dict(load_model(model_path(base_manifest)).named_parameters())
    assert ranks[0] == {"kept": len(whole), "fsdp": True} and ranks[1] == {"kept": 0, "fsdp": True}
    got = load_file(tmp_path / "rank0.safetensors")
    assert set(got) == set(whole) and all(torch.equal(got[n], p.detach()) for n, p in whole.items())


FULL_DISK_RANK = '''
"""A rank of train's torchrun (pipeline.training.torchrun) whose disk fills right after the
checkpoint of update GGPO_TEST_FULL_DISK["after"]: rank 0 fills it (a tmpfs's filler, or
the injected disk's flag, which every rank's Python writes under "root" then see)."""
import json, os, sys
from pipeline.core.full_disk import InjectedDisk, Tmpfs
from pipeline.training import checkpoint, torchrun
spec = json.loads(os.environ["GGPO_TEST_FULL_DISK"])
if spec["flag"]:
    disk = InjectedDisk(spec["root"], spec["flag"])
    disk.install()
else:
    disk = Tmpfs(spec["root"], mount=False)    # the test mounted it
save = checkpoint.save

def save_then_fill(folder, **kwargs):
    save(folder, **kwargs)
    if kwargs["update"] == spec["after"] and os.environ["RANK"] == "0":
        disk.fill(4096)
checkpoint.save = save_then_fill
torchrun.main(sys.argv[1:])
'''


def test_ranks_on_a_disk_that_fills_keep_the_last_checkpoint_and_resume(tmp_path, monkeypatch, runs,
                                                                          base_manifest, pool):
    """Two gloo ranks whose cache's disk fills right after the DCP checkpoint of update 2 (a
    tmpfs where one mounts, else ENOSPC injected into every rank's Python writes): the one
    after update 3 fails. The stage fails with one line saying the disk is full, no manifest,
    nothing half-written; the DCP checkpoint of update 2 is the latest. Space freed, the same
    call resumes after update 2 to the uninterrupted two-rank run's metrics and weights."""
    import json
    import os

    from pipeline.core.errors import DiskFull
    from pipeline.core.full_disk import Tmpfs
    from pipeline.training import torchrun

    from conftest import REPO
    root = tmp_path / "fs"
    disk = Tmpfs(root)
    flag = None if not disk.why else tmp_path / "disk-is-full"
    try:
        (tmp_path / "full_disk_rank.py").write_text(FULL_DISK_RANK)
        monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{REPO}")
        monkeypatch.setenv("GGPO_TEST_FULL_DISK", json.dumps({"root": str(root), "flag": flag and str(flag),
                                                              "after": 2}))
        argv_of = torchrun.torchrun_argv
        monkeypatch.setattr(torchrun, "torchrun_argv", lambda tc, args: argv_of(tc, args, module="full_disk_rank"))
        inputs, store = {"base": base_manifest, "pool": pool[2]}, Store(root / "cache")
        cfg = load_config("smoke", CFG + ["train.nproc=2"])
        folder = store.folder("train", graph.expected_key("train", cfg))
        with pytest.raises(DiskFull) as err:
            train.run(cfg, inputs, store=store)
        assert str(folder / "checkpoints") in str(err.value) and "\n" not in str(err.value), str(err.value)
        assert not (folder / MANIFEST).exists()
        assert checkpoint.load(folder / "checkpoints")["update"] == 2
        left = [p.name for p in (folder / "checkpoints").iterdir()]
        assert sorted(left) == ["dcp-000002", checkpoint.POINTER], left
        (disk.free() if flag is None else flag.unlink())
        monkeypatch.setattr(torchrun, "torchrun_argv", argv_of)
        resumed = train.run(cfg, inputs, store=store)
        _, double = runs
        assert pl.read_parquet(resumed.path("metrics")).drop("seconds").equals(
            pl.read_parquet(double.path("metrics")).drop("seconds"))
        _assert_same_run(resumed, double)
    finally:
        disk.close()
