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


# ---------------------------------------------------------------- countdown_work: the length axis (#34)

def lines_of(trace: str) -> tuple[list[str], str]:
    """(the search lines, the box's content) of a trace."""
    *lines, last = trace.split("\n")
    assert last.startswith("\\boxed{") and last.endswith("}")
    return lines, last[len("\\boxed{"):-1]


@pytest.mark.parametrize("difficulty", [1, 2])
def test_search_traces_are_seeded_correct_and_write_their_work(difficulty):
    """Every trace's box grades 1 with countdown's verifier; the same stream gives the same
    trace, another stream another; every line is true arithmetic over the numbers it has
    (a given number or an earlier line's value); W failed tries are written (a leaf that
    misses the target), no line before the last hits it with every number used, and the
    last line's value is the target. 300 problems x 3 widths: ~0.3 s."""
    from pipeline.tasks import countdown_work as cw
    rng = random.Random(1)
    for _ in range(100):
        _, reference, _ = countdown.make(difficulty, rng)
        given, target = countdown.parse_reference(reference)
        for w in (0, 3, 10):
            text = cw.trace(given, target, w, random.Random(f"{reference}/{w}"))
            assert text == cw.trace(given, target, w, random.Random(f"{reference}/{w}"))
            assert countdown.grade(text, reference) == (1.0, "ok")
            lines, box = lines_of(text)
            assert countdown.grade(f"\\boxed{{{box}}}", reference) == (1.0, "ok")
            seen = list(given)
            for line in lines:
                expr, _, v = line.partition("=")
                a, op, b = next((expr[:i], expr[i], expr[i + 1:]) for i in range(1, len(expr)) if expr[i] in "+-*")
                assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] == int(v)
                assert int(a) in seen and int(b) in seen
                seen.append(int(v))
            assert int(lines[-1].split("=")[1]) == target
    a = cw.trace((3, 5, 7), 22, 4, random.Random(0))
    assert a != cw.trace((3, 5, 7), 22, 4, random.Random(1))


def test_search_trace_width_sets_the_length_and_the_failed_tries():
    """W failed tries: at level 1 a trace of W = 0 is the solution's two lines and the box;
    the mean length grows ~9.5 tokens a try (the module's table: 27, 67, 103, 122, 141 for
    W = 0, 4, 8, 10, 12 over 2,000 problems; here 300, within 10 %); no trace exceeds its
    budget. ~0.2 s."""
    from pipeline.tasks import countdown_work as cw
    rng = random.Random(0)
    for i in range(200):
        _, reference, _ = countdown.make(1, rng)
        given, target = countdown.parse_reference(reference)
        lines, _ = lines_of(cw.trace(given, target, 0, random.Random(i)))
        assert len(lines) == 2
        for w in (4, 10):
            text = cw.trace(given, target, w, random.Random(i))
            chosen = cw.pick(given, target, w, random.Random(i), signed=False)
            assert [item[0] != target for _, item in chosen] == [True] * w + [False]
            # the trace is the chosen leaves' lines, each written once, in the search's order
            steps = dict.fromkeys(step for path, _ in chosen for step in path)
            assert lines_of(text)[0] == [line for _, line in steps]
            assert len(text) + 1 <= cw.budget(w, 3)         # the end token fits too
    means = cw.measure_lengths([0, 4, 10], problems=300)
    for w, expected in ((0, 27), (4, 67), (10, 122)):
        assert abs(means[w] - expected) / expected < 0.1, (w, means[w])


def test_search_trace_skips_a_hit_until_w_tries_are_written():
    """3 5 7 > 22 has 4 solutions in 27 leaves: with W = 23 the search meets hits before its
    23rd miss and must skip them (no line but the last reaches 22 with every number used);
    W past the search's misses writes them all, then the first hit."""
    from pipeline.tasks import countdown_work as cw
    for w in (23, cw.MAX_WIDTH):
        lines, box = lines_of(cw.trace((3, 5, 7), 22, w, random.Random(5)))
        assert box in countdown.solutions((3, 5, 7), 22)
        second = [line for line in lines if line.count("=") == 1 and line.split("=")[1] == "22"]
        assert lines[-1] in second and len(second) == 1
    assert len(lines_of(cw.trace((3, 5, 7), 22, cw.MAX_WIDTH, random.Random(5)))[0]) >= 23
    assert cw.trace((1, 1), 2, 5, random.Random(0)).endswith("\\boxed{1+1}")      # 1-1, 1*1 miss; then the hit


def test_countdown_work_task_is_countdown_with_traces():
    """countdown_work:W: countdown's splits (same problems, references, prompts), the same
    verifier on a long response, trace targets for the warm-up, a response budget; a bad W
    is one clear error. ~0.1 s."""
    from pipeline.core.errors import DatasetError
    from pipeline.tasks import countdown_work as cw
    short = catalog.splits(TaskConfig(name="countdown", n_train=100, n_eval=30))
    work = catalog.splits(TaskConfig(name="countdown_work:10", n_train=100, n_eval=30))
    for k in ("train", "eval"):
        assert [(p.problem, p.answer) for p in work[k]] == [(p.problem, p.answer) for p in short[k]]
    assert work["eval"][0].id == "countdown_work:10-d1-eval-00000"
    cfg = TaskConfig(name="countdown_work:10", n_train=100, n_eval=30)
    plain = catalog.sft_stream(TaskConfig(name="countdown", n_train=100, n_eval=30), set())
    targets = catalog.sft_targets(cfg, set())
    for _ in range(50):
        (problem, target), (same, _) = next(targets), next(plain)
        given, value = problem.split(">")
        assert problem == same and countdown.grade(target, f"{countdown.PREFIX}{given}={value}") == (1.0, "ok")
        assert target.count("\n") >= 10
    assert next(catalog.sft_targets(TaskConfig(name="countdown"), set()))[1].startswith("\\boxed{")
    assert catalog.response_budget(cfg) == cw.budget(10, 3) == 158
    assert catalog.response_budget(TaskConfig(name="countdown")) == 24
    assert catalog.is_builtin("countdown_work") and catalog.content_key(cfg) == {}
    for bad in ("countdown_work:x", "countdown_work:-1", "countdown_work:999"):
        with pytest.raises(DatasetError, match=r"countdown_work:W"):
            catalog.splits(TaskConfig(name=bad))
    # the verifier decides on the last box of a long response, within countdown's bounds
    long = "\n".join(["3+5=8", "8*7=56"] * 60) + "\n\\boxed{3*5+7}"
    assert countdown.grade(long, REF) == (1.0, "ok")
    assert countdown.grade(long.replace("\\boxed{3*5+7}", "\\boxed{3+5+7}"), REF) == (0.0, "ok")
    assert countdown.grade(long.replace("\\boxed{3*5+7}", "15+7=22"), REF) == (0.0, "no_answer")
