"""Progress of long work (rollout, grading, training, evaluation): a bar on a terminal, a
periodic log line otherwise, and a Prefect progress artifact inside a Prefect run.

API (one instance per stage or loop; safe to update from several threads):

    from pipeline.services.progress import Progress
    with Progress("train grpo seed 42", total=updates, unit="update", start=resume_at) as bar:
        bar.update(1, loss=0.12, reward=0.5, tok_s=2600.0)   # postfix fields, shown as given

    # as a callback that takes a count (engines, grading):
    engine.generate(prompts, params, progress=bar.update)

- `Progress(desc, total=None, unit="item", start=0, key=None)`: `start` counts work done
  before this run (a resumed training), shown in the count but not in the rate or ETA;
  `key` names the Prefect artifact (default: derived from `desc`).
- `bar.update(n=1, **postfix)`: n more units done; postfix fields replace earlier ones.
  `bar.set_postfix(**postfix)` changes the fields only. `bar.close()` (or leaving the
  `with`) writes the final line; closing twice is harmless.
- Where it goes, chosen once per instance:
  - `GGPO_PROGRESS=0` (or `off`): nothing at all (no bar, no line, no artifact);
  - a terminal (`sys.stderr.isatty()`, or `GGPO_PROGRESS=bar`): a tqdm bar on stderr with
    rate, ETA and the postfix fields;
  - otherwise (or `GGPO_PROGRESS=lines`): an INFO line on the logger "ggpo" at most every
    `GGPO_PROGRESS_SECONDS` seconds (default 10) and one at the end, e.g.
    "train grpo seed 42: 12/32 updates (37%), 0.8 update/s, ETA 25s, loss=0.12 reward=0.5";
  - in addition, inside a Prefect task or flow run, for work that outlasts one period: a
    progress artifact (key from `desc`: lowercase letters, digits, dashes), created at the
    first periodic report, updated at most every `GGPO_PROGRESS_SECONDS` seconds and set
    to 100 at the end. A failing Prefect call never breaks the stage: it
    is logged once at DEBUG level and artifacts stop for that instance.
- Cost per `update`: a lock, an addition and a clock read; formatting, bar redraws and
  Prefect calls happen only when the period has passed (tqdm throttles its own redraws).
"""
from __future__ import annotations

import inspect
import logging
import os
import re
import sys
import threading
import time
from typing import Any
from uuid import UUID

from pipeline.services import prefect_client

log = logging.getLogger("ggpo")


def mode() -> str:
    """'off', 'bar' or 'lines', from GGPO_PROGRESS and whether stderr is a terminal."""
    value = os.environ.get("GGPO_PROGRESS", "").strip().lower()
    if value in ("0", "off", "false", "no"):
        return "off"
    if value in ("bar", "lines"):
        return value
    try:
        return "bar" if sys.stderr is not None and sys.stderr.isatty() else "lines"
    except (AttributeError, ValueError):     # a closed or replaced stderr
        return "lines"


def period_seconds() -> float:
    raw = os.environ.get("GGPO_PROGRESS_SECONDS", "10")
    try:
        return max(0.0, float(raw))
    except ValueError:
        raise ValueError(f"GGPO_PROGRESS_SECONDS={raw!r}: expected a number of seconds, e.g. 10") from None


def artifact_key(desc: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9]+", "-", desc.lower()).strip("-") or "progress"


def duration(seconds: float) -> str:
    """25s, 3m05s, 1h02m."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def fmt_value(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def fmt_rate(rate: float) -> str:
    return f"{rate:.0f}" if rate >= 100 else f"{rate:.1f}" if rate >= 10 else f"{rate:.2g}"


def plural(unit: str) -> str:
    return unit if unit.endswith("s") else unit + "s"


def clock() -> float:
    """Seconds on a monotonic clock; one name, so a test can give Progress a clock of its own."""
    return time.monotonic()


class Progress:
    """See the module docstring."""

    def __init__(self, desc: str, total: int | None = None, unit: str = "item", start: int = 0,
                 key: str | None = None):
        self.desc, self.total, self.unit, self.start = desc, total, unit, start
        self.n = start
        self.postfix: dict[str, Any] = {}
        self.mode, self.period = mode(), period_seconds()
        self._lock = threading.Lock()
        self._t0 = clock()
        self._next = self._t0 + self.period
        self._closed = False
        self._bar = self._open_bar() if self.mode == "bar" else None
        # created at the first periodic report, so only work that outlasts one period gets an
        # artifact: a flow of many short stages would otherwise flood the run (and the
        # `deployment run --watch` output) with artifact events
        self._artifact = _Artifact(key or artifact_key(desc)) if self.mode != "off" else None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)

    def update(self, n: int = 1, **postfix: Any) -> None:
        if self.mode == "off":
            return
        with self._lock:
            self.n += n
            if postfix:
                self.postfix.update(postfix)
            now = clock()
            # at the total the final line follows at close: no periodic line just before it
            due = now >= self._next and not (self.total and self.n >= self.total)
            if due:
                self._next = now + self.period
        if self._bar is not None:
            self._bar_update(n, postfix)
        if due:
            self._report(final=False)

    def set_postfix(self, **postfix: Any) -> None:
        self.update(0, **postfix)

    def close(self, failed: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.mode == "off":
            return
        if self._bar is not None:
            self._bar.close()
        self._report(final=True, failed=failed)

    # -- reporting -------------------------------------------------------------------

    def elapsed(self) -> float:
        return clock() - self._t0

    def rate(self) -> float:
        elapsed = self.elapsed()
        return (self.n - self.start) / elapsed if elapsed > 0 else 0.0

    def line(self, final: bool = False, failed: bool = False) -> str:
        """The log line: count, percent, rate, ETA (or elapsed at the end), postfix."""
        with self._lock:
            n, postfix = self.n, dict(self.postfix)
        rate = self.rate()
        count = f"{n}/{self.total} {plural(self.unit)}" if self.total else f"{n} {plural(self.unit)}"
        if self.total:
            count += f" ({100 * n / self.total:.0f}%)"
        parts = [("stopped at " if failed else "") + count]
        if final:
            parts.append(f"in {duration(clock() - self._t0)}")
        # slow work (a training update every minute) reads better as seconds per unit
        parts.append(f"{1 / rate:.3g} s/{self.unit}" if 0 < rate < 0.1 else f"{fmt_rate(rate)} {self.unit}/s")
        if not final and self.total and rate > 0:
            parts.append(f"ETA {duration(max(0, self.total - n) / rate)}")
        text = f"{self.desc}: " + ", ".join(parts)
        if postfix:
            text += ", " + " ".join(f"{k}={fmt_value(v)}" for k, v in postfix.items())
        return text

    def _report(self, final: bool, failed: bool = False) -> None:
        if self.mode == "lines":
            log.info(self.line(final, failed))
        if self._artifact is not None and not self._artifact.dead and (self._artifact.id or not final):
            fraction = self.n / self.total if self.total else (1.0 if final else 0.0)
            self._artifact.update(100.0 if final and not failed else 100.0 * min(1.0, fraction),
                                  self.line(final, failed))

    # -- tqdm --------------------------------------------------------------------------

    def _open_bar(self):
        from tqdm import tqdm
        try:
            sized = os.get_terminal_size(sys.stderr.fileno()).columns > 0
        except (OSError, ValueError, AttributeError):
            sized = False
        # a terminal that reports 0 columns (a pty without a size) would get an empty bar
        return tqdm(total=self.total, initial=self.start, desc=self.desc, unit=self.unit, file=sys.stderr,
                    dynamic_ncols=sized, ncols=None if sized else 100,
                    nrows=None if sized else 40, leave=True)

    def _bar_update(self, n: int, postfix: dict) -> None:
        assert self._bar is not None    # update calls this only with a bar
        if postfix:
            self._bar.set_postfix({k: fmt_value(v) for k, v in postfix.items()}, refresh=False)
        self._bar.update(n)


class _Artifact:
    """A Prefect progress artifact of the current task or flow run, if any. Any failure is
    logged once at DEBUG level and turns the artifact off: progress never breaks a stage."""

    def __init__(self, key: str):
        self.key, self.dead = key, not in_prefect_run()
        self.id: UUID | None = None

    def update(self, percent: float, description: str) -> None:
        if self.dead or prefect_client.down():      # down: its server stopped answering mid-run
            return
        try:
            from prefect.artifacts import create_progress_artifact, update_progress_artifact
            if self.id is None:
                # _sync: a plain call even where Prefect guesses an async context
                # the ignores: prefect's types omit async_dispatch's _sync keyword (so the sync result, a UUID)
                self.id = create_progress_artifact(progress=percent, key=self.key, description=description,  # type: ignore[call-arg, assignment]
                                                   _sync=True)
            else:
                update_progress_artifact(self.id, progress=percent, description=description, _sync=True)  # type: ignore[call-arg]
        except Exception as e:       # noqa: BLE001 - progress must never fail the work it reports
            self.dead = True
            prefect_client.noticed(e)     # its server gone: the run stops waiting on it
            log.debug("progress artifact %s disabled: %s: %s", self.key, type(e).__name__, e)


def in_prefect_run() -> bool:
    if "prefect.context" not in sys.modules:     # no run without it; importing prefect costs ~1 s
        return False
    from prefect.context import FlowRunContext, TaskRunContext
    return TaskRunContext.get() is not None or FlowRunContext.get() is not None


def generate(engine, prompts: list[str], params, bar: Progress) -> list:
    """engine.generate(prompts, params), counting finished prompts on `bar` with the
    responses per second (params.n per prompt) as a postfix. An engine without a
    `progress` argument (vLLM generates all prompts in one call) counts once at the end."""
    if "progress" not in inspect.signature(engine.generate).parameters:
        out = engine.generate(prompts, params)
        bar.update(len(prompts), resp_s=round(len(prompts) * params.n / max(bar.elapsed(), 1e-9), 1))
        return out

    def finished(k: int) -> None:
        # responses so far over time so far, counting this batch: the rate a user wants to see
        bar.update(k, resp_s=round((bar.n - bar.start + k) * params.n / max(bar.elapsed(), 1e-9), 1))
    return engine.generate(prompts, params, progress=finished)
