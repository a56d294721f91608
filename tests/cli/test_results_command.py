"""`hqlab results`: list a results folder's runs, rebuild its index, check the claims beside its runs (exit 1 where
one does not hold), and name an unknown study in one line."""

from __future__ import annotations

import json

import polars as pl

from hqlab.bench import results
from hqlab.cli import main


def test_list_check_and_index_a_results_folder(tmp_path, capsys):
    results.write_run("toy", "r1", card="h100", tables={"rows": pl.DataFrame({"x": [1.0, 2.0]})}, root=tmp_path,
                      info={"commit": "abc"})
    assert main(["results", "list", "--root", str(tmp_path)]) == 0
    assert capsys.readouterr().out.split("  ")[:4] == ["toy/r1", "h100", results.run_info("toy", "r1", tmp_path)
                                                       ["date"], "abc"]
    claims = [{"what": "two rows", "metric": "count(*)", "op": "==", "value": 2}]
    (tmp_path / "toy" / "r1" / "claims.json").write_text(json.dumps(claims))
    assert main(["results", "index", "--root", str(tmp_path)]) == 0
    assert "claims.json" in results.run_info("toy", "r1", tmp_path)["files"]
    capsys.readouterr()
    assert main(["results", "check", "toy", "r1", "--root", str(tmp_path)]) == 0
    assert "1 claims of 1 runs checked, 0 do not hold" in capsys.readouterr().out
    claims.append({"what": "three rows", "metric": "count(*)", "op": "==", "value": 3})
    (tmp_path / "toy" / "r1" / "claims.json").write_text(json.dumps(claims))
    assert main(["results", "check", "--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "toy/r1 FAILED: three rows -- count(*) == 3; found 2" in out and "1 do not hold" in out


def test_an_unknown_study_is_named_in_one_line(tmp_path, capsys):
    results.write_run("toy", "r1", card="cpu", root=tmp_path)
    assert main(["results", "check", "nope", "--root", str(tmp_path)]) == 2
    assert "hqlab results check: error: no study 'nope'" in capsys.readouterr().err
    assert main(["results", "list", "toy", "--root", str(tmp_path)]) == 0
