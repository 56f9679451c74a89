"""Every verify status, real math-verify, in-process and in the shared worker pool; the
same verdicts on a quiet and on a loaded machine (CPU-time limits, one retry)."""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from pipeline.tasks.grading import RETRY_FACTOR, grade, grade_many, pool_info, summary

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
    got_reward, got_status, seconds, _ = grade(response, answers, 5.0)
    assert (got_reward, got_status) == (reward, status) and seconds >= 0


def test_timeout_is_reward_zero_and_bounded():
    reward, status, seconds, _ = grade(SLOW, ("1",), 0.5)
    assert (reward, status) == (0.0, "timeout")
    assert seconds < 1.0   # CPU seconds: the limit fired; math-verify alone would take > 10 s


def integral(j: int) -> str:
    """A response whose grading costs more CPU as j grows (sympy evaluates the integral to
    compare it): about 0.2 s at j = 2 and 2.8 s at j = 10 on one machine, well under 2 s on
    a faster one. Tests measure the cost on the machine they run on (cpu_cost)."""
    return rf"The area is \boxed{{\int_0^{{{j}}} x^{{{j}}} \sin(x) dx}}"


def cpu_cost(response: str, answers: tuple[str, ...] = ("1",)) -> float:
    """The CPU seconds grading `response` costs here, under a limit far above it."""
    graded = grade(response, answers, 600.0)
    assert graded.status == "ok", graded
    return graded.seconds


def busy_machine():
    """Every core busy with a spinning process, until the returned processes are killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]


def limits_from_costs(fast: list[str]) -> tuple[str, float, float]:
    """(slow response, limit, retry limit) set from costs measured here: the limit is the
    geometric mean of the fast responses' largest cost and the slow one's (a margin of at
    least 2x on both sides), the retry limit 1.6x the slow one's cost. The slow response is
    the first integral costing at least 4x the fast ones; SLOW costs several times any of
    these (about 4x the j = 10 integral), so it exceeds both limits on any processor."""
    top = max(cpu_cost(r) for r in fast)
    for j in range(8, 24):
        cost = cpu_cost(integral(j))
        if cost >= 4 * top:
            return integral(j), (top * cost) ** 0.5, 1.6 * cost
    pytest.fail(f"no integral up to j = 23 costs 4x the fast responses' {top:.2f} CPU s")


def test_verdicts_do_not_depend_on_load():
    """The same responses graded on a quiet machine and with every core busy: identical
    rewards, statuses and retries. Limits are set from the costs measured on this machine
    (limits_from_costs): the fast integrals inside the CPU limit (a wall-clock limit would
    fail some of them under load), the slow one over it but inside the retry, SLOW over
    both. Under load each grade takes 2-3 times the wall time, and the verdicts stay."""
    fast = [integral(j) for j in (2, 3, 4, 5, 6)]
    slow, limit, retry = limits_from_costs(fast)
    responses = fast + [slow, SLOW, r"\boxed{3}"]
    answers = [("1",)] * (len(responses) - 1) + [("3",)]
    quiet = grade_many(responses, answers, limit, workers=2, chunk=1, retry_timeout_s=retry)
    load = busy_machine()
    try:
        loaded = grade_many(responses, answers, limit, workers=2, chunk=1, retry_timeout_s=retry)
    finally:
        for p in load:
            p.kill()
            p.wait()
    assert [g[:2] for g in quiet] == [g[:2] for g in loaded]
    assert [g.retried for g in quiet] == [g.retried for g in loaded] == [False] * 5 + [True, True, False]
    assert [g.status for g in loaded] == ["ok"] * 6 + ["timeout", "ok"] and loaded[-1].reward == 1.0
    counts = summary(loaded)
    assert (counts["grading_retries"], counts["grading_timeouts"], counts["status_ok"]) == (2, 1, 7)


def test_worker_pool_matches_in_process():
    responses = [rf"\boxed{{{i}}}" for i in range(100)] + ["nothing", SLOW]
    answers = [(str(i if i % 3 else i + 1),) for i in range(100)] + [("1",), ("1",)]
    pooled = grade_many(responses, answers, 0.5, workers=2, chunk=16)
    local = [grade(r, a, 0.5) for r, a in zip(responses, answers)]
    assert [g[:2] for g in pooled] == [g[:2] for g in local]
    assert pooled[-2][1] == "no_answer" and pooled[-1][1] == "timeout"
    assert sum(g[0] for g in pooled) == sum(1 for i in range(100) if i % 3)


# ---- the shared worker pool: one per process, every core, robust to stuck workers

def _batch(n: int):
    """n responses with known grades: boxed right (i % 3 != 0), boxed wrong, unboxed (i % 7 == 0)."""
    responses, answers, expected = [], [], []
    for i in range(n):
        if i % 7 == 0:
            responses.append(f"the answer is {i}")
            expected.append((0.0, "no_answer"))
        else:
            responses.append(rf"so \boxed{{{i if i % 3 else i + 1}}}")
            expected.append((1.0 if i % 3 else 0.0, "ok"))
        answers.append((str(i),))
    return responses, answers, expected


def _in_thread(fn, *args, **kwargs):
    """fn's result, called from a non-main thread (as a flow runs stages)."""
    out = []
    thread = threading.Thread(target=lambda: out.append(fn(*args, **kwargs)))
    thread.start()
    thread.join(timeout=120)
    assert out, "the call did not finish in 120 s"
    return out[0]


def test_pathological_response_keeps_its_chunk_mates():
    responses, answers, expected = _batch(40)
    responses[17], answers[17] = SLOW, ("1",)
    expected[17] = (0.0, "timeout")
    got = grade_many(responses, answers, 1.0, workers=2, chunk=64)     # all 40 in one chunk
    assert [g[:2] for g in got] == expected
    assert got[17].retried and not any(g.retried for i, g in enumerate(got) if i != 17)
    assert got[17].seconds < RETRY_FACTOR * 1.0 + 1.0                 # the retry's CPU limit fired


def test_pool_is_reused_across_calls_and_threads_and_reports_progress():
    responses, answers, expected = _batch(50)
    first = grade_many(responses, answers, 2.0, workers=2)
    pids = pool_info()["pids"]
    counts = []
    second = _in_thread(grade_many, responses, answers, 2.0, workers=2, progress=counts.append)
    assert [g[:2] for g in first] == [g[:2] for g in second] == expected
    assert pool_info()["pids"] == pids and len(pids) == 2 and all(p != os.getpid() for p in pids)
    assert sum(counts) == 50 and all(c > 0 for c in counts)
    counts.clear()
    grade_many(responses[:5], answers[:5], 2.0, workers=1, progress=counts.append)   # in-process path
    assert sum(counts) == 5


def test_small_batch_uses_every_worker():
    responses, answers, expected = _batch(32)
    grade_many(responses[:2], answers[:2], 2.0, workers=2)              # pool started and warm
    before = pool_info()["graded"]
    got = _in_thread(grade_many, responses, answers, 2.0, workers=2)
    after = pool_info()["graded"]
    assert [g[:2] for g in got] == expected
    assert len(after) == 2 and all(after[pid] > before.get(pid, 0) for pid in after)


def test_stuck_worker_is_replaced_and_graded_results_are_kept():
    """A worker that cannot answer (stopped, like one stuck in C code where its timer
    cannot fire) is killed with its pool; only its response is `timeout`."""
    responses, answers, expected = _batch(40)
    responses[10], answers[10] = SLOW, ("1",)
    expected[10] = (0.0, "timeout")
    grade_many(responses[:2], answers[:2], 2.0, workers=2)              # pool started and warm
    old_pids = pool_info()["pids"]
    out = []
    thread = threading.Thread(target=lambda: out.append(grade_many(responses, answers, 1.5, workers=2, chunk=20)))
    thread.start()
    stopped, deadline = None, time.monotonic() + 30
    while stopped is None and time.monotonic() < deadline:
        stopped = next((pid for pid, (idx, _) in pool_info().get("inflight", {}).items() if idx == 10), None)
        time.sleep(0.005)
    assert stopped is not None, "response 10 was never seen in flight"
    os.kill(stopped, signal.SIGSTOP)
    thread.join(timeout=90)
    assert out, "grading did not finish after its worker was stopped"
    assert [g[:2] for g in out[0]] == expected
    info = pool_info()
    assert stopped not in info["pids"] and set(info["pids"]).isdisjoint(old_pids)
    with pytest.raises(ProcessLookupError):
        os.kill(stopped, 0)
    # 0-9 were graded before the stop and kept: the new pool graded at most the other 29
    assert 9 <= sum(info["graded"].values()) <= 29


def _children() -> set[int]:
    """Pids of this process's live (or unreaped) children, from /proc."""
    kids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:      # gone since the listing
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                kids.add(int(entry))
    return kids


def test_killed_worker_is_replaced_and_its_responses_regraded():
    """The bad day (#25, 4): a grading worker killed with SIGKILL mid-batch (the OOM
    killer, an operator). Its response in flight and the rest of its chunk are graded again
    by a fresh pool: the verdicts equal an undisturbed run's (no `timeout` for the response
    it died under: one death does not convict a response), and the killed worker and the
    pool it was in leave no process behind, reaped ones included."""
    from pipeline.tasks.grading import close_pool
    responses, answers, _ = _batch(40)
    responses[10], answers[10] = integral(6), ("1",)    # costs CPU: seen in flight, then killed
    undisturbed = grade_many(responses, answers, 60.0, workers=2, chunk=20)
    old_pids = pool_info()["pids"]
    out = []
    thread = threading.Thread(target=lambda: out.append(grade_many(responses, answers, 60.0, workers=2, chunk=20)))
    thread.start()
    killed, deadline = None, time.monotonic() + 60
    while killed is None and time.monotonic() < deadline:
        killed = next((pid for pid, (idx, _) in pool_info().get("inflight", {}).items() if idx == 10), None)
        time.sleep(0.005)
    assert killed is not None, "response 10 was never seen in flight"
    os.kill(killed, signal.SIGKILL)
    thread.join(timeout=180)
    assert out, "grading did not finish after its worker was killed"
    assert [g[:2] for g in out[0]] == [g[:2] for g in undisturbed]
    assert out[0][10].status == "ok" and not out[0][10].retried
    info = pool_info()
    assert set(info["pids"]).isdisjoint(old_pids)                     # a fresh pool graded the rest
    assert sum(info["graded"].values()) >= 1                          # ...at least response 10
    assert _children().isdisjoint(old_pids)                           # none left, not even a zombie
    close_pool()
    assert _children().isdisjoint(info["pids"])


def test_bounded_grader_runs_in_the_calling_thread_in_order():
    """Countdown's answers are graded here (grading.BOUNDED): no worker pool starts for them,
    and a batch mixing them with math-verify answers keeps its order."""
    from pipeline.tasks import grading
    grading.close_pool()
    ref = ("countdown:3 5 7=22",)
    out = grading.grade_many(["\\boxed{3*5+7}", "\\boxed{3+5+7}", "no box"], [ref] * 3, 1.0, workers=2)
    assert [(g.reward, g.status) for g in out] == [(1.0, "ok"), (0.0, "ok"), (0.0, "no_answer")]
    assert grading.pool_info() == {}
    mixed = grading.grade_many(["\\boxed{2}", "\\boxed{7+5*3}", "\\boxed{3}"], [("2",), ref, ("2",)], 5.0, workers=1)
    assert [g.reward for g in mixed] == [1.0, 1.0, 0.0]


def test_killed_worker_during_the_retry_is_replaced_and_its_responses_regraded():
    """A grading worker SIGKILLed while the timeout-retry pass grades (the retry's own pool):
    it is replaced like one of the first pass and the response regraded with the retry's
    limit, to the verdict a limit far above its cost gives. Before, the retry's response was
    lost with its worker and waited out the safety net (minutes), then ended `timeout`."""
    import logging
    responses, answers, _ = _batch(6)
    responses[3], answers[3] = integral(6), ("1",)     # over the first limit, far under the retry's
    reference = [grade(r, a, 600.0)[:2] for r, a in zip(responses, answers)]
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append                       # type: ignore[method-assign]
    logging.getLogger("ggpo").addHandler(handler)
    out = []
    thread = threading.Thread(target=lambda: out.append(
        grade_many(responses, answers, 0.05, workers=2, retry_timeout_s=60.0)))
    thread.start()
    killed, deadline = None, time.monotonic() + 120
    try:
        while killed is None and time.monotonic() < deadline and thread.is_alive():
            retry = pool_info().get("retry", [])
            killed = next((pid for view in retry for pid in view["inflight"]), None)
            time.sleep(0.005)
        assert killed is not None, "no response was seen in flight in the retry pass"
        os.kill(killed, signal.SIGKILL)
        thread.join(timeout=120)
    finally:
        logging.getLogger("ggpo").removeHandler(handler)
    assert out, "the retry pass did not finish after its worker was killed"
    assert [g[:2] for g in out[0]] == reference
    assert out[0][3].retried and out[0][3].status == "ok"
    assert any("replacing the 1-worker retry pool" in r.getMessage() for r in records), \
        [r.getMessage() for r in records]
    assert pool_info().get("retry") is None                           # the retry's pool is closed
    assert killed not in _children()                                  # and reaped
