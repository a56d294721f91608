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
fused_run = "fa"  # the first H200 run (target and drafter both the 0.5B)
fused_profile_file = "data/results/fused_drafter_profile_h200.json"  # benchmarks/fused_drafter_profile.py

# %%
import json
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

# %% [markdown]
# ## Inside vLLM's GPU step (gpu-fused)
#
# `gpu-fused` runs the lookup and a Qwen2 drafter fused per position inside vLLM 0.26's model runner V2 (asynchronous
# scheduling, the drafting step replayed from CUDA graphs; `hqlab.engines.vllm.gpu_fused`), next to `none` and
# `gpu-lookup` in the same run. A bring-up run: the target AND the drafter are both Qwen2.5-Coder-0.5B (the drafter
# drafts for itself, not the 1.5B/0.5B pair above), bf16, greedy, 2 repeats, ~2000-token documents (chat prompts
# ≤ 350 tokens), 256 new tokens. Every output matched `none`'s. All speculating configs share nmax=32 and the
# earliest-match policy (gpu-lookup: nmin=1); gpu-fused drafts draft_block=7 tokens with the drafter per step, and
# `compile=true` torch.compiles the drafter's layer bodies.

# %%
fused_rows = pl.read_parquet(fused_vllm_file).filter(pl.col("run") == fused_run)
print(fused_rows["machine"][0], "|", fused_rows["model"][0], fused_rows["dtype"][0], "| run", fused_run,
      "| lossless:", fused_rows["lossless"].all())
classes = ["copy", "code", "edit", "quote", "summary", "qa", "chat"]
label = pl.col("config").str.replace_all(r"(nmin=1|nmax=32|policy=earliest),?", "").str.strip_chars_end(",")
fused = (fused_rows.filter(pl.col("concurrency") <= 1)
         .group_by("category", "config", maintain_order=True)
         .agg(pl.col("decode_tok_s").median(), pl.col("tokens_per_step").median(),
              (pl.col("propose_ms_per_step") + pl.col("verify_ms_per_step")).median().alias("ms_per_step"),
              pl.len().alias("prompts"))
         .with_columns((pl.col("decode_tok_s") / pl.col("decode_tok_s").filter(pl.col("config") == "none").first()
                        .over("category")).alias("vs_none"), label)
         .sort(pl.col("category").cast(pl.Enum(classes)), pl.col("config").str.len_chars()))
fused

# %% [markdown]
# ### Many tokens per step, few tokens per second (batch 1)
#
# Per task class, medians over the class's prompts (each the median of its repeats) at batch 1: decode tok/s (top,
# log scale), tokens per verify step (middle) and ms per step, proposing + verifying (bottom, log scale; tok/s ≈
# tokens/step ÷ s/step). gpu-fused emits 6.5-15 tokens per step, close to gpu-lookup where the lookup finds the text
# (copy, code, edit) and more where it does not (qa, quote, summary, chat), yet decodes at 0.27-0.66x `none`
# (0.32-0.95x with compile): its step costs 16-24 ms on the short chat prompts and 43-54 ms on the ~2000-token
# documents, against 2.2-2.6 ms for a plain step. gpu-lookup's steps cost what `none`'s do, so its long blocks make
# it 5-14x faster on copy, code, edit, quote and qa.

# %%
chart = plots.bar_panels(fused, "category", "config", {"decode_tok_s": "decode tok/s (batch 1)",
                                                       "tokens_per_step": "tokens per verify step",
                                                       "ms_per_step": "ms per step"},
                         log=("decode_tok_s", "ms_per_step"))
plots.save(chart, figures / "vllm_fused_h200_classes.svg")
chart

# %% [markdown]
# Four requests submitted together (copy, code, edit, quote): total tok/s, and its ratio to `none` under the same
# load. Here too gpu-fused runs at about a third of `none` (0.33x, 0.37x with compile), gpu-lookup at 3.5x.

# %%
(fused_rows.filter(pl.col("concurrency") > 1).with_columns(label).group_by("config", maintain_order=True)
 .agg(pl.col("batch_tok_s").first(), pl.col("tokens_per_step").median())
 .with_columns((pl.col("batch_tok_s") / pl.col("batch_tok_s").filter(pl.col("config") == "none").first())
               .alias("vs_none")))

# %% [markdown]
# ### Where the drafting step's time goes
#
# `benchmarks/fused_drafter_profile.py` timed the drafting step outside vLLM, on the same H200 with the same drafter
# and vLLM-shaped state (8 request slots, 2300 tokens of history each): one whole step replayed from its CUDA graph
# (7 drafter passes: a 16-token catch-up pass and 6 single-token ones, then the lookup and the fusion rule), for 1 and
# 8 requests, per attention-length bucket. The drafter attends over its whole bucket (masked), so the step costs
# more as the bucket grows: at 1 request 20 → 29 ms from 512 to 4096 positions (12 → 21 ms with compile), at 8
# requests 23 → 37 ms (14 → 29 ms). The last bucket is the whole drafter cache, max_model_len + k + 1 +
# draft_block = 4119 positions: one layer's masked attention costs about twice what it costs at 4096 (the table
# below), so that step jumps by 6-11 ms. Chat's steps inside vLLM (short prompts, 512-1024 bucket) cost about
# this graph step plus a plain target step; the ~2000-token documents' steps (4096 bucket) cost 19-23 ms more than
# that, time this profile does not show.

# %%
profile = json.loads(Path(fused_profile_file).read_text())
drafting = pl.DataFrame(profile["rows"]).with_columns(
    pl.format("n={}{}", "n", pl.when("compile").then(pl.lit(", compile")).otherwise(pl.lit(""))).alias("batch"))
chart = plots.lines(drafting, "attn_len", "graph_step_ms", "batch", x_title="drafter attention length (bucket)",
                    y_title="ms per drafting step (CUDA graph)")
plots.save(chart, figures / "vllm_fused_h200_drafting_step.svg")
chart

# %% [markdown]
# The pieces. `catchup_pass_ms` / `decode_pass_ms` are one drafter pass run eagerly (no graph): 15-20 ms (16-33 ms
# with compile) at every length and batch size, the time the host takes to launch the pass's kernels, not GPU
# work, which is why the step runs from a graph. `cache_write_ms`, `cache_gather_ms` and `sdpa_mask_ms` are one
# layer's KV-cache write, gather and masked attention (16 query positions), each on its own.

# %%
drafting.select("batch", "attn_len", "graph_step_ms", "catchup_pass_ms", "decode_pass_ms", "cache_write_ms",
                "cache_gather_ms", "sdpa_mask_ms")

# %% [markdown]
# torch.profiler over three drafting steps without the graph (compile on, 1 request, the 4096 bucket), kernels by GPU
# time: cuDNN's masked attention takes about half of it (~61 µs a call, 7 passes × 24 layers a step).

# %%
print(profile["device"], "| torch", profile["torch"], "| bucket", profile["profile_eager_n1_bucket"])
print(profile["profile_table"])
