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
# # Core benchmark: hqlab lookup vs no speculation vs transformers' prompt lookup
#
# By default this notebook re-plots the committed benchmark runs (`data/results/core/<tag>/`, written by
# `benchmarks/bench_core.py` on the machine named in every row and in the run's run.json). With `rerun = True` it
# first runs the benchmark here, on this machine, with the parameters below. `engine = "vllm"` runs the configs inside
# vLLM on a CUDA GPU instead (`hqlab.bench.vllm`, docs/vllm.md; hqlab proposers through the custom_class adapter, and
# vLLM's own `vllm-ngram` / `arctic-suffix`); its results have the same columns, so every cell below applies.

# %% tags=["parameters"]
tags = ["cpu", "vllm"]  # runs of the study `core` (data/results/core/<tag>/)
rerun = False
engine = "hf"
model = "qwen2.5-coder-0.5b"
device = "auto"
dtype = "auto"  # "auto": bf16 on CUDA and CPU alike; float32 is faster on CPUs without bf16 arithmetic
configs = ["lookup:nmin=1,nmax=32,k=15,policy=earliest", "lookup:nmin=6,nmax=12,k=15", "lookup:nmin=6,nmax=12,k=7", "pld:n=3,k=10", "hf-pld:k=10"]
suites = {"labd": 512, "chat": 128}
doc_tokens = 2000
repeats = 1
limit = 0
figures_dir = "figures"
results_dir = "data/results"  # the results folder read, and written by a rerun

# %%
from pathlib import Path

import altair as alt
import polars as pl

from IPython.display import SVG, display

from hqlab import bench, plots
from hqlab.bench import results as committed

alt.renderers.enable("svg")
pl.Config.set_fmt_str_lengths(60)
pl.Config.set_tbl_width_chars(180)
pl.Config.set_tbl_rows(60)
figures = Path(figures_dir)

# %%
if rerun:  # every suite through `engine` ("hf" or "vllm"), then the run core/<first tag> with its rows and steps
    results, steps = bench.run_suites(engine, suites, configs, model=model, device=device, dtype=dtype,
                                      doc_tokens=doc_tokens, limit=limit, repeats=repeats)
    committed.write_run("core", tags[0], card=committed.card_of(results["machine"][0]),
                        tables={"rows": results, "steps": steps}, root=results_dir)

# %%
for tag in tags:
    results = committed.load("core", tag, root=results_dir)
    print(f"[{tag}] engine {results['engine'][0]}, model {results['model'][0]} ({results['dtype'][0]}), "
          f"machine: {results['machine'][0]}")
    print(bench.summarize(results))
    for path in bench.core_figures(results, tag, figures):
        print("wrote", path)
        display(SVG(filename=str(path)))

# %% [markdown]
# ## Per task class: decode speed, per-position acceptance, acceptance-length histogram
#
# Decode tok/s is (output tokens - 1) / (time of the last token - time of the first), median over prompts.
# Per-position acceptance at position i is the share of drafts that accepted more than i tokens (transformers'
# prompt lookup does not expose its drafts, so only hqlab's proposers have a curve). The histogram counts verify
# steps by the number of proposed tokens they accepted: a proposer that is often right but proposes few tokens
# piles up at its k, one that guesses long and misses piles up at 0.

# %%
for tag in tags:
    results = committed.load("core", tag, root=results_dir)
    steps = committed.load("core", tag, "steps", root=results_dir)
    per_cat = results.group_by(["category", "config"], maintain_order=True).agg(
        pl.col("decode_tok_s").median(), pl.col("e2e_tok_s").median(), pl.col("tokens_per_step").median())
    speed = plots.grouped_bars(per_cat, "category", "decode_tok_s", "config", y_title="decode tok/s (median)")
    plots.save(speed, figures / f"core_{tag}_decode_tok_s.svg")
    display(speed)
    acceptance = bench.acceptance_by_position(steps.filter(pl.col("config") != "none"))
    histogram = plots.acceptance_histogram_data(steps)
    if acceptance.height == 0:  # e.g. very short answers: nothing was ever proposed
        print(f"[{tag}] no config proposed a draft: no acceptance curves or histograms")
    else:
        curve = plots.lines(acceptance, "position", "acceptance", "config", facet="category",
                            x_title="draft position", y_title="share of drafts accepting past it")
        plots.save(curve, figures / f"core_{tag}_acceptance_by_position.svg")
        display(curve)
    if histogram.height:
        hist = plots.histograms(histogram, "accepted", "share", "config", facet="category",
                                x_title="proposed tokens accepted in a step", y_title="share of steps")
        plots.save(hist, figures / f"core_{tag}_acceptance_hist.svg")
        display(hist)
    print(per_cat.pivot(on="config", index="category", values="decode_tok_s").with_columns(pl.selectors.numeric().round(1)))
