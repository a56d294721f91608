"""First contact: every command checks all its inputs before it loads a model, and a bad one ends it within
seconds with exit code 2 and one line on stderr naming the problem, having written nothing.

The real `hqlab` command runs in a subprocess with an empty model cache (`HQLAB_CACHE`) and the hub offline:
preparing or loading any model creates folders in that cache (locks, packages, converted models), so a cache
that is still absent afterwards shows no model was touched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hqlab.cli import main

HQLAB = Path(sys.executable).with_name("hqlab")
LIMIT_S = 20.0


def _inputs(folder: Path) -> None:
    """Bad (and some good) input files in the working folder of a run."""
    (folder / "bad.jsonl").write_text('{"prompt": "fine"}\n{"prompt": "broken\n')
    (folder / "good.jsonl").write_text(json.dumps({"prompt": "hello"}) + "\n")
    (folder / "bad.yaml").write_text(yaml.safe_dump({"defaults": {"model": "no-such-model"}}))
    (folder / "typo.yaml").write_text(yaml.safe_dump({"explorer": {"max_new_tokens": "many"}}))
    (folder / "broken.yaml").write_text("explorer: {model: [\n")
    (folder / "badcorpus.jsonl").write_text('{"output_ids": [1, 2\n')
    (folder / "not_a_model").mkdir()
    (folder / "a_file").write_text("x")


def _snapshot(folder: Path) -> dict[str, float]:
    return {str(p.relative_to(folder)): p.stat().st_mtime for p in folder.rglob("*")}


CASES = [
    # the three of the issue
    (["figures", "--only", "nonexistent"], "no notebook named nonexistent"),
    (["sweep", "--grid", "lookup:nmin=1|x", "--out", "r.parquet"], "nmin must be an integer, got 'x'"),
    (["bench", "--suite", "bad.jsonl", "--out", "r.parquet"], "bad.jsonl:2: invalid JSON"),
    # the same defect elsewhere
    (["figures", "--params", "bad.yaml"], "core_benchmark: model: unknown model 'no-such-model'"),
    (["figures", "--params", "typo.yaml"], "explorer: max_new_tokens must be an integer like its default"),
    (["figures", "--params", "broken.yaml"], "cannot read parameters file broken.yaml"),
    (["figures", "--params", "missing.yaml"], "parameters file missing.yaml: no such file"),
    (["sweep", "--suite", "bad.jsonl", "--grid", "pld", "--out", "r.parquet"], "bad.jsonl:2: invalid JSON"),
    (["sweep", "--grid", "lookup:nmin=20|2,nmax=8", "--out", "r.parquet"], "nmin=20 is in no valid combination"),
    (["sweep", "--traces", "bad.jsonl", "--grid", "pld", "--out", "r.parquet"], "not a readable parquet"),
    (["bench", "--suite", "good.jsonl", "--figure", "speed.png", "--out", "r.parquet"], "--figure must end in .svg"),
    (["bench", "--suite", "good.jsonl", "--model", "./not_a_model", "--out", "r.parquet"], "without config.json"),
    (["bench", "--suite", "good.jsonl", "--proposer", "draft:model=nope", "--out", "r.parquet"],
     "unknown model 'nope'"),
    (["bench", "--suite", "good.jsonl", "--out", "a_file/r.parquet"], "a_file is a file, not a folder"),
    (["bench", "--max-new-tokens", "lots", "--out", "r.parquet"], "invalid int value: 'lots'"),
    (["vocab", "build", "--corpus", "badcorpus.jsonl", "--out", "vocab"], "badcorpus.jsonl:1: invalid JSON"),
    (["vocab", "coverage", "--corpus", "good.jsonl", "--sizes", "1k,2k", "--out", "c.parquet"],
     "--sizes must be comma-separated integers"),
]


@pytest.mark.parametrize("argv, message", CASES, ids=[" ".join(a[:3]) for a, _ in CASES])
def test_bad_input_exits_2_with_one_line_fast_loading_and_writing_nothing(tmp_path, argv, message):
    work = tmp_path / "work"
    work.mkdir()
    _inputs(work)
    before = _snapshot(work)
    cache = tmp_path / "model-cache"
    env = dict(os.environ, HQLAB_CACHE=str(cache), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    t0 = time.perf_counter()
    run = subprocess.run([str(HQLAB), *argv], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - t0
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2, run.stderr
    assert len(lines) == 1, f"expected one line on stderr, got:\n{run.stderr}"
    assert message in lines[0] and lines[0].startswith(f"hqlab {argv[0]}")
    assert elapsed < LIMIT_S, f"took {elapsed:.1f}s"
    assert not cache.exists(), "a model was prepared or loaded before the input was checked"
    assert _snapshot(work) == before, "the command wrote or changed files"


def _no_model(monkeypatch, tmp_path) -> Path:
    cache = tmp_path / "model-cache"
    monkeypatch.setenv("HQLAB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


@pytest.mark.parametrize("argv, message", [
    (["figures", "--out-dir", "{tmp}/a_file/out"], "a_file is a file, not a folder"),
    (["sweep", "--grid", "pld", "--cost", "{tmp}/missing.parquet", "--out", "{tmp}/r.parquet"], "no such file"),
    (["sweep", "--grid", "pld", "--cost", "{tmp}/r.parquet", "--measure-cost", "--out", "{tmp}/r.parquet"],
     "not both"),
    (["sweep", "--grid", "lookup:nmin=1|2", "--limit", "-1", "--out", "{tmp}/r.parquet"], "--limit must be >= 0"),
    (["sweep", "--grid", "lookup:depth=1|2", "--out", "{tmp}/r.parquet"], "unknown key(s) depth"),
    (["bench", "--repeats", "0", "--out", "{tmp}/r.parquet"], "--repeats must be >= 1"),
    (["bench", "--doc-tokens", "10", "--out", "{tmp}/r.parquet"], "doc_tokens must be >= 64"),
    (["bench", "--device", "tpu9", "--out", "{tmp}/r.parquet"], "unknown device 'tpu9'"),
    (["bench", "--suite", "{tmp}", "--out", "{tmp}/r.parquet"], "is a folder"),
    (["bench", "--proposer", "draft:vocab={tmp}/none.json", "--out", "{tmp}/r.parquet"],
     "no such draft vocabulary"),
    (["vocab", "build", "--corpus", "{tmp}/nothing", "--out", "{tmp}/v"], "no such file or folder"),
    (["vocab", "build", "--corpus", "{tmp}/good.jsonl", "--size", "0", "--out", "{tmp}/v"], "--size must be >= 1"),
    (["vocab", "build", "--corpus", "{tmp}/good.jsonl", "--out", "{tmp}/not_a_model"], None),  # empty: fine so far
    (["vocab", "coverage", "--corpus", "{tmp}/good.jsonl", "--reference", "{tmp}/nothing", "--out",
      "{tmp}/c.parquet"], "nothing: no such file or folder"),
    (["site", "--notebooks-dir", "{tmp}/none", "--out", "{tmp}/site"], "no such folder"),
])
def test_more_bad_inputs_in_process(tmp_path, capsys, monkeypatch, argv, message):
    _inputs(tmp_path)
    (tmp_path / "not_a_model" / "stray.txt").write_text("x")  # a non-empty folder that hqlab did not publish
    cache = _no_model(monkeypatch, tmp_path)
    before = _snapshot(tmp_path)
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert (message or "not a published vocabulary folder") in err[0]
    assert not cache.exists() and _snapshot(tmp_path) == before


def test_notebook_parameters_are_checked_before_the_first_notebook_runs(tmp_path):
    """A bad value for the last notebook fails the whole run before the first one starts."""
    from hqlab.site.notebooks import NotebookError, plan

    params = tmp_path / "p.yaml"
    params.write_text(yaml.safe_dump({"core_benchmark": {"limit": 1}, "suffix_lengths": {"dtype": "int3"}}))
    with pytest.raises(NotebookError, match="suffix_lengths: dtype: unknown dtype 'int3'"):
        plan(params, out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()
    params.write_text(yaml.safe_dump({"defaults": {"device": "cpu", "max_new_tokens": 12},
                                      "suffix_lengths": {"nmin_grid": [1, 2], "live_configs": []},
                                      "core_benchmark": {"suites": {"chat": 8}}}))
    runs = {r.stem: r.parameters for r in plan(params, only=["suffix_lengths", "core_benchmark", "kernels"])}
    assert runs == {"core_benchmark": {"device": "cpu", "suites": {"chat": 8}},
                    "kernels": {},
                    "suffix_lengths": {"device": "cpu", "max_new_tokens": 12, "nmin_grid": [1, 2],
                                       "live_configs": []}}
    params.write_text(yaml.safe_dump({"core_benchmark": {"suites": {"nonesuch": 8}}}))
    with pytest.raises(NotebookError, match="suites: unknown suite 'nonesuch'"):
        plan(params)
    params.write_text(yaml.safe_dump({"explorer": {"compare": "lookup:k=4"}}))  # a list is expected
    with pytest.raises(NotebookError, match="compare must be a list"):
        plan(params)
