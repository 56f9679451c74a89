"""Bring your own pool (#18): `ggpo pool import SOURCE`, `ggpo stage score --model PATH`, the
offline flow on an imported pool, and one line for every kind of bad source.

Real files (JSONL, Parquet, a folder saved by `datasets`), the real tokenizer of the tiny
base model, real math-verify grading and real training; nothing is mocked.
"""
from __future__ import annotations

import json
import math
import os
import subprocess

import polars as pl
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.cli import main
from pipeline.core import schemas
from pipeline.core.config import load_config
from pipeline.core.seeding import py_random
from pipeline.core.store import Store, model_path
from pipeline.dag import graph
from pipeline.models.hf import load_tokenizer
from stages import evaluate, pool_import, score, train

from conftest import BIN, REPO
from tolerance import rounding_tol

EXAMPLE = REPO / "data" / "example_completions.jsonl"
NO_BEHAVIOR = ["experiment.methods=[grpo,agro,ggpo]", "train.anchor=old"]


def ggpo(*args, env=None, timeout=600):
    return subprocess.run([str(BIN / "ggpo"), *args], capture_output=True, text=True, cwd=REPO,
                          env=os.environ | (env or {}), timeout=timeout)


def sets(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def example_rows() -> list[dict]:
    return [json.loads(line) for line in EXAMPLE.read_text().splitlines()]


def write_jsonl(path, rows: list[dict]):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def one_line(res) -> str:
    """The single `ggpo:` line of a failed command (exit 2, no traceback)."""
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("ggpo:")]
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    return lines[0]


def imported(source, base_manifest, store=None, **pool):
    """(config, pool_import manifest) of `source` under the smoke preset."""
    cfg = load_config("smoke", {"pool.source": str(source)} | {f"pool.{k}": v for k, v in pool.items()})
    return cfg, pool_import.run(cfg, {"base": base_manifest}, store=store)


# ------------------------------------------------------------------ end to end

def test_example_imports_trains_three_methods_and_evaluates_through_the_cli(base_manifest):
    """data/example_completions.jsonl: import -> train GGPO, AGRO, GRPO anchored at old ->
    evaluate; every rerun is a cache hit; the pool has no behavior log-probs, so the
    spec-9 diagnostics that need them are empty."""
    first = ggpo("pool", "import", str(EXAMPLE), "--preset", "smoke", "--no-track")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "pool_import: built" in first.stdout or "pool_import: cache hit" in first.stdout
    again = ggpo("pool", "import", str(EXAMPLE), "--preset", "smoke", "--no-track")
    assert "pool_import: cache hit" in again.stdout and "train on it: ggpo stage train" in again.stdout
    cfg = load_config("smoke", {"pool.source": str(EXAMPLE)})
    manifest = Store().load("pool_import", graph.expected_key("pool_import", cfg))
    s = manifest.summary
    assert (s["groups_source"], s["groups_kept"] + s["groups_all_correct"] + s["groups_all_wrong"]) == (48, 48)
    assert s["groups_kept"] == 39 and s["behavior_logprobs"] == "none" and s["rewards"] == "graded (math-verify)"
    assert s["rewards_compared"] == 384 and s["reward_disagreements"] == 0      # the file's rewards are math-verify's
    orders = set()
    for method in ("train.method=ggpo", "train.method=agro", "train.method=grpo"):
        argv = ["stage", "train", "--preset", "smoke", "--no-track"] + sets(f"pool.source={EXAMPLE}", method,
                                                                             "train.anchor=old")
        res = ggpo(*argv)
        assert res.returncode == 0, res.stderr[-3000:]
        assert "cache hit" in ggpo(*argv).stdout
        trained = Store().load("train", graph.expected_key("train", load_config("smoke", argv[6::2])))
        orders.add(trained.summary["group_order_sha256"])
        metrics = pl.read_parquet(trained.path("metrics"))
        assert metrics["k3_mismatch"].is_null().all() and metrics["ess"].is_null().all()
        assert metrics["abs_log_ratio"].is_null().all() and metrics["loss"].is_not_null().all()
    assert len(orders) == 1                       # the same seeded group order for every method
    res = ggpo("stage", "evaluate", "--preset", "smoke", "--no-track",
               *sets(f"pool.source={EXAMPLE}", "train.method=ggpo", "train.anchor=old"))
    assert res.returncode == 0 and "mean_at_4" in res.stdout, res.stderr[-3000:]


def test_grpo_tis_is_refused_until_the_pool_is_scored(base_manifest, logit_scale):
    """GRPO+TIS on a pool without behavior log-probs: one line, exit 2; `ggpo stage score
    --model PATH` records teacher-forced log-probs, marked as scored by that model, and
    then it trains, with the diagnostics computed."""
    tis = sets(f"pool.source={EXAMPLE}", "train.method=grpo_tis")
    ggpo("pool", "import", str(EXAMPLE), "--preset", "smoke", "--no-track")
    refused = one_line(ggpo("stage", "train", "--preset", "smoke", "--no-track", *tis))
    assert "train.method=grpo_tis: GRPO+TIS needs behavior log-probs" in refused
    assert "ggpo stage score --model PATH" in refused
    cfg = load_config("smoke", tis[1::2])       # past the preflight, the train stage refuses it too
    with pytest.raises(train.TrainingError, match="GRPO\\+TIS needs behavior log-probs"):
        train.run(cfg, {"base": base_manifest, "pool": Store().load("pool_import", graph.expected_key("pool_import", cfg))})
    assert Store().load("train", graph.expected_key("train", cfg)) is None
    model = model_path(base_manifest)
    scored = ggpo("stage", "score", "--preset", "smoke", "--no-track", "--model", model, *tis)
    assert scored.returncode == 0, scored.stderr[-3000:]
    cfg = load_config("smoke", tis[1::2] + [f"pool.score_model={model}"])
    manifest = Store().load("score", graph.expected_key("score", cfg))
    assert manifest.summary["behavior_logprobs"] == f"scored by {model}, not sampled"
    pool = pl.read_parquet(manifest.path("train_pool"))
    assert set(pool["logprobs_mode"]) == {f"scored by {model}, not sampled"}
    assert (pool["behavior_logprobs"].list.len() == pool["response_token_ids"].list.len()).all()
    assert pool["behavior_logprobs"].explode().max() <= 0
    res = ggpo("stage", "train", "--preset", "smoke", "--no-track", *tis, "--model", model)
    assert res.returncode == 0, res.stderr[-3000:]
    trained = Store().load("train", graph.expected_key("train", cfg))
    assert trained.summary["pool_behavior_logprobs"] == f"scored by {model}, not sampled"
    metrics = pl.read_parquet(trained.path("metrics"))
    assert metrics["k3_mismatch"].is_not_null().all() and metrics["ess"].is_not_null().any()
    # the first update runs on pi_0 itself: the scored log-probs are the learner's (the same
    # model and code, other micro-batches), so |log rho| is rounding only
    tol = 2 * rounding_tol(torch.float32, *logit_scale)
    assert metrics["abs_log_ratio"][0] <= tol < metrics["abs_log_ratio"][3]


@pytest.mark.servers
def test_offline_flow_on_a_renamed_parquet_with_boolean_flags(base_manifest, tmp_path):
    """One row per problem with other column names and correctness flags as booleans:
    `ggpo run offline --set pool.source=...` skips rollout, verify and filter, trains every
    method on the imported pool in one group order, evaluates, and logs the source as the
    parent run's dataset input (name, digest, rows); the rerun builds nothing."""
    rows = example_rows()
    path = tmp_path / "generations.parquet"
    pl.DataFrame({"question": [r["problem"] for r in rows], "answer": [r["answer"] for r in rows],
                  "generations": [r["responses"] for r in rows],
                  "correctness": [[bool(x) for x in r["rewards"]] for r in rows]}).write_parquet(path)
    mapping = {"problem": "question", "responses": "generations", "rewards": "correctness"}
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect"), "GGPO_HOME": str(tmp_path / "home")}
    items = [f"pool.source={path}", f"pool.map={json.dumps(mapping)}"] + NO_BEHAVIOR
    argv = [str(BIN / "ggpo"), "run", "offline", "--preset", "smoke", *sets(*items)]
    res = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    rerun = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    out = rerun.stdout + rerun.stderr
    assert rerun.returncode == 0 and "pool_import: cache hit" in out, out[-4000:]
    assert ": building " not in out                      # the rerun is all cache hits
    cfg = load_config("smoke", items[:2])
    first = res.stdout + res.stderr         # rollout, verify and filter never ran
    assert "pool_import-seed42" in first and not any(f"{stage}-seed" in first for stage in ("rollout", "verify", "filter"))
    pool = Store().load("pool_import", graph.expected_key("pool_import", cfg))
    assert pool.summary["groups_kept"] == 39 and pool.summary["reward_disagreements"] == 0
    orders = {Store().load("train", graph.expected_key("train", cfg.updated({"train.method": m, "train.anchor": "old"})))
              .summary["group_order_sha256"] for m in ("grpo", "agro", "ggpo")}
    assert len(orders) == 1
    from mlflow import MlflowClient
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("ggpo-offline").experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 2
    parent = parents[0]
    (dataset,) = [d.dataset for d in parent.inputs.dataset_inputs]
    assert dataset.name == f"pool source {path}" and dataset.digest == pool.summary["source_digest"][:36]
    assert json.loads(dataset.profile) == {"num_rows": 48}
    assert parent.data.tags["ggpo.pool_source_digest"] == pool.summary["source_digest"]


def test_flow_refuses_grpo_tis_on_a_pool_without_logprobs_before_any_work():
    res = ggpo("run", "offline", "--preset", "smoke", *sets(f"pool.source={EXAMPLE}", "experiment.methods=[ggpo,grpo_tis]"),
               env={"PREFECT_API_URL": ""}, timeout=120)
    assert res.stdout == "" and "prefect" not in res.stderr.lower()
    assert "experiment cell 'grpo_tis': train.method=grpo_tis: GRPO+TIS needs behavior log-probs" in one_line(res)


# ------------------------------------------------------------------ keys, groups, tokens, rewards

def test_one_byte_of_the_source_rebuilds_and_its_path_does_not(tmp_path, base_manifest):
    path = tmp_path / "a.jsonl"
    path.write_bytes(EXAMPLE.read_bytes())
    cfg, first = imported(path, base_manifest)
    assert imported(path, base_manifest)[1].cache_hit
    moved = tmp_path / "b.jsonl"
    moved.write_bytes(path.read_bytes())
    assert graph.expected_key("pool_import", cfg.updated({"pool.source": str(moved)})) == first.key
    data = bytearray(path.read_bytes())
    data[data.index(b"boxed{1447889}") + 6] ^= 1          # one response's digit 1 -> 0
    path.write_bytes(bytes(data))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    _, second = imported(path, base_manifest)
    assert not second.cache_hit and second.key != first.key
    assert graph.expected_key("train", cfg) != graph.expected_key("train", cfg.updated({"pool.source": str(moved)}))


def test_groups_reach_m_by_a_named_seeded_choice_and_smaller_ones_are_dropped(tmp_path, base_manifest):
    """One row per response, groups of 10, 8 and 5 (m = 8): the 10 keep the 8 that the stream
    (seed, "pool_import/choose/<id>") picks, recorded in provenance.parquet; the 5 are dropped
    and counted; another seed picks others, the same seed the same."""
    rows = []
    for pid, n in (("ten", 10), ("eight", 8), ("five", 5)):
        rows += [{"id": pid, "problem": "3142", "answer": "1234",
                  "response": f"\\boxed{{{1234 if k % 2 else 1000 + k}}} ({k})"} for k in range(n)]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    cfg, m = imported(path, base_manifest)
    s = m.summary
    assert (s["groups_source"], s["groups_subsampled"], s["groups_smaller_than_m"], s["groups_kept"]) == (3, 1, 1, 2)
    assert s["source_shape"] == "response" and s["choice_stream"] == "(seed 42, pool_import/choose/<problem id>)"
    prov = pl.read_parquet(m.path("provenance"))
    picks = sorted(py_random(42, "pool_import/choose/ten").sample(range(10), 8))
    assert prov.filter(pl.col("prompt_id") == "ten")["source_row"].to_list() == picks
    assert prov.filter(pl.col("prompt_id") == "eight")["source_row"].to_list() == list(range(10, 18))
    assert pq.read_schema(m.path("provenance")).remove_metadata() == schemas.POOL_PROVENANCE
    other = pool_import.run(cfg.updated({"seed": 7}), {"base": base_manifest})
    other_picks = pl.read_parquet(other.path("provenance")).filter(pl.col("prompt_id") == "ten")["source_row"]
    assert other_picks.to_list() == sorted(py_random(7, "pool_import/choose/ten").sample(range(10), 8)) != picks
    m4 = pool_import.run(cfg.updated({"rollout.group_size": 4}), {"base": base_manifest})
    assert (m4.summary["groups_subsampled"], m4.summary["groups_smaller_than_m"]) == (3, 0)


def test_tokenized_as_the_trainer_with_given_logprobs_and_truncation_marked(tmp_path, base_manifest):
    """Prompts as the rollout stage tokenizes them; a response is its text's tokens + EOS
    (what an engine records for a sample that stopped); given log-probs are kept (one per
    token, EOS included, or without it: the sampler stopped at its budget); a response over
    rollout.max_new_tokens is cut there and marked; GRPO+TIS trains on given log-probs."""
    tok = load_tokenizer(model_path(base_manifest))
    short = [{"id": "s", "problem": "312", "answer": "123", "response": f"\\boxed{{{123 if k % 2 else 132}}} {k}",
              "reward": k % 2} for k in range(8)]
    long = [{"id": "l", "problem": "987", "answer": "789", "response": "\\boxed{789}" + " pad" * 5 + str(k),
             "reward": k % 2} for k in range(8)]
    rows = short + long
    for row in rows:
        row["behavior_logprobs"] = [-0.5] * (len(tok(row["response"], add_special_tokens=False)["input_ids"]) + 1)
    rows[7]["behavior_logprobs"] = rows[7]["behavior_logprobs"][:-1]      # stopped without an EOS
    cfg, m = imported(write_jsonl(tmp_path / "given.jsonl", rows), base_manifest, trust_rewards=True)
    assert m.summary["behavior_logprobs"] == "given" and m.summary["groups_kept"] == 2
    pool_rows = pl.read_parquet(m.path("train_pool")).sort(["group", "sample"])
    from pipeline.tasks.catalog import Problem
    from stages.rollout import prompt_table
    assert pool_rows["prompt_token_ids"][0].to_list() == prompt_table([Problem("s", "312", "123")], tok)[
        "prompt_token_ids"][0]
    ids = tok(rows[0]["response"], add_special_tokens=False)["input_ids"]
    assert pool_rows["response_token_ids"][0].to_list() == ids + [tok.eos_token_id]
    assert pool_rows["finish_reason"].to_list()[:8] == ["stop"] * 7 + ["length"]
    assert pool_rows["response_token_ids"][7].to_list()[-1] != tok.eos_token_id
    assert (pool_rows["behavior_logprobs"].list.len() == pool_rows["response_token_ids"].list.len()).all()
    assert set(pool_rows["engine"]) == {"import"} and set(pool_rows["logprobs_mode"]) == {"given"}
    longest = max(len(tok(r["response"], add_special_tokens=False)["input_ids"]) for r in long)
    assert m.summary["responses_truncated"] == 8 and longest + 1 > cfg.rollout.max_new_tokens
    cut = pool_rows.filter(pl.col("prompt_id") == "l")
    assert (cut["finish_reason"] == "length").all() and (cut["response_length"] == cfg.rollout.max_new_tokens).all()
    assert cut["response_text"][0] == tok.decode(cut["response_token_ids"][0], skip_special_tokens=True)
    assert pl.read_parquet(m.path("provenance")).filter(pl.col("prompt_id") == "l")["truncated"].all()
    trained = train.run(cfg.updated({"train.method": "grpo_tis"}), {"base": base_manifest, "pool": m})
    assert pl.read_parquet(trained.path("metrics"))["k3_mismatch"].is_not_null().all()


def test_truncated_response_is_graded_on_what_is_kept(tmp_path, base_manifest):
    rows = [{"id": "a", "problem": "21", "answer": "12",
             "responses": ["\\boxed{12}", "x" * 30 + "\\boxed{12}", "\\boxed{21}"]}]
    cfg = load_config("smoke", {"pool.source": str(write_jsonl(tmp_path / "t.jsonl", rows)), "rollout.group_size": 3})
    m = pool_import.run(cfg, {"base": base_manifest})
    prov = pl.read_parquet(m.path("provenance")).sort("sample")
    assert prov["truncated"].to_list() == [False, True, False]
    assert prov["reward"].to_list() == [1.0, 0.0, 0.0] and prov["status"][1] == "no_answer"
    pool_rows = pl.read_parquet(m.path("train_pool")).sort("sample")
    assert pool_rows["finish_reason"].to_list() == ["stop", "length", "stop"]
    assert pool_rows["response_length"][1] == 20 and pool_rows["response_text"][1] == "x" * 20


def test_chat_prompt_is_the_template_evaluation_uses(tmp_path, base_manifest):
    """pool.prompt=chat builds prompts with the model's chat template exactly as
    eval.prompt=chat does (a copy of the tiny model given a chat template)."""
    import shutil
    folder = tmp_path / "chat-model"
    shutil.copytree(model_path(base_manifest), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    cfg = load_config("smoke", {"pool.source": str(EXAMPLE), "pool.prompt": "chat", "model.name_or_path": str(folder),
                                "eval.prompt": "chat", "pool.trust_rewards": True})
    base = graph.run("base", cfg, {}, Store())
    m = pool_import.run(cfg, {"base": base})
    tok = load_tokenizer(str(folder))
    row = pl.read_parquet(m.path("train_pool")).row(0, named=True)
    problem = next(r["problem"] for r in example_rows() if r["id"] == row["prompt_id"])
    _, to_prompt = evaluate.prompt_builder(cfg, tok)
    assert to_prompt(problem).startswith("<user>") and row["prompt_token_ids"] == tok(to_prompt(problem))["input_ids"]
    assert m.summary["prompt_template"].startswith("chat template of the model")


def test_given_rewards_are_trusted_or_graded_with_disagreements_counted(tmp_path, base_manifest):
    rows = example_rows()
    flipped = 0
    for r in rows[:5]:
        r["rewards"][0] = 1 - r["rewards"][0]
        flipped += 1
    path = write_jsonl(tmp_path / "flipped.jsonl", rows)
    _, graded = imported(path, base_manifest)
    assert graded.summary["reward_disagreements"] == flipped and graded.summary["rewards_compared"] == 384
    assert math.isclose(graded.summary["reward_disagreement_rate"], flipped / 384)
    _, trusted = imported(path, base_manifest, trust_rewards=True)
    prov = pl.read_parquet(trusted.path("provenance"))
    assert set(prov["status"]) == {"given"} and prov["reward"].to_list() == prov["given_reward"].to_list()
    assert trusted.summary["rewards"] == "given (pool.trust_rewards)" and "reward_disagreements" not in trusted.summary
    assert graded.key != trusted.key


def test_identical_responses_warn_and_are_kept(tmp_path, base_manifest, caplog):
    rows = example_rows()[:3]
    rows[1]["responses"] = ["\\boxed{1}"] * 8
    cfg, m = imported(write_jsonl(tmp_path / "same.jsonl", rows), base_manifest)
    assert m.summary["groups_identical_responses"] == 1 and m.summary["groups_source"] == 3
    assert "1 group(s) have responses that are all the same string (the first: line 2" in caplog.text
    assert m.summary["groups_all_wrong"] >= 1        # kept through the import; the mixed filter decides


def test_a_folder_saved_by_datasets_imports_and_its_fingerprint_keys_it(tmp_path, base_manifest):
    import datasets
    rows = example_rows()
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "saved"))
    cfg, m = imported(tmp_path / "saved", base_manifest)
    assert m.summary["source_kind"] == "saved" and m.summary["groups_kept"] == 39
    datasets.DatasetDict({"test": ds.select(range(20))}).save_to_disk(str(tmp_path / "split"))
    small = cfg.updated({"pool.source": str(tmp_path / "split"), "pool.split": "test"})
    assert graph.expected_key("pool_import", small) != m.key
    assert pool_import.run(small, {"base": base_manifest}).summary["source_rows"] == 20


# ------------------------------------------------------------------ bad input: one line, exit 2, nothing written

def lp_rows(bad) -> list[dict]:
    rows = [{"id": "p", "problem": "21", "answer": "12", "response": "\\boxed{12}", "behavior_logprobs": [-0.1] * 11},
            {"id": "p", "problem": "21", "answer": "12", "response": "\\boxed{21}", "behavior_logprobs": [-0.1] * 11}]
    rows[1]["behavior_logprobs"] = bad
    return rows


EXAMPLE_HEAD = [{"id": "a", "problem": "21", "answer": "12", "responses": ["\\boxed{12}", "\\boxed{21}"],
                 "rewards": [1, 0]},
                {"id": "b", "problem": "312", "answer": "123", "responses": ["\\boxed{123}", "\\boxed{132}"],
                 "rewards": [1, 0]}]


def edited(i: int, **fields) -> list[dict]:
    rows = json.loads(json.dumps(EXAMPLE_HEAD))
    rows[i].update(fields)
    return rows


BAD = {
    "missing column": ([{k: v for k, v in r.items() if k != "answer"} for r in EXAMPLE_HEAD], [],
                       "missing required column 'answer'"),
    "map to nothing": (EXAMPLE_HEAD, ["--map", "problem=question"], "--map problem=question: the source has no "
                                                                    "column 'question'"),
    "empty list": (edited(1, responses=[], rewards=[]), [], "line 2: field 'responses' is an empty list"),
    "non-numeric reward": (edited(1, rewards=[1, "yes"]), [], "line 2: field 'rewards' holds 'yes' at response 1, "
                                                              "not a number or boolean"),
    "renamed non-numeric reward": ([{k if k != "rewards" else "correctness": v for k, v in r.items()} for r in
                                    edited(0, rewards=["right", False])], ["--map", "rewards=correctness"],
                                   "line 1: field 'correctness' (pool field rewards) holds 'right' at response 0"),
    "duplicate rows": ([{"id": "p", "problem": "21", "answer": "12", "response": r} for r in ("a", "b", "a")], [],
                       "line 3: field 'response' repeats line 1: the same problem id 'p' and response"),
    "duplicate problem ids": (edited(1, id="a"), [], "line 2: field 'id' repeats line 1's id 'a'"),
    "NaN log-prob": (lp_rows([-0.1, float("nan")] + [-0.1] * 9), [],
                     "line 2: field 'behavior_logprobs' holds nan at token 1"),
    "log-probs for some": (lp_rows(None), [], "line 2: field 'behavior_logprobs' is empty for response 0 while other"),
    "trust without rewards": ([{k: v for k, v in r.items() if k != "rewards"} for r in EXAMPLE_HEAD],
                              ["--trust-rewards"], "--trust-rewards (pool.trust_rewards) but the source has no column "
                                                   "'rewards'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_source_is_one_line_naming_file_row_and_field(case, tmp_path, capsys):
    rows, extra, says = BAD[case]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    assert main(["pool", "import", str(path), "--preset", "smoke", "--no-track", *extra]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("ggpo:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"ggpo: {path}: ") and says in lines[0], lines[0]
    assert "(fix the source, or map its columns" in lines[0]
    key = graph.expected_key("pool_import", load_config("smoke", {"pool.source": str(path)}))
    assert not Store().folder("pool_import", key).exists()          # refused before any work


def test_bad_logprob_length_and_parquet_nan_are_one_line_and_nothing_is_written(tmp_path, base_manifest, capsys):
    """Found once the tokenizer has spoken (the length) or in a Parquet row: still one line,
    and the import's folder holds no manifest and no pool."""
    path = write_jsonl(tmp_path / "short.jsonl", lp_rows([-0.1] * 5))
    m2 = ["--set", "rollout.group_size=2"]
    assert main(["pool", "import", str(path), "--preset", "smoke", "--no-track", *m2]) == 2
    line = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("ggpo:")][-1]
    assert f"{path}: line 2: field 'behavior_logprobs' has 5 entries for response 0, which tokenizes to 10 " \
           "tokens (11 with EOS)" in line
    cfg = load_config("smoke", {"pool.source": str(path), "rollout.group_size": 2})
    folder = Store().folder("pool_import", graph.expected_key("pool_import", cfg))
    assert not (folder / "manifest.json").exists() and not (folder / "train_pool.parquet").exists()
    nan = tmp_path / "nan.parquet"
    pl.DataFrame(lp_rows([-0.1] * 10 + [float("nan")])).write_parquet(nan)
    assert main(["pool", "import", str(nan), "--preset", "smoke", "--no-track", *m2]) == 2
    assert f"{nan}: row 1: field 'behavior_logprobs' holds nan at token 10" in capsys.readouterr().err


def test_unloadable_dataset_id_is_one_line():
    res = ggpo("pool", "import", "nobody-here/no-such-dataset", "--preset", "smoke", "--no-track",
               env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}, timeout=120)
    line = one_line(res)
    assert line.startswith("ggpo: cannot load dataset id nobody-here/no-such-dataset: ") and "(no internet here?" in line
    assert "no such file" in one_line(ggpo("pool", "import", "data/nope.jsonl", "--preset", "smoke", "--no-track"))


def test_score_needs_a_model_folder_and_the_same_tokenizer(tmp_path, base_manifest):
    cfg = load_config("smoke", {"pool.source": str(EXAMPLE), "pool.score_model": str(tmp_path)})
    with pytest.raises(Exception, match="not a local Hugging Face model folder"):
        score.model_folder(cfg)
    line = one_line(ggpo("stage", "score", "--preset", "smoke", "--no-track", "--model", str(tmp_path / "none"),
                         *sets(f"pool.source={EXAMPLE}")))
    assert f"pool.score_model={tmp_path / 'none'}: no such folder" in line
