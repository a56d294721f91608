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
# # Suffix-match kernels: latency per decode step
#
# Re-plots the committed GPU benchmark (`benchmarks/bench_kernels.py`, run on the machine recorded in the
# parquet). The kernels need a GPU to time; the figure does not.

# %% tags=["parameters"]
results_file = "data/results/kernels_h200.parquet"
figures_dir = "figures"
results_dir = "data/results"

# %%
from pathlib import Path

import altair as alt
import polars as pl

from hqlab import plots

alt.renderers.enable("svg")
frame = pl.read_parquet(results_file)
gpu = frame["gpu"][0] if "gpu" in frame.columns else "GPU"
chart = plots.kernel_latency(frame, title=f"Suffix-match lookup, nmin 6 / nmax 12 / k 15: {gpu} and its host CPU")
plots.save(chart, Path(figures_dir) / "kernels_latency.svg")
chart

# %%
pl.Config.set_tbl_width_chars(200)
pl.Config.set_fmt_str_lengths(40)
frame.pivot(on="context", index=["method", "batch"], values="median_us", aggregate_function="first").sort("batch")
