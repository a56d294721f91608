"""hqlab vocab: bad input is refused before anything loads; coverage curves from the command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SELFGEN = Path(__file__).resolve().parents[2] / "data" / "selfgen" / "qwen2.5-coder-0.5b.jsonl"


def test_cli_rejects_bad_input_before_loading(tmp_path, capsys):
    from hqlab.cli import main

    assert main(["vocab", "coverage", "--corpus", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "c.parquet")]) == 2
    assert "nope.jsonl: no such file or folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["vocab", "coverage", "--corpus", "x.jsonl", "--out", str(tmp_path / "c.csv")])
    assert "--out must end in .parquet" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_coverage(tmp_path, capsys):
    from hqlab.cli import main

    import polars as pl

    ref = tmp_path / "ref.jsonl"
    ref.write_text("".join(json.dumps({"text": f"Some generic text number {i}, def f(x): return x"}) + "\n"
                           for i in range(30)))
    out = tmp_path / "cov.parquet"
    assert main(["vocab", "coverage", "--corpus", str(SELFGEN), "--reference", str(ref), "--sizes",
                 "256,1024,151936", "--out", str(out)]) == 0
    frame = pl.read_parquet(out)
    assert set(frame["list"]) == {"own outputs", "ref"}
    for label in ("own outputs", "ref"):
        curve = frame.filter((pl.col("list") == label) & (pl.col("src") == "all")).sort("n")["coverage"].to_list()
        assert curve == sorted(curve) and curve[-1] == pytest.approx(1.0)
    own = frame.filter((pl.col("list") == "own outputs") & (pl.col("src") == "all") & (pl.col("n") == 1024))
    ref_row = frame.filter((pl.col("list") == "ref") & (pl.col("src") == "all") & (pl.col("n") == 1024))
    assert own["coverage"][0] > ref_row["coverage"][0]  # a tiny unrelated text loses to the model's own outputs
