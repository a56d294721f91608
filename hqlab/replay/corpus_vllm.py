"""Corpus settings swept over a vLLM run's own recorded outputs, priced with that run's measured step times (#42).

A vLLM corpus run (`benchmarks/vllm_corpus.py`, its requests in data/results/corpus/<run>/requests.parquet) records
every request's prompt and greedy output. Under greedy decoding the outputs do not depend on what is drafted, so the
replay (`hqlab.replay.corpus`) predicts exactly how many tokens every verify step of *another* corpus setting would emit
over the same outputs (for the run's own setting it matched all of vLLM's steps). What the replay cannot see is time;
this module prices the replayed steps with the run's own clocks:

- One request at a time (load 1): a verify step costs `a` ms (the lookup at the run's k: its requests' decode spans
  over their steps, pooled) plus `b` ms per 1,000 live corpus tokens (the corpus kernel scans the live slots:
  `kernels/corpus_match.py`): the corpus config's pooled span beyond `a` per step, over the live tokens its steps
  searched. In the first corpus run (data/results/corpus/c1/) this extra cost moved between repeats by more than its
  mean (per workload -0.13 to +0.32 ms a step around a mean near +0.07 ms, 3 %), so `b` is an average, and a
  projected ratio carries that noise.
- B in flight (the benchmark's closed loop: B requests submitted, the next one as soon as one finishes, whatever
  its session): the replay's `lockstep` schedule with every request its own session, which reproduces the run's
  tokens/step within 1 %; a point's time is its iterations × the measured iteration cost (the lookup points' wall
  time over their replayed iterations, prefill included on average) plus the same `b` per iteration for the live
  corpus (the kernel's grid spans the batch, so its time is taken not to grow with it: an assumption).
- Another k: the verify width k + 1 scales the iteration cost by the relative cost of that width at the same batch
  in a step-cost grid of the same model shape (data/results/seed_scale/<run>/grid.parquet: vLLM steps of the 1.5B shape
  on an H100, widths 1-32). The corpus's ratio to the same setting without it is nearly blind to this (both verify
  k + 1 positions); its ratio to `none` is not.

The acceptance measure is the ratio of decode rates with and without the corpus at the same setting (same outputs,
so the ratio of projected times). Projections, not measurements: the replay's token counts are exact for these
outputs; the times are a two-term model of one run's clocks (`calibration` compares it with that run).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from typing import Iterable, Sequence

import numpy as np
import polars as pl

from hqlab.config import ConfigError, require
from hqlab.replay import corpus as rc
from hqlab.replay.traces import Trace
from hqlab.rules.corpus import Corpus
from hqlab.rules.lookup import suffix_match
from hqlab.rules.verify import greedy_verify
from hqlab.trace import Source


# ----------------------------------------------------------------------------------------------------------------
# the run's requests as traces


def is_corpus_config(config: str) -> bool:
    return "corpus=" in config


def point_traces(requests: pl.DataFrame, *, workload: str, load: int, repeat: int = 0,
                 config: str | None = None) -> list[Trace]:
    """The requests of one point of a run, in the order they were sent, as traces: the recorded prompt and output
    ids of `config` (default: the run's config with a corpus). Each request is its own session (`prompt_id` = its
    name), because the benchmark's closed loop admits the next request as soon as any slot frees."""
    rows = requests.filter((pl.col("workload") == workload) & (pl.col("load") == load) & (pl.col("repeat") == repeat))
    configs = sorted(rows["config"].unique().to_list())
    chosen = config if config is not None else next((c for c in configs if is_corpus_config(c)), None)
    if chosen is None or chosen not in configs:
        raise ConfigError(f"no requests of config {config!r} at {workload}, load {load}, repeat {repeat} "
                          f"(configs there: {configs})")
    rows = rows.filter(pl.col("config") == chosen).sort("order")
    return [Trace(prompt_id=name, category=workload, prompt_ids=list(p), output_ids=list(o), max_new_tokens=256)
            for name, p, o in zip(rows["request"], rows["prompt_ids"], rows["output_ids"])]


def gpu_spec(config: rc.CorpusReplayConfig) -> str:
    """The vLLM speculator's spec (`gpu-lookup`, hqlab.engines.vllm.gpu_lookup) of a replayed corpus setting."""
    spec = f"gpu-lookup:nmin={config.nmin},nmax={config.nmax},k={config.k},policy={config.tie}"
    if config.tokens:
        spec += f",corpus={config.tokens},corpus_policy={config.choice},corpus_prompts={int(config.prompts)}"
        if config.docs != 1024:
            spec += f",corpus_docs={config.docs}"
    return spec


# ----------------------------------------------------------------------------------------------------------------
# prices


@dataclass(frozen=True)
class StepPrices:
    """What a verify iteration costs, from one vLLM run (module docstring).

    k:            the run's k (its iteration costs are at width k + 1).
    iteration_ms: {load: ms per iteration of the lookup without a corpus at width k + 1}.
    none_ms:      {load: ms per iteration of `none` (width 1)}.
    live_ms_per_1k: ms per iteration per 1,000 live corpus tokens (the corpus search).
    widths:       {load: {width: cost relative to width k + 1}} from a step-cost grid (empty: k other than the run's
                  is refused).
    """

    k: int
    iteration_ms: dict[int, float]
    none_ms: dict[int, float]
    live_ms_per_1k: float
    widths: dict[int, dict[int, float]] = field(default_factory=dict)
    source: str = ""

    def width_factor(self, load: int, k: int) -> float:
        if k == self.k:
            return 1.0
        table = self.widths.get(load) or self.widths.get(min(self.widths, key=lambda b: abs(b - load)) if
                                                         self.widths else -1)
        if not table:
            raise ConfigError(f"no step-cost grid to price k={k} (the run measured k={self.k})")
        w = np.array(sorted(table), dtype=float)
        c = np.array([table[int(x)] for x in w])
        return float(np.interp(np.log2(k + 1), np.log2(w), c))

    def ms(self, load: int, k: int, live_tokens: float = 0.0) -> float:
        """One iteration at `load` requests in flight (priced at the nearest measured load), width k + 1, with
        `live_tokens` in the corpus."""
        at = min(self.iteration_ms, key=lambda b: abs(b - load))
        return self.iteration_ms[at] * self.width_factor(at, k) + self.live_ms_per_1k * live_tokens / 1000.0


def _live_tokens(rows: pl.DataFrame) -> list[int]:
    """Per request of one point (rows in order), the live corpus tokens summed over its steps: each step saw the
    first `corpus_docs` documents of the point in insertion order (FIFO never evicted within these points' 32k)."""
    lens = {int(s): int(n) for s, n in zip(rows["corpus_seq"], rows["corpus_doc_len"]) if s >= 0}
    cum = np.concatenate([[0], np.cumsum([lens[i] for i in range(len(lens))])]) if lens else np.zeros(1)
    return [int(sum(cum[min(max(d, 0), cum.size - 1)] for d in docs)) for docs in rows["step_corpus_docs"]]


def closed_loop_iterations(lengths: Sequence[int], inflight: int) -> int:
    """Iterations of a closed loop in which every request emits one token per iteration (`none`): request i needs
    lengths[i] - 1 iterations after its prefill's token, the next request taking the first free slot."""
    slots = [0] * min(inflight, max(len(lengths), 1))
    for n in lengths:
        t = heapq.heappop(slots)
        heapq.heappush(slots, t + max(int(n) - 1, 0))
    return max(slots) if slots else 0


def fit_prices(requests: pl.DataFrame, *, step_grid: pl.DataFrame | None = None, shape: str = "qwen2.5-1.5b",
               repeat: int | None = None) -> StepPrices:
    """The run's prices (module docstring) from its requests (one run). `step_grid`: the seed-scale step-cost table
    (shape, config, width, batch, step_ms) for other k; `repeat`: fit on one repeat only (default: all)."""
    need = {"config", "workload", "load", "repeat", "order", "request", "prompt_ids", "output_ids", "ttft_s",
            "t_last", "point_wall_s", "corpus_seq", "corpus_doc_len", "step_corpus_docs", "step_emitted"}
    missing = need - set(requests.columns)
    require(not missing, f"the requests lack column(s) {sorted(missing)}")
    if repeat is not None:
        requests = requests.filter(pl.col("repeat") == repeat)
    specs = [c for c in requests["config"].unique().to_list() if c != "none"]
    lookups = [c for c in specs if not is_corpus_config(c)]
    require(len(lookups) == 1, f"expected one lookup config without a corpus, got {lookups}")
    base = rc.parse(_replay_spec(lookups[0]))
    # load 1: a = the lookup's pooled span per step; b = the corpus config's pooled span beyond a per live token
    spans = {True: [0.0, 0.0, 0.0], False: [0.0, 0.0, 0.0]}  # corpus? -> [span ms, steps, live tokens]
    ones = requests.filter((pl.col("load") == 1) & (pl.col("config") != "none"))
    for _, g in ones.group_by("workload", "repeat", "config", maintain_order=True):
        g = g.sort("order")
        corpus = is_corpus_config(g["config"][0])
        acc = spans[corpus]
        acc[0] += float((g["t_last"] - g["ttft_s"]).sum()) * 1000.0
        acc[1] += float(g["step_emitted"].list.len().sum())
        acc[2] += float(sum(_live_tokens(g))) if corpus else 0.0
    require(spans[False][1] > 0 and spans[True][2] > 0,
            "need one-at-a-time requests of the lookup with and without the corpus to fit the step price")
    a = spans[False][0] / spans[False][1]
    b = (spans[True][0] - a * spans[True][1]) / (spans[True][2] / 1000.0)
    none1 = requests.filter((pl.col("load") == 1) & (pl.col("config") == "none"))
    none_ms = {1: float((none1["t_last"] - none1["ttft_s"]).sum() * 1000.0 /
                        (none1["output_ids"].list.len() - 1).sum())}
    iteration_ms = {1: float(a)}
    # B in flight: wall / replayed iterations of the lookup's points (and `none`'s closed loop)
    for load in sorted(x for x in requests["load"].unique().to_list() if x > 1):
        wall = iters = none_wall = none_iters = 0.0
        at = requests.filter(pl.col("load") == load)
        for (w, rep), _ in at.group_by("workload", "repeat", maintain_order=True):
            traces = point_traces(at, workload=w, load=load, repeat=rep, config=lookups[0])
            runs = rc.replay_requests(traces, replace(base, inflight=load, schedule="lockstep", tokens=0))
            rows = at.filter((pl.col("workload") == w) & (pl.col("repeat") == rep))
            wall += rows.filter(pl.col("config") == lookups[0])["point_wall_s"][0]
            iters += max(r.left for r in runs) + 1
            nrows = rows.filter(pl.col("config") == "none").sort("order")
            if nrows.height:
                none_wall += nrows["point_wall_s"][0]
                none_iters += closed_loop_iterations(nrows["output_ids"].list.len().to_list(), load)
        iteration_ms[load] = wall * 1000.0 / iters
        if none_iters:
            none_ms[load] = none_wall * 1000.0 / none_iters
    widths: dict[int, dict[int, float]] = {}
    if step_grid is not None:
        g = step_grid.filter((pl.col("shape") == shape) & (pl.col("config") == "gpu-lookup"))
        runs = sorted(g["run"].unique().to_list()) if "run" in g.columns else []
        require(len(runs) <= 1, f"the step grid holds {shape}'s gpu-lookup rows of several runs {runs}: pass one "
                                f"run's rows (their medians would mix different contexts and hosts)")
        for load in iteration_ms:
            rows = g.filter(pl.col("batch") == load).group_by("width").agg(pl.col("step_ms").median())
            table = dict(zip(rows["width"].to_list(), rows["step_ms"].to_list()))
            ref = table.get(base.k + 1)
            if ref:
                widths[load] = {int(w): float(v / ref) for w, v in table.items()}
    return StepPrices(k=base.k, iteration_ms=iteration_ms, none_ms=none_ms, live_ms_per_1k=float(b), widths=widths,
                      source=f"fit on {requests.height} requests")


def _replay_spec(gpu: str) -> str:
    """The replay spec of a gpu-lookup spec (its lookup and corpus keys; the rest of its keys are refused)."""
    from hqlab.config import parse_spec

    name, values = parse_spec(gpu)
    require(name == "gpu-lookup", f"not a gpu-lookup spec: {gpu!r}")
    keys = {"nmin": "nmin", "nmax": "nmax", "k": "k", "policy": "tie", "corpus": "tokens", "corpus_docs": "docs",
            "corpus_policy": "choice", "corpus_prompts": "prompts"}
    unknown = set(values) - set(keys)
    require(not unknown, f"{gpu!r}: keys {sorted(unknown)} have no replay here")
    out = []
    for k, v in values.items():
        if k == "corpus_prompts":
            v = "true" if str(v).lower() in ("1", "true") else "false"
        out.append(f"{keys[k]}={v}")
    return "corpus:" + ",".join(out)


replay_spec = _replay_spec


# ----------------------------------------------------------------------------------------------------------------
# projection


@dataclass(frozen=True)
class Projection:
    """One setting over one point's requests: its replayed steps and projected decode time."""

    steps: int
    emitted: int  # tokens emitted by verify steps (the first token of each request comes from prefill)
    corpus_steps: int
    corpus_accepted: int
    iterations: int  # lockstep iterations (load > 1); steps at load 1
    seconds: float

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.steps if self.steps else float("nan")


def project(traces: Sequence[Trace], config: rc.CorpusReplayConfig, prices: StepPrices) -> Projection:
    """Replay `config` (its `inflight`: 1 one at a time, else the closed loop as `lockstep`) and price it."""
    load = config.inflight
    if load > 1:
        config = replace(config, schedule="lockstep")
    runs = rc.replay_requests(traces, config)
    steps = sum(len(r.records) for r in runs)
    emitted = sum(s.accepted + 1 for r in runs for s in r.records)
    from_corpus = [s for r in runs for s in r.records if s.sources and int(s.sources[0]) == int(Source.CORPUS)]
    base = prices.ms(load, config.k)
    if load == 1:
        live = sum(sum(r.searched) for r in runs)
        seconds = (steps * base + prices.live_ms_per_1k * live / 1000.0) / 1000.0
        iterations = steps
    else:
        iterations = max(r.left for r in runs) + 1
        live_at = np.zeros(iterations)
        for r in runs:  # every request of an iteration saw the same corpus: one search per iteration
            for j, lv in enumerate(r.searched):
                live_at[r.admitted + j] = lv
        seconds = (iterations * base + prices.live_ms_per_1k * float(live_at.sum()) / 1000.0) / 1000.0
    return Projection(steps, emitted, len(from_corpus), sum(s.accepted for s in from_corpus), iterations, seconds)


def none_seconds(traces: Sequence[Trace], load: int, prices: StepPrices) -> float:
    """`none`'s projected decode time: one token per iteration at width 1."""
    at = min(prices.none_ms, key=lambda b: abs(b - load))
    lengths = [len(t.output_ids) for t in traces]
    iters = sum(max(n - 1, 0) for n in lengths) if load == 1 else closed_loop_iterations(lengths, load)
    return iters * prices.none_ms[at] / 1000.0


def sweep(points: dict[tuple[str, int], Sequence[Trace]], specs: Iterable[str], prices: StepPrices, *,
          progress: bool = False) -> pl.DataFrame:
    """One row per (point, setting): `points` maps (workload, load) to its traces; `specs` are corpus replay specs
    (their `inflight` is set from the point's load). Each setting's ratio to the same setting without the corpus
    (`vs_no_corpus`, the acceptance measure) and to `none` (`vs_none`), with tokens per step of both."""
    from tqdm.auto import tqdm

    configs = [rc.parse(s) for s in specs]
    for c in configs:
        require(isinstance(c, rc.CorpusReplayConfig), f"not a corpus replay spec: {c!r}")
    out = []
    cache: dict[tuple, Projection] = {}
    for (workload, load), traces in tqdm(list(points.items()), desc="corpus sweep", disable=not progress):
        none_s = none_seconds(traces, load, prices)
        for c in configs:
            c = replace(c, inflight=load, schedule="lockstep" if load > 1 else "admit")
            plain = replace(c, tokens=0, choice="own", prompts=False, docs=1024)
            for x in (plain, c):
                key = (workload, load, x)
                if key not in cache:
                    cache[key] = project(traces, x, prices)
            p, q = cache[(workload, load, c)], cache[(workload, load, plain)]
            out.append({"workload": workload, "load": load, "requests": len(traces), "spec": c.spec(),
                        "gpu_spec": gpu_spec(c), "nmin": c.nmin, "nmax": c.nmax, "k": c.k, "tie": c.tie,
                        "tokens": c.tokens, "choice": c.choice, "prompts": c.prompts,
                        "steps": p.steps, "iterations": p.iterations, "tokens_per_step": p.tokens_per_step,
                        "base_tokens_per_step": q.tokens_per_step,
                        "corpus_step_share": p.corpus_steps / p.steps if p.steps else 0.0,
                        "corpus_accepted_share": p.corpus_accepted / max(p.emitted - p.steps, 1),
                        "seconds": p.seconds, "base_seconds": q.seconds, "none_seconds": none_s,
                        "vs_no_corpus": q.seconds / p.seconds, "vs_none": none_s / p.seconds,
                        "base_vs_none": none_s / q.seconds})
    return pl.DataFrame(out)


def meets(frame: pl.DataFrame, bar: dict[str, float], *, loads: Sequence[int] = (1, 8)) -> pl.DataFrame:
    """Per setting (`spec` without its inflight): the worst margin over the barred (workload, load) points
    (`worst_margin` = min of vs_no_corpus - bar) and whether every one clears its bar (`meets_all`), with each
    point's ratio as a column `<workload>_<load>`. Settings missing a barred point are dropped."""
    key = pl.col("spec").str.replace(r",inflight=\d+,schedule=\w+", "")
    f = frame.filter(pl.col("workload").is_in(list(bar)) & pl.col("load").is_in(list(loads))).with_columns(
        key.alias("setting"), pl.col("workload").replace_strict(bar, return_dtype=pl.Float64).alias("bar"))
    f = f.with_columns((pl.col("vs_no_corpus") - pl.col("bar")).alias("margin"),
                       pl.format("{}_{}", "workload", "load").alias("point"))
    wide = f.pivot(on="point", index="setting", values="vs_no_corpus")
    need = [f"{w}_{b}" for w in bar for b in loads]
    wide = wide.drop_nulls([c for c in need if c in wide.columns])
    worst = f.group_by("setting").agg(pl.col("margin").min().alias("worst_margin"), pl.len().alias("points"),
                                      pl.col("gpu_spec").first())
    return (wide.join(worst, on="setting").filter(pl.col("points") == len(need))
            .with_columns((pl.col("worst_margin") >= 0).alias("meets_all")).sort("worst_margin", descending=True))


# ----------------------------------------------------------------------------------------------------------------
# where the reuse is: what each source could give at every output position


def reuse_by_position(traces: Sequence[Trace], *, nmin: int = 1, nmax: int = 32, k: int = 15,
                      tie: str = "earliest", tokens: int = 32768, prompts: bool = True,
                      turn_of: dict[str, int] | None = None) -> pl.DataFrame:
    """One request at a time, every earlier request's document in the corpus: at every output position after the
    first, the own-history match and the corpus match (lengths) and how many of each one's drafted tokens the
    output continues with (`own_accepted`, `corpus_accepted`; k at most). `best` = their max: what any choice
    between the two sources can accept at that position (an oracle bound for `choose`)."""
    corpus = Corpus(rc.CorpusReplayConfig(tokens=tokens, prompts=prompts).corpus_config())
    out = []
    for i, t in enumerate(traces):
        if i:
            corpus.add(rc.document(traces[i - 1], prompts))
        view = rc.CorpusView(corpus)
        h = np.asarray([*t.prompt_ids, *t.output_ids], dtype=np.int64)
        p = len(t.prompt_ids)
        out_ids = np.asarray(t.output_ids, dtype=np.int64)
        for pos in range(1, out_ids.size - 1):
            hist = h[: p + pos]
            own = suffix_match(hist, nmin=nmin, nmax=nmax, k=k, policy=tie)
            found = view.match(hist, nmin=nmin, nmax=nmax, k=k, policy=tie)
            rest = out_ids[pos:]

            def acc(tokens: np.ndarray) -> int:
                m = min(tokens.size, rest.size - 1)
                return greedy_verify(tokens[:m], rest[: m + 1]).accepted if m > 0 else 0

            a_own, a_corpus = acc(own.tokens), acc(found.tokens)
            out.append({"request": t.prompt_id, "order": i, "turn": (turn_of or {}).get(t.prompt_id, -1),
                        "position": pos, "own_len": own.match_len, "corpus_len": found.match_len,
                        "own_accepted": a_own, "corpus_accepted": a_corpus, "best": max(a_own, a_corpus)})
    return pl.DataFrame(out)


def oracle_tokens_per_step(positions: pl.DataFrame, column: str = "best") -> float:
    """Tokens per verify step of a replay that, at every step, accepts `column` tokens at its position (a
    `reuse_by_position` frame; "best": the better of own history and corpus, "own_accepted": own history alone),
    walking each request from its second output position: the bound any choice between the two sources reaches."""
    steps = emitted = 0
    for _, g in positions.group_by("order", maintain_order=True):
        acc = dict(zip(g["position"].to_list(), g[column].to_list()))
        pos, end = 1, max(acc) + 1
        while pos <= end:
            a = int(acc.get(pos, 0))
            steps += 1
            emitted += a + 1
            pos += a + 1
    return emitted / steps if steps else float("nan")


__all__ = ["oracle_tokens_per_step", "StepPrices", "Projection", "point_traces", "gpu_spec", "replay_spec",
           "fit_prices", "project", "none_seconds", "sweep", "meets", "reuse_by_position", "closed_loop_iterations",
           "is_corpus_config"]
