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
# # Sticky exit: how long should the long verify block survive a dropped flag?
#
# The long block (k = 15) is entered after `entry_steps` consecutive qualifying steps (the lookup has a tail and
# the previous step was saturated) and left after `sticky + 1` non-qualifying ones; `stale = 1` reads the flag
# one step late, as an engine that copies it asynchronously from the device would (SPEC §2.5). Every setting is
# replayed exactly over the target's greedy outputs with teacher-forced drafts (see the fusion notebook).
# Tokens per step measure what a setting gains; verified positions per step what it costs.
#
# With `rerun = False` (the default of `make figures`) the grid re-plots the committed replay
# (`data/results/sticky_replay/cpu/`) and only the one-request timeline is replayed here; `rerun = True` replays
# the whole grid (one drafter forward pass over each of the six 1,700-token traces: slow in bf16 on a CPU).

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
sticky_grid = [0, 1, 2, 3, 5]
entry_grid = [1, 2]
stale_grid = [0, 1]
timeline_task = "copy"
rerun = False  # False: re-plot the committed grid (published_dir); True: replay it here
figures_dir = "figures"
results_dir = "data/results"  # the results folder a rerun writes the run sticky_replay/cpu to
published_dir = "data/results"  # the results folder the committed grid is read from when not rerunning

# %%
from pathlib import Path

import altair as alt
import polars as pl

from hqlab import plots
from hqlab.bench import results
from hqlab.proposers.fused import FusedConfig, FusedProposer
from hqlab.provenance import machine_description
from hqlab.replay import replay
from hqlab.replay.teacher import TeacherForcedDrafter, load_drafter, replay_fused_grid
from hqlab.replay.traces import cached_traces

alt.renderers.enable("svg")
pl.Config.set_tbl_width_chars(160)
figures = Path(figures_dir)
# the greedy outputs: trace cache, else the shipped set, else recorded here (only then does the model load)
traces = cached_traces(target, suite, max_new_tokens, dtype=dtype, device=device, doc_tokens=doc_tokens,
                       limit=limit, shipped=results.trace_files(shipped_traces)).traces
draft = load_drafter(drafter, device=device, dtype=dtype)
print(machine_description(draft.device), "|", target, "drafted by", drafter, "|", len(traces), "traces")

# %% [markdown]
# ## Tokens per step and verify cost over sticky window, entry rule and flag staleness

# %%
if rerun:
    specs = [f"fused:k={k},sticky={s},entry_steps={e},stale={st}"
             for s in sticky_grid for e in entry_grid for st in stale_grid]
    grid = replay_fused_grid(traces, draft, specs + [f"fused:k={k},schedule=short", f"fused:k={k},schedule=long"])
    results.write_run("sticky_replay", "cpu", card="cpu", tables={"rows": grid}, root=results_dir)
else:
    grid = results.load("sticky_replay", "cpu", root=published_dir)
pattern = r"sticky=(?P<sticky>\d+),entry_steps=(?P<entry>\d+),stale=(?P<stale>\d)"
grid = grid.with_columns(pl.col("config").str.extract_groups(pattern).alias("p")).unnest("p")
adaptive = grid.drop_nulls("sticky").with_columns(
    pl.col("sticky").cast(pl.Int32), ("entry " + pl.col("entry") + ", stale " + pl.col("stale")).alias("rule"))
summary = adaptive.group_by(["category", "rule", "sticky"], maintain_order=True).agg(
    pl.col("tokens_per_step").mean(), pl.col("verify_positions").mean(), pl.col("long_share").mean())
fixed = grid.filter(pl.col("sticky").is_null()).group_by(["category", "config"], maintain_order=True).agg(
    pl.col("tokens_per_step").mean(), pl.col("verify_positions").mean())
print(fixed)
print(summary.filter(pl.col("rule") == "entry 2, stale 0"))

# %%
plots.save(plots.lines(summary, "sticky", "tokens_per_step", "rule", facet="category",
                       y_title="tokens per verify step (replay)"), figures / "sticky_tps.svg")
plots.save(plots.lines(summary, "sticky", "verify_positions", "rule", facet="category",
                       y_title="verified positions per step"), figures / "sticky_cost.svg")

# %% [markdown]
# ## One request, step by step: block length and accepted tokens with sticky 0 and 3

# %%
trace = next(t for t in traces if t.prompt_id == timeline_task)
teacher = TeacherForcedDrafter(draft, trace.prompt_ids, trace.output_ids)
rows = []
for s in (0, 3):
    records = replay(trace.prompt_ids, trace.output_ids, FusedProposer(FusedConfig(k=k, sticky=s), drafter=teacher),
                     max_new_tokens=trace.max_new_tokens, request=trace.prompt_id)
    rows += [{"sticky": f"sticky {s}", "step": r.step, "series": "block", "tokens": r.block} for r in records]
    rows += [{"sticky": f"sticky {s}", "step": r.step, "series": "emitted", "tokens": r.emitted} for r in records]
timeline = pl.DataFrame(rows)
plots.save(plots.lines(timeline, "step", "tokens", "series", facet="sticky", y_title="tokens"),
           figures / "sticky_timeline.svg")
