"""Where an engine step's time goes under load, read from the worker's timed calls (`worker.StepTimer` rows, as
`benchmarks/vllm_corpus.py bench --profile` writes them): one row per engine step, and per point the steps that
admit a request (its prompt's prefill runs in them) apart from the steps that only decode.

A step is one `execute_model` call and the calls that follow it until the next one (`sample_tokens`, the
speculator's `propose`; the corpus's `corpus_step` runs inside `execute_model`). Its interval is the host time
from its `execute_model` to the next step's: everything the engine core did for it, scheduling, output processing
and any wait for the GPU included. The last step of a point has no interval (nothing follows it).
"""

from __future__ import annotations

import polars as pl

POINT = ["config", "workload_file", "load", "repeat", "point"]


def engine_steps(phases: pl.DataFrame) -> pl.DataFrame:
    """One row per engine step of every point: its interval (ms), the host and GPU ms of `execute_model`, the host
    ms of `sample_tokens`, `propose` and `corpus_step` (0 where a step had none), and what the scheduler gave it
    (tokens, requests, new_requests, finished_requests)."""
    need = {*POINT, "phase", "host_start_ms", "host_ms", "gpu_ms", "tokens", "new_requests"}
    missing = need - set(phases.columns)
    if missing:
        raise ValueError(f"not StepTimer rows with step facts (benchmarks/vllm_corpus.py --profile): missing "
                         f"{sorted(missing)}")
    calls = (phases.sort([*POINT, "host_start_ms"])
             .with_columns((pl.col("phase") == "execute_model").cast(pl.Int32).cum_sum().over(POINT).alias("step")))
    if calls.filter(pl.col("step") == 0).height:
        raise ValueError("a point's first timed call is not execute_model: its calls cannot be split into steps")
    by_phase = (calls.group_by([*POINT, "step", "phase"])
                .agg(pl.col("host_ms").sum())
                .pivot(on="phase", index=[*POINT, "step"], values="host_ms"))
    execute = calls.filter(pl.col("phase") == "execute_model").select(
        *POINT, "step", "host_start_ms", pl.col("gpu_ms").alias("execute_gpu_ms"), "tokens", "requests",
        "new_requests", "finished_requests")
    rename = {"execute_model": "execute_host_ms", "sample_tokens": "sample_host_ms",
              "propose (speculator)": "propose_host_ms", "propose (drafter)": "propose_host_ms",
              "corpus_step (speculator)": "corpus_step_host_ms"}
    by_phase = by_phase.rename({k: v for k, v in rename.items() if k in by_phase.columns})
    for column in ("sample_host_ms", "propose_host_ms", "corpus_step_host_ms"):
        if column not in by_phase.columns:
            by_phase = by_phase.with_columns(pl.lit(0.0).alias(column))
    return (execute.join(by_phase, on=[*POINT, "step"])
            .sort([*POINT, "step"])
            .with_columns((pl.col("host_start_ms").shift(-1).over(POINT) - pl.col("host_start_ms"))
                          .alias("interval_ms"),
                          pl.col("sample_host_ms", "propose_host_ms", "corpus_step_host_ms").fill_null(0.0))
            .select(*POINT, "step", "interval_ms", "execute_host_ms", "execute_gpu_ms", "sample_host_ms",
                    "propose_host_ms", "corpus_step_host_ms", "tokens", "requests", "new_requests",
                    "finished_requests"))


def admissions(steps: pl.DataFrame) -> pl.DataFrame:
    """Per point: steps, the share of its time in steps that admit a request, and for both kinds of step the median
    interval, the median GPU span of the forward and the median host time of `execute_model`. `admit_extra_ms` is
    what an admitting step costs beyond a decode step (mean interval less the decode steps' median): times the
    admitting steps, the time admissions add to the point."""
    timed = steps.filter(pl.col("interval_ms").is_not_null())
    admit = pl.col("new_requests") > 0
    return (timed.group_by(POINT, maintain_order=True)
            .agg(pl.len().alias("steps"), admit.sum().alias("admitting_steps"),
                 pl.col("interval_ms").sum().alias("total_ms"),
                 pl.col("interval_ms").filter(admit).sum().alias("admitting_ms"),
                 pl.col("interval_ms").filter(~admit).median().alias("decode_interval_ms"),
                 pl.col("interval_ms").filter(admit).median().alias("admit_interval_ms"),
                 pl.col("interval_ms").filter(admit).mean().alias("_admit_mean"),
                 pl.col("execute_gpu_ms").filter(~admit).median().alias("decode_gpu_ms"),
                 pl.col("execute_gpu_ms").filter(admit).median().alias("admit_gpu_ms"),
                 pl.col("execute_host_ms").filter(~admit).median().alias("decode_execute_host_ms"),
                 pl.col("execute_host_ms").filter(admit).median().alias("admit_execute_host_ms"),
                 pl.col("corpus_step_host_ms").filter(pl.col("finished_requests") > 0).median()
                 .alias("corpus_insert_host_ms"),
                 pl.col("tokens").filter(~admit).median().alias("decode_tokens"),
                 pl.col("tokens").filter(admit).median().alias("admit_tokens"))
            .with_columns((pl.col("admitting_ms") / pl.col("total_ms")).alias("admitting_share"),
                          (pl.col("_admit_mean") - pl.col("decode_interval_ms")).alias("admit_extra_ms"))
            .drop("_admit_mean"))


__all__ = ["engine_steps", "admissions", "POINT"]
