"""Verifiable reward: math-verify against the reference answer(s), with a time limit.

A task may bring its own grader (TASK_GRADERS): a reference answer that starts with its
prefix (`countdown:3 5 7=22`, pipeline/tasks/countdown.py) is graded by it instead of
math-verify, in the same call and with the same status codes. The prefix is part of the
data, so a prompt file whose answers carry it is graded the same way, and every stage that
grades (verify, online_pool, evaluate, base) needs no task switch. A grader bounded by
construction (BOUNDED: countdown's) runs in the calling thread, without the worker pool's
round trip or the CPU-time limit (a few microseconds a response, where the hop cost ~25 ms
a call); math-verify's grades keep both.

Status codes: `ok` (parsed and compared; reward 1 or 0), `no_answer` (no `\\boxed`),
`parse_error` (a box math-verify cannot parse), `timeout` (over the per-response limit).
Only `ok` can earn reward 1. math-verify's own signal timeouts are disabled and replaced
by one interval timer around parse+verify, so the limit is a float and covers both.

The limit is on CPU time, not wall time. A grade is a pure function of (response,
answers); what it costs in CPU seconds does not depend on how busy the machine is, what
it costs in wall seconds does (a 1.7 s grade took 2.0 s on a loaded machine and became
`timeout`, so one pool of a seed differed from another). The timer counts the process's
CPU time (ITIMER_PROF; a grading worker is single-threaded) and `seconds` is CPU seconds.
Wall time stays only as a safety net against a worker that stops progressing (STUCK_WALL).
Each grade starts from an empty sympy cache, so its cost does not depend on what the
worker graded before either. A response that times out is graded once more, in fresh
worker processes (a pool of the retry's own, with the same health checks as the
shared pool's: a worker killed or stuck during the retry is replaced and its responses
graded again), with the longer limit `retry_timeout_s` (default RETRY_FACTOR x timeout_s),
before `timeout` is final; `summary(results)` counts the retries and the final timeouts.

`grade_many(responses, answers, timeout_s, workers=0, chunk=None, progress=None,
retry_timeout_s=None)` grades a batch and returns Graded(reward, status, seconds, retried)
per response, in order:
- `workers == 1` on the main thread: graded in-process (the timer is a signal, which only
  a main thread receives). Otherwise in the process-wide worker pool.
- The pool is one per process, started lazily on first use (spawn context; each worker
  imports and exercises math-verify once, ~1 s) and reused by every later call, from any
  thread, so the verify and evaluate stages of a flow pay the start once. `workers=0`
  sizes it to all cores; a call asking for another size rebuilds it when no other call
  is using it (else it shares the current one); a call asking for 1 worker (off the main
  thread: for the timer, not for speed) uses any pool there is. Closed at exit.
- Work goes out in chunks of ceil(n / (4 * pool workers)) responses (1..256), so small
  batches use every worker too. Workers report each response as it finishes, so `progress(k)` is
  called (in the calling thread) with the number of newly finished responses, and
  results already graded are never lost. The caller sleeps on its call's event, which
  every delivered result sets (and at most _TICK_S for the health checks), never on a timer.
- A worker is stuck when one response runs past `stuck_wall(timeout_s)` wall seconds (its
  CPU timer could not fire: a long call in C, a stopped process; the margin lets a loaded
  machine's slow but progressing workers finish) or when the pool sends nothing for that
  long with work waiting. The pool is then killed and rebuilt; the stuck response is
  `timeout` (and retried), everything not yet graded is graded by the new pool. A response
  whose worker died under it twice is `timeout` too.
- Workers exit when their parent process is gone (a killed flow leaves no graders behind).
"""
from __future__ import annotations

import atexit
import itertools
import logging
import math
import multiprocessing as mp
import os
import signal
import threading
import time
from collections import Counter
from functools import lru_cache
from typing import Callable, NamedTuple, Sequence, cast

from pipeline.core import interrupt
from pipeline.tasks import countdown

STATUSES = ("ok", "no_answer", "parse_error", "timeout")
STUCK_GRACE_S = 2.0     # added to the wall-clock safety net (the timer repeats every 20 ms of CPU)
STUCK_WALL_FACTOR = 4   # a response is stuck after this many times its CPU limit in wall time
RETRY_FACTOR = 5.0      # default retry limit: this many times the first limit
STARTUP_S = 180.0       # a pool with no worker ready after this long is an error
_TICK_S = 0.25          # how often waiting callers check the pool's health

log = logging.getLogger("ggpo")


class Graded(NamedTuple):
    reward: float
    status: str
    seconds: float          # CPU seconds of the grade that counted
    retried: bool = False   # timed out once and was graded again with the retry limit



def stuck_wall(timeout_s: float) -> float:
    """Wall seconds after which a response counts as stuck (the safety net, not the verdict)."""
    return STUCK_WALL_FACTOR * timeout_s + STUCK_GRACE_S


def summary(results: list) -> dict[str, float]:
    """Counts for a stage's summary: responses per status (final), retried responses and
    final timeouts, and the CPU seconds spent grading."""
    statuses = Counter(r[1] for r in results)
    return {**{f"status_{s}": statuses.get(s, 0) for s in STATUSES},
            "grading_retries": sum(1 for r in results if len(r) > 3 and r[3]),
            "grading_timeouts": statuses.get("timeout", 0),
            "grading_seconds": sum(r[2] for r in results)}


class _Timeout(Exception):
    pass


_FIRED = [False]     # did the limit's timer fire during the current grade (this process)


def _alarm(signum, frame):
    _FIRED[0] = True
    raise _Timeout()


@lru_cache(maxsize=65536)
def _gold(answer: str):
    # each reference is parsed once per process, not once per response (4 ms each)
    from math_verify import parse
    return parse(f"\\boxed{{{answer}}}", parsing_timeout=None)


# reference prefix -> grader(response, reference) -> (reward, status), for tasks graded by meaning
TASK_GRADERS: dict[str, Callable[[str, str], tuple[float, str]]] = {countdown.PREFIX: countdown.grade}
# the prefixes whose grader is bounded by construction, graded in the calling thread (no
# worker round trip, no timer): countdown's is one scan for the box and a parse of at most
# MAX_CHARS characters that evaluates only + - * over the given numbers (pipeline/tasks/countdown.py)
BOUNDED = (countdown.PREFIX,)


def _grade_untimed(response: str, answers: tuple[str, ...]) -> tuple[float, str]:
    for prefix, task_grade in TASK_GRADERS.items():
        if answers and answers[0].startswith(prefix):
            return task_grade(response, answers[0])
    from math_verify import parse, verify
    if "\\boxed" not in response:
        return 0.0, "no_answer"
    pred = parse(response, parsing_timeout=None)
    if not pred:
        return 0.0, "parse_error"
    for answer in answers:
        if verify(_gold(answer), pred, timeout_seconds=None):
            return 1.0, "ok"
    return 0.0, "ok"


def grade(response: str, answers: tuple[str, ...], timeout_s: float) -> Graded:
    """(reward, status, CPU seconds) for one response. Must run in a main thread.

    The limit is CPU time (ITIMER_PROF, SIGPROF): the same response gets the same verdict on
    a quiet and on a loaded machine. math-verify catches exceptions internally (also our
    timer's), so the timer repeats every 20 ms of CPU after the limit until one lands
    outside its handlers; a result that arrives after the timer fired (math-verify may catch
    it and answer anyway) or after the limit is still a timeout. The timer's accounting is
    tick-based and process_time's exact, so either one past the limit decides."""
    from sympy.core.cache import clear_cache
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    # sympy memoizes sub-results: a worker that graded similar answers before would grade
    # this one faster, and a verdict near the limit would depend on the worker's history.
    # An empty cache per response makes the cost a function of the response (measured: no
    # slower on ordinary answers, 450 of them in 0.35 s vs 0.40 s)
    clear_cache()
    _FIRED[0] = False
    start = time.process_time()
    previous = signal.signal(signal.SIGPROF, _alarm)
    signal.setitimer(signal.ITIMER_PROF, timeout_s, 0.02)
    try:
        reward, status = _grade_untimed(response, answers)
    except _Timeout:
        reward, status = 0.0, "timeout"
    except Exception:  # math-verify raising on odd LaTeX is a parse failure, not a crash
        reward, status = 0.0, "parse_error"
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)
    seconds = time.process_time() - start
    if seconds > timeout_s or _FIRED[0]:
        reward, status = 0.0, "timeout"
    return Graded(reward, status, seconds)


def bounded(answers: tuple[str, ...]) -> bool:
    """Whether these references' grader is bounded by construction (BOUNDED)."""
    return bool(answers) and answers[0].startswith(BOUNDED)


def grade_bounded(response: str, answers: tuple[str, ...]) -> Graded:
    """A grade by a bounded grader, in this thread; `seconds` is this thread's CPU time."""
    start = time.thread_time()
    try:
        reward, status = _grade_untimed(response, answers)
    except Exception:  # noqa: BLE001 - the same verdict the timed path gives a raising grader
        reward, status = 0.0, "parse_error"
    return Graded(reward, status, time.thread_time() - start)


def warm_up() -> None:
    """Import and exercise math-verify once, so its ~1 s import never counts as a timeout."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    _grade_untimed("\\boxed{1}", ("1",))


def exit_with_parent() -> None:
    """In a worker process: exit as soon as the process that started it is gone (killed by
    SIGKILL, say), so no grader outlives the run it served. A watcher thread, not
    PR_SET_PDEATHSIG, which fires when the creating *thread* ends (flows start pools from
    task threads)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)
    threading.Thread(target=watch, daemon=True, name="ggpo-grader-parent-watch").start()


def _worker_init() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the parent's to handle
    exit_with_parent()
    warm_up()


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not on Linux
        return os.cpu_count() or 1


# ---------------------------------------------------------------- worker processes

def _worker_main(tasks, results) -> None:
    """Grade chunks from `tasks` until killed. Messages to the parent on the pipe `results`:
    ("ready", pid), ("start", pid, call, idx), ("done", pid, call, idx, result, next_idx).
    Sent directly, not through a queue's feeder thread, which cost ~40% of the rate on a
    busy machine; each message is far below PIPE_BUF, so concurrent writes never interleave
    (one write() each) and no lock is needed that a killed worker could leave held."""
    _worker_init()
    pid = os.getpid()
    results.send(("ready", pid))
    while True:
        task = tasks.get()
        if task is None:
            return
        call_id, timeout_s, items = task
        results.send(("start", pid, call_id, items[0][0]))
        for k, (idx, response, answers) in enumerate(items):
            result = grade(response, answers, timeout_s)
            following = items[k + 1][0] if k + 1 < len(items) else None
            results.send(("done", pid, call_id, idx, result, following))


# ---------------------------------------------------------------- the pool (parent side)
# All state below is guarded by _LOCK: the pool, the registry of waiting calls, and
# each call's results. Calling threads and the pool's collector thread take it briefly.

_LOCK = threading.Lock()
_POOL: _Pool | None = None
_CALLS: dict[int, _Call] = {}
_IDS = itertools.count()
_ATEXIT = False


class _Call:
    """One grade_many call (or its retry pass) waiting on `pool`: the shared pool, or a
    retry's own; a restart moves the call to the pool that replaces it."""

    def __init__(self, items: list, timeout_s: float, chunk: int, pool: _Pool, stuck_s: float | None = None):
        self.id, self.items, self.timeout_s, self.chunk = next(_IDS), items, timeout_s, chunk
        self.pool = pool
        self.stuck_s = stuck_s or stuck_wall(timeout_s)   # wall seconds on one response: stuck
        self.results: list[Graded | None] = [None] * len(items)
        self.remaining = len(items)
        self.crashes: Counter = Counter()    # idx -> times its worker died under it
        self.fruitless_restarts = 0
        self.error: str | None = None
        self.wake = threading.Event()

    def deliver(self, idx: int, result: Graded) -> None:
        if self.results[idx] is None:        # the first result wins (a regrade may race)
            self.results[idx] = Graded(*result)
            self.remaining -= 1
            self.wake.set()

    def fail(self, message: str) -> None:
        self.error = message
        self.wake.set()


class _Pool:
    """`size` spawned workers sharing one task queue and one result queue. `role` names it
    in log lines: "" for the shared pool, "retry " for a retry pass's own."""

    def __init__(self, size: int, role: str = ""):
        ctx = mp.get_context("spawn")
        self.size, self.role = size, role
        self.tasks = ctx.Queue()
        self.tasks.cancel_join_thread()      # abandoned when torn down: never block exit
        self.results, writer = ctx.Pipe(duplex=False)
        self.procs = [ctx.Process(target=_worker_main, args=(self.tasks, writer),
                                  daemon=True, name=f"ggpo-grader-{i}") for i in range(size)]
        for p in self.procs:
            p.start()
        writer.close()                       # the workers hold it; EOF once they are all gone
        self.started = self.last_message = time.monotonic()
        self.ready: set[int] = set()
        self.graded: Counter = Counter()     # pid -> responses graded
        self.inflight: dict[int, tuple[int, int, float, float]] = {}  # pid -> (call, idx, since, limit)
        self.closed = False
        self.last_watch = 0.0                # when _watch last looked (it runs every _TICK_S)
        threading.Thread(target=self._collect, daemon=True, name="ggpo-grading-collector").start()

    def _collect(self) -> None:
        try:
            while not self.closed:
                if not self.results.poll(_TICK_S):
                    continue
                msg = self.results.recv()
                with _LOCK:
                    if self.closed:
                        return
                    self._route(msg)
        except (EOFError, OSError):          # every worker gone (killed)
            return
        finally:
            self.results.close()             # here, never under a poll in progress

    def _route(self, msg: tuple) -> None:
        now = self.last_message = time.monotonic()
        kind, pid = msg[0], msg[1]
        if kind == "ready":
            self.ready.add(pid)
            return
        call = _CALLS.get(msg[2])
        limit = call.stuck_s if call else stuck_wall(60.0)
        if kind == "start":
            self.inflight[pid] = (msg[2], msg[3], now, limit)
            return
        _, _, call_id, idx, result, following = msg
        self.graded[pid] += 1
        if call is not None:
            call.deliver(idx, result)
        if following is None:
            self.inflight.pop(pid, None)
        else:
            self.inflight[pid] = (call_id, following, now, limit)

    def submit(self, call: _Call) -> None:
        todo = [i for i, r in enumerate(call.results) if r is None]
        for start in range(0, len(todo), call.chunk):
            part = todo[start:start + call.chunk]
            self.tasks.put((call.id, call.timeout_s, [(i, *call.items[i]) for i in part]))

    def close(self) -> None:
        self.closed = True
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)


def _ensure_pool(size: int) -> _Pool:
    """The process's pool, at `size` workers unless another call is using it. Under _LOCK."""
    global _POOL, _ATEXIT
    if _POOL is not None and size == 1:
        return _POOL                         # one worker is asked for the timer, not for speed
    if _POOL is not None and _POOL.size != size and not _calls_on(_POOL):
        _POOL.close()
        _POOL = None
    if _POOL is None:
        _POOL = _Pool(size)
        if not _ATEXIT:
            atexit.register(close_pool)
            _ATEXIT = True
    return _POOL


def close_pool() -> None:
    """Kill the shared worker pool (at exit; or to start over). The next pooled call starts
    one. A retry pass's own pool is its caller's to close."""
    with _LOCK:
        if _POOL is not None:    # calls waiting on it: none, usually
            _fail_pool(_POOL, "the grading pool was closed while this call waited")


def _forget_after_fork() -> None:
    # a forked child inherits neither the workers nor the collector thread (which may
    # have held the lock at the fork): it starts its own pool when it needs one
    global _LOCK, _POOL, _CALLS
    _LOCK, _POOL, _CALLS = threading.Lock(), None, {}


os.register_at_fork(after_in_child=_forget_after_fork)


def start_pool(workers: int = 0) -> None:
    """Start the pool now (it warms up in the background), e.g. while rollouts run."""
    with _LOCK:
        _ensure_pool(workers or default_workers())


def _view(pool: _Pool, now: float) -> dict:
    return {"pids": [p.pid for p in pool.procs], "graded": dict(pool.graded), "ready": len(pool.ready),
            "inflight": {pid: (rec[1], now - rec[2]) for pid, rec in pool.inflight.items()}}


def pool_info() -> dict:
    """The shared pool: worker pids, responses graded per pid, responses in flight
    ({pid: (index, seconds so far)}), workers ready; and under "retry" the same for each
    retry pass's pool running now. Empty when no pool is running."""
    with _LOCK:
        now = time.monotonic()
        retry = {id(c.pool): c.pool for c in _CALLS.values() if c.pool is not _POOL and not c.pool.closed}
        info = _view(_POOL, now) if _POOL is not None else {}
        if retry:
            info["retry"] = [_view(pool, now) for pool in retry.values()]
        return info


# ---------------------------------------------------------------- health checks

def _calls_on(pool: _Pool) -> list[_Call]:
    return [c for c in _CALLS.values() if c.pool is pool]


def _watch(pool: _Pool) -> None:
    """Replace a stuck, crashed or silent pool; fail its calls if it cannot start. Under _LOCK."""
    now, calls = time.monotonic(), _calls_on(pool)
    if pool.closed or not calls or now - pool.last_watch < _TICK_S:
        return
    pool.last_watch = now
    dead = [p for p in pool.procs if not p.is_alive()]
    for p in dead:
        # a worker that failed to start (its own error: exit code > 0) will fail again; one
        # killed by a signal before it was ready (the OOM killer while math-verify imports)
        # is replaced like any dead worker, within fruitless_restarts
        if p.pid not in pool.ready and (p.exitcode or 0) > 0:
            return _fail_pool(pool, f"a grading worker exited with code {p.exitcode} before it was ready (its "
                             "traceback is above: a worker imports math-verify and the main script, "
                             "which must be a file that runs only under `if __name__ == '__main__'`)")
    if not pool.ready and not dead:
        if now - pool.started > STARTUP_S:
            _fail_pool(pool, f"no grading worker was ready after {STARTUP_S:.0f} s; is the machine overloaded?")
        return
    stuck = {pid for pid, (_, _, since, limit) in pool.inflight.items() if now - since > limit}
    silent_for = now - pool.last_message
    stalled = silent_for > max(c.stuck_s for c in calls)
    if not (dead or stuck or stalled):
        return
    reason = (f"{len(stuck)} worker(s) stuck past the time limit" if stuck else
              f"{len(dead)} worker(s) died" if dead else f"no word from the workers for {silent_for:.1f} s")
    _restart(pool, stuck, {p.pid for p in dead if p.pid is not None}, now, reason)     # started: each has a pid


def _restart(pool: _Pool, stuck: set[int], dead: set[int], now: float, reason: str) -> None:
    """Kill `pool`, mark the responses it was stuck on `timeout`, regrade the rest anew in a
    pool of the same size and role that replaces it (for its calls, and as the shared pool
    where it was that)."""
    global _POOL
    blamed, calls = 0, _calls_on(pool)
    for pid, (call_id, idx, since, _) in pool.inflight.items():
        call = _CALLS.get(call_id)
        if call is None or call.pool is not pool:
            continue
        if pid in dead:
            call.crashes[idx] += 1           # a second death under the same response convicts it
        if pid in stuck or call.crashes[idx] >= 2:
            call.deliver(idx, Graded(0.0, "timeout", now - since))
            blamed += 1
    left = sum(c.remaining for c in calls)
    log.warning("grading: %s; replacing the %d-worker %spool (%d response(s) marked timeout, %d left to grade)",
                reason, pool.size, pool.role, blamed, left)
    shared = pool is _POOL
    _fail_pool(pool, None)
    try:
        new = _Pool(pool.size, pool.role)
    except Exception as e:   # e.g. out of processes: fail the waiting calls, never leave them hanging
        for call in calls:
            call.fail(f"could not restart the grading workers: {e}")
        return
    if shared:
        _POOL = new
    for call in calls:
        call.pool = new
        call.fruitless_restarts = 0 if blamed else call.fruitless_restarts + 1
        if call.fruitless_restarts > 3:
            call.fail(f"the grading pool was replaced {call.fruitless_restarts} times without progress "
                      f"({reason}); rerun with verify.workers=1 on the main thread to see the failing response")
        elif call.remaining:
            new.submit(call)


def _fail_pool(pool: _Pool, message: str | None) -> None:
    """Close `pool` (and forget it if it is the shared one); fail its calls with `message`."""
    global _POOL
    if message is not None:
        for call in _calls_on(pool):
            call.fail(message)
    pool.close()
    if pool is _POOL:
        _POOL = None


# ---------------------------------------------------------------- the entry point

def grade_many(responses: list[str], answers: Sequence[tuple[str, ...]], timeout_s: float,
               workers: int = 0, chunk: int | None = None,
               progress: Callable[[int], None] | None = None,
               retry_timeout_s: float | None = None) -> list[Graded]:
    """Graded(reward, status, seconds, retried) per response, in order; see the module
    docstring. `workers`: 0 = all cores; `chunk`: responses per task (default: 4 tasks per
    worker); `progress(k)`: called in this thread with the number of newly finished
    responses; `retry_timeout_s`: the CPU limit of the one retry of a timed-out response
    (default RETRY_FACTOR x timeout_s)."""
    if len(responses) != len(answers):
        raise ValueError(f"grade_many: {len(responses)} responses but {len(answers)} answer tuples")
    items = [(r, tuple(a)) for r, a in zip(responses, answers)]
    here = [i for i, (_, a) in enumerate(items) if bounded(a)]
    results: list[Graded | None] = [None] * len(items)
    for i in here:
        results[i] = grade_bounded(*items[i])
    if here and progress:
        progress(len(here))
    rest = [i for i, r in enumerate(results) if r is None]
    if rest:
        for i, r in zip(rest, _grade_timed([items[i] for i in rest], timeout_s, workers, chunk, progress,
                                           retry_timeout_s)):
            results[i] = r
    return cast(list[Graded], results)


def _grade_timed(items: list, timeout_s: float, workers: int, chunk: int | None, progress,
                 retry_timeout_s: float | None) -> list[Graded]:
    """Items graded under the CPU-time limit: here on a main thread asking for one worker,
    else in the pool; timeouts retried once."""
    workers = workers or default_workers()
    if workers == 1 and threading.current_thread() is threading.main_thread():
        results = _grade_here(items, timeout_s, progress)
    else:
        results = _grade_pooled(items, timeout_s, workers, chunk, progress)
    return _retry_timeouts(items, results, retry_timeout_s or RETRY_FACTOR * timeout_s, workers)


def _retry_timeouts(items: list, results: list, retry_timeout_s: float, workers: int) -> list[Graded]:
    """Grade every timed-out response once more, in fresh worker processes (a spawned pool
    of its own, so a worn or replaced pool cannot decide it twice), with the longer limit.
    The pool has the shared pool's health checks (_watch): a worker killed during the retry
    is replaced and its responses graded again; one stuck past its wall-clock net is `timeout`."""
    todo = [i for i, r in enumerate(results) if r[1] == "timeout"]
    results = [Graded(*r) for r in results]
    if not todo:
        return results
    log.info("grading: %d response(s) timed out; grading them again with a %.1f s CPU limit",
             len(todo), retry_timeout_s)
    with _LOCK:
        pool = _Pool(min(workers, len(todo)), role="retry ")
        # one response a task: a slow one holds up no other. The wall-clock net is wider
        # than the first pass's (STARTUP_S more): the retry's verdict is final, and a loaded
        # machine that slowed the first pass slows this one too; the CPU limit decides
        call = _Call([items[i] for i in todo], retry_timeout_s, 1, pool, STARTUP_S + stuck_wall(retry_timeout_s))
        _CALLS[call.id] = call
        pool.submit(call)
    try:
        regraded = _wait(call, None)
    finally:
        with _LOCK:
            _fail_pool(call.pool, None)      # the pool the call ended on (a restart replaces it)
    for i, r in zip(todo, regraded):
        results[i] = Graded(*r[:3], retried=True)
    return results


def _grade_here(items: list, timeout_s: float, progress) -> list[Graded]:
    warm_up()
    results, unreported, last = [], 0, time.monotonic()
    for response, answers in items:
        results.append(grade(response, answers, timeout_s))
        unreported += 1
        if progress and (time.monotonic() - last > 0.1 or len(results) == len(items)):
            progress(unreported)
            unreported, last = 0, time.monotonic()
    return results


def _grade_pooled(items: list, timeout_s: float, workers: int, chunk: int | None, progress) -> list[Graded]:
    with _LOCK:
        pool = _ensure_pool(workers)
        # 4 tasks per worker of the pool that runs them: every worker gets some, and a
        # slow task cannot leave the others idle for long
        call = _Call(items, timeout_s, chunk or min(256, max(1, math.ceil(len(items) / (4 * pool.size)))), pool)
        if not _calls_on(pool):
            pool.last_message = time.monotonic()   # an idle pool's silence was no stall
        _CALLS[call.id] = call
        pool.submit(call)
    return _wait(call, progress)


def _wait(call: _Call, progress) -> list[Graded]:
    """`call`'s results once all are delivered, watching its pool's health meanwhile;
    `progress(k)` as they come. The call leaves the registry however this ends."""
    reported, n = 0, len(call.items)
    try:
        while True:
            interrupt.check("grading")
            call.wake.wait(_TICK_S)
            call.wake.clear()
            with _LOCK:
                _watch(call.pool)
                done, error = n - call.remaining, call.error
            if progress and done > reported:
                progress(done - reported)
                reported = done
            if error:
                raise RuntimeError(f"grading {n} responses: {error}")
            if done == n:
                return cast(list[Graded], list(call.results))     # every item delivered: no None left
    finally:
        with _LOCK:
            _CALLS.pop(call.id, None)
