"""The goodput controller against no speculation, every fixed width and the served `batch_k` table, replayed over
the committed 1.5B traces by load and priced with the committed step costs (#62).

    python benchmarks/goodput_replay.py           # -> data/results/goodput_replay/cpu/ (~1 min, CPU)

Workloads: chat and prose (data/results/traces_1.5b_prose_chat_256.parquet), labd (traces_1.5b_labd_160.parquet);
greedy outputs, so every step is exact (`hqlab.replay.goodput.replay_engine`: vLLM's engine core with asynchronous
scheduling, all requests queued, at most `concurrency` running). Each point runs ten waves (10 × concurrency
requests, cycling through the workload's traces; at one request every trace once). Step costs: the committed
step-cost grid, H100 (`hqlab.rules.goodput.DEFAULT_STEP_COSTS`; batches above 8 extrapolated), and what-if costs
with each width's excess over a plain step doubled and quadrupled (`dearer_widths`: the served range of
docs/serving.md). The controller decides with the costs it is priced with; where wide steps cost more than the grid
says, also with the grid and measuring its own steps from it (goodput=online, `rg.compare_online`), priced alike.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SPEC = "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest,batch_k=1:15/4:7/0"  # the served lookup's widths
LOADS = (1, 8, 16, 32, 64)
FACTORS = (1.0, 2.0, 4.0)


def main(argv: list[str] | None = None) -> int:
    import polars as pl

    from hqlab import provenance
    from hqlab.config import LookupConfig
    from hqlab.engines.vllm.gpu_lookup import lookup_config
    from hqlab.replay import goodput as rg
    from hqlab.replay.traces import load_traces
    from hqlab.bench import results
    from hqlab.rules.goodput import DEFAULT_STEP_COSTS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=None, help="the results folder (default data/results): run goodput_replay/cpu")
    ap.add_argument("--waves", type=int, default=10)
    args = ap.parse_args(argv)
    spec = lookup_config(SPEC)
    lookup = LookupConfig(nmin=spec.nmin, nmax=spec.nmax, k=spec.k, policy=spec.policy)
    chat_prose = load_traces(results.trace_files(["1.5b_prose_chat_256"])[0])
    workloads = {"chat": [t for t in chat_prose if t.category == "chat"],
                 "prose": [t for t in chat_prose if t.category == "prose"],
                 "labd": load_traces(results.trace_files(["1.5b_labd_160"])[0])}
    tables = rg.TraceTables(lookup)
    frames = []
    for factor in FACTORS:
        costs = rg.dearer_widths(DEFAULT_STEP_COSTS, factor)
        for name, traces in workloads.items():
            for load in LOADS:
                frame = rg.compare(traces, lookup, costs, concurrency=load, batch_k_value=spec.batch_k,
                                   workload=name, waves=args.waves, tables=tables)
                if factor > 1:  # the controller priced with the grid, and measuring its own steps from it
                    online = rg.compare_online(traces, lookup, DEFAULT_STEP_COSTS, costs, tables=tables, workload=name,
                                               concurrency=load, batch_k_value=spec.batch_k, waves=args.waves)
                    frame = pl.concat([frame, online.filter(pl.col("policy").str.contains("prior|online"))],
                                      how="diagonal")
                frames.append(frame.with_columns(pl.lit(factor).alias("width_cost_factor"),
                                                 pl.lit(costs.source).alias("step_costs")))
                row = frame.filter(pl.col("policy") == "goodput").row(0, named=True)
                print(f"x{factor:g} {name:5s} {load:3d}: goodput {row['speedup']:.3f}x none, "
                      f"{row['vs_best_fixed']:.4f}x best fixed", flush=True)
    out = pl.concat(frames, how="diagonal").with_columns(pl.lit(SPEC).alias("spec"),
                                                         pl.lit(provenance.git_commit()).alias("git_commit"))
    folder = results.write_run("goodput_replay", "cpu", card="cpu", tables={"rows": out}, root=args.results,
                               info={"commit": provenance.git_commit(), "command": results.command_line(),
                                     "benchmark": "benchmarks/goodput_replay.py"})
    print(f"wrote {folder} ({out.height} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
