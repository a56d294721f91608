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
# gpu-fused inside vLLM's GPU step: always the published H200 results (a rerun above does not touch them)
fused_vllm_file = "data/results/vllm_fused_h200.parquet"  # benchmarks/vllm_gpu.py (`hqlab bench` rows)
fused_run = "fb"  # the acceptance pair: target Qwen2.5-Coder-1.5B, drafter 0.5B ("fa": both the 0.5B, first run)
measured_run = "fe"  # the same pair with the one-pass configs the replay below predicted ("fd": their first run)
compiled_run = "ff"  # the skip with nmin_alone, the fusion rule eager and compiled (torch.compile, compile_rule)
interleaved_run = "fg"  # ff's compiled config again, its engine alive next to none's and the lookup's (--interleave)
draft_model_run = "fg2"  # vLLM's draft model and the same fused config interleaved, with the burst of four
skip_config = ("gpu-fused:k=15,draft_block=1,nmax=32,policy=earliest,compile=true,schedule=long,nmin_tail=1,skip=2,"
               "skip_on=head,nmin_alone=1,compile_rule=true")
fused_profile_file = "data/results/fused_drafter_profile_h200_fb.json"  # experiments/drafting_step_profile/fused_drafter_profile.py
# the same profile run with --variants --autotune: FlashAttention splits, plan once, torch.compile max-autotune
kernel_settings_file = "data/results/fused_drafter_profile_h200_fc.json"
fused_skip_host_file = "data/results/fused_skip_host_h200.parquet"  # experiments/host_proven_skip/fused_skip_host.py --fold
# experiments/drafter_skip_replayed/fused_skip_replay.py over run fg's outputs: the skip config at k = 15 and 31, the lookup alone at both
width_replay_file = "data/results/fused_width_replay.parquet"
widths_run = "fh"  # both lookup widths and the skip config at k = 31, interleaved with none (3 rounds)
widths_burst_run = "fh2"  # the k = 31 skip config again, alone and in the burst of four
skip_config_k31 = skip_config.replace("k=15,", "k=31,", 1)
two_configs_run = "fi1"  # none, the lookup at k = 31 and 15, the skip config at k = 31 and the one-pass config
# at k = 15 without the skip, interleaved (2 rounds: five engines took 8 of the call's 10 minutes to start)
one_pass_k15 = (
    "gpu-fused:k=15,draft_block=1,nmax=32,policy=earliest,compile=true,schedule=long,nmin_tail=1,compile_rule=true")
device_skip_run = "fj1"  # none, the lookup at k = 31 and 15, the one-pass config at k = 15 and at k = 31 with
# the skip decided on the device, interleaved (10 rounds, the burst of four; vLLM's draft model from a second call)
device_skip_k31 = one_pass_k15.replace("k=15,", "k=31,", 1) + ",device_skip=true"
profiled_run = "fk1"  # fj1's five configs again, 8 interleaved rounds, then one profiled pass (GPU time by phase)
triton_run = "fl1"  # fk1's fused configs on the Triton layers and attention, 6 interleaved rounds + the burst of four
triton_suffix = ",layers=triton,attention=triton"
tuned_run = "fm1"  # fl1's configs with sweep t4's tiles, 11 interleaved rounds + the burst, profiled; vLLM's draft
# model from a second call
lazy_run = "fn1"  # fm1's configs with the lazy catch-up (catch_up=lazy, the default), the
# burst of four mixing copy with chat, qa and summary; 11 rounds + the burst, profiled; vLLM's draft model after
exact_run = "fn2"  # fn1's bench again, its records carrying the drafter's head token (the exact replay); an adaptive
# config (k = 15, drafter block 7) in the same burst from the call before, vLLM's draft model from the call after
whole_block_run = "fn3a"  # fn2's adaptive config again (alone and in the burst, 3 repeats), its records carrying the
# drafter's whole block: the replay of the config that drafts 7 tokens a step
adaptive_config = "gpu-fused:k=15,draft_block=7,nmax=32,policy=earliest,compile=true,compile_rule=true" + triton_suffix
fused_replay_file = "data/results/vllm_fused_h200.replay.parquet"  # benchmarks/vllm_gpu.py replay, every fused run
# benchmarks/fused_pass_kernels.py: the one-pass drafting step outside vLLM, kernel by kernel (fk2: FlashAttention
# settings plan_once and splits=1; fl: the drafter's layers as four Triton kernels, layers=triton; t1: the same with
# the tiles of sweep t1, and with the Triton attention, attention=triton)
pass_kernels_files = ["data/results/fused_pass_kernels_h200_fk.json", "data/results/fused_pass_kernels_h200_fk2.json",
                      "data/results/fused_pass_kernels_h200_fl.json", "data/results/fused_pass_kernels_h200_t1.json"]
tile_sweep_file = "data/results/drafter_layer_tiles_h200_t4.json"  # benchmarks/drafter_layer_tiles.py

# %%
import json
from pathlib import Path

import altair as alt
import polars as pl

from hqlab import bench, plots
from hqlab.bench import vllm_report
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

# %% [markdown]
# ## Inside vLLM's GPU step (gpu-fused)
#
# `gpu-fused` runs the lookup and a Qwen2 drafter fused per position inside vLLM 0.26's model runner V2 (asynchronous
# scheduling, the drafting step replayed from a CUDA graph; `hqlab.engines.vllm.gpu_fused`), next to `none`,
# `gpu-lookup` and vLLM's own draft-model method (`vllm-draft`, the same drafter, k=7, which vLLM runs on its V1
# runner, synchronously) in the same run. Run `fb`: target Qwen2.5-Coder-1.5B, drafter Qwen2.5-Coder-0.5B, bf16,
# greedy, 3 repeats, ~2000-token documents (chat prompts ≤ 350 tokens), 256 new tokens. Every output matched
# `none`'s. All hqlab configs share nmax=32 and the earliest-match policy (gpu-lookup: nmin=1); gpu-fused drafts
# `draft_block` tokens with the drafter per step (that many drafter passes: one catch-up pass over the tokens the
# last step emitted, then one per further token), verifies up to k+1 positions with the adaptive long block
# (`schedule=short`: always the short block), and torch.compiles the drafter's layers.

# %%
fused_rows = pl.read_parquet(fused_vllm_file).filter(pl.col("run") == fused_run)
print(fused_rows["machine"][0], "|", fused_rows["model"][0], fused_rows["dtype"][0], "| run", fused_run,
      "| lossless:", fused_rows["lossless"].all())
classes = ["copy", "code", "edit", "quote", "summary", "qa", "chat"]
dropped = r"(nmin=1|nmax=32|policy=earliest|compile=true|model=qwen2\.5-coder-0\.5b),?"  # shared by every config
label = pl.col("config").str.replace_all(dropped, "").str.strip_chars_end(",")
fused = (fused_rows.filter(pl.col("concurrency") <= 1)
         .group_by("category", "config", maintain_order=True)
         .agg(pl.col("decode_tok_s").median(), pl.col("tokens_per_step").median(),
              pl.col("step_efficiency").median(),
              # wall time per step, the same measure for every config (vLLM's draft model has no hqlab records)
              (1e3 * pl.col("tokens_per_step") / pl.col("decode_tok_s")).median().alias("ms_per_step"),
              pl.len().alias("prompts"))
         .with_columns((pl.col("decode_tok_s") / pl.col("decode_tok_s").filter(pl.col("config") == "none").first()
                        .over("category")).alias("vs_none"),
                       (pl.col("decode_tok_s") / pl.col("decode_tok_s")
                        .filter(pl.col("config").str.starts_with("gpu-lookup")).first().over("category"))
                       .alias("vs_gpu_lookup"), label)
         .sort(pl.col("category").cast(pl.Enum(classes)), pl.col("config").str.len_chars()))
fused

# %% [markdown]
# ### Faster than no speculation everywhere, slower than the lookup wherever it finds text (batch 1)
#
# Per task class, medians over the class's prompts (each the median of its repeats) at batch 1: decode tok/s (top,
# log scale), tokens per verify step (middle) and ms per step (bottom, log scale; tok/s ≈ tokens/step ÷ s/step).
# Every gpu-fused config beats `none` in every class (1.2-1.4x on chat, 1.4-2.4x on summary, 1.4-1.9x on qa, 3.3-7.4x
# on copy, code and edit with the adaptive block) and vLLM's own draft model by 3.4-17x; vLLM's draft-model method
# runs at 0.3-0.5x `none` (a 42-69 ms step on its synchronous V1 path). But gpu-lookup is faster still: its step
# costs 2.8-3.5 ms against `none`'s 2.7 ms, while each drafter pass adds ~1.2 ms, so gpu-fused with 2 passes
# (5.0 ms a step) matches it on chat (0.98x) and reaches 0.57-0.75x of it on the documents; with 7 passes (11.2 ms)
# 0.27-0.85x. The drafter's extra tokens (5.2 per step on chat against the lookup's 1.6) do not pay for its passes.

# %%
chart = plots.bar_panels(fused, "category", "config", {"decode_tok_s": "decode tok/s (batch 1)",
                                                       "tokens_per_step": "tokens per verify step",
                                                       "ms_per_step": "ms per step"},
                         log=("decode_tok_s", "ms_per_step"))
plots.save(chart, figures / "vllm_fused_h200_classes.svg")
chart

# %% [markdown]
# Four requests submitted together (copy, a chat prompt, qa, summary): each request's tokens/step in the burst, and
# the burst's total tok/s against `none` under the same load. Each request keeps the tokens/step it has alone (the
# copy request its long block: 15.0 with draft_block=7), and every output equals `none`'s. The burst ends with its
# slowest request, the chat prompt, so the lookup (1.1 tokens/step on it) is below `none` here (0.89x) and
# gpu-fused with draft_block=4 is the fastest (1.15x).

# %%
burst = fused_rows.filter(pl.col("concurrency") > 1).with_columns(label)
(burst.group_by("config", maintain_order=True)
 .agg(pl.col("batch_tok_s").first(), pl.col("lossless").all(),
      *[pl.col("tokens_per_step").filter(pl.col("category") == c).first().alias(f"{c} tokens/step")
        for c in ("copy", "chat", "qa", "summary")])
 .with_columns((pl.col("batch_tok_s") / pl.col("batch_tok_s").filter(pl.col("config") == "none").first())
               .alias("vs_none")))

# %% [markdown]
# ### What a drafter pass costs inside vLLM
#
# With `--profile` the bench timed each phase of every step on the GPU (CUDA events around vLLM's worker calls and
# the speculator's `propose`; `hqlab.engines.vllm.worker.StepTimer`): medians per config. The target's forward
# over a step's tokens (`execute_model`) costs 1.9 ms; gpu-fused's drafting step 5.3 ms with 4 drafter passes and
# 9.0 ms with 7, so one more single-token pass of the 0.5B drafter costs ~1.24 ms, two thirds of the 1.5B target's
# whole forward. Both are bound by kernel latency at batch 1, not by weight bytes: the drafter has 24 layers to
# the target's 28. vLLM's `draft_model` proposes in 45 ms a step, most of it on the host.

# %%
# vLLM's own timers put `propose` inside `sample_tokens`: `gpu_phases` takes it out of the sampling phase
fused_phases = pl.read_parquet(fused_vllm_file.replace(".parquet", ".phases.parquet"))
phases = vllm_report.gpu_phases(fused_phases, fused_run).with_columns(label)
chart = plots.stacked_time(phases.drop("gpu_ms"), "config", vllm_report.GPU_PHASES, y_title="GPU ms per step (median)")
plots.save(chart, figures / "vllm_fused_h200_step_parts.svg")
chart

# %% [markdown]
# ### How cheap a drafter pass must be
#
# The same run, modelled: per prompt, a gpu-fused step costs the gpu-lookup step of the same width on that prompt,
# plus a fixed drafting overhead, plus one price per drafter pass (`vllm_report.drafter_pass_fit`, least squares
# over every prompt and draft_block). Then, keeping each config's measured tokens/step, the price of a pass is varied
# (`vllm_report.fused_what_if`): the chart shows gpu-fused ÷ gpu-lookup for the best draft_block at each price,
# median over the class's prompts, and the table the price at which each class reaches the targets (1.1×
# the lookup on chat, 0.95× elsewhere). At the fitted price (~1.24 ms per pass, 0.2 ms residual) the model lands
# within 15 % of the measured ratios. Chat needs a pass below ~0.96 ms (a quarter cheaper than now), summary and qa
# below ~0.5 ms; copy, code and edit below ~0.2 ms, i.e. no drafter pass at all on the steps the lookup decides.

# %%
table, fit = vllm_report.drafter_pass_fit(pl.read_parquet(fused_vllm_file.replace(".parquet", ".steps.parquet")),
                                          fused_run)
print({key: round(value, 3) for key, value in fit.items()})
prices = [round(0.05 * i, 2) for i in range(31)]
what_if = (vllm_report.fused_what_if(table, fit, prices)
           .group_by("category", "passes", "per_pass_ms").agg(pl.col("vs_lookup").median())
           .group_by("category", "per_pass_ms").agg(pl.col("vs_lookup").max())  # the best draft_block at each price
           .sort(pl.col("category").cast(pl.Enum(classes)), "per_pass_ms"))
chart = plots.lines(what_if, "per_pass_ms", "vs_lookup", "category", x_title="ms per drafter pass (hypothetical)",
                    y_title="gpu-fused ÷ gpu-lookup, modelled")
plots.save(chart, figures / "vllm_fused_h200_pass_price.svg")
chart

# %%
targets = {c: (1.1 if c == "chat" else 0.95) for c in classes}
pl.concat([vllm_report.fused_what_if(table.filter(pl.col("category") == c), fit, [0.0], target=t)
           for c, t in targets.items()]).group_by("category", "passes").agg(
    pl.col("breakeven_pass_ms").median()).pivot("passes", index="category", values="breakeven_pass_ms").sort(
    pl.col("category").cast(pl.Enum(classes))).select("category", "2", "4", "7")

# %% [markdown]
# ### Skipping the drafter while the lookup copies (`skip`, replayed and priced)
#
# HyperQwen skips the drafter while a copy is in progress. The lab's `fused` proposer does it with `skip=L`: a
# request runs no drafter on a step when its step L steps earlier verified the long block (`skip_on=long`) or had
# its whole head filled by the lookup (`skip_on=head`); an engine that learns decisions asynchronously knows them
# only some steps late, hence the lag. gpu-fused runs it inside vLLM (built, not yet measured on the GPU).
# `experiments/drafter_skip_replayed/fused_skip_replay.py` replays it over run `fb`'s own outputs (teacher-forced drafter on the CPU,
# `data/results/fused_skip_replay.parquet`; with `--schedule long`, `fused_long_replay.parquet`) and
# `vllm_report.skip_what_if` prices each replay with the run's fitted drafter pass. A skipped step costs the lookup's
# step if the drafter catches up later (`lookup only`); gpu-fused as built adds its catch-up pass once per
# SKIP_RUN + 1 = 8 skipped steps (`as built`).
#
# Two schedules. The adaptive one (SPEC §2.5) verifies the short block (the drafter's head) until a copy is
# confirmed, then the long one. Inside vLLM that shortness saves nothing: every step verifies k positions whatever the
# block (gpu-fused pads after it), so `schedule=long` fills with the lookup's tail what the short block leaves to the
# pad. Below: the predicted gpu-fused ÷ gpu-lookup for the best draft_block per class and setting. With the adaptive
# schedule, skipping after a head the lookup filled is best (as built, lag 2: copy 0.76×, edit 0.74×, quote 0.69×,
# code 0.67×, against 0.54-0.57× without skipping). With the long block every document class gains (lag 2 or no
# skipping: copy 0.89×, edit 0.86×, quote 0.84×, summary 0.75×, qa 0.76×, code 0.72×; chat 1.00×). With HyperQwen's
# fusion thresholds no setting reaches the 0.95× at this pass price (1.24 ms); the next section changes them.

# %%
skip_files = [Path(published_dir) / name for name in ("fused_skip_replay.parquet", "fused_long_replay.parquet")]
skips = pl.concat([vllm_report.skip_what_if(pl.read_parquet(f), table, fit) for f in skip_files if f.exists()])
best = (skips.group_by("category", "schedule", "skip_on", "skip", "passes")
        .agg(pl.col("tokens_per_step").median(), pl.col("drafter_share").median(),
             pl.col("lookup_only_vs_lookup").median(), pl.col("built_vs_lookup").median())
        .sort("built_vs_lookup", descending=True)
        .group_by("category", "schedule", "skip_on", "skip", maintain_order=True).first()
        .with_columns(pl.when(pl.col("skip") == 0).then(pl.format("{}, never", "schedule"))
                      .otherwise(pl.format("{}, after {}, lag {}", "schedule", "skip_on", "skip")).alias("skipping"))
        .unique(["category", "skipping"], keep="first")
        .filter((pl.col("skip") == 0) | (pl.col("skip") <= 2))
        .sort(pl.col("category").cast(pl.Enum(classes)), "schedule", "skip_on", "skip"))
chart = plots.bar_panels(best, "category", "skipping", {"built_vs_lookup": "÷ gpu-lookup, as built",
                                                        "lookup_only_vs_lookup": "÷ gpu-lookup, lookup only",
                                                        "drafter_share": "share of steps drafting"})
plots.save(chart, figures / "vllm_fused_h200_skip.svg")
chart

# %%
best.sort("built_vs_lookup", descending=True).group_by("category", maintain_order=True).first().select(
    "category", "skipping", "passes", "tokens_per_step", "drafter_share", "built_vs_lookup", "lookup_only_vs_lookup"
).sort(pl.col("category").cast(pl.Enum(classes)))

# %% [markdown]
# ### One drafter pass and a drafter-confirmed lookup tail (thresholds, replayed and priced)
#
# The fusion thresholds were HyperQwen's (nstrong 6, nmin_tail 4: the lookup's tail only after a match of 4 tokens).
# Inside vLLM a drafter pass costs ~1.24 ms, so the cheapest drafter is one pass: `draft_block=1`, the catch-up pass
# alone, a head of one token. With the long block always and `nmin_tail=1`, a step proposes the lookup's whole
# continuation whenever the drafter's token equals the lookup's first (or the match is strong), else the drafter's
# one token: the drafter confirms the lookup instead of competing with it. `experiments/drafter_skip_replayed/fused_skip_replay.py
# --schedule long --blocks 1,2 --no-skip --vary nmin_tail=1,2,4 --vary nstrong=4,6` replayed it over run `fb`'s
# outputs (`data/results/fused_threshold_replay.parquet`, with `--blocks 1 --vary nmin_tail=1 --vary nstrong=6`
# for the skip settings too), priced as above. Predicted gpu-fused ÷ gpu-lookup with one pass, nmin_tail 1 and
# nstrong 6: chat 1.17x, summary 1.14x, qa 1.10x, quote 0.93x, copy 0.86x, edit 0.83x, code 0.82x; with HyperQwen's
# nmin_tail 4, chat 1.04x, summary 0.86x, qa 0.81x. Two passes lose everywhere. Adding the skip after a lookup-filled
# head (lag 2, as built): chat 1.16x, summary 1.12x, qa 1.10x, quote 0.99x, copy 0.98x, edit 0.94x, code 0.82x, which
# meets the targets on every class but edit (0.95x) and code. This is a prediction from the fitted pass
# price (one pass lies below the 2-7 passes it was fitted on): the next GPU run measures it.

# %%
threshold_file = Path(published_dir) / "fused_threshold_replay.parquet"
thresholds = (vllm_report.skip_what_if(pl.read_parquet(threshold_file), table, fit)
              .with_columns(pl.col("config").str.extract(r"nmin_tail=(\d+)").cast(pl.Int64).alias("nmin_tail"),
                            pl.col("config").str.extract(r"nstrong=(\d+)").cast(pl.Int64).alias("nstrong"))
              .with_columns(pl.format("{} pass{}, skip {}{}, nmin_tail {}, nstrong {}", "passes",
                                      pl.when(pl.col("passes") > 1).then(pl.lit("es")).otherwise(pl.lit("")),
                                      "skip", pl.when(pl.col("skip") > 0).then(pl.format(" after {}", "skip_on"))
                                      .otherwise(pl.lit("")), "nmin_tail", "nstrong").alias("setting")))
by_setting = (thresholds.group_by("category", "setting", "passes", "skip", "nmin_tail", "nstrong")
              .agg(pl.col("tokens_per_step").median(), pl.col("built_vs_lookup").median(),
                   pl.col("drafter_share").median())
              .sort(pl.col("category").cast(pl.Enum(classes)), "passes", "skip", "nmin_tail", "nstrong"))
# the figure: HyperQwen's tail threshold against 1, without skipping and with lag 2 (the table below has them all)
shown = by_setting.filter((pl.col("nstrong") == 6) & pl.col("nmin_tail").is_in([1, 4]) & pl.col("skip").is_in([0, 2]))
chart = plots.bar_panels(shown, "category", "setting", {"built_vs_lookup": "÷ gpu-lookup (predicted)",
                                                        "tokens_per_step": "tokens per step"})
plots.save(chart, figures / "vllm_fused_h200_thresholds.svg")
chart

# %%
by_setting.sort("built_vs_lookup", descending=True).group_by("category", maintain_order=True).first().select(
    "category", "setting", "tokens_per_step", "drafter_share", "built_vs_lookup"
).sort(pl.col("category").cast(pl.Enum(classes)))

# %% [markdown]
# ### The one-pass fusion, measured (runs `fd` and `fe`)
#
# Runs `fd` (code 7753b4c) and `fe` (code 3ae2773) measured the predicted configs on the same H200 with the same pair,
# suite and settings: `none`, gpu-lookup (nmin=1, k=15), gpu-fused with one drafter pass, the long block and
# nmin_tail=1, with and without skipping the drafter after lookup-filled heads (lag 2; run `fe` also lag 4), and
# run `fe` vLLM's own draft-model method with the same drafter (k=7). No output of either run differs from
# `none`'s but at near ties (one chat prompt, `none`'s own included, bf16 margin 0.125); the replay of each config
# over the run's outputs gives the same tokens/step on every prompt but one chat prompt (one near-tied step).
#
# The chart shows the run named in `measured_run`. In run `fe` the skip paid where the lookup copies: with lag 2 the
# host ran no drafter pass on 65 % of copy steps, 58 % of code's and 69 % of edit's (`drafter_passes` in the step
# records), those steps costing 2.3-2.5 ms against 3.7-3.8 ms with the pass, and gpu-fused ÷ gpu-lookup rose from
# 0.78 to 1.04 on copy and from 0.81 to 1.10 on edit; code reached 0.88 only, because a step without the drafter
# after the copy breaks proposes nothing below a match of 6 (13.4 tokens/step against 15.0). On prose the skip
# almost never fires (0-8 % of steps) and changes nothing: chat 1.05-1.06x, summary 1.03-1.04x, qa 1.05-1.08x
# (run `fd`: 1.17x, 1.12x, 1.21x). In run `fd` the same skipping config ran slower than without skipping
# everywhere (copy 0.83x, code 0.73x, edit 0.75x); that run did not record the drafter's passes, and the code
# differed from run `fe`'s only in host bookkeeping, so why is not known.

# %%
measured_rows = pl.read_parquet(fused_vllm_file).filter(pl.col("run") == measured_run)
print(measured_rows["machine"][0], "| code", measured_rows["git_commit"][0], "| lossless:",
      measured_rows["lossless"].all())
measured = (measured_rows.filter(pl.col("concurrency") <= 1)
            .group_by("category", "config", maintain_order=True)
            .agg(pl.col("decode_tok_s").median(), pl.col("tokens_per_step").median(),
                 (1e3 * pl.col("tokens_per_step") / pl.col("decode_tok_s")).median().alias("ms_per_step"))
            .with_columns((pl.col("decode_tok_s") / pl.col("decode_tok_s").filter(pl.col("config") == "none")
                           .first().over("category")).alias("vs_none"),
                          (pl.col("decode_tok_s") / pl.col("decode_tok_s")
                           .filter(pl.col("config").str.starts_with("gpu-lookup")).first().over("category"))
                          .alias("vs_gpu_lookup"), label)
            .sort(pl.col("category").cast(pl.Enum(classes)), "config"))
# measured against predicted: the replay's settings that the run's two one-pass configs ran
one_pass = {"draft_block=1,schedule=long,nmin_tail=1": "1 pass, skip 0, nmin_tail 1, nstrong 6",
            "draft_block=1,schedule=long,nmin_tail=1,skip=2,skip_on=head": "1 pass, skip 2 after head, nmin_tail 1, "
                                                                             "nstrong 6",
            "draft_block=1,schedule=long,nmin_tail=1,skip=4,skip_on=head": "1 pass, skip 4 after head, nmin_tail 1, "
                                                                             "nstrong 6"}
names = {"1 pass, skip 0, nmin_tail 1, nstrong 6": "one pass", "1 pass, skip 2 after head, nmin_tail 1, nstrong 6":
         "one pass + skip 2", "1 pass, skip 4 after head, nmin_tail 1, nstrong 6": "one pass + skip 4"}
versus = pl.concat([
    measured.filter(pl.col("config").str.starts_with("gpu-fused"))
    .with_columns(pl.col("config").str.replace(r"^gpu-fused:k=15,", "").replace_strict(one_pass, default=None)
                  .alias("setting"))
    .filter(pl.col("setting").is_not_null())
    .select("category", pl.format("{}, measured", pl.col("setting").replace_strict(names)).alias("series"),
            pl.col("vs_gpu_lookup").alias("ratio")),
    by_setting.filter(pl.col("setting").is_in(list(names)))
    .select("category", pl.format("{}, predicted", pl.col("setting").replace_strict(names)).alias("series"),
            pl.col("built_vs_lookup").alias("ratio")),
]).sort(pl.col("category").cast(pl.Enum(classes)), "series")
chart = plots.grouped_bars(versus, "category", "ratio", "series", y_title="gpu-fused ÷ gpu-lookup (batch 1)",
                           rule_at=1.0)
plots.save(chart, figures / "vllm_fused_h200_measured.svg")
chart

# %%
measured.select("category", "config", "decode_tok_s", "tokens_per_step", "ms_per_step", "vs_none", "vs_gpu_lookup")

# %% [markdown]
# The host's side of the skip, outside vLLM (`experiments/host_proven_skip/fused_skip_host.py`: the real drafter, the lookup kernel and
# the rule in their CUDA graphs on the H200, one request copying a passage or copying it with one token in 40
# changed, a stand-in for the target's forward of 1.9 ms and for vLLM's host work of 2.3 ms a step, the host at most
# one or two steps ahead of the GPU): the host proves the skip on 76-80 % of the copy's steps, and the skip's
# bookkeeping costs 0.10-0.17 ms of host time a step (choosing the graph 0.04-0.07 ms, copying the marks 0.05-0.10 ms).

# %%
skip_host = pl.read_parquet(fused_skip_host_file)
chart = plots.bar_panels(
    skip_host.with_columns(pl.format("{}, host <= {} ahead", "task", "ahead").alias("case")),
    "case", "skip", {"drafter_free_pct": "steps without drafter %", "gpu_ms_per_step": "GPU ms / step",
                     "tokens_per_step": "tokens / step", "host_step_ms": "host ms in step()"})
plots.save(chart, figures / "fused_skip_host_h200.svg")
chart

# %% [markdown]
# How much a longer lag would leave to skip, replayed over run `fd`'s outputs (`experiments/drafter_skip_replayed/fused_skip_replay.py
# RAW --schedule long --blocks 1 --vary nmin_tail=1 --vary nstrong=6 --skips head=2,3,4,6`,
# `data/results/fused_lag_replay.parquet`), priced as above. A longer lag gives the host's copies of the marks more
# time to arrive, but every request drafts its first `skip` steps, and a document answer here is only ~17 steps
# long: the drafter's share of steps on copy grows from 24 % at lag 2 to 35 % at lag 4, on edit from 19 % to 31 %,
# and code loses tokens (13.4 → 12.1 per step) because fewer steps have the drafter's token to confirm the lookup's
# tail. Priced as built, lag 4 predicts copy 0.96x and edit 0.92x, lag 2 copy 0.98x. Run `fe` measured both: lag 2
# copy 1.04x, edit 1.10x, code 0.88x; lag 4 copy 0.86x, edit 0.92x, code 0.74x (more steps draft, and code loses
# more tokens: 12.1 per step). A drafter-free step inside vLLM costs about what a lookup step costs (2.3-2.5 ms).

# %%
lags = (vllm_report.skip_what_if(pl.read_parquet(Path(published_dir) / "fused_lag_replay.parquet"), table, fit)
        .group_by("category", "skip").agg(pl.col("tokens_per_step").median(), pl.col("drafter_share").median(),
                                          pl.col("built_vs_lookup").median())
        .sort(pl.col("category").cast(pl.Enum(classes)), "skip"))
lags.pivot("skip", index="category", values="drafter_share")

# %% [markdown]
# ### A step without the drafter that still proposes (`nmin_alone`, replayed)
#
# Run `fe`'s one miss with the skip is code: a step that skipped the drafter right after the copy broke kept the
# lookup's head only at a match of `nstrong` = 6 or more, and below that proposed nothing, though vLLM verifies and
# pays for all k positions anyway. `nmin_alone=N` lets such a step take the lookup's head at a match of N
# (`hqlab.rules.fusion`, its GPU twin tested decision for decision). Replayed over run `fe`'s outputs
# (`experiments/drafter_skip_replayed/fused_skip_replay.py RAW --schedule long --blocks 1 --vary nmin_tail=1 --vary nstrong=6 --vary
# nmin_alone=0,1,2,4 --skips head=0,2,4`, `data/results/fused_alone_replay.parquet`) and priced as above: with
# nmin_alone 1 or 2, code keeps 15.0 tokens/step at lag 2 (13.4 without) and runs the drafter on 18 % of its steps
# instead of 32 %; prose and the other documents keep their tokens/step (chat 2.26-2.27). Not measured in vLLM yet.

# %%
alone = (vllm_report.skip_what_if(pl.read_parquet(Path(published_dir) / "fused_alone_replay.parquet"), table, fit)
         .with_columns(pl.col("config").str.extract(r"nmin_alone=(\d+)").cast(pl.Int64).alias("nmin_alone"))
         .filter(pl.col("skip") > 0)
         .group_by("category", "skip", "nmin_alone").agg(pl.col("tokens_per_step").median(),
                                                         pl.col("drafter_share").median(),
                                                         pl.col("built_vs_lookup").median())
         .with_columns(pl.format("skip {}, nmin_alone {}", "skip", "nmin_alone").alias("setting"))
         .sort(pl.col("category").cast(pl.Enum(classes)), "skip", "nmin_alone"))
chart = plots.grouped_bars(alone, "category", "built_vs_lookup", "setting",
                           y_title="predicted gpu-fused ÷ gpu-lookup", rule_at=1.0)
plots.save(chart, figures / "vllm_fused_h200_alone.svg")
chart

# %%
alone.pivot("setting", index="category", values="tokens_per_step")

# %% [markdown]
# ### `nmin_alone` and the compiled rule, measured (run `ff`)
#
# Run `ff` (code cce1839; the same pair, suite and settings) measured the lag-2 skip with `nmin_alone=1`, its fusion
# rule eager and compiled (`compile_rule=true`: torch.compile fuses the rule's many small kernels inside the step's
# CUDA graph), next to `none` and gpu-lookup k=15 (it ran no vLLM draft model: the device session ended first).
# `nmin_alone` did what the replay said: code keeps 15.0 tokens/step (13.4 in run `fe`). The compiled rule made every
# step without the drafter cost what a lookup step costs (1.9-2.2 ms on copy, code, quote and summary against
# 3.6-3.7 ms with the eager rule in the same run), and gpu-fused ÷ gpu-lookup reached chat 1.05, summary 1.00, qa
# 1.16, copy 0.97, code 1.05, quote 0.93 and edit 0.80 (1.28-1.36x `none` on chat). The eager config measured 0.59-0.69x
# on the documents, slower than the same rule in run `fe` (whose drafter-free steps cost 2.3-2.5 ms): runs of whole
# configs minutes apart still move with the host. Lossless; the replay agrees on every prompt but the near-tied chat
# step.

# %%
compiled = (vllm_report.fused_ratios(pl.read_parquet(fused_vllm_file), compiled_run)
            .filter(pl.col("config").str.starts_with("gpu-fused"))
            .with_columns(pl.when(pl.col("config").str.contains("compile_rule=true"))
                          .then(pl.lit("skip 2, nmin_alone 1, compiled rule"))
                          .otherwise(pl.lit("skip 2, nmin_alone 1, eager rule")).alias("setting"))
            .sort(pl.col("category").cast(pl.Enum(classes)), "setting"))
chart = plots.grouped_bars(compiled, "category", "vs_best_gpu_lookup", "setting",
                           y_title="gpu-fused ÷ gpu-lookup (batch 1)", rule_at=1.0)
plots.save(chart, figures / "vllm_fused_h200_compiled.svg")
chart

# %%
fused_steps = pl.read_parquet(Path(fused_vllm_file).with_suffix(".steps.parquet"))
by_passes = (vllm_report.step_ms_by_passes(fused_steps, compiled_run)
             .filter(pl.col("config").str.starts_with("gpu-fused") | pl.col("config").str.starts_with("gpu-lookup"))
             .with_columns(pl.when(pl.col("config").str.starts_with("gpu-lookup")).then(pl.lit("gpu-lookup"))
                           .when(pl.col("config").str.contains("compile_rule=true")).then(pl.lit("compiled rule"))
                           .otherwise(pl.lit("eager rule")).alias("rule"))
             .with_columns(pl.when(pl.col("drafter_passes") < 0).then(pl.col("rule"))
                           .otherwise(pl.format("{}, {} drafter pass(es)", "rule", "drafter_passes")).alias("step"))
             .sort(pl.col("category").cast(pl.Enum(classes)), "step"))
chart = plots.grouped_bars(by_passes, "category", "step_ms", "step", y_title="median ms per step (batch 1)")
plots.save(chart, figures / "vllm_fused_h200_compiled_steps.svg")
chart

# %%
compiled.select("category", "setting", "decode_tok_s", "tokens_per_step", "vs_none", "vs_best_gpu_lookup",
                "step_efficiency")

# %% [markdown]
# ### The same config interleaved (runs `fg` and `fg2`)
#
# Run `fg` (code da8249f) ran run `ff`'s compiled config again with `--interleave`: the engines of `none`, the
# lookup and the fused config alive together, each prompt on each engine in turn, so a ratio compares requests
# seconds apart. Interleaved, the fused config measured 0.71-0.81x the lookup on copy, code and edit, 0.87-0.90x on
# summary and qa and 1.05x on chat: below run `ff` everywhere but chat. The lookup's steps on the documents ran
# 1.9-2.0 ms (2.2-2.8 in `ff`). The fused config's drafter-free steps cost 2.8-3.0 ms on copy, quote and summary
# (1.9-2.2 in `ff`), and on exactly those classes its own host time per step rose to 0.25-0.28 ms from 0.20-0.21;
# on code and edit, where it stayed (0.21 and 0.30 ms), so did the steps. The gauge of the host's level
# (docs/vllm.md) moves per request even with the engines seconds apart. Run `fg2` ran vLLM's own draft model next to
# the same fused config: the fused config is 3.7x it on chat and 8-26x elsewhere.

# %%
across = (vllm_report.fused_ratios_across(pl.read_parquet(fused_vllm_file),
                                          {compiled_run: skip_config, interleaved_run: skip_config})
          .with_columns(pl.when(pl.col("run") == interleaved_run)
                        .then(pl.format("run {} (interleaved)", "run"))
                        .otherwise(pl.format("run {} (one config after another)", "run")).alias("measured"))
          .sort("run", pl.col("category").cast(pl.Enum(classes))))
chart = plots.grouped_bars(across, "category", "vs_best_gpu_lookup", "measured",
                           y_title="gpu-fused ÷ gpu-lookup (batch 1)", rule_at=0.95)
plots.save(chart, figures / "vllm_fused_h200_interleaved.svg")
chart

# %%
host_ms = (vllm_report.speculator_host_ms(fused_steps, [compiled_run, interleaved_run])
           .filter(pl.col("config").str.starts_with("gpu-lookup") | (pl.col("config") == skip_config))
           .with_columns(pl.format("{}, run {}", pl.when(pl.col("config").str.starts_with("gpu-lookup"))
                                   .then(pl.lit("gpu-lookup")).otherwise(pl.lit("gpu-fused")), "run").alias("engine"))
           .sort(pl.col("category").cast(pl.Enum(classes)), "engine"))
chart = plots.grouped_bars(host_ms, "category", "speculator_host_ms", "engine",
                           y_title="speculator's own host ms per step (median)")
plots.save(chart, figures / "vllm_fused_h200_host_ms.svg")
chart

# %%
draft_model = vllm_report.fused_ratios(pl.read_parquet(fused_vllm_file), draft_model_run)
draft_model.filter(pl.col("config") != "none").select("category", "config", "decode_tok_s", "tokens_per_step",
                                                       "vs_none", "vs_best_vllm_draft", "step_efficiency")

# %% [markdown]
# ### A longer block: k = 31, replayed
#
# Every fused run so far compared the fused config with the GPU lookup at k = 15 only. Over run `fg`'s own outputs
# (`experiments/drafter_skip_replayed/fused_skip_replay.py ... --settings k=31,nmax=32,policy=earliest --lookup-k 15,31`, the 0.5B drafter
# teacher-forced on the CPU) the lookup at k = 31 takes 25.5-31.9 tokens a step on copy, code and edit (14.2-15.9 at
# k = 15), so it is the best gpu-lookup config there, and the fused config at k = 15 could reach only about half of
# it. The same fused settings at k = 31 keep up (28.3-31.9) and stay ahead on prose (chat 2.29 against 1.57, qa 4.8
# against 3.4, summary 5.8 against 4.1). The next GPU run measures both widths.

# %%
widths = (pl.read_parquet(width_replay_file)
          .with_columns(pl.format("{} k={}", pl.col("config").str.extract(r"^(\w+):"),
                                  pl.col("config").str.extract(r"k=(\d+)")).alias("replayed"))
          .group_by("category", "replayed").agg(pl.col("tokens_per_step").median(), pl.col("drafter_share").median())
          .sort(pl.col("category").cast(pl.Enum(classes)), "replayed"))
chart = plots.grouped_bars(widths, "category", "tokens_per_step", "replayed", y_title="tokens per step (replayed)")
plots.save(chart, figures / "vllm_fused_h200_widths.svg")
chart

# %% [markdown]
# ### Both widths measured (runs `fh` and `fh2`)
#
# Run `fh` (code 369a0c2) ran `none`, the lookup at k = 31 and 15 and the skip config at k = 31 interleaved, 3
# rounds. Against the fastest lookup of each class (k = 31 except summary), the fused config's ratio of medians is
# 1.26 on copy, 1.00 on edit and quote, 0.99 on chat, 0.92 on summary, 0.89 on qa and 0.77 on code. A document
# request decodes its 256 tokens in 8-10 steps, 20-40 ms, so one slow step moves its rate by a tenth: the chart pairs
# each request with the lookup's in the same round (`vllm_report.round_ratios` over the `.repeats` frame) and shows
# the lowest, median and highest of these ratios. Tokens per step equal the lab's replay on 12 of 14 prompts (two
# chat prompts 0.8-0.9 % apart, near-tie flips); in the burst of four (`fh2`) the copy request keeps 28.3 tokens a
# step, as alone.

# %%
fused_repeats = pl.read_parquet(Path(fused_vllm_file).with_name(Path(fused_vllm_file).stem + ".repeats.parquet"))
paired = vllm_report.round_ratios(fused_repeats, widths_run, skip_config_k31)
spread = (paired.unpivot(["low", "median", "high"], index="category", variable_name="round", value_name="ratio")
          .with_columns(pl.col("round").replace({"low": "lowest round", "median": "median round",
                                                  "high": "highest round"}))
          .sort(pl.col("category").cast(pl.Enum(classes))))
chart = plots.grouped_bars(spread, "category", "ratio", "round",
                           y_title="gpu-fused k=31 ÷ fastest gpu-lookup, same round", rule_at=0.95)
plots.save(chart, figures / "vllm_fused_h200_rounds.svg")
chart

# %%
both_widths = vllm_report.fused_ratios(pl.read_parquet(fused_vllm_file), widths_run)
both_widths.filter(pl.col("config") != "none").select("category", "config", "decode_tok_s", "tokens_per_step",
                                                       "vs_none", "vs_best_gpu_lookup", "step_efficiency")

# %% [markdown]
# ### Two fused configs, both lookup widths (run `fi1`)
#
# Run `fi1` (code 9731152) ran `none`, the lookup at k = 31 and 15, the skip config at k = 31 (for the documents)
# and the one-pass config at k = 15 without the skip (for prose: the skip rarely fires there, and its host
# bookkeeping costs 0.1-0.2 ms a step), all five engines alive at once. They took 8 of the call's 10 minutes to
# start, so it has 2 rounds. The issue asks for the best fused config of each class against the best lookup of
# the same run: the chart shows each fused config's ratio of medians and, paired round by round
# (`vllm_report.round_ratios`), the median of its per-request ratios.

# %%
def fused_bars(run: str, names: dict[str, str], figure: str, named_only: bool = False) -> alt.Chart:
    """Each fused config of `run` over the fastest gpu-lookup of each class: ratio of medians and paired by round
    (`names`: short labels of the configs; `named_only`: only those, e.g. to leave out a config timed in a call of
    its own, which no round pairs with the lookup's), saved as figures/`figure`."""
    ratios = vllm_report.fused_ratios(pl.read_parquet(fused_vllm_file), run)
    fused = ratios.filter(pl.col("config").str.starts_with("gpu-fused"))
    if named_only:
        fused = fused.filter(pl.col("config").is_in(list(names)))
    paired = pl.concat([vllm_report.round_ratios(fused_repeats, run, c)
                        .select("category", pl.col("median").alias("ratio"), pl.lit(c).alias("config"))
                        for c in fused["config"].unique(maintain_order=True)])
    bars = pl.concat([
        fused.select("category", "config", pl.col("vs_best_gpu_lookup").alias("ratio"), pl.lit("medians").alias("how")),
        paired.select("category", "config", "ratio", pl.lit("paired").alias("how")),
    ]).with_columns(pl.format("{}, {}", pl.col("config").replace_strict(names, default=pl.col("config")), "how")
                    .alias("fused config, ratio")).sort(pl.col("category").cast(pl.Enum(classes)),
                                                        "fused config, ratio")
    chart = plots.grouped_bars(bars, "category", "ratio", "fused config, ratio",
                               y_title=f"gpu-fused ÷ fastest gpu-lookup, run {run}", rule_at=0.95)
    plots.save(chart, figures / figure)
    return chart


two = vllm_report.fused_ratios(pl.read_parquet(fused_vllm_file), two_configs_run)
fused_two = two.filter(pl.col("config").str.starts_with("gpu-fused"))
fused_bars(two_configs_run, {skip_config_k31: "k=31 skip", one_pass_k15: "k=15 one pass"}, "vllm_fused_h200_fi1.svg")

# %%
best_fused = (fused_two.sort("decode_tok_s", descending=True).unique("category", keep="first")
              .sort(pl.col("category").cast(pl.Enum(classes))))
best_fused.select("category", "config", "decode_tok_s", "tokens_per_step", "vs_none", "vs_best_gpu_lookup",
                  "step_efficiency", "mismatches")

# %% [markdown]
# What a step costs by the drafter passes it ran (`vllm_report.step_ms_by_passes`, one repeat's step records):
# on chat a one-pass step costs 3.33 ms against the lookup's 2.58 ms, 0.75 ms for the pass (run `fh`: 1.0-1.2 ms),
# which the drafter's 45 % more tokens a step now cover. The skip config's drafter-free steps on the documents
# cost what its steps with the pass cost (code 3.47 against 3.51 ms), 0.5-1.2 ms above the lookup's, with its
# speculator's own host time at 0.20-0.32 ms a step against the lookup's 0.04-0.08.

# %%
vllm_report.step_ms_by_passes(pl.read_parquet(Path(fused_vllm_file).with_name(
    Path(fused_vllm_file).stem + ".steps.parquet")), two_configs_run)

# %% [markdown]
# What the device-decided skip (`device_skip=true`, measured in run `fj1` below) should give the k = 31 config,
# priced from the same records (`vllm_report.device_skip_what_if`): a step whose lookup match reaches `nstrong` is
# priced at the fastest lookup's step, every other step at the config's own steps with a pass; tokens per step stay
# (the skip is exact). `every_pass` is the same config with the pass on every step, `measured` run `fi1`'s ratio.

# %%
vllm_report.device_skip_what_if(pl.read_parquet(Path(fused_vllm_file).with_name(
    Path(fused_vllm_file).stem + ".steps.parquet")), pl.read_parquet(fused_vllm_file), two_configs_run, skip_config_k31)

# %% [markdown]
# ### The device decides the skip: ten rounds (run `fj1`)
#
# Run `fj1` (code 2b56aaa) ran `none`, the lookup at k = 31 and 15, the one-pass config at k = 15 and the same
# config at k = 31 with `device_skip=true` (the drafter's pass behind a CUDA graph conditional node, skipped on the
# device when every row's lookup match reaches `nstrong`), the engines started together (3 minutes 18 s), 10
# rounds, each the suite alone and then the burst of four; vLLM's draft model ran in a second call, finished into
# the same run. The documents are now level with the lookup (copy 1.04, code 0.95, edit 1.07, quote 1.04), summary
# and qa above it (1.10, 1.15); chat is 1.08 (paired 1.12), short of the 1.1.

# %%
fused_bars(device_skip_run, {device_skip_k31: "k=31 device skip", one_pass_k15: "k=15 one pass"},
           "vllm_fused_h200_fj1.svg")

# %%
# the table: the faster fused config of each class against the fastest lookup, `none` and vLLM's draft model
vllm_report.best_fused(pl.read_parquet(fused_vllm_file), fused_repeats, device_skip_run)

# %% [markdown]
# Where the device skipped the pass, and what the steps cost by the passes they ran: the pass runs exactly on the
# steps whose match falls short of `nstrong` (78 % of copy and code steps skipped, 88 % of edit's, a third of
# quote's, 0-4 % of the prose steps). The step records keep one round's steps; over all ten rounds
# (`vllm_report.round_step_ms`: decode time over decode steps) the device-skip config's document steps cost what
# the lookup's cost (-0.2 to +0.3 ms), its prose steps, with the pass, 0.5-0.9 ms more. Then what
# `device_skip_what_if` predicted from run `fi1`'s records against what `fj1` measured.

# %%
fused_steps = pl.read_parquet(Path(fused_vllm_file).with_name(Path(fused_vllm_file).stem + ".steps.parquet"))
vllm_report.step_ms_by_passes(fused_steps, device_skip_run).filter(pl.col("config").is_in(
    [device_skip_k31, "gpu-lookup:nmin=1,nmax=32,k=31,policy=earliest"]))

# %%
vllm_report.round_step_ms(fused_repeats, device_skip_run).filter(pl.col("config").str.starts_with("gpu-"))

# %%
predicted = vllm_report.device_skip_what_if(fused_steps, pl.read_parquet(fused_vllm_file), two_configs_run,
                                            skip_config_k31)
measured = vllm_report.fused_ratios(pl.read_parquet(fused_vllm_file), device_skip_run).filter(
    pl.col("config") == device_skip_k31)
predicted.select("category", pl.col("predicted").alias(f"predicted from {two_configs_run}")).join(
    measured.select("category", pl.col("vs_best_gpu_lookup").alias(f"measured in {device_skip_run}")), on="category")

# %% [markdown]
# ### Chat again, and where a fused step's time goes (run `fk1`)
#
# Run `fk1` (code 2943059) ran `fj1`'s configs for 8 interleaved rounds, then one pass over the suite with every
# phase of every step timed on the GPU. Chat came out at 1.04 and summary at 0.93 the best lookup: the lookup's
# steps were cheaper than in `fj1` (2.23 against 2.57 ms on chat), the fused steps cost the same (3.32 ms).

# %%
fused_bars(profiled_run, {device_skip_k31: "k=31 device skip", one_pass_k15: "k=15 one pass"},
           "vllm_fused_h200_fk1.svg")

# %%
vllm_report.best_fused(pl.read_parquet(fused_vllm_file), fused_repeats, profiled_run)

# %% [markdown]
# GPU time per chat step by phase (medians of the profiled pass), next to each config's step over all rounds. The
# fused engine's GPU work adds up to its step time: the step is bound by the GPU, and the drafter's catch-up pass
# costs its full 1.34 ms, 70 % of the target's forward. The lookup's step is set by the host (its target-forward span
# includes the GPU waiting for launches). For chat to clear 1.1 with the tokens a step measured, the drafting step
# must take at most ~0.94 ms.

# %%
short_names = {one_pass_k15: "fused k=15 one pass", device_skip_k31: "fused k=31 device skip",
               one_pass_k15 + ",plan_once=true": "k=15, plan_once", one_pass_k15 + ",splits=1": "k=15, splits=1",
               one_pass_k15 + ",splits=1,plan_once=true": "k=15, splits=1, plan_once",
               one_pass_k15 + ",layers=triton,plan_once=true": "k=15, layers=triton, plan_once",
               one_pass_k15 + ",layers=triton,attention=triton": "k=15, layers=triton, attention=triton"}
short_name = pl.col("config").replace(short_names)
chat_phases = vllm_report.gpu_phases(fused_phases, profiled_run, category="chat")
chart = plots.stacked_time(chat_phases.drop("gpu_ms").with_columns(label).with_columns(short_name), "config",
                           vllm_report.GPU_PHASES,
                           y_title=f"GPU ms per chat step (median), run {profiled_run}")
plots.save(chart, figures / "vllm_fused_h200_fk1_phases.svg")
chart

# %%
chat_phases.join(vllm_report.round_step_ms(fused_repeats, profiled_run).filter(pl.col("category") == "chat")
                 .select("config", pl.col("step_ms").alias("step over all rounds")), on="config")

# %% [markdown]
# The one-pass drafting step outside vLLM, kernel by kernel (`benchmarks/fused_pass_kernels.py`: the real 0.5B,
# one request at 2,048 tokens of history, 16 positions, the step replayed from its CUDA graph): ~400 kernels of
# 3-4 µs, while a layer's weights take ~6 µs to read. `plan_once=true` drops one FlashAttention scheduling kernel per
# layer (-21 µs a step); `splits=1` drops the combine kernel but makes the attention itself slower. `layers=triton`
# (run fl, its first GPU run, untuned block sizes) halves the kernels but its four kernels read the weights at
# 1-2 TB/s against cuBLAS's ~2.6: the step got slower (1.59 against 1.46 ms at 2,048 tokens). With the tiles of
# sweep t1 (below) the same config's step took 1.29 ms in run t1, and 1.25 ms with the attention in one Triton
# kernel a layer (`attention=triton`), against 1.48 ms on the torch layers in the same run.

# %%
kernel_parts = pl.concat([vllm_report.pass_kernel_parts(json.loads(Path(f).read_text()))
                          .with_columns(pl.lit(Path(f).stem.rsplit("_", 1)[-1]).alias("run"))
                          for f in pass_kernels_files])
kernel_parts = kernel_parts.with_columns(pl.format("{}: {}", "run", short_name).alias("config"),
                                         (pl.col("us") / 1e3).alias("ms"))
chart = plots.stacked_time(kernel_parts.pivot("part", index="config", values="ms").fill_null(0.0), "config",
                           [p for p, _ in vllm_report.KERNEL_PARTS] + ["other"],
                           y_title="GPU ms of kernels per drafting step")
plots.save(chart, figures / "vllm_fused_h200_pass_kernels.svg")
chart

# %%
kernel_parts.group_by("config", maintain_order=True).agg(pl.col("us").sum().round(0), pl.col("kernels").sum())

# %% [markdown]
# The tile sweep behind those tiles (`benchmarks/drafter_layer_tiles.py`, random weights at the 0.5B's shapes): each
# Triton layer kernel's µs per launch, timed over 24 layers' own weights in one CUDA graph, with the tiles it first
# had and the best of ~70 candidates (columns per program, reduction step, pipeline depth, a split of the
# reduction), beside the product alone in cuBLAS; the attention beside vLLM's FlashAttention 3 as the drafter calls
# it. The norm kernels (K1, K3) still cost more than cuBLAS's bare product: they normalise, add the bias, rotate
# and write the cache (K1) or apply SiLU (K3) as well.

# %%
sweep = vllm_report.tile_sweep(json.loads(Path(tile_sweep_file).read_text()))
sweep_long = (sweep.with_columns(pl.when(pl.col("q_len").is_null()).then(pl.format("{}@{}", "kernel", "rows"))
                                 .otherwise(pl.format("{}@{}x{}", "kernel", "rows", "q_len")).alias("kernel@rows"))
              .unpivot(["reference_us", "table_us", "best_us"], index=["kernel@rows", "reference"],
                       variable_name="tiles", value_name="us")
              .with_columns(pl.col("tiles").replace({"reference_us": "cuBLAS product / FlashAttention 3",
                                                     "table_us": "tiles before the sweep", "best_us": "best of the sweep"})))
chart = plots.grouped_bars(sweep_long, "kernel@rows", "us", "tiles", y_title="µs per launch (24 layers, CUDA graph)")
plots.save(chart, figures / "drafter_layer_tiles_h200.svg")
chart

# %% [markdown]
# ### The Triton drafter inside vLLM (run `fl1`)
#
# Run `fl1` (code 618d3d6) ran `fk1`'s two fused configs with `layers=triton,attention=triton` (the tiles of sweep
# t1, the attention's 32-key steps, no programmatic dependent launch) beside `none` and the lookup at k = 15 and 31:
# 6 interleaved rounds, each the suite alone and then the burst of four. Chat reached 1.21 the best lookup (paired
# by round 1.18), summary 1.03 and qa 1.02; code and edit came out at 0.93 and 0.85, where the k = 31 config's
# steps cost 0.2-0.5 ms more than the lookup's at the same tokens per step.

# %%
fused_bars(triton_run, {device_skip_k31 + triton_suffix: "k=31 device skip, Triton",
                        one_pass_k15 + triton_suffix: "k=15 one pass, Triton"}, "vllm_fused_h200_fl1.svg")

# %%
vllm_report.best_fused(pl.read_parquet(fused_vllm_file), fused_repeats, triton_run)

# %% [markdown]
# Per step, over all rounds: the chat step of the one-pass config fell from 3.32 ms (`fk1`) to 3.15 ms; this run's
# host was slower (`none` 2.14 against 1.93 ms a step), which made the host-bound lookup's steps dearer too.

# %%
pl.concat([vllm_report.round_step_ms(fused_repeats, run).with_columns(pl.lit(run).alias("run"))
           for run in (profiled_run, triton_run)]).filter(pl.col("category").is_in(["chat", "code", "edit"])) \
    .with_columns(short_name.str.replace(triton_suffix, ", Triton", literal=True)) \
    .pivot("run", index=["category", "config"], values="step_ms").sort("category", "config")

# %% [markdown]
# ### Every point in one run (`fm1`)
#
# Run `fm1` (code d19abf5) ran `fl1`'s engines again with the tiles of sweep t4 (the layers at 16, 32 and 64 rows,
# the attention at 16 and 32 queries a request: 16-row tiles, 64 keys a step, 8 splits; now the kernels' defaults):
# 11 interleaved rounds, each the suite alone and then the burst of four, then one profiled pass; vLLM's draft model
# (the same 0.5B drafting, k = 7) ran in a second call a minute later and is finished into the same run. The table
# is the acceptance, point by point (`vllm_report.fused_acceptance`).

# %%
fused_bars(tuned_run, {device_skip_k31 + triton_suffix: "k=31 device skip, Triton",
                       one_pass_k15 + triton_suffix: "k=15 one pass, Triton"}, "vllm_fused_h200_fm1.svg")

# %%
vllm_report.fused_acceptance(pl.read_parquet(fused_vllm_file), fused_repeats, pl.read_parquet(fused_replay_file),
                             tuned_run)

# %%
vllm_report.best_fused(pl.read_parquet(fused_vllm_file), fused_repeats, tuned_run)

# %% [markdown]
# Per step over all rounds (decode time ÷ steps), `fm1` beside `fl1`: the chat step of the one-pass config is
# 3.08 ms (3.15 in `fl1`) and the k = 31 config's 3.25 (3.57); on edit the k = 31 config's steps, drafter-free but
# for the first, cost 0.58 ms more than the lookup's, as in `fl1` (0.55), and edit stays below 0.95.

# %%
pl.concat([vllm_report.round_step_ms(fused_repeats, run).with_columns(pl.lit(run).alias("run"))
           for run in (triton_run, tuned_run)]).filter(pl.col("category").is_in(["chat", "code", "copy", "edit"])) \
    .with_columns(short_name.str.replace(triton_suffix, ", Triton", literal=True)) \
    .pivot("run", index=["category", "config"], values="step_ms").sort("category", "config")

# %% [markdown]
# ### The lazy catch-up: every speed point in one run (`fn1`)
#
# In `fm1` the device-skip config's drafter, after seven drafter-free steps of a copy, had to catch up with one wide
# pass (256 positions, ~2 ms of GPU time) whether or not its token was needed: at k = 31 that is the ninth step of a
# 256-token document request, the last one. With `catch_up=lazy` (now the default) the drafter reads what it missed
# only at a step that needs its token, in a loop of wide passes behind a CUDA graph WHILE node, and everything the
# drafter runs sits inside one IF node, so a drafter-free step meets one node (its drafting phase: 0.07 ms of GPU
# time against 0.11 in `fm1` and the lookup's 0.04). Run `fn1` (code 0fce52e) is `fm1` again with that code and the
# burst of four mixing the copy request with chat, qa and summary (`--burst copy,chat,qa,summary`).

# %%
fused_bars(lazy_run, {device_skip_k31 + triton_suffix: "k=31 device skip, Triton",
                      one_pass_k15 + triton_suffix: "k=15 one pass, Triton"}, "vllm_fused_h200_fn1.svg")

# %%
fused_data = vllm_report.load(Path(fused_vllm_file))
vllm_report.fused_acceptance(fused_data["results"], fused_repeats, pl.read_parquet(fused_replay_file), lazy_run,
                             fused_data["steps"])

# %%
vllm_report.best_fused(fused_data["results"], fused_repeats, lazy_run)

# %% [markdown]
# Per step over all rounds: the k = 31 config's document steps now cost what the lookup's do (edit −0.10 ms, copy
# −0.02, code −0.10 a step; in `fm1` +0.58, +0.29, −0.59).

# %%
pl.concat([vllm_report.round_step_ms(fused_repeats, run).with_columns(pl.lit(run).alias("run"))
           for run in (tuned_run, lazy_run)]).filter(pl.col("category").is_in(["chat", "code", "copy", "edit"])) \
    .with_columns(short_name.str.replace(triton_suffix, ", Triton", literal=True)) \
    .pivot("run", index=["category", "config"], values="step_ms").sort("category", "config")

# %% [markdown]
# `fn1`'s fused configs hold every request at the long block (`schedule=long`: in vLLM's fixed-width verify a
# short block is padding, verified at the same cost). The adaptive schedule's burst, per request, is run `fb`'s
# (k = 15, drafter blocks 2, 4 and 7): the copy request kept the long block on as many of its steps as alone and
# its prose neighbours stayed as short as alone (`vllm_report.burst_blocks`).

# %%
vllm_report.burst_blocks(fused_data["steps"], "fb")

# %% [markdown]
# ### Every point of the issue in one run (`fn2`)
#
# Run `fn2` (code 38a44e1) is `fn1`'s bench again, now that the fused speculator's records carry the drafter's own
# head token: the replay (`benchmarks/vllm_gpu.py replay`) takes those tokens instead of its float32 drafter's
# guesses, so where bf16 and float32 break a near tie differently the fusion, schedule and verify decisions must
# still agree exactly, and the replay reports where its own drafter would have drafted another token. It does on
# every pair of the one-pass configs; the adaptive config drafts 7 tokens a step, of which `fn2`'s records carried
# the first only, so three of its chat prompts stay 1-3 % off (the records now carry the whole block,
# `StepRecord.drafter_tokens`, for the next run). The call before ran an adaptive config (k = 15, drafter block 7: the block grows to 16 only while a copy is
# in progress) alone and in the same burst of four, for the per-request blocks; the call after, vLLM's draft model.
# Both are finished into the same run; their wall times come from calls of their own, so the speed points compare
# the interleaved configs. (The profiled pass at the end of the bench ran past the call's time limit: the drafter's
# cost per pass is `fn1`'s.)

# %%
fused_bars(exact_run, {device_skip_k31 + triton_suffix: "k=31 device skip, Triton",
                       one_pass_k15 + triton_suffix: "k=15 one pass, Triton"}, "vllm_fused_h200_fn2.svg",
           named_only=True)  # the adaptive config ran in a call of its own: no round pairs it with the lookup

# %%
vllm_report.fused_acceptance(fused_data["results"], fused_repeats, pl.read_parquet(fused_replay_file), exact_run,
                             fused_data["steps"])

# %%
vllm_report.best_fused(fused_data["results"], fused_repeats, exact_run)

# %% [markdown]
# Per request in the burst: the adaptive config's copy request verifies the long block on as many of its steps as
# alone, and its prose neighbours stay as short as alone.

# %%
vllm_report.burst_blocks(fused_data["steps"], exact_run)

# %% [markdown]
# The replay per (config, prompt): `forced_drafts` counts the steps where it took vLLM's drafter token,
# `drafter_flips` those where its own float32 drafter would have drafted another, with the widest margin there.

# %%
(pl.read_parquet(fused_replay_file).filter(pl.col("run") == exact_run)
 .group_by("config").agg(pl.len().alias("pairs"), (pl.col("difference") == 0).sum().alias("exact"),
                         pl.col("forced_drafts").sum(), pl.col("drafter_flips").sum(), pl.col("flip_margin_max").max())
 .with_columns(short_name.replace({adaptive_config: "k=15 adaptive"})).sort("config"))

# %% [markdown]
# ### The adaptive config's replay, with the drafter's whole block (`fn3a`)
#
# Run `fn3a` (code 5b26737) ran `fn2`'s adaptive config again on the H200, alone and in the same burst of four, 3
# repeats, its records now carrying every token the drafter drafted (`StepRecord.drafter_tokens`). Its outputs and
# its step records repeat `fn2`'s step for step (`vllm_report.same_steps`: history, verify width, proposal and
# sources, acceptance, block, batch and drafter passes at every step), and its wall times are within 1 % of `fn2`'s.
# With every drafted token vLLM's, the replay gives vLLM's tokens/step on all 14 prompts, the three chat prompts
# `fn2`'s head-only records left 1-3 % off among them: the lookup, fusion, schedule and verify decisions agree with
# the reference rules; what differed was the float32 drafter breaking near ties otherwise than vLLM's bf16 one
# (`drafter_flips`, margins ≤ 0.06).

# %%
(pl.read_parquet(fused_replay_file).filter(pl.col("run") == whole_block_run)
 .select("prompt_id", "steps", "tokens_per_step", "vllm_tokens_per_step", "difference", "forced_drafts",
         "drafter_flips", "flip_margin_max", "long_share"))

# %%
vllm_report.same_steps(fused_data["steps"], exact_run, whole_block_run, adaptive_config)

# %% [markdown]
# `fn2`'s acceptance with `fn3a`'s replay standing in for the config it repeated step for step: every point of the
# issue is met.

# %%
vllm_report.fused_acceptance(fused_data["results"], fused_repeats, pl.read_parquet(fused_replay_file), exact_run,
                             fused_data["steps"], rerun=whole_block_run)

# %% [markdown]
# ### The drafting step outside vLLM
#
# `experiments/drafting_step_profile/fused_drafter_profile.py` timed the drafting step on the same H200 outside vLLM, with the same
# drafter and vLLM-shaped state (8 request slots): one whole step replayed from its CUDA graph (7 drafter passes: a
# 16-token catch-up pass and 6 single-token ones, then the lookup and the fusion rule), for 1 and 8 requests, per
# history length. The drafter attends through vLLM's paged FlashAttention, which reads each row only up to its own
# length, so the step no longer grows with the length: 9.2-9.5 ms at 1 request (17 ms without torch.compile),
# 9.7-10.4 ms at 8, from 512 to 3,900 tokens of history. (The first run's masked attention cost 12-21 ms at 1
# request and grew with the length; inside vLLM, which turns cuDNN's attention off, 44 ms on the documents.)

# %%
profile = json.loads(Path(fused_profile_file).read_text())
drafting = pl.DataFrame(profile["rows"])
if "variant" in drafting.columns:  # profiles run with --variants: the chart keeps the two base settings
    drafting = drafting.filter(pl.col("variant").is_in(["eager", "compiled"]))
drafting = drafting.with_columns(
    pl.format("n={}{}", "n", pl.when("compile").then(pl.lit(", compile")).otherwise(pl.lit(""))).alias("batch"))
chart = plots.lines(drafting, "history", "graph_step_ms", "batch", x_title="tokens of history per request",
                    y_title="ms per drafting step (CUDA graph)")
plots.save(chart, figures / "vllm_fused_h200_drafting_step.svg")
chart

# %% [markdown]
# ### Kernel settings of the drafting step: none pays
#
# The same profile again (`--variants --autotune`, `kernel_settings_file`): the whole 7-pass step replayed from its
# CUDA graph under the drafter's kernel settings (`drafter.StaticQwen2`): `no split` (`splits=1`: FlashAttention
# does not split the key length, so no combine kernel per layer), `plan once` (one FA3 scheduling call per pass
# instead of one per layer), both, and both under torch.compile's `max-autotune-no-cudagraphs` mode (`autotuned`).
# At 1 request the default compiled step costs 9.02-9.38 ms from 512 to 3,900 tokens of history; `plan once`
# 8.91-9.29 ms, 0.9-1.2 % less; `no split` 9.09 ms at 512 tokens (0.8 % more) rising with the history to 13.71 ms
# at 3,900 (+46 %), and with `plan once` on top 9.03-13.62 ms; autotuned 11.94-16.59 ms (+32-77 %). At 8 requests
# the same pattern: default 9.75-10.46 ms, `plan once` 9.63-10.37 ms (0.9-1.2 % less), `no split` 0.7 % less at 512
# tokens (9.68 ms) but 14.07 ms (+35 %) at 3,900, autotuned 17.56-22.08 ms (+80-111 %). (Eager, without
# torch.compile: 16.8-17.1 and 18.5-19.3 ms.) None of the three makes a drafter pass cheaper in a way that matters:
# `plan once` saves ~0.1 ms of a ~9 ms step, ~15 µs a pass, where a pass would have to shed a large part of its
# ~1.2 ms; the defaults (the split heuristic, a plan per layer, the default compile mode) stay.

# %%
settings = (pl.DataFrame(json.loads(Path(kernel_settings_file).read_text())["rows"])
            .with_columns(pl.format("n={}", "n").alias("requests"))
            .with_columns((pl.col("graph_step_ms") / pl.col("graph_step_ms").filter(pl.col("variant") == "compiled")
                           .first().over("requests", "history")).alias("vs_compiled")))
chart = plots.lines(settings, "history", "graph_step_ms", "variant", facet="requests",
                    x_title="tokens of history per request", y_title="ms per drafting step (CUDA graph)")
plots.save(chart, figures / "vllm_fused_h200_kernel_settings.svg")
display(settings.group_by("requests", "variant", maintain_order=True).agg(  # noqa: F821
    *[getattr(pl.col(c), f)().alias(f"{f}_{c}") for c in ("graph_step_ms", "vs_compiled") for f in ("min", "max")])
    .sort("requests", maintain_order=True))
chart

# %% [markdown]
# The pieces. `catchup_pass_ms` / `decode_pass_ms` are one drafter pass run eagerly (no graph): 10-23 ms, the time
# the host takes to launch the pass's kernels, not GPU work, which is why the step runs from a graph.
# `attention_flash_ms` and `attention_sdpa_mask_ms` are one layer's attention (16 query positions), on its own, in
# vLLM's FlashAttention and in the masked-sdpa path the CPU uses.

# %%
drafting.select("batch", "history", "graph_step_ms", "catchup_pass_ms", "decode_pass_ms", "attention_flash_ms",
                "attention_sdpa_mask_ms")

# %% [markdown]
# torch.profiler over three drafting steps without the graph (compile on, 1 request, 2,048 tokens of history),
# kernels by GPU time: per layer and pass, ~23 µs of matrix products (four cuBLAS kernels and a split-K reduction),
# ~12 µs of FlashAttention (three kernels: scheduling, attention, split combine), ~8 µs of fused elementwise Triton
# kernels and ~2 µs of cache write; 24 layers make the ~1.1 ms pass.

# %%
print(profile["device"], "| torch", profile["torch"], "| attention", profile["attention"], "|",
      profile["profile_eager_n1"])
print(profile["profile_table"])
