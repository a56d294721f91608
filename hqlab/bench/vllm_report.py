"""Reading vLLM benchmark results (benchmarks/vllm_gpu.py: the studies vllm_gpu and vllm_fused of data/results):
ratios within a run, throughput under concurrency, and where a step's milliseconds go. The vllm_gpu and
fusion_benchmark notebooks plot these; docs/vllm.md quotes them; what each committed run gave is stated in its
claims.json (`hqlab.bench.claims`), checked with these readers.

A *run* is one GPU session's engines, its own `none` reference included. Wall times on a shared host drift between
runs (the same `none` decode rate varied 360–600 tok/s between calls an hour apart), so every comparison here is a
ratio inside one run, and summaries are medians of those ratios over runs.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from hqlab.bench import results
from hqlab.config import ConfigError, parse_spec

CUSTOM_CLASS = "lookup:"  # configs run through the host-side custom_class adapter start with this
PROSE = ["chat", "summary", "qa", "quote"]  # the task classes where answers are mostly new text
DOCUMENTS = ["copy", "code", "edit"]  # and where they copy the prompt's document


def family(config: str) -> str:
    """What runs a config inside vLLM: `none`, hqlab on the GPU step, hqlab's host adapter, or vLLM's own."""
    if config == "none":
        return "none"
    if config.startswith("gpu-lookup"):
        return "hqlab GPU step (V2, async)"
    if config.startswith("gpu-fused"):
        return "hqlab fused GPU step (V2, async)"
    if config.startswith("vllm-ngram-gpu"):
        return "vLLM ngram_gpu (V1, async)"
    if config.startswith("vllm-ngram"):
        return "vLLM ngram (V1, sync)"
    if config.startswith("vllm-draft"):
        return "vLLM draft_model (V1, sync)"
    return "hqlab custom_class (V1, sync)"


SHORT_NAMES = {"gpu-lookup": "gpu-lookup", "gpu-fused": "gpu-fused", "lookup": "custom_class", "vllm-ngram": "vLLM ngram",
               "vllm-ngram-gpu": "vLLM ngram_gpu", "vllm-draft": "vLLM draft_model"}


def short_label(config: str) -> str:
    """A config as a chart label: `gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest,graphs=false` ->
    `gpu-lookup 1/32 k=15 earliest graphs=false` (match lengths nmin/nmax where both are given, k, the policy, then
    the other settings)."""
    name, values = parse_spec(config)
    parts = [SHORT_NAMES.get(name, name)]
    if "nmin" in values and "nmax" in values:
        parts.append(f"{values.pop('nmin')}/{values.pop('nmax')}")
    if "k" in values:
        parts.append(f"k={values.pop('k')}")
    if "policy" in values:
        parts.append(values.pop("policy"))
    parts += [f"{key}={value}" for key, value in values.items()]
    return " ".join(parts)


def run_ratios(results: pl.DataFrame) -> pl.DataFrame:
    """Per (run, category, config) at batch 1: median decode tok/s over the class's prompts, its ratio to `none`
    and to the run's custom_class lookup with the same settings (if it ran), tokens/step and step efficiency."""
    alone = results.filter(pl.col("concurrency") == 1) if "concurrency" in results.columns else results
    per = (alone.group_by(["run", "category", "config"], maintain_order=True)
           .agg(pl.col("decode_tok_s").median(), pl.col("tokens_per_step").median(),
                pl.col("step_efficiency").median(), pl.len().alias("prompts"),
                (pl.col("divergence") == "mismatch").sum().alias("mismatches"),
                (pl.col("divergence") == "near-tie").sum().alias("near_ties")))
    none = per.filter(pl.col("config") == "none").select("run", "category", pl.col("decode_tok_s").alias("none"))
    host = (per.filter(pl.col("config").str.starts_with(CUSTOM_CLASS))
            .select("run", "category", pl.col("config").str.strip_prefix(CUSTOM_CLASS).alias("settings"),
                    pl.col("decode_tok_s").alias("custom_class")))
    return (per.join(none, on=["run", "category"], how="left")
            .with_columns((pl.col("decode_tok_s") / pl.col("none")).alias("vs_none"),
                          pl.col("config").str.replace(r"^[a-z\-]+:", "").alias("settings"),
                          pl.col("config").map_elements(family, return_dtype=pl.String).alias("family"))
            .join(host, on=["run", "category", "settings"], how="left")
            .with_columns((pl.col("decode_tok_s") / pl.col("custom_class")).alias("vs_custom_class"))
            .drop("settings"))


def summary(ratios: pl.DataFrame) -> pl.DataFrame:
    """Medians over runs of each (category, config)'s ratios, with the number of runs."""
    return (ratios.group_by(["category", "config", "family"], maintain_order=True)
            .agg(pl.len().alias("runs"), pl.col("vs_none").median(), pl.col("vs_custom_class").median(),
                 pl.col("tokens_per_step").median(), pl.col("step_efficiency").median(),
                 pl.col("decode_tok_s").median(), pl.col("mismatches").sum(), pl.col("near_ties").sum()))


def concurrency(results: pl.DataFrame) -> pl.DataFrame:
    """Per (run, load, config): total throughput of the requests run together, and its ratio to `none` under the
    same load. `load` is "burst" (all submitted at once; results written before it existed) or "sustained"."""
    together = results.filter(pl.col("concurrency") > 1)
    if "load" not in together.columns:
        together = together.with_columns(pl.lit("burst").alias("load"))
    together = together.with_columns(pl.col("load").fill_null("burst"))
    per = together.group_by(["run", "load", "config", "concurrency"], maintain_order=True).agg(
        pl.col("batch_tok_s").first(), pl.col("tokens_per_step").median(),
        (pl.col("divergence") == "mismatch").sum().alias("mismatches"))
    none = per.filter(pl.col("config") == "none").select("run", "load", pl.col("batch_tok_s").alias("none"))
    return per.join(none, on=["run", "load"], how="left").with_columns(
        (pl.col("batch_tok_s") / pl.col("none")).alias("vs_none"),
        pl.col("config").map_elements(family, return_dtype=pl.String).alias("family"))


PARTS = ["execute_model (host)", "sample + verify (host)", "propose (host)", "scheduler, IPC, front end"]


def step_breakdown(phases: pl.DataFrame, steps: pl.DataFrame) -> pl.DataFrame:
    """Milliseconds per decode step, by part, per (run, config) of the profiled runs (`worker.StepTimer`).

    The worker's host time in the model runner's `execute_model` (inputs and the forward's launches), in
    `sample_tokens` less the proposer (sampling, verification, bookkeeping), in the proposer's `propose`, and the
    rest of the step interval the front end saw (engine-core scheduling, inter-process messages, output
    processing, and any wait for the GPU). `gpu_forward_ms` is the forward's GPU span, for comparison. Runs are
    kept apart: the same config name runs different code in different runs (the `git_commit` of the results)."""
    if "run" not in phases.columns:
        phases, steps = phases.with_columns(pl.lit("").alias("run")), steps.with_columns(pl.lit("").alias("run"))
    key = ["run", "config"]
    per_call = phases.group_by([*key, "phase"]).agg(pl.col("host_ms").sum(), pl.col("gpu_ms").sum())
    counts = steps.group_by(key).agg(pl.len().alias("steps"), (pl.col("step_s").mean() * 1e3).alias("step_ms"))
    wide = per_call.pivot(on="phase", index=key, values="host_ms", aggregate_function="first").fill_null(0.0)
    gpu = per_call.filter(pl.col("phase") == "execute_model").select(*key, pl.col("gpu_ms").alias("gpu_total"))
    propose = [c for c in wide.columns if c.startswith("propose")]
    out = (wide.join(counts, on=key).join(gpu, on=key)
           .with_columns(pl.sum_horizontal(propose).alias("_propose") if propose else pl.lit(0.0).alias("_propose"))
           .with_columns((pl.col("execute_model") / pl.col("steps")).alias(PARTS[0]),
                         ((pl.col("sample_tokens") - pl.col("_propose")) / pl.col("steps")).alias(PARTS[1]),
                         (pl.col("_propose") / pl.col("steps")).alias(PARTS[2]),
                         (pl.col("gpu_total") / pl.col("steps")).alias("gpu_forward_ms")))
    out = out.with_columns((pl.col("step_ms") - pl.sum_horizontal(PARTS[:3])).clip(lower_bound=0).alias(PARTS[3]))
    return (out.select(*key, pl.col("config").map_elements(family, return_dtype=pl.String).alias("family"),
                       "step_ms", *PARTS, "gpu_forward_ms", "steps")
            .sort("run", "step_ms"))


def request_step_ms(steps: pl.DataFrame, *, load: str = "alone") -> pl.DataFrame:
    """Median step milliseconds of each request run alone, per (run, config, request): on a host-bound engine the
    spread of these across requests of one config is the host's, not the prompt's (docs/vllm.md, "Host speed")."""
    alone = steps.filter(pl.col("load") == load) if "load" in steps.columns else steps
    return (alone.group_by(["run", "config", "request", "category"], maintain_order=True)
            .agg((pl.col("step_s").median() * 1e3).alias("step_ms"), pl.len().alias("steps"),
                 (pl.col("propose_s").median() * 1e3).alias("host_ms"))
            .with_columns(pl.col("config").map_elements(short_label, return_dtype=pl.String).alias("label")))


def host_level_correlation(per_request: pl.DataFrame, *, min_steps: int = 5) -> pl.DataFrame:
    """Per run: Pearson r between a gpu-lookup request's median speculator host time (`host_ms`, the host's level
    as the speculator met it) and its median step ms, over the requests of `request_step_ms` with at least
    `min_steps` steps (shorter ones give no stable median)."""
    rows = per_request.filter(pl.col("config").str.starts_with("gpu-lookup") & (pl.col("steps") >= min_steps))
    return (rows.group_by("run", maintain_order=True)
            .agg(pl.len().alias("requests"), pl.corr("host_ms", "step_ms").alias("r"),
                 pl.col("host_ms").min().alias("host_ms_min"), pl.col("host_ms").max().alias("host_ms_max"))
            .sort("run"))


def host_probe(results: pl.DataFrame, runs: list[str]) -> pl.DataFrame:
    """Each request run alone in `runs` with its CPU speed probe (`host_unit_ms`: ms of a fixed piece of Python on
    the engine core's CPU, just before and after the request; runs made with the since-removed `--pin-threads`) next
    to its wall time per decode step, 1000 * tokens_per_step / decode_tok_s. Requests without a probe are left
    out."""
    if "host_unit_ms" not in results.columns:
        raise ConfigError("these results have no host_unit_ms column (runs before the CPU speed probe)")
    alone = results.filter(pl.col("run").is_in(runs) & (pl.col("concurrency") == 1)
                           & pl.col("host_unit_ms").is_not_null() & pl.col("host_unit_ms").is_not_nan())
    if alone.is_empty():
        raise ConfigError(f"runs {runs}: no request at batch 1 has a CPU speed probe (host_unit_ms)")
    return alone.select("run", "config", "category", pl.col("prompt_id").alias("request"), "host_unit_ms",
                        (1e3 * pl.col("tokens_per_step") / pl.col("decode_tok_s")).alias("step_ms"),
                        "tokens_per_step",
                        pl.col("config").map_elements(short_label, return_dtype=pl.String).alias("label"))


def probe_correlation(probed: pl.DataFrame) -> pl.DataFrame:
    """Pearson r of step_ms against host_unit_ms (`host_probe` rows) per (run, config), per run, and over all
    rows (`label`/`run` "all"), with the number of requests and each side's median and range."""
    stats = [pl.len().alias("requests"), pl.corr("host_unit_ms", "step_ms").alias("r"),
             *[getattr(pl.col(column), stat)().alias(f"{name}_{stat}")
               for column, name in (("host_unit_ms", "probe"), ("step_ms", "step"))
               for stat in ("min", "median", "max")]]
    per = probed.group_by("run", "label", maintain_order=True).agg(*stats)
    runs = probed.group_by("run", maintain_order=True).agg(*stats).with_columns(pl.lit("all").alias("label"))
    both = probed.select(*stats).with_columns(pl.lit("all").alias("run"), pl.lit("all").alias("label"))
    return pl.concat([per, runs.select(per.columns), both.select(per.columns)])


def cost_model_check(steps: pl.DataFrame, runs: list[str], *, name: str | None = None,
                     host_level: bool = False) -> pl.DataFrame:
    """The step-cost model on one run's (or several adjacent calls') V2 engines at batch 1: each `gpu-lookup`
    config's decode time predicted by a model fitted on the *other* V2 configs' steps (`none` and the other
    widths; `costmodel.holdout_predictions`), pooled per (config, task class). The V1 paths cost differently
    and stay out of the fit. `host_level`: the model prices each request's host level, measured by the
    speculator's own host time (`costmodel.host_levels`; `none` has none and stays out). Returns measured and
    predicted tok/s and the error (measured / predicted - 1), and the model form (`model`)."""
    from hqlab.replay import costmodel

    v2 = steps.filter(pl.col("run").is_in(runs) & (pl.col("load") == "alone")
                      & ((pl.col("config") == "none") | pl.col("config").str.starts_with("gpu-lookup")))
    if v2.filter(pl.col("config") != "none")["config"].n_unique() < 2:
        raise ConfigError(f"runs {runs}: the cost model check needs none and at least two gpu-lookup configs "
                          f"(each is predicted from the others)")
    # a request name is per run: prompts of different calls are different requests
    v2 = v2.with_columns(pl.format("{}/{}", "run", "request").alias("request"))
    held = costmodel.holdout_predictions(v2, host_level=host_level).filter(pl.col("config") != "none")
    return (held.group_by(["config", "category"], maintain_order=True)
            .agg(pl.col("tokens").sum(), pl.col("measured_s").sum(), pl.col("predicted_s").sum())
            .with_columns(pl.lit(name or "+".join(runs)).alias("run"),
                          pl.lit("host level" if host_level else "fixed prices").alias("model"),
                          (pl.col("tokens") / pl.col("measured_s")).alias("measured_tok_s"),
                          (pl.col("tokens") / pl.col("predicted_s")).alias("predicted_tok_s"),
                          (pl.col("measured_s") / pl.col("predicted_s") - 1).alias("error")))


def fused_ratios(results: pl.DataFrame, run: str) -> pl.DataFrame:
    """Per (category, config) of one fused run at batch 1: median decode tok/s over the class's prompts, tokens/step,
    step efficiency, and the ratios the fused issue asks for: to `none`, to the run's best gpu-lookup config and to
    its best vLLM draft-model config (null where the run has none of them)."""
    rows = results.filter((pl.col("run") == run) & (pl.col("concurrency") <= 1))
    if rows.is_empty():
        raise ConfigError(f"run {run!r}: no batch-1 rows (runs here: {sorted(results['run'].unique().to_list())})")
    per = (rows.group_by(["category", "config"], maintain_order=True)
           .agg(pl.col("decode_tok_s").median(), pl.col("tokens_per_step").median(),
                pl.col("step_efficiency").median(), (pl.col("divergence") == "mismatch").sum().alias("mismatches")))

    baselines = {"none": pl.col("config") == "none", "best_gpu_lookup": pl.col("config").str.starts_with("gpu-lookup"),
                 "best_vllm_draft": pl.col("config").str.starts_with("vllm-draft")}
    out = per
    for name, which in baselines.items():  # the fastest config of each kind, per class
        best = per.filter(which).group_by("category").agg(pl.col("decode_tok_s").max().alias(name))
        out = out.join(best, on="category", how="left")
    return out.with_columns(*[(pl.col("decode_tok_s") / pl.col(name)).alias(f"vs_{name}")
                              for name in ("none", "best_gpu_lookup", "best_vllm_draft")])


def _fastest_per_class(repeats: pl.DataFrame) -> pl.DataFrame:
    """(category, config) of each class's fastest config among per-repeat `repeats`: the class median of per-prompt
    median decode tok/s, as `fused_ratios` ranks them."""
    return (repeats.group_by("category", "config", "prompt_id").agg(pl.col("decode_tok_s").median())
            .group_by("category", "config").agg(pl.col("decode_tok_s").median())
            .sort("decode_tok_s", descending=True).unique("category", keep="first").select("category", "config"))


def round_ratios(repeats: pl.DataFrame, run: str, config: str, *, against: str = "gpu-lookup") -> pl.DataFrame:
    """Per task class of one interleaved run: `config`'s decode tok/s over the class's fastest config whose name
    starts with `against` (fastest as `fused_ratios` picks it: the class median of per-prompt medians), request by
    request in the same round
    (`repeats`: the `.repeats` frame `benchmarks/vllm_gpu.py finish` writes). The median of these paired ratios, and
    their low and high, show how far the ratio of medians can be trusted where a request decodes in a few dozen ms."""
    rows = repeats.filter(pl.col("run") == run)
    if rows.filter(pl.col("config") == config).is_empty():
        raise ConfigError(f"run {run!r} has no per-repeat rows of {config!r}")
    rivals = _fastest_per_class(rows.filter(pl.col("config").str.starts_with(against) & (pl.col("config") != config)))
    if rivals.is_empty():
        raise ConfigError(f"run {run!r} has no config starting with {against!r} to compare {config!r} with")
    theirs = rows.join(rivals.select("category", "config"), on=["category", "config"])
    mine = rows.filter(pl.col("config") == config)
    paired = mine.join(theirs, on=["prompt_id", "repeat"], suffix="_against")
    return (paired.with_columns((pl.col("decode_tok_s") / pl.col("decode_tok_s_against")).alias("ratio"))
            .group_by("category", maintain_order=True)
            .agg(pl.col("config_against").first().alias("against"), pl.len().alias("pairs"),
                 pl.col("ratio").median().alias("median"), pl.col("ratio").min().alias("low"),
                 pl.col("ratio").max().alias("high")))


def round_step_ms(repeats: pl.DataFrame, run: str) -> pl.DataFrame:
    """Per (category, config) of one run at batch 1: the median over every round's requests of the ms a decode step
    took (decode time ÷ (steps − 1): the first step is the prompt's), and that minus the class's fastest gpu-lookup
    config's (`over_lookup_ms`; fastest by decode rate, as `round_ratios` picks it). The step records keep one
    round's steps; this uses all rounds, so it is the price to compare configs by."""
    rows = repeats.filter((pl.col("run") == run) & (pl.col("steps") > 1))
    if rows.is_empty():
        raise ConfigError(f"run {run!r} has no per-repeat rows")
    per = (rows.with_columns((1e3 * pl.col("decode_s") / (pl.col("steps") - 1)).alias("step_ms"))
           .group_by("category", "config", maintain_order=True)
           .agg(pl.col("step_ms").median(), pl.col("steps").median(), pl.len().alias("requests")))
    fastest = _fastest_per_class(rows.filter(pl.col("config").str.starts_with("gpu-lookup")))
    lookup = per.join(fastest, on=["category", "config"]).select("category", pl.col("step_ms").alias("lookup_ms"))
    return (per.join(lookup, on="category", how="left")
            .with_columns((pl.col("step_ms") - pl.col("lookup_ms")).alias("over_lookup_ms")).drop("lookup_ms"))


def best_fused(results: pl.DataFrame, repeats: pl.DataFrame, run: str) -> pl.DataFrame:
    """The fused issue's table for one run at batch 1: per task class the fastest gpu-fused config, its decode tok/s
    over the fastest gpu-lookup config's (ratio of medians, as `fused_ratios`; and paired round by round, as
    `round_ratios`: median, low, high), over `none` and vLLM's draft model, and both configs' tokens/step, median
    time to the first token (ms) and step efficiency."""
    table = fused_ratios(results, run)
    rows = results.filter((pl.col("run") == run) & (pl.col("concurrency") <= 1))
    first = rows.group_by("category", "config").agg((1e3 * pl.col("ttft_s").median()).alias("ttft_ms"))
    table = table.join(first, on=["category", "config"], how="left")

    def fastest(prefix: str) -> pl.DataFrame:
        return (table.filter(pl.col("config").str.starts_with(prefix))
                .sort("decode_tok_s", descending=True).unique("category", keep="first"))

    fused = fastest("gpu-fused")
    if fused.is_empty():
        raise ConfigError(f"run {run!r} has no batch-1 rows of a gpu-fused config")
    lookup = fastest("gpu-lookup").select(
        "category", pl.col("config").alias("lookup"), pl.col("tokens_per_step").alias("lookup_tokens_per_step"),
        pl.col("ttft_ms").alias("lookup_ttft_ms"), pl.col("step_efficiency").alias("lookup_step_efficiency"))
    paired = pl.concat([round_ratios(repeats, run, c).with_columns(pl.lit(c).alias("config"))
                        for c in fused["config"].unique(maintain_order=True)])
    order = pl.Enum(PROSE + DOCUMENTS)
    return (fused.join(lookup, on="category").join(paired.drop("against"), on=["category", "config"])
            .select("category", "config", "lookup", "vs_best_gpu_lookup", pl.col("median").alias("paired_median"),
                    pl.col("low").alias("paired_low"), pl.col("high").alias("paired_high"), "vs_none",
                    "vs_best_vllm_draft", "tokens_per_step", "lookup_tokens_per_step", "ttft_ms", "lookup_ttft_ms",
                    "step_efficiency", "lookup_step_efficiency", "mismatches")
            .sort(pl.col("category").cast(order, strict=False)))


def fused_ratios_across(results: pl.DataFrame, configs: dict[str, str]) -> pl.DataFrame:
    """`fused_ratios` of one gpu-fused config per run (`configs`: run -> config), stacked with a `run` column:
    how the same settings fared in runs taken at different times or in different ways (sequential, interleaved)."""
    parts = []
    for run, config in configs.items():
        table = fused_ratios(results, run)
        if table.filter(pl.col("config") == config).is_empty():
            raise ConfigError(f"run {run!r} has no config {config!r} at batch 1 (its configs: "
                              f"{sorted(table['config'].unique().to_list())})")
        parts.append(table.filter(pl.col("config") == config).with_columns(pl.lit(run).alias("run")))
    return pl.concat(parts, how="diagonal_relaxed")


def speculator_host_ms(steps: pl.DataFrame, runs: list[str]) -> pl.DataFrame:
    """Per (run, category, config) at batch 1: the median of the speculator's own host time per step (ms) and of
    the step. For one config's code the first is the gauge of the host's speed that request met (docs/vllm.md,
    "Pricing the host's level"); `none` proposes nothing and is left out."""
    alone = steps.filter(pl.col("run").is_in(runs) & (pl.col("load") == "alone") & (pl.col("config") != "none"))
    if alone.is_empty():
        raise ConfigError(f"runs {runs}: no batch-1 step records of a speculating config")
    return (alone.group_by(["run", "category", "config"], maintain_order=True)
            .agg((1e3 * pl.col("propose_s").median()).alias("speculator_host_ms"),
                 (1e3 * pl.col("step_s").median()).alias("step_ms"), pl.len().alias("steps"))
            .sort("run", "category", "config"))


def step_ms_by_passes(steps: pl.DataFrame, run: str) -> pl.DataFrame:
    """What a step costs by the drafter passes it ran, per (category, config) of one run at batch 1: the share of
    steps and the median step ms for each `drafter_passes` value (-1: a config without a drafter)."""
    alone = steps.filter((pl.col("run") == run) & (pl.col("load") == "alone"))
    if alone.is_empty():
        raise ConfigError(f"run {run!r}: no batch-1 step records")
    return (alone.group_by(["category", "config", "drafter_passes"], maintain_order=True)
            .agg(pl.len().alias("steps"), (1e3 * pl.col("step_s").median()).alias("step_ms"))
            .with_columns((pl.col("steps") / pl.col("steps").sum().over(["category", "config"])).alias("share"))
            .sort("category", "config", "drafter_passes"))


def burst_blocks(steps: pl.DataFrame, run: str) -> pl.DataFrame:
    """Per adaptive gpu-fused config of one run and request of its burst: the share of the request's steps that
    proposed more than the short block (`draft_block` tokens: the long block was on) in the burst and alone. The
    proposal is the block clipped to what lookup and drafter filled, so the share counts long steps that filled
    more than the short block: the same measure in both loads. Configs with `schedule=long` or `short` are left out
    (every block is k, or the short block, by setting)."""
    from hqlab.engines.vllm.gpu_fused import recorded_rules

    mine = steps.filter((pl.col("run") == run) & pl.col("config").str.starts_with("gpu-fused"))
    rows = []
    for config in mine["config"].unique(maintain_order=True).to_list():
        settings = recorded_rules(config)  # the spec as it ran, retired keys included
        if settings.schedule != "adaptive":
            continue
        of = mine.filter(pl.col("config") == config).with_columns(
            (pl.col("proposed").list.len() > settings.draft_block).alias("long"))
        burst = of.filter(pl.col("load") == "burst")
        for request in burst["request"].unique(maintain_order=True).to_list():
            there = burst.filter(pl.col("request") == request)
            alone = of.filter((pl.col("load") == "alone") & (pl.col("request") == request))
            rows.append({"config": config, "request": request, "steps": there.height,
                         "long_share_burst": float(there["long"].mean()),
                         "long_share_alone": float(alone["long"].mean()) if alone.height else None})
    schema = {"config": pl.String, "request": pl.String, "steps": pl.Int64, "long_share_burst": pl.Float64,
              "long_share_alone": pl.Float64}
    return pl.DataFrame(rows, schema=schema)


# What a step decided: a rerun whose records agree on these at every step made the same run, whatever its timing.
STEP_DECISIONS = ("context_len", "verify_len", "proposed", "sources", "match_len", "accepted", "emitted", "block",
                  "batch", "drafter_passes")


def same_steps(steps: pl.DataFrame, run: str, rerun: str, config: str) -> bool:
    """Whether `rerun`'s step records of `config` repeat `run`'s step for step: the same requests, loads and steps,
    and every decision (`STEP_DECISIONS`: history length, verify width, proposal and its sources, acceptance, block,
    batch, drafter passes) equal. False where either run lacks the config."""
    def of(name: str) -> pl.DataFrame:
        return (steps.filter((pl.col("run") == name) & (pl.col("config") == config))
                .select("request", "load", "step", *STEP_DECISIONS).sort("request", "load", "step"))

    a, b = of(run), of(rerun)
    return a.height > 0 and a.equals(b)


def replay_rows(replayed: pl.DataFrame, run: str, steps: pl.DataFrame | None = None,
                rerun: str | None = None) -> pl.DataFrame:
    """The lab's replay of `run` (`benchmarks/vllm_gpu.py replay`'s frame: per fused (config, prompt) the replay's
    tokens/step and `difference`, vLLM's ÷ the replay's - 1), with a `replay_run` column. With `rerun` (and the step
    records `steps`), a config whose replay is off in `run` takes `rerun`'s rows where `rerun` ran it again with the
    same decisions at every step (`same_steps`): a rerun whose records carry the drafter's whole block stands in for
    a config whose records carried its head token only."""
    mine = replayed.filter(pl.col("run") == run).with_columns(pl.col("run").alias("replay_run"))
    if rerun is None:
        return mine
    if steps is None:
        raise ConfigError(f"rerun={rerun!r}: give the step records too (steps=...), to check it repeated {run!r}")
    if rerun not in set(replayed["run"]):
        raise ConfigError(f"rerun={rerun!r}: no replay of that run (replayed runs: {sorted(set(replayed['run']))})")
    for config in mine["config"].unique(maintain_order=True).to_list():
        other = replayed.filter((pl.col("run") == rerun) & (pl.col("config") == config))
        off = (mine.filter(pl.col("config") == config)["difference"] != 0).any()
        if off and other.height and same_steps(steps, run, config=config, rerun=rerun):
            mine = pl.concat([mine.filter(pl.col("config") != config),
                              other.with_columns(pl.col("run").alias("replay_run"))], how="diagonal_relaxed")
    return mine


def fused_vs_lookup(results: pl.DataFrame, repeats: pl.DataFrame, run: str, configs: list[str]) -> pl.DataFrame:
    """Per task class, each of `configs` (gpu-fused configs of `run`) over the class's fastest gpu-lookup config two
    ways: the ratio of class medians (`how` = "medians", as `fused_ratios`) and the median of the per-request ratios
    paired round by round (`how` = "paired", as `round_ratios`)."""
    ratios = fused_ratios(results, run)
    fused = ratios.filter(pl.col("config").is_in(configs))
    missing = sorted(set(configs) - set(fused["config"]))
    if missing:
        raise ConfigError(f"run {run!r} has no batch-1 rows of {missing}")
    paired = pl.concat([round_ratios(repeats, run, c).select("category", pl.col("median").alias("ratio"),
                                                             pl.lit(c).alias("config"))
                        for c in fused["config"].unique(maintain_order=True)])
    return pl.concat([
        fused.select("category", "config", pl.col("vs_best_gpu_lookup").alias("ratio"), pl.lit("medians").alias("how")),
        paired.select("category", "config", "ratio", pl.lit("paired").alias("how")),
    ])


def run_figure(study: str, run: str, root: str | Path | None = None) -> str:
    """The figure name of one run of a study: `<study>_<card>_<run>.svg` (the fusion_benchmark notebook writes it;
    docs embed it by that name)."""
    return f"{study}_{results.run_info(study, run, root)['card']}_{run}.svg"


GPU_PHASES = ["target forward", "propose", "sample + accept"]


def gpu_phases(phases: pl.DataFrame, run: str, *, category: str | None = None) -> pl.DataFrame:
    """GPU ms per decode step by phase for each config of one profiled run (`bench --profile`: CUDA events around
    vLLM's worker calls and the speculator's `propose`), medians over the steps, optionally of one task class: the
    target's forward (`execute_model`), the drafting step (`propose`) and the rest of sampling (`sample + accept`).
    vLLM calls the speculator inside `sample_tokens`, so its span is taken out of that phase's."""
    rows = phases.filter(pl.col("run") == run)
    if category is not None:
        rows = rows.filter(pl.col("category") == category)
    if rows.is_empty():
        raise ConfigError(f"run {run!r} has no profiled phases" + (f" of class {category!r}" if category else ""))
    names = {"execute_model": "target forward", "sample_tokens": "sample + accept", "propose (speculator)": "propose",
             "propose (drafter)": "propose"}
    wide = (rows.with_columns(pl.col("phase").replace(names))
            .group_by("config", "phase", maintain_order=True).agg(pl.col("gpu_ms").median())
            .pivot("phase", index="config", values="gpu_ms"))
    for part in GPU_PHASES:
        if part not in wide.columns:
            wide = wide.with_columns(pl.lit(0.0).alias(part))
    return (wide.fill_null(0.0)
            .with_columns((pl.col("sample + accept") - pl.col("propose")).clip(lower_bound=0.0)
                          .alias("sample + accept"))
            .with_columns(pl.sum_horizontal(GPU_PHASES).alias("gpu_ms"))
            .select("config", *GPU_PHASES, "gpu_ms").sort("propose"))


# what a kernel of a drafting step is, by its name (the profiler table of
# experiments/drafting_step_profile/fused_pass_kernels.py), first match
KERNEL_PARTS = [("Triton drafter layers (K1-K4)", ("_norm_qkv_rope_cache", "_linear_residual", "_norm_gate_up_silu")),
                ("KV cache write", ("reshape_and_cache",)),  # before attention: vLLM names it ..._flash_kernel
                ("attention", ("flash", "Flash", "_decode_attention")),
                ("matrix products", ("nvjet", "gemm", "Gemm", "cublas", "splitKreduce")),
                ("fused elementwise (norms, rotary, SiLU)", ("triton_",))]


def pass_kernel_parts(profile: dict) -> pl.DataFrame:
    """Per config of a `fused_pass_kernels` profile (its JSON): µs of kernels per drafting step by part (attention,
    matrix products, KV cache write, the fused elementwise kernels, the rest) and kernel launches per step."""
    rows = []
    for config, table in profile.get("kernels", {}).items():
        for kernel in table["rows"]:
            part = next((name for name, keys in KERNEL_PARTS if any(k in kernel["name"] for k in keys)), "other")
            rows.append({"config": config, "part": part, "us": float(kernel["us_per_step"]),
                         "kernels": int(kernel["calls"])})
    if not rows:
        raise ConfigError("the profile has no kernel tables (experiments/drafting_step_profile/fused_pass_kernels.py "
                          "writes them)")
    return (pl.DataFrame(rows).group_by("config", "part", maintain_order=True)
            .agg(pl.col("us").sum(), pl.col("kernels").sum()))


# the variants of experiments/drafting_step_profile/fused_pass_kernels.py --prefill, by what they are
PREFILL_LABELS = {"chunk1024": "eager, one call (served so far)", "chunk64": "eager, 64-token calls",
                  "chunk1024-nocompile": "eager, no torch.compile", "graph64": "graph, 64-token passes"}


def prefill_times(profile: dict) -> pl.DataFrame:
    """The drafter's prompt prefill of a `fused_pass_kernels --prefill` run (its JSON): one row per (variant, prompt
    length, call) with `ms` of wall time, `call` "warm" (the median of the repeats after a warm-up, with `ms_min`,
    `ms_max`) or "first" (the first call at a length not seen before, as a served request meets it), and for first
    calls whether the drafter's next-token argmax after the prompt equals the first variant's (`same_argmax`)."""
    rows = [{"variant": r["variant"], "label": PREFILL_LABELS.get(r["variant"], r["variant"]),
             "prompt": int(r["prompt"]), "call": "warm", "ms": float(r["ms"]), "ms_min": float(r["ms_min"]),
             "ms_max": float(r["ms_max"]), "same_argmax": None} for r in profile.get("rows", []) if "variant" in r]
    rows += [{"variant": r["variant"], "label": PREFILL_LABELS.get(r["variant"], r["variant"]),
              "prompt": int(r["prompt"]), "call": "first", "ms": float(r["first_call_ms"]), "ms_min": None,
              "ms_max": None, "same_argmax": bool(r["same_argmax_as_first"])} for r in profile.get("fresh", [])]
    if not rows:
        raise ConfigError("the profile has no prefill rows by variant "
                          "(experiments/drafting_step_profile/fused_pass_kernels.py --prefill writes them)")
    return pl.DataFrame(rows).sort("call", "variant", "prompt", descending=[True, False, False],
                                   maintain_order=True)


def tile_sweep(sweep: dict) -> pl.DataFrame:
    """Per (kernel, rows) of a tile sweep (the JSON of experiments/drafter_kernel_tiles/drafter_layer_tiles.py): µs per
    launch of the product alone in cuBLAS (or, for the attention, vLLM's FlashAttention), of the tiles the table held
    when the sweep ran, and of the best candidate within the sweep's error bound; candidates tried and how many failed
    or missed. The attention's rows are its requests, `q_len` its queries per request (16 unless the sweep says; the
    sweep keys other query counts `attention@NqQ`)."""
    rows = []
    for ref in sweep.get("cublas", []):
        kernel, n, q = ref["kernel"], ref["rows"], ref.get("q_len", 16 if ref["kernel"] == "attention" else None)
        tried = [r for r in sweep.get("rows", []) if r["kernel"] == kernel and r["rows"] == n
                 and r.get("q_len", q) == q]
        best = (sweep.get("best") or {}).get(f"{kernel}@{n}" if q in (None, 16) else f"{kernel}@{n}q{q}")
        rows.append({"kernel": kernel, "rows": int(n), "q_len": q,
                     "reference_us": ref.get("us", ref.get("flash_us")),
                     "reference": "FlashAttention 3" if kernel == "attention" else "cuBLAS product",
                     "table_us": float(ref["table_us"]), "best_us": float(best["us"]) if best else None,
                     "candidates": len(tried), "failed": sum("failed" in r for r in tried)})
    if not rows:
        raise ConfigError("the sweep has no reference rows (experiments/drafter_kernel_tiles/drafter_layer_tiles.py "
                          "writes them)")
    return pl.DataFrame(rows)


def load(study: str, runs: list[str] | None = None, root: str | Path | None = None) -> dict[str, pl.DataFrame]:
    """The rows ("results"), step records, repeats and, where runs were profiled, phases and profiled steps of a
    study's runs (`runs`, or all that have rows), stacked; an empty frame for a kind no chosen run has."""
    out = {"results": results.load(study, runs, root=root)}
    for part in ("phases", "profile_steps", "steps", "repeats"):
        try:
            out[part] = results.load(study, runs, part, having=True, root=root)
        except results.MissingRun:  # no chosen run has this table
            out[part] = pl.DataFrame()
    return out


__all__ = ["short_label", "run_ratios", "summary", "concurrency", "step_breakdown", "request_step_ms",
           "cost_model_check", "host_probe", "probe_correlation", "load", "family", "PARTS", "fused_ratios",
           "step_ms_by_passes", "host_level_correlation", "fused_ratios_across", "speculator_host_ms", "round_ratios",
           "best_fused", "fused_vs_lookup", "round_step_ms", "gpu_phases", "GPU_PHASES", "pass_kernel_parts",
           "KERNEL_PARTS", "tile_sweep", "burst_blocks", "same_steps", "replay_rows", "run_figure", "STEP_DECISIONS",
           "PROSE", "DOCUMENTS"]
