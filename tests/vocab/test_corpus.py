"""Corpus readers: every format read as specified; malformed input rejected with file and line, before anything
is counted or published."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hqlab.cli import main
from hqlab.vocab.corpus import CorpusError, expand, read_corpus, split, validate
from hqlab.vocab.publish import publish, read_index


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        path.write_text(data, encoding="utf-8")
    else:
        path.write_bytes(data)
    return path


def jsonl(path: Path, *objs) -> Path:
    return write(path, "".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))


def test_every_format(tmp_path):
    txt = write(tmp_path / "a.txt", "Plain text.\nSecond line.\n")
    py = write(tmp_path / "b.py", "def f():\n    return 1\n")
    js = jsonl(tmp_path / "c.jsonl",
               {"prompt": "Hi", "response": "Hello!", "src": "chat"},
               "",  # blank lines are skipped and do not count as records
               {"text": "just text"},
               {"messages": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}]},
               {"id": "x", "src": "code", "prompt_ids": [1, 2], "output_ids": [5, 6, 7], "finish": "eos"})
    table = pa.table({"text": ["row one", "row two"], "src": ["math", None]})
    pq.write_table(table, tmp_path / "d.parquet")
    recs = validate([txt, py, js, tmp_path / "d.parquet"])
    assert [(Path(r.path).name, r.line, r.index, r.src) for r in recs] == [
        ("a.txt", 0, 0, "text"), ("b.py", 0, 1, "code"),
        ("c.jsonl", 1, 0, "chat"), ("c.jsonl", 3, 1, "c"), ("c.jsonl", 4, 2, "c"), ("c.jsonl", 5, 3, "code"),
        ("d.parquet", 1, 0, "math"), ("d.parquet", 2, 1, "d")]
    assert recs[0].texts == ("Plain text.\nSecond line.\n",)
    assert recs[2].texts == ("Hi", "Hello!") and recs[2].ids is None
    assert recs[4].texts == ("Q?", "A.")
    # a self-generated record is counted from what the model emitted, not its prompt
    assert recs[5].ids == (5, 6, 7) and recs[5].texts == ()
    assert recs[6].texts == ("row one",)


def test_holdout_rule_is_per_file(tmp_path):
    a = jsonl(tmp_path / "a.jsonl", *[{"text": f"a{i}"} for i in range(23)])
    b = jsonl(tmp_path / "b.jsonl", *[{"text": f"b{i}"} for i in range(5)])
    counted, held = split(read_corpus([a, b]))
    assert [r.texts[0] for r in held] == ["a0", "a10", "a20", "b0"]
    assert len(counted) == 24
    assert split(read_corpus([a]), holdout=False)[1] == []


def test_folder_expands_to_corpus_files_sorted(tmp_path):
    write(tmp_path / "z.txt", "z")
    write(tmp_path / "sub" / "a.py", "a = 1")
    write(tmp_path / "notes.md", "ignored inside a folder")
    assert [p.name for p in expand([tmp_path])] == ["a.py", "z.txt"]
    assert [r.index for r in read_corpus([tmp_path])] == [0, 1]


def _bad_cases(tmp: Path):
    return [
        (jsonl(tmp / "badjson.jsonl", {"text": "ok"}, {"text": "ok"}, '{"text": "unterminated'),
         "badjson.jsonl:3: invalid JSON"),
        (jsonl(tmp / "notobj.jsonl", [1, 2]), "notobj.jsonl:1: expected a JSON object, got list"),
        (jsonl(tmp / "prompt.jsonl", {"text": "ok"}, {"prompt": 5}), "prompt.jsonl:2: field 'prompt' must be a string, got int"),
        (jsonl(tmp / "resp.jsonl", {"response": ["a"]}), "resp.jsonl:1: field 'response' must be a string, got list"),
        (jsonl(tmp / "msgs.jsonl", {"messages": "hi"}), "msgs.jsonl:1: 'messages' must be a list"),
        (jsonl(tmp / "msg1.jsonl", {"messages": [{"content": "a"}, {"role": "user"}]}),
         "msg1.jsonl:1: messages[1] must be an object with a string 'content'"),
        (jsonl(tmp / "ids.jsonl", {"output_ids": [1, "2"]}), "ids.jsonl:1: 'output_ids' must be a list of non-negative"),
        (jsonl(tmp / "neg.jsonl", {"output_ids": [1, -2]}), "neg.jsonl:1: 'output_ids' must be a list of non-negative"),
        (jsonl(tmp / "bool.jsonl", {"output_ids": [True]}), "bool.jsonl:1: 'output_ids' must be a list of non-negative"),
        (jsonl(tmp / "pids.jsonl", {"output_ids": [1], "prompt_ids": "1 2"}), "pids.jsonl:1: 'prompt_ids' must be"),
        (jsonl(tmp / "src.jsonl", {"text": "a", "src": 3}), "src.jsonl:1: 'src' must be a string"),
        (jsonl(tmp / "nothing.jsonl", {"id": "a", "title": "no countable field"}), "nothing.jsonl:1: nothing to count"),
        (jsonl(tmp / "blank.jsonl", {"text": "   "}), "blank.jsonl:1: nothing to count"),
        (write(tmp / "empty.txt", ""), "empty.txt: empty file"),
        (write(tmp / "spaces.py", "  \n\n"), "spaces.py: empty file"),
        (write(tmp / "empty.jsonl", "\n\n"), "empty.jsonl: empty file"),
        (write(tmp / "bin.txt", b"line one\nline two\x00\x01\x02"), "bin.txt:2: binary file (NUL byte"),
        (write(tmp / "latin.py", "x = 1\n# caf\xe9\n".encode("latin-1")), "latin.py:2: not UTF-8 text (byte 0xe9"),
        (write(tmp / "bin.jsonl", b'{"text": "a"}\n\xff\xfe{"text": "b"}\n'), "bin.jsonl:2: not UTF-8 text"),
        (write(tmp / "notes.md", "# hello"), "notes.md: unsupported corpus file type '.md'"),
        (write(tmp / "README", "hello"), "README: unsupported corpus file type '(no extension)'"),
        (tmp / "missing.jsonl", "missing.jsonl: no such file or folder"),
        (write(tmp / "broken.parquet", b"PAR1 definitely not parquet"), "broken.parquet: not a readable Parquet file"),
    ]


def test_malformed_input_names_file_and_line(tmp_path):
    for path, message in _bad_cases(tmp_path):
        with pytest.raises(CorpusError) as e:
            validate([path])
        assert message in str(e.value), (path.name, str(e.value))
        assert str(e.value).startswith(str(path)), str(e.value)


@pytest.mark.parametrize("table, message", [
    (pa.table({"body": ["a"]}), "no 'text' column (columns: body)"),
    (pa.table({"text": [1, 2]}), "column 'text' must hold strings, has int64"),
    (pa.table({"text": ["a"], "src": [1]}), "column 'src' must hold strings"),
    (pa.table({"text": ["a", None]}), "row 2: 'text' is null"),
    (pa.table({"text": pa.array([], pa.string())}), "no rows"),
])
def test_malformed_parquet(tmp_path, table, message):
    path = tmp_path / "t.parquet"
    pq.write_table(table, path)
    with pytest.raises(CorpusError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate([path])


def test_folder_without_corpus_files(tmp_path):
    write(tmp_path / "a.md", "x")
    with pytest.raises(CorpusError, match="folder holds no corpus files"):
        validate([tmp_path])


def test_bad_corpus_never_touches_published_artifacts(tmp_path, capsys):
    """`hqlab vocab build` validates the whole corpus first: a malformed file fails with its name and line and the
    published folder stays byte-for-byte what it was (no model needed: it fails before loading anything)."""
    out = tmp_path / "vocab"
    publish(out, {"ids.json": b'{"ids": [1, 2, 3]}\n', "lm_head.safetensors": b"rows"}, {"size": 3})
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    good = jsonl(tmp_path / "ok.jsonl", *[{"output_ids": [1, 2]} for _ in range(20)])
    for path, message in _bad_cases(tmp_path / "bad"):
        rc = main(["vocab", "build", "--corpus", str(good), "--corpus", str(path), "--size", "64", "--out", str(out)])
        err = capsys.readouterr().err
        assert rc == 2 and message in err, (path.name, err)
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    assert read_index(out)["meta"] == {"size": 3}
