"""`hqlab.bench.engine_steps` on timed calls shaped as `worker.StepTimer` writes them under
`benchmarks/vllm_corpus.py bench --profile` (no GPU: the rows are written out here, one point of five steps)."""

from __future__ import annotations

import polars as pl
import pytest

from hqlab.bench.engine_steps import admissions, engine_steps

POINT = {"config": "gpu-lookup:k=15", "workload_file": "batch.jsonl", "load": 8, "repeat": 0, "point": 3}
NO_FACTS = {"tokens": -1, "requests": -1, "new_requests": -1, "finished_requests": -1}


def _calls() -> pl.DataFrame:
    """Five steps starting at 0, 4, 8, 12 and 42 ms: the fourth admits a request (its prompt makes it a 30 ms step),
    the third follows a finished one (its corpus insertion timed inside execute_model). The calls are listed in
    reverse; the reader orders them by host start."""
    rows = []
    for step, (start, new, finished, tokens) in enumerate([(0, 0, 0, 128), (4, 0, 0, 128), (8, 0, 1, 112),
                                                           (12, 1, 0, 412), (42, 0, 0, 128)]):
        start = float(start)
        rows.append({**POINT, "phase": "execute_model", "host_start_ms": start, "host_ms": 1.0 + (20 if new else 0),
                     "gpu_ms": 2.0 + (6 if new else 0), "tokens": tokens, "requests": 8, "new_requests": new,
                     "finished_requests": finished})
        rows.append({**POINT, "phase": "sample_tokens", "host_start_ms": start + 1.5, "host_ms": 0.8, "gpu_ms": 0.5,
                     **NO_FACTS})
        rows.append({**POINT, "phase": "propose (speculator)", "host_start_ms": start + 1.6, "host_ms": 0.3,
                     "gpu_ms": 0.1, **NO_FACTS})
        if finished:
            rows.append({**POINT, "phase": "corpus_step (speculator)", "host_start_ms": start + 0.1, "host_ms": 0.25,
                         "gpu_ms": 0.05, **NO_FACTS})
    return pl.DataFrame(rows[::-1])


def test_engine_steps_pair_each_execute_model_with_the_calls_after_it():
    steps = engine_steps(_calls())
    assert steps["step"].to_list() == [1, 2, 3, 4, 5]
    assert steps["interval_ms"].to_list()[:4] == [4.0, 4.0, 4.0, 30.0] and steps["interval_ms"][4] is None
    assert steps["corpus_step_host_ms"].to_list() == [0.0, 0.0, 0.25, 0.0, 0.0]
    assert steps["sample_host_ms"].to_list() == [0.8] * 5 and steps["propose_host_ms"].to_list() == [0.3] * 5
    assert steps["new_requests"].to_list() == [0, 0, 0, 1, 0]


def test_admissions_split_a_point_s_time_by_the_kind_of_step():
    row = admissions(engine_steps(_calls())).row(0, named=True)
    # four timed steps (the last has no interval), one of them admitting: 30 of the point's 42 ms
    assert row["steps"] == 4 and row["admitting_steps"] == 1
    assert row["total_ms"] == pytest.approx(42.0) and row["admitting_ms"] == pytest.approx(30.0)
    assert row["admitting_share"] == pytest.approx(30 / 42) and row["admit_extra_ms"] == pytest.approx(26.0)
    assert row["decode_interval_ms"] == pytest.approx(4.0) and row["admit_interval_ms"] == pytest.approx(30.0)
    assert row["admit_gpu_ms"] == pytest.approx(8.0) and row["decode_gpu_ms"] == pytest.approx(2.0)
    assert row["admit_execute_host_ms"] == pytest.approx(21.0) and row["decode_execute_host_ms"] == pytest.approx(1.0)
    assert row["corpus_insert_host_ms"] == pytest.approx(0.25)


def test_rows_without_step_facts_are_refused_by_name():
    with pytest.raises(ValueError, match="missing .*new_requests"):
        engine_steps(_calls().drop("new_requests"))


def test_finish_turns_a_profiled_runs_phases_into_one_admissions_row_a_point():
    """benchmarks/vllm_corpus.py `finish` reads a `--profile` run's .phases.parquet through `admissions_table`: one row
    per point, tagged with its run."""
    from hqlab.bench.corpus_runs import admissions_table

    table = admissions_table(_calls(), "c9")
    assert table["run"].to_list() == ["c9"] and table["admitting_steps"].to_list() == [1]
