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
# # Explorer: where do a proposer's tokens come from?
#
# The target decodes each prompt once without speculation; every proposer setting is then **replayed** exactly
# over that output (greedy acceptance depends only on it). Each token below is coloured by who supplied it:
# the lookup (or a drafter) when the target accepted a proposed token, the target itself as a **correction**
# where it rejected one, or as the **bonus** token after a fully accepted proposal. Each verify step is a box
# with the block length it was allowed in small grey digits; hover a box for its numbers.
#
# In JupyterLab the widget at the end re-runs the replay when a slider moves. On the published site the widget
# shows the state it had when the notebook was executed.

# %% tags=["parameters"]
model = "qwen2.5-coder-0.5b"
device = "auto"
dtype = "auto"
suite = "labd"
doc_tokens = 1500
max_new_tokens = 128
limit = 0
shipped_traces = ["0.5b_all_128_bf16"]  # committed trace sets if recorded like here; []: record
request = "code"
compare = ["lookup:nmin=6,nmax=12,k=15", "lookup:nmin=1,nmax=32,k=15,policy=earliest", "pld:n=3,k=10"]
start = "lookup:nmin=6,nmax=12,k=15"
figures_dir = "figures"

# %%
from pathlib import Path

import altair as alt
import polars as pl
from IPython.display import HTML, display

from hqlab import plots
from hqlab.bench import results
from hqlab.proposers import make_proposer
from hqlab.replay import replay
from hqlab.replay.traces import cached_traces
from hqlab.site import explorer
from hqlab.trace import records_frame

alt.renderers.enable("svg")
# the greedy outputs: trace cache, else the shipped set, else recorded here (only then does the model load)
found = cached_traces(model, suite, max_new_tokens, dtype=dtype, device=device, doc_tokens=doc_tokens,
                      limit=limit, shipped=results.trace_files(shipped_traces))
traces, tokenizer = found.traces, found.tokenizer
by_id = {t.prompt_id: t for t in traces}
trace = by_id.get(request, traces[0])
print(f"{len(traces)} traces; showing {trace.prompt_id!r} ({trace.category}, {len(trace.output_ids)} tokens)")


def token_text(token_id: int) -> str:
    return tokenizer.decode([token_id])


texts = [token_text(t) for t in trace.output_ids]

# %% [markdown]
# ## One request, several proposers

# %%
runs = {}
for spec in compare:
    records = replay(trace.prompt_ids, trace.output_ids, make_proposer(spec), max_new_tokens=trace.max_new_tokens,
                     request=trace.prompt_id)
    runs[spec] = records
    s = explorer.summary(records, len(trace.output_ids))
    display(HTML(explorer.render_stream(texts, records, title=f"{spec}: {s['tokens_per_step']:.2f} tokens/step, "
                                                               f"{s['steps']} steps")))

# %% [markdown]
# ## Tokens per step along the output
# Where the copy starts and stops shows up as the switch between long bars and ones.

# %%
timeline = pl.concat([records_frame(r).with_columns(pl.lit(spec).alias("config")) for spec, r in runs.items()])
chart = plots.step_timeline(timeline, title=f"{trace.prompt_id}: tokens emitted per verify step")
plots.save(chart, Path(figures_dir) / "explorer_timeline.svg")
chart

# %% [markdown]
# ## Interactive
# Pick a request and a proposer; every field of the proposer's configuration has a control.

# %%
ex = explorer.Explorer(traces, token_text, start=start)
ex.request.value = trace.prompt_id
ex.widget
