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


# the timer's phase names -> this module's column stems (several runner methods may time one thing)
PHASE_STEMS = {"execute_model": "execute", "sample_tokens": "sample", "propose (speculator)": "propose",
               "propose (drafter)": "propose", "corpus_step (speculator)": "corpus_step",
               "run_fullgraph (cudagraph_manager)": "forward", "run_pw_graph (cudagraph_manager)": "forward",
               "sample": "sampler"}
TIMED = ("sample", "propose", "corpus_step", "forward", "sampler")  # the phases besides execute_model, 0 where absent


def engine_steps(phases: pl.DataFrame, keys: list[str] = POINT) -> pl.DataFrame:
    """One row per engine step of every point (`keys` name a point): its interval (ms), the host and GPU ms of
    `execute_model` and of each phase in TIMED (0 where a step had none: `sample_host_ms` is `sample_tokens`,
    `sampler_*` the logits and (rejection) sampler inside it, `forward_*` the forward's graph replay inside
    `execute_model`, absent where it ran eagerly), and what the scheduler gave it (tokens, requests, new_requests,
    finished_requests)."""
    need = {*keys, "phase", "host_start_ms", "host_ms", "gpu_ms", "tokens", "new_requests"}
    missing = need - set(phases.columns)
    if missing:
        raise ValueError(f"not StepTimer rows with step facts (benchmarks/vllm_corpus.py --profile): missing "
                         f"{sorted(missing)}")
    unknown = set(phases["phase"].unique()) - set(PHASE_STEMS)
    if unknown:
        raise ValueError(f"phases the step table does not know: {sorted(unknown)} (hqlab.engines.vllm.worker.StepTimer"
                         f" names {sorted(PHASE_STEMS)})")
    calls = (phases.sort([*keys, "host_start_ms"])
             .with_columns((pl.col("phase") == "execute_model").cast(pl.Int32).cum_sum().over(keys).alias("step"),
                           pl.col("phase").replace_strict(PHASE_STEMS).alias("stem")))
    if calls.filter(pl.col("step") == 0).height:
        raise ValueError("a point's first timed call is not execute_model: its calls cannot be split into steps")
    by_phase = (calls.filter(pl.col("stem") != "execute").group_by([*keys, "step", "stem"])
                .agg(pl.col("host_ms").sum().alias("host"), pl.col("gpu_ms").sum().alias("gpu")))
    wide = calls.filter(pl.col("phase") == "execute_model").select(
        *keys, "step", "host_start_ms", pl.col("host_ms").alias("execute_host_ms"),
        pl.col("gpu_ms").alias("execute_gpu_ms"), "tokens", "requests", "new_requests", "finished_requests")
    for stem in TIMED:
        part = by_phase.filter(pl.col("stem") == stem).select(
            *keys, "step", pl.col("host").alias(f"{stem}_host_ms"), pl.col("gpu").alias(f"{stem}_gpu_ms"))
        wide = wide.join(part, on=[*keys, "step"], how="left")
    columns = [f"{stem}_{side}_ms" for stem in TIMED for side in ("host", "gpu")]
    return (wide.sort([*keys, "step"])
            .with_columns((pl.col("host_start_ms").shift(-1).over(keys) - pl.col("host_start_ms"))
                          .alias("interval_ms"), pl.col(columns).fill_null(0.0))
            .select(*keys, "step", "interval_ms", "execute_host_ms", "execute_gpu_ms", *columns, "tokens", "requests",
                    "new_requests", "finished_requests"))


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


# A step's time split twice, so that each split sums to the step: the host's timeline (the worker's calls in order,
# and what the engine core did between them) and the GPU's (spans of the same calls; a span counts the GPU from
# the call's first queued work to its last, idle gaps inside it included).
HOST_PARTS = {"execute_model (host)": pl.col("execute_host_ms"),
              "sampler (host)": pl.col("sampler_host_ms"),
              "speculator (host)": pl.col("propose_host_ms"),
              "bookkeeping (host)": pl.col("sample_host_ms") - pl.col("sampler_host_ms") - pl.col("propose_host_ms"),
              "engine core (host)": pl.col("interval_ms") - pl.col("execute_host_ms") - pl.col("sample_host_ms")}
_FORWARD = pl.when(pl.col("forward_gpu_ms") > 0).then(pl.col("forward_gpu_ms")).otherwise(pl.col("execute_gpu_ms"))
GPU_PARTS = {"forward (GPU)": _FORWARD,
             "sampler (GPU)": pl.col("sampler_gpu_ms"),
             "speculator (GPU)": pl.col("propose_gpu_ms"),
             "other (GPU)": pl.col("execute_gpu_ms") - _FORWARD + pl.col("sample_gpu_ms") - pl.col("sampler_gpu_ms")
             - pl.col("propose_gpu_ms"),
             "idle (GPU)": (pl.col("interval_ms") - pl.col("execute_gpu_ms") - pl.col("sample_gpu_ms")).clip(0.0)}


def step_parts(steps: pl.DataFrame, keys: list[str], load: str | None = None) -> pl.DataFrame:
    """Mean ms a step spends in each part (HOST_PARTS, GPU_PARTS), per group of `keys`, over the steps that have
    an interval; with `load` (a column of the group: requests in flight) only the steps that ran that many requests
    (the point's steady state, without its ramp-up and drain). Long: one row per (group, timeline, part) with `ms`,
    the group's `interval_ms` (its mean step) and `steps` (those averaged; `all_steps` before the load filter).
    The forward is the graph replay's span, or `execute_model`'s where every step ran it eagerly."""
    timed = steps.filter(pl.col("interval_ms").is_not_null())
    counted = timed.group_by(keys).agg(pl.len().alias("all_steps"))
    if load is not None:
        timed = timed.filter(pl.col("requests") == pl.col(load))
    parts = {**HOST_PARTS, **GPU_PARTS}
    wide = (timed.group_by(keys, maintain_order=True)
            .agg(pl.len().alias("steps"), pl.col("interval_ms").mean(),
                 *[expr.mean().alias(name) for name, expr in parts.items()])
            .join(counted, on=keys))
    return (wide.unpivot(index=[*keys, "steps", "all_steps", "interval_ms"], on=list(parts), variable_name="part",
                         value_name="ms")
            .with_columns(pl.when(pl.col("part").is_in(list(HOST_PARTS))).then(pl.lit("host"))
                          .otherwise(pl.lit("GPU")).alias("timeline")))


__all__ = ["engine_steps", "admissions", "step_parts", "POINT", "PHASE_STEMS", "TIMED", "HOST_PARTS",
           "GPU_PARTS"]
