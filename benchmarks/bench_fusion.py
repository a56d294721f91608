"""Fusion benchmark (issue: model drafter, fusion, adaptive long block, per-request lengths in batches).

Target Qwen2.5-Coder-1.5B, drafter Qwen2.5-Coder-0.5B (same tokenizer), the labd task suite, greedy. One process,
configs interleaved per prompt (`hqlab.bench.suites.fusion_benchmark`), every output checked against the engine's own
no-speculation output:
  none · draft k=7 · lookup k=7 · lookup k=15 · fused k=7 · fused + adaptive long block k=15 with sticky 0 and 3
Then all prompts concurrently at batch 4: no speculation, fused adaptive per-request, fused adaptive unanimous
(HyperQwen's batch rule), each checked against the batch-1 reference.

Writes the run data/results/fusion/<tag>/ (rows, steps, batch, batch_steps; hqlab.bench.results); the figures come
from notebooks/fusion_benchmark.py.
Usage: python benchmarks/bench_fusion.py [--tag cpu] [--device auto] [--doc-tokens 1500] [--new-tokens 160]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import polars as pl

from hqlab import bench
from hqlab.bench.suites import fusion_benchmark


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--doc-tokens", type=int, default=1500)
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--results", type=Path, default=None, help="the results folder (default data/results)")
    ap.add_argument("--skip-single", action="store_true", help="only the batch part")
    ap.add_argument("--skip-batch", action="store_true", help="only the single-request part")
    args = ap.parse_args()

    frames = fusion_benchmark(args.tag, args.results, target=args.target, drafter=args.drafter, device=args.device,
                              dtype=args.dtype, doc_tokens=args.doc_tokens, new_tokens=args.new_tokens,
                              repeats=args.repeats, batch=args.batch, single=not args.skip_single,
                              batched=not args.skip_batch)
    with pl.Config(tbl_rows=100, tbl_cols=20, tbl_width_chars=220):
        for name, results in frames.items():
            print(bench.summarize(results) if name == "rows" else results.select(
                "config", "prompt_id", "tokens_per_step", "mean_block", "long_share", "batch_tok_s", "divergence"))
            print(results["machine"][0])


if __name__ == "__main__":
    main()
