"""The committed results' one layout (`hqlab.bench.results`): data/results/<study>/<run>/ with run.json, one card
spelling, an index that lists every run and its files, logs gzipped over the limit; the writer every `finish` uses;
the readers' errors; and no test or comment of the library named after a run (the run's data folder says which)."""

from __future__ import annotations

import ast
import gzip
import io
import json
import re
import tokenize
from pathlib import Path

import polars as pl
import pytest

from hqlab.bench import results

REPO = Path(__file__).resolve().parents[2]
CARD = re.compile(r"^(cpu|[a-z]{1,2}\d{2,4}[a-z]?)$")


def test_the_index_lists_every_run_folder_and_its_files():
    assert results.index() == results.build_index(), "data/results/index.json is stale: results.write_index()"
    assert len(results.index()) >= 100


def test_nothing_lies_outside_a_run_folder():
    top = {p.name for p in results.RESULTS.iterdir()}
    studies = set(results.studies())
    assert top - studies == {"index.json", "README.md"}, sorted(top - studies)
    for study in studies:
        folder = results.RESULTS / study
        assert all(p.is_dir() for p in folder.iterdir()), f"{study}: a file beside its runs"
        assert {p.name for p in folder.iterdir()} == set(results.runs(study))
        for run in results.runs(study):
            assert all(p.is_file() for p in (folder / run).iterdir()), f"{study}/{run}: a folder inside a run"


def test_every_run_says_what_ran_in_the_same_fields_and_spelling():
    for entry in results.index():
        where = f"{entry['study']}/{entry['run']}"
        meta = json.loads(results.run_file(entry["study"], entry["run"], "run.json").read_text())
        assert tuple(meta) == results.RUN_FIELDS, where
        assert CARD.match(meta["card"]), f"{where}: card {meta['card']!r}"
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", meta["date"]) and meta["date_from"] in ("log", "git", "finish"), where
        assert meta["benchmark"] is None or (REPO / meta["benchmark"]).exists(), f"{where}: {meta['benchmark']}"
        assert meta["plan"] is None or (REPO / meta["plan"]).exists(), f"{where}: {meta['plan']}"


def test_a_runs_card_is_the_one_its_rows_name():
    checked = 0
    for entry in results.index():
        if "rows.parquet" not in entry["files"]:
            continue
        rows = results.load(entry["study"], entry["run"])
        named = [c for c in ("machine", "device") if c in rows.columns]
        if named:
            cards = {results.card_of(m) for m in rows[named[0]].drop_nulls().unique()}
            assert cards == {entry["card"]}, f"{entry['study']}/{entry['run']}: {cards} against {entry['card']}"
            checked += 1
    assert checked >= 60


def test_every_log_over_the_limit_is_gzipped():
    for log in results.RESULTS.glob("*/*/*.log"):
        assert log.stat().st_size <= results.LOG_GZIP_BYTES, log.relative_to(results.RESULTS)


def test_card_of_spells_each_card_one_way():
    assert results.card_of("NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, vllm 0.26.0") == "h100"
    assert results.card_of("cuda (NVIDIA H200)") == "h200"
    assert results.card_of("CPU AMD EPYC, 2 threads, torch 2.13.0+cpu") == "cpu"
    assert results.card_of("cpu (Intel(R) Xeon(R) Processor, AVX2)") == "cpu"
    with pytest.raises(ValueError, match="no card named in the machine description 'a box'"):
        results.card_of("a box")


def test_a_log_header_gives_the_command_and_the_day_it_ran(tmp_path):
    text = "== python3 benchmarks/vllm_serve.py together --tag s9  2026-12-08 10:00:00\nname, driver\n"
    assert results.log_header(text) == ("python3 benchmarks/vllm_serve.py together --tag s9", "2026-12-08")
    assert results.log_header("no header\n") == (None, None)
    (tmp_path / "setup.log").write_text("== python3 -m pytest -q tests  2026-12-08 09:00:00\n")
    (tmp_path / "vllm_serve_s9.log").write_text(text)
    for other in ("vllm_serve_s99.log", "prepare_s9x.log", "s9.log.gz"):
        (tmp_path / other).write_text("")
    assert [p.name for p in results.logs_of(tmp_path, "s9")] == ["s9.log.gz", "vllm_serve_s9.log"]
    files, info = results.run_logs([tmp_path / "setup.log", tmp_path / "vllm_serve_s9.log"], "benchmarks/vllm_serve.py")
    assert files == {"setup.log": tmp_path / "setup.log", "run.log": tmp_path / "vllm_serve_s9.log"}
    assert info == {"command": "python3 benchmarks/vllm_serve.py together --tag s9", "date": "2026-12-08",
                    "date_from": "log"}


def test_write_run_puts_a_run_in_place_and_the_index_lists_it(tmp_path):
    rows = pl.DataFrame({"config": ["none", "a"], "x": [1.0, 2.0]})
    folder = results.write_run("toy", "r1", card="h100", tables={"rows": rows}, root=tmp_path,
                               files={"run.log": b"== python3 x.py  2026-12-08 10:00:00\n", "raw.json": b"{}"},
                               info={"commit": "abc", "command": "python3 x.py", "date": "2026-12-08",
                                     "date_from": "log"})
    assert folder == tmp_path / "toy" / "r1"
    entry = results.run_info("toy", "r1", tmp_path)
    assert entry["card"] == "h100" and entry["commit"] == "abc" and entry["plan"] is None
    assert entry["files"] == ["raw.json", "rows.parquet", "run.json", "run.log"]
    assert results.load("toy", "r1", root=tmp_path).equals(rows.with_columns(pl.lit("r1").alias("run")))
    # finishing again: the files it writes replace theirs, the others stay, run.json keeps what it is not told
    big = b"x" * (results.LOG_GZIP_BYTES + 1)
    results.write_run("toy", "r1", card="h100", files={"run.log": big}, root=tmp_path)
    entry = results.run_info("toy", "r1", tmp_path)
    assert entry["files"] == ["raw.json", "rows.parquet", "run.json", "run.log.gz"] and entry["commit"] == "abc"
    assert gzip.decompress(results.run_file("toy", "r1", "run.log", tmp_path).read_bytes()) == big
    assert results.read_text("toy", "r1", "run.log", tmp_path) == big.decode()
    results.write_run("toy", "r2", card="cpu", tables={"rows": rows.head(1)}, root=tmp_path)
    assert results.run_info("toy", "r2", tmp_path)["date_from"] == "finish"
    assert results.load("toy", root=tmp_path)["run"].to_list() == ["r1", "r1", "r2"]
    assert results.index(tmp_path) == results.build_index(tmp_path)
    results.remove_run("toy", "r2", tmp_path)
    assert results.runs("toy", root=tmp_path) == ["r1"]


def test_write_run_refuses_what_the_layout_cannot_hold(tmp_path):
    with pytest.raises(ValueError, match="card 'H100': spell it as card_of does"):
        results.write_run("toy", "r1", card="H100", root=tmp_path)
    with pytest.raises(ValueError, match="run 'a/b': use letters"):
        results.write_run("toy", "a/b", card="cpu", root=tmp_path)
    with pytest.raises(ValueError, match="run.json has no field.*colour"):
        results.write_run("toy", "r1", card="cpu", info={"colour": "red"}, root=tmp_path)


def test_a_missing_study_run_table_or_file_says_which_and_where_it_looked(tmp_path):
    results.write_run("toy", "r1", card="cpu", tables={"rows": pl.DataFrame({"x": [1]})}, root=tmp_path)
    results.write_run("toy", "r2", card="cpu", files={"run.log": b"hello\n"}, root=tmp_path)
    index = tmp_path / "index.json"
    with pytest.raises(results.MissingRun, match=f"no study 'nope' in {re.escape(str(index))} \\(studies: toy\\)"):
        results.load("nope", root=tmp_path)
    with pytest.raises(results.MissingRun, match=r"no run 'r9' of study 'toy' in .*index.json \(its runs: r1, r2\)"):
        results.run_path("toy", "r9", tmp_path)
    with pytest.raises(results.MissingRun, match=r"run\(s\) r2 of study 'toy' have no 'rows' table"):
        results.load("toy", ["r1", "r2"], root=tmp_path)
    assert results.load("toy", ["r1", "r2"], having=True, root=tmp_path)["run"].to_list() == ["r1"]
    assert results.load("toy", root=tmp_path)["run"].to_list() == ["r1"]  # every run that has the table
    with pytest.raises(results.MissingRun, match="no run of study 'toy' has a 'steps' table"):
        results.load("toy", kind="steps", root=tmp_path)
    with pytest.raises(results.MissingRun, match="run toy/r1 has no file 'run.log'.*its files: rows.parquet, run.json"):
        results.run_file("toy", "r1", "run.log", tmp_path)
    with pytest.raises(results.MissingRun, match="no results index at"):
        results.index(tmp_path / "elsewhere")


# --- run tags: a run's name lives in its data folder and its plan, not in test names or the library's prose -------

TAG = re.compile(r"^(?:[a-z]{1,2}\d+[a-z]?\d*[a-z]?|f[a-n])$")  # the shape of a GPU run's tag: s1, c4c, fn3a, fb
# words of this code that have a tag's shape: the cards, vLLM's engine versions, a dtype, the cost model of batch size 1
NOT_TAGS = {"h100", "h200", "v1", "v2", "bf16", "b1"}


def run_tags(root: Path = REPO) -> set[str]:
    """The tags of the committed runs (their names in the index, and a compound name's last part: drafter_fc) and of
    the plans (benchmarks/plans/<study>_<tag>.json), those of a tag's shape."""
    names = {r["run"] for r in results.index()}
    names |= {n.rsplit("_", 1)[-1] for n in names}
    names |= {p.stem.rsplit("_", 1)[-1] for p in (root / "benchmarks" / "plans").glob("*.json")}
    return {n for n in names if TAG.match(n)} - NOT_TAGS


def run_named_tests(tags: set[str], root: Path = REPO) -> list[str]:
    """`file::test (tags)` for every test function under root/tests whose name holds a run's tag as a word."""
    named = []
    for path in sorted((root / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
                hits = set(node.name.split("_")) & tags
                named += [f"{path.relative_to(root)}::{node.name} ({', '.join(sorted(hits))})"] if hits else []
    return named


def prose(path: Path) -> list[tuple[int, str]]:
    """The comments and docstrings of a module, with their lines."""
    source = path.read_text()
    found = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
             if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                found.append((node.body[0].lineno, doc))
    return found


def tagged_prose(tags: set[str], root: Path = REPO) -> list[str]:
    """`file:line: tag` for every run tag, as a whole word, in a comment or docstring of hqlab/ or kernels/. A path to
    a run's data folder (data/results/<study>/<run>/) is a pointer, not a tag."""
    word = re.compile(r"(?<![\w./-])(" + "|".join(sorted(tags, key=len, reverse=True)) + r")(?![\w/-])")
    return [f"{path.relative_to(root)}:{line}: {m.group(1)}" for folder in (root / "hqlab", root / "kernels")
            for path in sorted(folder.rglob("*.py")) for line, text in prose(path) for m in word.finditer(text)]


def test_no_test_is_named_after_a_run():
    assert not (named := run_named_tests(run_tags())), named


def test_no_run_tag_in_the_comments_or_docstrings_of_the_library():
    """A comment says why, not which run; it may point at a run's data folder by path."""
    assert not (found := tagged_prose(run_tags())), found


def test_the_run_tag_checks_can_fail(tmp_path):
    (tmp_path / "hqlab").mkdir()
    (tmp_path / "kernels").mkdir()
    (tmp_path / "hqlab" / "m.py").write_text('"""Tiles as run c4c chose."""\n\nx = 1  # see data/results/corpus/c4c/\n'
                                             "y = 2  # c4cx, as fn2 measured\n")
    assert tagged_prose({"c4c", "fn2"}, tmp_path) == ["hqlab/m.py:4: fn2", "hqlab/m.py:1: c4c"]
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_m.py").write_text("def test_c4c_holds():\n    pass\n\n\ndef test_holds():\n    pass\n")
    assert run_named_tests({"c4c"}, tmp_path) == ["tests/test_m.py::test_c4c_holds (c4c)"]
    assert {"c4c", "fn3a", "fb", "s5", "c5b"} <= run_tags() and not NOT_TAGS & run_tags()
