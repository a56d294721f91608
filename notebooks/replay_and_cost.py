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
# # Replay speed, the measured cost model, and the proposer zoo
#
# Greedy decoding makes a proposer's acceptance a function of the target's output alone, so replaying recorded
# outputs is exact. This notebook shows how fast that replay is, how well the cost model turns replayed steps
# into speed (on this CPU, held out on committed live runs; on the H200, step costs at real model shapes), and
# how other systems' proposers do on the same traces. It re-plots committed results; the zoo is re-run when
# vLLM and Arctic Inference are installed.

# %% tags=["parameters"]
data_dir = "data/results"  # the results folder the committed runs are read from
results_dir = "data/results"  # the results folder a re-run zoo is written to (the run zoo/cpu)
figures_dir = "figures"
trace_set = "0.5b_all_128"  # a run of the study traces
zoo_rerun = "auto"  # "auto": re-run when every zoo proposer's library is installed; "yes"; "no"
zoo_repeats = 3

# %%
from pathlib import Path

import altair as alt
import polars as pl

from hqlab import plots
from hqlab.bench import results
from hqlab.replay import costmodel, zoo
from hqlab.replay.traces import load_traces

alt.renderers.enable("svg")
pl.Config.set_fmt_str_lengths(50)
pl.Config.set_tbl_width_chars(180)
pl.Config.set_tbl_rows(40)
figures = Path(figures_dir)

# %% [markdown]
# ## 1. Replay speed
# `benchmarks/bench_replay.py`: the 0.5B's traces repeated to 200k target tokens (1.6M history tokens). *cold*: one
# configuration from scratch; *warm*: on an index shared with earlier configurations (how sweeps run); *sweep*:
# 100 configurations with proposal timing and pricing, per configuration. The dashed line is 1M tokens/s.

# %%
speed = results.load("replay_speed", "cpu", root=data_dir)
print(speed["machine"][0], "| load average during the run:", speed["load_avg_1m"].round(1).unique().to_list())
shown = speed.filter(pl.col("kind") != "index").with_columns(
    (pl.col("tok_s") / 1e6).alias("M tokens/s (wall)"), (pl.col("cpu_tok_s") / 1e6).alias("M tokens/s (CPU time)"),
    pl.when(pl.col("kind") == "sweep").then(pl.lit("per configuration, 100 configurations"))
    .otherwise(pl.col("config")).alias("configuration"))
chart = plots.grouped_bars(shown, "kind", "M tokens/s (wall)", "configuration", y_title="M target tokens/s",
                           rule_at=1.0)
plots.save(chart, figures / "replay_speed.svg")
display(shown.select("kind", "configuration", "wall_s", "cpu_s", "M tokens/s (wall)", "M tokens/s (CPU time)"))
chart

# %% [markdown]
# ## 2. The CPU cost model, checked on committed live runs
# Each configuration of the committed core benchmark (0.5B, CPU, 2 threads; labd at 512 new tokens, chat at 128)
# is predicted by a step model fitted on the *other* configurations' steps, plus its own proposal-time model.
# Pooled per suite: measured vs predicted decode tok/s.

# %%
steps = results.load("core", "cpu", "steps", root=data_dir).filter(pl.col("config") != "hf-pld:k=10")
print(costmodel.CostModel.fit_steps(steps).describe())
held_out = costmodel.holdout_predictions(steps)
suites = costmodel.suite_errors(held_out)
display(suites.select("config", "suite", "requests", "measured_tok_s", "predicted_tok_s", "tok_s_error"))
print("per run: median |error| %.1f%%, within 10%%: %d of %d" % (
    100 * held_out["tok_s_error"].abs().median(), (held_out["tok_s_error"].abs() < 0.1).sum(), held_out.height))
bars = suites.unpivot(index=["config", "suite"], on=["measured_tok_s", "predicted_tok_s"], variable_name="kind",
                      value_name="tok/s")
chart = plots.grouped_bars(bars, "config", "tok/s", "kind", facet="suite", y_title="decode tok/s")
plots.save(chart, figures / "costmodel_holdout.svg")
chart

# %% [markdown]
# ### The suffix-length notebook's prediction against its own live check
# Its sweep is priced by this step model fitted on a step-time grid measured on the same machine
# (`suffix_step_times.parquet`); two of its configurations and `none` then ran live on every prompt. Mean error of
# the predicted decode time per configuration and suite (an earlier model, a bilinear interpolation of a one-shot
# grid, was 10-30 % off on the run of commit 23661fb: docs/replay-and-cost.md).

# %%
live = results.load("suffix_lengths", "cpu", "live", root=data_dir)
grid = results.load("suffix_lengths", "cpu", "sweep", root=data_dir).filter(pl.col("p_policy") == "recent")
grid = grid.with_columns(
    pl.format("lookup:nmin={},nmax={},k={}", "p_nmin", "p_nmax", "p_k").alias("config"))
base = grid.group_by("prompt_id").agg(pl.col("pred_base_s").first())
old = (live.join(grid.select("config", "prompt_id", "pred_decode_s"), on=["config", "prompt_id"], how="left")
       .join(base, on="prompt_id")
       .with_columns(pl.when(pl.col("config") == "none").then(pl.col("pred_base_s")).otherwise(pl.col("pred_decode_s"))
                     .alias("predicted_s"), ((pl.col("new_tokens") - 1) / pl.col("decode_tok_s")).alias("measured_s"))
       .with_columns((pl.col("measured_s") / pl.col("predicted_s") - 1).alias("tok_s_error"),
                     pl.when(pl.col("category") == "chat").then(pl.lit("chat")).otherwise(pl.lit("labd")).alias("suite")))
display(old.group_by("config", "suite").agg(pl.col("prompt_tokens").median(), pl.col("tok_s_error").mean().round(3))
        .sort("suite", "config"))

# %% [markdown]
# ### A fresh end-to-end check
# `benchmarks/bench_costmodel.py`: calibrate with `measure_step_times` (the engine's own step, shuffled rounds),
# predict from replay, then run the same configurations live on the labd suite.

# %%
if "costmodel" in results.studies(data_dir):
    check = results.load("costmodel", "cpu", root=data_dir)
    pooled = (check.group_by("config", maintain_order=True)
              .agg(((pl.col("new_tokens") - 1).sum() / ((pl.col("new_tokens") - 1) / pl.col("decode_tok_s")).sum())
                   .alias("measured_tok_s"),
                   ((pl.col("new_tokens") - 1).sum() / pl.col("pred_decode_s").sum()).alias("predicted_tok_s"))
              .with_columns((pl.col("predicted_tok_s") / pl.col("measured_tok_s") - 1).alias("tok_s_error")))
    display(pooled)
    display(check.select("config", "prompt_id", "decode_tok_s", "predicted_tok_s", "tok_s_error"))
    bars = pooled.unpivot(index="config", on=["measured_tok_s", "predicted_tok_s"], variable_name="kind",
                          value_name="tok/s")
    chart = plots.grouped_bars(bars, "config", "tok/s", "kind", y_title="decode tok/s, labd suite")
    plots.save(chart, figures / "costmodel_live_check.svg")
    display(chart)

# %% [markdown]
# ## 3. Verify-step cost on the H200 at real model shapes
# `experiments/verify_step_cost/step_cost_gpu.py` (random bf16 weights; CUDA graphs, i.e. without launch overhead; 2k
# context). Going from decoding one token to verifying two is the largest step on every model; past that, each extra
# position adds little at batch 1 and much more at batch 8.

# %%
gpu = results.load("step_cost", "h200", root=data_dir)
graph = gpu.filter((pl.col("mode") == "graph") & (pl.col("context_len") == 2048))
stair = graph.filter(pl.col("batch").is_in([1, 8])).with_columns(pl.format("batch {}", "batch").alias("panel"))
chart = plots.lines(stair, "verify_len", "step_ms", "model", facet="panel", x_title="verified positions",
                    y_title="ms per step")
plots.save(chart, figures / "step_cost_h200.svg")
fits = []
for (name,), rows in graph.filter(pl.col("batch") == 1).group_by(["model"], maintain_order=True):
    allctx = gpu.filter((pl.col("mode") == "graph") & (pl.col("batch") == 1) & (pl.col("model") == name))
    m = costmodel.CostModel.fit_points(allctx["verify_len"].to_numpy(), allctx["context_len"].to_numpy(),
                                       allctx["step_ms"].to_numpy())
    fits.append({"model": name, **{k: round(v, 3) for k, v in m.coef.items()}, "residual_ms": round(m.residual_ms, 3)})
display(pl.DataFrame(fits))
chart

# %%
batch = gpu.filter((pl.col("mode") == "graph") & (pl.col("context_len") == 2048) &
                   pl.col("verify_len").is_in([1, 8, 16, 32])).with_columns(pl.format("v = {}", "verify_len").alias("v"))
chart = plots.lines(batch, "batch", "step_ms", "v", facet="model", x_title="batch (requests)", y_title="ms per step",
                    log_x=True)
plots.save(chart, figures / "step_cost_h200_batch.svg")
eager = gpu.filter((pl.col("batch") == 1) & (pl.col("context_len") == 2048) & pl.col("verify_len").is_in([1, 16]))
display(eager.pivot(on="mode", index=["model", "verify_len"], values="step_ms").sort("model", "verify_len"))
chart

# %% [markdown]
# ## 4. The proposer zoo on the same traces
# The 0.5B's outputs on the labd and chat suites (128 new tokens). Tokens per step = accepted + the bonus token
# (Spec-Bench's "mean accepted tokens"); latency = one `propose` call, median over steps and repeats.

# %%
traces = load_traces(results.trace_files([trace_set], data_dir)[0])
ok, missing = zoo.available() if zoo_rerun != "no" else ({}, {})
rerun = zoo_rerun == "yes" or (zoo_rerun == "auto" and not missing)
if rerun:
    zoo_steps = zoo.run_zoo(traces, ok, repeats=zoo_repeats)
    results.write_run("zoo", "cpu", card="cpu", tables={"steps": zoo_steps}, root=results_dir)
else:
    print("re-plotting the committed zoo run;", "missing:", missing if missing else "nothing (zoo_rerun='no')")
    zoo_steps = results.load("zoo", "cpu", "steps", root=data_dir)
table = zoo.summarize(zoo_steps)
display(zoo.overall(zoo_steps).sort("tokens_per_step_geomean", descending=True))
display(table.pivot(on="category", index="proposer", values="tokens_per_step"))
display(table.pivot(on="category", index="proposer", values="propose_ms_median"))
print("vLLM ngram (1-32) takes the same decisions as hqlab's earliest policy at",
      f"{100 * zoo.agreement(zoo_steps, 'vLLM ngram (1-32)', 'hqlab lookup, earliest (1-32)'):.1f}% of steps")
chart = plots.grouped_bars(table, "category", "tokens_per_step", "proposer", y_title="tokens per step", rule_at=1.0)
plots.save(chart, figures / "zoo_tokens_per_step.svg")
chart

# %%
chart = plots.grouped_bars(table, "category", "propose_ms_median", "proposer", y_title="proposal latency, ms (median)")
plots.save(chart, figures / "zoo_latency.svg")
chart
