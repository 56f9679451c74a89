"""The online loop (spec 8.1-8.3): refill counts, the seeded loader, on-policy ratios at
N = 1, staleness within a step, bad input, the flow's cells against sequential ones (the
resident cell itself: tests/test_online_cell.py)."""
import os
import subprocess
from pathlib import Path

import polars as pl
import pytest
import torch

from pipeline.core.config import ConfigError, load_config
from pipeline.core.store import Store
from pipeline.dag import graph
from stages.online_pool import RefillError, cannot_fill, collect_mixed, loader_positions, poisson_upper

from conftest import BIN, REPO
from tolerance import rounding_tol


def table_draw(table: list[list[int]], per_draw: int):
    """draw(d) over a hand-made reward table: prompt i's rewards are table[i]."""
    return lambda d: [(i, table[i]) for i in range(d * per_draw, min((d + 1) * per_draw, len(table)))]


def test_refill_counts_on_a_hand_made_reward_table():
    solved, failed, mixed = [1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 0, 0]
    # prompt:  0       1      2      3       4      5      6      7      8      9
    table = [solved, mixed, failed, mixed, solved, failed, failed, mixed, mixed, mixed]
    got = collect_mixed(table_draw(table, 3), need=4, max_draws=10)
    # draw 0: prompts 0-2 (1 mixed), draw 1: 3-5 (2), draw 2: 6-8 (4: enough, 8 is surplus)
    assert (got.draws, got.prompts, got.responses, got.mixed) == (3, 9, 36, 4)
    assert got.kept == [1, 3, 7, 8]
    got = collect_mixed(table_draw(table, 4), need=4, max_draws=10)
    assert (got.draws, got.prompts, got.responses, got.mixed, got.kept) == (3, 10, 40, 5, [1, 3, 7, 8])


def test_refill_is_bounded_and_says_what_it_found():
    table = [[1, 1, 1, 1]] * 20 + [[0, 1, 1, 1]]
    with pytest.raises(RefillError, match=r"found 0 mixed-reward groups from 12 prompts \(48 responses, 3 draws\)"):
        collect_mixed(table_draw(table, 4), need=2, max_draws=3)


def test_poisson_upper_bound_against_its_definition():
    import math
    # k = 0: P(Poisson(lam) = 0) = exp(-lam) = alpha exactly
    assert poisson_upper(0, 1e-4) == pytest.approx(-math.log(1e-4), rel=1e-9)
    for k, alpha in [(1, 1e-3), (5, 1e-4), (40, 1e-2), (300, 1e-4)]:
        lam = poisson_upper(k, alpha)
        cdf = sum(math.exp(i * math.log(lam) - lam - math.lgamma(i + 1)) for i in range(k + 1))
        assert cdf == pytest.approx(alpha, rel=1e-6) and lam > k


def test_a_round_that_cannot_fill_stops_early_and_one_that_can_is_unchanged():
    # a collapsed policy: 0 mixed in the first draw of 512 prompts, 15 draws left, needs 512
    assert cannot_fill(0, 512, 15 * 512, 512, 1e-4)
    # 0 mixed of 32 with 480 prompts left, needs 32: a rate of 9.2 / 32 could still fill it
    assert not cannot_fill(0, 32, 480, 32, 1e-4)
    assert not cannot_fill(10, 10, 0, 10, 1e-4)          # filled: never a stall
    # all solved, 16 prompts a draw, needs 16: after d draws the bound is 9.21 / (16 d) per
    # prompt, and 9.21 (16 - d) / d < 16 first at d = 6
    table = [[1, 1, 1, 1]] * 256
    with pytest.raises(RefillError, match=r"from 96 prompts \(384 responses, 6 of online.max_draws = 16 draws\)"):
        collect_mixed(table_draw(table, 16), need=16, max_draws=16, stall_alpha=1e-4)
    # with mixed groups at a rate of one in four, the early test lets every draw happen
    mixed, solved = [0, 1, 0, 0], [1, 1, 1, 1]
    table = [mixed if i % 4 == 0 else solved for i in range(64)]
    early = collect_mixed(table_draw(table, 4), need=16, max_draws=16, stall_alpha=1e-4)
    plain = collect_mixed(table_draw(table, 4), need=16, max_draws=16)
    assert (early.draws, early.kept) == (plain.draws, plain.kept) == (16, list(range(0, 64, 4)))


def test_loader_order_depends_only_on_seed_and_epoch():
    first = loader_positions(0, 10, 10, seed=42)
    assert sorted(first) == list(range(10))
    assert loader_positions(7, 6, 10, seed=42)[:3] == first[7:]           # a cursor continues the epoch
    second = loader_positions(10, 10, 10, seed=42)
    assert sorted(second) == list(range(10)) and second != first           # reshuffled per epoch
    assert loader_positions(0, 10, 10, seed=1234) != first


def run_cell(cfg, base, store=None) -> tuple[dict, list]:
    """One online cell in this process, as the flow runs it: (its counts, its round records)."""
    from stages.online_cell import run_cell as run
    store = store or Store()
    result = run(cfg, store, base)
    rounds = cfg.train.updates // cfg.train.updates_per_step
    records = [store.load("online_train", graph.online_keys(cfg, r)["online_train"]) for r in range(rounds)]
    assert [r.trained.key for r in result.rounds] == [m.key for m in records] and all(records), result.counts
    return result.counts, records


def final_policy(cfg, store=None):
    return (store or Store()).load("online_policy", graph.expected_key("online_policy", cfg))


def metrics_of(manifests) -> pl.DataFrame:
    return pl.concat([pl.read_parquet(m.path("metrics")) for m in manifests])


def test_n1_with_an_fp32_sampler_is_on_policy(base_manifest, logit_scale):
    """N = 1: every update is a step start, and the learner's log-probs equal the sampler's
    within fp32 rounding: the sampler's KV-cached forward and the trainer's full forward are
    two fp32 computations of the same log-prob (tests/tolerance.py; scale: the model's
    largest logit, terms: its hidden size). The sampler is synced in place each round: a
    sampler left at pi_0 would show the learner's drift from round 1 on."""
    cfg = load_config("smoke-online", {"train.updates_per_step": 1, "train.updates": 3, "train.method": "grpo_tis",
                                       "rollout.dtype": "float32", "train.lr": 1e-4})
    counts, records = run_cell(cfg, base_manifest)
    rows = metrics_of(records)
    assert rows["staleness"].to_list() == [0, 0, 0] and counts["engine_starts"] == 1
    tol = 2 * rounding_tol(torch.float32, *logit_scale)
    print(f"\nmax |log rho| {rows['max_abs_log_ratio'].max():.2e}, token mean {rows['abs_log_ratio'].max():.2e}, "
          f"K3 {rows['k3_mismatch'].max():.2e}; tolerance {tol:.2e}")
    assert rows["max_abs_log_ratio"].max() <= tol, rows.select("update", "max_abs_log_ratio")
    assert rows["abs_log_ratio"].max() <= tol and rows["k3_mismatch"].max() <= tol ** 2 / 2, rows
    assert rows["responses_generated"].to_list() == sorted(rows["responses_generated"].to_list())


def test_bf16_sampler_shows_a_mismatch_at_n1(base_manifest):
    cfg = load_config("smoke-online", {"train.updates_per_step": 1, "train.updates": 1, "rollout.dtype": "bfloat16"})
    rows = metrics_of(run_cell(cfg, base_manifest)[1])
    assert rows["max_abs_log_ratio"][0] > 1e-3 and rows["k3_mismatch"][0] > 1e-6


def test_the_jth_update_of_a_step_is_j_updates_stale(base_manifest, logit_scale):
    """Update j of a round trains on responses sampled j updates ago: its behavior-learner
    K3 is ~0 at j = 0 and grows with j (means over three rounds: each j sees other groups)."""
    cfg = load_config("smoke-online", {"train.updates_per_step": 4, "train.groups_per_update": 6,
                                       "train.updates": 12, "rollout.dtype": "float32", "train.lr": 3e-5})
    rows = metrics_of(run_cell(cfg, base_manifest)[1])
    assert rows["staleness"].to_list() == [0, 1, 2, 3] * 3
    k3 = rows.group_by("staleness").agg(pl.col("k3_mismatch").mean()).sort("staleness")["k3_mismatch"].to_list()
    assert k3[0] <= (2 * rounding_tol(torch.float32, *logit_scale)) ** 2 / 2 and k3[0] < k3[1] < k3[2] < k3[3], k3
    pool = Store().load("online_pool", graph.expected_key("online_pool", cfg))      # round 0's
    assert pool.summary["groups_kept"] == 24
    drawn = pl.read_parquet(pool.path("draws"))
    assert drawn.height == pool.summary["prompts_drawn"] and drawn["kept"].sum() == 24
    assert pool.summary["responses_generated"] == 8 * drawn.height


@pytest.mark.parametrize("overrides, message", [
    ({"train.updates": 5}, r"train.updates \(5\) must be a multiple of train.updates_per_step \(2\)"),
    ({"train.updates_per_step": 8, "train.updates": 8}, r"needs .* = 64 distinct mixed-reward groups but the task has 48"),
    ({"online.max_draws": 1, "online.draw_prompts": 4}, r"online.max_draws x draw size = 4 prompts can never fill"),
])
def test_online_geometry_is_checked_before_any_work(overrides, message):
    from pipeline.dag.preflight import check_run
    with pytest.raises(ConfigError, match=message) as err:     # every cell: said once
        check_run("online", "smoke-online", overrides)
    assert "\n" not in str(err.value)


def test_ggpo_stage_names_the_missing_round():
    res = subprocess.run([str(BIN / "ggpo"), "stage", "online_train", "--preset", "smoke-online", "--no-track",
                          "--set", "online.round=7", "--set", "seed=99"], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env=os.environ)
    assert res.returncode == 2
    assert "input 'pool' from stage 'online_pool' (round 7 of an online cell)" in res.stderr
    assert "input 'state' from stage 'online_train' (round 6 of an online cell)" in res.stderr
    assert "`ggpo stage online --preset smoke-online`" in res.stderr and "ggpo run online" in res.stderr


def test_report_tables_against_n_and_t_ref(tmp_path):
    from pipeline.reports import online
    evals, curves = [], []
    for method, t_ref in (("grpo", "fixed"), ("ggpo", "160")):
        for n in (1, 4):
            cell = f"{method} updates_per_step={n}"
            for seed, noise in ((42, 0.0), (7, 0.02)):
                final = 0.5 - 0.01 * n * (method == "grpo") + noise
                evals += [{"method": method, "cell": cell, "N": n, "t_ref": t_ref, "seed": seed, "update": u,
                           "accuracy": a} for u, a in ((0, 0.4), (4, 0.45), (8, final))]
                curves += [{"method": method, "cell": cell, "N": n, "t_ref": t_ref, "seed": seed, "update": u,
                            "k3_mismatch": 1e-4 * n, "ess": 1.0, "entropy": 0.1 * u, "response_length": 15.0,
                            "mean_ell": 0.5 * u + (method == "ggpo"), "success_ess": None if u % 2 else 0.9 - 0.1 * n,
                            "responses_generated": 256 * u} for u in range(1, 9)]
    table, paths = online.write(pl.DataFrame(evals), pl.DataFrame(curves), tmp_path, "mean@8")
    staleness = pl.read_csv(tmp_path / "staleness.csv")
    grpo4 = staleness.filter((pl.col("method") == "grpo") & (pl.col("N") == 4)).row(0, named=True)
    assert grpo4["mean"] == pytest.approx(0.47) and grpo4["std"] == pytest.approx(0.02 / 2 ** 0.5) and grpo4["seeds"] == 2
    assert "| grpo | fixed | 50.00 ± 1.41; stalls 0/2 | 47.00 ± 1.41; stalls 0/2 |" in table
    assert not (tmp_path / "refresh.csv").exists()      # t_ref differs only between methods: nothing to compare
    diag = pl.read_csv(tmp_path / "diagnostics.csv")
    assert diag.filter((pl.col("method") == "ggpo") & (pl.col("N") == 4))["k3_mismatch"][0] == pytest.approx(4e-4)
    # seed Table 7 / Figure 9 columns over the last quarter (updates 7 and 8); success_ess
    # skips the updates without a group of two successes (null), never counts them as 0
    ggpo1 = diag.filter((pl.col("method") == "ggpo") & (pl.col("N") == 1)).row(0, named=True)
    assert ggpo1["mean_ell"] == pytest.approx(1 + 0.5 * 7.5) and ggpo1["entropy"] == pytest.approx(0.75)
    assert ggpo1["success_ess"] == pytest.approx(0.8)
    assert ("| method | cell | N | t_ref | seeds | k3_mismatch | ess | mean_ell | entropy | success_ess | response_length "
            "| round_drift | round_drift_seq |") in table
    assert {p.name for p in paths} >= {"figure1.png", "figure2.png", "figure3_7.png", "final.csv", "report.md"}


def test_a_stopped_cell_is_evaluated_at_its_points_before_the_stop_and_at_the_stop():
    tc = load_config("smoke-online", {"train.updates": 8, "train.updates_per_step": 2, "train.eval_every": 3}).train
    assert tc.online_eval_updates(4) == [3, 6, 8]        # finished: every point and the end
    assert tc.online_eval_updates(2) == [3, 4]           # stopped in round 2: point 3, then update 4
    assert tc.online_eval_updates(3) == [3, 6]           # stopped where a point already is
    assert tc.online_eval_updates(0) == []


def test_report_marks_a_cell_that_stopped_early(tmp_path):
    """A cell that stalled (online.on_stall=stop) reports its policy at the stop as its final,
    with the update beside it; one seed stopping does not hide the other seed's final."""
    from pipeline.reports import online
    evals = []
    for n, stop in ((1, None), (16, 16)):
        for seed in (42, 7):
            last = stop if stop and seed == 42 else 64
            evals += [{"method": "ggpo", "cell": f"ggpo updates_per_step={n}", "N": n, "t_ref": "20", "seed": seed,
                       "update": u, "accuracy": a} for u, a in ((0, 0.2), (last, 0.01 if last < 64 else 0.3))]
    curves = [{"method": "ggpo", "cell": f"ggpo updates_per_step={n}", "N": n, "t_ref": "20", "seed": 42, "update": u,
               "k3_mismatch": 0.0, "ess": 1.0, "entropy": 0.1, "response_length": 9.0, "mean_ell": 0.5,
               "success_ess": 0.9, "responses_generated": 64 * u} for n in (1, 16) for u in range(1, 17)]
    table, _ = online.write(pl.DataFrame(evals), pl.DataFrame(curves), tmp_path, "mean@8")
    assert "| ggpo updates_per_step=16 | 16 | 20 | 2 | 16 | 7: 30.00, 42: 1.00 (stopped at 16) | 1/2 |" in table
    assert "| ggpo updates_per_step=1 | 1 | 20 | 2 | 64 | 30.00 ± 0.00 |" in table
    assert "A cell whose update is below 64 stopped there" in table
    assert "| ggpo | 20 | 30.00 ± 0.00; stalls 0/2 | 7: 30.00, 42: 1.00 (stopped at 16); stalls 1/2 |" in table



def test_report_without_a_base_evaluation():
    """`ggpo report` on a partly built cache: a cell's online evaluations without the base
    policy's (its mean is None) say so instead of failing on None."""
    from pipeline.reports import online
    evals = pl.DataFrame([{"method": "ggpo", "cell": "ggpo", "N": 1, "t_ref": "20", "seed": 42, "update": u,
                           "accuracy": a} for u, a in ((4, 0.25), (8, 0.5))])
    table = online.markdown_final(evals, "mean@8")
    assert "(mean@8, %; base policy not evaluated)" in table and "| ggpo | 1 | 20 | 1 | 8 | 50.00 |" in table
@pytest.mark.servers
def test_flow_with_parallel_builds_equals_sequential_rounds(tmp_path, base_manifest):
    """The online flow builds two cells' rounds concurrently (threads) while a bf16 sampler
    is being loaded; each cell's weights equal a sequential run's, bit for bit."""
    sets = ["rollout.dtype=bfloat16", "experiment.parallel=2", "train.updates=8", "train.eval_every=null"]
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect"), "GGPO_HOME": str(tmp_path / "home")}
    res = subprocess.run([str(BIN / "ggpo"), "run", "online", "--preset", "smoke-online"]
                         + [x for s in sets for x in ("--set", s)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    for method in ("grpo", "ggpo"):
        cfg = load_config("smoke-online", sets + [f"train.method={method}"])
        run_cell(cfg, base_manifest, Store(tmp_path / method))
        alone, in_flow = final_policy(cfg, Store(tmp_path / method)), final_policy(cfg)
        assert in_flow is not None and in_flow.files["weights"].sha256 == alone.files["weights"].sha256, method
    # `ggpo report` reads the same cache and prints the flow's tables
    rep = subprocess.run([str(BIN / "ggpo"), "report", "--preset", "smoke-online"] + [x for s in sets for x in ("--set", s)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stderr[-3000:]
    folder = next(line.split(": ", 1)[1] for line in res.stdout.splitlines() if line.startswith("report files: "))
    flow_table = (Path(folder) / "report.md").read_text()       # what the flow wrote and logged
    assert flow_table.strip() in rep.stdout and "Final accuracy" in flow_table, (flow_table, rep.stdout)
    assert "online_pool" in rep.stdout and "not built" not in rep.stdout


def test_report_diagnostics_and_drift_are_mean_and_sample_std_over_seeds(tmp_path):
    """Three seeds of two cells (N = 2, 4 rounds each): the diagnostics table and CSV hold
    mean and std (ddof 1) over seeds of each seed's last-quarter mean, and the drift table
    each seed's first / mean / max / last round drift, all checked against numpy float64."""
    import numpy as np

    from pipeline.reports import online
    rng, curves, evals = np.random.default_rng(1), [], []
    for method in ("grpo", "ggpo"):
        cell = f"{method} updates_per_step=2"
        for seed in (42, 1234, 2027):
            evals += [{"method": method, "cell": cell, "N": 2, "t_ref": "10", "seed": seed, "update": u,
                       "accuracy": float(rng.random())} for u in (0, 8)]
            for u in range(1, 9):
                end = u % 2 == 0
                curves.append({"method": method, "cell": cell, "N": 2, "t_ref": "10", "seed": seed, "update": u,
                               "round": (u - 1) // 2, "k3_mismatch": float(rng.random()), "ess": 1.0, "entropy": 0.1,
                               "response_length": 9.0, "mean_ell": float(rng.normal()), "success_ess": None,
                               "responses_generated": 64 * u, "round_drift": float(rng.random()) if end else None,
                               "round_drift_seq": float(rng.random()) if end else None})
    table, paths = online.write(pl.DataFrame(evals), pl.DataFrame(curves), tmp_path, "mean@8")
    diag, drift = pl.read_csv(tmp_path / "diagnostics.csv"), pl.read_csv(tmp_path / "drift.csv")

    def per_seed(method, col, pick):
        return [pick([r[col] for r in curves if r["method"] == method and r["seed"] == s and r[col] is not None
                      and (pick is not np.mean or r["update"] > 6)]) for s in (42, 1234, 2027)]
    for method in ("grpo", "ggpo"):
        row = diag.filter(pl.col("method") == method).row(0, named=True)
        for col in ("k3_mismatch", "mean_ell", "round_drift", "round_drift_seq"):
            values = per_seed(method, col, np.mean)
            assert row[col] == pytest.approx(np.mean(values), rel=1e-12)
            assert row[f"{col}_std"] == pytest.approx(np.std(values, ddof=1), rel=1e-12)
        assert row["seeds"] == 3 and row["success_ess"] is None
        assert f"{row['k3_mismatch']:.4g} ± {row['k3_mismatch_std']:.2g}" in table
        mx = per_seed(method, "round_drift", np.max)
        assert f"| {np.mean(mx):.4g} ± {np.std(mx, ddof=1):.2g} |" in table
        r2 = drift.filter((pl.col("method") == method) & (pl.col("round") == 2)).row(0, named=True)
        at = [r["round_drift"] for r in curves if r["method"] == method and r["update"] == 6]
        assert r2["update"] == 6 and r2["round_drift"] == pytest.approx(np.mean(at), rel=1e-12)
        assert r2["round_drift_std"] == pytest.approx(np.std(at, ddof=1), rel=1e-12)
    assert drift.height == 8 and "| method | cell | N | t_ref | seeds | rounds | first | mean | max | last |" in table
    assert "| grpo | grpo updates_per_step=2 | 2 | 10 | 3 | 4 ± 0 |" in table      # every seed ran 4 rounds


def test_round_log_batches_without_losing_a_round(monkeypatch):
    """A cell's rounds reach MLflow every PUBLISH_EVERY rounds and at the end, each once; the
    Prefect table gets every row (flows/online.RoundLog)."""
    from types import SimpleNamespace

    from flows import online as flow
    sent, tables = [], []
    monkeypatch.setattr(flow.tracking, "log_rounds", lambda rounds, run_id: sent.append([t.r for t, _ in rounds]))
    monkeypatch.setattr(flow, "create_table_artifact", lambda table, key, description: tables.append(len(table)))
    log = flow.RoundLog("run", "ggpo N=1 seed=42")
    for r in range(flow.PUBLISH_EVERY + 3):
        pool = SimpleNamespace(key="p" * 16, summary={"prompts_drawn": 8, "groups_kept": 8, "pool_mean_reward": 0.5})
        trained = SimpleNamespace(r=r, key="t" * 16, summary={"updates": r + 1, "final_reward": 0.5})
        log.add(r, pool, trained)
    log.publish()
    log.publish()           # nothing new: no second batch
    assert sent == [list(range(flow.PUBLISH_EVERY)), list(range(flow.PUBLISH_EVERY, flow.PUBLISH_EVERY + 3))]
    assert tables == [flow.PUBLISH_EVERY, flow.PUBLISH_EVERY + 3]
