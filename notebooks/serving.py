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
# # Serving under load: `vllm serve` with hqlab's speculators
#
# Re-plots a committed serving run (`benchmarks/vllm_serve.py` on the GPU host: one `vllm serve` process per
# config, loaded by vLLM's own `vllm bench serve`; data/results/serve/<run>/, the machine in its rows and run.json).
# For each dataset and temperature: output throughput and time per output token against the requests in flight,
# each config's throughput ÷ `none`'s, the best config per load, and the sampling test (per-position token
# frequencies of 600 samples against `none`'s, chi-square, Bonferroni). docs/serving.md reads these.

# %% tags=["parameters"]
run = "s1"  # a run of the study serve
figures_dir = "figures"
positions = 24  # output positions the sampling test compares
# the speculation gate's replay: recorded greedy outputs, the lookup it gates, the gate lengths (0 = no gate), and
# where the two step costs come from (a serving run at one request, and the step-cost grid of the same target)
gate_traces = {"0.5B": ["0.5b_all_128", "0.5b_corpus_128"],
               "1.5B": ["1.5b_labd_160", "1.5b_prose_chat_256"]}  # model -> trace sets (runs of the study traces)
gate_lookup = "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest"
gate_min_matches = [0, 1, 2, 3, 4, 6, 8]
gate_cost_run = "s3"
gate_cost_config = "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest,batch_k=1:15/4:7/0"
gate_grid_run = "s2"  # the run of the study seed_scale whose step-cost grid prices it
results_dir = "data/results"  # the results folder the gate's replay goes to (the run gate_replay/cpu)
gate_cost_ratios = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6]  # speculative step ÷ plain step, the host's cost
gate_cost_lengths = [0, 1, 2, 3]  # the gate lengths drawn against it
gate_runs = ["s4", "s4b"]  # the serving runs of the gated lookup (gate=1, gate=2) beside the ungated one
# drafts drawn from the drafter (`draft_sample=probabilistic`): the CPU measurement of what they are worth (the runs
# draft_sampling/cpu; draft_temperature/cpu, the drafter drawn hotter or colder; drawn_heads/cpu, whole steps:
# greedy against drawn heads of 1-3 tokens), and the served run and config whose sampled-prose speedup at one
# request it projects from
head_speed_run = "s3"  # the serving run that measured greedy heads of 1-3 tokens against each other
projection_run = "s4"
served_heads_run = "s5a"  # the serving run that measured the drawn heads themselves (sampled prose, one request)
projection_config = ("gpu-fused:k=15,draft_block=1,nmax=32,policy=earliest,compile=true,schedule=long,nmin_tail=1,"
                     "compile_rule=true,device_skip=true,layers=triton,attention=triton,batch_k=1:15/4:7/0")
# the drafter's prompt prefill outside vLLM (experiments/drafting_step_profile/fused_pass_kernels.py --prefill): eager
# calls against the passes replayed from a captured graph (`prefill_graph`)
prefill_run = "p1"  # a run of the study fused_pass_kernels
prefill_runs = ["s5a", "s6"]  # serving runs of projection_config on sampled prose at one request (s6: also with
# prefill_graph=1024, the drafter's prompt read from the captured graph)
load_runs = ["s7a", "s7b"]  # serving runs whose points are ten waves with steady-state rates (throughput under load)
profile_run = "p2"  # a serving run whose profiled repeats timed the worker's steps (phases.parquet; plan serve_p2)
goodput_served_run = "s8a"  # a serving run of goodput servers with their decisions (goodput_decisions.parquet)
gate_plot = ["prose 1.5B", "chat 1.5B", "prose 0.5B", "template 0.5B", "multiturn 0.5B", "agent 0.5B", "qa 1.5B",
             "copy 1.5B"]  # the workloads drawn (the table and the parquet have all)

# %%
import json
from pathlib import Path

import altair as alt
import polars as pl
from IPython.display import display

from hqlab import plots
from hqlab.bench import results, serve, serve_profile, soak, vllm_report
from hqlab.replay import sampled_drafts

alt.renderers.enable("svg")
pl.Config.set_tbl_width_chars(200)
pl.Config.set_fmt_str_lengths(60)
serve_rows = results.load("serve")  # every serving run's load rows
rows = serve_rows.filter(pl.col("run") == run)
curves = serve.load_curves(rows)
print(rows["machine"][0], "| vLLM", rows["vllm_version"][0], "| model", rows["model"][0], "| commit",
      rows["git_commit"][0])

# %%
chart = plots.lines(curves, "max_concurrency", "output_throughput", "label", facet="group", log_x=True,
                    x_title="requests in flight", y_title="output tok/s")
plots.save(chart, Path(figures_dir) / "vllm_serve_h200_throughput.svg")
chart

# %%
chart = plots.lines(curves, "max_concurrency", "median_tpot_ms", "label", facet="group", log_x=True,
                    x_title="requests in flight", y_title="median time per output token (ms)")
plots.save(chart, Path(figures_dir) / "vllm_serve_h200_tpot.svg")
chart

# %% [markdown]
# Throughput ÷ `none`'s in the same group (dashed: 0.95, the serving issue's floor for the best config), and the
# best config per group. Configs are named by proposer and `batch_k` (width by requests in flight).

# %%
table = serve.load_curves(serve.speedup_table(rows)).filter(pl.col("config") != "none")
chart = plots.grouped_bars(table, "load", "ratio", "label", facet="group", y_title="output tok/s ÷ none",
                           rule_at=0.95, width=260)
plots.save(chart, Path(figures_dir) / "vllm_serve_h200_ratio.svg")
chart

# %%
table.pivot(on="label", index=["dataset", "temperature", "max_concurrency"], values="ratio").sort(
    "dataset", "temperature", "max_concurrency")

# %%
serve.best_ratio(table).select("dataset", "temperature", "max_concurrency", "label", "ratio", "median_ttft_ms",
                               "acceptance_length")

# %% [markdown]
# Throughput under load, measured: points of ten waves, three repeats interleaved across the configs, each repeat's
# steady-state rate (first request's end to last request's start: `hqlab.bench.serve.steady_state`) divided by
# `none`'s same repeat; a dot at the median, a bar over the repeats' range (one repeat where no bar shows).

# %%
loaded = serve.load_curves(serve.speedup_table(results.load("serve", load_runs),
                                               metric="steady_output_throughput")).filter(pl.col("config") != "none")
loaded = (loaded.group_by("dataset", "temperature", "max_concurrency", "label", "group", "load")
          .agg(pl.col("ratio").median(), pl.col("ratio_min").min(), pl.col("ratio_max").max(), pl.col("repeats").sum())
          .sort("dataset", "max_concurrency", "label"))
chart = plots.ranges(loaded, "load", "ratio", "ratio_min", "ratio_max", "label", facet="group",
                     rules={"none": 1.0}, y_title="steady-state tok/s ÷ none")
plots.save(chart, Path(figures_dir) / "serving_load.svg")
chart

# %%
loaded.select("group", "load", "label", "ratio", "ratio_min", "ratio_max", "repeats")

# %% [markdown]
# ## Where a served step's time goes
#
# Run `profile_run`'s profiled repeats timed every engine step inside each server (`hqlab.bench.serve_profile`: the
# worker's step timer through vLLM's `/collective_rpc`). Mean ms a step at the point's full load, split twice: on
# the host (the worker's `execute_model`, the sampler, the speculator's `propose`, the rest of `sample_tokens`, and
# what the engine core did between steps, waits included) and on the GPU (spans of the forward's graph replay, the
# sampler, the speculator, the rest, and what is left of the step: idle). Then each served step's cost ÷ `none`'s
# from the unprofiled repeats (time per output token × tokens a step), issue #62's acceptance number.

# %%
try:
    phases = results.load("serve", profile_run, "phases")
except results.MissingRun as missing:
    phases = None
    print(f"no served profile yet ({missing}): run plan benchmarks/plans/serve_{profile_run}.json on a GPU host")
if phases is not None:
    parts = serve_profile.served_parts(phases)
    chart = plots.stacked_time(serve_profile.part_bars(parts), "bar", sorted(set(parts["part"])), facet="load")
    plots.save(chart, Path(figures_dir) / "served_step_profile.svg")
    display(chart)
    display(parts.filter(pl.col("config") != "none").pivot(on="max_concurrency", index=["label", "part"],
                                                           values="extra_ms").sort("label", "part"))
    display(serve_profile.step_cost_ratios(results.load("serve", profile_run)))

# %% [markdown]
# The sampling test: each speculator's samples against `none`'s (same prompt, temperature 1), and a server with a
# planted verification bug, which must fail.

# %%
all_samples = results.load("serve", kind="samples")
reference = all_samples.filter((pl.col("run") == run) & (pl.col("config") == "none"))["token_ids"][0].to_list()
serve.sampling_verdicts(reference, all_samples.filter((pl.col("run") == run) & (pl.col("config") != "none")),
                        positions=positions)

# %% [markdown]
# Every other run's sampled servers against run `run`'s `none` (same model, same vLLM): longer and drawn drafter
# heads, the gated lookup, the lookup with the corpus.

# %%
serve.sampling_verdicts(reference, all_samples.filter(pl.col("run") != run), positions=positions)

# %% [markdown]
# ## The speculation gate, replayed
#
# `gpu-lookup:...,gate=G` verifies drafts on a step only when some request's history, as vLLM's scheduler knows it
# (three steps old under asynchronous scheduling), ends in G tokens seen earlier in it (`hqlab.rules.gate`). The
# replay walks recorded greedy outputs (the 0.5B's at 128 tokens; the served 1.5B's at 160 and 256) with that lag
# (`hqlab.replay.gate`, checked step for step against vLLM's own scheduler in tests/engines/vllm/test_vllm_gate.py)
# and prices the steps with two measured costs at one request:
# a plain step and a speculative one. Two cost pairs: the served engine's (run `gate_cost_run`: `none`'s time per
# token, and the lookup's time per token × its tokens a step) and the step-cost grid's (the same 1.5B shape, random
# weights, width 1 against the median of widths 2-32). A projection until the gated server is measured.

# %%
from hqlab.config import LookupConfig, resolve_spec
import numpy as np

from hqlab.replay import gate as gate_replay
from hqlab.replay import scale
from hqlab.replay.traces import load_traces

cost_rows = serve_rows.filter((pl.col("run") == gate_cost_run)
                                                 & pl.col("config").is_in(["none", gate_cost_config]))
served_plain, served_spec = serve.step_costs(cost_rows, gate_cost_config)
grid = results.load("seed_scale", gate_grid_run, "grid")
grid_plain, *grid_wide = scale.step_ms(grid, "qwen2.5-1.5b", "gpu-lookup", [1, 2, 4, 8, 16, 32], 1024, 1)
grid_spec = float(np.median(grid_wide))
costs = {f"served ({served_spec / served_plain:.2f}x a plain step)": (served_plain, served_spec),
         f"step-cost grid ({grid_spec / grid_plain:.2f}x)": (grid_plain, grid_spec)}
lookup = resolve_spec(gate_lookup, {"gpu-lookup": LookupConfig, "lookup": LookupConfig})[1]
steps = pl.concat([gate_replay.sweep(load_traces(f), lookup, [g or None for g in gate_min_matches])
                   .with_columns(pl.format("{} {}", pl.col("workload"), pl.lit(size)).alias("workload"))
                   for size, sets in gate_traces.items() for f in results.trace_files(sets)])
priced = pl.concat([gate_replay.price(steps, plain_ms=p, spec_ms=q).with_columns(pl.lit(name).alias("costs"))
                    for name, (p, q) in costs.items()])
results.write_run("gate_replay", "cpu", card="cpu", tables={"rows": priced}, root=results_dir)
shown = priced.filter(pl.col("workload").is_in(gate_plot))
chart = plots.lines_with_mark(shown, "min_match", "speedup", "workload", panel="costs", columns=2,
                              mark=(0, 1.0, "none"), log_x=False, x_title="gate length (0: no gate)",
                              y_title="tok/s ÷ none (replay, 1 request)")
plots.save(chart, Path(figures_dir) / "gate_replay.svg")
chart

# %%
priced.pivot(on="min_match", index=["costs", "workload"], values="speedup").sort("costs", "workload")

# %% [markdown]
# ## Which gate for which host
#
# What a speculative step costs over a plain one is a property of the host as much as of the card (1.49× in run
# `s3`, 1.22× in run `s4`, both H100s; 1.19× in the step-cost grid), and a gate's speed-up depends on the steps
# only through that ratio. The same replayed steps, priced at every ratio of `gate_cost_ratios`, each gate against
# the ungated lookup (`hqlab.replay.gate.by_cost_ratio`): above 1, the gate pays on that host. Measure your host's
# ratio with a serving run of `none` and the lookup at one request (`hqlab.bench.serve.step_costs`).

# %%
by_cost = gate_replay.by_cost_ratio(steps, gate_cost_ratios)
shown = (by_cost.filter(pl.col("workload").is_in(gate_plot) & pl.col("min_match").is_in(gate_cost_lengths)
                        & (pl.col("min_match") > 0))
         .with_columns(pl.format("gate={}", pl.col("min_match")).alias("gate")))
chart = plots.lines_with_mark(shown, "cost_ratio", "vs_ungated", "gate", panel="workload", columns=4,
                              mark=(1.0, 1.0, "no gate"), log_x=False, log_y=False,
                              x_title="speculative step ÷ plain step",
                              y_title="tok/s ÷ the ungated lookup (replay)")
plots.save(chart, Path(figures_dir) / "gate_by_cost.svg")
chart

# %%
best = (by_cost.sort("speedup", descending=True).group_by("workload", "cost_ratio", maintain_order=True).first()
        .pivot(on="cost_ratio", index="workload", values="min_match").sort("workload"))
best  # the gate length (0: none) with the best replayed speed, per workload and cost ratio

# %% [markdown]
# ## The goodput controller by load (replay)
#
# The controller fixes each step's width among 15, 7 and 0 by expected tokens per ms (docs/goodput.md). The committed
# replay (`benchmarks/goodput_replay.py`, run `goodput_replay/cpu`) serves the greedy traces at 1 to 64 in flight,
# ten waves a load, and prices every policy with the same step costs: the grid's, and the grid with each width's
# excess over a plain step ×2 and ×4 (the range a served step measured). `goodput` decides with the costs it is
# priced with, `goodput prior` with the grid whatever the truth, `goodput online` with its own steps' times, starting
# from the grid (`fixed 15` lies under `goodput prior`). Speed ÷ `none`, same costs.

# %%
goodput_rows = results.load("goodput_replay", "cpu", "rows")
shown = (goodput_rows.filter(pl.col("policy") != "none")
         .with_columns(pl.format("wide steps: grid excess x{}", pl.col("width_cost_factor")).alias("costs")))
chart = plots.line_grid(shown, "concurrency", "speedup", "policy", row="workload", column="costs",
                        x_title="requests in flight", y_title="tok/s ÷ none (replay)", x_ticks=[1, 8, 16, 32, 64])
plots.save(chart, Path(figures_dir) / "goodput_replay.svg")
chart

# %% [markdown]
# ## The goodput controller served (run s8a)
#
# Run `goodput_served_run`'s goodput servers from their recorded decisions (`serve_profile.goodput_served_costs`).
# Top: the share of calls at each width, by requests in the call. Bottom: the priced wide step over a plain one (the
# file's table; the online server's record holds only its prior) beside its served step over `none`'s (all steps;
# median, range over repeats). In s8a (H100, sampled chat) both stayed wide at 32 requests (99.8 % and 86 % of calls),
# priced at 1.18× and 1.43× a plain step; their steps cost 2.34× and 2.15×.

# %%
goodput_served = serve_profile.goodput_served_costs(results.load("serve", goodput_served_run, "goodput_decisions"),
                                                    results.load("serve", goodput_served_run))
shares, step_ratios = serve_profile.goodput_served_bars(goodput_served)
widths = [c for c in shares.columns if c.startswith("width ")]
chart = alt.vconcat(
    plots.stacked_time(shares, "batches", widths, facet="server", y_title="share of calls (by requests in the call)",
                       value="share", part_title="width", in_order=True),
    plots.ranges(step_ratios, "load", "ratio", "lo", "hi", "series", rules={"a plain step": 1.0},
                 y_title="wide step ÷ plain step", width=300)).resolve_scale(color="independent")
plots.save(chart, Path(figures_dir) / "goodput_served.svg")
chart

# %%
goodput_served.drop("config")

# %% [markdown]
# ## The gate, served
#
# The gated lookup (`gate=1`, `gate=2`) beside the ungated lookup, `gpu-fused` and `none`, each a `vllm serve`
# process of runs `gate_runs` (repeats interleaved: each repeat is divided by `none`'s same repeat; the bars are
# medians, the table gives the range). Then the step costs each run's host gave at one request on sampled prose:
# the gate pays in proportion to how much a speculative step costs over a plain one.

# %%
gate_rows = serve_rows.filter(pl.col("run").is_in(gate_runs))
gate_table = serve.load_curves(serve.speedup_table(gate_rows)).filter(pl.col("config") != "none")
chart = plots.grouped_bars(gate_table, "load", "ratio", "label", facet="group", y_title="output tok/s ÷ none",
                           rule_at=0.95, width=200, independent_y=True, legend_limit=400)
plots.save(chart, Path(figures_dir) / "gate_served.svg")
chart

# %%
gate_table.select("run", "group", "load", "label", "ratio", "ratio_min", "ratio_max", "repeats",
                  "acceptance_length", "median_tpot_ms", "median_ttft_ms").sort("group", "load", "label")

# %%
cost_runs = []
served = serve_rows.filter((pl.col("dataset") == "prose") & (pl.col("temperature") > 0)
                                              & pl.col("config").is_in(["none", gate_cost_config]))
for cost_run in [gate_cost_run, *gate_runs]:
    prose = served.filter(pl.col("run") == cost_run)
    if prose.filter(pl.col("max_concurrency") == 1).height:
        plain, spec = serve.step_costs(prose, gate_cost_config)
        cost_runs.append({"run": cost_run, "machine": prose["machine"][0].split(",")[0], "plain step ms": plain,
                          "speculative step ms": spec, "ratio": spec / plain})
pl.DataFrame(cost_runs)

# %% [markdown]
# The sampling test for the gated lookup: its samples against run `run`'s `none` (same model, same vLLM).

# %%
serve.sampling_verdicts(reference, all_samples.filter(pl.col("run").is_in(gate_runs)), positions=positions)

# %% [markdown]
# ## Drafts drawn from the drafter (`draft_sample=probabilistic`)
#
# Under sampling, the drafter's argmax verified as a point mass is accepted with p(argmax q); a draft drawn from the
# drafter's q and verified against it with 1 - TV(p, q). Both measured with the real models on the CPU over the target's
# own sampled answers (`experiments/drawn_draft_heads/draft_sampling_cpu.py`): the mean per answer position, with the
# lowest and highest prompt mean. Then what the gain would make of `projection_config`'s measured speedup on sampled
# prose at one request in run `projection_run`, at the same step cost (a one-token head: the gain is the whole change of
# tokens a step where the lookup proposes nothing). A projection, not a measurement: plan s5 measures it.

# %%
drafts = sampled_drafts.summary(results.load("draft_sampling", "cpu")).with_columns(
    pl.format("{} · T={}", pl.col("dataset"), pl.col("temperature")).alias("group"))
chart = plots.grouped_bars(drafts, "group", "acceptance", "draft",
                           y_title="acceptance of the drafter's token", width=360)
plots.save(chart, Path(figures_dir) / "draft_sampling_acceptance.svg")
chart

# %% [markdown]
# Would drawing the drafter at another temperature than the request's bring q closer to p? The same positions, the
# drafter drawn at T x scale and verified against that distribution (`--draft-scales`).

# %%
tempered = sampled_drafts.draft_temperature_summary(results.load("draft_temperature", "cpu")).with_columns(
    pl.format("{} · T={}", pl.col("dataset"), pl.col("temperature")).alias("group"))
chart = plots.lines(tempered, "draft_scale", "acceptance", "group", x_title="drafter's temperature ÷ the request's",
                    y_title="acceptance of a drawn draft, 1 − TV(p, q)")
plots.save(chart, Path(figures_dir) / "draft_temperature_acceptance.svg")
chart

# %%
measured = serve.speedup_table(serve_rows.filter(pl.col("run") == projection_run)).filter(
    (pl.col("config") == projection_config) & (pl.col("dataset") == "prose") & (pl.col("temperature") == 0.7)
    & (pl.col("max_concurrency") == 1))
gains = drafts.filter((pl.col("dataset") == "prose") & (pl.col("temperature") == 0.7)).pivot(
    "draft", index="group", values="acceptance")
gain = float(gains["sampled"][0] - gains["greedy"][0])
pl.DataFrame([{"run": projection_run, "measured ratio": r["ratio"], "repeats": r["repeats"],
               "tokens a step": r["acceptance_length"], "gain a step": gain,
               "projected ratio": sampled_drafts.projected_speedup(r["ratio"], r["acceptance_length"], gain)}
              for r in measured.iter_rows(named=True)])

# %% [markdown]
# Whole steps: the lab's `fused` proposer with plan s5's settings decoding prose at T = 0.7 with the real models on the
# CPU (`experiments/drawn_draft_heads/drawn_heads_cpu.py`), greedy drafts against drafts drawn from the drafter, heads
# of one to three tokens: tokens a step, and the drawn/greedy ratio with its 95 % range over prompts. Projected onto the
# GPU: `projection_config`'s measured speedup in `projection_run` (a greedy one-token head), times what a greedy head of
# that length ran against the one-token head in `head_speed_run`, times the ratio (the same step, more tokens).

# %%
heads = sampled_drafts.head_summary(results.load("drawn_heads", "cpu"))
long_heads = heads.unpivot(["greedy", "drawn"], index="head", variable_name="draft", value_name="tokens a step")
chart = plots.grouped_bars(long_heads.with_columns(pl.format("head of {}", pl.col("head")).alias("head")), "head",
                           "tokens a step", "draft", y_title="tokens a verify step (prose, T = 0.7)", width=300)
plots.save(chart, Path(figures_dir) / "drawn_heads_tokens.svg")
speeds = sampled_drafts.head_speeds(serve_rows, head_speed_run)
sampled_drafts.project_heads(heads, float(measured["ratio"].median()), speeds).with_columns(
    pl.col("head").replace_strict(speeds, return_dtype=pl.Float64).alias(f"greedy head speed ({head_speed_run})"))

# %%
chart

# %% [markdown]
# The drawn heads served (`served_heads_run`): each config's output throughput ÷ `none`'s at one request on sampled
# prose (the median of the repeats, each against `none`'s same repeat, and their range) beside the projection above,
# with the tokens a verify step and that step's time ÷ a plain step (time per output token × tokens a step).

# %%
served = serve.served_heads(serve_rows, served_heads_run)
projected = sampled_drafts.project_heads(heads, float(measured["ratio"].median()), speeds)
compared = pl.concat([
    served.select(pl.format("head of {}", pl.col("head")).alias("head"),
                  pl.format("{} drafts, measured ({})", pl.col("draft"), pl.lit(served_heads_run)).alias("source"),
                  "ratio", lo="ratio_min", hi="ratio_max"),
    projected.select(pl.format("head of {}", pl.col("head")).alias("head"),
                     pl.lit("drawn drafts, projected (CPU)").alias("source"),
                     pl.col("projected").alias("ratio"), lo="projected_lo", hi="projected_hi")])
chart = plots.ranges(compared, "head", "ratio", "lo", "hi", "source", rules={"the issue's 1.3×": 1.3, "none": 1.0},
                     y_title="output tok/s ÷ none (prose, T = 0.7, one request)")
plots.save(chart, Path(figures_dir) / "drawn_heads_served.svg")
served.drop("config", "machine")

# %%
chart

# %% [markdown]
# The drafter's prompt prefill, what `gpu-fused` adds to a new request's first token (`prefill_run`): wall time
# per prompt length of the eager calls the served config made (warm: the median of seven after a warm-up; first:
# the first call at a length not seen before, as a served request meets it) against 64-position passes replayed
# from one captured CUDA graph (`prefill_graph`).

# %%
prefill = vllm_report.prefill_times(json.loads(results.read_text("fused_pass_kernels", prefill_run, "profile.json")))
chart = plots.lines_with_mark(prefill.with_columns(pl.col("call").replace_strict(
    {"warm": "warm (median of 7)", "first": "first call at a new length"}).alias("call")), "prompt", "ms", "label",
    panel="call", columns=2, x_title="prompt tokens", y_title="drafter prefill (ms, wall)")
plots.save(chart, Path(figures_dir) / "drafter_prefill.svg")
prefill.filter(pl.col("prompt") <= 256).pivot("variant", index=["call", "prompt"], values="ms")

# %%
chart

# %% [markdown]
# The first token's fix served (`prefill_runs`): the served `gpu-fused` (`projection_config`) and the same with
# `prefill_graph=1024` on sampled prose (T = 0.7) at one request, each repeat divided by `none`'s same repeat (the
# median and the range), with the median time to the first token.

# %%
served_runs = serve_rows.filter(
    pl.col("run").is_in(prefill_runs) & (pl.col("dataset") == "prose") & (pl.col("temperature") == 0.7)
    & (pl.col("max_concurrency") == 1)
    & pl.col("config").is_in(["none", projection_config, projection_config + ",prefill_graph=1024"]))
first_token = serve.speedup_table(served_runs).with_columns(
    pl.col("config").map_elements(serve.short_config, return_dtype=pl.String).alias("label"),
    pl.format("{} ({})", pl.col("run"), pl.col("machine").str.extract(r"(H\d00)")).alias("served run"))
chart = plots.ranges(first_token.filter(pl.col("config") != "none"), "served run", "ratio", "ratio_min", "ratio_max",
                     "label", rules={"the issue's 1.3×": 1.3},
                     y_title="output tok/s ÷ none (prose, T = 0.7, one request)")
plots.save(chart, Path(figures_dir) / "prefill_graph_served.svg")
first_token.select("served run", "label", "ratio", "ratio_min", "ratio_max", "repeats", "output_throughput",
                   "median_ttft_ms", "acceptance_length")

# %%
chart

# %% [markdown]
# ## The soak (#60)
#
# One `vllm serve` a config kept at 64 requests in flight for five minutes by clients that mix chat, prose and the
# handbook's tasks, token limits from 8 to 256, greedy and sampled requests, n = 2, log-probabilities, streams, and
# disconnect from a tenth of their requests at a random point (plan `benchmarks/plans/soak_k1.json`,
# `hqlab.bench.soak`). Every 5 s: the server's output tokens a second, its processes' resident memory and the card's
# GPU memory in use, one line per config; then each run's totals and the plan's pass criteria that failed. Until a
# soak run is committed, these cells print a note and draw nothing.

# %%
chart = soak.figure()
if chart is not None:
    plots.save(chart, Path(figures_dir) / "soak.svg")
chart

# %%
soak_rows = soak.committed("rows")
soak_rows if soak_rows is None else soak_rows.select(
    "run", "config", "duration_s", "requests", "served", "errors", "hangs", "disconnects", "left_on_server",
    "tokens_per_s", "throughput_drift", "rss_growth", "gpu_growth", "failed_criteria")
