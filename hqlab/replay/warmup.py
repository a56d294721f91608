"""How fast the corpus warms up, what its bound costs, and Arctic's suffix rule beside it (#61), from the exact replay.

A *stream* is one client's requests in the order they are sent: a workload's file (the corpus workloads' traces), or
the requests of one vLLM point in the order that point sent them. Under greedy decoding every verify step a setting
would take over a stream follows from the recorded outputs and the order requests finish (`hqlab.replay.corpus`;
at 8 in flight its `lockstep` schedule reproduces vLLM's tokens a step within 0.1 % on the batch job), so one replay
per setting gives:

- **Warm-up** (`warmup`): tokens a step against how many requests were sent before a request (its place in the
  stream, `order`), binned (`WARMUP_EDGES`: 0, 1, 2-3, 4-7, ... earlier requests). With B in flight the B - 1 sent
  just before it are still decoding when it starts, so their outputs are not in its corpus yet.
- **The bound** (`by_bound`, `knee`): the same stream with the corpus bounded by tokens (`corpus=N`, documents kept
  first in first out as served) or by documents (`corpus_docs`), pooled over the stream; the knee is the smallest
  bound within a tolerance of the best tokens a step over the bounds tried.
- **Arctic beside it** (`VLLM_SUFFIX`): Arctic's rule (`hqlab.rules.suffix_decoding`) as vLLM 0.26's `suffix` method
  runs with no options: tree depth 24, at most 24 tokens a step (vLLM sets `num_speculative_tokens` to the depth),
  spec factor 1.0, min token probability 0.1, a global tree of the last 10,000 requests' outputs (its bound is a
  request count; here `cached`, with the token bound off). vLLM's Arctic also adds the outputs of requests still in
  flight to its global tree as they grow; the replay gives it finished outputs only, so with several in flight
  Arctic's numbers here are a lower bound.

Speed is projected per request with the step cost models of `hqlab.replay.corpus.step_models` (a model per batch
size, `b1`, `b8`, ...; a request decoding among B in flight is priced at batch B, against its own price without
speculation), plus the corpus search at `search_ms_per_1k` ms a step per 1,000 live corpus tokens (hqlab's corpus
only: Arctic's tree lives on the host and its lookups are not priced, nor is the own-history lookup).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

import polars as pl
from tqdm.auto import tqdm

from hqlab.config import require
from hqlab.replay import corpus as rc
from hqlab.replay.corpus_vllm import replay_spec
from hqlab.replay.costmodel import CostModel
from hqlab.replay.traces import Trace

# A token bound no stream reaches (the rule's positions are 32-bit).
UNBOUNDED_TOKENS = 2**31 - 1
# Bins of earlier requests: [0, 1), [1, 2), [2, 4), [4, 8), ... the last one open.
WARMUP_EDGES = (0, 1, 2, 4, 8, 16, 32, 64, 128)
VLLM_SUFFIX = rc.ArcticConfig(k=24, depth=24, factor=1.0, min_prob=0.1, cached=10_000, tokens=UNBOUNDED_TOKENS)

Config = rc.CorpusReplayConfig | rc.ArcticConfig


# ----------------------------------------------------------------------------------------------------------------
# settings


def served(gpu_spec: str, **changes: object) -> rc.CorpusReplayConfig:
    """The replay setting of a served `gpu-lookup` spec (its lookup and corpus keys), with `changes` applied
    (e.g. tokens=4096, inflight=8)."""
    config = rc.parse(replay_spec(gpu_spec))
    require(isinstance(config, rc.CorpusReplayConfig), f"not a corpus replay setting: {gpu_spec!r}")
    return replace(config, **changes)


def at_load(config: Config, load: int) -> Config:
    """`config` with `load` requests in flight: one at a time, or the `lockstep` schedule (a continuously batched
    server's order of finishing, which reproduces vLLM's steps)."""
    return replace(config, inflight=load, schedule="lockstep" if load > 1 else "admit")


def bounds(config: Config, *, tokens: Sequence[int] = (), docs: Sequence[int] = ()) -> list[Config]:
    """`config` bounded by each token count in `tokens` (documents as `config` has them), then by each document
    count in `docs` (tokens unbounded). Arctic's document bound is its request count (`cached`)."""
    require(not (isinstance(config, rc.CorpusReplayConfig) and config.tokens == 0),
            "a corpus setting to bound needs a corpus (tokens > 0)")
    out: list[Config] = [replace(config, tokens=int(t)) for t in tokens]
    for d in docs:
        if isinstance(config, rc.ArcticConfig):
            out.append(replace(config, tokens=UNBOUNDED_TOKENS, cached=int(d)))
        else:
            out.append(replace(config, tokens=UNBOUNDED_TOKENS, docs=int(d)))
    return out


# ----------------------------------------------------------------------------------------------------------------
# replay


def replay_rows(streams: Mapping[str, Sequence[Trace]], settings: Sequence[tuple[str, Config]], *,
                loads: Sequence[int] = (1,), costs: Mapping[str, Mapping[str, CostModel]] | None = None,
                progress: bool = False) -> pl.DataFrame:
    """One row per (stream, setting, load, request), as `hqlab.replay.corpus.rows`, with the stream's name
    (`stream`), the setting's label (`label`) and spec at any load (`setting`: its spec at one request in flight),
    the load (`inflight`), its bounds (`tokens`: -1 unbounded, 0 no corpus; `docs`) and
    tokens emitted (`emitted`: accepted + one a step). `costs` maps a stream to its cost models ({"b1": .., "b8":
    ..}, `rc.step_models`); every load needs its batch's model (a stream without costs gets no prices)."""
    require(len(loads) > 0 and all(b >= 1 for b in loads), f"loads must be >= 1 (got {list(loads)})")
    costs = costs or {}
    for name, models in costs.items():
        missing = [b for b in loads if f"b{b}" not in models]
        require(not missing, f"stream {name!r} has no cost model for batch(es) {missing}")
    frames = []
    jobs = [(name, label, at_load(config, b)) for name in streams for label, config in settings for b in loads]
    for name, label, config in tqdm(jobs, desc="warm-up replay", disable=not progress):
        models = {f"b{config.inflight}": costs[name][f"b{config.inflight}"]} if name in costs else {}
        frame = rc.rows(streams[name], [config.spec()], costs=models, progress=False)
        if models:  # one price column a row whatever its load, so the loads stack
            frame = frame.rename({f"pred_s_b{config.inflight}": "pred_s", f"base_s_b{config.inflight}": "base_s"})
        setting = at_load(config, 1).spec()  # the setting whatever its load
        frames.append(frame.with_columns(pl.lit(name).alias("stream"), pl.lit(label).alias("label"),
                                         pl.lit(setting).alias("setting"),
                                         (pl.col("accepted") + pl.col("steps")).alias("emitted")))
    out = pl.concat(frames, how="diagonal_relaxed")
    return out.with_columns(pl.when(pl.col("tokens") >= UNBOUNDED_TOKENS).then(-1).otherwise(pl.col("tokens"))
                            .alias("tokens"))


def measured_rows(requests: pl.DataFrame, *, stream: str, label_of: Mapping[str, str] | None = None) -> pl.DataFrame:
    """The same columns from a vLLM point's requests (one run, workload, load and repeat): per request its place in
    the order sent, its verify steps and tokens emitted as vLLM recorded them (`step_emitted`). `label_of` maps
    the point's configs to labels (default: the config itself); configs it leaves out are dropped."""
    for column in ("workload", "load", "repeat"):
        values = requests[column].unique().to_list()
        require(len(values) == 1, f"the requests must be of one point: {column} has {sorted(values)}")
    rows = requests if label_of is None else requests.filter(pl.col("config").is_in(list(label_of)))
    label = pl.col("config") if label_of is None else pl.col("config").replace_strict(dict(label_of))
    return rows.select(pl.lit(stream).alias("stream"), label.alias("label"), pl.col("config").alias("spec"),
                       pl.col("load").alias("inflight"), "order", "request",
                       pl.col("step_emitted").list.len().cast(pl.Int64).alias("steps"),
                       pl.col("step_emitted").list.sum().cast(pl.Int64).alias("emitted"))


# ----------------------------------------------------------------------------------------------------------------
# what the rows say


def priced(rows: pl.DataFrame, *, search_ms_per_1k: float = 0.0) -> pl.DataFrame:
    """`rows` with each request's projected decode seconds (`seconds`: its steps at its load's step price, plus the
    corpus search for hqlab's corpus) and without speculation (`none_seconds`); null where a row has no price."""
    require(search_ms_per_1k >= 0, f"search_ms_per_1k must be >= 0 (got {search_ms_per_1k})")
    if "pred_s" not in rows.columns:
        return rows.with_columns(pl.lit(None, pl.Float64).alias("seconds"), pl.lit(None, pl.Float64)
                                 .alias("none_seconds"))
    search = pl.when(pl.col("rule") == "corpus").then(pl.col("searched_tokens") * search_ms_per_1k / 1e6) \
        .otherwise(0.0)
    return rows.with_columns((pl.col("pred_s") + search.fill_null(0.0)).alias("seconds"),
                             pl.col("base_s").alias("none_seconds"))


def _pooled(frame: pl.DataFrame, by: Sequence[str]) -> pl.DataFrame:
    return (frame.group_by(list(by), maintain_order=True)
            .agg(pl.len().alias("requests"), pl.col("steps").sum(),
                 (pl.col("emitted").sum() / pl.col("steps").sum()).alias("tokens_per_step"),
                 (pl.col("none_seconds").sum() / pl.col("seconds").sum()).alias("speedup")))


def _against_lookup(frame: pl.DataFrame, rows: pl.DataFrame, key: Sequence[str]) -> pl.DataFrame:
    """Ratios to the lookup alone (hqlab's rule without a corpus) of the same stream, load and `key`."""
    if "rule" not in rows.columns:
        return frame
    lookup = rows.filter((pl.col("rule") == "corpus") & (pl.col("tokens") == 0))
    if lookup.height == 0:
        return frame
    base = _pooled(lookup, ["stream", "inflight", *key]).select(
        "stream", "inflight", *key, pl.col("tokens_per_step").alias("lookup_tokens_per_step"),
        pl.col("speedup").alias("lookup_speedup"))
    return frame.join(base, on=["stream", "inflight", *key], how="left").with_columns(
        (pl.col("tokens_per_step") / pl.col("lookup_tokens_per_step")).alias("tokens_per_step_vs_lookup"),
        (pl.col("speedup") / pl.col("lookup_speedup")).alias("speedup_vs_lookup"))


def bin_of(order: pl.Expr, edges: Sequence[int] = WARMUP_EDGES) -> pl.Expr:
    """The first edge at or below each value: the warm-up bin of a request with `order` earlier requests."""
    require(list(edges) == sorted(set(edges)) and edges[0] == 0, f"edges must rise from 0 (got {list(edges)})")
    expr = pl.lit(edges[0], dtype=pl.Int64)
    for e in edges[1:]:
        expr = pl.when(order >= e).then(pl.lit(e, dtype=pl.Int64)).otherwise(expr)
    return expr


def warmup(rows: pl.DataFrame, *, edges: Sequence[int] = WARMUP_EDGES, search_ms_per_1k: float = 0.0,
           measured: pl.DataFrame | None = None) -> pl.DataFrame:
    """Per (stream, label, load, bin of earlier requests): the requests in the bin, their mean number of earlier
    requests (`earlier`), tokens a step pooled over their steps, projected speedup over no speculation (summed
    times), and both as ratios to the lookup alone in the same bin. `measured` (`measured_rows`) adds vLLM's own
    tokens a step, its labels as they are."""
    frames = [priced(rows, search_ms_per_1k=search_ms_per_1k)]
    if measured is not None:
        frames.append(priced(measured).with_columns(pl.lit("measured").alias("rule")))
    both = pl.concat(frames, how="diagonal_relaxed").with_columns(bin_of(pl.col("order"), edges).alias("bin"))
    key = ["stream", "label", "inflight", "bin"]
    out = _pooled(both, key).join(both.group_by(key).agg(pl.col("order").mean().alias("earlier")), on=key)
    out = _against_lookup(out, both.filter(pl.col("rule") != "measured"), ["bin"])
    return out.sort("stream", "label", "inflight", "bin")


def by_bound(rows: pl.DataFrame, *, search_ms_per_1k: float = 0.0) -> pl.DataFrame:
    """Per (stream, label, load, token bound, document bound), pooled over the stream: tokens a step, projected
    speedup over no speculation, both as ratios to the lookup alone, and the live corpus tokens a step searched on
    average (`live_tokens`)."""
    p = priced(rows, search_ms_per_1k=search_ms_per_1k)
    key = ["stream", "label", "inflight", "tokens", "docs"]
    out = _pooled(p, key).join(
        p.group_by(key).agg((pl.col("searched_tokens").sum() / pl.col("steps").sum()).alias("live_tokens")), on=key)
    return _against_lookup(out, p, []).sort("stream", "label", "inflight", "tokens", "docs")


def knee(bounded: pl.DataFrame, *, over: str = "tokens", value: str = "tokens_per_step",
         within: float = 0.01) -> pl.DataFrame:
    """Per (stream, label, load), over the rows bounded by `over` ("tokens", or "docs" with tokens unbounded): the
    smallest bound whose `value` is within `within` (a share) of the best value over the bounds, with that value,
    the best, and the value at the smallest and largest bound tried."""
    require(over in ("tokens", "docs"), f"over must be 'tokens' or 'docs' (got {over!r})")
    require(0 <= within < 1, f"within must be in [0, 1) (got {within})")
    # bounded by tokens: the rows with a token bound (their document bound as the setting has it); by documents:
    # the rows whose tokens are unbounded
    rows = bounded.filter(pl.col("tokens") > 0) if over == "tokens" else \
        bounded.filter((pl.col("tokens") == -1) & (pl.col("docs") > 0))
    out = []
    for (stream, label, load), g in rows.sort(over).group_by("stream", "label", "inflight", maintain_order=True):
        best = float(g[value].max())
        enough = g.filter(pl.col(value) >= best * (1 - within))
        out.append({"stream": stream, "label": label, "inflight": load, "bound": over,
                    "knee": int(enough[over][0]), "at_knee": float(enough[value][0]), "best": best,
                    "smallest": int(g[over][0]), "at_smallest": float(g[value][0]),
                    "largest": int(g[over][-1]), "at_largest": float(g[value][-1])})
    return pl.DataFrame(out)


# ----------------------------------------------------------------------------------------------------------------
# the figures' rows (long: one value a row, for `hqlab.plots.line_grid`)


def warmup_lines(curve: pl.DataFrame) -> pl.DataFrame:
    """A `warmup` table as lines: x = the bin's first request number (1 = the first request sent); a row of panels
    per (measure, load): tokens a step, then projected speed as a ratio to the lookup alone where priced."""
    measured = pl.col("label").str.starts_with("measured")
    out = []
    for column, measure in (("tokens_per_step", "tokens a step"),
                            ("speedup_vs_lookup", "projected speed ÷ lookup alone")):
        for load in sorted(curve["inflight"].unique().to_list()):
            out.append(curve.filter((pl.col("inflight") == load) & pl.col(column).is_finite()).select(
                "stream", "label", (pl.col("bin") + 1).alias("request"), pl.col(column).alias("value"),
                pl.lit(f"{measure}, {load} in flight").alias("panel_row"), measured.alias("measured"))
                .sort("stream", "label", "request"))
    return pl.concat(out)


def size_lines(bounded: pl.DataFrame, *, speed: Mapping[str, pl.DataFrame] | None = None,
               speed_loads: Sequence[int] = ()) -> pl.DataFrame:
    """A `by_bound` table as lines: per load, tokens a step against the token bound (the rows with one) and against
    the document bound (the rows with tokens unbounded), a row of panels each. A setting with no such bound at
    that load (the lookup alone; Arctic, bounded by requests only, or at its default alone) is drawn flat at its
    unbounded value (no corpus, or tokens unbounded and the most documents). `speed` ({label suffix: a `by_bound`
    table at one search price}) adds, for each load in `speed_loads`, the projected speedup over none against the
    token bound."""
    key = ["stream", "label", "inflight"]

    def lines(frame: pl.DataFrame, over: str, value: str, row: str, suffix: str = "",
              flats: bool = True) -> list[pl.DataFrame]:
        keep = (pl.col("tokens") > 0) if over == "tokens" else ((pl.col("tokens") == -1) & (pl.col("docs") > 0))
        bounded_rows = frame.filter(keep)
        varied = bounded_rows.group_by(key).agg(pl.len().alias("n")).filter(pl.col("n") > 1).drop("n")
        body = bounded_rows.join(varied, on=key).with_columns(pl.col(over).alias("bound"))
        rest = frame.join(varied, on=key, how="anti").filter(pl.col("tokens") <= 0)
        unbounded = rest.filter(pl.col("docs") == pl.col("docs").max().over(key))
        flat = unbounded.join(body.select("stream", "inflight", "bound").unique(), on=["stream", "inflight"])
        return [p.select("stream", (pl.col("label") + tail).alias("label"), "bound", pl.col(value).alias("value"),
                         pl.lit(row).alias("panel_row")).sort("stream", "label", "bound")  # one order, one figure
                for p, tail in ((body, suffix), (flat, "")) if p.height and (flats or p is body)]

    out = []
    for load in sorted(bounded["inflight"].unique().to_list()):
        at = bounded.filter(pl.col("inflight") == load)
        out += lines(at, "tokens", "tokens_per_step", f"tokens a step, {load} in flight, by corpus tokens")
        out += lines(at, "docs", "tokens_per_step", f"tokens a step, {load} in flight, by documents")
    for i, (suffix, table) in enumerate((speed or {}).items()):  # the flat settings have no search to price: once
        for load in speed_loads:
            out += lines(table.filter(pl.col("inflight") == load), "tokens", "speedup",
                         f"projected speedup, {load} in flight, by corpus tokens", suffix, i == 0)
    return pl.concat(out, how="vertical_relaxed")


__all__ = ["WARMUP_EDGES", "UNBOUNDED_TOKENS", "VLLM_SUFFIX", "served", "at_load", "bounds", "replay_rows", "measured_rows", "priced", "bin_of", "warmup", "by_bound", "knee",
           "warmup_lines", "size_lines"]
