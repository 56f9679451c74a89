"""The countdown task (pipeline/tasks/countdown.py): problems with many right answers, and its
verifier on hostile inputs: every case gets its status within a bounded CPU time, through
the same timed grade() and worker pool as math-verify, never a crash."""
import random
import statistics

import pytest

from pipeline.core.config import TaskConfig
from pipeline.tasks import catalog, countdown
from pipeline.tasks.grading import grade, grade_many

REF = "countdown:3 5 7=22"
BOUND_S = 0.1           # CPU seconds: any of these costs well under a millisecond to a few ms
LIMIT_S = 2.0           # the verify stage's default CPU limit; none of them comes near it

HOSTILE = [
    # (response, reward, status)
    (r"\boxed{3*5+7}", 1.0, "ok"),
    (r"\boxed{7+5*3}", 1.0, "ok"),                       # another order: also right
    (r"so \boxed{((3*5))+(7)}", 1.0, "ok"),              # redundant parentheses
    ("\\boxed{ 3 *\t5\n+ 7 }", 1.0, "ok"),               # whitespace between tokens
    (r"\boxed{3×5+7}", 1.0, "ok"),                       # the multiplication sign
    (r"\boxed{5*(7−3)+(7-7)}", 0.0, "ok"),               # U+2212 minus; 7 used thrice
    (r"\boxed{03*5+7}", 1.0, "ok"),                      # a leading zero still uses the 3
    (r"\boxed{3+5+7} or rather \boxed{3*5+7}", 1.0, "ok"),   # the last box counts
    (r"\boxed{3*5+7} or rather \boxed{3+5+7}", 0.0, "ok"),
    (r"\boxed{3+5+7}", 0.0, "ok"),                       # the right numbers, the wrong value
    (r"\boxed{22}", 0.0, "ok"),                          # the target, but no numbers used
    (r"\boxed{3*5}", 0.0, "ok"),                         # 7 unused
    (r"\boxed{3*5+7+7-7}", 0.0, "ok"),                   # 7 reused (value 22)
    (r"\boxed{3*5+7+0}", 0.0, "ok"),                     # a number not given
    (r"\boxed{3*5+7+99999999999999999999*0}", 0.0, "ok"),   # a huge number: never converted
    ("\\boxed{" + "9" * 150 + "}", 0.0, "ok"),
    ("\\boxed{" + "9" * 100_000 + "}", 0.0, "parse_error"),  # longer than MAX_CHARS
    (r"\boxed{3/0+5*7}", 0.0, "ok"),                     # division: against the rules, never evaluated
    (r"\boxed{(3*5+7)/(5-5)}", 0.0, "ok"),
    (r"\boxed{3**5**7**9**9}", 0.0, "ok"),               # a power tower: never evaluated
    (r"\boxed{3^5^7}", 0.0, "ok"),
    (r"\boxed{--3*5+7}", 0.0, "ok"),                     # unary signs (value 22): against the rules
    (r"\boxed{+3*5+7}", 0.0, "ok"),
    (r"\boxed{-(-3*5-7)}", 0.0, "ok"),
    ("\\boxed{" + "(" * 16 + "3*5+7" + ")" * 16 + "}", 1.0, "ok"),   # MAX_DEPTH deep
    ("\\boxed{" + "(" * 17 + "3*5+7" + ")" * 17 + "}", 0.0, "parse_error"),
    ("\\boxed{" + "(" * 90 + "3" + ")" * 90 + "}", 0.0, "parse_error"),
    ("\\boxed{" + "(" * 100_000 + "3" + ")" * 100_000 + "}", 0.0, "parse_error"),
    (r"\boxed{(3*5+7}", 0.0, "parse_error"),             # unbalanced
    (r"\boxed{3*5+7)}", 0.0, "parse_error"),
    (r"\boxed{[3*5]+7}", 0.0, "parse_error"),            # other brackets
    (r"\boxed{{3*5}+7}", 0.0, "parse_error"),
    (r"\boxed{٣*٥+٧}", 0.0, "parse_error"),              # Arabic-Indic digits are not digits here
    (r"\boxed{３*５+７}", 0.0, "parse_error"),             # nor are fullwidth ones
    (r"\boxed{3*5+7=22}", 0.0, "parse_error"),           # an equation, not an expression
    (r"\boxed{3*5+}", 0.0, "parse_error"),
    (r"\boxed{3 5 7}", 0.0, "parse_error"),
    (r"\boxed{__import__('os').system('true')}", 0.0, "parse_error"),
    ("\\boxed{3*5+7\x00}", 0.0, "parse_error"),
    (r"\boxed{}", 0.0, "parse_error"),
    (r"\boxed{3*5+7", 0.0, "parse_error"),               # never closed
    (r"\boxed 3*5+7", 0.0, "parse_error"),
    ("3*5+7", 0.0, "no_answer"),
    ("x" * 10_000_000 + r"\boxed{3*5+7}", 1.0, "ok"),    # a long response: one scan
    (r"\boxed{" * 100_000, 0.0, "parse_error"),
]


@pytest.mark.parametrize("response, reward, status", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_inputs_get_a_status_in_bounded_time(response, reward, status):
    got = grade(response, (REF,), LIMIT_S)
    assert (got.reward, got.status) == (reward, status)
    assert got.seconds < BOUND_S


def test_worker_pool_gives_the_same_verdicts():
    """The task's grader runs in the shared worker pool (spawned processes) like math-verify."""
    cases = [c for c in HOSTILE if len(c[0]) < 1000]
    pooled = grade_many([c[0] for c in cases], [(REF,)] * len(cases), LIMIT_S, workers=2)
    assert [(g.reward, g.status) for g in pooled] == [(c[1], c[2]) for c in cases]
    assert max(g.seconds for g in pooled) < BOUND_S


def test_math_answers_still_go_to_math_verify():
    assert grade(r"\boxed{\frac{1}{2}}", ("0.5",), 5.0)[:2] == (1.0, "ok")
    assert grade(r"\boxed{22}", ("22",), 5.0)[:2] == (1.0, "ok")        # no prefix: math-verify


def test_solutions_enumerate_every_order_and_tree():
    assert countdown.solutions((3, 5, 7), 22) == {"3*5+7", "5*3+7", "7+3*5", "7+5*3"}
    assert countdown.solutions((2, 2), 4) == {"2+2", "2*2"}
    assert countdown.solutions((1, 2), 5) == set()


@pytest.mark.parametrize("difficulty, numbers, least_mean", [(1, 3, 4.0), (2, 4, 20.0)])
def test_problems_have_many_correct_answers(difficulty, numbers, least_mean):
    """Every drawn problem is solvable (its drawn expression grades 1); on average it has
    several distinct correct expressions (measured: 5.0 at level 1, 29 at level 2)."""
    rng, counts = random.Random(0), []
    for _ in range(300):
        problem, reference, expression = countdown.make(difficulty, rng)
        given, target = countdown.parse_reference(reference)
        assert len(given) == numbers and all(1 <= n <= 9 for n in given) and target >= 1
        assert problem == f"{' '.join(map(str, given))}>{target}"
        assert expression in countdown.solutions(given, target)
        assert countdown.grade(f"\\boxed{{{expression}}}", reference) == (1.0, "ok")
        counts.append(len(countdown.solutions(given, target)))
    assert statistics.mean(counts) >= least_mean
    assert sum(c >= 2 for c in counts) / len(counts) >= 0.95


def test_task_splits_and_warm_up_targets():
    cfg = TaskConfig(name="countdown", n_train=200, n_eval=50)
    s = catalog.splits(cfg)
    assert s == catalog.splits(cfg) and len(s["train"]) == 200 and len(s["eval"]) == 50
    assert all(p.answer.startswith(countdown.PREFIX) for p in s["train"] + s["eval"])
    assert catalog.format_prompt(s["train"][0].problem).startswith("Q:") and ">" in s["train"][0].problem
    stream = catalog.sft_stream(cfg, {p.problem for p in s["eval"]})
    pairs = [next(stream) for _ in range(200)]
    # each warm-up target is a correct response of its own problem
    for problem, boxed in pairs:
        given, target = problem.split(">")
        assert countdown.grade(catalog.format_target(boxed), f"{countdown.PREFIX}{given}={target}") == (1.0, "ok")
    # and a random one: its numbers come in the problem's order about 1 time in 6, not always
    in_order = sum("".join(c for c in boxed if c.isdigit()) == problem.split(">")[0].replace(" ", "")
                   for problem, boxed in pairs)
    assert in_order / len(pairs) < 0.4


def test_base_group_statistics():
    """mean@m, the share of mixed groups and distinct correct responses per group with a success."""
    from stages.base_model import group_stats
    groups = [[(r"\boxed{3*5+7}", 1.0), (r"\boxed{7+5*3}", 1.0), (r"\boxed{3*5+7}", 1.0), ("x", 0.0)],
              [("x", 0.0)] * 4,
              [(r"\boxed{1}", 1.0)] * 4]
    stats = group_stats(groups)
    assert stats["check_mean_at_4"] == 7 / 12
    assert stats["check_mixed_fraction"] == 1 / 3
    assert stats["check_distinct_correct"] == (2 + 1) / 2


@pytest.mark.parametrize("answer", ["countdown:3 5 x=22", "countdown:3 5 7", "countdown:=22", "countdown:3 5 7=2.5"])
def test_a_malformed_countdown_reference_in_a_task_file_names_the_row(tmp_path, answer):
    import polars as pl

    from pipeline.core.errors import DatasetError
    from pipeline.tasks import catalog
    path = tmp_path / "t.parquet"
    pl.DataFrame({"id": ["a", "b"], "problem": ["Q:3 5 7>22\nA:", "Q:1 2>3\nA:"],
                  "answer": ["countdown:3 5 7=22", answer]}).write_parquet(path)
    with pytest.raises(DatasetError, match=r"t\.parquet: row 1 \(id b\), field 'answer': .* is not a countdown reference"):
        catalog.load_file(path)
