"""Every verify status, real math-verify, in-process and in worker processes."""
import pytest

from pipeline.grading import grade, grade_many

SLOW = r"The answer is \boxed{\int_0^1 e^{x^2} \sin(x^{3}) dx}"   # sympy takes >10 s on this


@pytest.mark.parametrize("response, answers, reward, status", [
    (r"sorted: \boxed{124568}", ("124568",), 1.0, "ok"),
    (r"\boxed{124586}", ("124568",), 0.0, "ok"),
    (r"\boxed{\frac{1}{2}}", ("0.5",), 1.0, "ok"),
    (r"\boxed{7}", ("3", "7"), 1.0, "ok"),                 # any reference answer may match
    ("124568", ("124568",), 0.0, "no_answer"),            # right number, but not boxed
    (r"\boxed{}", ("1",), 0.0, "parse_error"),
])
def test_statuses(response, answers, reward, status):
    got_reward, got_status, seconds = grade(response, answers, 5.0)
    assert (got_reward, got_status) == (reward, status) and seconds >= 0


def test_timeout_is_reward_zero_and_bounded():
    reward, status, seconds = grade(SLOW, ("1",), 0.5)
    assert (reward, status) == (0.0, "timeout")
    assert seconds < 3.0   # the limit fired; math-verify alone would take > 10 s


def test_worker_pool_matches_in_process():
    responses = [rf"\boxed{{{i}}}" for i in range(100)] + ["nothing", SLOW]
    answers = [(str(i if i % 3 else i + 1),) for i in range(100)] + [("1",), ("1",)]
    pooled = grade_many(responses, answers, 0.5, workers=2, chunk=16)
    local = [grade(r, a, 0.5) for r, a in zip(responses, answers)]
    assert [g[:2] for g in pooled] == [g[:2] for g in local]
    assert pooled[-2][1] == "no_answer" and pooled[-1][1] == "timeout"
    assert sum(g[0] for g in pooled) == sum(1 for i in range(100) if i % 3)
