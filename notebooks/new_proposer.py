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
# # A new proposer in one cell: define it, replay it, run it live, compare it
#
# Template for prototyping a proposer. The cell below defines a toy one, **bigram chaining**: from the request's
# own history, count which token followed each token, then propose the most frequent successor of the last
# token, of that one, and so on, k times. Unlike context lookup it does not need a matching suffix, only a token
# seen before; it guesses more often and copies less exactly.
#
# Anything with a `k` and `propose(histories, budgets, keys=None) -> list[Proposal]` is a proposer
# (`hqlab/proposers/base.py`). Registering it under a name makes its spec (`bigram:k=8,min_count=2`) work
# everywhere a spec is taken: the exact replay and sweeps (`hqlab.replay`, `hqlab.replay.sweep`), the live engine
# (`HFEngine.generate`) and the benchmark harness. Replace the class, keep the rest.

# %% tags=["parameters"]
model = "qwen2.5-coder-0.5b"
device = "auto"
dtype = "auto"
suite = "all"
doc_tokens = 1500
max_new_tokens = 128
limit = 0
shipped_traces = ["0.5b_all_128_bf16"]  # committed trace sets if recorded like here; []: record
toy_grid = {"k": [4, 8, 15], "min_count": [1, 2]}
builtins = ["lookup:nmin=6,nmax=12,k=15", "lookup:nmin=1,nmax=32,k=15,policy=earliest", "pld:n=3,k=10"]
live_configs = ["bigram:k=8,min_count=1", "lookup:nmin=6,nmax=12,k=15"]
live_limit = 2
figures_dir = "figures"
results_dir = "data/results"  # the results folder the run new_proposer/<card> is written to

# %%
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Sequence

import altair as alt
import numpy as np
import polars as pl

from hqlab import bench, plots
from hqlab.bench import results
from hqlab.config import ConfigError, DecodeConfig
from hqlab.proposers import REGISTRY, Proposal, Proposer, Source, make_proposer


@dataclass(frozen=True)
class BigramConfig:
    """k: tokens proposed per step; min_count: stop the chain at a successor seen fewer times than this."""

    k: int = 8
    min_count: int = 1

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ConfigError(f"bigram: k must be >= 1 (got {self.k})")
        if self.min_count < 1:
            raise ConfigError(f"bigram: min_count must be >= 1 (got {self.min_count})")


class BigramProposer:
    name: ClassVar[str] = "bigram"
    Config = BigramConfig

    def __init__(self, config: BigramConfig | None = None) -> None:
        self.config = config or BigramConfig()
        self.k = self.config.k

    def propose(self, histories: Sequence[np.ndarray], budgets: Sequence[int],
                keys: Sequence[str] | None = None) -> list[Proposal]:
        return [self._one(np.asarray(h), min(self.k, int(b))) for h, b in zip(histories, budgets)]

    def _one(self, history: np.ndarray, n: int) -> Proposal:
        tokens: list[int] = []
        prev, nxt = history[:-1], history[1:]
        last = int(history[-1]) if history.size else -1
        while len(tokens) < n and history.size > 1:
            successors = nxt[prev == last]
            if successors.size == 0:
                break
            values, counts = np.unique(successors, return_counts=True)
            best = counts.argmax()
            if counts[best] < self.config.min_count:
                break
            last = int(values[best])
            tokens.append(last)
        arr = np.array(tokens, dtype=np.int64)
        return Proposal(arr, np.full(arr.size, Source.DRAFT, dtype=np.int8), match_len=1 if tokens else 0)


REGISTRY["bigram"] = BigramProposer
assert isinstance(make_proposer("bigram:k=4"), Proposer)

# %% [markdown]
# ## 1. Reference outputs: one plain decode per prompt (from the trace cache under data/traces)

# %%
from hqlab.engines.hf import HFEngine
from hqlab.provenance import machine_description
from hqlab.replay import sweep
from hqlab.replay.costmodel import CostModel
from hqlab.replay.traces import cached_traces

alt.renderers.enable("svg")
pl.Config.set_fmt_str_lengths(60)
pl.Config.set_tbl_width_chars(160)
figures = Path(figures_dir)
engine = HFEngine.load(model, device=device, dtype=dtype)  # the live runs below need it anyway
found = cached_traces(model, suite, max_new_tokens, dtype=dtype, device=device, doc_tokens=doc_tokens,
                      limit=limit, engine=engine, shipped=results.trace_files(shipped_traces))
card = results.card_of(machine_description(engine.device))  # the run new_proposer/<card> this notebook writes
prompts, traces = found.prompts, found.traces
decode = DecodeConfig(max_new_tokens=max_new_tokens)
print(machine_description(engine.device), "|", len(prompts), "prompts")

# %% [markdown]
# ## 2. Live: the real engine runs the toy (registered above) next to a built-in
# Greedy outputs are checked token by token against the engine's own no-speculation output. The step records of
# these runs also price a verify step on this machine (time vs verify length and context), which turns the
# replayed steps below into predicted speed. The shortest prompts keep this cheap, but their contexts are short:
# prices of long-context classes are extrapolated (raise `live_limit` to cover them).

# %%
# The `live_limit` shortest prompts (0: all): on a CPU the live runs are what takes time (on two cores without
# AVX-512 the 0.5B's bf16 prefill of a 1,500-token labd prompt alone takes ~100 s per run).
shortest = sorted(range(len(prompts)), key=lambda i: len(traces[i].prompt_ids))[:live_limit or len(prompts)]
live_prompts = [prompts[i] for i in sorted(shortest)]
print("live on", ", ".join(f"{prompts[i].id} ({len(traces[i].prompt_ids)} tokens)" for i in sorted(shortest)))
live, live_steps = bench.run_bench(engine, live_prompts, live_configs, decode)
results.write_run("new_proposer", card, card=card, tables={"live": live}, root=results_dir)
assert (live["divergence"] != "mismatch").all(), "a speculative output differs from the reference"
cost = CostModel.fit_steps(live_steps)
print(cost.describe())
longest = max(len(t.prompt_ids) + len(t.output_ids) for t in traces)
print(f"fitted on contexts {live_steps['context_len'].min()}-{live_steps['context_len'].max()}; the replay below "
      f"prices contexts up to {longest}, beyond that range by extrapolation (suffix_lengths measures a grid)")
live.select("config", "prompt_id", "tokens_per_step", "decode_tok_s", "speedup_decode", "divergence")

# %% [markdown]
# ## 3. Exact replay over every prompt: the toy's grid against the built-ins

# %%
toy_specs = sweep.grid("bigram", **toy_grid)
specs = list(dict.fromkeys([*toy_specs, *builtins, *live_configs]))
grid = sweep.sweep(traces, specs, cost=cost)
table = sweep.by_category(grid)
results.write_run("new_proposer", card, card=card, tables={"replay": grid}, root=results_dir)
best_toy = sweep.best_overall(grid.filter(pl.col("config").is_in(toy_specs))).row(0, named=True)["config"]
shown = list(dict.fromkeys([best_toy, *builtins]))
print("best toy configuration by geometric-mean predicted speedup:", best_toy)

# %%
chart = plots.grouped_bars(table.filter(pl.col("config").is_in(shown)), "category", "tokens_per_step", "config",
                           y_title="tokens per verify step (replay)", rule_at=1.0)
plots.save(chart, figures / "new_proposer_tokens_per_step.svg")
chart

# %%
chart = plots.grouped_bars(table.filter(pl.col("config").is_in(shown)), "category", "speedup_pred", "config",
                           y_title="predicted decode speedup", rule_at=1.0)
plots.save(chart, figures / "new_proposer_speedup.svg")
chart

# %% [markdown]
# ## 4. Replay against live
# Where a live output is identical to the reference, its tokens/step must equal the replay's exactly.

# %%
replayed = grid.select("config", "prompt_id", pl.col("tokens_per_step").alias("replay"))
check = live.filter(pl.col("config") != "none").join(replayed, on=["config", "prompt_id"])
assert check.height == (len(set(live_configs) - {"none"})) * len(live_prompts)
exact = check.filter(pl.col("divergence") == "identical")  # near-tie flips (see the lossless check) differ by design
print(f"{exact.height} of {check.height} live runs token-identical to the reference")
if exact.height:
    assert (exact["tokens_per_step"] - exact["replay"]).abs().max() < 1e-9, "replay must equal live"
agg = (check.group_by(["config", "category"], maintain_order=True)
       .agg(pl.col("tokens_per_step").median().alias("live"), pl.col("replay").median())
       .unpivot(index=["config", "category"], variable_name="source", value_name="tokens_per_step"))
chart = plots.grouped_bars(agg, "category", "tokens_per_step", "source", facet="config",
                           y_title="tokens per verify step")
plots.save(chart, figures / "new_proposer_live.svg")
chart

# %%
sweep.best_overall(grid).select("config", "geomean_speedup", "worst_class", "mean_tokens_per_step")
