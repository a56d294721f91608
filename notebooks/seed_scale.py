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
# # The seeds' scale: verify-step costs of 7B–32B targets joined with measured acceptance
#
# Re-plots the committed step-cost measurement (`benchmarks/vllm_step_cost.py`, the study seed_scale: Qwen2.5-shaped
# targets with random weights inside vLLM 0.26.0, CUDA graphs, every verify width) and joins it with tokens per
# step measured on real outputs: the step records of `lookup_run` (the 0.5B, gpu-lookup) and `fused_run` (the
# 1.5B, gpu-fused with the 0.5B drafting). First the prediction is checked where the truth is known (the 0.5B and
# 1.5B runs themselves), then projected onto the large shapes (`hqlab.replay.scale`). docs/seed-scale.md reads these.

# %% tags=["parameters"]
step_cost_card = "h100"  # the card of the seed_scale grids used (the H200 was not lent: measured on an H100)
# runs of the study seed_scale whose grids are used, oldest first: where several measured a point, the one named
# last keeps it (`scale.newest_points`; empty: all runs of the card, each point must then appear once)
step_costs_runs = ["s2", "s3a", "s3b", "s3c", "s3d"]  # s3d: the 27B class in fp8
lookup_run = "w2"  # a run of the study vllm_gpu
lookup_shape = "qwen2.5-0.5b"  # the grid's shape of the run's model
fused_run = "fn2"  # a run of the study vllm_fused
fused_shape = "qwen2.5-1.5b"  # the run's target, and the shape the fused step was measured on
drafter_shape = "qwen2.5-0.5b"  # the shape of the drafter in the fused measurement
# where the grid has no fused step: the profiled pass of this run of vllm_fused (the same fused configs)
pass_profile_run = "fn1"
shapes = ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-27b", "qwen2.5-32b"]
widths = [1, 2, 4, 8, 16, 32]  # the step-cost figure's widths
contexts = [1024, 8192, 32768]  # the step-cost figure's contexts
batches = [1, 8]
quant = "bf16"  # the figures' weights; the tables also project every shape measured in `extra_quants`
extra_quants = ["fp8"]
drafter_ratio = 0.05  # the scaled drafter: the measured shape nearest to this fraction of the target
tolerance = 0.10  # the validation's band
speedup_configs = ["gpu-lookup k=31 (w2)", "gpu-lookup k=31 (fn2)", "gpu-fused k=15 (fn2, measured drafter)",
                   "gpu-fused k=31 device skip (fn2, measured drafter)",
                   "gpu-fused k=31 device skip (fn2, scaled drafter)"]  # the speedup figure's panels
seeds_params_b = 27.0  # the seeds' headline: 159 -> 381 tok/s on a ~27B target
seeds_speedup = 2.4
# decodes beside a grid of the same call, in the study seed_scale: decode run -> [the run (folder) of the call,
# whose grid prices it, the grid shape that prices it]
same_machine_runs = {"v1_05b": ["v1", "qwen2.5-0.5b"], "v1_15b": ["v1", "qwen2.5-1.5b"],
                     "v2a_05b": ["v2a", "qwen2.5-0.5b"], "v2b_15b": ["v2b", "qwen2.5-1.5b"],
                     "v3a_05b": ["v3a", "qwen2.5-0.5b"], "v4a_05b": ["v4a", "qwen2.5-0.5b"],
                     "v4b_15b": ["v4b", "qwen2.5-1.5b"], "v4c_05b": ["v4c", "qwen2.5-0.5b"],
                     "v4d_15b": ["v4d", "qwen2.5-1.5b"]}
steady_spread = 1.1  # a pair is "steady" where every prompt's repeats agree within this factor
figures_dir = "figures"
results_dir = "data/results"  # the results folder the projection goes to (seed_scale_projection/<card>)

# %%
from pathlib import Path

import altair as alt
import polars as pl

from hqlab import plots
from hqlab.bench import results as committed
from hqlab.replay import scale

alt.renderers.enable("svg")
pl.Config.set_tbl_rows(200)
pl.Config.set_tbl_width_chars(200)
pl.Config.set_fmt_str_lengths(60)
costs = committed.load("seed_scale", kind="grid", card=step_cost_card)
if step_costs_runs:
    costs = scale.newest_points(costs, step_costs_runs)
costs = scale.check_step_costs(costs)
print(" | ".join(sorted(costs["machine"].unique())), "| vLLM", ", ".join(sorted(costs["vllm_version"].unique())),
      "| runs", ", ".join(sorted(costs["run"].unique())), "| commit", ", ".join(sorted(costs["git_commit"].unique())))
costs.group_by("shape", "quant", "config").agg(
    pl.col("target_params_b").first(), pl.col("width").unique().sort(), pl.col("context").unique().sort(),
    pl.col("batch").unique().sort(), pl.len().alias("points"), pl.col("engine_start_s").first()).sort(
    "target_params_b", "quant", "config")

# %% [markdown]
# ## 1. The step's cost: ms per verify step against the width, per shape (gpu-lookup)

# %%
curve = (costs.filter((pl.col("config") == "gpu-lookup") & (pl.col("quant") == quant) & pl.col("shape").is_in(shapes)
                      & pl.col("width").is_in(widths) & pl.col("context").is_in(contexts)
                      & pl.col("batch").is_in(batches))
         .sort("target_params_b", "batch", "context", "width")
         .with_columns(pl.format("batch {}, context {}k", "batch", pl.col("context") // 1024).alias("panel")))
chart = plots.panel_lines(curve, "width", "step_ms", "shape", panel="panel", log_x=True,
                          order=[f"batch {b}, context {c // 1024}k" for b in batches for c in contexts],
                          x_title="verify width (positions)", y_title="ms per step (median)", columns=len(contexts))
plots.save(chart, Path(figures_dir) / "seed_scale_step_cost.svg")
chart

# %%
curve.pivot(on="width", index=["shape", "batch", "context"], values="step_ms").sort("batch", "context")

# %% [markdown]
# The drafter's pass: where the grid measured the 1.5B's gpu-fused step, that step minus its gpu-lookup step at the
# same point; where it did not, the pass's GPU time in the profiled run `pass_profile_run` (the same fused configs
# as `fn2`, on the H200, batch 1), and then gpu-fused is projected at batch 1 only.

# %%
missing_shapes = [s for s in shapes if costs.filter(pl.col("shape") == s).is_empty()]
print(f"shapes not in the step-cost file (left out): {missing_shapes}")
shapes = [s for s in shapes if s not in missing_shapes]
profiled = None
if scale.has_fused(costs, fused_shape, quant=quant):
    fused_points = costs.filter((pl.col("shape") == fused_shape) & (pl.col("config") == "gpu-fused")
                                & (pl.col("quant") == quant))
    passes = fused_points.select("width", "context", "batch").with_columns(
        pl.Series("pass_ms", [float(scale.pass_ms(costs, [w], [c], b, fused_shape=fused_shape, quant=quant)[0])
                              for w, c, b in fused_points.select("width", "context", "batch").iter_rows()]))
    display(passes.pivot(on="width", index=["batch", "context"], values="pass_ms").sort("batch", "context"))
else:
    profiled = scale.profiled_pass_ms(committed.load("vllm_fused", pass_profile_run, "phases"), pass_profile_run)
    print(f"no gpu-fused step of {fused_shape} in the grid; the drafter's pass from run {pass_profile_run}'s profile "
          f"(GPU ms by verify width): {profiled}")

# %% [markdown]
# ## 2. Validation where the truth is known
# Each committed run's own configs at batch 1, priced with its own model's shape: per request tokens ÷ the summed
# predicted step costs at the width each step verified and the context it read, the class median over prompts,
# against the measured class median of decode tok/s. Chat prompts read 140–600 tokens, below the grid's 1,024: those
# steps are priced at 1,024 (`clamped_share`).

# %%
lookup_steps, lookup_results = (committed.load("vllm_gpu", lookup_run, kind) for kind in ("steps", "rows"))
fused_steps, fused_results = (committed.load("vllm_fused", fused_run, kind) for kind in ("steps", "rows"))
validation = pl.concat([
    scale.validate(costs, lookup_steps, lookup_results, lookup_run, lookup_shape, quant=quant, tolerance=tolerance),
    scale.validate(costs, fused_steps, fused_results, fused_run, fused_shape, fused_shape=fused_shape, quant=quant,
                   profiled_pass=profiled, tolerance=tolerance)])
for run, results, steps in ((lookup_run, lookup_results, lookup_steps), (fused_run, fused_results, fused_steps)):
    left = sorted({c for c in results.filter(pl.col("run") == run)["config"].to_list()
                   if not scale.priceable(steps, run, c)})
    print(f"run {run}: not priced (no step cost for them in the grid): {left}")
print(f"within ±{tolerance:.0%}: {int(validation['within'].sum())} of {validation.height} (config, class) pairs, "
      f"{scale.validation_fraction(validation):.0%}")
validation.select("run", "label", "category", "prompts", "measured_tok_s", "predicted_tok_s", "ratio", "within",
                  "predicted_step_ms", "recorded_step_ms", "clamped_share")

# %%
validation.group_by("run", "label", maintain_order=True).agg(
    pl.col("within").sum().alias("within"), pl.len().alias("classes"), pl.col("ratio").min().alias("lowest"),
    pl.col("ratio").median().alias("median"), pl.col("ratio").max().alias("highest"))

# %% [markdown]
# The projection quotes speedups ÷ `none`: the same check on them, each side divided by its own `none`.

# %%
speedups = scale.speedup_check(validation, tolerance=tolerance)
print(f"speedup ÷ none within ±{tolerance:.0%}: {int(speedups['speedup_within'].sum())} of {speedups.height} "
      f"(config, class) pairs")
speedups.group_by("run", "label", maintain_order=True).agg(
    pl.col("speedup_within").sum().alias("within"), pl.len().alias("classes"),
    pl.col("speedup_ratio").min().alias("lowest"), pl.col("speedup_ratio").median().alias("median"),
    pl.col("speedup_ratio").max().alias("highest"))

# %%
shown = validation.with_columns(pl.format("{} {}", "run", "label").alias("config"))
chart = plots.predicted_vs_measured(shown, "measured_tok_s", "predicted_tok_s", "config", tolerance=tolerance,
                                    x_title="measured decode tok/s (batch 1)", y_title="predicted decode tok/s",
                                    tooltip=["config", "category", "measured_tok_s", "predicted_tok_s", "ratio"])
plots.save(chart, Path(figures_dir) / "seed_scale_validation.svg")
chart

# %% [markdown]
# ## 2b. Validation on one machine
# The check above prices H200 decodes with an H100's grid. Runs `v1` to `v4d` (benchmarks/seed_scale_validation.py)
# each measured a grid at exactly the points it prices and then the decodes it predicts, in one call on one H100, so
# card and machine cannot explain a miss (the host's state within the call can). `repeat_spread`: per pair the
# largest, over its prompts, of a prompt's fastest ÷ slowest repeat; a pair whose own repeats spread more than the
# band cannot be predicted within it by any model.

# %%
same_parts = {name: committed.load("seed_scale", sorted({r for r, _ in same_machine_runs.values()}), name, having=True)
              for name in ("rows", "steps", "phases", "repeats")}
same = pl.concat([
    scale.validate_runs(scale.decode_costs(committed.load("seed_scale", grid_run, "grid"))[0], same_parts["steps"],
                        same_parts["rows"], {run: shape}, phases=same_parts["phases"],
                        repeats=same_parts["repeats"], tolerance=tolerance, say=print)
    for run, (grid_run, shape) in same_machine_runs.items()], how="diagonal_relaxed")
steady = same.filter(pl.col("repeat_spread") <= steady_spread)
print(f"within ±{tolerance:.0%}: {int(same['within'].sum())} of {same.height} (config, class) pairs, "
      f"{scale.validation_fraction(same):.0%}; of the {steady.height} pairs whose repeats agree within "
      f"{steady_spread}x: {int(steady['within'].sum())}")
same.group_by("run", "label", maintain_order=True).agg(
    pl.col("within").sum().alias("within"), pl.len().alias("classes"), pl.col("ratio").min().alias("lowest"),
    pl.col("ratio").median().alias("median"), pl.col("ratio").max().alias("highest"),
    pl.col("repeat_spread").median().alias("median repeat spread"))

# %%
shown = same.with_columns(pl.format("{} {}", "run", "label").alias("config"))  # coloured by run, config in the tip
chart = plots.predicted_vs_measured(shown, "measured_tok_s", "predicted_tok_s", "run", tolerance=tolerance,
                                    x_title="measured decode tok/s (batch 1, runs v1 to v4d, one H100 each)",
                                    y_title="predicted from the same call's grid",
                                    tooltip=["config", "category", "measured_tok_s", "predicted_tok_s", "ratio",
                                             "repeat_spread"])
plots.save(chart, Path(figures_dir) / "seed_scale_same_machine.svg")
chart

# %% [markdown]
# ## 3. Projection onto the large shapes
# Tokens per step from `w2` (the 0.5B's gpu-lookup) and `fn2` (the 1.5B's gpu-fused, and its own gpu-lookup for a
# comparison inside one run), each step priced on the target's grid at batch 1 and 8. gpu-fused: the measured
# drafter (the 0.5B's pass as measured on the 1.5B) and a scaled drafter (the measured shape nearest to
# `drafter_ratio` × the target; its pass = the measured pass + that shape's lookup step − the 0.5B's).

# %%
def sources_of(steps: pl.DataFrame, results: pl.DataFrame, run: str, kinds: tuple[str, ...]) -> list[scale.Traces]:
    configs = sorted(c for c in results.filter(pl.col("run") == run)["config"].unique().to_list()
                     if scale.priceable(steps, run, c) and scale.config_kind(c) in kinds)
    return [scale.traces(steps, results, run, c) for c in configs]


lookups = (sources_of(lookup_steps, lookup_results, lookup_run, ("gpu-lookup",))
           + sources_of(fused_steps, fused_results, fused_run, ("gpu-lookup",)))
fused = sources_of(fused_steps, fused_results, fused_run, ("gpu-fused",))
fused_batches = batches if profiled is None else [b for b in batches if b == 1]  # a profiled pass is batch 1's
measured_in = {q: [s for s in shapes if not costs.filter((pl.col("quant") == q) & (pl.col("shape") == s)).is_empty()]
               for q in [quant, *extra_quants]}
options = dict(pass_quant=quant, fused_shape=fused_shape, measured_drafter_shape=drafter_shape,
               drafters=("measured", "scaled"), drafter_ratio=drafter_ratio, profiled_pass=profiled)
projection = pl.concat([
    scale.project(costs, group, measured_in[q], these, quant=q, **options)
    for q in measured_in if measured_in[q] for group, these in ((lookups, batches), (fused, fused_batches))])
path = committed.write_run("seed_scale_projection", step_cost_card, card=step_cost_card,
                           tables={"rows": scale.checked_projection(projection)}, root=results_dir)
print(f"{projection.height} rows -> {path}")
projection.select("shape", "target_params_b", "quant", "label", "traces_run", "drafter", "drafter_shape", "category",
                  "batch", "tokens_per_step", "step_ms", "tok_s", "none_tok_s", "speedup").sort(
    "batch", "label", "traces_run", "drafter", "category", "target_params_b", "quant")

# %% [markdown]
# Speedup ÷ `none` per class against the target's size (diamond: the seeds' headline, 2.4× at ~27B).

# %%
named = projection.with_columns(
    pl.when(pl.col("drafter") == "-").then(pl.format("{} ({})", "label", "traces_run"))
    .otherwise(pl.format("{} ({}, {} drafter)", "label", "traces_run", "drafter")).alias("config"),
    pl.format("{} {}", "shape", "quant").alias("target"))
missing = sorted(set(speedup_configs) - set(named["config"].to_list()))
assert not missing, f"speedup_configs not in the projection: {missing}"
shown = (named.filter(pl.col("config").is_in(speedup_configs) & (pl.col("quant") == quant))
         .with_columns(pl.format("{}, batch {}", "config", "batch").alias("panel"),
                       pl.col("config").replace_strict({c: i for i, c in enumerate(speedup_configs)}).alias("order"))
         .sort("batch", "order", "target_params_b"))
chart = plots.lines_with_mark(shown, "target_params_b", "speedup", "category", panel="panel", columns=3,
                              mark=(seeds_params_b, seeds_speedup, f"seeds: {seeds_speedup}×"),
                              x_title="target parameters (B)", y_title="projected speedup ÷ none")
plots.save(chart, Path(figures_dir) / "seed_scale_speedup.svg")
chart

# %%
large = named.filter(pl.col("target_params_b") >= 5).sort("target_params_b")
large.pivot(on="category", index=["batch", "config", "target"], values="speedup", maintain_order=True).sort(
    "batch", "config", maintain_order=True)

# %%
large.pivot(on="category", index=["batch", "config", "target"], values="tok_s", maintain_order=True).sort(
    "batch", "config", maintain_order=True)
