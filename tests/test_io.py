"""`hqlab.io`: what every benchmark's `finish` writes when a results file already holds other runs (`replace_runs`), and
raw run records read plain or gzipped (`read_json`), and the one check of a path to be written (`check_writable`)."""

from __future__ import annotations

import json

import polars as pl
import pytest

from hqlab.io import check_writable, replace_runs


def test_a_finished_run_replaces_its_own_rows_and_keeps_every_other_run():
    old = pl.DataFrame({"run": ["v1", "v1", "s2"], "x": [1, 2, 3]})
    new = pl.DataFrame({"run": ["v1"], "x": [9], "rounds": [8]})
    got = replace_runs(old, new)
    assert got.sort("run").rows() == [("s2", 3, None), ("v1", 9, 8)]  # v1's two old rows gone, s2 kept
    assert replace_runs(None, new).equals(new)
    assert replace_runs(got, new).sort("run").equals(got.sort("run"))  # finishing again changes nothing


def test_read_json_reads_the_plain_file_or_else_its_gzipped_copy(tmp_path):
    import gzip

    from hqlab.io import read_json

    plain = tmp_path / "run.json"
    with gzip.open(tmp_path / "run.json.gz", "wt", encoding="utf-8") as f:
        json.dump({"engines": [1, 2]}, f)
    assert read_json(plain) == {"engines": [1, 2]}  # only the gzipped copy exists
    plain.write_text('{"engines": []}', encoding="utf-8")
    assert read_json(plain) == {"engines": []}  # the plain file wins where both exist
    with pytest.raises(FileNotFoundError):
        read_json(tmp_path / "missing.json")


def test_check_writable_tells_a_file_a_folder_replaced_and_a_folder_written_into(tmp_path):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "folder").mkdir()
    check_writable(tmp_path / "new" / "r.parquet", "--out", ValueError)  # nothing exists yet: the tmp folder decides
    check_writable(tmp_path / "folder", "--out", ValueError, folder=True)
    check_writable(tmp_path / "folder", "--out-dir", ValueError, into=True)
    for path, kind, message in [(tmp_path / "folder", {}, "is a directory"),
                                (tmp_path / "a_file", {"into": True}, "is a file"),
                                (tmp_path / "a_file" / "out", {"into": True}, "a_file is a file, not a folder")]:
        with pytest.raises(ValueError, match=message):
            check_writable(path, "--out", ValueError, **kind)
