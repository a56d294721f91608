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
# # Suffix-match lengths: which nmin, nmax and k make *this* workload faster?
#
# The target decodes each prompt once without speculation. Under greedy decoding a proposer's acceptance is
# fully determined by that output, so we **replay** every lookup configuration over it exactly, then price every
# replayed step with a **cost model measured on this machine** (forward time vs verify length and context).
# A few configurations are also run **live** on the real model to check the predictions.
#
# With `rerun = False` (the default of `make figures`) it re-plots the committed run from `published_dir`: the
# sweep, the step costs that priced it and the live check, all from one machine (named below). `rerun = True`
# does all of it here: on a 2-core CPU about an hour, most of it the live runs of the 0.5B in bf16.

# %% tags=["parameters"]
model = "qwen2.5-coder-0.5b"
device = "auto"
dtype = "auto"
suite = "all"
doc_tokens = 1500
max_new_tokens = 128
limit = 0
shipped_traces = ["0.5b_all_128_bf16"]  # committed trace sets if recorded like here; []: record
nmin_grid = [1, 2, 3, 4, 6, 8]
nmax_grid = [3, 4, 8, 12, 16, 32]
k_grid = [4, 8, 15]
policies = ["recent", "earliest"]
live_configs = ["lookup:nmin=6,nmax=12,k=15", "lookup:nmin=2,nmax=12,k=8"]
cost_contexts = [512, 1024, 2048]
cost_verify_lens = [1, 2, 4, 8, 12, 16]
rerun = False  # False: re-plot the committed run (published_dir); True: record, measure, replay and run live here
figures_dir = "figures"
results_dir = "data/results"  # the results folder a rerun writes the run suffix_lengths/<card> to
published_dir = "data/results"  # the results folder the committed run suffix_lengths/cpu is read from

# %%
from pathlib import Path

import altair as alt
import polars as pl

from hqlab import bench, plots
from hqlab.bench import results
from hqlab.config import DecodeConfig
from hqlab.engines.hf import HFEngine
from hqlab.provenance import machine_description
from hqlab.replay import sweep
from hqlab.replay.costmodel import CostModel, measure_step_times
from hqlab.replay.traces import cached_traces

alt.renderers.enable("svg")
pl.Config.set_fmt_str_lengths(60)
pl.Config.set_tbl_width_chars(160)
figures = Path(figures_dir)
if rerun:
    engine = HFEngine.load(model, device=device, dtype=dtype)  # the cost model and the live check need it anyway
    found = cached_traces(model, suite, max_new_tokens, dtype=dtype, device=device, doc_tokens=doc_tokens,
                          limit=limit, engine=engine, shipped=results.trace_files(shipped_traces))
    card = results.card_of(machine_description(engine.device))  # the run suffix_lengths/<card> written here
    prompts, traces = found.prompts, found.traces
    decode = DecodeConfig(max_new_tokens=max_new_tokens)
    print(machine_description(engine.device), "|", len(prompts), "prompts")

# %% [markdown]
# ## 1. Reference outputs and exact replay of the grid

# %%
if rerun:
    specs = [s for policy in policies for s in sweep.grid("lookup", nmin=nmin_grid, nmax=nmax_grid, k=k_grid,
                                                         policy=[policy])]
    print(len(specs), "configurations ×", len(traces), "traces")

# %% [markdown]
# ## 2. What a verify step costs here
# Measured forward time over `verify_len` positions on top of a KV cache of `context_len` tokens.

# %%
if rerun:
    step_times = measure_step_times(engine, cost_contexts, cost_verify_lens).with_columns(
        pl.lit(machine_description(engine.device)).alias("machine"))
    results.write_run("suffix_lengths", card, card=card, tables={"step_times": step_times}, root=results_dir)
else:
    step_times = results.load("suffix_lengths", "cpu", "step_times", root=published_dir)
print("measured on", step_times["machine"][0])
plots.save(plots.lines(step_times, "verify_len", "step_ms", "context_len", x_title="verify positions",
                       y_title="ms per verify step"), figures / "suffix_step_cost.svg")
step_times.pivot(on="verify_len", index="context_len", values="step_ms")

# %%
if rerun:
    grid = sweep.sweep(traces, specs, cost=CostModel.fit(step_times))
    results.write_run("suffix_lengths", card, card=card, tables={"sweep": grid}, root=results_dir)
else:
    grid = results.load("suffix_lengths", "cpu", "sweep", root=published_dir)
table = sweep.by_category(grid)

# %% [markdown]
# ## 3. Acceptance: tokens per step over nmin × nmax (largest k, first policy: by default 15 and most recent)

# %%
k_max = table["p_k"].cast(pl.Int32).max()  # of the grid shown (the committed one unless rerun)
heat = table.filter((pl.col("p_k") == str(k_max)) & (pl.col("p_policy") == policies[0])).with_columns(
    pl.col("p_nmin").cast(pl.Int32).alias("nmin"), pl.col("p_nmax").cast(pl.Int32).alias("nmax"))
chart = plots.heatmap(heat, "nmax", "nmin", "tokens_per_step", facet="category", title="tokens/step")
plots.save(chart, figures / "suffix_tokens_per_step.svg")
chart

# %% [markdown]
# ## 4. Speed: predicted decode speedup over no speculation (same grid)

# %%
chart = plots.heatmap(heat, "nmax", "nmin", "speedup_pred", facet="category", title="predicted speedup")
plots.save(chart, figures / "suffix_speedup.svg")
chart

# %% [markdown]
# ## 5. Block size k and match policy, at the best nmin/nmax per category

# %%
best_nm = (table.sort("speedup_pred", descending=True).group_by("category", maintain_order=True).first()
           .select("category", "p_nmin", "p_nmax"))
kk = table.join(best_nm, on=["category", "p_nmin", "p_nmax"]).with_columns(pl.col("p_k").cast(pl.Int32).alias("k"))
chart = plots.lines(kk, "k", "speedup_pred", "p_policy", facet="category", x_title="k (tokens proposed)",
                    y_title="predicted speedup")
plots.save(chart, figures / "suffix_k_policy.svg")
chart

# %% [markdown]
# ## 6. Live check: the real engine on the same prompts
# The live configurations are points of the grid, so the sweep holds their replay and prediction.

# %%
if rerun:
    live, live_steps = bench.run_bench(engine, prompts, live_configs, decode)
    results.write_run("suffix_lengths", card, card=card, tables={"live": live}, root=results_dir)
else:
    live = results.load("suffix_lengths", "cpu", "live", root=published_dir)
speculative = live.filter(pl.col("config") != "none")
pred = sweep.rows_of(grid, speculative["config"].unique(maintain_order=True).to_list())
check = speculative.join(pred.select("config", "prompt_id", "tokens_per_step", "speedup_pred"),
                         on=["config", "prompt_id"], suffix="_replay")
exact = check.filter(pl.col("divergence") == "identical")
assert check.height == speculative.height, "a live run has no replay of its prompt"
assert (exact["tokens_per_step"] - exact["tokens_per_step_replay"]).abs().max() < 1e-9, "replay must equal live"
agg = (check.group_by(["config", "category"], maintain_order=True)
       .agg(pl.col("speedup_decode").median().alias("measured"), pl.col("speedup_pred").median().alias("predicted"))
       .unpivot(index=["config", "category"], variable_name="kind", value_name="speedup"))
chart = plots.grouped_bars(agg, "category", "speedup", "kind", facet="config", y_title="decode speedup",
                           rule_at=1.0)
plots.save(chart, figures / "suffix_live_vs_predicted.svg")
chart

# %% [markdown]
# ## 7. Conclusions
# Best configuration per task class by predicted speed (acceptance alone would pick longer blocks and shorter
# matches than speed does), and the single configuration with the best geometric-mean speedup over classes.

# %%
best = (table.sort("speedup_pred", descending=True).group_by("category", maintain_order=True).first()
        .select("category", "config", "tokens_per_step", "speedup_pred").sort("category"))
overall = sweep.best_overall(grid)
print(best)
print(overall.head(8))
