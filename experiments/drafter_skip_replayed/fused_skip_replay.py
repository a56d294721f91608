"""What skipping the drafter on copying steps (`fused:...,skip=L`) does to tokens per step, replayed over a vLLM
run's own greedy outputs, with teacher-forced drafts of the real drafter on the CPU.

  CPU (here):
      python experiments/drafter_skip_replayed/fused_skip_replay.py RETURNED/vllm_gpu_fb1.parquet --run skip
  writes the run data/results/fused_skip_replay/<run>/ (rows.parquet; hqlab.bench.results). It reads the raw run (and
  its .json: model, suite, document length), takes `none`'s outputs (first repeat, alone; every config's outputs equal
  them: the run is lossless), and replays the lab's `fused` proposer with the run's gpu-fused settings (k=15, nmax=32,
  earliest match) at draft_block 2, 4 and 7, skipping the drafter after long-block steps (skip_on=long, lag 0 = never to
  3) or after steps whose head the lookup filled (skip_on=head, lag 1 and 2): tokens/step and the share of steps that
  ran the drafter, per prompt. (The fusion notebook priced them with the run's measured drafter pass,
  `vllm_report.skip_what_if`, since retired: the run history in the docs keeps the answer.)
  --schedule long replays the same grid with the scheduler fixed to the long block (`schedule=long`): inside vLLM
  every step verifies k positions whatever the block (gpu-fused pads after it), so a block shorter than k saves no
  verify time there, and the lookup's tail fills positions an adaptive short block leaves to the pad.
  --blocks 1,2 picks the drafter head lengths; --vary nmin_tail=1,4 (repeatable) replays every combination of those
  fusion settings too; --no-skip replays skip=0 only; --skips head=2,3,4 (repeatable) replays those lags instead of
  the default ones.
  --settings k=31,nmax=32,policy=earliest replays other base settings than run fb's (e.g. a longer block), and
  --lookup-k 15,31 adds the lookup alone (`lookup:nmin=1,nmax=32,k=K,policy=earliest`, what gpu-lookup runs) at
  those widths, the rows the fused configs are compared with (drafter_share 0).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

BLOCKS = (2, 4, 7)
SKIPS = {"long": (0, 1, 2, 3), "head": (1, 2)}  # skip_on -> lags (skip 0: never, the run's own configs)
SETTINGS = "k=15,nmax=32,policy=earliest"  # the gpu-fused configs of run fb


def main(argv: list[str] | None = None) -> int:
    import polars as pl
    from transformers import AutoTokenizer

    from hqlab import models
    from hqlab.bench.vllm_runs import runs_from_raw
    from hqlab.config import ConfigError, resolve_spec
    from hqlab.engines import vllm as hv
    from hqlab.proposers import make_proposer
    from hqlab.proposers.fused import FusedConfig
    from hqlab.replay import replay
    from hqlab.replay.teacher import load_drafter, replay_fused_grid
    from hqlab.trace import tokens_per_step
    from hqlab.replay.traces import Trace
    from hqlab.workloads import load_workload

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw", help="a raw vLLM run (benchmarks/vllm_gpu.py bench) that ran `none`")
    ap.add_argument("--run", required=True, help="the name of this replay: data/results/fused_skip_replay/<run>/")
    ap.add_argument("--results", default=None, help="the results folder (default data/results)")
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default="float32", help="the replay drafter's dtype on the CPU")
    ap.add_argument("--blocks", default=",".join(map(str, BLOCKS)),
                    help="drafter head lengths (draft_block) to replay, comma-separated")
    ap.add_argument("--vary", action="append", default=[], metavar="KEY=V1,V2",
                    help="a fused setting to replay at each of these values (repeatable: every combination)")
    ap.add_argument("--no-skip", action="store_true", help="replay skip=0 only (the drafter every step)")
    ap.add_argument("--skips", action="append", default=[], metavar="ON=L1,L2",
                    help="the lags to replay after `long` or `head` steps instead of the default ones (repeatable, "
                         "e.g. --skips head=2,3,4)")
    ap.add_argument("--schedule", default="adaptive", choices=["adaptive", "long"],
                    help="the fused scheduler's mode (SPEC §2.5 adaptive, or always the long block)")
    ap.add_argument("--settings", default=SETTINGS, help=f"the fused configs' base settings (default {SETTINGS})")
    ap.add_argument("--lookup-k", default="", help="also replay the lookup alone at these k (comma-separated)")
    args = ap.parse_args(argv)
    try:
        lookup_ks = [int(x) for x in args.lookup_k.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--lookup-k: comma-separated integers, e.g. 15,31 (got {args.lookup_k!r})") from None

    skips = {"long": (0,)} if args.no_skip else SKIPS
    if args.skips:
        skips = {}
        for item in args.skips:
            on, _, lags = item.partition("=")
            try:
                skips[on] = tuple(int(x) for x in lags.split(","))
            except ValueError:
                lags = ""
            if on not in SKIPS or not lags:
                raise ConfigError(f"--skips: expected long=L1,L2 or head=L1,L2 with integer lags (got {item!r})")

    meta = json.loads(Path(args.raw).with_suffix(".json").read_text())
    runs = [r for r in runs_from_raw(pl.read_parquet(args.raw))
            if r.config == "none" and r.concurrency <= 1 and r.repeat == 0]
    if not runs:
        raise ConfigError(f"{args.raw}: no `none` run at batch 1 (the outputs to replay over)")
    tokenizer = AutoTokenizer.from_pretrained(models.prepare(meta["model"]))
    prompts = {pid: (category, ids) for pid, category, ids in hv.encode_prompts(
        tokenizer, load_workload(meta["suite"], doc_tokens=meta["doc_tokens"], tokenizer=tokenizer))}
    traces = [Trace.of(prompts[r.prompt_id][1], list(r.generation.output_ids), meta["max_new_tokens"], r.prompt_id,
                       prompts[r.prompt_id][0]) for r in runs]
    mode = "" if args.schedule == "adaptive" else f",schedule={args.schedule}"
    try:
        blocks = [int(b) for b in args.blocks.split(",")]
    except ValueError:
        raise ConfigError(f"--blocks: comma-separated draft_block values, e.g. 1,2 (got {args.blocks!r})") from None
    varied = [""]
    for item in args.vary:
        key, _, values = item.partition("=")
        if not key or not values:
            raise ConfigError(f"--vary: expected KEY=V1,V2 (got {item!r})")
        varied = [f"{v},{key}={x}" for v in varied for x in values.split(",")]
    specs = [f"fused:{args.settings},draft_block={b},skip={s},skip_on={on}{mode}{v}" for b in blocks
             for on, lags in skips.items() for s in lags for v in varied]
    for spec in specs:  # a bad setting fails here, before the drafter loads
        resolve_spec(spec, {"fused": FusedConfig}, context="fused")
    table = replay_fused_grid(traces, load_drafter(args.drafter, device="cpu", dtype=args.dtype), specs)
    if lookup_ks:
        lookups = []
        for k in lookup_ks:
            spec = f"lookup:nmin=1,nmax=32,k={k},policy=earliest"
            proposer = make_proposer(spec)
            for t in traces:
                records = replay(t.prompt_ids, t.output_ids, proposer, max_new_tokens=t.max_new_tokens,
                                 request=t.prompt_id)
                lookups.append({"config": spec, "prompt_id": t.prompt_id, "category": t.category,
                                "steps": len(records), "tokens_per_step": tokens_per_step(records),
                                "verify_positions": sum(r.verify_len for r in records) / max(len(records), 1),
                                "drafter_share": 0.0})
        table = pl.concat([table, pl.DataFrame(lookups)], how="diagonal_relaxed")
    table = table.with_columns(pl.lit(meta["model"]).alias("target"), pl.lit(args.drafter).alias("drafter"),
                               pl.lit(Path(args.raw).name).alias("source"))
    from hqlab.bench import results
    from hqlab.provenance import git_commit

    out = results.write_run("fused_skip_replay", args.run, card="cpu", tables={"rows": table}, root=args.results,
                            info={"commit": git_commit(), "command": results.command_line(),
                                  "benchmark": "experiments/drafter_skip_replayed/fused_skip_replay.py"})
    with pl.Config(tbl_rows=-1, tbl_width_chars=160, fmt_str_lengths=60):
        print(table.group_by("config", "category").agg(pl.col("tokens_per_step").median(),
                                                        pl.col("drafter_share").median()).sort("category", "config"))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
