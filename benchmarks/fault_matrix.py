"""The fault matrix (#25, 5), measured: each fault of a bad day injected into the smoke flows,
offline and online, and compared with an undisturbed run of the same config (on demand;
tests/test_fault_matrix.py runs the same cells and asserts on them).

    .venv/bin/python benchmarks/fault_matrix.py [--faults grader,sigkill,disk,mlflow,prefect] [--out table.md]

It builds the smoke base model in a temporary cache, starts its own servers (`ggpo up` on
free ports, its own state folder) and prints the table (fault x flow: exit codes, warning
and error lines, seconds from the fault to the exit, artifacts equal to the undisturbed
run's, processes left behind) with the machine it ran on.

Faults, each injected once the run has reached a point seen on disk (never after a sleep):
- `grader`: a grading worker of the run is SIGKILLed while it grades: once the base
  policy's evaluation is written (the pool is warm: a worker killed before it is ready is
  another story, see docs/faults.md), at the worker's next burst of CPU (verify, a round's
  draws, or the final evaluation).
- `sigkill`: the run itself is SIGKILLed once its first training checkpoint exists
  (offline: the train stage's checkpoints/latest.pt; online: the cell's rolling checkpoint
  of round 0), then the same command runs again and resumes. Also the online flow with its
  stages in worker processes (`experiment.task_runner=processes`): its workers must exit
  with it, and its artifacts equal the threads runner's undisturbed run.
- `disk`: the cache's disk fills at that checkpoint: a size-limited tmpfs holding the cache
  (where mounting is permitted), else ENOSPC injected into the run's Python file writes;
  then space is freed and the same command runs again.
- `mlflow`, `prefect`: the server `ggpo up` started is stopped (SIGTERM to its process
  group) once both flows have written that checkpoint. They run last, MLflow first: the
  `prefect` cells then track to the SQLite file of the server already gone.

The two flows of a fault run at the same time (a server outage hits both; the matrix takes
half the time), each with its own cache (a copy of the base model, nothing else), so every
stage is computed. Artifacts are compared by the content hashes of every manifest's files
(Parquet files with a `seconds` column, a CPU timing, compared without it). Processes are
the run's own when their environment carries its cell's marker (FAULT_MARKER). Seconds are
wall-clock on a machine that runs two flows at once: a safety net, never a verdict.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from pipeline.core import full_disk

REPO = Path(__file__).resolve().parents[1]
GGPO = [sys.executable, "-m", "pipeline.cli"]      # this checkout's code, whatever `ggpo` is installed
FAULT_MARKER = "GGPO_FAULT_CELL"
FAULTS = ("grader", "sigkill", "disk", "mlflow", "prefect")   # the order they run in
# the cells of each fault: both flows; a killed run also without servers (`ggpo up` never ran)
# and the online flow with its stages in worker processes (experiment.task_runner=processes),
# compared with the threads runner's undisturbed run
CELLS = [(fault, flow) for fault in FAULTS for flow in ("offline", "online")
         + (("offline, no servers", "online, processes") if fault == "sigkill" else ())]
POLL_S = 0.02
RUN_BOUND_S = 900.0       # a hung run: a safety net, not a verdict
GONE_BOUND_S = 15.0       # how long a killed run's workers may take to exit (they poll their parent every 1 s)
MiB = 1 << 20
# a grading call has finished once an evaluation's manifest exists (the base policy's comes
# first): the run's grading pool is warm, and grading is left to do (pools, the final policy)
WARM = "evaluate-*/manifest.json"
# a line on stderr that warns or reports an error; "status_parse_error" and the like are not
NOISE = re.compile(r"^ggpo:|\b(warning|error|retrying|traceback|exception|failed|died|unable)\b", re.I)


@dataclass(frozen=True)
class Flow:
    name: str
    preset: str
    sets: tuple[str, ...]
    checkpoint: str     # glob under the cache: the first training checkpoint (the fault point)
    resumed: re.Pattern     # what a resumed run logs, with a number
    resumed_from: Callable[[int], str]      # the checkpoint that number says it resumed from

    def argv(self) -> list[str]:
        return ["run", self.name, "--preset", self.preset] + [a for s in self.sets for a in ("--set", s)]


FLOWS = {
    # 16 updates, a checkpoint after each: the first one leaves ~15 updates, the evaluation
    # and the report to run after the fault
    "offline": Flow("offline", "smoke", ("experiment.methods=[grpo]", "train.updates=16", "train.checkpoint_every=1"),
                    "train-*/checkpoints/latest.pt",
                    re.compile(r"resuming after update (\d+)"), "update {}".format),
    # 3 rounds of N = 2 updates, a rolling checkpoint after each: round 0's leaves two rounds
    "online": Flow("online", "smoke-online", ("experiment.methods=[grpo]", "train.updates=6", "train.eval_every=null",
                                              "online.checkpoint_every=1"),
                   "online_cell-*/checkpoints/round-000000/cell.json",
                   re.compile(r"rounds \(([1-9]\d*) from a checkpoint"), lambda k: f"round {k - 1}"),
}


@dataclass
class Outcome:
    """One cell: what the disturbed run did, and the rerun where the fault calls for one."""
    flow: str
    fault: str
    exit: int | None = None
    warnings: list[str] = field(default_factory=list)
    fault_to_exit_s: float | None = None
    rerun_exit: int | None = None
    rerun_warnings: list[str] = field(default_factory=list)
    rerun_s: float | None = None
    differences: list[str] | None = None      # artifacts unlike the undisturbed run's (None: not compared)
    leftovers: list[str] = field(default_factory=list)
    gone_s: float | None = None               # seconds until the run's processes were all gone
    notes: list[str] = field(default_factory=list)
    stderr: str = ""
    rerun_stderr: str = ""
    digests: dict[str, str] = field(default_factory=dict)

    @property
    def traceback(self) -> bool:
        return "Traceback" in self.stderr + self.rerun_stderr


# ---------------------------------------------------------------- processes

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def marked(marker: str) -> list[str]:
    """`pid cmdline` of every live process whose environment carries FAULT_MARKER=marker."""
    needle = f"{FAULT_MARKER}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if _state(int(entry)) == "Z" or needle not in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                continue
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:     # gone since the listing, or not ours to read
            continue
        found.append(f"{entry} {cmd.strip()[:120]}")
    return found


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _state(pid: int) -> str:
    return _stat(pid)[0]


def graders(pid: int) -> list[int]:
    """The grading workers of process `pid`: its children started by multiprocessing's spawn."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(_stat(int(entry))[1]) == pid and \
                    b"spawn_main" in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except OSError:
            continue
    return found


def cpu_ticks(pid: int) -> int:
    try:
        fields = _stat(pid)
    except OSError:
        return -1
    return int(fields[11]) + int(fields[12])    # utime + stime


# ---------------------------------------------------------------- a user's shell and its runs

class Shell:
    """A user's shell with servers of its own: `ggpo up` on free ports, state in `home`."""

    def __init__(self, home: Path, cache: Path):
        env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", FAULT_MARKER)}
        self.home = home
        self.env = env | {"GGPO_HOME": str(home), "GGPO_CACHE": str(cache), "GGPO_PREFECT_PORT": str(free_port()),
                          "GGPO_MLFLOW_PORT": str(free_port())}

    def up(self) -> None:
        done = subprocess.run(GGPO + ["up"], cwd=REPO, env=self.env, capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise RuntimeError(f"ggpo up failed: {done.stdout}{done.stderr}")

    def down(self) -> None:
        subprocess.run(GGPO + ["down"], cwd=REPO, env=self.env, capture_output=True, timeout=120)

    def stop(self, service: str) -> None:
        """The service stops as a crash or a redeploy would stop it: SIGTERM to its group."""
        pid = json.loads((self.home / "services.json").read_text())["pids"][service]
        os.killpg(pid, signal.SIGTERM)


class Run:
    """One `ggpo run` in the background, its stdout and stderr in files (never a pipe that
    could fill and stall it); a thread of its own notes the moment it exits."""

    def __init__(self, argv: list[str], env: dict[str, str], folder: Path, tag: str):
        folder.mkdir(parents=True, exist_ok=True)
        self.err_path = folder / f"{tag}.stderr"
        with open(folder / f"{tag}.stdout", "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=err)
        self.started = time.monotonic()
        self.ended: float | None = None
        self._waiter = threading.Thread(target=self._wait, daemon=True, name=f"wait-{tag}")
        self._waiter.start()

    def _wait(self) -> None:
        self.proc.wait()
        self.ended = time.monotonic()

    def alive(self) -> bool:
        return self.ended is None

    def wait(self) -> int:
        self._waiter.join(timeout=RUN_BOUND_S)
        if self._waiter.is_alive():
            self.proc.kill()
            self._waiter.join()
        assert self.proc.returncode is not None
        return self.proc.returncode

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")


def noise(text: str) -> list[str]:
    return [line for line in text.splitlines() if NOISE.search(line)]


def until(condition: Callable[[], bool], runs: list[Run], bound: float = RUN_BOUND_S) -> bool:
    """Poll until `condition` holds (True), or a run exits or the bound passes (False)."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        if condition():
            return True
        if not all(r.alive() for r in runs):
            return condition()
        time.sleep(POLL_S)
    return False


def exists(root: Path, pattern: str) -> Callable[[], bool]:
    return lambda: any(root.glob(pattern))


# ---------------------------------------------------------------- artifacts

def digests(cache: Path) -> dict[str, str]:
    """{stage folder/file: sha256} over every manifest in `cache`; a Parquet file with a
    `seconds` column (CPU seconds of a grade or an update) hashed without it."""
    import polars as pl
    out = {}
    for manifest in sorted(cache.glob("*/manifest.json")):
        folder = manifest.parent
        for entry in json.loads(manifest.read_text())["files"].values():
            path = folder / entry["path"]
            digest = entry["sha256"]
            if path.suffix == ".parquet":
                frame = pl.read_parquet(path)
                if "seconds" in frame.columns:
                    digest = hashlib.sha256(frame.drop("seconds").write_csv().encode()).hexdigest()
            out[f"{folder.name}/{entry['path']}"] = digest
    return out


def stray_temporaries(cache: Path) -> list[str]:
    """Temporary files of an interrupted write (`.name.tmp-PID-TID.ext`, `*.tmp`) in the cache."""
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if ".tmp" in p.name)


# ---------------------------------------------------------------- disks that fill

class Tmpfs(full_disk.Tmpfs):
    """A size-limited tmpfs at `root` that really fills (pipeline/core/full_disk.py; where
    root may not mount, `available` is False and `why` says so); the run writes to it as is."""

    def __init__(self, root: Path, size: int = 128 * MiB):
        super().__init__(root, size)
        self.argv_prefix, self.available = GGPO, not self.why


class InjectedDisk(full_disk.InjectedDisk):
    """Where no tmpfs can be mounted: the run starts through inject_enospc, so its Python
    file writes under `root` raise ENOSPC while the file `flag` exists (pipeline/core/full_disk.py,
    the disk tests/test_disk_full.py injects too). Writes from native code (pyarrow,
    safetensors) do not see it; the next checkpoint, manifest or report does."""

    def __init__(self, root: Path):
        root.mkdir(parents=True, exist_ok=True)
        super().__init__(root, root.parent / "disk-is-full")
        self.available, self.why = True, ""
        boot = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import fault_matrix; "
                "fault_matrix.inject_enospc(sys.argv[1], sys.argv[2]); from pipeline.cli import main; "
                "sys.exit(main(sys.argv[3:]))")
        self.argv_prefix = [sys.executable, "-c", boot, str(root), str(self.flag)]


def inject_enospc(root: str, flag: str) -> None:
    """In a run started by InjectedDisk: files opened for writing under `root` raise
    OSError(ENOSPC) on write while `flag` exists."""
    full_disk.InjectedDisk(root, flag).install()


# ---------------------------------------------------------------- the cells

class Cell:
    """One flow under one fault: its own folder, cache (the base model copied in) and marker.
    Without `servers` it runs as in a shell where `ggpo up` never ran: its own state folder,
    ports nothing listens on (Prefect's temporary server, MLflow's SQLite file)."""

    def __init__(self, flow: Flow, fault: str, shell: Shell, base: Path, folder: Path, disk=None,
                 servers: bool = True, label: str | None = None):
        self.flow, self.fault, self.folder, self.disk = flow, fault, folder, disk
        folder.mkdir(parents=True, exist_ok=True)
        self.cache = (disk.root if disk is not None else folder) / "cache"
        shutil.copytree(base, self.cache / base.name)
        self.marker = f"{flow.name}-{fault}-{os.getpid()}-{time.monotonic_ns()}"
        self.env = shell.env | {"GGPO_CACHE": str(self.cache), FAULT_MARKER: self.marker}
        if not servers:
            self.env |= {"GGPO_HOME": str(folder / "home"), "GGPO_PREFECT_PORT": str(free_port()),
                         "GGPO_MLFLOW_PORT": str(free_port())}
        self.outcome = Outcome(label or (flow.name if servers else f"{flow.name}, no servers"), fault)

    def start(self, tag: str = "run") -> Run:
        prefix = self.disk.argv_prefix if self.disk is not None else GGPO
        return Run(prefix + self.flow.argv(), self.env, self.folder, tag)

    def finish(self, run: Run, fault_at: float | None) -> None:
        """Wait for the disturbed run; its exit, noise, seconds from the fault, leftovers."""
        o = self.outcome
        o.exit = run.wait()
        o.stderr = run.stderr()
        o.warnings = noise(o.stderr)
        o.fault_to_exit_s = None if fault_at is None else max(0.0, (run.ended or fault_at) - fault_at)
        self.settle()

    def settle(self) -> None:
        """Wait (bounded) until none of the run's processes is left; record the rest."""
        o, t0 = self.outcome, time.monotonic()
        while marked(self.marker) and time.monotonic() - t0 < GONE_BOUND_S:
            time.sleep(0.1)
        left = marked(self.marker)
        o.gone_s = None if left else time.monotonic() - t0
        o.leftovers += left
        for entry in left:      # recorded; not left to run on after the measurement
            try:
                os.kill(int(entry.split()[0]), signal.SIGKILL)
            except OSError:
                pass

    def rerun(self) -> None:
        run = self.start("rerun")
        o = self.outcome
        o.rerun_exit = run.wait()
        o.rerun_s = (run.ended or run.started) - run.started
        o.rerun_stderr = run.stderr()
        o.rerun_warnings = noise(o.rerun_stderr)
        self.settle()
        found = self.flow.resumed.search(o.rerun_stderr)
        if found:
            o.notes.append(f"rerun resumed from the checkpoint of {self.flow.resumed_from(int(found.group(1)))}")

    def compare(self, baseline: dict[str, str] | None) -> None:
        o = self.outcome
        o.digests = digests(self.cache)
        if baseline is not None:
            o.differences = sorted(k for k in baseline.keys() | o.digests.keys() if baseline.get(k) != o.digests.get(k))
        stray = stray_temporaries(self.cache)
        if stray:
            o.notes.append(f"temporary files left in the cache: {', '.join(stray)}")


def undisturbed(cell: Cell) -> None:
    cell.finish(cell.start(), None)


def kill_a_grader(cell: Cell) -> None:
    """SIGKILL a grading worker of the run while it grades: once a grading call has finished
    (the base policy's evaluation: the pool is warm), at its next burst of CPU."""
    run = cell.start()
    fault_at = None
    if until(exists(cell.cache, WARM), [run]):
        pid = busy_grader(run)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            fault_at = time.monotonic()
    if fault_at is None:
        cell.outcome.notes.append("no grading worker was seen grading: no fault injected")
    cell.finish(run, fault_at)
    left = re.search(r"(\d+) left to grade", cell.outcome.stderr)
    if left:
        cell.outcome.notes.append(f"killed mid-batch: {left.group(1)} responses left, graded by a new worker")


def busy_grader(run: Run, bound: float = 300.0) -> int | None:
    """A grading worker of `run` using CPU (>= 20 ms in 50 ms): a warm worker uses CPU only
    to grade."""
    last: dict[int, int] = {}
    deadline = time.monotonic() + bound
    while run.alive() and time.monotonic() < deadline:
        now = {pid: cpu_ticks(pid) for pid in graders(run.proc.pid)}
        busy = [pid for pid, ticks in now.items() if pid in last and ticks - last[pid] >= 2]
        if busy:
            return busy[0]
        last = now
        time.sleep(0.05)
    return None


def kill_the_run(cell: Cell) -> None:
    run = cell.start()
    fault_at = None
    if until(exists(cell.cache, cell.flow.checkpoint), [run]) and run.alive():
        os.kill(run.proc.pid, signal.SIGKILL)     # the run only, as the OOM killer would: not its group
        fault_at = time.monotonic()
    else:
        cell.outcome.notes.append("the run ended before its first checkpoint: no fault injected")
    cell.finish(run, fault_at)
    cell.rerun()


def fill_the_disk(cell: Cell) -> None:
    assert cell.disk is not None
    run = cell.start()
    fault_at = None
    if until(exists(cell.cache, cell.flow.checkpoint), [run]) and run.alive():
        cell.disk.fill()
        fault_at = time.monotonic()
        cell.outcome.notes.append("cache on a tmpfs filled" if isinstance(cell.disk, Tmpfs) else "ENOSPC injected")
    else:
        cell.outcome.notes.append("the run ended before its first checkpoint: no fault injected")
    cell.finish(run, fault_at)
    cell.disk.free()
    cell.rerun()


def stop_a_server(cells: list[Cell], shell: Shell, service: str) -> None:
    """Both flows run; once both have written their first checkpoint the server stops."""
    runs = [c.start() for c in cells]
    reached = until(lambda: all(any(c.cache.glob(c.flow.checkpoint)) for c in cells), runs)
    fault_at = None
    if reached and all(r.alive() for r in runs):
        shell.stop(service)
        fault_at = time.monotonic()
    for c, r in zip(cells, runs):
        if fault_at is None:
            c.outcome.notes.append(f"the runs did not both reach their checkpoint alive: {service} not stopped")
        c.finish(r, fault_at)


class Matrix:
    """The cells, run a fault at a time (both flows at once) and remembered."""

    def __init__(self, shell: Shell, base: Path, folder: Path, disk: str = "auto"):
        self.shell, self.base, self.folder, self.disk = shell, base, folder, disk
        self.baselines: dict[str, Outcome] = {}
        self.results: dict[str, dict[str, Outcome]] = {}

    def cells(self, fault: str) -> list[Cell]:
        out = []
        for flow in FLOWS.values():
            where = self.folder / fault / flow.name
            disk = self.make_disk(where / "fs") if fault == "disk" else None
            out.append(Cell(flow, fault, self.shell, self.base, where, disk))
        if fault == "sigkill":      # a killed run must not leave Prefect's temporary server behind either
            out.append(Cell(FLOWS["offline"], fault, self.shell, self.base, self.folder / fault / "alone",
                            servers=False))
            # the workers of a killed run exit too (they watch their parent); the rerun resumes
            processes = replace(FLOWS["online"], sets=FLOWS["online"].sets + ("experiment.task_runner=processes",))
            out.append(Cell(processes, fault, self.shell, self.base, self.folder / fault / "processes",
                            label="online, processes"))
        return out

    def make_disk(self, root: Path):
        disk: Tmpfs | InjectedDisk
        disk = Tmpfs(root) if self.disk in ("auto", "tmpfs") else InjectedDisk(root)
        if not disk.available:
            if self.disk == "tmpfs":
                raise RuntimeError(f"cannot mount a tmpfs at {root}: {disk.why}")
            disk = InjectedDisk(root.with_name("injected"))
        return disk

    def baseline(self) -> dict[str, Outcome]:
        if not self.baselines:
            cells = self.cells("undisturbed")
            _together(undisturbed, cells)
            for c in cells:
                c.compare(None)
                self.baselines[c.flow.name] = c.outcome
        return self.baselines

    def run(self, fault: str) -> dict[str, Outcome]:
        if fault not in self.results:
            base = self.baseline()
            cells = self.cells(fault)
            try:
                if fault in ("mlflow", "prefect"):
                    stop_a_server(cells, self.shell, fault)
                else:
                    _together({"grader": kill_a_grader, "sigkill": kill_the_run, "disk": fill_the_disk}[fault], cells)
                for c in cells:
                    c.compare(base[c.flow.name].digests)
            finally:
                for c in cells:
                    if c.disk is not None:
                        c.disk.close()
            self.results[fault] = {c.outcome.flow: c.outcome for c in cells}
        return self.results[fault]


def _together(scenario: Callable[[Cell], None], cells: list[Cell]) -> None:
    """`scenario` for each cell at once, in threads; the first error is raised."""
    errors: list[BaseException] = []

    def one(c: Cell) -> None:
        try:
            scenario(c)
        except BaseException as exc:    # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append(exc)
    threads = [threading.Thread(target=one, args=(c,), name=f"fault-{c.flow.name}") for c in cells]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


# ---------------------------------------------------------------- the table

FAULT_TEXT = {
    "undisturbed": "none (the reference run)",
    "grader": "a grading worker SIGKILLed while it grades",
    "sigkill": "the run SIGKILLed after its first checkpoint, then rerun",
    "disk": "the cache's disk full after the first checkpoint, then freed and rerun",
    "mlflow": "the MLflow server stopped mid-run",
    "prefect": "the Prefect server stopped mid-run",
}


def _s(x: float | None) -> str:
    return "–" if x is None else f"{x:.1f}"


def table(outcomes: list[Outcome]) -> str:
    rows = ["| fault | flow | exit | warning/error lines | s fault→exit | rerun: exit, lines, s | artifacts = "
            "undisturbed | processes left | notes |",
            "|---|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        rerun = "–" if o.rerun_exit is None else f"{o.rerun_exit}, {len(o.rerun_warnings)}, {_s(o.rerun_s)}"
        equal = "–" if o.differences is None else ("yes" if not o.differences else f"no ({len(o.differences)} files)")
        left = f"{len(o.leftovers)}" + ("" if o.gone_s is None else f" (all gone in {o.gone_s:.1f} s)")
        rows.append(f"| {FAULT_TEXT[o.fault]} | {o.flow} | {o.exit} | {len(o.warnings)}"
                    f"{' + Traceback' if o.traceback else ''} | {_s(o.fault_to_exit_s)} | {rerun} | {equal} | {left} "
                    f"| {'; '.join(o.notes)} |")
    return "\n".join(rows)


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or "?")
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return f"{len(os.sched_getaffinity(0))} cores of {model}, {mem:.0f} GiB, {platform.system()} {platform.release()}"


def measured_on(t0: float, load0: float) -> str:
    """Where and how (seconds since t0, load average then and now) the table was measured."""
    return (f"Measured on {machine()} in {time.monotonic() - t0:.0f} s ({time.strftime('%Y-%m-%d')}; two flows "
            f"at a time; load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end).")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--disk", choices=("auto", "tmpfs", "injected"), default="auto")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    faults = [f for f in FAULTS if f in args.faults.split(",")]
    work = Path(tempfile.mkdtemp(prefix="ggpo-fault-matrix-"))
    os.environ["GGPO_CACHE"] = str(work / "cache")
    from pipeline.core.config import load_config
    from stages import base_model
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    base_folder = Path(base_model.run(load_config("smoke")).folder)
    shell = Shell(work / "home", work / "cache")
    shell.up()
    matrix = Matrix(shell, base_folder, work / "cells", args.disk)
    try:
        outcomes = list(matrix.baseline().values())
        for fault in faults:
            outcomes += list(matrix.run(fault).values())
    finally:
        shell.down()
    text = f"{table(outcomes)}\n\n{measured_on(t0, load0)}"
    print(text)
    for o in outcomes:
        for line in o.warnings + o.rerun_warnings:
            print(f"  {o.fault}/{o.flow}: {line[:200]}")
    if args.out:
        args.out.write_text(text + "\n")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
