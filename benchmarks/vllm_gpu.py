"""hqlab inside vLLM on a GPU: the configs of docs/vllm.md on one engine each, raw runs saved after every config.

  GPU (through tools/gpu_host/vllm_host.py run; `python benchmarks/vllm_gpu.py host bench ...` prints the call):
      python3 benchmarks/vllm_gpu.py bench --tag a --suite all --repeats 3 --concurrency 8 --profile \\
          --config gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest --config lookup:nmin=1,nmax=32,k=15,policy=earliest
    writes $OUT/vllm_gpu_<tag>.parquet (raw runs, after every config) and $OUT/vllm_gpu_<tag>.json (machine, settings,
    what vLLM chose per engine, and with --profile each engine's phase timings: hqlab.engines.vllm.worker.StepTimer)
  CPU (here):
      python benchmarks/vllm_gpu.py finish RETURNED/vllm_gpu_*.parquet --run NAME [--study vllm_fused]
    merges the raw runs of several calls into one run (the `none` reference may come from an earlier call) and
    puts it in place, data/results/<study>/<run>/ (hqlab.bench.results): rows.parquet with the columns `hqlab
    bench` writes (+ concurrency, batch_tok_s, step_efficiency, vllm_runner, async_scheduling, run),
    steps.parquet, repeats.parquet, the phase timings (phases.parquet, profile_steps.parquet) and the calls' logs;
    a call run with --skip-reference that repeats a config of the earlier call is finished as a run of its own
    with `--reference EARLIER.parquet` (the earlier call's `none` rows).
      python benchmarks/vllm_gpu.py replay RETURNED/vllm_gpu_*.parquet --run NAME [--study vllm_fused]
    replays every gpu-fused config over the run's own outputs with the lab's `fused` proposer (teacher-forced
    drafter on the CPU), compares tokens/step with vLLM's, per prompt, and writes the finished run's
    replay.parquet.

--sustained adds the whole suite with --concurrency requests kept in flight (a closed loop, as a server sees it).
--interleave starts every config's engine at once and runs each prompt on all of them in turn, so the ratios
compare runs seconds apart (a host-bound step drifts by tens of percent over minutes); its engine processes start
with spawn (forked ones inherit the running engines' threads and sockets, and stalled after the first prompt).
--parallel-start (with --interleave) builds those engines at the same time, each in a thread of its own, with a
4 GiB KV cache each (vLLM's memory profiling cannot tell engines starting together apart), then warms them up one
at a time as before (hqlab/engines/vllm/startup.py says what was checked in vLLM for it).
`none` always runs first in a call unless --skip-reference; a failing config is logged and the
others still run (--fail-fast stops at the first failure instead, to save device time while a new path is brought
up).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace as dataclasses_replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a bare checkout on the GPU host (hqlab is not importable before this)

from hqlab.bench import runner  # noqa: E402  (standard library only)
from hqlab.bench.runner import log  # noqa: E402

SCRIPT = "benchmarks/vllm_gpu.py"
STUDIES = ("vllm_gpu", "vllm_fused")  # where finish puts a run: the lookup's runs, the fused step's
DEFAULT_CONFIGS = ["gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest", "lookup:nmin=1,nmax=32,k=15,policy=earliest"]


def check_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.parallel_start and not args.interleave:
        parser.error("--parallel-start starts the engines of an --interleave call together: add --interleave, or "
                     "drop --parallel-start (without --interleave one engine runs at a time)")


def bench(args: argparse.Namespace) -> int:
    import vllm  # noqa: F401  (first: a wheel missing from the carried set fails here, before the conversion)

    from hqlab import models, provenance
    from hqlab.bench import vllm_runs
    from hqlab.config import DecodeConfig
    from hqlab.engines import vllm as hv
    from hqlab.trace import drafter_pass_shares
    from hqlab.workloads import load_workload

    machine = provenance.machine_description(vllm=True)  # before any CUDA call: vLLM forks its engine processes then
    versions = {**provenance.versions(), "device": f"cuda ({machine.split(',')[0]})"}
    log(machine)
    t = time.time()
    folder = models.prepare(args.model)
    log(f"model ready in {time.time() - t:.0f} s: {folder}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = load_workload(args.suite, doc_tokens=args.doc_tokens, tokenizer=tokenizer)
    encoded = hv.encode_prompts(tokenizer, prompts)[: args.limit or None]
    log("prompt tokens: " + ", ".join(f"{pid} {len(ids)}" for pid, _, ids in encoded))
    options = hv.VLLMOptions(model=folder, max_num_seqs=max(8, args.concurrency),
                             tensor_parallel_size=args.tensor_parallel_size,
                             pipeline_parallel_size=args.pipeline_parallel_size)
    decode = DecodeConfig(max_new_tokens=args.max_new_tokens)
    out = runner.out_dir()
    raw_path, meta_path = out / f"vllm_gpu_{args.tag}.parquet", out / f"vllm_gpu_{args.tag}.json"
    settings = hv.settings_for(args.config or DEFAULT_CONFIGS)  # every spec checked before the first engine
    if args.skip_reference:
        settings = [s for s in settings if s.label != "none"]
    burst = [b.strip() for b in args.burst.split(",") if b.strip()]
    if burst:
        args.concurrency = len(burst)
        options = dataclasses_replace(options, max_num_seqs=max(8, len(burst)))
    group = vllm_runs.burst_group(encoded, args.concurrency, burst)  # a bad name fails here, before any engine starts
    if group and not burst and any(s.label.startswith("gpu-fused") for s in settings):
        log(f"note: the {len(group)} requests at once are the suite's first prompts ("
            f"{', '.join(p[0] for p in group)}); --burst copy,chat,qa,summary mixes the copy request with prose")
    vllm_runs.check_prompts(options, encoded, decode)
    log("configs: " + ", ".join(s.label for s in settings))
    described: list[dict] = []
    runs: list = []

    def save() -> None:
        runner.save_table(raw_path, vllm_runs.raw_table(runs))
        runner.save_json(meta_path, {
            "machine": machine, "versions": versions, "model": args.model, "dtype": options.dtype,
            "doc_tokens": args.doc_tokens, "suite": args.suite, "max_new_tokens": args.max_new_tokens,
            "repeats": args.repeats, "concurrency": args.concurrency, "tensor_parallel_size": args.tensor_parallel_size,
            "pipeline_parallel_size": args.pipeline_parallel_size, "parallel_start": args.parallel_start,
            "commit": args.commit, "engines": described})

    if args.interleave:  # every engine alive at once, runs interleaved request by request
        import dataclasses
        import faulthandler

        # Engine processes started by fork inherit the threads and sockets of the engines already running; spawn
        # starts them clean (they load hqlab's plugin through its entry point). A stall shows as stack dumps.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        faulthandler.dump_traceback_later(150, repeat=True)

        def saved(got: list, engines: list, what: str) -> None:
            runs[:] = got
            described[:] = engines
            save()
            log(f"saved {len(got)} runs: {what}")

        vllm_runs.run_interleaved(dataclasses.replace(options, gpu_memory_utilization=args.gpu_memory), settings,
                                  encoded, decode, repeats=args.repeats, concurrency=args.concurrency,
                                  sustained=args.sustained, profile=args.profile, saved=saved, burst=burst,
                                  parallel_start=args.parallel_start)
        for setting in settings:
            alone = [r for r in runs if r.config == setting.label and r.concurrency <= 1 and r.repeat >= 0]
            rate = sorted(r.generation.decode_tok_s() for r in alone)
            log(f"{setting.label}: median decode {rate[len(rate) // 2]:.0f} tok/s")
        return 0
    failed = 0
    for setting in settings:
        t = time.time()
        try:
            more, description = vllm_runs.run_setting(options, setting, encoded, decode, repeats=args.repeats,
                                                      concurrency=args.concurrency, sustained=args.sustained,
                                                      profile=args.profile, burst=burst)
        except Exception as e:  # one config failing must not lose the others
            import traceback

            failed += 1
            log(f"{setting.label} FAILED after {time.time() - t:.0f} s: {type(e).__name__}: {e}")
            traceback.print_exc()
            if args.fail_fast:
                break
            continue
        runs += more
        described.append(description)
        save()
        alone = [r for r in more if r.concurrency <= 1 and r.repeat >= 0]
        rate = sorted(r.generation.decode_tok_s() for r in alone)
        tps = sorted(r.generation.tokens_per_step() for r in alone)
        shares = drafter_pass_shares([rec for r in alone for rec in r.generation.records])
        passes = ", drafter passes per step " + ", ".join(f"{n}: {100 * x:.0f} %" for n, x in shares.items()) \
            if shares else ""
        log(f"{setting.label}: {time.time() - t:.0f} s, runner {description['model_runner']}, async "
            f"{description['async_scheduling']}, median decode {rate[len(rate) // 2]:.0f} tok/s, "
            f"median tokens/step {tps[len(tps) // 2]:.2f}{passes}")
    return 1 if failed else 0


def finish(args: argparse.Namespace) -> int:
    """One run's returned raw files -> data/results/<study>/<run>/ (hqlab.bench.results.write_run)."""
    import polars as pl

    from hqlab import bench as hb
    from hqlab.bench import results
    from hqlab.bench.vllm import finish_tables

    tables = finish_tables(args.raw, args.run, reference=args.reference, commit=args.commit)
    rows = tables["rows"]
    logs = {found for path in args.raw
            for found in runner.returned_logs(Path(path).parent, Path(path).stem.removeprefix("vllm_gpu_"))}
    runners = rows["vllm_runner"].to_list() if "vllm_runner" in rows.columns else []
    folder = runner.finish_run(args.study, args.run, card=results.card_of(rows["machine"][0]), script=SCRIPT,
                               tables=tables, logs=logs, root=args.results,
                               info={"commit": rows["git_commit"][0], "vllm_runner": runner.vllm_runners(runners)})
    with pl.Config(tbl_rows=100, tbl_cols=20, tbl_width_chars=220):
        print(hb.summarize(rows.filter(pl.col("concurrency") == 1)))
    print(f"wrote run {args.run!r}: {', '.join(sorted(tables))} -> {folder}")
    return 0


def replay(args: argparse.Namespace) -> int:
    """CPU: every gpu-fused config of a raw run against the lab's replay of the same fused config over the same
    outputs (`hqlab.bench.vllm.fused_replay_check`); the prompts are re-encoded from the run's suite settings."""
    import polars as pl
    from transformers import AutoTokenizer

    from hqlab import models
    from hqlab.bench import results
    from hqlab.bench.vllm import fused_replay_check, merge_replay
    from hqlab.bench.vllm_runs import runs_from_raw
    from hqlab.engines import vllm as hv
    from hqlab.io import read_json
    from hqlab.replay.teacher import load_drafter
    from hqlab.workloads import load_workload

    meta = read_json(Path(args.raw).with_suffix(".json"))
    runs = runs_from_raw(pl.read_parquet(args.raw))
    if args.category:
        runs = [r for r in runs if r.category in args.category]
    tokenizer = AutoTokenizer.from_pretrained(models.prepare(meta["model"]))
    prompts = hv.encode_prompts(tokenizer, load_workload(meta["suite"], doc_tokens=meta["doc_tokens"],
                                                         tokenizer=tokenizer))
    drafter = load_drafter(args.drafter, device="cpu", dtype=args.dtype)
    table = fused_replay_check(runs, prompts, drafter, max_new_tokens=meta["max_new_tokens"])
    entry = results.run_info(args.study, args.run, args.results)  # a run is finished before it is replayed
    existing = results.load(args.study, args.run, "replay", root=args.results) \
        if "replay.parquet" in entry["files"] else None
    merged = merge_replay(table.with_columns(pl.lit(args.run).alias("run")), existing)
    runner.finish_run(args.study, args.run, card=entry["card"], script=SCRIPT, tables={"replay": merged},
                      root=args.results)
    with pl.Config(tbl_rows=-1, tbl_width_chars=160, fmt_str_lengths=60):
        print(table.select("config", "prompt_id", "category", "tokens_per_step", "vllm_tokens_per_step",
                           "difference"))
    return 0


CLI = runner.Benchmark(SCRIPT, __doc__)
cmd = CLI.gpu("bench", bench, "GPU: every config on one vLLM engine each, raw runs into $OUT", tag="a",
              check=check_bench)
cmd.add_argument("--model", default="qwen2.5-coder-0.5b")
cmd.add_argument("--suite", default="all", help="labd, chat, all, a task, or a JSONL file")
cmd.add_argument("--config", action="append", default=None, help="a config spec (repeatable); `none` is added")
cmd.add_argument("--repeats", type=int, default=3)
cmd.add_argument("--max-new-tokens", type=int, default=256)
cmd.add_argument("--doc-tokens", type=int, default=2000)
cmd.add_argument("--limit", type=int, default=0, help="only the first N prompts")
cmd.add_argument("--concurrency", type=int, default=8, help="then the first N prompts at once (0: skip)")
cmd.add_argument("--burst", default="",
                 help="comma-separated prompt ids or categories submitted together instead of the first N "
                      "(e.g. copy,chat,qa,summary: a copy request among prose); sets --concurrency to their count")
cmd.add_argument("--tensor-parallel-size", type=int, default=1)
cmd.add_argument("--pipeline-parallel-size", type=int, default=1)
cmd.add_argument("--profile", action="store_true", help="time the worker's phases on one more pass")
cmd.add_argument("--interleave", action="store_true",
                 help="all engines alive at once, each prompt run on every engine in turn (ratios robust to drift)")
cmd.add_argument("--sustained", action="store_true", help="also the whole suite with --concurrency requests kept in "
                 "flight")
cmd.add_argument("--gpu-memory", type=float, default=0.85,
                 help="with --interleave: GPU memory fraction shared by all engines")
cmd.add_argument("--parallel-start", action="store_true",
                 help="with --interleave: build every engine at the same time (each with a 4 GiB KV cache), "
                      "then warm them up one at a time")
cmd.add_argument("--skip-reference", action="store_true", help="leave out `none` (an earlier call ran it)")
cmd.add_argument("--fail-fast", action="store_true", help="stop at the first failing config")
cmd = CLI.command("finish", finish, "CPU: one run's raw files -> data/results/<study>/<run>/", commit=True)
cmd.add_argument("raw", nargs="+")
cmd.add_argument("--study", default="vllm_gpu", choices=STUDIES, help="vllm_gpu (the lookup's runs) or vllm_fused (the "
                 "fused step's)")
cmd.add_argument("--run", required=True, help="name of this run (one GPU session's reference and configs)")
cmd.add_argument("--reference", default=None,
                 help="a raw file whose `none` runs are this run's reference (for a call run with --skip-reference "
                      "whose configs another call ran too)")
cmd = CLI.command("replay", replay, "CPU: gpu-fused configs of a raw run against the lab's replay")
cmd.add_argument("raw")
cmd.add_argument("--study", default="vllm_fused", choices=STUDIES)
cmd.add_argument("--drafter", default="qwen2.5-coder-0.5b")
cmd.add_argument("--dtype", default="float32", help="the replay drafter's dtype on the CPU")
cmd.add_argument("--category", action="append", default=None, help="only these task classes (repeatable)")
cmd.add_argument("--run", required=True, help="the finished run the raw file belongs to: its replay.parquet gets this "
                 "file's rows in place of its rows of the same configs")
main = CLI.main

if __name__ == "__main__":
    sys.exit(main())
