"""Crash-safe publishing of a set of artifact files into a folder (SPEC §2.7).

A published folder holds data files named by their content (`ids-<sha12>.json`, ...) and `index.json`, which
maps each logical name (`ids.json`) to its file, size and sha256. The index is the commit point:

1. every data file is written to `<file>.tmp`, flushed and fsync'd, `os.replace`d onto its name, and the folder is
   fsync'd (files already present with the right content are not rewritten: that is how a run completes an
   earlier, killed one);
2. before a publish first replaces a committed set, that set is copied once into `pristine/` (its files, then its
   index last); a complete `pristine/` is never written again, so the first published version stays loadable;
3. `index.json` is written the same way, last;
4. files no index references, and `.tmp` leftovers, are removed.

A reader (`read_index`) therefore sees the previous complete set or the new complete set, never a mix, and
checks every file against the index. A run killed at any point leaves at most `.tmp` files and unreferenced
data files, which the next run removes after completing its own publish.

Test hook: with `HQLAB_PUBLISH_KILL_AFTER=n` in the environment the process calls `os._exit(KILL_EXIT_CODE)`
right after its n-th write point (1-based; `write_points` of a finished run lists them), simulating a crash.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hqlab.io import fsync_dir, sha256_bytes, sha256_file

INDEX = "index.json"
PRISTINE = "pristine"
FORMAT = "hqlab-publish/1"
KILL_ENV = "HQLAB_PUBLISH_KILL_AFTER"
KILL_EXIT_CODE = 86
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_CONTENT_NAME = re.compile(r"^.+-[0-9a-f]{12}(\.[A-Za-z0-9]+)?$")


class PublishError(RuntimeError):
    """A folder holds no complete published set (or a file disagrees with its index)."""


@dataclass
class PublishResult:
    folder: Path
    index: dict[str, Any]
    write_points: list[str] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)  # files already present with the right content
    removed: list[str] = field(default_factory=list)


class _Points:
    """Counts write points and kills the process after the one named by the environment (test hook)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        raw = os.environ.get(KILL_ENV, "").strip()
        self.kill_after = int(raw) if raw.isdigit() else 0

    def __call__(self, name: str) -> None:
        self.names.append(name)
        if self.kill_after and len(self.names) == self.kill_after:
            os._exit(KILL_EXIT_CODE)


def call_killed_after(kill_after: int, func: Any, /, *args: Any, **kwargs: Any) -> Any:
    """Crash-test driver: `func(*args, **kwargs)` in this process with the kill point set to `kill_after`.
    Meant as the target of a child process (module-level, so it pickles for spawn and forkserver)."""
    os.environ[KILL_ENV] = str(int(kill_after))
    return func(*args, **kwargs)


def content_name(name: str, sha: str) -> str:
    stem, dot, suffix = name.partition(".")
    return f"{stem}-{sha[:12]}{dot}{suffix}"


def _write_file(path: Path, data: bytes, points: _Points, label: str = "") -> None:
    label = label or path.name
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    points(f"tmp:{label}")
    os.replace(tmp, path)
    fsync_dir(path.parent)
    points(f"replace:{label}")


def _index_bytes(index: dict[str, Any]) -> bytes:
    return (json.dumps(index, indent=1, sort_keys=True) + "\n").encode()


def _load_index(folder: Path) -> dict[str, Any] | None:
    path = folder / INDEX
    if not path.exists():
        return None
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PublishError(f"{path}: unreadable index ({e}); the folder was not written by "
                           f"hqlab.vocab.publish") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or not isinstance(index.get("files"), dict):
        raise PublishError(f"{path}: not an index in format {FORMAT}")
    return index


def read_index(folder: str | Path, *, verify: bool = True) -> dict[str, Any]:
    """The committed index of `folder`; with `verify`, every file it names must exist with its size and sha256."""
    folder = Path(folder)
    index = _load_index(folder)
    if index is None:
        raise PublishError(f"{folder}: nothing published here (no {INDEX}); run the build that publishes it")
    for name, entry in index["files"].items():
        path = folder / entry["file"]
        if not path.is_file():
            raise PublishError(f"{folder}: {name} ({entry['file']}) is missing; the folder was changed by hand")
        if verify and (path.stat().st_size != entry["bytes"] or sha256_file(path) != entry["sha256"]):
            raise PublishError(f"{path}: content does not match {INDEX} (sha256); the file was modified")
    return index


def path_of(folder: str | Path, name: str, index: dict[str, Any] | None = None) -> Path:
    """Where the logical file `name` of the committed set lives."""
    index = index or read_index(folder)
    try:
        return Path(folder) / index["files"][name]["file"]
    except KeyError:
        raise PublishError(f"{folder}: the published set has no {name!r} (has {', '.join(index['files'])})") from None


def _copy_pristine(folder: Path, index: dict[str, Any], points: _Points) -> None:
    target = folder / PRISTINE
    if (target / INDEX).exists():
        return  # copied once, never overwritten
    target.mkdir(exist_ok=True)
    fsync_dir(folder)
    for entry in index["files"].values():
        dest = target / entry["file"]
        if dest.exists() and sha256_file(dest) == entry["sha256"]:
            continue
        _write_file(dest, (folder / entry["file"]).read_bytes(), points, f"{PRISTINE}/{dest.name}")
    _write_file(target / INDEX, _index_bytes(index), points, f"{PRISTINE}/{INDEX}")


def _clean(folder: Path, keep: set[str]) -> list[str]:
    removed = []
    for path in sorted(folder.iterdir()):
        if path.is_file() and (path.name.endswith(".tmp") or
                               (_CONTENT_NAME.match(path.name) and path.name not in keep)):
            path.unlink()
            removed.append(path.name)
    pristine = folder / PRISTINE
    if pristine.is_dir():
        for path in sorted(pristine.iterdir()):
            if path.name.endswith(".tmp"):
                path.unlink()
                removed.append(f"{PRISTINE}/{path.name}")
    if removed:
        fsync_dir(folder)
    return removed


def publish(folder: str | Path, files: dict[str, bytes], meta: dict[str, Any] | None = None) -> PublishResult:
    """Publish `files` (logical name -> content) with `meta` into `folder`, atomically as a set."""
    folder = Path(folder)
    if not files:
        raise ValueError("publish needs at least one file")
    for name in files:
        if not _NAME.match(name) or name == INDEX or name == PRISTINE:
            raise ValueError(f"invalid artifact name {name!r}")
    meta = json.loads(json.dumps(meta or {}))  # must be JSON; a copy
    folder.mkdir(parents=True, exist_ok=True)
    points = _Points()
    old = _load_index(folder)
    if old is None:  # a first publish (or one a crash interrupted): the folder must hold nothing else
        strays = sorted(p.name for p in folder.iterdir() if not (p.name.endswith(".tmp") or p.name == PRISTINE
                                                                  or _CONTENT_NAME.match(p.name)))
        if strays:
            raise PublishError(f"{folder}: not empty and not a published folder (holds {', '.join(strays[:5])}); "
                               f"publish into a new or an hqlab-published folder")
    entries = {}
    for name, data in files.items():
        sha = sha256_bytes(data)
        entries[name] = {"file": content_name(name, sha), "sha256": sha, "bytes": len(data)}
    index = {"format": FORMAT, "files": entries, "meta": meta}
    result = PublishResult(folder, index)
    if old is not None and old != index:
        _copy_pristine(folder, read_index(folder), points)
    for name, data in files.items():
        path = folder / entries[name]["file"]
        if path.is_file() and path.stat().st_size == len(data) and sha256_file(path) == entries[name]["sha256"]:
            result.reused.append(name)
            continue
        _write_file(path, data, points)
    if old != index:
        _write_file(folder / INDEX, _index_bytes(index), points)
    result.removed = _clean(folder, {e["file"] for e in entries.values()})
    result.write_points = points.names
    return result
