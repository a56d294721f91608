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
gpu_latency = "data/results/vocab_latency_gpu_*.json"  # glob: selfgen_gpu.py --latency-sizes results, if any
figures_dir = "figures"
results_dir = "data/results"

# %%
import json
from pathlib import Path

import altair as alt
import polars as pl

from hqlab import plots, vocab

alt.renderers.enable("svg")
pl.Config.set_tbl_width_chars(160)
figures, results = Path(figures_dir), Path(results_dir)
results.mkdir(parents=True, exist_ok=True)
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
coverage.write_parquet(results / "vocab_coverage.parquet")
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
from hqlab import models

lat_model, _, info = models.load(model, device=device, dtype=dtype)
latency_rows = vocab.measure_draft_latency(lat_model, latency_sizes, context=latency_context,
                                           repeats=latency_repeats)
where = vocab.device_description(lat_model)
latency = pl.DataFrame([r | dict(model=model, device=where) for r in latency_rows])
for f in sorted(Path().glob(gpu_latency)):
    latency = pl.concat([latency, pl.DataFrame(json.loads(Path(f).read_text())).select(latency.columns)],
                            how="vertical_relaxed")
latency.write_parquet(results / "vocab_latency.parquet")
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
