"""Greedy traces of the served target (the 1.5B, bf16) on the prose and chat prompts, at the serving benchmark's
256 new tokens: what the speculation gate's replay (notebook `serving`, docs/serving.md) prices for the model that
is served, beside the 0.5B's shorter traces.

    python benchmarks/gate_traces.py            # records what the trace cache lacks (CPU: about half an hour)
                                                # -> data/results/traces/1.5b_prose_chat_256/
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TRACE_SET = "1.5b_prose_chat_256"  # the run of the study `traces` (hqlab.bench.results) that holds them
SUITES = (str(ROOT / "data" / "workloads" / "prose.jsonl"), "chat")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--results", default=None, help="the results folder (default data/results)")
    args = p.parse_args(argv)

    from hqlab import provenance
    from hqlab.bench import results
    from hqlab.replay.traces import cached_traces, save_traces, shipped_model

    traces, engine = [], None
    for suite in SUITES:
        found = cached_traces(args.model, suite, args.max_new_tokens, dtype=args.dtype, device="cpu", engine=engine)
        traces += found.traces
        engine = found.engine or engine
        origin = found.origin
    path = save_traces(traces, results.results_dir(args.results) / "traces" / TRACE_SET / "traces.parquet",
                       model=shipped_model(origin))
    results.write_run("traces", TRACE_SET, card=results.card_of(origin.device), root=args.results,
                      info={"commit": provenance.git_commit(), "command": results.command_line(),
                            "benchmark": "benchmarks/gate_traces.py"})
    print(f"{len(traces)} traces -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
