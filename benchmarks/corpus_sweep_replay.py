"""Sweep the GPU corpus's settings over vLLM run c1's recorded outputs, priced with c1's own step times (#42).

    python benchmarks/corpus_sweep_replay.py            # -> data/results/corpus_sweep_replay/c1/ (~6 min, CPU)
    python benchmarks/corpus_sweep_replay.py --quick    # a small grid, for a look

Every setting is one the vLLM speculator accepts (`gpu-lookup:nmin,nmax,k,policy,corpus,corpus_policy,
corpus_prompts`). Its points are run c1's: per workload the requests of its corpus config at repeat 0, one at a time
(load 1, the first 10; prose 6) and 8 in flight (load 8, the first 16), plus `multiturn16`: the 16 multi-turn
requests recorded at load 8 (turns 0 and 1 of all 8 chats) replayed one at a time, since c1's one-at-a-time point
held only two second turns. Tokens per step are the replay's (exact for these outputs); times are
`hqlab.replay.corpus_vllm`'s prices fitted on c1 (the step-cost grid of data/results/seed_scale/s2/ for k other
than 15). Rows: one per (point, setting), with `vs_no_corpus` (the issue's measure), `vs_none`, tokens per
step with and without the corpus; plus the run's own setting's `calibration` rows (`measured` from c1).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RUN = "c1"  # the corpus run whose outputs and clocks are swept
STEP_GRID_RUN = "s2"  # the seed-scale run whose step-cost grid scales k
WORKLOADS = ("multiturn", "template", "agent", "prose")
GRID = {"nmin": [1, 2, 3], "nmax": [16, 32, 64], "k": [7, 15, 31], "tie": ["earliest", "recent"],
        "tokens": [1024, 4096, 32768], "choice": ["own", "longest"], "prompts": [False, True]}
QUICK = {"nmin": [1, 3], "nmax": [32], "k": [15, 31], "tie": ["earliest"], "tokens": [32768],
         "choice": ["longest"], "prompts": [False, True]}


def specs(grid: dict[str, list]) -> list[str]:
    from hqlab.replay import corpus as rc

    return rc.grid("corpus:docs=1024", **grid)


def points(requests, *, repeat: int = 0) -> dict:
    from hqlab.replay import corpus_vllm as cv

    out = {(w, load): cv.point_traces(requests, workload=w, load=load, repeat=repeat)
           for w in WORKLOADS for load in (1, 8)}
    out[("multiturn16", 1)] = [t.__class__(**{**t.__dict__, "category": "multiturn16"})
                               for t in cv.point_traces(requests, workload="multiturn", load=8, repeat=repeat)]
    return out


def main(argv: list[str] | None = None) -> int:
    import polars as pl

    from hqlab import provenance
    from hqlab.bench import corpus_report, results
    from hqlab.replay import corpus_vllm as cv

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small grid")
    ap.add_argument("--results", default=None, help="the results folder (default data/results)")
    args = ap.parse_args(argv)
    requests = results.load("corpus", RUN, "requests")
    prices = cv.fit_prices(requests, step_grid=results.load("seed_scale", STEP_GRID_RUN, "grid"))
    print(prices)
    pts = points(requests)
    grid = specs(QUICK if args.quick else GRID)
    frame = cv.sweep(pts, grid, prices, progress=True).with_columns(pl.lit(RUN).alias("run"),
                                                                     pl.lit("sweep").alias("kind"))
    # the run's own setting against what c1 measured
    measured = corpus_report.speedups(results.load("corpus", RUN))
    own = cv.sweep({k: v for k, v in pts.items() if k[0] in WORKLOADS},
                   [cv.replay_spec(measured["config"][0])], prices)
    own = (own.join(measured.select("workload", "load", pl.col("vs_no_corpus").alias("measured"),
                                    pl.col("vs_no_corpus_lo").alias("measured_lo"),
                                    pl.col("vs_no_corpus_hi").alias("measured_hi"),
                                    pl.col("tokens_per_step").alias("measured_tokens_per_step")),
                    on=["workload", "load"], how="left")
           .with_columns(pl.lit(RUN).alias("run"), pl.lit("calibration").alias("kind")))
    out = pl.concat([frame, own], how="diagonal_relaxed")
    out = out.with_columns(pl.lit(prices.live_ms_per_1k).alias("price_live_ms_per_1k"),
                           pl.col("load").replace_strict(prices.iteration_ms, default=None,
                                                         return_dtype=pl.Float64).alias("price_iteration_ms"))
    folder = results.write_run("corpus_sweep_replay", RUN, card="cpu", tables={"rows": out}, root=args.results,
                               info={"commit": provenance.git_commit(), "command": results.command_line(),
                                     "benchmark": "benchmarks/corpus_sweep_replay.py"})
    with pl.Config(tbl_rows=40, tbl_cols=20, tbl_width_chars=220, fmt_str_lengths=110):
        print(own.select("workload", "load", "base_tokens_per_step", "tokens_per_step", "vs_no_corpus", "measured"))
        bar = {**corpus_report.BAR, "multiturn16": corpus_report.BAR["multiturn"]}
        print(cv.meets(frame, corpus_report.BAR).head(15))
        print(cv.meets(frame.filter(pl.col("workload") != "multiturn"),
                       {"multiturn16": bar["multiturn16"], "template": 1.3, "prose": 0.97}, loads=(1,)).head(5))
    print(f"wrote {folder} ({out.height} rows, {len(grid)} settings)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
