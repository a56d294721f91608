"""Corpus readers for counting a draft vocabulary (SPEC §2.7).

Formats, chosen by extension:
- `.txt`, `.py`: the whole file is one record (UTF-8 text).
- `.jsonl`: one record per line, an object with any of the string fields `prompt`, `response`, `text`, a
  `messages` list of `{content: str, ...}` objects, or `output_ids` (a list of token ids: a self-generated
  record, counted directly instead of re-tokenizing text). Optional string `src` (or `category`) names the kind
  of record (chat/code/math...), used for coverage per kind.
- `.parquet`: one record per row of a string column `text` (optional string column `src`).
A folder stands for the files of these types below it (sorted; other files there are ignored).

Every record carries `index`, the `j` of the hold-out rule (`j % 10 == 0` is held out): its position within its
file for JSONL and Parquet, and for whole-file formats its position among the whole-file inputs (one record per
file, so a per-file index would hold out every file).

Bad input fails with a `CorpusError` naming the file (and line or row) before anything is counted or published:
empty or binary files, invalid JSON, fields of the wrong type, records with nothing to count, unknown extensions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from hqlab.io import json_lines

WHOLE_FILE = (".txt", ".py")
SUFFIXES = (*WHOLE_FILE, ".jsonl", ".parquet")
TEXT_FIELDS = ("prompt", "response", "text")


class CorpusError(ValueError):
    """Malformed corpus input; the message starts with `file[:line]`."""


@dataclass(frozen=True)
class CorpusRecord:
    path: str
    line: int  # 1-based line (JSONL) or row (Parquet); 0 for a whole file
    index: int  # j of the hold-out rule (see module doc)
    src: str
    texts: tuple[str, ...] = ()  # to tokenize (without special tokens)
    ids: tuple[int, ...] | None = None  # token ids to count directly (self-generated outputs)

    @property
    def held_out(self) -> bool:
        return self.index % 10 == 0

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}" if self.line else self.path


def expand(paths: Sequence[str | Path]) -> list[Path]:
    """Files named, with folders expanded to their corpus files (sorted). Unknown extensions named explicitly,
    missing paths and folders without corpus files are errors."""
    if not paths:
        raise CorpusError("no corpus given")
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in SUFFIXES)
            if not found:
                raise CorpusError(f"{p}: folder holds no corpus files ({', '.join(SUFFIXES)})")
            files += found
        elif p.is_file():
            if p.suffix not in SUFFIXES:
                raise CorpusError(f"{p}: unsupported corpus file type {p.suffix or '(no extension)'!r}; "
                                  f"expected one of {', '.join(SUFFIXES)}")
            files.append(p)
        else:
            raise CorpusError(f"{p}: no such file or folder")
    return files


def read_corpus(paths: Sequence[str | Path]) -> Iterator[CorpusRecord]:
    """Records of every file, in order. Each file is validated completely before its first record is yielded."""
    whole = 0
    for path in expand(paths):
        if path.suffix in WHOLE_FILE:
            yield read_text_file(path, index=whole)
            whole += 1
        elif path.suffix == ".jsonl":
            yield from read_jsonl(path)
        else:
            yield from read_parquet(path)


def validate(paths: Sequence[str | Path]) -> list[CorpusRecord]:
    """All records, or the first error: run this before publishing anything built from the corpus."""
    return list(read_corpus(paths))


# ----------------------------------------------------------------------------------------------------------------
# Formats


def _line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def _decode(path: Path, data: bytes) -> str:
    """UTF-8 text, or an error naming the line of the first bad byte; NUL bytes mean a binary file."""
    if not data.strip():
        raise CorpusError(f"{path}: empty file")
    nul = data.find(b"\x00")
    if nul >= 0:
        raise CorpusError(f"{path}:{_line_of(data, nul)}: binary file (NUL byte at offset {nul}); "
                          f"corpus files must be UTF-8 text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(f"{path}:{_line_of(data, e.start)}: not UTF-8 text (byte 0x{data[e.start]:02x} "
                          f"at offset {e.start}); binary file or another encoding") from None


def read_text_file(path: Path, *, index: int = 0) -> CorpusRecord:
    text = _decode(path, path.read_bytes())
    return CorpusRecord(str(path), 0, index, "code" if path.suffix == ".py" else "text", texts=(text,))


def _ids(value: Any, where: str, field: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                              for t in value):
        raise CorpusError(f"{where}: {field!r} must be a list of non-negative integer token ids")
    return tuple(value)


def _jsonl_record(obj: Any, where: str, path: Path, lineno: int, index: int) -> CorpusRecord:
    if not isinstance(obj, dict):
        raise CorpusError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    src = obj.get("src", obj.get("category", path.stem))
    if not isinstance(src, str):
        raise CorpusError(f"{where}: 'src' must be a string, got {type(src).__name__}")
    texts: list[str] = []
    for field in TEXT_FIELDS:
        if field in obj:
            if not isinstance(obj[field], str):
                raise CorpusError(f"{where}: field {field!r} must be a string, got {type(obj[field]).__name__}")
            texts.append(obj[field])
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list):
            raise CorpusError(f"{where}: 'messages' must be a list, got {type(messages).__name__}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                raise CorpusError(f"{where}: messages[{i}] must be an object with a string 'content'")
            texts.append(m["content"])
    ids = _ids(obj["output_ids"], where, "output_ids") if "output_ids" in obj else None
    if "prompt_ids" in obj:
        _ids(obj["prompt_ids"], where, "prompt_ids")  # validated, not counted: the model did not write it
    if ids is None and not any(t.strip() for t in texts):
        raise CorpusError(f"{where}: nothing to count; expected a non-empty string field "
                          f"({', '.join(TEXT_FIELDS)}), 'messages' or 'output_ids'")
    # Self-generated records are counted from their output ids: exactly what the model emitted.
    return CorpusRecord(str(path), lineno, index, src, texts=() if ids is not None else tuple(texts), ids=ids)


def read_jsonl(path: Path) -> list[CorpusRecord]:
    text = _decode(path, path.read_bytes())
    records: list[CorpusRecord] = []
    for lineno, where, obj in json_lines(text, path, CorpusError):
        records.append(_jsonl_record(obj, where, path, lineno, len(records)))
    if not records:
        raise CorpusError(f"{path}: no records (only blank lines)")
    return records


def read_parquet(path: Path) -> list[CorpusRecord]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise CorpusError(f"{path}: not a readable Parquet file ({e})") from None
    if "text" not in table.column_names:
        raise CorpusError(f"{path}: no 'text' column (columns: {', '.join(table.column_names) or 'none'})")
    for name in ("text", "src"):
        if name in table.column_names and not (pa.types.is_string(table.schema.field(name).type)
                                               or pa.types.is_large_string(table.schema.field(name).type)):
            raise CorpusError(f"{path}: column {name!r} must hold strings, has {table.schema.field(name).type}")
    if table.num_rows == 0:
        raise CorpusError(f"{path}: no rows")
    texts = table.column("text").to_pylist()
    srcs = table.column("src").to_pylist() if "src" in table.column_names else [path.stem] * len(texts)
    records = []
    for row, (text, src) in enumerate(zip(texts, srcs)):
        if text is None:
            raise CorpusError(f"{path}: row {row + 1}: 'text' is null")
        records.append(CorpusRecord(str(path), row + 1, row, src if src is not None else path.stem, texts=(text,)))
    return records


# ----------------------------------------------------------------------------------------------------------------
# Helpers for callers


def split(records: Iterable[CorpusRecord], *, holdout: bool = True) -> tuple[list[CorpusRecord], list[CorpusRecord]]:
    """(counted, held out) under the every-10th rule; with holdout=False everything is counted."""
    train, held = [], []
    for r in records:
        (held if holdout and r.held_out else train).append(r)
    return train, held
