"""Files: where the repository is, crash-safe writes (a reader sees the old file or the new one, never half of
one), sha256 digests, and JSON-lines reading with errors that name the file and line.

A leaf module (imports nothing from hqlab), so every floor may use it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator

# The checkout hqlab runs from (the folder that holds hqlab/, data/, notebooks/, docs/). For an installed copy it
# is the folder hqlab was installed into, which holds none of those.
REPO = Path(__file__).resolve().parent.parent

_CHUNK = 8 << 20  # streaming block for hashing


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp)` to produce the file at `<path>.tmp`, fsync it, rename it over `path`, fsync the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)
    return path


def replace_runs(old: Any, new: Any, key: str = "run") -> Any:
    """A results table with `new`'s rows in place of `old`'s rows of the same runs (polars frames; `old` may be
    None): what a benchmark's `finish` writes, so that finishing a run again replaces it and every other run stays.
    Columns one side lacks are null on the other side's rows."""
    import polars as pl

    if old is None:
        return new
    return pl.concat([old.filter(~pl.col(key).is_in(new[key].unique().to_list())), new], how="diagonal_relaxed")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path, progress: str | None = None) -> str:
    """Hex sha256 of a file, streamed (GGUFs are hundreds of MB); `progress` names a byte progress bar that
    disappears when done."""
    h = hashlib.sha256()
    bar = None
    if progress is not None:
        from tqdm.auto import tqdm

        bar = tqdm(total=Path(path).stat().st_size, desc=progress, unit="B", unit_scale=True, unit_divisor=1024,
                   leave=False)
    try:
        with open(path, "rb") as f:
            while block := f.read(_CHUNK):
                h.update(block)
                if bar is not None:
                    bar.update(len(block))
    finally:
        if bar is not None:
            bar.close()
    return h.hexdigest()


def check_writable(path: Path, option: str, error: type[Exception], *, folder: bool = False,
                   into: bool = False) -> None:
    """`path` can be written: a file, or a folder (`folder`) that is replaced whole, so its nearest existing parent
    must be writable; or a folder written into (`into`), which must itself be writable where it exists. No parent
    may be a file. Else `error` naming `option`. Creates nothing."""
    folder = folder or into
    if path.exists() and path.is_dir() != folder:
        raise error(f"{option} {str(path)!r} is {'a file' if folder else 'a directory'}")
    for parent in ([path] if into else []) + list(path.parents):
        if parent.exists():
            if not parent.is_dir():
                raise error(f"{option} {str(path)!r}: {parent} is a file, not a folder")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise error(f"{option} {str(path)!r}: {parent} is not writable")
            return


def read_json(path: str | Path) -> Any:
    """The JSON document at `path`, or at `path` + ".gz" where only that exists: large raw run records (a decode
    run's engine profiles, megabytes of text) are committed gzipped, so that the working tree still travels to the
    GPU host beside a part; the benchmarks write them plain."""
    import gzip

    path = Path(path)
    packed = path.with_name(path.name + ".gz")
    if not path.exists() and packed.exists():
        with gzip.open(packed, "rt", encoding="utf-8") as f:
            return json.load(f)
    return json.loads(path.read_text(encoding="utf-8"))


def json_lines(text: str, path: Path, error: type[Exception]) -> Iterator[tuple[int, str, Any]]:
    """(line number, "<path>:<line>", parsed value) for every non-blank line of a JSON-lines text; a line that is
    not JSON raises `error` naming the file, line and column."""
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise error(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        yield lineno, where, obj


def read_table(path: str | Path, need: set[str], where: str, error: type[Exception], kind: str = "file") -> Any:
    """A parquet file as a polars DataFrame holding at least the columns `need`; a missing file, one that is not
    parquet or one without those columns raises `error` starting with `where` (the option or file it came from)."""
    import polars as pl

    path = Path(path)
    if not path.is_file():
        raise error(f"{where}: no such file")
    try:
        frame = pl.read_parquet(path)
    except Exception as e:  # polars raises several kinds for a file that is not parquet
        raise error(f"{where}: not a readable parquet {kind} ({type(e).__name__})") from None
    if not need <= set(frame.columns):
        raise error(f"{where}: missing column(s) {', '.join(sorted(need - set(frame.columns)))}")
    return frame
