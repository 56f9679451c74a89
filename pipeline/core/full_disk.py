"""Disks that fill, for the tests (tests/test_disk_full.py, the torchrun ranks of
tests/test_distributed.py) and the fault matrix (benchmarks/fault_matrix.py); nothing in a
run uses this module.

`Tmpfs(root, size)`: a size-limited tmpfs mounted at `root` that really fills (`why` says
why not where mounting is not permitted: then use the injected disk; mount=False: one
already mounted there, by another process). fill(room) leaves
`room` bytes free with a filler file (room 0: writes until ENOSPC, so a run writing
meanwhile cannot slip in between); free() deletes it; close() unmounts.

A full disk, injected: files opened for writing under a folder raise OSError(ENOSPC) on
write once the disk is full, where no size-limited filesystem can be mounted.

`InjectedDisk(root, flag=None)`: the disk under `root`, full
- with `flag`: while that file exists (any process that installed the disk sees it: a run
  started as a child, every rank of a torchrun); fill() touches it, free() removes it;
- without: once this process's byte budget is spent (fill(room) leaves `room` bytes; a
  write larger than what is left fails whole, as on a real disk; free() lifts the budget).

`install(setattr)` replaces Python's `open` (builtins, io, os.fdopen: MLflow stages
artifacts through a descriptor, named by /proc) and makes shutil copy through Python files
instead of sendfile; pass pytest's `monkeypatch.setattr` to have it undone, else it stays
for the process. Writes from native code (pyarrow, safetensors, polars) do not see it.
"""
from __future__ import annotations

import builtins
import errno
import io
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Callable

MiB = 1 << 20


class Tmpfs:
    """A size-limited tmpfs at `root` (see the module docstring)."""

    def __init__(self, root: Path | str, size: int = 64 * MiB, mount: bool = True):
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        self.root, self.filler, self.why = root, root / "filler", ""
        if not mount:       # one another process mounted: to fill it from here
            return
        try:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(root)],
                                  capture_output=True, text=True, timeout=60)
            self.why = (done.stderr.strip() or f"exit {done.returncode}") if done.returncode else ""
        except (OSError, subprocess.TimeoutExpired) as exc:     # no mount(8) at all
            self.why = str(exc)

    def fill(self, room: int = 0) -> None:
        with open(self.filler, "wb", buffering=0) as f:
            if room:
                free = os.statvfs(self.root)
                f.write(bytes(max(0, free.f_bavail * free.f_frsize - room)))
                return
            chunk = bytes(MiB)
            for size in (MiB, 64 * 1024, 4096, 1):
                try:
                    while True:
                        f.write(chunk[:size])
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise

    def free(self) -> None:
        self.filler.unlink()

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.root)], check=False, capture_output=True)


class FullFile:
    """A file under the injected disk: each write asks the disk first, then raises ENOSPC
    or goes through."""

    def __init__(self, disk: InjectedDisk, f):
        self._disk, self._f = disk, f

    def write(self, data) -> int:
        n = len(data.encode()) if isinstance(data, str) else len(memoryview(data).cast("B"))
        if not self._disk.take(n):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._f.name)
        return self._f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __iter__(self):
        return iter(self._f)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()


class InjectedDisk:
    """The disk under `root` (see the module docstring)."""

    def __init__(self, root: Path | str, flag: Path | str | None = None):
        self.root = Path(root).resolve()
        self.flag = Path(flag) if flag is not None else None
        self.budget: int | None = None

    def full(self) -> bool:
        return self.flag is not None and self.flag.exists()

    def take(self, n: int) -> bool:
        """Whether a write of `n` bytes fits (and, under a budget, spend them)."""
        if self.full():
            return False
        if self.budget is None:
            return True
        if n > self.budget:
            return False
        self.budget -= n
        return True

    def fill(self, room: int = 0) -> None:
        if self.flag is not None:
            self.flag.touch()
        else:
            self.budget = room

    def free(self) -> None:
        if self.flag is not None:
            self.flag.unlink(missing_ok=True)
        self.budget = None

    def close(self) -> None:
        """Nothing to unmount (as Tmpfs.close: either disk can be closed)."""

    def install(self, setattr: Callable[[Any, str, Any], None] = setattr) -> None:
        """Python's file opening, patched: a file opened for writing under `root` is a FullFile."""
        real = io.open

        def fake_open(file, mode="r", *args, **kwargs):
            f = real(file, mode, *args, **kwargs)
            # a descriptor (os.fdopen: MLflow's staged artifacts) is named by /proc
            where = os.readlink(f"/proc/self/fd/{file}") if isinstance(file, int) else file
            inside = isinstance(where, (str, os.PathLike)) and Path(where).resolve().is_relative_to(self.root)
            return FullFile(self, f) if inside and any(c in mode for c in "wax+") else f
        setattr(builtins, "open", fake_open)
        setattr(io, "open", fake_open)
        setattr(os, "fdopen", fake_open)
        setattr(shutil, "_USE_CP_SENDFILE", False)     # copies write through the file, not sendfile
