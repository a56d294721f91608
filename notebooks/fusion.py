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
# # Fusion thresholds: when should the context lookup replace the model drafter?
#
# A smaller model with the target's tokenizer drafts the head of the verify block; the context lookup can
# replace it (head) and extend it (tail). The rule has five thresholds (SPEC §2.4). This notebook
#
# 1. replays every fusion setting **exactly** over the target's recorded greedy outputs, with the drafter's
#    greedy drafts **teacher-forced** from one forward pass per trace (the rare steps whose decision reads past
#    what the trace can tell are drafted for real and counted), and
# 2. (speed, batches: see `fusion_benchmark.py`, which re-plots the live benchmark).
#
# With `rerun = False` (the default of `make figures`) it re-plots the committed replay
# (`data/results/fusion_replay/cpu/`); `rerun = True` replays here: the drafter's forward pass over each of the six
# 1,700-token traces is most of the time on a CPU (bf16 without native CPU support is slow; seconds on a GPU).

# %% tags=["parameters"]
target = "qwen2.5-coder-1.5b"
drafter = "qwen2.5-coder-0.5b"
device = "auto"
dtype = "auto"
suite = "labd"
doc_tokens = 1500
max_new_tokens = 160
limit = 0
shipped_traces = ["1.5b_labd_160"]  # committed trace sets if recorded like here; []: record
k = 15
fusion_grid = ["nstrong=6,agree=0", "nstrong=8,agree=2", "nstrong=8,agree=0", "nstrong=12,agree=0",
               "nstrong=6,agree=0,nmin_tail=2", "nstrong=6,agree=0,nmin_tail=6", "rule=score"]
schedule = "sticky=3"
rerun = False  # False: re-plot the committed replay (published_dir); True: replay here (runs the drafter)
figures_dir = "figures"
results_dir = "data/results"  # the results folder a rerun writes the run fusion_replay/cpu to
published_dir = "data/results"  # the results folder the committed replay is read from when not rerunning

# %%
from pathlib import Path

import altair as alt
import polars as pl

from hqlab import plots
from hqlab.bench import results
from hqlab.provenance import machine_description
from hqlab.replay.teacher import load_drafter, replay_fused_grid
from hqlab.replay.traces import cached_traces

alt.renderers.enable("svg")
pl.Config.set_tbl_width_chars(160)
figures = Path(figures_dir)
if rerun:
    # the greedy outputs: trace cache, else the shipped set, else recorded here (only then does the model load)
    traces = cached_traces(target, suite, max_new_tokens, dtype=dtype, device=device, doc_tokens=doc_tokens,
                           limit=limit, shipped=results.trace_files(shipped_traces)).traces
    draft = load_drafter(drafter, device=device, dtype=dtype)
    print(machine_description(draft.device), "|", target, "drafted by", drafter, "|", len(traces), "prompts")

# %% [markdown]
# ## Replay: tokens per step and verified positions per step for each fusion setting

# %%
if rerun:
    specs = [f"fused:k={k},{schedule},{g}" for g in fusion_grid] + [f"fused:k={k},{schedule},schedule=short"]
    grid = replay_fused_grid(traces, draft, specs)
    grid = grid.with_columns(pl.col("config").str.replace(f"fused:k={k},{schedule},", "").alias("setting"))
    results.write_run("fusion_replay", "cpu", card="cpu", tables={"rows": grid}, root=results_dir)
else:
    grid = results.load("fusion_replay", "cpu", root=published_dir)
summary = grid.group_by(["category", "setting"], maintain_order=True).agg(
    pl.col("tokens_per_step").mean(), pl.col("verify_positions").mean(), pl.col("lookup_head_share").mean(),
    pl.col("real_drafts").sum())
print(summary)

# %%
plots.save(plots.grouped_bars(summary, "category", "tokens_per_step", "setting",
                              y_title="tokens per verify step (replay)"), figures / "fusion_thresholds_tps.svg")
plots.save(plots.grouped_bars(summary, "category", "verify_positions", "setting",
                              y_title="verified positions per step"), figures / "fusion_thresholds_cost.svg")
