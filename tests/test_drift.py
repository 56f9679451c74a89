"""The learner-to-behavior drift at a round's end (pipeline/training/drift.py) and its guard
(online.max_round_drift): the value against an fp64 computation of its definition on the
tiny model, the record and curves that carry it, and the guard warning, stopping a real
small cell, or doing nothing when off; the guard's fields never enter a key."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import polars as pl
import pytest
import torch
from safetensors.torch import load_file

from pipeline.core.config import load_config
from pipeline.core.store import Store, model_path
from pipeline.dag import graph
from pipeline.models.hf import load_model, load_tokenizer
from pipeline.models.runtime import make_runtime
from pipeline.services import tracking
from pipeline.training.drift import drift_sample, drift_sums, from_sums, round_drift
from pipeline.training.pool import Pool
from stages.online_cell import run_cell

SMALL = {"train.updates_per_step": 2, "train.method": "ggpo", "train.eval_every": None, "train.updates": 6,
         "online.drift_every": 1}      # every round measured, whatever the default


def hand_drift(model, pool: Pool, groups: list[int], temperature: float) -> tuple[float, float]:
    """The docstring's definition in float64, one response at a time, no padding."""
    model = model.double()
    abs_tok, tokens, abs_seq, n = 0.0, 0, 0.0, 0
    for g in groups:
        for resp, beh in zip(pool.responses[g], pool.lp_beh[g]):
            ids = torch.tensor([pool.prompt_ids[g] + resp])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0].double() / temperature
            p = len(pool.prompt_ids[g])
            lp = torch.log_softmax(logits[p - 1:-1], -1).gather(1, torch.tensor(resp)[:, None])[:, 0]
            d = (lp - torch.tensor(beh, dtype=torch.float64)).clamp(-20, 20)
            abs_tok, tokens, abs_seq, n = abs_tok + d.abs().sum().item(), tokens + len(resp), \
                abs_seq + abs(d.sum().item()), n + 1
    return abs_tok / tokens, abs_seq / n


def test_drift_matches_its_fp64_definition_on_the_tiny_model(base_manifest):
    cfg = load_config("smoke-online")
    path = model_path(base_manifest)
    tok, rng = load_tokenizer(path), torch.Generator().manual_seed(0)
    vocab = load_model(path).config.vocab_size
    m, n_groups = 3, 5
    prompts = [torch.randint(3, vocab, (int(torch.randint(2, 6, (1,), generator=rng)),), generator=rng).tolist()
               for _ in range(n_groups)]
    responses = [[torch.randint(3, vocab, (int(torch.randint(1, 9, (1,), generator=rng)),), generator=rng).tolist()
                  for _ in range(m)] for _ in range(n_groups)]
    # behavior log-probs: any numbers, a few far enough to hit the +-20 guard
    lp_beh = [[(-torch.rand(len(r), generator=rng, dtype=torch.float64) * 8).tolist() for r in rs] for rs in responses]
    lp_beh[1][0][0] = -60.0
    pool = Pool(group_ids=list(range(n_groups)), prompt_ids=prompts, responses=responses, lp_beh=lp_beh,
                rewards=torch.zeros(n_groups, m, dtype=torch.float64), group_size=m)
    groups = [0, 1, 3]
    rt = make_runtime(cfg.train)
    got = round_drift(rt.prepare(load_model(path)), pool, groups, cfg, tok.pad_token_id, rt)
    want = hand_drift(load_model(path), pool, groups, cfg.rollout.temperature)
    assert got["round_drift"] == pytest.approx(want[0], rel=1e-5)
    assert got["round_drift_seq"] == pytest.approx(want[1], rel=1e-5)
    assert want[1] > want[0] > 0            # a sequence's |log w| adds up its tokens' ratios


def test_drift_sums_small_case_and_sample():
    lp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]])
    beh = torch.tensor([[-1.5, -1.0, 9.0], [-0.5, -1.0, -0.25]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # d = [0.5, -1.0 | 0.0, 0.5, -0.25]: token mean |d| 2.25 / 5, sequences |-0.5|, |0.25|
    assert from_sums(drift_sums(lp, beh, mask)) == pytest.approx({"round_drift": 0.45, "round_drift_seq": 0.375})
    assert from_sums(torch.zeros(4, dtype=torch.float64)) == {"round_drift": None, "round_drift_seq": None}
    assert drift_sample(5, 8, 42, 0) == [0, 1, 2, 3, 4]
    s = drift_sample(100, 8, 42, 3)
    assert s == drift_sample(100, 8, 42, 3) == sorted(set(s)) and len(s) == 8
    assert s != drift_sample(100, 8, 42, 4) and s != drift_sample(100, 8, 1234, 3)


def store_with_base(root: Path, base) -> Store:
    shutil.copytree(base.folder, root / Path(base.folder).name)
    return Store(root)


@pytest.fixture(scope="module")
def plain(tmp_path_factory, base_manifest):
    """A small cell with the guard off, every round measured: (store, counts, warnings said)."""
    store = store_with_base(tmp_path_factory.mktemp("plain") / "s", base_manifest)
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())     # type: ignore[method-assign]
    logging.getLogger("ggpo").addHandler(handler)
    try:
        counts = run_cell(load_config("smoke-online", SMALL), store, base_manifest).counts
    finally:
        logging.getLogger("ggpo").removeHandler(handler)
    return store, counts, said


def test_a_cell_records_its_drift_and_the_guard_warns_stops_or_stays_off(tmp_path, base_manifest, caplog, plain):
    """Off: every round's last row carries its drift (the others None) and nothing is said.
    A bound below any real drift: warn says one line per round and finishes; stop ends the
    cell after round 0 with its policy kept as the final, marked stopped with the reason."""
    cfg = load_config("smoke-online", SMALL)
    store, counts, said = plain
    assert counts["stalled"] is None and counts["rounds"] == 3 and not [w for w in said if "drift" in w]
    rows = pl.concat([pl.read_parquet(store.load("online_train", graph.online_keys(cfg, r)["online_train"]).path("metrics"))
                      for r in range(3)])
    ends = rows.filter(pl.col("round_drift").is_not_null())
    assert ends["update"].to_list() == [2, 4, 6] and rows.height == 6
    assert all(d > 0 for d in ends["round_drift"]) and all(d > 0 for d in ends["round_drift_seq"])
    record = store.load("online_train", graph.online_keys(cfg, 2)["online_train"])
    assert record.summary["round_drift"] == ends["round_drift"][-1]
    logged = [(k, v, step) for k, v, step in tracking.training_curves(record) if k.startswith("train/round_drift")]
    assert logged == [("train/round_drift", ends["round_drift"][-1], 6), ("train/round_drift_seq", ends["round_drift_seq"][-1], 6)]

    caplog.clear()
    warn = cfg.updated({"online.max_round_drift": 1e-9})
    with caplog.at_level(logging.WARNING, logger="ggpo"):
        counts = run_cell(warn, store_with_base(tmp_path / "w", base_manifest), base_manifest).counts     # rounds run again
    lines = [r.getMessage() for r in caplog.records if "max_round_drift" in r.getMessage()]
    assert counts["stalled"] is None and counts["rounds"] == 3 and len(lines) == 3
    assert "online round 0 (ggpo seed 42): learner-to-behavior drift" in lines[0] and "on_drift=warn" in lines[0]

    stop = warn.updated({"online.on_drift": "stop"})
    fresh = store_with_base(tmp_path / "t", base_manifest)
    counts = run_cell(stop, fresh, base_manifest).counts
    assert (counts["stalled"]["cause"], counts["stalled"]["round"], counts["stalled"]["update"], counts["rounds"]) \
        == ("drift", 0, 2, 1)
    assert "above online.max_round_drift = 1e-09" in counts["stalled"]["reason"]
    assert stop.train.online_eval_updates(counts["rounds"]) == [2]
    assert fresh.load("online_policy", graph.expected_key("online_policy", stop.updated({"eval.update": 2}))) is not None
    assert fresh.load("online_train", graph.online_keys(stop, 1)["online_train"]) is None     # round 1 never ran


def test_drift_every_measures_every_kth_round_and_the_last(tmp_path, base_manifest, caplog, plain):
    """online.drift_every = 2 over 3 rounds: rounds 0 (a multiple of 2) and 2 (the last) are
    measured, round 1 is not: its drift is missing (null in the metrics, None in its record,
    no MLflow curve point), never 0, and the guard (a bound below any real drift) says
    nothing for it. The keys, the updates and the weights are those of a cell measuring
    every round."""
    cfg = load_config("smoke-online", SMALL | {"online.drift_every": 2, "online.max_round_drift": 1e-9})
    store = store_with_base(tmp_path / "k", base_manifest)
    with caplog.at_level(logging.WARNING, logger="ggpo"):
        counts = run_cell(cfg, store, base_manifest).counts
    lines = [r.getMessage() for r in caplog.records if "max_round_drift" in r.getMessage()]
    assert counts["rounds"] == 3 and len(lines) == 2, lines
    assert "online round 0 " in lines[0] and "online round 2 " in lines[1]
    every, _, _ = plain
    plain_cfg = load_config("smoke-online", SMALL)
    for r in range(3):
        keys = graph.online_keys(cfg, r)
        assert keys == graph.online_keys(plain_cfg, r)
        rec, ref = store.load("online_train", keys["online_train"]), every.load("online_train", keys["online_train"])
        got, want = pl.read_parquet(rec.path("metrics")), pl.read_parquet(ref.path("metrics"))
        assert got.drop("seconds", "round_drift", "round_drift_seq").equals(
            want.drop("seconds", "round_drift", "round_drift_seq"))      # the same updates, bit for bit
        if r == 1:
            assert got["round_drift"].null_count() == got.height == 2 and rec.summary["round_drift"] is None
            assert not [k for k, _, _ in tracking.training_curves(rec) if k.startswith("train/round_drift")]
        else:       # measured: the value of the cell that measures every round
            assert got["round_drift"].to_list() == want["round_drift"].to_list()
            assert rec.summary["round_drift"] == ref.summary["round_drift"] > 0
    key = graph.expected_key("online_policy", cfg.updated({"eval.update": 6}))
    a, b = (load_file(s.load("online_policy", key).path("weights")) for s in (store, every))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the report: round 1 blank in drift.csv, the summary over the measured rounds only
    from pipeline.core.grid import GridCell
    from pipeline.reports import online as online_report
    rounds = [store.load("online_train", graph.online_keys(cfg, r)["online_train"]) for r in range(3)]
    curves = online_report.cell_curves(GridCell(cfg.seed, "ggpo", {}, "ggpo", {}, cfg), cfg, rounds)
    measured = [rec.summary["round_drift"] for rec in rounds]
    assert online_report.drift_rounds(curves)["round_drift"].to_list() == measured
    summary = online_report.drift_summary(curves).row(0, named=True)
    assert (summary["rounds"], summary["first"], summary["last"]) == (3, measured[0], measured[2])
    assert summary["mean"] == pytest.approx((measured[0] + measured[2]) / 2, rel=1e-12)


def test_the_guard_fields_enter_no_key():
    a = load_config("tiny-regime")
    b = a.updated({"online.max_round_drift": 0.1, "online.on_drift": "stop", "online.drift_every": 3})
    assert graph.cell_key(a) == graph.cell_key(b)
    for stage in ("base", "rollout", "verify", "filter", "train", "evaluate", "online_pool", "online_train"):
        assert graph.expected_key(stage, a) == graph.expected_key(stage, b), stage
