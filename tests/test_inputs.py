"""Bad input gets a clear error naming the problem, and nothing is written half-way."""

from __future__ import annotations

import json

import pytest

from hqlab.cli import main
from hqlab.config import ConfigError, DecodeConfig, LookupConfig, parse_spec
from hqlab.proposers import make_proposer
from hqlab.workloads import WorkloadError, load_workload, read_jsonl


@pytest.mark.parametrize("spec, message", [
    ("lookup:nmin=8,nmax=4", "nmin must be <= nmax"),
    ("lookup:k=0", "k must be >= 1"),
    ("lookup:nmin=0", "nmin must be >= 1"),
    ("lookup:frobnicate=3", "unknown key(s) frobnicate"),
    ("lookup:nmin=six", "nmin must be an integer"),
    ("lookup:policy=oldest", "policy must be 'recent' or 'earliest'"),
    ("lookup:nmin", "is not key=value"),
    ("lookup:k=3,k=4", "given twice"),
    ("pld:n=0", "n must be >= 1"),
    ("nonesuch", "unknown proposer 'nonesuch'"),
    ("", "empty proposer spec"),
])
def test_bad_specs(spec, message):
    with pytest.raises(ConfigError) as e:
        make_proposer(spec)
    assert message in str(e.value)


def test_spec_round_trip():
    assert parse_spec(" lookup : nmin=3 , k=9 ") == ("lookup", {"nmin": "3", "k": "9"})
    p = make_proposer("lookup:nmin=3,nmax=5,k=9,policy=earliest,full=true")
    assert p.config == LookupConfig(nmin=3, nmax=5, k=9, policy="earliest", full=True)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        DecodeConfig(max_new_tokens=0)
    with pytest.raises(ConfigError, match="top_p"):
        DecodeConfig(top_p=0)


@pytest.mark.parametrize("argv, message", [
    (["--proposer", "lookup:nmin=9,nmax=2"], "nmin must be <= nmax"),
    (["--proposer", "lookup:k=0"], "k must be >= 1"),
    (["--proposer", "lookup:bogus=1"], "unknown key(s) bogus"),
    (["--proposer", "hf-pld:k=0"], "hf-pld: k must be >= 1"),
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--model", "./missing/folder"], "does not exist"),
    (["--suite", "no_such_suite"], "unknown suite 'no_such_suite'"),
    (["--dtype", "int3"], "dtype"),
])
def test_cli_rejects_bad_input_and_writes_nothing(tmp_path, capsys, argv, message):
    out = tmp_path / "r.parquet"
    assert main(["bench", "--out", str(out), *argv]) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_cli_rejects_bad_out_path(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--out", str(tmp_path / "results.csv")])
    assert "--out must end in .parquet" in capsys.readouterr().err


def _write(tmp_path, lines, name="w.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "ok"}', '{"prompt": "fine"}', '{"prompt": "broken'], ":3: invalid JSON"),
    (['{"prompt": 5}'], ":1: 'prompt' must be a non-empty string"),
    (['{"prompt": "a", "turns": ["b"]}'], ":1: give exactly one of 'prompt' or 'turns'"),
    (['{"text": "a"}'], ":1: give exactly one of 'prompt' or 'turns'"),
    (['["prompt"]'], ":1: expected a JSON object"),
    (['{"turns": []}'], ":1: 'turns' must be a non-empty list"),
    (['{"turns": ["hi", "hello"]}'], ":1: the last turn must be the user's"),
    (['{"turns": [{"role": "robot", "content": "x"}]}'], ":1: turn 0 must be"),
    (['{"prompt": "a", "id": "x"}', '{"prompt": "b", "id": "x"}'], ":2: duplicate id 'x'"),
    (['{"prompt": "a", "category": 3}'], ":1: 'id' and 'category' must be strings"),
    ([""], "no prompts (empty file)"),
])
def test_malformed_workloads_name_file_and_line(tmp_path, lines, message):
    path = _write(tmp_path, lines)
    with pytest.raises(WorkloadError) as e:
        read_jsonl(path)
    assert message in str(e.value) and str(path) in str(e.value)


def test_binary_workload_file(tmp_path):
    path = tmp_path / "blob.jsonl"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    with pytest.raises(WorkloadError, match="not UTF-8"):
        read_jsonl(path)


def test_good_workload_forms(tmp_path):
    path = _write(tmp_path, [json.dumps({"prompt": "hi"}),
                             json.dumps({"turns": ["q", "a", "q2"], "category": "multi", "id": "t"}),
                             json.dumps({"turns": [{"role": "system", "content": "be brief"},
                                                   {"role": "user", "content": "q"}]})])
    prompts = load_workload(str(path))
    assert [p.category for p in prompts] == ["custom", "multi", "custom"]
    assert [m["role"] for m in prompts[1].messages] == ["user", "assistant", "user"]
    assert prompts[0].id == "w-1"


def test_builtin_suites():
    assert [p.id for p in load_workload("labd")] == ["copy", "code", "edit", "quote", "summary", "qa"]
    chat = load_workload("chat")
    assert len(chat) == 8 and {p.category for p in chat} == {"chat"}
    assert len(load_workload("all")) == 14
    assert "Warning:" in load_workload("copy")[0].messages[0]["content"]


@pytest.mark.slow
def test_prompt_longer_than_context(tmp_path, capsys):
    path = _write(tmp_path, [json.dumps({"id": "huge", "prompt": "lantern " * 40_000})])
    out = tmp_path / "r.parquet"
    assert main(["bench", "--suite", str(path), "--out", str(out), "--max-new-tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert "prompt 'huge' has" in err and "exceeds the model's context of 32768" in err
    assert not out.exists() and not (tmp_path / "r.steps.parquet").exists()
