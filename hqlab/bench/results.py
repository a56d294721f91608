"""Committed results: one folder a run, and an index of every run that notebooks, tests and benchmarks read.

    data/results/index.json            every run: study, run, card, commit, date, ... and the files of its folder
    data/results/<study>/<run>/
        run.json                       what ran: study, run, card, commit, date and date_from, command, benchmark,
                                       plan, vllm_runner (`RUN_FIELDS`)
        rows.parquet                   the run's rows
        steps.parquet                  its step records, where it has any
        <kind>.parquet                 its other tables (repeats, phases, requests, samples, greedy, grid, ...)
        run.log[.gz]                   the log of its command, gzipped over `LOG_GZIP_BYTES`; other logs <name>.log
        raw.* profile.json ...         what the machine returned, as it returned it
        claims.json                    what the docs say of the run, as data (`hqlab.bench.claims`)

A study is one benchmark or analysis; a run one measurement of it (the tag it ran under, or the card where it has
none). Every run of a study keeps its own tables: `load(study)` stacks them, each row keeping its run (a `run`
column is added from the folder where a table has none), so readers of several runs need no file that mixes them.
`card` is spelled one way: "cpu", or the GPU's model in lower case ("h100", "h200"; `card_of`).

`write_run` is the one writer: every benchmark's `finish` puts a run in place with it, each file written atomically,
`run.json` last among the run's files, then the index (`write_index`), so a reader finds a run with all its files
or not at all.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import sys
from datetime import date as _date
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import polars as pl

from hqlab.io import REPO, write_atomic

RESULTS = REPO / "data" / "results"
INDEX = "index.json"
RUN_JSON = "run.json"
# the fields of run.json, in this order; `files` is added in the index
RUN_FIELDS = ("study", "run", "card", "commit", "date", "date_from", "command", "benchmark", "plan", "vllm_runner")
LOG_GZIP_BYTES = 200_000  # a log larger than this is committed gzipped
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")  # study and run names: one path component each


class MissingRun(LookupError):
    """A study, run or file that the index does not hold; the message says which and where it looked."""


def results_dir(root: str | Path | None = None) -> Path:
    """The results folder: `root`, or the repository's data/results."""
    return Path(root) if root is not None else RESULTS


def card_of(machine: str) -> str:
    """The card a machine description names, in the one spelling of run.json: "cpu" for a CPU, else the GPU's model
    in lower case ("NVIDIA H100 80GB HBM3, torch 2.11" -> "h100", "cuda (NVIDIA H200)" -> "h200")."""
    text = str(machine)
    gpu = re.search(r"NVIDIA\s+(?:GeForce\s+)?([A-Z]{1,2}\d{1,4}[A-Za-z]?)\b", text)
    if gpu:
        return gpu.group(1).lower()
    if re.match(r"\s*(cpu\b|CPU\b)", text):
        return "cpu"
    raise ValueError(f"no card named in the machine description {machine!r}")


def log_header(text: str) -> tuple[str | None, str | None]:
    """(command, day) of a log that tools/gpu_host/vllm_host.py wrote: its first line starting with "== " holds the
    command and the time it started; (None, None) where the log has no such line in its first lines."""
    for line in text.splitlines()[:3]:
        found = re.match(r"^== (.*?)\s{2}(\d{4}-\d\d-\d\d) \d\d:\d\d:\d\d\s*$", line)
        if found:
            return found.group(1), found.group(2)
    return None, None


def logs_of(folder: str | Path, tag: str) -> list[Path]:
    """The logs a GPU call returned for the call `tag` (`<anything>_<tag>.log`, or `.log.gz`): the name
    tools/gpu_host/vllm_host.py run --log gives them."""
    name = re.compile(rf"(.*_)?{re.escape(tag)}\.log(\.gz)?")
    return sorted(p for p in Path(folder).glob("*.log*") if name.fullmatch(p.name))


def run_logs(paths: Iterable[str | Path], script: str) -> tuple[dict[str, Path], dict[str, Any]]:
    """The logs a GPU host returned with a run, as `write_run` files, and what the run's own log says of it: the log
    whose header runs `script` (e.g. "benchmarks/vllm_serve.py") becomes run.log and gives run.json its command and
    date; the others (set-up, tests) keep their names."""
    files: dict[str, Path] = {}
    info: dict[str, Any] = {}
    for path in sorted(Path(p) for p in paths):
        text = gzip.open(path, "rt", errors="replace").read(4000) if path.suffix == ".gz" else \
            path.read_text(errors="replace")[:4000]
        command, day = log_header(text)
        if not info and command is not None and script in command:
            files["run.log"] = path
            info = {"command": command, "date": day, "date_from": "log"}
        else:
            files[path.name.removesuffix(".gz")] = path
    return files, info


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command this process runs, as run.json records it: `python <script> <args>`, the script relative to the
    checkout where it lies inside it."""
    argv = list(sys.argv if argv is None else argv)
    if argv:
        script = Path(argv[0]).resolve()
        if script.is_relative_to(REPO):
            argv[0] = str(script.relative_to(REPO))
    return " ".join(["python", *argv])


def _index_path(root: str | Path | None) -> Path:
    return results_dir(root) / INDEX


def index(root: str | Path | None = None) -> list[dict[str, Any]]:
    """Every run of the results folder, as its index lists it (run.json's fields and `files`)."""
    path = _index_path(root)
    if not path.is_file():
        raise MissingRun(f"no results index at {path} (`write_index` builds it from the run folders)")
    return json.loads(path.read_text())["runs"]


def studies(root: str | Path | None = None) -> list[str]:
    return sorted({r["study"] for r in index(root)})


def runs(study: str, *, card: str | None = None, root: str | Path | None = None) -> list[str]:
    """The runs of a study in the index (of one card if `card`), in the index's order."""
    entries = [r for r in index(root) if r["study"] == study]
    if not entries:
        raise MissingRun(f"no study {study!r} in {_index_path(root)} (studies: {', '.join(studies(root))})")
    return [r["run"] for r in entries if card is None or r["card"] == card]


def run_info(study: str, run: str, root: str | Path | None = None) -> dict[str, Any]:
    """The index entry of one run; a run the index lacks raises MissingRun naming the study's runs."""
    for entry in index(root):
        if entry["study"] == study and entry["run"] == run:
            return entry
    known = runs(study, root=root)  # raises for an unknown study
    raise MissingRun(f"no run {run!r} of study {study!r} in {_index_path(root)} (its runs: {', '.join(known)})")


def run_path(study: str, run: str, root: str | Path | None = None) -> Path:
    """The folder of a run the index lists."""
    run_info(study, run, root)
    return results_dir(root) / study / run


def run_file(study: str, run: str, name: str, root: str | Path | None = None) -> Path:
    """The path of file `name` of a run (or of `name`.gz where the file was committed gzipped)."""
    entry = run_info(study, run, root)
    for candidate in (name, name + ".gz"):
        if candidate in entry["files"]:
            return results_dir(root) / study / run / candidate
    raise MissingRun(f"run {study}/{run} has no file {name!r} in {_index_path(root)} "
                     f"(its files: {', '.join(entry['files'])})")


def trace_files(sets: Iterable[str], root: str | Path | None = None) -> list[Path]:
    """The files of trace sets committed as runs of the study `traces` (what `cached_traces(shipped=...)` takes)."""
    return [run_file("traces", name, "traces.parquet", root) for name in sets]


def read_text(study: str, run: str, name: str, root: str | Path | None = None) -> str:
    """A text file of a run (a log), gunzipped where it was committed gzipped."""
    path = run_file(study, run, name, root)
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
            return f.read()
    return path.read_text(encoding="utf-8", errors="replace")


def load(study: str, runs: Iterable[str] | str | None = None, kind: str = "rows", *, card: str | None = None,
         having: bool = False, root: str | Path | None = None) -> pl.DataFrame:
    """The `kind` table (rows, steps, repeats, ...) of runs of a study, stacked in the given order: the runs named
    (each must have that table, unless `having`: then those of them that have it), or every run of the study (of
    `card`, if given) that has one, in the index's order. A table without a `run` column gets one from its folder's
    name."""
    entries = [r for r in index(root) if r["study"] == study]
    if not entries:
        raise MissingRun(f"no study {study!r} in {_index_path(root)} (studies: {', '.join(studies(root))})")
    name = f"{kind}.parquet"
    if runs is None:
        chosen = [r for r in entries if (card is None or r["card"] == card) and name in r["files"]]
        if not chosen:
            raise MissingRun(f"no run of study {study!r}{f' on card {card!r}' if card else ''} has a {kind!r} table "
                             f"in {_index_path(root)}")
    else:
        wanted = [runs] if isinstance(runs, str) else list(runs)
        chosen = [run_info(study, run, root) for run in wanted]
        lacking = [r["run"] for r in chosen if name not in r["files"]]
        if having and len(lacking) < len(chosen):
            chosen, lacking = [r for r in chosen if name in r["files"]], []
        if lacking:
            raise MissingRun(f"run(s) {', '.join(lacking)} of study {study!r} have no {kind!r} table in "
                             f"{_index_path(root)}")
    frames = []
    for entry in chosen:
        frame = pl.read_parquet(results_dir(root) / study / entry["run"] / name)
        if "run" not in frame.columns:
            frame = frame.with_columns(pl.lit(entry["run"]).alias("run"))
        frames.append(frame)
    return frames[0] if len(frames) == 1 else pl.concat(frames, how="diagonal_relaxed")


def _check_name(what: str, name: str) -> None:
    if not NAME.match(name):
        raise ValueError(f"{what} {name!r}: use letters, digits, '_', '-' and '.', one path component")


def write_parquet(frame: pl.DataFrame, path: str | Path) -> Path:
    """A committed table, written atomically and compressed hard (results travel with the tree to the GPU host)."""
    return write_atomic(path, lambda tmp: frame.write_parquet(tmp, compression="zstd", compression_level=19,
                                                              statistics=False))


def write_run(study: str, run: str, *, card: str, tables: Mapping[str, pl.DataFrame] | None = None,
              files: Mapping[str, str | Path | bytes] | None = None, info: Mapping[str, Any] | None = None,
              root: str | Path | None = None) -> Path:
    """Put a run in place: each table as `<kind>.parquet`, each file under its name (a log over `LOG_GZIP_BYTES`
    as `<name>.gz`), then run.json (`info` over what an earlier run.json said: commit, date, command, benchmark,
    plan, vllm_runner) and the index. Files of the run that this call does not write stay. Returns the folder."""
    _check_name("study", study)
    _check_name("run", run)
    if card != "cpu" and not re.fullmatch(r"[a-z]{1,2}\d{1,4}[a-z]?", card):
        raise ValueError(f"card {card!r}: spell it as card_of does ('cpu', 'h100', 'h200')")
    unknown = set(info or {}) - set(RUN_FIELDS)
    if unknown:
        raise ValueError(f"run.json has no field(s) {', '.join(sorted(unknown))}; its fields: {', '.join(RUN_FIELDS)}")
    folder = results_dir(root) / study / run
    folder.mkdir(parents=True, exist_ok=True)
    for kind, frame in (tables or {}).items():
        _check_name("table", kind)
        write_parquet(frame, folder / f"{kind}.parquet")
    for name, source in (files or {}).items():
        _check_name("file", name)
        data = source if isinstance(source, bytes) else Path(source).read_bytes()
        plain = name
        if name.endswith(".log") and len(data) > LOG_GZIP_BYTES:
            name, data = name + ".gz", gzip.compress(data, mtime=0)
        for stale in {plain, plain + ".gz"} - {name}:  # the other spelling of a file written again
            (folder / stale).unlink(missing_ok=True)
        write_atomic(folder / name, lambda tmp, d=data: tmp.write_bytes(d))
    old = json.loads((folder / RUN_JSON).read_text()) if (folder / RUN_JSON).exists() else {}
    meta = {field: None for field in RUN_FIELDS} | old | dict(info or {}) | {"study": study, "run": run, "card": card}
    if meta["date"] is None:
        meta["date"], meta["date_from"] = _date.today().isoformat(), "finish"
    body = json.dumps({field: meta[field] for field in RUN_FIELDS}, indent=1) + "\n"
    write_atomic(folder / RUN_JSON, lambda tmp: tmp.write_text(body))
    write_index(root)
    return folder


def remove_run(study: str, run: str, root: str | Path | None = None) -> None:
    """Take a run out of the results folder and the index (a run finished under a wrong name)."""
    folder = run_path(study, run, root)
    shutil.rmtree(folder)
    write_index(root)


def build_index(root: str | Path | None = None) -> list[dict[str, Any]]:
    """The index entries of every run folder under `root` (those holding a run.json), sorted by study and run."""
    base = results_dir(root)
    entries = []
    for meta_path in sorted(base.glob(f"*/*/{RUN_JSON}")):
        meta = json.loads(meta_path.read_text())
        folder = meta_path.parent
        if (meta.get("study"), meta.get("run")) != (folder.parent.name, folder.name):
            raise ValueError(f"{meta_path} names run {meta.get('study')}/{meta.get('run')}, not its folder's")
        files = sorted(p.name for p in folder.iterdir() if p.is_file() and not p.name.endswith(".tmp"))
        entries.append({**{field: meta.get(field) for field in RUN_FIELDS}, "files": files})
    return entries


def write_index(root: str | Path | None = None) -> Path:
    """Rebuild the index from the run folders, atomically."""
    body = json.dumps({"runs": build_index(root)}, indent=1) + "\n"
    return write_atomic(_index_path(root), lambda tmp: tmp.write_text(body))


__all__ = ["RESULTS", "RUN_FIELDS", "LOG_GZIP_BYTES", "MissingRun", "results_dir", "card_of", "log_header", "logs_of",
           "run_logs", "command_line", "index", "studies", "runs", "run_info", "run_path", "run_file", "trace_files",
           "read_text", "load", "write_parquet", "write_run", "remove_run", "build_index", "write_index"]
