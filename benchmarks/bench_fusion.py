"""Fusion benchmark (issue: model drafter, fusion, adaptive long block, per-request lengths in batches).

Target Qwen2.5-Coder-1.5B, drafter Qwen2.5-Coder-0.5B (same tokenizer), the labd task suite, greedy. One process,
configs interleaved per prompt (hqlab.bench.run_bench), every output checked against the engine's own
no-speculation output:
  none · draft k=7 · lookup k=7 · lookup k=15 · fused k=7 · fused + adaptive long block k=15 with sticky 0 and 3
Then all prompts concurrently at batch 4: no speculation, fused adaptive per-request, fused adaptive unanimous
(HyperQwen's batch rule), each checked against the batch-1 reference.

Writes data/results/fusion_<tag>.parquet (+ .steps.parquet) and fusion_<tag>_batch.parquet (+ .steps);
the figures come from notebooks/fusion.py.
Usage: python benchmarks/bench_fusion.py [--tag cpu] [--device auto] [--doc-tokens 1500] [--new-tokens 160]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import polars as pl

from hqlab import bench
from hqlab.config import DecodeConfig
from hqlab.engines.hf import HFEngine
from hqlab.io import write_atomic
from hqlab.workloads import load_workload


def configs(drafter: str, dtype: str, device: str) -> tuple[list[str], list[str]]:
    d = f"model={drafter},dtype={dtype},device={device}"
    single = [f"draft:k=7,{d}", "lookup:nmin=6,nmax=12,k=7", "lookup:nmin=6,nmax=12,k=15", f"fused:k=7,{d}",
              f"fused:k=15,sticky=0,{d}", f"fused:k=15,sticky=3,{d}"]
    batched = [f"fused:k=15,sticky=3,{d}", f"fused:k=15,sticky=3,batch_mode=unanimous,{d}"]
    return single, batched


def save(frame: pl.DataFrame, path: Path) -> None:
    write_atomic(path, lambda t: frame.write_parquet(t))


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
    ap.add_argument("--out-dir", type=Path, default=Path("data/results"))
    ap.add_argument("--skip-single", action="store_true", help="only the batch part")
    ap.add_argument("--skip-batch", action="store_true", help="only the single-request part")
    args = ap.parse_args()

    engine = HFEngine.load(args.target, device=args.device, dtype=args.dtype)
    dtype = str(next(engine.model.parameters()).dtype).removeprefix("torch.")
    device = engine.device.type
    single, batched = configs(args.drafter, dtype, device)
    prompts = load_workload("labd", doc_tokens=args.doc_tokens, tokenizer=engine.tokenizer)
    decode = DecodeConfig(max_new_tokens=args.new_tokens)
    meta = {"suite": "labd", "doc_tokens": args.doc_tokens, "drafter": args.drafter}

    if not args.skip_single:
        results, steps = bench.run_bench(engine, prompts, single, decode, repeats=args.repeats, meta=meta)
        out = args.out_dir / f"fusion_{args.tag}.parquet"
        save(steps, out.with_name(out.stem + ".steps.parquet"))
        save(results, out)
        with pl.Config(tbl_rows=100, tbl_cols=20, tbl_width_chars=220):
            print(bench.summarize(results))
        print(results["machine"][0])
    if args.skip_batch:
        return

    # batch-1 no-speculation references: run_batch_bench recomputes them (the same engine and greedy loop)
    by_id = {p.id: p for p in prompts}  # the soak composition of SPEC §3: copy, summary, code, qa
    b_results, b_steps = bench.run_batch_bench(engine, [by_id[t] for t in ("copy", "summary", "code", "qa")],
                                               batched, decode, batch=args.batch,
                                               repeats=args.repeats, meta=meta)
    out_b = args.out_dir / f"fusion_{args.tag}_batch.parquet"
    save(b_steps, out_b.with_name(out_b.stem + ".steps.parquet"))
    save(b_results, out_b)
    with pl.Config(tbl_rows=100, tbl_cols=20, tbl_width_chars=220):
        print(b_results.select("config", "prompt_id", "tokens_per_step", "mean_block", "long_share",
                               "batch_tok_s", "divergence"))
    print(b_results["machine"][0])


if __name__ == "__main__":
    main()
