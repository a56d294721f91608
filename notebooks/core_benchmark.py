# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Core benchmark: hqlab lookup vs no speculation vs transformers' prompt lookup
#
# By default this notebook re-plots the committed benchmark results (`data/results/core_<tag>.parquet`, written
# by `benchmarks/bench_core.py` on the machine named in every row). With `rerun = True` it first runs the
# benchmark here, on this machine, with the parameters below.

# %% tags=["parameters"]
tags = ["cpu"]
rerun = False
model = "qwen2.5-coder-0.5b"
device = "auto"
configs = ["lookup:nmin=1,nmax=32,k=15,policy=earliest", "lookup:nmin=6,nmax=12,k=15", "lookup:nmin=6,nmax=12,k=7", "pld:n=3,k=10", "hf-pld:k=10"]
suites = {"labd": 512, "chat": 128}
doc_tokens = 2000
repeats = 1
limit = 0
figures_dir = "figures"
results_dir = "data/results"

# %%
from pathlib import Path

import altair as alt
import polars as pl

from hqlab import bench
from hqlab.config import DecodeConfig

alt.renderers.enable("svg")
pl.Config.set_fmt_str_lengths(60)
pl.Config.set_tbl_width_chars(180)
pl.Config.set_tbl_rows(60)
figures, results_path = Path(figures_dir), Path(results_dir)

# %%
if rerun:
    from hqlab.engines.hf import HFEngine
    from hqlab.workloads import load_workload

    engine = HFEngine.load(model, device=device)
    frames = []
    for suite, n in suites.items():
        prompts = load_workload(suite, doc_tokens=doc_tokens, tokenizer=engine.tokenizer)
        prompts = prompts[:limit] if limit else prompts
        frames.append(bench.run_bench(engine, prompts, configs, DecodeConfig(max_new_tokens=n), repeats=repeats,
                                      meta={"suite": suite, "doc_tokens": doc_tokens})[0])
    results_path.mkdir(parents=True, exist_ok=True)
    pl.concat(frames, how="diagonal_relaxed").write_parquet(results_path / f"core_{tags[0]}.parquet")

# %%
for tag in tags:
    results = pl.read_parquet(results_path / f"core_{tag}.parquet")
    print(f"[{tag}] engine {results['engine'][0]}, model {results['model'][0]} ({results['dtype'][0]}), "
          f"machine: {results['machine'][0]}")
    print(bench.summarize(results))
    for path in bench.core_figures(results, tag, figures):
        print("wrote", path)
