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
# config, loaded by vLLM's own `vllm bench serve`; the machine is recorded in the parquet). For each dataset and
# temperature: output throughput and time per output token against the requests in flight, each config's
# throughput ÷ `none`'s, the best config per load, and the sampling test (per-position token frequencies of 600
# samples against `none`'s, chi-square, Bonferroni). docs/serving.md reads these.

# %% tags=["parameters"]
results_file = "data/results/vllm_serve_h200.parquet"
samples_file = "data/results/vllm_serve_h200.samples.parquet"
run = "s1"
figures_dir = "figures"
positions = 24  # output positions the sampling test compares

# %%
from pathlib import Path

import altair as alt
import polars as pl

from hqlab import plots
from hqlab.bench import serve

alt.renderers.enable("svg")
pl.Config.set_tbl_width_chars(200)
pl.Config.set_fmt_str_lengths(60)
rows = pl.read_parquet(results_file).filter(pl.col("run") == run)
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
# The sampling test: each speculator's samples against `none`'s (same prompt, temperature 1), and a server with a
# planted verification bug, which must fail.

# %%
samples = pl.read_parquet(samples_file).filter(pl.col("run") == run)
by = dict(zip(samples["config"], samples["token_ids"].to_list()))
verdicts = []
for config, got in by.items():
    if config == "none":
        continue
    per_position = serve.distribution_test(by["none"], got, positions=positions)
    verdicts.append({"config": config, "samples": len(got), "min p": min(r["p"] for r in per_position),
                     "same distribution": serve.same_distribution(per_position)})
pl.DataFrame(verdicts)
