"""The resident online cell (stages/online_cell.py): one engine per cell, weights synced in
place (transformers, and vLLM's weight-transfer calls against a recording fake), kill -9 at
a random moment then rerun, a longer run continuing the chain, heavy bytes that do not grow
with rounds, two gloo ranks against one process, and one-line errors for bad input."""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import polars as pl
import pytest
import torch
from safetensors.torch import load_file

from pipeline.core.config import load_config
from pipeline.core.errors import TrainingError, WeightSyncError
from pipeline.core.store import MANIFEST, Store
from pipeline.dag import graph
from pipeline.models.engines import SamplingParams
from stages.online_cell import run_cell, state_folder
from stages.online_pool import RefillError

from conftest import BIN, REPO

SMALL = {"train.updates_per_step": 2, "train.method": "grpo_tis", "train.eval_every": None}


def cfg_of(**extra):
    return load_config("smoke-online", SMALL | extra)


def store_with_base(root: Path, base) -> Store:
    """A fresh store that holds the session's base model (copied: no warm-up)."""
    shutil.copytree(base.folder, root / Path(base.folder).name)
    return Store(root)


def weights(manifest) -> dict[str, torch.Tensor]:
    return load_file(manifest.path("weights"))


def policy(cfg, store: Store, at: int | None = None):
    c = cfg if at is None else cfg.updated({"eval.update": at})
    return store.load("online_policy", graph.expected_key("online_policy", c))


def heavy_bytes(store: Store) -> dict[str, int]:
    """Bytes of weights and optimizer state per kind of folder (not base, pools, metrics)."""
    out: dict[str, int] = {}
    for path in store.root.rglob("*"):
        kind = path.relative_to(store.root).parts[0].split("-")[0]
        if path.is_file() and path.suffix in (".safetensors", ".pt", ".distcp") and kind != "base":
            out[kind] = out.get(kind, 0) + path.stat().st_size
    return out


# --------------------------------------------------------------------------- engines

def test_transformers_sync_equals_a_fresh_engine_on_the_saved_policy(base_manifest, tmp_path):
    """The in-place sync (load_weights) samples exactly what an engine built from the
    learner's saved folder samples: the old per-round reload, without the reload."""
    from pipeline.models.engines.hf import TransformersEngine
    from pipeline.models.hf import load_model, load_tokenizer
    from pipeline.training.loop import save_policy
    from stages.base_model import model_path
    learner = load_model(model_path(base_manifest))
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    save_policy(learner, load_tokenizer(model_path(base_manifest)), tmp_path / "saved")
    params = SamplingParams(n=4, temperature=1.0, top_p=1.0, max_new_tokens=12, seed=5)
    prompts = ["3 1 2 ->", "9 4 ->", "5 5 1 0 ->"]
    resident = TransformersEngine(model_path(base_manifest), batch_prompts=8, dtype="bfloat16")
    before = resident.generate(prompts, params)
    resident.load_weights(list(learner.named_parameters()))
    fresh = TransformersEngine(str(tmp_path / "saved"), batch_prompts=8, dtype="bfloat16")
    assert resident.generate(prompts, params) == fresh.generate(prompts, params) != before


def test_a_sampler_that_rejects_the_weights_says_so_in_one_line(base_manifest):
    from pipeline.models.engines.hf import TransformersEngine
    from stages.base_model import model_path
    engine = TransformersEngine(model_path(base_manifest), batch_prompts=8)
    named = [(n, p.detach()) for n, p in engine.model.named_parameters()]
    renamed = [("module." + named[0][0], named[0][1])] + named[1:]
    with pytest.raises(WeightSyncError, match=r"1 missing \(e\.g\. .*\); 1 it does not have \(e\.g\. module\.") as e:
        engine.load_weights(renamed)
    assert "\n" not in str(e.value)
    wrong = named[:-1] + [(named[-1][0], named[-1][1][..., :-1])]
    with pytest.raises(WeightSyncError, match=rf"1 of another shape \(e\.g\. {named[-1][0]}: "):
        engine.load_weights(wrong)


class RecordingLLM:
    """vLLM's LLM as the resident engine drives it (vllm/entrypoints/rl/offline.py and the
    worker's ipc_engine.receive_weights): records every call, and loads what arrives into a
    model of its own after the worker's checks (every name known, one handle per tensor,
    declared dtype and shape those of the tensor)."""

    def __init__(self, model_path: str, kwargs: dict):
        from pipeline.models.hf import load_model
        assert kwargs["enable_sleep_mode"] is True and kwargs["weight_transfer_config"] == {"backend": "ipc"}
        assert os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") == "1"
        self.model = load_model(model_path).to(torch.bfloat16)
        self.calls, self.received = [], []

    def init_weight_transfer_engine(self, request):
        self.calls.append(("init_weight_transfer_engine", request))

    def start_weight_update(self):
        self.calls.append(("start_weight_update",))

    def update_weights(self, request):
        info = request["update_info"]
        self.calls.append(("update_weights", len(info["names"])))
        params = dict(self.model.named_parameters(remove_duplicate=False))     # the tied head by its name too
        assert len(info["names"]) == len(info["dtype_names"]) == len(info["shapes"]) == len(info["ipc_handles"])
        for name, dtype, shape, handle in zip(info["names"], info["dtype_names"], info["shapes"], info["ipc_handles"]):
            (tensor,) = handle.values()          # {gpu uuid: args}: the test's args are the tensor
            assert isinstance(shape, list) and list(tensor.shape) == shape == list(params[name].shape), name
            assert str(tensor.dtype).split(".")[-1] == dtype and tensor.is_contiguous(), name
            self.received.append((name, dtype, tuple(shape)))
            params[name].data.copy_(tensor)      # what the model's load_weights does (cast to bf16)

    def finish_weight_update(self):
        self.calls.append(("finish_weight_update",))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))


def test_vllm_sync_sends_every_tensor_through_the_weight_transfer_api(base_manifest, monkeypatch):
    from pipeline.models.engines import vllm_engine as ve
    from pipeline.models.hf import load_model
    from stages.base_model import model_path
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    monkeypatch.setattr(ve, "build_llm", lambda path, kwargs: RecordingLLM(path, kwargs))
    engine = ve.VLLMEngine(model_path(base_manifest), seed=3, resident=True)
    engine.ipc_handle = lambda t: t           # the fake worker reads the tensor itself
    llm = engine.llm
    learner = load_model(model_path(base_manifest))          # fp32, as the trainer holds it
    with torch.no_grad():
        for p in learner.parameters():
            p.mul_(1.01)
    engine.load_weights(list(learner.named_parameters()))
    assert [c[0] for c in llm.calls] == ["init_weight_transfer_engine", "start_weight_update", "update_weights",
                                         "finish_weight_update", "reset_prefix_cache"]
    assert llm.calls[0][1] == {"init_info": {"packed": False}}
    expected = ve.checkpoint_shapes(model_path(base_manifest))
    expected["lm_head.weight"] = expected["model.embed_tokens.weight"]      # the tied head is sent too
    assert {n: s for n, _, s in llm.received} == expected and {d for _, d, _ in llm.received} == {"float32"}
    got = dict(llm.model.named_parameters())
    assert all(torch.equal(got[n], p.detach().to(torch.bfloat16)) for n, p in learner.named_parameters())
    # between rounds the engine sleeps (level 2: weights and KV dropped); the next sync wakes
    # the weights, loads, then the KV cache; the transfer engine is set up once
    llm.calls.clear()
    engine.sleep()
    engine.load_weights(list(learner.named_parameters()))
    assert [c[:2] if c[0] != "update_weights" else c[:1] for c in llm.calls] == [
        ("sleep", 2), ("wake_up", ("weights",)), ("start_weight_update",), ("update_weights",),
        ("finish_weight_update",), ("reset_prefix_cache",), ("wake_up", ("kv_cache",))]
    # a learner of another shape is refused before any call reaches the engine
    llm.calls.clear()
    named = list(learner.named_parameters())
    with pytest.raises(WeightSyncError, match="vLLM sampler refused the learner's weights: 1 missing"):
        engine.load_weights(named[:-1])
    assert llm.calls == []


# --------------------------------------------------------------------------- resume

def test_sigkill_at_a_random_moment_then_rerun_equals_uninterrupted(tmp_path, base_manifest):
    """`ggpo stage online` killed -9 at a random moment (inside a random round, rounds of N = 2,
    a checkpoint every 2 rounds, policies at updates 3, 6, 9, 12, 15 and 16), then run again:
    every kept policy is bit-identical to an uninterrupted run's, the rerun samples only
    the rounds whose pools the killed run had not committed, and the draw counts match."""
    sets = {"train.updates": 16, "train.eval_every": 3, "online.checkpoint_every": 2}
    cfg, rounds = cfg_of(**sets), 8
    straight = store_with_base(tmp_path / "straight", base_manifest)
    run_cell(cfg, straight, base_manifest)
    killed = store_with_base(tmp_path / "killed", base_manifest)
    seed = int(os.environ.get("GGPO_TEST_SEED", time.time_ns() % 10**6))
    rng = random.Random(seed)
    at_round, delay = rng.randint(1, rounds - 2), rng.uniform(0.0, 1.0)
    print(f"\nGGPO_TEST_SEED={seed}: kill -9 {delay:.2f}s after round {at_round}'s pool is committed")
    argv = [str(BIN / "ggpo"), "stage", "online", "--preset", "smoke-online", "--no-track"] + [
        x for k, v in (SMALL | sets).items() for x in ("--set", f"{k}={'null' if v is None else v}")]
    env = os.environ | {"GGPO_CACHE": str(killed.root)}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    pool_r = killed.folder("online_pool", graph.online_keys(cfg, at_round)["online_pool"]) / MANIFEST
    deadline = time.monotonic() + 300
    while not pool_r.exists():
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    committed = sum(killed.load("online_pool", graph.online_keys(cfg, r)["online_pool"]) is not None
                    for r in range(rounds))
    assert proc.returncode == -signal.SIGKILL and at_round + 1 <= committed < rounds
    rerun = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    counts = json.loads(next(ln for ln in rerun.stdout.splitlines() if ln.strip().startswith("counts "))
                        .split("counts ", 1)[1])
    assert counts["rounds_sampled"] == rounds - committed and counts["engine_starts"] == 1
    assert counts["rounds_skipped"] + counts["rounds_replayed"] + counts["rounds_sampled"] == rounds
    for at in (3, 6, 9, 12, 15, 16):
        a, b = weights(policy(cfg, straight, at)), weights(policy(cfg, killed, at))
        assert all(torch.equal(a[k], b[k]) for k in a), f"policy after update {at}"
    last = graph.online_keys(cfg, rounds - 1)["online_train"]
    assert killed.load("online_train", last).summary["cumulative_prompts"] == \
        straight.load("online_train", last).summary["cumulative_prompts"]
    assert not (state_folder(killed, cfg) / "pending").exists()


def test_a_replayed_round_trains_at_the_cells_threads(tmp_path, base_manifest):
    """A cell killed after round 1's pool was committed resumes from round 0's checkpoint and
    replays round 1 from the cached pool before any engine exists (the engine, which also
    sets the thread count, is built at the first round that samples). The CPU kernels split
    their sums by thread, so the replay must run at model.threads as the live round did, not
    at the process's default (one thread per core in a fresh `ggpo stage online`; 4 here):
    the final policy is bit-identical. Cost: two 2-round cells of the tiny model (seconds)."""
    cfg = cfg_of(**{"train.updates": 4, "online.checkpoint_every": 1})
    straight = store_with_base(tmp_path / "straight", base_manifest)
    run_cell(cfg, straight, base_manifest)
    shutil.copytree(straight.root, tmp_path / "killed")
    killed = Store(tmp_path / "killed")
    shutil.rmtree(state_folder(killed, cfg) / "checkpoints" / "round-000001")
    shutil.rmtree(killed.folder("online_train", graph.online_keys(cfg, 1)["online_train"]))
    shutil.rmtree(killed.folder("online_policy", policy(cfg, killed).key))
    threads, seen = torch.get_num_threads(), []
    torch.set_num_threads(4)
    try:
        counts = run_cell(cfg, killed, base_manifest, on_round=lambda *_: seen.append(torch.get_num_threads())).counts
    finally:
        torch.set_num_threads(threads)
    assert (counts["rounds_skipped"], counts["rounds_replayed"], counts["engine_starts"]) == (1, 1, 0)
    a, b = weights(policy(cfg, straight)), weights(policy(cfg, killed))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert seen == [cfg.model.threads] * 2


@pytest.fixture(scope="module")
def chains(tmp_path_factory, base_manifest):
    """16 then 32 updates in one store; 32 straight in another; 8 in a third (N = 2)."""
    root = tmp_path_factory.mktemp("chains")
    out = {}
    for name, steps in (("extended", (16, 32)), ("straight", (32,)), ("short", (8,))):
        store = store_with_base(root / name, base_manifest)
        out[name] = (store, [run_cell(cfg_of(**{"train.updates": n, "online.checkpoint_every": 1}), store,
                                      base_manifest).counts for n in steps])
    return out


def test_a_longer_run_continues_the_chain(chains):
    store, (first, second) = chains["extended"]
    assert (first["rounds_sampled"], first["engine_starts"]) == (8, 1)
    # the 32-update run starts at the 16-update run's last checkpoint: rounds 0-7 are not redone
    assert (second["rounds_skipped"], second["rounds_replayed"], second["rounds_sampled"]) == (8, 0, 8)
    cfg16, cfg32 = cfg_of(**{"train.updates": 16}), cfg_of(**{"train.updates": 32})
    assert [graph.online_keys(cfg16, r) for r in range(8)] == [graph.online_keys(cfg32, r) for r in range(8)]
    straight, _ = chains["straight"]
    a, b = weights(policy(cfg32, store)), weights(policy(cfg32, straight))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert policy(cfg16, store) is not None        # the shorter run's end stays an evaluation point


def test_heavy_bytes_do_not_grow_with_rounds(chains):
    """16 rounds leave the same weights and optimizer bytes as 4 rounds: two rolling
    checkpoints and the final policy; the rounds' folders hold pools and metrics only."""
    (long_store, _), (short_store, _) = chains["straight"], chains["short"]
    long, short = heavy_bytes(long_store), heavy_bytes(short_store)
    print(f"\nheavy bytes after 16 rounds {long}, after 4 rounds {short}")
    assert set(long) == set(short) == {"online_cell", "online_policy"}
    assert long["online_policy"] == short["online_policy"]
    assert abs(long["online_cell"] - short["online_cell"]) <= 0.001 * short["online_cell"]
    assert len(list(state_folder(long_store, cfg_of(**{"train.updates": 32})).glob("checkpoints/round-*"))) == 2
    for folder in long_store.root.glob("online_train-*"):
        assert sorted(p.name for p in folder.iterdir()) == [MANIFEST, "metrics.parquet"]


def test_a_round_that_cannot_fill_its_pool_ends_the_cell_at_its_policy(tmp_path, base_manifest):
    """A learner wrecked by its first round (lr 1: AdamW moves every weight by about 1) fails
    every prompt, so round 1 finds no mixed group in its draws. online.on_stall=stop ends
    the cell after update 2 with that policy kept for evaluation, and a rerun stalls at the
    same place without sampling the finished round again; on_stall=error fails in one line."""
    cfg = cfg_of(**{"train.lr": 1.0, "train.updates": 6, "online.max_draws": 2})
    store = store_with_base(tmp_path / "s", base_manifest)
    counts = run_cell(cfg, store, base_manifest).counts
    assert (counts["stalled"]["round"], counts["stalled"]["update"], counts["update"], counts["rounds"]) == (1, 2, 2, 1)
    assert re.search(r"online round 1 \(seed 42\): found 0 mixed-reward groups from \d+ prompts", counts["stalled"]["reason"])
    assert policy(cfg, store, 2) is not None and policy(cfg, store) is None
    again = run_cell(cfg, store, base_manifest).counts
    assert again["stalled"] == counts["stalled"] and again["rounds_sampled"] == 0
    a, b = weights(policy(cfg, store, 2)), weights(store.load("base", base_manifest.key))
    assert any(not torch.equal(a[k], b[k]) for k in a)       # it is the trained policy, not pi_0
    with pytest.raises(RefillError, match=r"online round 1 .* found 0 mixed-reward groups") as e:
        run_cell(cfg.updated({"online.on_stall": "error"}), store, base_manifest)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------- bad input

def test_a_foreign_checkpoint_and_a_missing_round_are_one_line(tmp_path, base_manifest):
    cfg = cfg_of(**{"train.updates": 4})
    store = store_with_base(tmp_path / "s", base_manifest)
    run_cell(cfg, store, base_manifest)
    (ckpt,) = (state_folder(store, cfg) / "checkpoints").glob("round-*")
    meta = json.loads((ckpt / "cell.json").read_text())
    (ckpt / "cell.json").write_text(json.dumps(meta | {"round_key": "f" * 64}))
    with pytest.raises(TrainingError, match=r"closes round 1 of another chain .* delete .* to start this cell over") as e:
        run_cell(cfg, store, base_manifest)
    assert "\n" not in str(e.value)
    (ckpt / "cell.json").write_text(json.dumps(meta))
    shutil.rmtree(store.folder("online_train", graph.online_keys(cfg, 1)["online_train"]))
    with pytest.raises(TrainingError, match=r"closes round 1, whose record .* is not in the cache: the chain is "
                                            r"missing a round") as e:
        run_cell(cfg, store, base_manifest)
    assert "\n" not in str(e.value)



def test_a_rank_that_cannot_see_rank_0s_artifact_says_so(tmp_path):
    """A rank (on another node) whose store lacks the round rank 0 committed: one line that
    names the store, not an AttributeError on None further on."""
    from stages.online_cell import CellRun, committed
    cfg = cfg_of(**{"train.updates": 4})
    cell = CellRun(cfg, Store(str(tmp_path / "s")), None, [graph.online_keys(cfg, 0)], tmp_path / "state", None, None)
    with pytest.raises(TrainingError, match=r"round 0's online_pool artifact, written by rank 0, is not in the store "
                                            r"at .*every rank \(every node\) must use one store") as e:
        committed(cell, "online_pool", 0)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------- ranks

def test_two_gloo_ranks_match_one_process(tmp_path, base_manifest):
    """The cell under torchrun (2 CPU ranks, FSDP2): rank 0 samples with the gathered weights;
    the pools' responses are the one-process cell's and the weights agree within 1e-5."""
    cfg1 = cfg_of(**{"train.updates": 4, "train.eval_every": 2})
    one, two = store_with_base(tmp_path / "one", base_manifest), store_with_base(tmp_path / "two", base_manifest)
    run_cell(cfg1, one, base_manifest)
    counts = run_cell(cfg1.updated({"train.nproc": 2}), two, base_manifest).counts
    assert (counts["engine_starts"], counts["rounds_sampled"]) == (1, 2)
    for r in range(2):
        key = graph.online_keys(cfg1, r)["online_pool"]
        cols = ["prompt_id", "response_token_ids", "reward"]
        assert pl.read_parquet(one.load("online_pool", key).path("train_pool"), columns=cols).equals(
            pl.read_parquet(two.load("online_pool", key).path("train_pool"), columns=cols))
    for at in (2, 4):
        a, b = weights(policy(cfg1, one, at)), weights(policy(cfg1, two, at))
        worst = max((a[k] - b[k]).abs().max().item() for k in a)
        assert set(a) == set(b) and worst <= 1e-5, (at, worst)


def test_torchrun_ranks_wait_for_rank_0_on_a_cpu_group_sized_from_the_round(monkeypatch):
    """While rank 0 samples a round, the other ranks wait at a gloo (CPU) barrier whose
    timeout comes from the round's size, not at an NCCL barrier under the process group's
    10-minute default: at the paper's scale (Qwen3-1.7B preset, N = 8) one draw alone is
    256 prompts x 8 samples x 3,072 tokens, and a round may take up to 16 draws."""
    import datetime
    import types

    import torch.distributed as dist

    from pipeline.training import distributed
    from stages import online_cell
    paper = load_config("qwen3-1.7b")
    draw = paper.online.per_draw(paper.train) * paper.rollout.group_size * paper.rollout.max_new_tokens
    assert draw == 256 * 8 * 3072
    seconds = online_cell.wait_seconds(paper)
    assert seconds >= 1800 + paper.online.max_draws * draw / online_cell.WAIT_TOKENS_PER_S > 600
    made, waited = [], []
    monkeypatch.setattr(dist, "new_group", lambda **kw: made.append(kw) or "the cell's gloo group")
    monkeypatch.setattr(dist, "barrier", lambda group=None, **kw: waited.append((group, kw)))
    monkeypatch.setattr(distributed, "current", lambda: types.SimpleNamespace(is_main=False, rank=1))
    cell = types.SimpleNamespace(waits=online_cell.wait_group(paper))
    online_cell.barrier(cell)
    assert made == [{"backend": "gloo", "timeout": datetime.timedelta(seconds=seconds)}]
    assert waited == [("the cell's gloo group", {})]


def test_the_step_anchor_read_from_the_first_update_changes_nothing(tmp_path, base_manifest, monkeypatch):
    """GRPO+TIS at N = 2 (a PPO clip against lp_old): the step's first update's micro-batch is
    the anchor's first one, so its anchor comes from that update's own forward
    (train.anchor_reuse); the weights of every round and the metrics equal, byte for byte,
    those of a cell that computes the whole anchor apart, with half the anchor's forwards."""
    from pipeline.training import loop
    calls = {"anchor": 0}
    real = loop.policy_logprobs

    def counted(model, batch, rt, temperature, with_entropy=False, device=None):
        calls["anchor"] += not torch.is_grad_enabled() and model.training
        return real(model, batch, rt, temperature, with_entropy, device)
    monkeypatch.setattr(loop, "policy_logprobs", counted)
    runs = {}
    for reuse in (True, False):
        cfg = cfg_of(**{"train.updates": 4, "train.anchor_reuse": reuse, "train.groups_per_update": 2,
                        "train.micro_batch_groups": 2})
        store = store_with_base(tmp_path / str(reuse), base_manifest)
        calls["anchor"] = 0
        run_cell(cfg, store, base_manifest)
        runs[reuse] = (store, cfg, calls["anchor"])
    (on, cfg, n_on), (off, _, n_off) = runs[True], runs[False]
    a, b = weights(policy(cfg, on)), weights(policy(cfg, off))
    assert all(torch.equal(a[k], b[k]) for k in a)
    for r in range(2):
        key = graph.online_keys(cfg, r)["online_train"]
        mine, theirs = on.load("online_train", key), off.load("online_train", key)
        assert {**mine.summary, "train_seconds": 0} == {**theirs.summary, "train_seconds": 0}
        assert pl.read_parquet(mine.path("metrics")).drop("seconds").equals(
            pl.read_parquet(theirs.path("metrics")).drop("seconds"))
    assert (n_on, n_off) == (2, 4)      # 2 rounds x 2 micro-batches apart, 1 of them read from the update


def test_a_round_whose_content_was_sampled_before_takes_that_pool(tmp_path, base_manifest):
    """online.share_pools: two cells with different keys but the same content (t_ref 100 never
    fires in 6 updates, so it trains as t_ref fixed does): the second samples nothing after
    round 0 (which is shared by key anyway) and copies the first one's pools, byte for byte,
    naming them; its final weights equal those of the same cell run alone without sharing.
    A cell whose weights differ (another lr) shares nothing."""
    share = {"train.updates": 6, "online.share_pools": True}
    store = store_with_base(tmp_path / "shared", base_manifest)
    first = run_cell(cfg_of(**share, **{"train.t_ref": "fixed"}), store, base_manifest)
    second_cfg = cfg_of(**share, **{"train.t_ref": 100})
    second = run_cell(second_cfg, store, base_manifest)
    assert first.counts["rounds_sampled"] == 3 and first.counts["rounds_shared"] == 0
    assert (second.counts["rounds_sampled"], second.counts["rounds_shared"], second.counts["rounds_replayed"]) == (0, 2, 1)
    for r in (1, 2):
        mine = store.load("online_pool", graph.online_keys(second_cfg, r)["online_pool"])
        theirs = store.load("online_pool", graph.online_keys(cfg_of(**share, **{"train.t_ref": "fixed"}), r)["online_pool"])
        assert mine.key != theirs.key and mine.summary["shared_from"] == theirs.key
        assert {n: f.sha256 for n, f in mine.files.items()} == {n: f.sha256 for n, f in theirs.files.items()}
        assert mine.summary["generate_seconds"] == 0.0 and mine.summary["prompt_cursor"] == theirs.summary["prompt_cursor"]
    alone_cfg = cfg_of(**{"train.updates": 6, "train.t_ref": 100})
    alone = store_with_base(tmp_path / "alone", base_manifest)
    run_cell(alone_cfg, alone, base_manifest)
    a, b = weights(policy(second_cfg, store)), weights(policy(alone_cfg, alone))
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = run_cell(cfg_of(**share, **{"train.lr": 2 * second_cfg.train.lr}), store, base_manifest)
    assert other.counts["rounds_shared"] == 0 and other.counts["rounds_sampled"] == 2


def test_the_weights_hash_reads_every_byte_of_every_dtype():
    """weights_sha256 (online.share_pools' content key): equal tensors give equal hashes in
    fp32 and bf16; one changed element, a renamed tensor or another dtype of the same values
    gives another."""
    from stages.online_pool import weights_sha256
    w = [("a", torch.arange(6, dtype=torch.float32).view(2, 3)), ("b", torch.ones(4))]
    same = [(n, t.clone()) for n, t in reversed(w)]
    assert weights_sha256(w) == weights_sha256(same)
    bent = [("a", w[0][1].clone()), ("b", torch.ones(4))]
    bent[0][1][1, 2] = torch.nextafter(bent[0][1][1, 2], torch.tensor(9.0))
    renamed = [("c", w[0][1]), ("b", w[1][1])]
    bf16 = [(n, t.to(torch.bfloat16)) for n, t in w]
    hashes = {weights_sha256(x) for x in (w, bent, renamed, bf16)}
    assert len(hashes) == 4 and weights_sha256(bf16) == weights_sha256([(n, t.clone()) for n, t in bf16])
