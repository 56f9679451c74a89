"""Content-addressed artifact store.

Every stage output is a folder `<root>/<stage>-<key[:16]>/` where key = sha256 of the
canonical JSON of (stage name, stage version, the config fields the stage reads, the keys
of its inputs, and the sha256 of files outside the store it reads). The folder holds the stage's files and `manifest.json`, written last
(temp file, fsync, rename). A folder without a manifest is an interrupted build: it is
never read, and the next run rebuilds it (a resumable stage such as training keeps its
`checkpoints/` and resumes from them). Root: `$GGPO_CACHE`, default `./data/cache`.

Integrity: an artifact is read only when its files match its manifest. `check` looks at
presence and size of every file, the footer of every Parquet file (last 4 bytes `PAR1`
and a footer length that fits) and the sha256; a file's hash is computed once per process
for a given (path, size, mtime, inode), so a cache hit costs a `stat` per file after the
first look. `load` treats a damaged artifact like an interrupted build (None, with a
warning), so `run_stage` rebuilds it; `inspect` says what is wrong. Each problem is one
line naming the artifact folder, the file and what is wrong. `verify_all` re-hashes
everything (`ggpo cache verify`); `gc_plan` says what `ggpo cache gc` may remove.

Location. A manifest names its files relative to the store root: `manifest.json` holds
`folder` = `<stage>-<key16>` (older ones an absolute path, ignored), and the store that
loads a manifest sets `folder` to where the files are on this machine. A cache copied or
mounted elsewhere therefore reads only its own files.

Shared store. `GGPO_CACHE` may be an fsspec URL (`s3://bucket/prefix`, `gs://…`,
`file:///shared/cache`; options in `GGPO_CACHE_OPTIONS`, see `pipeline/core/remote_store.py`).
Stages still build into and read from a local folder, the mirror (`Store.root`, under
`$GGPO_STAGING` or `$GGPO_HOME/staging`): `commit` uploads the build's files, then the
manifest last; `load` reads the remote manifest (none: not built, never read), downloads
the artifact into the mirror once, and checks it like a local one. A plain path is used in
place, as before. `check_store` opens the store before any work (one line if it cannot).

One build of a key at a time. `build_lock(stage, key)` (held by run_stage from before its
second cache lookup until the manifest is written) is an exclusive flock on
`<root>/.<stage>-<key16>.build.lock`, beside the artifact's folder, holding who builds it
(pid, host, since). A second process (or thread) that needs the key waits, says so in one
line naming the holder, then finds the artifact in the cache. The kernel releases a flock
when its holder dies, SIGKILL included: the waiter then rebuilds (an interrupted build, as
above). A flock reaches the processes of one machine (on NFS, Linux maps it to a POSIX
lock the server keeps). A remote store also takes a claim in the store itself
(`pipeline/core/remote_store.py`, "one build of a key at a time"): a key being built on
another machine stops the run in one line instead of two builds uploading into one folder.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from pydantic import BaseModel

from pipeline.core.errors import DamagedArtifact, DiskFull, StoreError, is_disk_full
from pipeline.core.remote_store import Remote, check_remote, claim, is_url, lock_path, mirror_root, release

CACHE_ENV = "GGPO_CACHE"
MANIFEST = "manifest.json"
log = logging.getLogger("ggpo")


class FileEntry(BaseModel):
    path: str               # relative to the artifact folder
    bytes: int
    sha256: str
    rows: int | None = None


class Manifest(BaseModel):
    """What flows pass between stages: small, JSON-able, never tensors."""
    stage: str
    key: str
    version: int
    folder: str
    config: dict[str, Any]
    inputs: dict[str, str]           # input name -> key
    files: dict[str, FileEntry]
    summary: dict[str, Any] = {}
    created_at: str
    seconds: float
    cache_hit: bool = False
    content: dict[str, str] = {}     # sha256 of files outside the store the stage reads (task, benchmarks)

    def path(self, name: str) -> Path:
        return Path(self.folder) / self.files[name].path


def model_path(manifest: Manifest, update: int | None = None) -> str:
    """Where downstream stages load pi_0, a trained policy, or its snapshot after `update`
    updates from. A model an artifact holds is found through its own files (the file named
    "weights", or "snapshot_<update>" of a trained one; each in an HF folder), under
    `manifest.folder` as set by the store that loaded it, so a copied or remote cache reads
    its own copy. Only an external model (`model.name_or_path`) comes from the summary."""
    if "weights" not in manifest.files:
        return manifest.summary["model_path"]
    if update is None or manifest.stage in ("base", "online_policy"):     # one model each
        return str(manifest.path("weights").parent)
    if f"snapshot_{update}" not in manifest.files:
        known = sorted(int(k.split("_")[1]) for k in manifest.files if k.startswith("snapshot_"))
        raise ValueError(f"eval.update={update}: training run {manifest.key[:16]} has snapshots at {known} "
                         f"(train.eval_every) and its final model (eval.update unset)")
    return str(manifest.path(f"snapshot_{update}").parent)


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def stage_key(stage: str, version: int, config: dict, inputs: dict[str, str],
              content: dict[str, str] | None = None) -> str:
    payload = {"stage": stage, "version": version, "config": config, "inputs": inputs}
    if content:     # only when present, so keys of stages that read no outside file stay as they were
        payload["content"] = content
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# (path, size, mtime_ns, inode) -> sha256: a file is hashed once per process unless it changes
_hashes: dict[tuple, str] = {}
_hashes_lock = threading.Lock()


def sha256_cached(path: str | Path, fresh: bool = False) -> str:
    """sha256 of a file, remembered for this process while its size, mtime and inode stay;
    fresh: hash it now whatever is remembered (and remember that)."""
    st = os.stat(path)
    stamp = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    with _hashes_lock:
        known = None if fresh else _hashes.get(stamp)
    if known is None:
        known = sha256_file(Path(path))
        with _hashes_lock:
            _hashes[stamp] = known
    return known


def parquet_footer_problem(path: Path, size: int) -> str | None:
    """What is wrong with a Parquet file's framing (magic at both ends, footer length), or
    None; reads 12 bytes, never the data."""
    if size < 12:
        return f"is too small for Parquet ({size} bytes)"
    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(size - 8)
        tail = f.read(8)
    if tail[4:] != b"PAR1":
        return "has no Parquet footer (does not end with PAR1)"
    if head != b"PAR1":
        return "does not start with PAR1"
    footer = int.from_bytes(tail[:4], "little")
    if footer + 12 > size:
        return f"has a Parquet footer length {footer} that does not fit in {size} bytes"
    return None


# Before a read, files up to this size are hashed; larger ones (a 1.7 B model's weights are
# 7 GB, its snapshots five times that) get presence, size and their header checked, so a
# cache hit in a new process does not spend minutes hashing. `ggpo cache verify` (fresh)
# hashes everything.
HASH_BEFORE_READ_MAX_BYTES = 256 << 20


def safetensors_header_problem(path: Path, size: int) -> str | None:
    """What is wrong with a safetensors file's header (length prefix, JSON), or None."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n + 8 > size:
            return f"has a safetensors header length {n} that does not fit in {size} bytes"
        try:
            json.loads(f.read(n))
        except ValueError:
            return "has a safetensors header that is not JSON"
    return None


def file_problem(folder: Path, entry: "FileEntry", hashes: bool = True, fresh: bool = False) -> str | None:
    """What is wrong with one file of an artifact, or None. hashes: compare sha256 too
    (files over HASH_BEFORE_READ_MAX_BYTES only when fresh); fresh: hash again even if
    this process hashed the same file before."""
    path = folder / entry.path
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "is missing"
    if size != entry.bytes:
        return f"is {size} bytes, the manifest says {entry.bytes} (truncated or rewritten)"
    header = {".parquet": parquet_footer_problem, ".safetensors": safetensors_header_problem}.get(path.suffix)
    problem = header(path, size) if header else None
    if problem:
        return problem
    if hashes and (fresh or size <= HASH_BEFORE_READ_MAX_BYTES):
        digest = sha256_file(path) if fresh else sha256_cached(path)
        if digest != entry.sha256:
            return f"has sha256 {digest[:12]}..., the manifest says {entry.sha256[:12]}... (altered)"
    return None


def check(manifest: Manifest, hashes: bool = True, fresh: bool = False) -> list[str]:
    """One line per damaged file of an artifact (empty: intact)."""
    folder = Path(manifest.folder)
    out = []
    for entry in manifest.files.values():
        problem = file_problem(folder, entry, hashes, fresh)
        if problem:
            out.append(f"artifact {folder.name} (stage {manifest.stage}): {entry.path} {problem}")
    return out


def fsync_rename(tmp: Path, final: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


# ---------------------------------------------------------------- a full disk
# Every write of the project goes to a temporary file that is renamed into place once
# complete, so a disk that fills mid-write leaves the previous file (manifest, checkpoint,
# report) as it was; the temporary is removed, and the failure becomes one line (DiskFull)
# naming the path and the space the write needed.

def size_text(n: int | None) -> str:
    """Bytes for a message: "12 bytes", "3.4 KiB", "6.2 MiB", "1.5 GiB"."""
    if n is None:
        return "an unknown amount"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def free_bytes(path: Path) -> int | None:
    """Bytes free on the filesystem that holds `path` (its nearest existing parent)."""
    for where in (path, *path.parents):
        try:
            return shutil.disk_usage(where).free
        except OSError:
            continue
    return None


def disk_full(path: Path, needed: int | None, doing: str = "writing") -> DiskFull:
    """The one line for a write into `path` that the disk could not hold."""
    need = f"needs about {size_text(needed)}" if needed else "needs more space"
    return DiskFull(f"disk full: {doing} {path} {need}, {size_text(free_bytes(path))} free there")


@contextmanager
def atomic_path(path: Path, needed: int | Callable[[], int] | None = None) -> Iterator[Path]:
    """A temporary path next to `path` (same suffix: writers that go by it still do) for
    the body to write; once the body is done it is fsynced and renamed onto `path`. On any
    failure the temporary is removed, so `path` keeps what it held, and a full disk raises
    DiskFull naming `path` and `needed` bytes (a number or a function computing it)."""
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}-{threading.get_ident()}{path.suffix}")
    try:
        yield tmp
        fsync_rename(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, DiskFull) or not is_disk_full(exc):
            raise
        raise disk_full(path, needed() if callable(needed) else needed) from exc


def write_file_atomic(path: Path, write: Callable[[Path], object], needed: int | None = None) -> None:
    """`write(tmp)` (e.g. a DataFrame's write_csv, a figure's savefig), then renamed onto `path`."""
    with atomic_path(path, needed) as tmp:
        write(tmp)


def write_text_atomic(path: Path, text: str) -> None:
    data = text.encode()
    with atomic_path(path, len(data)) as tmp:
        tmp.write_bytes(data)


def default_root() -> Path | str:
    """`$GGPO_CACHE` (default ./data/cache) as an absolute Path, or the URL as given."""
    root = os.environ.get(CACHE_ENV, "data/cache")
    return root.rstrip("/") if is_url(root) else Path(root).resolve()


def check_store(root: str | Path | None = None) -> None:
    """Raise StoreError (one line) when the store cannot be used: a URL whose protocol is
    unknown or whose package is not installed, missing credentials, an endpoint that does
    not answer, a missing bucket, no write permission; a local root that cannot be created
    or written. Writes and removes one small probe object. Call before any work."""
    root = default_root() if root is None else root
    if is_url(str(root)):
        check_remote(str(root).rstrip("/"))
        return
    path = Path(root).resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"GGPO_CACHE={path}: cannot create the cache folder ({exc.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise StoreError(f"GGPO_CACHE={path}: the cache folder is not writable; fix its permissions or "
                         f"point GGPO_CACHE elsewhere")


def parse_manifest(text: str, name: str, stage: str, key: str) -> tuple[Manifest | None, str | None]:
    """(manifest, None) or (None, one line saying why `name`'s manifest cannot be used)."""
    try:
        manifest = Manifest.model_validate_json(text)
    except ValueError as exc:
        first = str(exc).splitlines()[0]
        return None, f"artifact {name} (stage {stage}): {MANIFEST} is unreadable ({first})"
    if manifest.key != key:
        return None, (f"artifact {name} (stage {stage}): {MANIFEST} holds key "
                      f"{manifest.key[:16]}, not the folder's {key[:16]}")
    return manifest, None


@contextmanager
def mirror_lock(root: Path, name: str) -> Iterator[None]:
    """An exclusive lock on one mirrored artifact (flock: between threads and processes)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "a") as f:
        try:
            import fcntl
        except ImportError:     # not POSIX: no cross-process lock
            yield
            return
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


# ---------------------------------------------------------------- one build of a key at a time

LOCK_POLL_S = 0.25          # a waiting build looks again this often (a syscall: nothing)
REMOTE_POLL_S = 2.0         # ... and at a remote claim (a request each time)


def lock_file(root: Path, name: str) -> Path:
    """The build lock of the artifact folder `name`: beside it, hidden (never an artifact folder)."""
    return root / f".{name}.build.lock"


def holder_record(stage: str, key: str) -> str:
    """What a build lock holds while held: who builds which key, since when."""
    return canonical_json({"pid": os.getpid(), "host": socket.gethostname(), "since": now_iso(),
                           "stage": stage, "key": key})


def holder_text(raw: str) -> str:
    """'process 4242 on host h (since 2026-12-03 16:55:21 UTC)' from a lock's record."""
    try:
        who = json.loads(raw)
        return f"process {who['pid']} on host {who['host']} (since {who['since'].replace('T', ' ').rstrip('Z')} UTC)"
    except (ValueError, KeyError, TypeError, AttributeError):
        return "another process (not named yet)"


def alive_here(raw: str) -> bool | None:
    """Whether the process a lock record names is alive: True or False for one of this host,
    None for another host's (or an unreadable record): it cannot be seen from here."""
    try:
        who = json.loads(raw)
        pid, host = int(who["pid"]), who["host"]
    except (ValueError, KeyError, TypeError):
        return None
    if host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # alive, another user's
        return True
    return True


def read_record(path: Path) -> str:
    """The lock file's record; its holder writes it just after taking the lock, so an empty
    one is read again for a moment."""
    text = ""
    for _ in range(25):
        try:
            text = path.read_text()
        except OSError:
            return ""
        if text:
            return text
        time.sleep(0.02)
    return text


@contextmanager
def flock_wait(path: Path, record: str, what: str, on_wait: Callable[[], None]) -> Iterator[bool]:
    """An exclusive flock on `path` (created), holding `record` while held. Held by another
    process or thread: waited for, said once in one line (`what`, who holds it), `on_wait()`
    between looks (it may raise to stop waiting). Yields whether it waited."""
    try:
        import fcntl
    except ImportError:     # not POSIX: no cross-process lock
        yield False
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        waited = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waited:
                    log.info("%s is being built by %s; waiting for it (lock %s)", what,
                             holder_text(read_record(path)), path)
                    waited = True
                on_wait()
                time.sleep(LOCK_POLL_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode(), 0)
        try:
            yield waited
        finally:
            os.ftruncate(fd, 0)     # no stale name for the next waiter to quote
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class Store:
    """root: the local folder artifacts are built in and read from. url: the remote root
    when GGPO_CACHE (or `root`) is a URL, else None."""

    def __init__(self, root: str | Path | None = None):
        root = default_root() if root is None or root == "" else root
        if isinstance(root, str) and is_url(root):
            self.url: str | None = root.rstrip("/")
            self.remote: Remote | None = Remote(self.url)
            self.root = mirror_root(self.url)
        else:
            self.url, self.remote = None, None
            self.root = Path(root).resolve()

    @property
    def location(self) -> str:
        """Where the store is, for messages: the URL or the local root."""
        return self.url or str(self.root)

    def folder(self, stage: str, key: str) -> Path:
        return self.root / f"{stage}-{key[:16]}"

    def address(self, manifest: Manifest) -> str:
        """Where an artifact lives in the store: the remote folder's URL or the local folder."""
        return f"{self.url}/{Path(manifest.folder).name}" if self.url else manifest.folder

    def inspect(self, stage: str, key: str, hashes: bool = True) -> tuple[Manifest | None, list[str]]:
        """(manifest, problems): (None, []) when not built or interrupted; (None, [..])
        when manifest.json itself is unreadable; (manifest, [..]) when files are damaged."""
        if self.remote is not None:
            return self._inspect_remote(stage, key, hashes)
        path = self.folder(stage, key) / MANIFEST
        if not path.exists():
            return None, []
        manifest, problem = parse_manifest(path.read_text(), path.parent.name, stage, key)
        if problem:
            return None, [problem]
        assert manifest is not None     # parse_manifest returns a manifest or a problem
        if manifest.folder != str(path.parent):     # relative in the file (or the cache moved): its files are here
            manifest = manifest.model_copy(update={"folder": str(path.parent)})
        return manifest, check(manifest, hashes)

    def _inspect_remote(self, stage: str, key: str, hashes: bool) -> tuple[Manifest | None, list[str]]:
        """The remote manifest decides; the artifact is downloaded into the local mirror
        (once: a mirror whose manifest equals the remote one is current) and checked there."""
        assert self.remote is not None      # inspect calls this for a remote store only
        local = self.folder(stage, key)
        text = self.remote.read_manifest(local.name)
        if text is None:
            return None, []
        manifest, problem = parse_manifest(text, local.name, stage, key)
        if problem:
            return None, [f"{problem} at {self.url}"]
        assert manifest is not None     # as in inspect
        manifest = manifest.model_copy(update={"folder": str(local)})
        mirrored = local / MANIFEST
        with mirror_lock(self.root, local.name):    # threads and processes sharing this mirror fetch once
            if mirrored.exists() and mirrored.read_text() == text and not check(manifest, hashes):
                return manifest, []
            # first use on this machine, a rebuilt remote artifact, or a damaged mirror
            try:
                self.remote.fetch(local.name, local)
            except Exception as exc:     # fetch downloads into a temp folder, removed on failure
                if not is_disk_full(exc):
                    raise
                raise disk_full(local, sum(e.bytes for e in manifest.files.values()),
                                f"mirroring {self.url}/{local.name} into") from exc
            problems = [f"{p} at {self.url}" for p in check(manifest, hashes)]
            if not problems:
                write_text_atomic(mirrored, text)   # last: the mirror is complete
        return manifest, problems

    def load(self, stage: str, key: str) -> Manifest | None:
        """The manifest if the artifact is complete and intact, else None: an interrupted
        or damaged artifact is never read, and the stage that owns it rebuilds it."""
        manifest, problems = self.inspect(stage, key)
        for problem in problems:
            log.warning("%s; it will be rebuilt", problem)
        return None if problems else manifest

    def resolve(self, manifest: Manifest) -> Manifest:
        """`manifest` (e.g. made on another machine) with `folder` where its files are on
        this one: the local root's folder, or the remote artifact mirrored here (downloaded
        and checked). Raises DamagedArtifact (one line) when the store does not hold it intact."""
        folder = self.folder(manifest.stage, manifest.key)
        if self.remote is None:
            return manifest if manifest.folder == str(folder) else manifest.model_copy(update={"folder": str(folder)})
        if manifest.folder == str(folder) and (folder / MANIFEST).exists():
            return manifest     # built or mirrored here already
        found, problems = self.inspect(manifest.stage, manifest.key)
        if found is None or problems:
            why = problems[0] if problems else "it has no manifest there"
            raise DamagedArtifact(f"artifact {folder.name} (stage {manifest.stage}) cannot be read from "
                                  f"{self.url}: {why}")
        return found.model_copy(update={"cache_hit": manifest.cache_hit})

    def check(self, manifest: Manifest, hashes: bool = True) -> list[str]:
        return check(manifest, hashes)

    @contextmanager
    def build_lock(self, stage: str, key: str, on_wait: Callable[[], None] = lambda: None) -> Iterator[bool]:
        """Held while this process builds (stage, key): a flock beside its folder (module
        docstring), and for a remote store a claim in the store too. Yields whether it
        waited for another holder (who may have built it meanwhile: look again)."""
        name = self.folder(stage, key).name
        record = holder_record(stage, key)
        with flock_wait(lock_file(self.root, name), record, f"{stage}: {key[:16]}", on_wait) as waited:
            if self.remote is None:
                yield waited
                return
            with self._remote_claim(stage, key, record, on_wait) as waited_there:
                yield waited or waited_there

    @contextmanager
    def _remote_claim(self, stage: str, key: str, record: str, on_wait: Callable[[], None]) -> Iterator[bool]:
        """The store's own claim on (stage, key) (remote_store.claim): a live holder on this
        host is waited for, a dead one's claim taken over, another host's is one StoreError."""
        assert self.remote is not None      # build_lock calls this for a remote store only
        name, waited = self.folder(stage, key).name, False
        while (held := claim(self.remote, name, record)) is not None:
            alive = alive_here(held)
            where = f"{self.url}/{lock_path(self.remote, name).rsplit('/', 2)[-2]}/{name}.json"
            if alive is False:      # killed mid-build (its flock went with it; this claim stays)
                log.warning("%s: %s was claimed by %s, which is gone; building it here (claim %s replaced)",
                            stage, key[:16], holder_text(held), where)
                release(self.remote, name, held)
                continue
            if alive is None:
                raise StoreError(f"artifact {name} (stage {stage}) at {self.url} is being built by {holder_text(held)} "
                                 f"(claim {where}); this run does not build it too: rerun once that run is done, "
                                 f"or delete the claim if that run is gone")
            if not waited:
                log.info("%s: %s is being built by %s; waiting for it (claim %s)", stage, key[:16],
                         holder_text(held), where)
                waited = True
            on_wait()
            time.sleep(REMOTE_POLL_S)
        try:
            yield waited
        finally:
            release(self.remote, name, record)

    def begin(self, stage: str, key: str, keep: tuple[str, ...] = ()) -> Path:
        """A clean work folder for a build; an old manifest (forced rerun) and any
        leftovers of an interrupted build go, except the names in `keep`."""
        folder = self.folder(stage, key)
        if self.remote is not None:     # no reader may pair the old manifest with new files
            self.remote.clear(folder.name)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MANIFEST).unlink(missing_ok=True)
        for child in folder.iterdir():
            if child.name in keep:
                continue
            shutil.rmtree(child) if child.is_dir() else child.unlink()
        return folder

    def abandon(self, folder: Path, stage: str, keep: tuple[str, ...], exc: BaseException) -> DiskFull:
        """After a build into `folder` ran out of space: its unfinished files removed (they
        would only hold space; without a manifest no run reads them), except `keep`
        (checkpoints a rerun resumes from); the one line to raise."""
        written = 0
        for child in list(folder.iterdir()) if folder.exists() else []:
            if child.name in keep:
                continue
            written += folder_bytes(child) if child.is_dir() else child.stat().st_size
            shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
        present = [k for k in keep if (folder / k).exists()]
        kept = f"; kept {', '.join(present)} to resume from" if present else ""
        if isinstance(exc, DiskFull):    # the write that failed named itself
            return DiskFull(f"{exc} (stage {stage}: its unfinished files in {folder} were removed{kept})")
        need = f"more than the {size_text(written)} it had written (removed{kept})" if written else f"more space{kept}"
        return DiskFull(f"disk full: building stage {stage} in {folder} needs {need}, "
                        f"{size_text(free_bytes(folder))} free there")

    def commit(self, manifest: Manifest) -> Manifest:
        """Publish a finished build: (remote: upload its files, then) the manifest, last.
        The file holds the folder relative to the root; the returned manifest the local one."""
        folder = Path(manifest.folder)
        text = manifest.model_copy(update={"folder": folder.name}).model_dump_json(indent=2)
        if self.remote is not None:
            try:
                self.remote.upload(folder, folder.name)
                self.remote.write_manifest(folder.name, text)
            except Exception as exc:     # the store is full, not this machine: say where
                if not is_disk_full(exc):
                    raise
                raise DiskFull(f"disk full: uploading {folder} to {self.url}/{folder.name} needs about "
                               f"{size_text(sum(e.bytes for e in manifest.files.values()))}: the store is out of "
                               f"space") from exc
        write_text_atomic(folder / MANIFEST, text)
        return manifest

    def entries(self) -> list[Manifest]:
        """Every complete artifact (remote: listed there, nothing downloaded), oldest first;
        `folder` is where its files are (or would be mirrored) on this machine."""
        if self.remote is not None:
            texts = self.remote.manifests()
        elif self.root.exists():
            texts = [(p.parent.name, p.read_text()) for p in sorted(self.root.glob(f"*/{MANIFEST}"))]
        else:
            texts = []
        found = []
        for name, text in texts:
            try:
                manifest = Manifest.model_validate_json(text)
            except ValueError:
                continue  # foreign or damaged folder: listing must not crash
            found.append(manifest.model_copy(update={"folder": str(self.root / name)}))
        return sorted(found, key=lambda m: m.created_at)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def artifact_folders(root: Path) -> list[tuple[Path, str]]:
    """(folder, stage) of every `<stage>-<16 hex>` folder under root; anything else in the
    root is not ours and is never touched."""
    out = []
    for folder in sorted(root.iterdir()) if root.exists() else []:
        stage, _, short = folder.name.rpartition("-")
        if folder.is_dir() and stage and len(short) == 16 and all(c in "0123456789abcdef" for c in short):
            out.append((folder, stage))
    return out


def read_manifest(folder: Path) -> tuple[Manifest | None, str | None]:
    """(manifest, None), (None, None) when there is none, or (None, why it is unreadable)."""
    path = folder / MANIFEST
    if not path.exists():
        return None, None
    try:
        return Manifest.model_validate_json(path.read_text()), None
    except ValueError as exc:
        return None, str(exc).splitlines()[0]


def verify_all(store: Store) -> tuple[int, int, int, list[str]]:
    """Re-hash every file of every complete artifact against its manifest (no remembered
    hashes): (artifacts, files, bytes, one line per problem). A remote store: presence and
    size of every file there, without downloading (hashes are checked when staged)."""
    if store.remote is not None:
        return _verify_remote(store)
    artifacts = files = size = 0
    problems = []
    for folder, stage in artifact_folders(store.root):
        manifest, error = read_manifest(folder)
        if error:
            problems.append(f"artifact {folder.name} (stage {stage}): {MANIFEST} is unreadable ({error})")
        if manifest is None:
            continue
        manifest = manifest.model_copy(update={"folder": str(folder)})   # the folder as it is now
        artifacts, files = artifacts + 1, files + len(manifest.files)
        size += sum(e.bytes for e in manifest.files.values())
        problems += check(manifest, hashes=True, fresh=True)
    return artifacts, files, size, problems


def _verify_remote(store: Store) -> tuple[int, int, int, list[str]]:
    assert store.remote is not None     # verify_all calls this for a remote store only
    artifacts = files = size = 0
    problems = []
    for name, text in store.remote.manifests():
        stage = name.rpartition("-")[0]
        try:
            manifest = Manifest.model_validate_json(text)
        except ValueError as exc:
            problems.append(f"artifact {name} (stage {stage}): {MANIFEST} is unreadable "
                            f"({str(exc).splitlines()[0]}) at {store.url}")
            continue
        there = store.remote.files(name)
        artifacts, files = artifacts + 1, files + len(manifest.files)
        size += sum(e.bytes for e in manifest.files.values())
        for entry in manifest.files.values():
            got = there.get(entry.path)
            why = ("is missing" if got is None else None if got == entry.bytes else
                   f"is {got} bytes, the manifest says {entry.bytes} (truncated or rewritten)")
            if why:
                problems.append(f"artifact {name} (stage {manifest.stage}): {entry.path} {why} at {store.url}")
    return artifacts, files, size, problems


def gc_plan(store: Store, versions: dict[str, int], protected: set[tuple[str, str]] | None = None,
            all_interrupted: bool = False) -> list[tuple[Path, str, int]]:
    """(folder, why, bytes) of what `ggpo cache gc` removes. The rule is conservative:
    - an interrupted build (no manifest, or an unreadable one), except a train folder with
      checkpoints/ or an online cell's state folder (a rerun resumes from it) unless
      all_interrupted;
    - an unreachable artifact: its stage is gone, or its stage version is not the code's
      (`versions`: stage -> current version), or it was built on an unreachable one. Keys
      include the version, so no run of this code can ever read these;
    - with `protected` (a set of (stage, key)): also every complete artifact that leads to
      no result: not in `protected` (the presets' experiments), not a result itself
      (RESULT_STAGES: trained policies and evaluations, whatever config made them), and not
      an input, directly or through others, of something kept. This drops pools nobody
      trained on and online rounds that led to no policy; it never drops a result, nor
      anything a result's report reads (a stopped cell's rounds, its last policy).
    """
    if store.remote is not None:
        raise StoreError(f"GGPO_CACHE={store.url}: `ggpo cache gc` is not supported for remote stores yet; "
                         f"remove folders with the storage's own tools (its local mirror {store.root} "
                         f"may be deleted at any time)")
    plan, complete = [], {}
    for folder, stage in artifact_folders(store.root):
        manifest, error = read_manifest(folder)
        if manifest is not None:
            complete[manifest.key] = (folder, manifest)
            continue
        if stage in ("train", "online_cell") and (folder / "checkpoints").is_dir() and not all_interrupted and not error:
            continue        # a training run or an online cell's state: a rerun resumes from it
        why = f"{MANIFEST} unreadable" if error else "interrupted build (no manifest)"
        plan.append((folder, why, folder_bytes(folder)))
    dead = {k for k, (_, m) in complete.items() if versions.get(m.stage) != m.version}
    while True:     # built on something unreachable: unreachable too
        more = {k for k, (_, m) in complete.items() if k not in dead and set(m.inputs.values()) & dead}
        if not more:
            break
        dead |= more
    keep = kept_keys(complete, dead, protected or set())
    for key, (folder, m) in complete.items():
        if key in dead:
            why = (f"stage '{m.stage}' no longer exists" if m.stage not in versions else
                   f"built by {m.stage} v{m.version}, the code is v{versions[m.stage]}"
                   if versions[m.stage] != m.version else "built on an unreachable artifact")
        elif protected is not None and key not in keep:
            why = "unreferenced: leads to no result (policy or evaluation) and no preset's experiment expects it"
        else:
            continue
        plan.append((folder, why, folder_bytes(folder)))
    return plan


# what a run is for: never removed by `ggpo cache gc --unreferenced`, whatever config made it
RESULT_STAGES = ("train", "online_policy", "evaluate")


def kept_keys(complete: dict[str, tuple[Path, Manifest]], dead: set[str], protected: set[tuple[str, str]]) -> set[str]:
    """The keys of the results and protected artifacts, and of everything they were built
    on (their inputs, transitively)."""
    todo = [k for k, (_, m) in complete.items() if k not in dead
            and (m.stage in RESULT_STAGES or (m.stage, k) in protected)]
    keep: set[str] = set()
    while todo:
        key = todo.pop()
        if key in keep or key not in complete:
            continue
        keep.add(key)
        todo += complete[key][1].inputs.values()
    return keep


def file_entry(folder: Path, rel: str, rows: int | None = None) -> FileEntry:
    path = folder / rel
    # hashed now (the manifest must be right), then remembered: the next stage's input
    # check in this process costs a stat, not a hash
    return FileEntry(path=rel, bytes=path.stat().st_size, sha256=sha256_cached(path, fresh=True), rows=rows)


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
