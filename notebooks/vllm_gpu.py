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
# # hqlab's lookup inside vLLM's GPU step
#
# Re-plots the committed vLLM runs (`benchmarks/vllm_gpu.py`, machine and versions in every row): hqlab's
# `gpu-lookup` speculator in vLLM's model runner V2 with asynchronous scheduling, next to `none`, hqlab's host-side
# `custom_class` adapter and vLLM's `ngram` / `ngram_gpu`. Every ratio is taken inside one run (one GPU session,
# its own `none`); tables give medians over runs. docs/vllm.md discusses them.

# %% tags=["parameters"]
results_file = "data/results/vllm_gpu_h200.parquet"
figures_dir = "figures"
results_dir = "data/results"
focus_run = "j"  # the run whose per-class bars are drawn (the current code, k = 15/31 and the adapter at both)
current_runs = ["e", "f", "g", "h", "j", "k"]  # hqlab's current code (step efficiency); vLLM's own: every run

# %%
from pathlib import Path

import altair as alt
import polars as pl

from hqlab import plots
from hqlab.bench import vllm_report

alt.renderers.enable("svg")
pl.Config.set_tbl_width_chars(200)
pl.Config.set_fmt_str_lengths(48)
pl.Config.set_tbl_rows(80)
data = vllm_report.load(results_file)
ratios = vllm_report.run_ratios(data["results"])
print(data["results"]["machine"][0], "|", data["results"]["model"][0], data["results"]["dtype"][0])

# %% [markdown]
# ## Decode speed over no speculation, per task class (batch 1)

# %%
one = ratios.filter((pl.col("run") == focus_run) & (pl.col("config") != "none")).with_columns(
    pl.col("config").map_elements(vllm_report.short_label, return_dtype=pl.String))
chart = plots.grouped_bars(one, "category", "vs_none", "config", y_title="decode tok/s ÷ none", rule_at=1.0)
plots.save(chart, Path(figures_dir) / "vllm_gpu_speedup.svg")
chart

# %%
vllm_report.summary(ratios).select("category", "config", "runs", "vs_none", "vs_custom_class", "tokens_per_step",
                                   "step_efficiency", "mismatches", "near_ties")

# %% [markdown]
# ## Step efficiency: what a speculative step costs against a plain one
#
# decode tok/s ÷ (tokens/step × none's decode tok/s): 1.0 when a verify step costs what a plain step costs.

# %%
ours = pl.col("family").str.starts_with("hqlab")
eff = (ratios.filter((pl.col("config") != "none") & (~ours | pl.col("run").is_in(current_runs)))
       .group_by(["config", "family"], maintain_order=True)
       .agg(pl.col("step_efficiency").median(), pl.col("tokens_per_step").median())
       .with_columns(pl.col("config").map_elements(vllm_report.short_label, return_dtype=pl.String)))
chart = plots.grouped_bars(eff, "config", "step_efficiency", "family", y_title="step efficiency (median)",
                           rule_at=1.0, width=420)
plots.save(chart, Path(figures_dir) / "vllm_gpu_step_efficiency.svg")
chart

# %% [markdown]
# ## Where a step's milliseconds go (profiled pass, worker host time)

# %%
if data["phases"].height:
    parts = vllm_report.step_breakdown(data["phases"], data["profile_steps"])
    labelled = parts.with_columns(pl.format("{} · run {}", pl.col("config").map_elements(
        vllm_report.short_label, return_dtype=pl.String), "run").alias("config"))
    chart = plots.stacked_time(labelled.select("config", *vllm_report.PARTS), "config", vllm_report.PARTS,
                               y_title="ms per decode step")
    plots.save(chart, Path(figures_dir) / "vllm_gpu_step_breakdown.svg")
    display(parts)  # noqa: F821
    display(chart)  # noqa: F821

# %% [markdown]
# ## Eight requests at once: total throughput
#
# A burst submits eight prompts together (the slowest sets the wall time); a sustained load keeps eight in flight
# over the whole suite. Each is compared with `none` under the same load in the same run.

# %%
together = vllm_report.concurrency(data["results"])
if together.height:
    shown = together.filter(pl.col("config") != "none").with_columns(
        pl.col("config").map_elements(vllm_report.short_label, return_dtype=pl.String),
        (pl.col("run") + pl.when(pl.col("load") == "burst").then(pl.lit("")).otherwise(" · " + pl.col("load")))
        .alias("run"))
    chart = plots.grouped_bars(shown, "run", "vs_none", "config",
                               y_title="total tok/s ÷ none (8 requests)", rule_at=1.0)
    plots.save(chart, Path(figures_dir) / "vllm_gpu_concurrency.svg")
    display(together.select("run", "load", "config", "batch_tok_s", "vs_none", "tokens_per_step",  # noqa: F821
                            "mismatches"))
    display(chart)  # noqa: F821
