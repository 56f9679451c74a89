"""The store's remote side: `GGPO_CACHE` as an fsspec URL (`s3://bucket/prefix`, `gs://…`,
`file:///shared/cache`, any protocol fsspec knows).

Contract. Stages never see the remote: they build into a local folder and read local
files. This module moves whole artifact folders between that local folder and the remote:
- `upload` copies every file of a finished build except `checkpoints/` (resume state stays
  on the machine that built it), then `write_manifest` puts `manifest.json`, LAST, so a
  reader on another machine sees either no artifact or a complete one;
- `fetch` copies every file of a remote artifact except its manifest into a fresh local
  folder (the store checks them against the manifest before anything reads them).
Local layout (the "mirror"): `$GGPO_STAGING/<slug of the URL>/<stage>-<key16>/`, default
`$GGPO_HOME/staging/…`; two URLs never share a mirror.

Configuration (environment):
- `GGPO_CACHE`: the URL. A plain path (no `://`) is used in place, without this module.
- `GGPO_CACHE_OPTIONS`: JSON of fsspec storage options for that protocol, e.g.
  `{"endpoint_url": "http://127.0.0.1:9000"}` or `{"anon": true}` for s3fs, `{"project": "p"}`
  for gcsfs.
- The protocol's own variables: for S3, `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY` (or
  `AWS_PROFILE`), `AWS_DEFAULT_REGION`, and `AWS_ENDPOINT_URL` for an S3-compatible server
  (MinIO, Ceph, moto): botocore reads these itself.
`check_store` turns every failure to open the store (unknown protocol, package not
installed, no credentials, endpoint that does not answer, missing bucket, no write
permission) into one `StoreError` line, before any work.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path

from pipeline.core import paths
from pipeline.core.errors import StoreError, is_disk_full

OPTIONS_ENV = "GGPO_CACHE_OPTIONS"
STAGING_ENV = "GGPO_STAGING"
MANIFEST = "manifest.json"
LOCAL_ONLY = ("checkpoints",)       # top-level names never uploaded
# pip packages of fsspec's protocols that are not built in
PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "abfs": "adlfs", "az": "adlfs",
            "abfss": "adlfs", "adl": "adlfs", "hf": "huggingface_hub", "sftp": "paramiko", "ssh": "paramiko",
            "hdfs": "pyarrow", "webhdfs": "requests", "oci": "ocifs", "oss": "ossfs", "r2": "s3fs"}
# short timeouts for the preflight probe only: a dead endpoint answers in seconds, not minutes
PROBE_OPTIONS = {"s3": {"config_kwargs": {"connect_timeout": 5, "read_timeout": 10,
                                          "retries": {"max_attempts": 2, "mode": "standard"}}}}


def is_url(root) -> bool:
    return isinstance(root, str) and "://" in root


def protocol(url: str) -> str:
    return url.split("://", 1)[0].lower()


def storage_options() -> dict:
    raw = os.environ.get(OPTIONS_ENV, "").strip()
    if not raw:
        return {}
    try:
        opts = json.loads(raw)
    except ValueError as exc:
        raise StoreError(f"{OPTIONS_ENV} is not JSON ({exc}); give an object such as "
                         '\'{"endpoint_url": "http://127.0.0.1:9000"}\'') from None
    if not isinstance(opts, dict):
        raise StoreError(f"{OPTIONS_ENV} must be a JSON object of fsspec storage options, got {raw[:60]}")
    return opts


def mirror_root(url: str) -> Path:
    """The local folder holding staged builds and downloaded artifacts of the store at `url`."""
    base = Path(os.environ[STAGING_ENV]).resolve() if os.environ.get(STAGING_ENV) else paths.state_dir() / "staging"
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", url)[:60].strip("_")
    return base / f"{slug}-{hashlib.sha256(url.encode()).hexdigest()[:8]}"


def describe(exc: BaseException, url: str) -> str:
    """One line for a failure to use the store at `url`: what failed and what to do."""
    proto = protocol(url)
    names = set()
    e: BaseException | None = exc
    while e is not None:
        names |= {c.__name__ for c in type(e).__mro__}
        e = e.__cause__ or e.__context__
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    where = f"GGPO_CACHE={url}"
    if isinstance(exc, ImportError):
        pkg = PACKAGES.get(proto)
        fix = f"pip install {pkg}" if pkg else text
        return f"{where}: the '{proto}' protocol needs a package that is not installed ({fix})"
    if isinstance(exc, ValueError) and "Protocol not known" in text:
        return f"{where}: unknown protocol '{proto}' (fsspec knows s3://, gs://, abfs://, file://, …); check the URL"
    if names & {"NoCredentialsError", "PartialCredentialsError", "NoAuthTokenError", "DefaultCredentialsError"}:
        return (f"{where}: no credentials for '{proto}' ({text}); for S3 set AWS_ACCESS_KEY_ID and "
                f"AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or {OPTIONS_ENV}='{{\"anon\": true}}' for a public bucket")
    if names & {"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionError",
                "ClientConnectorError", "ServerDisconnectedError", "TimeoutError"}:
        return (f"{where}: the store does not answer ({text}); check the endpoint "
                f"(AWS_ENDPOINT_URL or endpoint_url in {OPTIONS_ENV}) and the network")
    if isinstance(exc, PermissionError):
        return f"{where}: access denied ({text}); check the credentials and the bucket's permissions"
    return f"{where}: {type(exc).__name__}: {text}"


class Remote:
    """An fsspec file system and the store's root path on it; artifact folders by name."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self._fs = None
        self._root = ""

    def open(self, extra: dict | None = None):
        """(fs, root path) with the user's options (plus `extra`, for the probe)."""
        import fsspec
        opts = storage_options()
        if protocol(self.url) in ("file", "local"):
            opts.setdefault("auto_mkdir", True)     # object stores have no folders; a file system needs them
        for k, v in (extra or {}).items():
            opts[k] = {**opts.get(k, {}), **v} if isinstance(v, dict) else v
        try:
            fs, root = fsspec.core.url_to_fs(self.url, **opts)
        except Exception as exc:
            raise StoreError(describe(exc, self.url)) from None
        return fs, root.rstrip("/")

    @property
    def fs(self):
        if self._fs is None:
            self._fs, self._root = self.open()
        return self._fs

    def path(self, name: str) -> str:
        """The path of `name` on the file system (no protocol), opening it first if needed."""
        if self._fs is None:
            self._fs, self._root = self.open()
        return f"{self._root}/{name}"

    def call(self, fn, *args, **kwargs):
        """Run one file-system call; a connection or credential failure becomes one line."""
        try:
            return fn(*args, **kwargs)
        except FileNotFoundError:
            raise
        except StoreError:
            raise
        except Exception as exc:
            if is_disk_full(exc):       # a full disk, not a store that cannot be reached: the caller names it
                raise
            raise StoreError(describe(exc, self.url)) from exc

    def read_manifest(self, name: str) -> str | None:
        """The text of `<name>/manifest.json`, or None when there is none (not built, or
        its files are still being uploaded)."""
        try:
            return self.call(self.fs.cat_file, f"{self.path(name)}/{MANIFEST}").decode()
        except FileNotFoundError:
            return None

    def files(self, name: str) -> dict[str, int]:
        """Relative path -> size of every file of an artifact folder, manifest included."""
        base = self.path(name)
        try:
            found = self.call(self.fs.find, base, detail=True)
        except FileNotFoundError:
            return {}
        return {p[len(base) + 1:]: int(info.get("size") or 0) for p, info in found.items()
                if info.get("type", "file") != "directory" and p.startswith(base + "/")}

    def fetch(self, name: str, local: Path) -> None:
        """Replace `local` with a fresh copy of the remote folder's files (not the manifest).
        Downloads go to a temp folder first, so `local` never holds half a file."""
        rels = [r for r in self.files(name) if r != MANIFEST]
        tmp = local.with_name(f".{local.name}.fetch-{uuid.uuid4().hex[:8]}")
        tmp.mkdir(parents=True)
        try:
            if rels:
                targets = [str(tmp / r) for r in rels]
                for t in targets:
                    Path(t).parent.mkdir(parents=True, exist_ok=True)
                self.call(self.fs.get, [f"{self.path(name)}/{r}" for r in rels], targets)
            shutil.rmtree(local, ignore_errors=True)
            os.replace(tmp, local)
        except OSError as exc:
            if not local.is_dir() or is_disk_full(exc):
                raise
            # another process on this machine mirrored the same artifact first: use its copy
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def upload(self, local: Path, name: str) -> None:
        """Copy every file of a finished build to the remote folder, except LOCAL_ONLY and the manifest."""
        pairs = []
        for path in sorted(local.rglob("*")):
            rel = path.relative_to(local).as_posix()
            if path.is_file() and rel != MANIFEST and rel.split("/")[0] not in LOCAL_ONLY:
                pairs.append((str(path), f"{self.path(name)}/{rel}"))
        if pairs:
            self.call(self.fs.put, [a for a, _ in pairs], [b for _, b in pairs])

    def write_manifest(self, name: str, text: str) -> None:
        target = f"{self.path(name)}/{MANIFEST}"
        if "file" in _protocols(self.fs):     # a rename is atomic there; object stores put whole objects
            tmp = f"{self.path(name)}/.{MANIFEST}.tmp-{uuid.uuid4().hex[:8]}"
            self.call(self.fs.pipe_file, tmp, text.encode())
            self.call(self.fs.mv, tmp, target)
        else:
            self.call(self.fs.pipe_file, target, text.encode())

    def clear(self, name: str) -> None:
        """Drop a remote artifact folder, manifest first (a forced rerun or a damaged artifact)."""
        base = self.path(name)
        for target in (f"{base}/{MANIFEST}", base):
            try:
                self.call(self.fs.rm, target, recursive=target == base)
            except FileNotFoundError:
                pass

    def manifests(self) -> list[tuple[str, str]]:
        """(folder name, manifest text) of every complete artifact under the root."""
        pattern = f"{self.path('*')}/{MANIFEST}"
        out = []
        for p in sorted(self.call(self.fs.glob, pattern)):
            try:
                out.append((p.rsplit("/", 2)[-2], self.call(self.fs.cat_file, p).decode()))
            except FileNotFoundError:
                continue    # removed while listing
        return out


def _protocols(fs) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def check_remote(url: str) -> None:
    """Open the store at `url` and write, read and remove a probe object, with short
    timeouts; any failure raises StoreError (one line). Creates a `file://` root."""
    remote = Remote(url)
    # a fresh instance: fsspec's cached one may hold the credentials of an earlier environment
    fs, root = remote.open({**PROBE_OPTIONS.get(protocol(url), {}), "skip_instance_cache": True})
    local = "file" in _protocols(fs)
    try:
        if local:
            fs.makedirs(root, exist_ok=True)
        probe = f"{root}/.ggpo-probe-{uuid.uuid4().hex[:8]}"
        try:
            fs.pipe_file(probe, b"ggpo")
        except FileNotFoundError:
            if local:
                raise
            raise StoreError(f"GGPO_CACHE={url}: the bucket '{root.split('/')[0]}' does not exist (or "
                             f"these credentials cannot see it); create it first") from None
        if fs.cat_file(probe) != b"ggpo":
            raise StoreError(f"GGPO_CACHE={url}: a probe object read back different bytes")
        fs.rm(probe)
    except StoreError:
        raise
    except Exception as exc:
        raise StoreError(describe(exc, url)) from None


# ---------------------------------------------------------------- one build of a key at a time
# On one machine processes sharing a mirror serialize their builds of a key with a flock
# (pipeline/core/store.py, Store.build_lock). Across machines (or mirrors) no flock reaches:
# a build of a key also claims a lock object `<root>/.locks/<stage>-<key16>.json` (outside
# the artifact's folder, which `clear` removes), created only if absent: S3's conditional
# put (If-None-Match: *, s3fs mode="create"), O_EXCL on a `file://` root; on other
# protocols fsspec checks for it first, which leaves a short race. A claim held by another
# live process on this host is waited for; one held elsewhere (or by a process this host
# cannot see) stops the run in one line naming the holder and the object, rather than
# build the key twice into one remote folder. A holder that died (SIGKILL, a lost machine)
# leaves its object behind: one on this host whose process is gone is taken over; another
# host's is named in that line, to delete once that run is known to be gone.
LOCKS = ".locks"


def lock_path(remote: "Remote", name: str) -> str:
    return f"{remote.path(LOCKS)}/{name}.json"


def claim(remote: "Remote", name: str, text: str) -> str | None:
    """Create the lock object of `name` holding `text`; None when created (ours), else the
    text of the claim that holds it."""
    path = lock_path(remote, name)
    fs = remote.fs
    try:
        if "file" in _protocols(fs):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(text)
        else:
            remote.call(fs.pipe_file, path, text.encode(), mode="create")
        return None
    except (FileExistsError, OSError, StoreError) as exc:
        # s3fs reports a failed If-None-Match as OSError(EINVAL): whether it is a claim is
        # what the object says
        try:
            return remote.call(fs.cat_file, path).decode()
        except FileNotFoundError:
            raise exc from None


def release(remote: "Remote", name: str, text: str) -> None:
    """Remove the lock object of `name` if it still holds `text` (ours)."""
    path = lock_path(remote, name)
    try:
        if remote.call(remote.fs.cat_file, path).decode() == text:
            remote.call(remote.fs.rm, path)
    except FileNotFoundError:
        pass
