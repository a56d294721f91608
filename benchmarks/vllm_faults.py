"""The fault-and-feature suite and the soak through `vllm serve` (#60). `run`: a plan's configs served at once for one
setting (prefix caching on or off, a KV cache of a few blocks so that vLLM preempts), each case of
`hqlab.bench.faults` sent to every server in turn, one record per (config, case) with the servers' memory before and
after. `soak`: one config's server under the plan's steady load with disconnects (`hqlab.bench.soak`), sampled
every few seconds.

  GPU:  python3 benchmarks/vllm_faults.py run --plan benchmarks/plans/faults_f1.json --setting prefix-on --tag f1a
        python3 benchmarks/vllm_faults.py soak --plan benchmarks/plans/soak_k1.json --config lookup --tag k1a
  CPU:  python benchmarks/vllm_faults.py finish RETURNED_DIR   -> data/results/faults/<tag>/ or soak/<tag>/
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a bare checkout on the GPU host

from hqlab.bench import runner  # noqa: E402  (standard library only: the host has no polars)

SCRIPT = "benchmarks/vllm_faults.py"
PLAN_KEYS = ("model", "configs", "settings", "server", "limits", "cases", "prompts", "seed")
SOAK_KEYS = ("model", "configs", "settings", "server", "bounds", "mix", "seed", "criteria")


def run(args) -> int:
    import vllm  # noqa: F401  (first: a wheel missing from the carried set fails here)

    from hqlab.bench import faults
    from hqlab.provenance import machine_description

    out = runner.out_dir()
    runner.save_json(out / f"faults_{args.tag}.json", {"machine": machine_description(vllm=True),
                                                       "setting": args.setting, "commit": args.commit})
    return faults.run_suite(args.suite, args.setting, args.tag, out, port=args.port, start_timeout=args.start_timeout,
                            budget=args.budget, root=ROOT, log=runner.log)


def soak(args) -> int:
    import vllm  # noqa: F401  (first: a wheel missing from the carried set fails here)

    from hqlab.bench.soak import run_soak

    return run_soak(args.suite, args.config, args.tag, runner.out_dir(), port=args.port, budget=args.budget,
                    start_timeout=args.start_timeout, commit=args.commit, plan_path=args.plan, log=runner.log)


def finish(args) -> int:
    if any(Path(args.returned).glob("soak_*.json")):  # a soak's call
        from hqlab.bench import soak

        return soak.report(*soak.finish(args.returned, script=SCRIPT, commit=args.commit, root=args.results))
    from hqlab.bench import faults

    faults.finish(args.returned, script=SCRIPT, commit=args.commit, root=args.results)
    return 0


def check_run(args, parser) -> None:
    if getattr(args, "suite", None) is None:
        parser.error(f"{args.cmd} needs --plan (benchmarks/plans/{'soak' if args.cmd == 'soak' else 'faults'}_*.json)")
    if args.cmd == "soak":
        from hqlab.bench.soak import check_plan

        try:
            check_plan(args.suite, args.config)
        except ValueError as e:  # a ConfigError, or a criterion that is no claim
            parser.error(f"--plan {args.plan}: {e}")
    elif args.setting not in args.suite["settings"]:
        parser.error(f"--setting {args.setting!r}: the plan's settings are {', '.join(args.suite['settings'])}")


def plan(args, loaded) -> None:
    args.suite = loaded


CLI = runner.Benchmark(SCRIPT, __doc__)
cmd = CLI.gpu("run", run, "GPU host: the plan's servers for one setting, every case", plan=plan, plan_keys=PLAN_KEYS,
              budget_s=560, check=check_run)
cmd.add_argument("--setting", required=True, help="one of the plan's settings (prefix caching on or off)")
cmd.add_argument("--port", type=int, default=8421)
cmd.add_argument("--start-timeout", type=float, default=420)
cmd = CLI.gpu("soak", soak, "GPU host: one config's server under the plan's steady load", plan=plan,
              plan_keys=SOAK_KEYS, budget_s=560, check=check_run)
cmd.add_argument("--config", required=True, help="the plan's config to serve (one server a call)")
cmd.add_argument("--port", type=int, default=8431)
cmd.add_argument("--start-timeout", type=float, default=300)
cmd = CLI.command("finish", finish, "CPU: one call's returned files -> data/results/faults/<tag>/ or soak/<tag>/",
                  commit=True)
cmd.add_argument("returned", help="the folder of one call's returned files")
main = CLI.main

if __name__ == "__main__":
    sys.exit(main())
