"""Core-loop benchmark (issue: lossless engine + context lookup): the default model on this machine.

One process, one model load, configs interleaved per prompt; both suites in the same run:
  - labd (copy, code, edit, quote, summary, qa over the frozen document), 512 new tokens;
  - chat (8 short real prompts), 128 new tokens.
Configs: no speculation (reference), hqlab lookup with HyperQwen's fused-setting defaults at k=15 and k=7, the
suffix-length sweep's best standalone lookup (--standalone-from), hqlab's Spec-Bench PLD, and transformers' own
prompt lookup (hf-pld k=10) timed by the same harness.

Writes the run data/results/core/<tag>/ (rows.parquet, steps.parquet, run.json: hqlab.bench.results) and
figures/core_<tag>_*.svg/png.
Usage: python benchmarks/bench_core.py [--tag cpu] [--repeats 1] [--device auto] [--doc-tokens 2000]
       [--standalone-from data/results/suffix_lengths/cpu/sweep.parquet]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import polars as pl

from hqlab import bench, provenance
from hqlab.bench import results as committed
from hqlab.replay import sweep

CONFIGS = ["lookup:nmin=6,nmax=12,k=15", "lookup:nmin=6,nmax=12,k=7", "pld:n=3,k=10", "hf-pld:k=10"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--doc-tokens", type=int, default=2000)
    ap.add_argument("--labd-tokens", type=int, default=512)
    ap.add_argument("--chat-tokens", type=int, default=128)
    ap.add_argument("--standalone-from", type=Path, default=None,
                    help="suffix_sweep.parquet: add the sweep's best overall lookup config (geomean over classes)")
    ap.add_argument("--suites", default="labd,chat", help="comma-separated: labd, chat")
    ap.add_argument("--configs", default=None, help="';'-separated specs instead of the default set")
    args = ap.parse_args()
    configs = args.configs.split(";") if args.configs else list(CONFIGS)
    if args.standalone_from:
        best = sweep.best_overall(pl.read_parquet(args.standalone_from))["config"][0]
        print("standalone lookup chosen by the sweep:", best)
        configs.insert(0, best)

    tokens = {"labd": args.labd_tokens, "chat": args.chat_tokens}
    results, steps = bench.run_suites("hf", {suite: tokens[suite] for suite in args.suites.split(",")}, configs,
                                      model=args.model, device=args.device, doc_tokens=args.doc_tokens,
                                      repeats=args.repeats)
    committed.write_run("core", args.tag, card=committed.card_of(results["machine"][0]),
                        tables={"rows": results, "steps": steps},
                        info={"commit": provenance.git_commit(), "command": committed.command_line(),
                              "benchmark": "benchmarks/bench_core.py"})
    with pl.Config(tbl_rows=100, tbl_cols=20, tbl_width_chars=220):
        print(bench.summarize(results))
    print(results["machine"][0])
    bench.core_figures(results, args.tag, Path("figures"))


if __name__ == "__main__":
    main()
