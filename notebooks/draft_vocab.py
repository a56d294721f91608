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
# # Draft vocabulary: coverage of the model's own outputs, and what a smaller head saves
#
# A drafter that scores only N rows of the lm_head can never propose a token outside its list, so the share of
# the target's output tokens the list contains (**coverage**) bounds what it can deliver (SPEC §2.7). We count
# lists from self-generated answers (`benchmarks/selfgen_gpu.py` over `data/prompts/selfgen.jsonl`) and from a
# generic corpus (Python's standard library sources, its documentation topics and the installed packages'
# READMEs), hold out every 10th record (`j % 10 == 0`) and measure coverage of the held-out outputs over N.
# Then we time a draft step vs N. Corpora listed in `corpora` that do not exist yet are skipped.

# %% tags=["parameters"]
model = "qwen2.5-coder-0.5b"  # tokenizer (shared by the Qwen2.5-Coder family) and the model timed below
corpora = {
    "qwen2.5-coder-0.5b": "data/selfgen/qwen2.5-coder-0.5b.jsonl",
    "qwen2.5-coder-1.5b": "data/selfgen/qwen2.5-coder-1.5b.jsonl",
}
references = {"generic": ["generic"]}
sizes = []  # N values of the curves; empty: 1k..128k plus HyperQwen's 16k-64k of 248k scaled to this vocabulary
latency_sizes = [2048, 4096, 8192, 16384, 32768, 65536]
latency_context = 512
latency_repeats = 20
device = "auto"
dtype = "auto"
gpu_latency = "vocab_latency"  # the study whose runs' latency.json (selfgen_gpu.py --latency-sizes) join, if any
accept_target = "qwen2.5-coder-1.5b"  # target whose greedy outputs the drafter must match
accept_drafter = "qwen2.5-coder-0.5b"
accept_k = 7
accept_sizes = [1024, 4096, 16384, 0]  # 0 is the full vocabulary (no list)
accept_vocab_corpus = ""  # corpus the lists are counted from; empty: the target's own corpus, else the first one
accept_prompts = 6  # held-out prompts of that corpus (their answers were not counted)
accept_max_new_tokens = 64
live_prompts = 1  # of those, run live through the engine (lossless check and measured tok/s)
accept_rerun = False  # False: re-plot the committed results of this section; True: run it (long on a CPU)
figures_dir = "figures"
results_dir = "data/results"  # where the run draft_vocab/cpu is written (and read from when not rerun)

# %%
import json
from pathlib import Path

import altair as alt
import polars as pl

from hqlab import plots, vocab
from hqlab.bench import results

alt.renderers.enable("svg")
pl.Config.set_tbl_width_chars(160)
figures = Path(figures_dir)
_, tokenizer, vocab_size = vocab.model_files(model)
targets = {name: [path] for name, path in corpora.items() if Path(path).exists()}
assert targets, f"none of the corpora exist: {corpora}"
print("targets:", {t: p[0] for t, p in targets.items()}, "| skipped:", sorted(set(corpora) - set(targets)))
sizes = sizes or vocab.default_sizes(vocab_size)

# %% [markdown]
# ## 1. Held-out coverage vs N
# For each target model: the list counted from its own outputs, the generic list, and the lists counted from the
# other models' outputs, all evaluated on the same held-out answers of that target.

# %%
rows = vocab.coverage_study(tokenizer, vocab_size, targets, references, sizes)
coverage = pl.DataFrame(rows)
results.write_run("draft_vocab", "cpu", card="cpu", tables={"coverage": coverage}, root=results_dir)
overall = coverage.filter(pl.col("src") == "all")
chart = plots.lines(overall, "n", "coverage", "list", facet="target", x_title="draft vocabulary size N",
                    y_title="held-out coverage", log_x=True)
plots.save(chart, figures / "vocab_coverage.svg")
chart

# %%
overall.pivot(on="list", index=["target", "n"], values="coverage").sort("target", "n")

# %%
counts = coverage.group_by("target", "list").agg(pl.col("list_tokens").first(), pl.col("list_records").first(),
                                                 pl.col("list_distinct").first(),
                                                 pl.col("heldout_tokens").filter(pl.col("src") == "all").first())
counts.sort("target", "list")

# %% [markdown]
# ## 2. Coverage by kind of answer (chat, code, math)

# %%
by_kind = coverage.filter(pl.col("src") != "all").with_columns(
    pl.format("{}: {}", pl.col("target"), pl.col("src")).alias("panel"))
chart = plots.lines(by_kind, "n", "coverage", "list", facet="panel", x_title="draft vocabulary size N",
                    y_title="held-out coverage", log_x=True)
plots.save(chart, figures / "vocab_coverage_by_kind.svg")
chart

# %% [markdown]
# ## 3. Draft step latency vs N
# One draft step = the model body's forward for one token over a KV cache of `latency_context` tokens, the head
# over N rows, and the argmax (median of `latency_repeats`); "full" is the whole vocabulary. GPU rows appear
# when a `selfgen_gpu.py --latency-sizes` result file exists.

# %%
from hqlab.proposers.draft import load_drafter
from hqlab.provenance import machine_description

lat_model = load_drafter(model, device, dtype)  # the same weights the drafter below uses
latency_rows = vocab.measure_draft_latency(lat_model, latency_sizes, context=latency_context,
                                           repeats=latency_repeats)
where = machine_description(next(lat_model.parameters()).device)
latency = pl.DataFrame([r | dict(model=model, device=where) for r in latency_rows])
for run in (results.runs(gpu_latency) if gpu_latency in results.studies() else []):
    latency = pl.concat([latency, pl.DataFrame(json.loads(results.read_text(gpu_latency, run, "latency.json")))
                         .select(latency.columns)], how="vertical_relaxed")
results.write_run("draft_vocab", "cpu", card="cpu", tables={"latency": latency}, root=results_dir)
full_ms = latency.filter(pl.col("full")).select("device", pl.col("step_ms").alias("full_ms"))
latency = latency.join(full_ms, on="device").with_columns(
    (pl.col("step_ms") / pl.col("full_ms")).alias("relative_step"))
long = latency.unpivot(index=["device", "n"], on=["step_ms", "head_ms"], variable_name="part", value_name="ms")
long = long.with_columns(pl.col("part").replace({"step_ms": "draft step", "head_ms": "head only"}))
chart = plots.lines(long, "n", "ms", "part", facet="device", x_title="draft vocabulary size N (last = full)",
                    y_title="ms (median)", log_x=True)
plots.save(chart, figures / "vocab_latency.svg")
chart

# %%
latency.select("device", "n", "full", "step_ms", "head_ms", "relative_step").sort("device", "n")

# %% [markdown]
# ## 4. Acceptance, tokens per step and speed vs N
# The drafter (`draft:` proposer) drafts `accept_k` tokens with its head cut to the top-N list; the target
# verifies greedily. **Replay** (`hqlab.replay.sweep`, exact under greedy decoding) gives tokens per step on every
# held-out prompt; a few prompts also run **live** in the engine (tokens/step, tok/s, drafter and verify time, and
# the lossless check against the engine's own no-speculation output). N = full vocabulary is the drafter without
# a list. With `accept_rerun = False` this section re-plots the committed results (the run takes long on a CPU).

# %%
if accept_rerun:
    from hqlab.bench.suites import vocab_acceptance

    vocab_corpus = accept_vocab_corpus or targets.get(accept_target, next(iter(targets.values())))[0]
    replayed, live = vocab_acceptance(accept_target, accept_drafter, vocab_corpus, accept_sizes, k=accept_k,
                                      prompts=accept_prompts, live_prompts=live_prompts,
                                      max_new_tokens=accept_max_new_tokens, device=device, dtype=dtype,
                                      vocab_model=model)
    results.write_run("draft_vocab", "cpu", card="cpu", tables={"acceptance_replay": replayed, "acceptance_live": live},
                      root=results_dir)

replayed = results.load("draft_vocab", "cpu", "acceptance_replay", root=results_dir)
live = results.load("draft_vocab", "cpu", "acceptance_live", root=results_dir)
assert live.filter(pl.col("divergence") == "mismatch").height == 0, "a speculative output differs from the reference"
print(live["model"][0], "target |", live["machine"][0], "|", replayed["p_model"][0], "drafter, k =",
      replayed["p_k"][0], "|", replayed["prompt_id"].n_unique(), "replayed prompts,", live["prompt_id"].n_unique(),
      "live")
live_ids = live["prompt_id"].unique().to_list()
per_n = replayed.group_by("n").agg(
    pl.col("output_coverage").mean().alias("coverage of the outputs"),
    (pl.col("accepted").sum() / (pl.col("steps").sum() * pl.col("p_k").cast(pl.Int64).first()))
    .alias("acceptance rate"),
    pl.col("tokens_per_step").mean().alias("replay tokens/step"),
    pl.col("tokens_per_step").filter(pl.col("prompt_id").is_in(live_ids)).mean()
    .alias("replay tokens/step, live prompts"))
measured = live.filter(pl.col("n") > 0).group_by("n").agg(
    pl.col("tokens_per_step").mean().alias("live tokens/step"),
    pl.col("speedup_decode").median().alias("live decode speedup"),
    pl.col("propose_ms_per_step").median().alias("live drafter ms/step"),
    pl.col("verify_ms_per_step").median().alias("live verify ms/step"))
summary = per_n.join(measured, on="n", how="left").sort("n")
summary

# %%
long = summary.drop("live drafter ms/step", "live verify ms/step").unpivot(
    index="n", variable_name="metric", value_name="value").drop_nulls()
long = long.with_columns(pl.when(pl.col("metric").str.contains("tokens/step")).then(pl.lit("tokens per step"))
                         .when(pl.col("metric").str.contains("speedup")).then(pl.lit("live decode speedup"))
                         .otherwise(pl.lit("share of tokens")).alias("panel"))
chart = plots.lines(long, "n", "value", "metric", facet="panel", x_title="draft vocabulary size N (last = full)",
                    y_title="", log_x=True)
plots.save(chart, figures / "vocab_acceptance.svg")
chart

# %%
live.select("n", "prompt_id", "divergence", "first_divergence", "divergence_margin", "tokens_per_step",
            "decode_tok_s", "speedup_decode").sort("n")
