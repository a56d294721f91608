"""Each GPU benchmark's `finish`, run again on what the GPU host returned for a committed run, writes that run's
committed tables exactly, and run.json the same card, commit, command, plan and model runners: the finish side is
checked here on the CPU, for the benchmarks whose GPU side cannot run here. (benchmarks/vllm_serve.py's and
benchmarks/seed_scale_validation.py's round trips are in test_serve.py and test_seed_scale_validation.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pyarrow as pa
from polars.testing import assert_frame_equal

from hqlab.bench import results

ROOT = Path(__file__).resolve().parents[2]
RUN_FIELDS = ("card", "commit", "command", "plan", "vllm_runner")


def returned(into: Path, study: str, run: str, names: dict[str, str]) -> Path:
    """A committed run's files under the names the GPU host returned them with ({committed: returned})."""
    into.mkdir()
    for name, as_returned in names.items():
        shutil.copy(results.run_file(study, run, name), into / as_returned)
    return into


def same_fields(study: str, run: str, root: Path, committed: tuple[str, str] | None = None) -> None:
    entry, before = results.run_info(study, run, root), results.run_info(*(committed or (study, run)))
    for field in RUN_FIELDS:
        assert entry[field] == before[field], field


def test_vllm_gpu_finish_writes_a_committed_decode_run_again(tmp_path):
    """benchmarks/vllm_gpu.py finish on the decodes a validation call returned (raw runs and their .json, as
    vllm_gpu.py bench wrote them): the same rows, steps and repeats as the committed run holds for them."""
    from benchmarks import vllm_gpu

    src = returned(tmp_path / "returned", "seed_scale", "v2a",
                   {"raw_05b.parquet": "vllm_gpu_v2a_05b.parquet", "raw_05b.json": "vllm_gpu_v2a_05b.json"})
    root = tmp_path / "results"
    commit = results.run_info("seed_scale", "v2a")["commit"]
    assert vllm_gpu.main(["finish", str(src / "vllm_gpu_v2a_05b.parquet"), "--run", "v2a_05b", "--commit", commit,
                          "--results", str(root)]) == 0
    for kind in ("rows", "steps", "repeats"):
        finished = results.load("vllm_gpu", "v2a_05b", kind, root=root)
        committed = results.load("seed_scale", "v2a", kind).filter(pl.col("run") == "v2a_05b")
        assert_frame_equal(finished, committed.select(finished.columns), check_dtypes=False)
    entry, committed = results.run_info("vllm_gpu", "v2a_05b", root), results.run_info("seed_scale", "v2a")
    assert (entry["card"], entry["commit"], entry["vllm_runner"]) == ("h100", commit, committed["vllm_runner"])
    assert entry["benchmark"] == "benchmarks/vllm_gpu.py"


STEP_FIELDS = {"step_context_len": "context_len", "step_corpus_docs": "corpus_docs", "step_emitted": "emitted",
               "step_accepted": "accepted", "step_source": "source"}
# what a point row takes from the step fields the requests table does not keep (each step's drafted tokens and end
# time): the replay's check and the step intervals
NEEDS_DRAFTS_AND_TIMES = ("replay_", "step_ms_median", "slow_step_share", "slow_time_share")


def test_corpus_finish_writes_a_committed_runs_points_again(tmp_path):
    """benchmarks/vllm_corpus.py finish on raw rows rebuilt from a committed run's requests table (its points one
    request at a time in the first repeat, every config's), with the run's returned .json and log: the same point
    rows (rates, tokens a step, ratios to `none` and to the lookup without the corpus, greedy agreement), the same
    request rows and the same run.json. The raw file itself is not committed; what needs each step's drafted tokens
    and end time (the replay's check, the step intervals) is checked on recorded steps by test_vllm_corpus.py."""
    import pyarrow.parquet as pq

    from benchmarks import vllm_corpus

    run = "c3"
    points = (pl.col("load") == 1) & (pl.col("repeat") == 0)
    requests = results.load("corpus", run, "requests").filter(points)
    raw = [{**{k: v for k, v in r.items() if k not in STEP_FIELDS and k != "run"},
            "steps": json.dumps([dict(zip(STEP_FIELDS.values(), step), drafted=None, match_len=-1, t_end=0.0)
                                 for step in zip(*(r[k] for k in STEP_FIELDS))])}
           for r in requests.to_dicts()]  # the fields the requests table does not keep: none drafted, one time
    src = returned(tmp_path / "returned", "corpus", run, {"raw.json": f"vllm_corpus_{run}.json",
                                                           "run.log": f"vllm_corpus_{run}.log"})
    pq.write_table(pa.Table.from_pylist(raw), src / f"vllm_corpus_{run}.parquet")
    root = tmp_path / "results"
    assert vllm_corpus.main(["finish", str(src / f"vllm_corpus_{run}.parquet"), "--run", run, "--commit",
                             results.run_info("corpus", run)["commit"], "--results", str(root)]) == 0
    finished, committed = results.load("corpus", run, root=root), results.load("corpus", run).filter(points)
    columns = [c for c in finished.columns if not c.startswith(NEEDS_DRAFTS_AND_TIMES)]
    assert finished.height == committed.height == 3 and "vs_no_corpus" in columns
    assert_frame_equal(finished.select(columns), committed.select(columns), check_dtypes=False, check_row_order=False)
    assert_frame_equal(results.load("corpus", run, "requests", root=root), requests.select(requests.columns),
                       check_dtypes=False, check_column_order=False)
    same_fields("corpus", run, root)
    assert results.run_info("corpus", run, root)["plan"] == f"benchmarks/plans/corpus_{run}.json"


def test_step_cost_finish_writes_a_committed_grid_again(tmp_path):
    """benchmarks/vllm_step_cost.py finish on the grid rows and the log a call returned: the committed grid (less
    the columns later runs added), its raw rows, and run.json's command, card and commit."""
    from benchmarks import vllm_step_cost

    src = returned(tmp_path / "returned", "seed_scale", "s3a",
                   {"grid.jsonl": "seed_scale_s3a.jsonl", "run.log": "vllm_step_cost_s3a.log"})
    root = tmp_path / "results"
    assert vllm_step_cost.main(["finish", str(src), "--results", str(root)]) == 0
    finished = results.load("seed_scale", "s3a", "grid", root=root)
    assert_frame_equal(finished, results.load("seed_scale", "s3a", "grid").select(finished.columns),
                       check_dtypes=False)
    same_fields("seed_scale", "s3a", root)
    assert results.run_file("seed_scale", "s3a", "grid.jsonl", root).read_bytes() == \
        results.run_file("seed_scale", "s3a", "grid.jsonl").read_bytes()
