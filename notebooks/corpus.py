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
# # Lookup beyond one request: a corpus of earlier outputs (#42)
#
# The lookup searches the request's own history. A **corpus** of recent outputs (optionally prompts) extends
# the search to earlier requests: the same suffix-match rule over a FIFO of documents (`hqlab.rules.corpus`), with
# a policy for which source wins (`own`: own history first; `longest`: the longer match). Under greedy decoding
# every step a configuration would take follows from the recorded outputs and the order requests finish, so the
# whole grid (corpus size × match length × policy × requests in flight × workload) is replayed exactly on the CPU
# from the committed traces (`hqlab.replay.corpus`) and priced with step costs measured on an H200 at batch 1
# and 8. Arctic's suffix decoding (a per-request suffix tree plus a global tree of earlier outputs, scored by
# frequency) runs beside it over the same earlier outputs. Nothing here runs the model: the traces are the 0.5B's
# greedy outputs on the corpus workloads (`experiments/corpus_workloads/corpus_workloads.py`).

# %% tags=["parameters"]
trace_set = "0.5b_corpus_128"  # a run of the study `traces` (data/results/traces/<set>/)
workloads = ["multiturn", "template", "agent", "prose"]
corpus_sizes = [0, 256, 1024, 4096, 16384]  # tokens; 0 = no corpus (the plain lookup)
nmins = [1, 3]
nmax = 32
k = 15
policies = ["own", "longest"]
inflight = [1, 8]  # requests in flight
schedules = ["admit", "lockstep"]  # with several in flight: corpus frozen at admission, or updated as requests finish
prompts = [False, True]  # corpus documents: outputs only, or prompt + output (at the largest size only)
arctic = True  # Arctic's rule beside (its global tree bounded by the same sizes)
arctic_depth = 24
step_cost_run = "h200"  # measured verify steps: a run of the study `step_cost` (experiments/verify_step_cost/)
cost_model = "qwen2.5-0.5b"
search_ms_per_1k = 0.001  # the corpus kernel's price per step per 1k live tokens (see docs/corpus.md)
vllm_run = "c1"  # the corpus inside vLLM: a run of the study `corpus` (benchmarks/vllm_corpus.py finish)
vllm_runs_compared = ["c1", "c2", "c3"]  # the vLLM runs side by side (c2: all 24 multi-turn requests, and
# k = 31; c3: a batch job of 153 requests over the template)
sweep_run = "c1"  # GPU settings over that run's outputs: a run of corpus_sweep_replay (its benchmark)
sweep_show = 8  # settings listed, best worst margin first
# warm-up and corpus size (#61): the served setting over the corpus workloads' traces and one vLLM point's outputs
warmup_served = "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest,corpus=32768,corpus_policy=longest,corpus_prompts=1"
warmup_workloads = ["batch", "template", "multiturn", "prose"]  # streams from the traces above
warmup_vllm = {"run": "c4c", "workload": "batch", "load": 8, "repeat": 0}  # a vLLM point's outputs ({}: none)
warmup_vllm_model = "qwen2.5-1.5b"  # its step costs' shape
warmup_loads = [1, 8]  # requests in flight
warmup_tokens = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 262144, 1048576]  # corpus bounds (tokens)
warmup_docs = [1, 2, 4, 8, 16, 64, 1024]  # corpus_docs bounds (tokens unbounded)
warmup_arctic_cached = [1, 4, 16]  # Arctic's global tree bounded by requests (beside vLLM's default 10,000)
warmup_arctic_loads = [1]  # loads of Arctic's bounded trees (its default runs at every load)
warmup_within = 0.01  # the knee: the smallest bound within this share of the best tokens a step
warmup_search_fit_run = "c3"  # the upper search price: that run's corpus time a step beyond the lookup's
figures_dir = "figures"
results_dir = "data/results"  # where the replays write their runs (corpus_replay/cpu, corpus_warmup_replay/cpu)

# %%
from pathlib import Path

import altair as alt
from IPython.display import display
import polars as pl

from hqlab import plots
from hqlab.bench import corpus_report, results
from hqlab.replay import corpus as rc
from hqlab.replay import corpus_vllm as cv
from hqlab.replay.traces import load_traces

alt.renderers.enable("svg")
pl.Config.set_tbl_width_chars(200)
pl.Config.set_tbl_rows(60)
figures = Path(figures_dir)
figures.mkdir(parents=True, exist_ok=True)
all_traces = load_traces(results.run_file("traces", trace_set, "traces.parquet"))
traces = {w: [t for t in all_traces if t.category == w] for w in workloads}
empty = [w for w, ts in traces.items() if not ts]
if empty:
    raise ValueError(f"trace set {trace_set} has no traces of workload(s) {empty}")
costs = rc.step_models(results.load("step_cost", step_cost_run), model=cost_model)
for label, model in costs.items():
    print(label, model.describe())
print({w: len(ts) for w, ts in traces.items()}, "requests")

# %% [markdown]
# ## The grid, replayed per workload
#
# Each workload is its own stream of requests (a client's sessions against one server), so each gets its own
# corpus. With 8 requests in flight, `admit` freezes a request's corpus when it is admitted (the outputs of the
# requests up to 8 before it: the earlier waves of the sessions), a lower bound; `lockstep` steps the 8 together
# and adds each output as it finishes, for the requests still decoding (an idealised server).

# %%
loads = [f"inflight={b},schedule={s}" for b in inflight for s in (schedules if b > 1 else schedules[:1])]
specs = [f"corpus:nmin={n},nmax={nmax},k={k},tokens={size},choice={p},{load}"
         for n in nmins for size in corpus_sizes for p in (policies if size else policies[:1]) for load in loads]
specs += [f"corpus:nmin={n},nmax={nmax},k={k},tokens={max(corpus_sizes)},choice={p},{load},prompts=true"
          for n in nmins for p in policies for load in loads if True in prompts and max(corpus_sizes)]
if arctic:
    specs += [f"arctic:k={k},depth={arctic_depth},tokens={size},{load}" for size in corpus_sizes for load in loads]
frame = pl.concat([rc.rows(traces[w], specs, costs=costs, search_ms_per_1k=search_ms_per_1k) for w in workloads])
results.write_run("corpus_replay", "cpu", card="cpu", tables={"rows": frame}, root=results_dir)
summary = rc.summarize(frame).with_columns(
    pl.when(pl.col("inflight") == 1).then(pl.col("speedup_b1")).otherwise(pl.col("speedup_b8")).alias("speedup"),
    pl.when(pl.col("inflight") == 1).then(pl.lit("1 in flight"))
    .otherwise(pl.format("{} in flight, {}", "inflight", "schedule")).alias("load"))
plain = summary.filter((pl.col("rule") == "corpus") & (pl.col("tokens") == 0)).select(
    "workload", "nmin", "load", pl.col("tokens_per_step").alias("plain_tps"),
    pl.col("speedup").alias("plain_speedup"))
summary = summary.join(plain, on=["workload", "nmin", "load"], how="left").with_columns(
    (pl.col("speedup") / pl.col("plain_speedup")).alias("vs_plain"))
summary.select("workload", "rule", "nmin", "tokens", "choice", "prompts", "load", "tokens_per_step",
               "corpus_accepted_share", "speedup", "vs_plain").sort("workload", "rule", "nmin", "load", "tokens")

# %% [markdown]
# ## Tokens per step and projected speedup against corpus size
#
# Lines: the corpus rule per choice policy (outputs only), at nmin 1; the size-0 point of every line is the plain
# lookup. Arctic's rule, its global tree bounded by the same number of tokens, is the blue line. One row per
# workload: one request at a time, then 8 in flight under each schedule. Speedup is projected with the H200's step
# costs at the 0.5B's shape: batch 1 for one request at a time, batch 8 for 8 in flight, against no speculation.

# %%
def lines_of(nmin: int) -> pl.DataFrame:
    corpus_rows = summary.filter((pl.col("rule") == "corpus") & (pl.col("nmin") == nmin) & ~pl.col("prompts"))
    label = pl.format("corpus, {}", "choice").alias("rule_label")
    series = [corpus_rows.filter(pl.col("tokens") > 0).with_columns(label)]
    for p in policies:  # the plain lookup starts every policy's line
        plain_rows = corpus_rows.filter(pl.col("tokens") == 0)
        series.append(plain_rows.with_columns(pl.lit(f"corpus, {p}").alias("rule_label")))
    if arctic:
        arctic_rows = summary.filter(pl.col("rule") == "arctic")
        series.append(arctic_rows.with_columns(pl.lit("Arctic suffix").alias("rule_label")))
    out = pl.concat(series, how="diagonal_relaxed").with_columns(
        pl.format("{} · {}", "workload", "load").alias("panel"),
        (pl.col("tokens").cast(pl.Float64).clip(64)).alias("corpus_tokens"))  # 0 drawn at 64 on the log axis
    return out.sort("panel", "rule_label", "corpus_tokens")


chart = plots.lines(lines_of(1), "corpus_tokens", "tokens_per_step", "rule_label", facet="panel", log_x=True,
                    x_title="corpus tokens (64 = none)", y_title="tokens per step")
plots.save(chart, figures / "corpus_tokens_per_step.svg")
chart

# %%
chart = plots.lines(lines_of(1), "corpus_tokens", "speedup", "rule_label", facet="panel", log_x=True,
                    x_title="corpus tokens (64 = none)", y_title="projected speedup (H200 step costs)")
plots.save(chart, figures / "corpus_speedup.svg")
chart

# %% [markdown]
# ## Corpus size × match length
#
# Speedup over the same configuration without a corpus (policy `longest`, one request at a time), per nmin and
# corpus size.

# %%
grid = summary.filter((pl.col("rule") == "corpus") & (pl.col("choice") == policies[-1]) & (pl.col("inflight") == 1)
                      & (pl.col("tokens") > 0) & ~pl.col("prompts"))
chart = plots.heatmap(grid.with_columns(pl.col("tokens").alias("corpus tokens")), "corpus tokens", "nmin", "vs_plain",
                      facet="workload", title="× without corpus", fmt=".2f")
plots.save(chart, figures / "corpus_match_length.svg")
chart

# %% [markdown]
# ## Side by side: the plain lookup, the corpus and Arctic's rule
#
# At the largest corpus size: tokens per step and projected speedup per workload and load (8 in flight: lockstep).

# %%
big = max(corpus_sizes)
pick = pl.concat([
    summary.filter((pl.col("rule") == "corpus") & (pl.col("tokens") == 0) & (pl.col("nmin") == 1))
    .with_columns(pl.lit("lookup, no corpus").alias("config")),
    *[summary.filter((pl.col("rule") == "corpus") & (pl.col("tokens") == big) & (pl.col("nmin") == 1)
                     & (pl.col("choice") == p) & ~pl.col("prompts")).with_columns(pl.lit(f"corpus {p}").alias("config"))
      for p in policies],
    *([summary.filter((pl.col("rule") == "arctic") & (pl.col("tokens") == t)).with_columns(
        pl.lit("Arctic, own tree" if t == 0 else "Arctic, + global tree").alias("config")) for t in (0, big)]
      if arctic else []),
], how="diagonal_relaxed").filter((pl.col("inflight") == 1) | (pl.col("schedule") == schedules[-1])).with_columns(
    pl.format("{} · {} in flight", "workload", "inflight").alias("panel"))
chart = plots.bar_panels(pick, "panel", "config", {"tokens_per_step": "tokens per step",
                                                   "speedup": "projected speedup"})
plots.save(chart, figures / "corpus_arctic.svg")
pick.select("panel", "config", "tokens_per_step", "corpus_accepted_share", "speedup")

# %% [markdown]
# ## Measured inside vLLM
#
# The corpus config (`gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest,corpus=32768,corpus_policy=longest,
# corpus_prompts=1`) against the same lookup without the corpus, on vLLM's GPU step (`benchmarks/vllm_corpus.py`:
# the 1.5B, greedy, 256 new tokens, two repeats; the card is in the rows). Dots: median of the repeats' ratios, bars:
# their range. Beside it the replay's projection above for the same rule (nmin 1, `longest`, prompts in the corpus,
# the largest corpus size; 8 in flight: the dot is `lockstep`, the bar reaches `admit`), from the 0.5B's traces
# priced with H200 step costs: a different model, output length and request count, so only roughly comparable.

# %%
points = results.load("corpus", vllm_run)
measured = corpus_report.speedups(points)
print(points["device"].unique().to_list(), points["vllm"].unique().to_list(), points["model"].unique().to_list())
panel = pl.format("{} in flight", "load").alias("panel")
series = [measured.select("workload", panel, pl.lit(f"measured in vLLM, {points['model'][0]}").alias("source"),
                          "vs_no_corpus", "vs_no_corpus_lo", "vs_no_corpus_hi")]
projected = summary.filter((pl.col("rule") == "corpus") & (pl.col("nmin") == 1) & (pl.col("choice") == "longest")
                           & (pl.col("tokens") == max(corpus_sizes)) & pl.col("prompts"))
if projected.height:  # one request: its one schedule; 8 in flight: the dot at the last schedule, the bar over all
    series.append(projected.group_by("workload", pl.col("inflight").alias("load")).agg(
        pl.col("vs_plain").sort_by(pl.col("schedule") == schedules[-1]).last().alias("vs_no_corpus"),
        pl.col("vs_plain").min().alias("vs_no_corpus_lo"), pl.col("vs_plain").max().alias("vs_no_corpus_hi"))
        .select("workload", panel, pl.lit(f"replay projection, traces {trace_set}").alias("source"),
                "vs_no_corpus", "vs_no_corpus_lo", "vs_no_corpus_hi"))
order = {w: i for i, w in enumerate(dict.fromkeys([*workloads, *measured["workload"].to_list()]))}
speed = pl.concat(series).sort("panel", pl.col("workload").replace_strict(order), "source")
bars = {f"{v}× ({', '.join(w for w, b in corpus_report.BAR.items() if b == v)})": v
        for v in sorted(set(corpus_report.BAR.values()), reverse=True)}
chart = plots.ranges(speed, "workload", "vs_no_corpus", "vs_no_corpus_lo", "vs_no_corpus_hi", "source",
                     facet="panel", rules=bars, y_title="× the same lookup without the corpus")
plots.save(chart, figures / "corpus_vllm.svg")
chart

# %%
measured.drop("run", "config", "base_config")

# %%
corpus_report.greedy_differences(results.load("corpus", vllm_run, "requests")).drop("run")

# %% [markdown]
# ### The vLLM runs side by side
# Every committed run's corpus configs against the same lookup without the corpus (c1: the first 10 multi-turn
# requests one at a time, 16 with 8 in flight, two repeats; c2: all 24 multi-turn requests at both loads, three
# repeats, c1's config and k = 31 with `corpus_policy=own` over outputs only; c3: the batch job, 24 requests one at
# a time and 153 with 8 in flight, three repeats). Dots: median of the repeats' ratios, bars: their range.

# %%
runs_points = results.load("corpus", vllm_runs_compared)
by_run = corpus_report.speedups(runs_points).with_columns(
    pl.format("{}: {}", "run", pl.col("config").map_elements(corpus_report.label, return_dtype=pl.String))
    .alias("source"), panel)
chart = plots.ranges(by_run.sort("panel", pl.col("workload").replace_strict(order, default=len(order)), "source"),
                     "workload", "vs_no_corpus", "vs_no_corpus_lo", "vs_no_corpus_hi", "source", facet="panel",
                     rules=bars, y_title="× the same lookup without the corpus")
plots.save(chart, figures / "corpus_vllm_runs.svg")
chart

# %%
by_run.select("run", "source", "workload", "load", "vs_no_corpus", "vs_no_corpus_lo", "vs_no_corpus_hi", "vs_none",
              "base_tokens_per_step", "tokens_per_step", "corpus_step_share", "replay_exact", "repeats")

# %% [markdown]
# ### The first wave and the rest
# With `load` in flight the first `load` requests of a point start before any answer has finished, so the corpus
# holds nothing of their kind; every later request finds the answers finished before it
# (`corpus_report.waves`). Per request: decoded tokens over decode time, with ÷ without the corpus in each repeat
# (dot: median, bar: range). A point's ratio above mixes the two; a longer batch job is mostly its later wave.

# %%
wave_rows = corpus_report.waves(results.load("corpus", vllm_runs_compared, "requests"))
by_wave = wave_rows.with_columns(
    pl.format("{}: {}, {} wave", "run", pl.col("config").map_elements(corpus_report.label, return_dtype=pl.String),
              "wave").alias("source"), panel)
chart = plots.ranges(by_wave.sort("panel", pl.col("workload").replace_strict(order, default=len(order)), "source"),
                     "workload", "stream", "stream_lo", "stream_hi", "source", facet="panel", rules=bars,
                     y_title="per-request decode rate, × without the corpus")
plots.save(chart, figures / "corpus_waves.svg")
chart

# %%
by_wave.select("source", "workload", "load", "requests", "base_tokens_per_step", "tokens_per_step",
               "tokens_per_step_ratio", "stream", "stream_lo", "stream_hi")

# %% [markdown]
# ### Where the time goes with 8 in flight
# The share of the requests' decode time spent in slow steps (over 3× the point's median step, from the front end's
# clock): with 8 in flight about one per request admitted, each holding up the others. Dot: median of the repeats,
# bar: their range. Runs that kept their step intervals (`finish` since c3).

# %%
slow = corpus_report.slow_steps(results.load("corpus", vllm_runs_compared))
if slow.height:
    slow_view = slow.with_columns(pl.format("{}, {} in flight", "workload", "load").alias("point"),
                                  pl.format("{}: {}", "run", "who").alias("config in run"))
    chart = plots.ranges(slow_view, "point", "slow", "slow_lo", "slow_hi", "config in run",
                         y_title="share of decode time in slow steps")
    plots.save(chart, figures / "corpus_admissions.svg")
    display(chart)
slow.drop("config")

# %% [markdown]
# ## Which GPU setting would clear the bar? Replayed over run c1's own outputs
#
# Every setting the vLLM speculator accepts (nmin, nmax, k, ties, corpus size, `corpus_policy`, `corpus_prompts`),
# replayed over the outputs c1 recorded (exact tokens per step for those outputs; 8 in flight as the benchmark's
# closed loop) and priced with c1's own clocks (`hqlab.replay.corpus_vllm`: the lookup's ms per step and per
# iteration, the corpus search's ms per 1,000 live tokens; other k scaled by the 1.5B's vLLM step-cost grid).
# `benchmarks/corpus_sweep_replay.py` writes the grid; here it is read and ranked by each setting's worst margin
# over the issue's bars. Projections, not measurements: the calibration rows put c1's own setting beside what c1
# measured.

# %%
sweep = results.load("corpus_sweep_replay", sweep_run)
calibration = sweep.filter(pl.col("kind") == "calibration")
swept = sweep.filter(pl.col("kind") == "sweep")
ranking = cv.meets(swept, corpus_report.BAR)
print(f"{ranking.height} settings, {ranking['meets_all'].sum()} projected to clear every bar")
calibration.select("workload", "load", "base_tokens_per_step", "tokens_per_step", "vs_no_corpus", "measured",
                   "measured_lo", "measured_hi")

# %%
ranking.drop("setting", "points").head(sweep_show)

# %% [markdown]
# Per barred point: what c1 measured (dot: median of its repeats, bar: their range), the replay's projection of
# c1's setting, of the setting with the best worst margin, and of the best setting for that point alone.

# %%
best = ranking["gpu_spec"][0]
barred = swept.filter(pl.col("workload").is_in(list(corpus_report.BAR)))
per_point = barred.sort("vs_no_corpus", descending=True).group_by("workload", "load", maintain_order=True).first()
ratio = [pl.col("vs_no_corpus").alias(c) for c in ("x", "lo", "hi")]  # a projection: one value, no range
barred_calibration = calibration.filter(pl.col("workload").is_in(list(corpus_report.BAR)))
series = [barred_calibration.select("workload", "load", pl.lit(f"measured, run {vllm_run}").alias("source"),
                                    pl.col("measured").alias("x"), pl.col("measured_lo").alias("lo"),
                                    pl.col("measured_hi").alias("hi")),
          barred_calibration.select("workload", "load", pl.lit(f"projected, run {vllm_run}'s setting").alias("source"),
                                    *ratio),
          barred.filter(pl.col("gpu_spec") == best).select(
              "workload", "load", pl.lit("projected, best worst margin").alias("source"), *ratio),
          per_point.select("workload", "load", pl.lit("projected, best for that point").alias("source"), *ratio)]
chart_data = pl.concat(series).with_columns(pl.format("{} in flight", "load").alias("panel")).sort("panel")
chart = plots.ranges(chart_data, "workload", "x", "lo", "hi", "source", facet="panel", rules=bars,
                     y_title="× the same lookup without the corpus")
plots.save(chart, figures / "corpus_sweep.svg")
print("best worst margin:", best)
per_point.select("workload", "load", "gpu_spec", "vs_no_corpus", "base_tokens_per_step", "tokens_per_step")

# %% [markdown]
# ## Why multi-turn gains little one request at a time
#
# At every output position of c1's one-at-a-time multi-turn point (8 first turns, then 2 second turns), what the
# own-history match and the corpus match (every earlier request's prompt and output) would each have accepted at
# k = 15. `best` is their maximum: walking it step by step bounds what any choice between the two sources can
# reach at this k.

# %%
mt = results.load("corpus", vllm_run, "requests")
mt_traces = cv.point_traces(mt, workload="multiturn", load=1)
mt_turns = dict(mt.filter(pl.col("workload") == "multiturn").select("request", "turn").unique().iter_rows())
positions = cv.reuse_by_position(mt_traces, turn_of=mt_turns)
print({c: round(cv.oracle_tokens_per_step(positions, c), 3) for c in ("own_accepted", "corpus_accepted", "best")},
      "tokens per step walking each source alone and their best")
positions.group_by("turn").agg(
    pl.col("request").n_unique().alias("requests"), pl.len().alias("positions"),
    (pl.col("corpus_accepted") > pl.col("own_accepted")).mean().alias("corpus_better"),
    pl.col("own_accepted").mean(), pl.col("corpus_accepted").mean(), pl.col("best").mean(),
    (pl.col("corpus_len") == 0).mean().alias("no_corpus_match"),
    pl.col("corpus_len").median().alias("corpus_match_len_median")).sort("turn")


# %% [markdown]
# ## Warm-up and corpus size (#61)
#
# The served setting (`warmup_served`) replayed over each workload's requests in the order they are sent
# (`hqlab.replay.warmup`): tokens a step against how many requests came before (bins 1, 2, 3–4, 5–8, ...), and the
# same streams with the corpus bounded from 1k to 1M tokens (FIFO of whole documents, as served) or by documents
# (`corpus_docs`). Beside it the lookup alone and Arctic's rule as vLLM's `suffix` runs by default (depth 24, up to
# 24 tokens, a global tree of the last 10,000 requests' outputs, bounded here also to fewer requests). One more
# stream: the batch job's outputs as vLLM served them at 8 in flight (the 1.5B, 256 tokens), with vLLM's own tokens
# a step per request drawn dashed. Speed is projected with the step costs above (the 1.5B's shape for its stream),
# the corpus search priced at `search_ms_per_1k` and, as an upper bound, at all of `warmup_search_fit_run`'s extra
# time a step with the corpus over the live tokens it searched.

# %%
from hqlab.replay import warmup as wu

streams = {w: [t for t in all_traces if t.category == w] for w in warmup_workloads}
stream_costs = {w: costs for w in streams}
measured = None
lookup_setting = wu.served(warmup_served, tokens=0)
corpus_setting = wu.served(warmup_served)
if warmup_vllm:
    point = results.load("corpus", warmup_vllm["run"], "requests").filter(
        (pl.col("workload") == warmup_vllm["workload"]) & (pl.col("load") == warmup_vllm["load"])
        & (pl.col("repeat") == warmup_vllm["repeat"]))
    served_stream = f"{warmup_vllm['workload']}, vLLM outputs ({warmup_vllm_model})"
    streams[served_stream] = cv.point_traces(point, workload=warmup_vllm["workload"], load=warmup_vllm["load"],
                                             repeat=warmup_vllm["repeat"], config=warmup_served)
    stream_costs[served_stream] = rc.step_models(results.load("step_cost", step_cost_run), model=warmup_vllm_model,
                                                 batches=warmup_loads)
    measured = wu.measured_rows(point, stream=served_stream, label_of={
        warmup_served: "measured in vLLM: hqlab corpus", cv.gpu_spec(lookup_setting): "measured in vLLM: lookup alone"})
search_upper = cv.fit_prices(results.load("corpus", warmup_search_fit_run, "requests")).live_ms_per_1k
labels = {"lookup": "lookup alone", "corpus": "hqlab corpus", "arctic": "Arctic, vLLM's suffix defaults"}
prices = {f", search {search_ms_per_1k:g} ms per 1k": search_ms_per_1k, f", search {search_upper:.3f} ms per 1k":
          search_upper}
palette = [*labels.values(), "measured in vLLM: lookup alone", "measured in vLLM: hqlab corpus",
           *[labels["corpus"] + p for p in prices]]
settings = [(labels["lookup"], lookup_setting), (labels["corpus"], corpus_setting), (labels["arctic"], wu.VLLM_SUFFIX)]
settings += [(labels["corpus"], c) for c in wu.bounds(corpus_setting, tokens=warmup_tokens, docs=warmup_docs)
             if c != corpus_setting]
warm_rows = pl.concat([
    wu.replay_rows(streams, settings, loads=warmup_loads, costs=stream_costs, progress=True),
    wu.replay_rows(streams, [(labels["arctic"], c) for c in wu.bounds(wu.VLLM_SUFFIX, docs=warmup_arctic_cached)],
                   loads=warmup_arctic_loads, costs=stream_costs, progress=True)], how="diagonal_relaxed")
results.write_run("corpus_warmup_replay", "cpu", card="cpu", tables={"rows": warm_rows}, root=results_dir,
                  info={"benchmark": "notebooks/corpus.py"})
print({s: len(ts) for s, ts in streams.items()}, "requests;", f"search price upper bound {search_upper:.3f} ms per 1k")

# %% [markdown]
# ### How fast the corpus warms up
#
# Tokens a step and projected speedup per bin of requests sent before, the served size (32,768 tokens) and
# Arctic at vLLM's defaults; with 8 in flight the 7 requests sent just before a request are still decoding.

# %%
warm_settings = [lookup_setting.spec(), corpus_setting.spec(), wu.VLLM_SUFFIX.spec()]
curve = wu.warmup(warm_rows.filter(pl.col("setting").is_in(warm_settings)), search_ms_per_1k=search_ms_per_1k,
                  measured=measured)
chart = plots.line_grid(wu.warmup_lines(curve), "request", "value", "label", row="panel_row", column="stream",
                        x_title="request number (bins start 1, 2, 3, 5, 9, ...)", y_title="", dash="measured",
                        x_ticks=[1, 2, 5, 10, 20, 50, 100], colors=palette)
plots.save(chart, figures / "corpus_warmup.svg")
chart

# %%
curve.pivot(on="inflight", index=["stream", "label", "bin"], values="tokens_per_step").sort("stream", "label", "bin")

# %% [markdown]
# ### The corpus bound
#
# Pooled over each stream: tokens a step against the bound in tokens and in documents (Arctic's in requests), the
# lookup alone and Arctic at vLLM's defaults drawn flat; projected speedup with 8 in flight at both search prices.
# The knee: the smallest bound within `warmup_within` of the best tokens a step.

# %%
speed = {suffix: wu.by_bound(warm_rows, search_ms_per_1k=price) for suffix, price in prices.items()}
bounded = next(iter(speed.values()))
chart = plots.line_grid(wu.size_lines(bounded, speed=speed, speed_loads=[max(warmup_loads)]), "bound", "value",
                        "label", row="panel_row", column="stream", x_title="corpus bound (tokens, or documents)",
                        y_title="", x_ticks=[1, 10, 100, 1e3, 1e4, 1e5, 1e6], colors=palette)
plots.save(chart, figures / "corpus_size.svg")
chart

# %%
knees = pl.concat([wu.knee(bounded, within=warmup_within), wu.knee(bounded, over="docs", within=warmup_within)])
knees.sort("label", "bound", "stream", "inflight")

