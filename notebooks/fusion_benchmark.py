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
# # Lookup, model drafter, fusion and the adaptive long block, live
#
# Re-plots `benchmarks/bench_fusion.py` results (target Qwen2.5-Coder-1.5B, drafter Qwen2.5-Coder-0.5B, the labd
# task suite, greedy, every output checked against the engine's own no-speculation output): tokens per step,
# wall-time speedup, where a step's time goes (proposing = the drafter's forward passes, vs verifying), and
# four concurrent requests with per-request vs unanimous block lengths. `rerun=True` runs the benchmark here
# first (minutes on a GPU; long on a CPU).

# %% tags=["parameters"]
tags = ["h200"]
rerun = False
target = "qwen2.5-coder-1.5b"
drafter = "qwen2.5-coder-0.5b"
device = "auto"
doc_tokens = 1500
new_tokens = 160
figures_dir = "figures"
results_dir = "data/results"  # where a rerun writes
published_dir = "data/results"  # where committed results are read from when not rerunning

# %%
from pathlib import Path

import altair as alt
import polars as pl

from hqlab import bench, plots
from hqlab.bench.suites import fusion_benchmark

alt.renderers.enable("svg")
pl.Config.set_tbl_width_chars(160)
pl.Config.set_tbl_rows(60)
figures = Path(figures_dir)
results = Path(results_dir) if rerun else Path(published_dir)
if rerun:  # what benchmarks/bench_fusion.py runs
    for tag in tags:
        fusion_benchmark(tag, results, target=target, drafter=drafter, device=device, doc_tokens=doc_tokens,
                         new_tokens=new_tokens)


def short(frame: pl.DataFrame) -> pl.DataFrame:
    """Config labels without the drafter's model/dtype/device keys."""
    return frame.with_columns(pl.col("config").str.replace(r",model=[^,]+,dtype=[^,]+,device=\w+", ""))


# %% [markdown]
# ## One request at a time: tokens per step, speedup, and where the time goes

# %%
for tag in tags:
    live = short(pl.read_parquet(results / f"fusion_{tag}.parquet"))
    print(tag, "|", live["machine"][0], "|", live["model"][0], "drafted by", live["drafter"][0])
    per = live.group_by(["category", "config"], maintain_order=True).agg(
        pl.col("tokens_per_step").median(), pl.col("speedup_e2e").median(), pl.col("decode_tok_s").median(),
        pl.col("propose_ms_per_step").median().alias("propose"), pl.col("verify_ms_per_step").median().alias("verify"),
        (pl.col("divergence") != "mismatch").all().alias("lossless"))
    print(per)
    plots.save(plots.grouped_bars(per, "category", "tokens_per_step", "config", rule_at=1.0,
                                  y_title="tokens per verify step"), figures / bench.fusion_figure_names(tag)["tps"])
    plots.save(plots.grouped_bars(per, "category", "speedup_e2e", "config", rule_at=1.0,
                                  y_title="wall-time speedup over no speculation"),
               figures / bench.fusion_figure_names(tag)["speedup"])
    plots.save(plots.stacked_time(per.select("category", "config", "propose", "verify"), "config",
                                  ["propose", "verify"], facet="category"), figures / bench.fusion_figure_names(tag)["time"])

# %% [markdown]
# ## Four concurrent requests (copy, summary, code, qa): per-request vs unanimous block length

# %%
for tag in tags:
    path = results / f"fusion_{tag}_batch.parquet"
    if not path.exists():
        continue
    batch = short(pl.read_parquet(path))
    print(batch.select("config", "prompt_id", "tokens_per_step", "mean_block", "long_share", "batch_tok_s",
                       "divergence", "divergence_margin"))
    plots.save(plots.grouped_bars(batch, "prompt_id", "tokens_per_step", "config",
                                  y_title="tokens per verify step, 4 concurrent requests"),
               figures / bench.fusion_figure_names(tag)["batch"])
