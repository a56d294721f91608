"""The fault-and-feature suite through `vllm serve` (#60): a plan's configs served at once for one setting (prefix
caching on or off, a KV cache of a few blocks so that vLLM preempts), each case of `hqlab.bench.faults` sent to every
server in turn, one record per (config, case) with the servers' memory before and after.

  GPU:  python3 benchmarks/vllm_faults.py run --plan benchmarks/plans/faults_f1.json --setting prefix-on --tag f1a
  CPU:  python benchmarks/vllm_faults.py finish RETURNED_DIR   -> data/results/faults/<tag>/
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a bare checkout on the GPU host

from hqlab.bench import runner  # noqa: E402  (standard library only: the host has no polars)

SCRIPT = "benchmarks/vllm_faults.py"
PLAN_KEYS = ("model", "configs", "settings", "server", "limits", "cases", "prompts", "seed")


def run(args) -> int:
    import vllm  # noqa: F401  (first: a wheel missing from the carried set fails here)

    from hqlab.bench import faults
    from hqlab.provenance import machine_description

    out = runner.out_dir()
    runner.save_json(out / f"faults_{args.tag}.json", {"machine": machine_description(vllm=True),
                                                       "setting": args.setting, "commit": args.commit})
    return faults.run_suite(args.suite, args.setting, args.tag, out, port=args.port, start_timeout=args.start_timeout,
                            budget=args.budget, root=ROOT, log=runner.log)


def finish(args) -> int:
    import polars as pl

    from hqlab.bench import results
    from hqlab.bench.faults import FAULT_COLUMNS, rows

    src = Path(args.returned)
    raws = sorted(src.glob("faults_*.jsonl"))
    tags = sorted({f.name.removeprefix("faults_").removesuffix(".jsonl") for f in raws})
    if len(tags) != 1:
        raise SystemExit(f"{src}: finish one run's returned files at a time (found runs {tags or 'none'})")
    tag = tags[0]
    records = [json.loads(line) for line in raws[0].read_text().splitlines() if line.strip()]
    table = pl.DataFrame(rows(records), schema_overrides={"preemptions": pl.Float64}).select(FAULT_COLUMNS)
    meta = json.loads((src / f"faults_{tag}.json").read_text())
    folder = runner.finish_run("faults", tag, card=results.card_of(meta["machine"]), script=SCRIPT,
                               tables={"rows": table}, files={"raw.jsonl": raws[0]},
                               logs=runner.returned_logs(src, tag),
                               info={"commit": runner.commit_of(args.commit, meta.get("commit")),
                                     "plan": runner.plan_path("faults", tag.rstrip("ab"))},
                               root=args.results)
    print(table.select("config", "setting", "case", "requests", "errors", "hangs", "greedy_equal", "near_ties",
                       "mismatches", "logprob_max_diff", "sampling_p", "preemptions"))
    print(f"{table.height} rows of run {tag} -> {folder}")
    return 0


def check_run(args, parser) -> None:
    if getattr(args, "suite", None) is None:
        parser.error("run needs --plan (benchmarks/plans/faults_*.json)")
    if args.setting not in args.suite["settings"]:
        parser.error(f"--setting {args.setting!r}: the plan's settings are {', '.join(args.suite['settings'])}")


CLI = runner.Benchmark(SCRIPT, __doc__)
cmd = CLI.gpu("run", run, "GPU host: the plan's servers for one setting, every case", plan=lambda args, plan: setattr(args, "suite", plan),
              plan_keys=PLAN_KEYS, budget_s=560, check=check_run)
cmd.add_argument("--setting", required=True, help="one of the plan's settings (prefix caching on or off)")
cmd.add_argument("--port", type=int, default=8421)
cmd.add_argument("--start-timeout", type=float, default=420)
cmd = CLI.command("finish", finish, "CPU: one run's returned records -> data/results/faults/<tag>/", commit=True)
cmd.add_argument("returned", help="the folder of one run's returned files")
main = CLI.main

if __name__ == "__main__":
    sys.exit(main())
