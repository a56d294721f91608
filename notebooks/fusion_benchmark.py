# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python (hqlab)
#     language: python
#     name: hqlab
# ---

# %% [markdown]
# # Lookup and model drafter fused: where they stand
#
# Two benchmarks of the fusion of the suffix-match lookup with a model drafter (target Qwen2.5-Coder-1.5B, drafter
# Qwen2.5-Coder-0.5B, the labd task suite, greedy, every output checked against the engine's own output without
# speculation):
#
# - **the HF engine** (`benchmarks/bench_fusion.py`): tokens per step, wall-time speedup and where a step's time
#   goes, one request at a time and four at once. `rerun=True` runs it here first (minutes on a GPU, long on a CPU).
# - **inside vLLM's GPU step** (`gpu-fused`, `benchmarks/vllm_gpu.py`, the committed H200 runs): the fused configs of
#   one run (`run`) against `none`, the GPU lookup and vLLM's own draft model in the same run, the burst of four,
#   the lab's replay of every step, and what a step costs.
#
# Change `run` (and `fused_configs`) to look at another run of the study vllm_fused (data/results/vllm_fused/);
# docs/vllm.md tells the runs apart.

# %% tags=["parameters"]
tags = ["h200"]  # HF-engine runs to plot: data/results/fusion/<tag>/
rerun = False
target = "qwen2.5-coder-1.5b"
drafter = "qwen2.5-coder-0.5b"
device = "auto"
doc_tokens = 1500
new_tokens = 160
figures_dir = "figures"
results_dir = "data/results"  # the results folder a rerun writes to
published_dir = "data/results"  # the results folder committed runs are read from when not rerunning
# gpu-fused inside vLLM: the committed runs of the study vllm_fused (a rerun above does not touch them)
run = "fn2"  # the run to plot; its figure is vllm_fused_<card>_<run>.svg
# a later run that repeated a config of `run` step for step, whose replay stands in for that config's ("": none);
# fn3a's records carry the adaptive config's whole drafted block, fn2's its first token only
replay_rerun = "fn3a"
# the fused configs to draw against the lookup, with their labels (those timed in the run's interleaved rounds)
fused_configs = {
    "gpu-fused:k=31,draft_block=1,nmax=32,policy=earliest,compile=true,schedule=long,nmin_tail=1,compile_rule=true,"
    "device_skip=true,layers=triton,attention=triton": "k=31 device skip, Triton",
    "gpu-fused:k=15,draft_block=1,nmax=32,policy=earliest,compile=true,schedule=long,nmin_tail=1,compile_rule=true,"
    "layers=triton,attention=triton": "k=15 one pass, Triton",
}
profiled_run = "fn1"  # the latest run with every step's phases timed on the GPU (`bench --profile`)
tile_sweep_run = "t4"  # a run of the study drafter_layer_tiles (experiments/drafter_kernel_tiles/)

# %%
import json
from pathlib import Path

import altair as alt
import polars as pl

from hqlab import bench, plots
from hqlab.bench import results, vllm_report
from hqlab.bench.suites import fusion_benchmark

alt.renderers.enable("svg")
pl.Config.set_tbl_width_chars(160)
pl.Config.set_tbl_rows(60)
pl.Config.set_fmt_str_lengths(100)
figures = Path(figures_dir)
root = results_dir if rerun else published_dir
if rerun:  # what benchmarks/bench_fusion.py runs
    for tag in tags:
        fusion_benchmark(tag, root, target=target, drafter=drafter, device=device, doc_tokens=doc_tokens,
                         new_tokens=new_tokens)


def short(frame: pl.DataFrame) -> pl.DataFrame:
    """Config labels without the drafter's model/dtype/device keys."""
    return frame.with_columns(pl.col("config").str.replace(r",model=[^,]+,dtype=[^,]+,device=\w+", ""))


def label(frame: pl.DataFrame) -> pl.DataFrame:
    """vLLM configs as their `fused_configs` label, or `vllm_report.short_label`."""
    name = pl.col("config").map_elements(lambda c: fused_configs.get(c) or vllm_report.short_label(c),
                                         return_dtype=pl.String)
    return frame.with_columns(name)


# %% [markdown]
# ## The HF engine, one request at a time: tokens per step, speedup, and where the time goes
#
# Medians per task class. `propose` is the drafter's forward passes (and the lookup), `verify` the target's.

# %%
for tag in tags:
    live = short(results.load("fusion", tag, root=root))
    print(tag, "|", live["machine"][0], "|", live["model"][0], "drafted by", live["drafter"][0])
    per = live.group_by(["category", "config"], maintain_order=True).agg(
        pl.col("tokens_per_step").median(), pl.col("speedup_e2e").median(), pl.col("decode_tok_s").median(),
        pl.col("propose_ms_per_step").median().alias("propose"), pl.col("verify_ms_per_step").median().alias("verify"),
        (pl.col("divergence") != "mismatch").all().alias("lossless"))
    display(per)  # noqa: F821
    names = bench.fusion_figure_names(tag)
    plots.save(plots.grouped_bars(per, "category", "tokens_per_step", "config", rule_at=1.0,
                                  y_title="tokens per verify step"), figures / names["tps"])
    plots.save(plots.grouped_bars(per, "category", "speedup_e2e", "config", rule_at=1.0,
                                  y_title="wall-time speedup over no speculation"), figures / names["speedup"])
    plots.save(plots.stacked_time(per.select("category", "config", "propose", "verify"), "config",
                                  ["propose", "verify"], facet="category"), figures / names["time"])

# %% [markdown]
# ## The HF engine, four concurrent requests (copy, summary, code, qa): per-request vs unanimous block length

# %%
for tag in tags:
    if "batch.parquet" not in results.run_info("fusion", tag, root)["files"]:
        continue
    batch = short(results.load("fusion", tag, "batch", root=root))
    display(batch.select("config", "prompt_id", "tokens_per_step", "mean_block", "long_share",  # noqa: F821
                         "batch_tok_s", "divergence", "divergence_margin"))
    plots.save(plots.grouped_bars(batch, "prompt_id", "tokens_per_step", "config",
                                  y_title="tokens per verify step, 4 concurrent requests"),
               figures / bench.fusion_figure_names(tag)["batch"])

# %% [markdown]
# ## Inside vLLM's GPU step: the fused configs against the fastest lookup
#
# `gpu-fused` runs the lookup and the Qwen2 drafter fused per position inside vLLM's model runner V2 (asynchronous
# scheduling, the drafting step replayed from a CUDA graph; `hqlab.engines.vllm.gpu_fused`). A run's engines
# alternate prompt by prompt in interleaved rounds (`--interleave`), so a ratio compares requests seconds apart.
# The table (`vllm_report.best_fused`): per task class the fastest fused config, its decode rate over the
# fastest gpu-lookup config's (ratio of class medians; paired round by round: median, lowest, highest), over
# `none` and over vLLM's draft model (the same 0.5B drafting k = 7 tokens), tokens per step, time to the first
# token and step efficiency.

# %%
data = vllm_report.load("vllm_fused")
here = data["results"].filter(pl.col("run") == run)
print(here["machine"][0], "|", here["model"][0], here["dtype"][0], "| run", run, "| code", here["git_commit"][0],
      "| lossless:", (here["divergence"] != "mismatch").all())
label(vllm_report.best_fused(data["results"], data["repeats"], run)).with_columns(
    pl.col("lookup").map_elements(vllm_report.short_label, return_dtype=pl.String))

# %% [markdown]
# Each fused config of `fused_configs` over the fastest lookup of each class, both ways: the ratio of class medians
# and, paired round by round, the median of the per-request ratios (a document request decodes its 256 tokens in
# under ten steps, tens of ms, so one slow step moves its rate). The line is the bar for the documents,
# 0.95.

# %%
classes = pl.Enum(["copy", "code", "edit", "quote", "summary", "qa", "chat"])
bars = (vllm_report.fused_vs_lookup(data["results"], data["repeats"], run, list(fused_configs))
        .with_columns(pl.format("{}, {}", pl.col("config").replace_strict(fused_configs), "how")
                      .alias("fused config, ratio"))
        .sort(pl.col("category").cast(classes), "fused config, ratio"))
chart = plots.grouped_bars(bars, "category", "ratio", "fused config, ratio",
                           y_title=f"gpu-fused ÷ fastest gpu-lookup, run {run}", rule_at=0.95)
plots.save(chart, figures / vllm_report.run_figure("vllm_fused", run))
chart

# %% [markdown]
# ## Four requests at once
#
# The burst of four (`--burst`: the copy request beside prose ones where the run mixed them): the burst's total
# decode rate over `none`'s under the same load, and each request's tokens per step in the burst and alone.
# Where a fused config's schedule is adaptive (the long block only while a copy is in progress), the share of each
# request's steps that verified the long block, in the burst and alone (`vllm_report.burst_blocks`): the copy
# request should keep its long block, its prose neighbours their short one.

# %%
label(vllm_report.concurrency(here))

# %%
label(here.filter(pl.col("config").str.starts_with("gpu-"))
      .group_by("config", "prompt_id", "load").agg(pl.col("tokens_per_step").median())
      .pivot("load", index=["config", "prompt_id"], values="tokens_per_step")
      .filter(pl.col("burst").is_not_null()).sort("config", "prompt_id"))

# %%
label(vllm_report.burst_blocks(data["steps"], run))

# %% [markdown]
# ## The lab's replay of every step
#
# `benchmarks/vllm_gpu.py replay` runs the lab's reference rules (lookup, fusion, schedule, verify) over each fused
# request's own outputs, taking the drafter tokens vLLM's bf16 drafter drafted (`forced_drafts`), and compares its
# tokens per step with vLLM's (`exact`: the (config, prompt) pairs where they are equal). `drafter_flips` counts
# the steps where the replay's own float32 drafter would have drafted another token (near ties; the widest margin
# shown). With `replay_rerun`, a config whose records carried only part of its drafted block takes the replay of the
# later run that repeated it step for step (`vllm_report.same_steps`) with the whole block recorded.

# %%
replayed = vllm_report.replay_rows(results.load("vllm_fused", kind="replay"), run, data["steps"], replay_rerun or None)
label(replayed.group_by("config", "replay_run")
      .agg(pl.len().alias("pairs"), (pl.col("difference") == 0).sum().alias("exact"),
           pl.col("difference").abs().max().alias("widest difference"), pl.col("forced_drafts").sum(),
           pl.col("drafter_flips").sum(), pl.col("flip_margin_max").max()).sort("config"))

# %% [markdown]
# ## What a step costs
#
# Milliseconds per decode step over every round (`vllm_report.round_step_ms`: decode time ÷ steps after the
# prompt's), and that minus the class's fastest lookup's (`over_lookup_ms`). A fused step with a drafter pass costs
# the lookup's step plus the pass; where the lookup alone decides (a strong match) the device-skip configs skip the
# pass.

# %%
label(vllm_report.round_step_ms(data["repeats"], run)).pivot("category", index="config", values="step_ms")

# %% [markdown]
# GPU time per decode step by phase in `profiled_run` (CUDA events around vLLM's worker calls and the speculator's
# `propose`, medians; `vllm_report.gpu_phases` takes the drafting step out of sampling, where vLLM calls it): the
# target's forward, the drafting step (lookup, drafter pass, fusion rule) and the rest of sampling.

# %%
phases = label(vllm_report.gpu_phases(data["phases"], profiled_run))
display(phases)  # noqa: F821
plots.stacked_time(phases.drop("gpu_ms"), "config", vllm_report.GPU_PHASES,
                   y_title=f"GPU ms per step (median), run {profiled_run}")

# %% [markdown]
# ## The drafter's Triton layer kernels: the tile sweep
#
# `experiments/drafter_kernel_tiles/drafter_layer_tiles.py` (random weights at the 0.5B's shapes): each Triton layer
# kernel's µs per launch, timed over 24 layers' own weights in one CUDA graph, with the tiles it had before the sweep
# and the best candidate (columns per program, reduction step, pipeline depth, a split of the reduction), beside the
# product alone in cuBLAS; the attention beside vLLM's FlashAttention 3 as the drafter calls it. The norm kernels (K1,
# K3) also normalise, add the bias, rotate and write the cache (K1) or apply SiLU (K3).

# %%
sweep = vllm_report.tile_sweep(json.loads(results.read_text("drafter_layer_tiles", tile_sweep_run, "sweep.json")))
sweep_long = (sweep.with_columns(pl.when(pl.col("q_len").is_null()).then(pl.format("{}@{}", "kernel", "rows"))
                                 .otherwise(pl.format("{}@{}x{}", "kernel", "rows", "q_len")).alias("kernel@rows"))
              .unpivot(["reference_us", "table_us", "best_us"], index=["kernel@rows", "reference"],
                       variable_name="tiles", value_name="us")
              .with_columns(pl.col("tiles").replace({"reference_us": "cuBLAS product / FlashAttention 3",
                                                     "table_us": "tiles before the sweep", "best_us": "best of the sweep"})))
chart = plots.grouped_bars(sweep_long, "kernel@rows", "us", "tiles", y_title="µs per launch (24 layers, CUDA graph)")
plots.save(chart, figures / "drafter_layer_tiles_h200.svg")
chart
