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
# Re-plots a committed GPU run (`experiments/suffix_match_latency/bench_kernels.py`, data/results/kernels/<run>/, run on
# the machine its rows and run.json record). The kernels need a GPU to time; the figure does not.

# %% tags=["parameters"]
run = "h200"  # a run of the study kernels
figures_dir = "figures"
published_dir = "data/results"  # the results folder it is read from

# %%
from pathlib import Path

import altair as alt
import polars as pl

from hqlab import plots
from hqlab.bench import results

alt.renderers.enable("svg")
frame = results.load("kernels", run, root=published_dir)
gpu = frame["gpu"][0] if "gpu" in frame.columns else "GPU"
chart = plots.kernel_latency(frame, title=f"Suffix-match lookup, nmin 6 / nmax 12 / k 15: {gpu} and its host CPU")
plots.save(chart, Path(figures_dir) / "kernels_latency.svg")
chart

# %%
pl.Config.set_tbl_width_chars(200)
pl.Config.set_fmt_str_lengths(40)
frame.pivot(on="context", index=["method", "batch"], values="median_us", aggregate_function="first").sort("batch")
