"""Crash-safe writes of the files leapdecode ships and resumes from (drafter artifacts, training checkpoints).

Every file is written to a temporary name in its folder, flushed to disk (``fsync``), then renamed over the old
one (a rename is atomic), and the folder is synced so the rename itself survives a crash. A folder of several files
gets one manifest, ``checksums.json``, written first as "incomplete" and last with each file's size and SHA-256:
a reader that finds the manifest incomplete, or a file that does not match it, knows a write was interrupted and
never pairs new tensors with an old JSON. A folder without a manifest (written before this scheme) is read as is.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as tensors_to_bytes

MANIFEST_FILE = "checksums.json"


def write_atomic(path: str | Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` in one step: a crash leaves the old file or the new one, never a mix."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    sync_folder(path.parent)


def write_json_atomic(path: str | Path, obj: Any, indent: int | None = 2) -> None:
    text = json.dumps(obj, indent=indent) + ("\n" if indent is not None else "")
    write_atomic(path, text.encode("utf-8"))


def save_tensors_atomic(path: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file written with :func:`write_atomic`."""
    write_atomic(path, tensors_to_bytes(tensors))


def sync_folder(folder: str | Path) -> None:
    """Make the renames in ``folder`` durable (a no-op where folders cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def file_digest(path: str | Path) -> dict[str, Any]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"bytes": Path(path).stat().st_size, "sha256": h.hexdigest()}


def begin_folder_write(folder: str | Path) -> Path:
    """Mark ``folder`` (made if missing) as being written: readers refuse it until :func:`finish_folder_write`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(folder / MANIFEST_FILE, {"complete": False})
    return folder


def finish_folder_write(folder: str | Path, names: list[str]) -> None:
    """Write the manifest last: ``names`` (files in ``folder``) with their sizes and digests."""
    folder = Path(folder)
    files = {name: file_digest(folder / name) for name in sorted(names)}
    write_json_atomic(folder / MANIFEST_FILE, {"complete": True, "files": files})


def replace_in_folder(folder: str | Path, name: str, data: bytes) -> None:
    """Rewrite one file of a folder that has a manifest, and the manifest after it (a folder without one gets
    the file only)."""
    folder = Path(folder)
    manifest = folder / MANIFEST_FILE
    names = list(read_manifest(folder) or {}) if manifest.is_file() else None
    if names is not None:
        begin_folder_write(folder)
    write_atomic(folder / name, data)
    if names is not None:
        finish_folder_write(folder, sorted(set(names) | {name}))


def read_manifest(folder: str | Path) -> dict[str, Any] | None:
    """The manifest's files (None when the folder has none); ValueError when a write into it was interrupted."""
    path = Path(folder) / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not readable JSON ({e}): the folder was damaged; write it again") from None
    if not isinstance(doc, dict) or doc.get("complete") is not True or not isinstance(doc.get("files"), dict):
        raise ValueError(f"{folder} was not written completely (a write was interrupted); write it again")
    return doc["files"]


def verify_folder(folder: str | Path) -> None:
    """Check every file the manifest lists against its size and digest (nothing to check without one);
    ValueError naming the first that differs or is missing."""
    files = read_manifest(folder)
    for name, want in (files or {}).items():
        path = Path(folder) / name
        if not path.is_file():
            raise ValueError(f"{path} is missing (listed in {MANIFEST_FILE}); the folder is incomplete")
        if file_digest(path) != want:
            raise ValueError(
                f"{path} does not match {MANIFEST_FILE} (its write was interrupted, or it was changed since); "
                "write the folder again"
            )


__all__ = [
    "MANIFEST_FILE",
    "begin_folder_write",
    "file_digest",
    "finish_folder_write",
    "read_manifest",
    "replace_in_folder",
    "save_tensors_atomic",
    "sync_folder",
    "verify_folder",
    "write_atomic",
    "write_json_atomic",
]
