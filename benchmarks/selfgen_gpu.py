"""Self-generate a draft-vocabulary corpus with a target model (meant for a GPU; runs on CPU too, slowly).

Resumable: run the same command again (same output path, model and settings) and it continues where the last
run stopped, skipping ids already written; a line cut short by a killed run is dropped. Progress (records and
tok/s) shows on stderr. With --latency-sizes it then measures the draft step latency vs draft vocabulary size
on the same device (`hqlab.vocab.measure_draft_latency`), written as the run data/results/vocab_latency/<model>/
(latency.json; hqlab.bench.results) where the draft_vocab notebook picks it up.

Usage:
  PYTHONPATH=. python benchmarks/selfgen_gpu.py --model PATH_OR_NAME --records 4000 --batch-size 128 \
      --max-new-tokens 1024 --out data/selfgen/qwen2.5-coder-1.5b.jsonl [--prompts FILE] [--latency-sizes 8192,...]

The output file holds `{id, src, prompt_ids, output_ids, finish}` per line plus `<out>.meta.json` (model,
sampling settings and their source, max_new_tokens, seed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="offline short name, model folder or hub id")
    ap.add_argument("--prompts", default=None, help="prompt JSONL (default: data/prompts/selfgen.jsonl)")
    ap.add_argument("--records", type=int, required=True, help="records to have in the file when done")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--out", type=Path, required=True, help="corpus .jsonl (appended to; resumable)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave as is)")
    ap.add_argument("--latency-sizes", default="", help="comma-separated draft vocab sizes to time after generating")
    ap.add_argument("--latency-context", type=int, default=512)
    ap.add_argument("--results", type=Path, default=None,
                    help="the results folder the latency run goes to (default data/results, read by the notebook)")
    args = ap.parse_args(argv)

    import torch

    from hqlab import models
    from hqlab.vocab import selfgen

    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = selfgen.load_prompts(args.prompts)  # validated before the model loads
    sizes = [int(s) for s in args.latency_sizes.split(",") if s.strip()]
    t0 = time.time()
    model, tokenizer, info = models.load(args.model, device=args.device, dtype=args.dtype)
    print(f"loaded {info.name} ({info.dtype}, {info.device}) in {time.time() - t0:.1f}s; "
          f"{len(prompts)} prompts, {args.records} records", file=sys.stderr)
    summary = selfgen.run(model, tokenizer, prompts, args.out, n_records=args.records, batch_size=args.batch_size,
                          max_new_tokens=args.max_new_tokens, seed=args.seed, model_name=info.name,
                          eos_ids=info.eos_token_ids)
    print(f"{summary.out}: {summary.skipped} already there, {summary.written} written, {summary.new_tokens} new "
          f"tokens in {summary.seconds:.1f}s ({summary.tok_s:.1f} tok/s)", file=sys.stderr)
    if sizes:
        from hqlab import vocab
        from hqlab.provenance import machine_description

        rows = vocab.measure_draft_latency(model, sizes, context=args.latency_context)
        for r in rows:
            r.update(model=info.name, dtype=info.dtype, device=machine_description(next(model.parameters()).device))
        from hqlab.bench import results
        from hqlab.provenance import git_commit

        path = results.write_run("vocab_latency", Path(info.name).name, card=results.card_of(rows[0]["device"]),
                                 files={"latency.json": (json.dumps(rows, indent=1) + "\n").encode()},
                                 info={"commit": git_commit(), "command": results.command_line(),
                                       "benchmark": "benchmarks/selfgen_gpu.py"}, root=args.results)
        for r in rows:
            print(f"N={r['n']:>7}: {r['step_ms']:.3f} ms/draft step (head {r['head_ms']:.3f} ms)", file=sys.stderr)
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
