"""Content-addressed artifact store.

Every stage output is a folder `<root>/<stage>-<key[:16]>/` where key = sha256 of the
canonical JSON of (stage name, stage version, the config fields the stage reads, the keys
of its inputs). The folder holds the stage's files and `manifest.json`, written last
(temp file, fsync, rename). A folder without a manifest is an interrupted build: it is
never read, and the next run rebuilds it (a resumable stage such as training keeps its
`checkpoints/` and resumes from them). Root: `$GGPO_CACHE`, default `./data/cache`.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel

CACHE_ENV = "GGPO_CACHE"
MANIFEST = "manifest.json"


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

    def path(self, name: str) -> Path:
        return Path(self.folder) / self.files[name].path


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def stage_key(stage: str, version: int, config: dict, inputs: dict[str, str]) -> str:
    payload = {"stage": stage, "version": version, "config": config, "inputs": inputs}
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_rename(tmp: Path, final: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    fsync_rename(tmp, path)


def default_root() -> Path:
    return Path(os.environ.get(CACHE_ENV, "data/cache")).resolve()


class Store:
    def __init__(self, root: str | Path | None = None):
        self.root = Path(root).resolve() if root else default_root()

    def folder(self, stage: str, key: str) -> Path:
        return self.root / f"{stage}-{key[:16]}"

    def load(self, stage: str, key: str) -> Manifest | None:
        """The manifest if the artifact is complete, else None (never a partial folder)."""
        path = self.folder(stage, key) / MANIFEST
        if not path.exists():
            return None
        manifest = Manifest.model_validate_json(path.read_text())
        if manifest.key != key:
            raise RuntimeError(f"{path}: manifest key {manifest.key} does not match folder key {key}")
        return manifest

    def begin(self, stage: str, key: str, keep: tuple[str, ...] = ()) -> Path:
        """A clean work folder for a build; an old manifest (forced rerun) and any
        leftovers of an interrupted build go, except the names in `keep`."""
        folder = self.folder(stage, key)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MANIFEST).unlink(missing_ok=True)
        for child in folder.iterdir():
            if child.name in keep:
                continue
            shutil.rmtree(child) if child.is_dir() else child.unlink()
        return folder

    def commit(self, manifest: Manifest) -> Manifest:
        write_text_atomic(Path(manifest.folder) / MANIFEST, manifest.model_dump_json(indent=2))
        return manifest

    def entries(self) -> list[Manifest]:
        found = []
        if not self.root.exists():
            return found
        for path in sorted(self.root.glob(f"*/{MANIFEST}")):
            try:
                found.append(Manifest.model_validate_json(path.read_text()))
            except ValueError:
                continue  # foreign or damaged folder: listing must not crash
        return sorted(found, key=lambda m: m.created_at)


def file_entry(folder: Path, rel: str, rows: int | None = None) -> FileEntry:
    path = folder / rel
    return FileEntry(path=rel, bytes=path.stat().st_size, sha256=sha256_file(path), rows=rows)


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
