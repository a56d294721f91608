"""Bad input gets a clear error naming the problem, and nothing is written half-way."""

from __future__ import annotations

import json

import pytest

from hqlab.cli import main


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


@pytest.mark.slow
def test_prompt_longer_than_context(tmp_path, capsys):
    path = _write(tmp_path, [json.dumps({"id": "huge", "prompt": "lantern " * 40_000})])
    out = tmp_path / "r.parquet"
    assert main(["bench", "--suite", str(path), "--out", str(out), "--max-new-tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert "prompt 'huge' has" in err and "exceeds the model's context of 32768" in err
    assert not out.exists() and not (tmp_path / "r.steps.parquet").exists()
