"""Cost model check on one machine (this CPU, or a GPU with --device cuda), end to end: calibrate, replay,
predict, then measure live and compare.

1. Calibrate: `measure_step_times` (the engine's own step, shuffled rounds) over contexts and verify lengths;
   fit `CostModel`. Proposal cost: each proposer timed on the traces (`measure_proposal_cost`).
2. Predict: replay every configuration over the target's greedy outputs (the committed trace set when it
   matches, else recorded now) and price every step: predicted decode tok/s per request.
3. Measure: run the same configurations live on the engine (`hqlab.bench.run_bench`) and compare decode tok/s
   per request and per suite (tokens / summed time).

Writes the run data/results/costmodel/<tag>/ (hqlab.bench.results): rows.parquet (one row per configuration x
request; with --repeats the live numbers are medians of the repeats) and grid.parquet (the calibration grid).
Usage: python benchmarks/bench_costmodel.py [--tag cpu] [--model qwen2.5-coder-0.5b] [--device cpu|cuda]
           [--suite labd] [--max-new-tokens 128] [--doc-tokens 1500] [--repeats 1] [--threads N]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import polars as pl

from hqlab import bench
from hqlab.bench import results
from hqlab.config import DecodeConfig
from hqlab.engines.hf import HFEngine
from hqlab.proposers import make_proposer
from hqlab.provenance import git_commit, machine_description
from hqlab.replay import sweep
from hqlab.replay.costmodel import CostModel, measure_step_times
from hqlab.replay.traces import record_traces
from hqlab.workloads import load_workload

CONFIGS = ["lookup:nmin=6,nmax=12,k=15", "lookup:nmin=1,nmax=32,k=15,policy=earliest", "pld:n=3,k=10"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", default="cpu", help="the run's name: data/results/costmodel/<tag>/")
    ap.add_argument("--model", default=None, help="model name or path (default: the embedded default)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--repeats", type=int, default=1, help="live runs per configuration and request (median)")
    ap.add_argument("--config", dest="configs", action="append", default=None,
                    help=f"a proposer spec (repeatable; default: {', '.join(CONFIGS)})")
    ap.add_argument("--suite", default="labd")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--doc-tokens", type=int, default=1500)
    ap.add_argument("--contexts", default="128,512,1024,1536,2048")
    ap.add_argument("--verify-lens", default="1,2,4,8,12,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default). On a shared "
                    "machine one thread can be much faster than two: calibrate and run with the same setting")
    ap.add_argument("--results", type=Path, default=None, help="the results folder (default data/results)")
    args = ap.parse_args()
    configs = args.configs or CONFIGS
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    engine = HFEngine.load(args.model, device=args.device)
    prompts = load_workload(args.suite, doc_tokens=args.doc_tokens, tokenizer=engine.tokenizer)
    decode = DecodeConfig(max_new_tokens=args.max_new_tokens)
    traces = record_traces(engine, prompts, decode)
    machine = machine_description(engine.device)
    print(machine, "| load", os.getloadavg())

    grid = measure_step_times(engine, [int(x) for x in args.contexts.split(",")],
                              [int(x) for x in args.verify_lens.split(",")], repeats=args.rounds)
    cost = CostModel.fit(grid)
    print(cost.describe())
    grid = grid.with_columns(pl.lit(machine).alias("machine"))

    predicted = []
    for spec in configs:
        proposal = sweep.measure_proposal_cost(make_proposer(spec), traces)
        frame = sweep.sweep(traces, [spec], cost=cost.with_proposal(proposal), progress=False)
        predicted.append(frame.select("config", "prompt_id", "pred_decode_s", "pred_base_s", "tokens_per_step"))
    pred = pl.concat(predicted)
    base = pred.group_by("prompt_id").agg(pl.col("pred_base_s").first())
    pred = pl.concat([pred.select("config", "prompt_id", "pred_decode_s", "tokens_per_step"),
                      base.select(pl.lit("none").alias("config"), "prompt_id",
                                  pl.col("pred_base_s").alias("pred_decode_s"), pl.lit(1.0).alias("tokens_per_step"))])

    live, _ = bench.run_bench(engine, prompts, configs, decode, repeats=args.repeats, meta={"suite": args.suite})
    rows = live.join(pred, on=["config", "prompt_id"], suffix="_replay").with_columns(
        ((pl.col("new_tokens") - 1) / pl.col("pred_decode_s")).alias("predicted_tok_s"),
        pl.lit(os.getloadavg()[0]).alias("load_avg_1m"))
    rows = rows.with_columns((pl.col("predicted_tok_s") / pl.col("decode_tok_s") - 1).alias("tok_s_error"))
    folder = results.write_run("costmodel", args.tag, card=results.card_of(machine),
                               tables={"rows": rows, "grid": grid}, root=args.results,
                               info={"commit": git_commit(), "command": results.command_line(),
                                     "benchmark": "benchmarks/bench_costmodel.py"})
    suite = (rows.group_by("config", maintain_order=True)
             .agg(((pl.col("new_tokens") - 1).sum() / ((pl.col("new_tokens") - 1) / pl.col("decode_tok_s")).sum())
                  .alias("measured_tok_s"),
                  ((pl.col("new_tokens") - 1).sum() / pl.col("pred_decode_s").sum()).alias("predicted_tok_s"))
             .with_columns((pl.col("predicted_tok_s") / pl.col("measured_tok_s") - 1).alias("error")))
    with pl.Config(tbl_rows=60, tbl_width_chars=200, fmt_str_lengths=50):
        print(rows.select("config", "prompt_id", "divergence", "tokens_per_step", "tokens_per_step_replay",
                          "decode_tok_s", "predicted_tok_s", "tok_s_error"))
        print(suite)
    print(f"wrote {folder}")


if __name__ == "__main__":
    main()
