"""`hqlab.io.replace_runs`: what every benchmark's `finish` writes when a results file already holds other runs."""

from __future__ import annotations

import polars as pl

from hqlab.io import replace_runs


def test_a_finished_run_replaces_its_own_rows_and_keeps_every_other_run():
    old = pl.DataFrame({"run": ["v1", "v1", "s2"], "x": [1, 2, 3]})
    new = pl.DataFrame({"run": ["v1"], "x": [9], "rounds": [8]})
    got = replace_runs(old, new)
    assert got.sort("run").rows() == [("s2", 3, None), ("v1", 9, 8)]  # v1's two old rows gone, s2 kept
    assert replace_runs(None, new).equals(new)
    assert replace_runs(got, new).sort("run").equals(got.sort("run"))  # finishing again changes nothing
