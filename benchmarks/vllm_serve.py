"""hqlab through `vllm serve`: throughput and latency under load (`vllm bench serve`), greedy text through `openai`,
and the sampling test's samples; one server process per config, results saved after every load point.

  GPU (through tools/gpu_host/vllm_host.py run, which installs vLLM and the models on an offline host;
  `python benchmarks/vllm_serve.py host together --plan benchmarks/plans/serve_<tag>.json --tag <tag>` prints the
  call with its commit and log name):
      python3 benchmarks/vllm_serve.py bench --tag s1 --commit $(git rev-parse --short HEAD) \\
          --config none --config "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest,batch_k=1:15/8:3/0"
    keeps its files under a work folder that outlives one call (a later call with the same tag adds the configs it
    names; a config already done is skipped) and copies them to $OUT: vllm_serve_<tag>.jsonl (one row per load point,
    hqlab.bench.serve.SERVE_COLUMNS), serve_greedy_<tag>.jsonl (greedy chat texts), serve_samples_<tag>.jsonl (the
    sampling test's token ids), serve_<tag>_<n>.log (each server's log).
  CPU (here): python benchmarks/vllm_serve.py finish RETURNED_DIR puts the run in place, data/results/serve/<tag>/
    (hqlab.bench.results): rows.parquet (the load rows), samples.parquet, greedy.parquet, the returned files as they
    came, the call's log as run.log, and run.json.

--planted-fault CONFIG (bench), a plan's `planted` or `sample_prefix_off` (together) add a samples-only server of CONFIG
with the planted verification bug (hqlab.engines.vllm.fault: the sampling test must fail) or prefix caching off; a
plan's `decisions` has goodput servers record their decisions (goodput_decisions.parquet, goodput_timed.parquet).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a bare checkout on the GPU host

from hqlab.bench import runner, serve_servers  # noqa: E402  (standard library only: the host has no polars)
from hqlab.bench.runner import append_jsonl, log  # noqa: E402
from hqlab.bench.serve import PROMPT_SETS, dataset_prompts, parse_point  # noqa: E402

SCRIPT = "benchmarks/vllm_serve.py"
TARGET = "qwen2.5-coder-1.5b"
# the sampling test's prompt: a list the answer repeats, so the lookup drafts at most steps, and sampling at
# temperature 1 leaves several likely tokens at most positions
SAMPLE_PROMPT = ("Write the sequence 'red, green, blue, yellow' five times on one line, separated by commas, "
                 "then name one more colour.")
GREEDY_PROMPTS = 3  # chat prompts whose greedy text every server returns through the openai package


def done_configs(path: Path) -> set[str]:
    if not path.exists():
        return set()
    return {json.loads(line)["config"] for line in path.read_text().splitlines() if line.strip()}


@dataclass(frozen=True)
class Call:
    """What a GPU call sets up before its first server: the work folder that outlives one call (a later call with
    the same tag adds to its files), the folder the call returns, its result files, the served model, the datasets'
    prompt files, the greedy test's chat prompts, and the machine and vLLM version every row records."""

    work: Path
    out: Path
    rows: Path
    greedy: Path
    samples: Path
    model: str
    data: Path
    chat: list[str]
    machine: str
    version: str


def prepare(args: argparse.Namespace, datasets: list[str]) -> Call:
    """The models converted (the fused configs' drafters once here rather than in a server's worker), the datasets'
    prompt files written, the result files named."""
    from transformers import AutoTokenizer

    from hqlab import models
    from hqlab.provenance import machine_description, package_version

    work = Path(args.work or Path(tempfile.gettempdir()) / "hqlab-serve" / args.tag)
    work.mkdir(parents=True, exist_ok=True)
    out = runner.out_dir(work / "out")
    model = models.prepare(args.model)
    for spec in args.config:
        if spec.startswith("gpu-fused"):
            from hqlab.engines.vllm.gpu_fused import fused_config

            models.prepare(fused_config(spec).model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    data = work / "datasets"
    data.mkdir(exist_ok=True)
    for name in datasets:
        with open(data / f"{name}.jsonl", "w") as f:
            for text in dataset_prompts(name, tokenizer):
                f.write(json.dumps({"prompt": text}) + "\n")
    chat = dataset_prompts("chat", tokenizer)[:GREEDY_PROMPTS]
    return Call(work, out, work / f"vllm_serve_{args.tag}.jsonl", work / f"serve_greedy_{args.tag}.jsonl",
                work / f"serve_samples_{args.tag}.jsonl", model, data, chat, machine_description(vllm=True),
                package_version("vllm"))


def server_argv(call: Call, spec: str, args: argparse.Namespace, *, port: int, memory: list[str],
                planted: str | None = None) -> list[str]:
    """`vllm serve` for one config, through vLLM's CLI module under this Python, its memory flags `memory`."""
    from hqlab.engines.vllm.serving import serve_command

    return [sys.executable, "-m", "vllm.entrypoints.cli.main"] + serve_command(
        call.model, spec, max_num_seqs=args.max_num_seqs, port=port, planted_fault=planted,
        extra=["--served-model-name", "target", "--max-model-len", str(args.max_model_len), *memory,
               "--disable-uvicorn-access-log", "--seed", "0"])[1:]


def take_samples(call: Call, server, label: str, args: argparse.Namespace) -> None:
    """The sampling test's samples from one server, appended to the samples file."""
    from hqlab.bench import serve

    t0 = time.perf_counter()
    samples = serve.sample_token_ids(server.base_url, "target", SAMPLE_PROMPT, samples=args.samples,
                                     max_tokens=args.sample_tokens, temperature=1.0,
                                     concurrency=args.sample_concurrency)
    append_jsonl(call.samples, {"run": args.tag, "config": label, "temperature": 1.0,
                                "concurrency": args.sample_concurrency, "prompt": SAMPLE_PROMPT, "token_ids": samples})
    log(f"{label}: {len(samples)} samples in {time.perf_counter() - t0:.0f} s")


def measure(call: Call, server, spec: str, point, args: argparse.Namespace, *, result_file: str, label: str,
            repeat: int | None = None, profiled: bool = False) -> None:
    """One load point on one server (`vllm bench serve` in this process): its row appended to the rows file, which
    goes to the returned folder at once (what a call cut at its limit still returns)."""
    from hqlab.bench import serve, serve_profile

    (call.work / "bench").mkdir(exist_ok=True)
    if serve.ordered(point.dataset):  # a corpus workload's point starts from an empty corpus and prefix cache
        serve_profile.reset_server(server.base_url, spec)
    bench_args = serve.bench_args(server.base_url, "target", call.model, serve.point_dataset(call.data, point), point,
                                  output_len=args.output_len, result_dir=call.work / "bench", result_file=result_file)
    row = serve.load_row(serve.run_load(bench_args), run=args.tag, config=spec, point=point, model=args.model,
                         machine=call.machine, vllm_version=call.version, git_commit=args.commit)
    if repeat is not None:
        row["repeat"], row["profiled"] = repeat, profiled
    append_jsonl(call.rows, row)
    shutil.copy(call.rows, call.out / call.rows.name)
    log(f"{label}: {row['output_throughput']:.0f} tok/s, TPOT p50 {row['median_tpot_ms']:.2f} ms, TTFT p50 "
        f"{row['median_ttft_ms']:.0f} ms, acceptance length {row['acceptance_length']:.2f}")


def point_name(point) -> str:
    return f"{point.dataset}_t{point.temperature:g}_c{point.max_concurrency}"


def bench(args: argparse.Namespace) -> int:
    import vllm  # noqa: F401  (first: a wheel missing from the carried set fails here)

    from hqlab.bench import serve  # no polars needed: hqlab.bench loads its harness lazily (the GPU host has none)
    from hqlab.engines.vllm.serving import serve_env  # FULL graphs' capture fix, where a config runs them

    call = prepare(args, args.dataset)
    points = serve.load_points(args.dataset, args.temperature, args.concurrency)
    servers = [(spec, None) for spec in args.config] + [(spec, "accept_first_draft") for spec in args.planted_fault]
    already = done_configs(call.rows) | done_configs(call.samples)
    for n, (spec, planted) in enumerate(servers):
        label = spec if planted is None else f"{spec} [planted {planted}]"
        if label in already:
            log(f"{label}: done in an earlier call, skipped")
            continue
        argv = server_argv(call, spec, args, port=args.port, planted=planted,
                           memory=["--gpu-memory-utilization", str(args.gpu_memory_utilization)])
        log(f"{label}: starting `{' '.join(argv[3:6])} ...`")
        server_log = call.work / f"serve_{args.tag}_{len(already) + n}.log"
        try:
            with serve.Server(argv, server_log, port=args.port, env={**os.environ, **serve_env(spec)},
                              timeout_s=args.start_timeout) as server:
                log(f"{label}: ready in {server.ready_s:.0f} s")
                eager = warn_if_eager(label, server_log, args.allow_eager)
                if planted is None:
                    texts = serve.chat_texts(server.base_url, "target", call.chat, max_tokens=args.greedy_tokens)
                    append_jsonl(call.greedy, {"run": args.tag, "config": label, "texts": texts})
                take_samples(call, server, label, args)
                if planted is not None or (eager and not args.allow_eager):
                    continue
                for point in points:
                    measure(call, server, spec, point, args, result_file=f"{n}_{point_name(point)}.json",
                            label=f"{label} {point_name(point)}")
        except Exception as e:  # the next config still runs; what was saved stays
            log(f"{label}: FAILED {type(e).__name__}: {e}")
            if args.fail_fast:
                break
        finally:
            runner.copy_out([call.rows, call.greedy, call.samples, server_log], call.out)
    return 0


def apply_plan(args: argparse.Namespace, plan: dict) -> None:
    """A committed plan (benchmarks/plans/serve_*.json): its configs by name, which of them run at one request only
    (`batch1`) and which are sampled (`sample`), its points; added to what the command line names."""
    named = plan["configs"]
    args.config += list(named.values())
    args.batch1_config += [named[n] for n in plan.get("batch1", [])]
    args.sample_config += [named[n] for n in plan.get("sample", [])]
    args.point += plan["points"]
    args.allow_short = args.allow_short or bool(plan.get("allow_short"))  # plans written before the rule
    args.profile_repeat += plan.get("profile", [])
    serve_servers.apply_plan(args, plan)


def check_together(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Configs and points named, every point valid and (unless --allow-short) of at least 10 waves: a short point's
    ratio is ramp-up and drain. Refused before any server starts."""
    from hqlab.bench import serve_profile
    from hqlab.config import ConfigError

    if not args.config or not args.point:
        parser.error("name the configs and points (--config/--point or --plan)")
    try:
        for point, repeats in map(parse_point, args.point):
            if not args.allow_short:
                point.require_waves()
            serve_profile.check_repeats(args.profile_repeat, point, repeats)
    except ConfigError as e:
        parser.error(str(e))


def together(args: argparse.Namespace) -> int:
    """Every config's server started at once (each its own port, KV cache and compile cache), then the load points
    run server after server, repeat after repeat: the configs of a point are measured minutes apart, not a config's
    whole run apart, so a drift of the host's speed touches them alike, and the servers' start-up is paid once."""
    import vllm  # noqa: F401

    from hqlab.bench import serve, serve_profile
    from hqlab.engines.vllm.serving import serve_env  # FULL graphs' capture fix, where the config runs them

    points = [parse_point(p) for p in args.point]
    call = prepare(args, sorted({p.dataset for p, _ in points}))
    served = serve_servers.servers(args)  # the configs, then their sampling variants (prefix caching off, planted)
    share, servers = min(0.9 / len(served), 0.9), []
    for n, srv in enumerate(served):
        argv = server_argv(call, srv.spec, args, port=args.port + n, planted=srv.planted,
                           memory=["--gpu-memory-utilization", f"{share:.3f}", "--kv-cache-memory-bytes",
                                   str(int(args.kv_cache_gib * (1 << 30))), *srv.flags])
        env = {**os.environ, "VLLM_CACHE_ROOT": str(call.work / f"vllm-cache-{n}"),  # no two compiles share a file
               **serve_servers.record_env(srv, call.work, n), **serve_env(srv.spec)}  # decisions if asked; FULL
        if args.profile_repeat or any(serve.ordered(p.dataset) for p, _ in points):  # the step timer's or the
            # corpus reset's routes (serve.reset_server); every server alike, none included
            argv, env = argv + serve_profile.profile_flags(), {**env, **serve_profile.PROFILE_ENV}
        servers.append((srv.label, serve.Server(argv, call.work / f"serve_{args.tag}_{n}.log", port=args.port + n,
                                                env=env, timeout_s=args.start_timeout)))
    phases, phases_file = [], call.work / f"serve_phases_{args.tag}.parquet"  # the step timer's rows, if profiled

    def save() -> None:
        if phases:
            runner.save_table(phases_file, phases)
        serve.save_together(call.out, [call.rows, call.greedy, call.samples, phases_file,
                                       *serve_servers.collect(served, call.work, args.tag)],  # decisions, if any
                            [srv.log_path for _, srv in servers], args.tag)
    variants = {s.label for s in served if s.samples_only}  # the sampling test's samples only
    live, eager = [], set(variants)  # eager: servers whose drafting runs outside CUDA graphs: no load points
    try:
        for spec, server in servers:
            server.start()
        for spec, server in servers:
            try:
                server.wait()
                live.append((spec, server))
                log(f"{spec}: ready in {server.ready_s:.0f} s")
                if warn_if_eager(spec, server.log_path, args.allow_eager) and not args.allow_eager:
                    eager.add(spec)
            except Exception as e:
                log(f"{spec}: FAILED to start: {type(e).__name__}: {str(e)[-2000:]}")
        for spec, server in [(spec, server) for spec, server in live if spec not in variants]:
            append_jsonl(call.greedy, serve.greedy_row(server.base_url, "target", call.chat, run=args.tag,
                                                       config=spec, max_tokens=args.greedy_tokens))
        save()
        for spec, server in live:
            if spec in args.sample_config or spec in variants:
                take_samples(call, server, spec, args)
        save()
        for point, repeats in points:
            name = point_name(point)
            for repeat in range(repeats):
                for n, (spec, server) in enumerate(live):
                    if (point.max_concurrency > 1 and spec in args.batch1_config) or spec in eager:
                        continue
                    if args.budget.over():
                        log(f"budget of {args.budget_s:.0f} s spent: {name} repeat {repeat} and later not run")
                        save()
                        return 0
                    profiled = repeat in args.profile_repeat
                    with serve_profile.step_profile(server.base_url, phases, on=profiled, run=args.tag, config=spec,
                                                    repeat=repeat, **point.__dict__):
                        measure(call, server, spec, point, args, result_file=f"{n}_{name}_r{repeat}.json",
                                label=f"{short(spec)} {name} r{repeat}", repeat=repeat, profiled=profiled)
        save()
    finally:
        for _, server in servers:
            server.stop()
        save()
    return 0


def warn_if_eager(label: str, server_log: Path, allow: bool) -> bool:
    """Whether a server's drafting step failed to capture in CUDA graphs, said at once. It then runs eagerly:
    lossless, so its greedy texts and samples still count, but its speed is not the config's, so its load points
    are skipped unless `allow` (--allow-eager); `finish` records it as `drafting_eager`."""
    from hqlab.bench.serve import server_log_facts

    if not (server_log.exists() and server_log_facts(server_log.read_text(errors="replace"))["drafting_eager"]):
        return False
    log(f"{label}: WARNING: its drafting step runs eagerly (CUDA graph capture failed; see its log): "
        + ("measured anyway (--allow-eager)" if allow else "its load points are skipped"))
    return True


def short(spec: str) -> str:
    return spec if len(spec) <= 60 else spec[:57] + "..."


def finish(args: argparse.Namespace) -> int:
    """The files a GPU call returned for one run -> data/results/serve/<tag>/ (hqlab.bench.results.write_run)."""
    from hqlab.bench import results
    from hqlab.bench.serve import returned_run

    tag, tables, files, host_logs = returned_run(args.returned)
    rows = tables["rows"]
    cards = {results.card_of(m) for m in rows["machine"].unique()}
    if len(cards) != 1:
        raise SystemExit(f"run {tag}'s rows name {len(cards)} cards ({sorted(cards)}): one run is one machine")
    folder = runner.finish_run("serve", tag, card=cards.pop(), script=SCRIPT, tables=tables, files=files,
                               logs=host_logs, root=args.results,
                               info={"commit": rows["git_commit"][0], "vllm_runner": runner.vllm_runners(
                                   rows["vllm_runner"].to_list()), "plan": runner.plan_path("serve", tag)
                                   or runner.plan_path("corpus", tag)})  # corpus_c5*: corpus plans served
    print(f"{rows.height} load rows of run {tag} -> {folder}")
    return 0


def check_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    args.dataset = args.dataset or list(PROMPT_SETS)  # the corpus workloads run in `together`, which resets them
    args.temperature = args.temperature or [0.0, 0.7]
    args.concurrency = args.concurrency or [1, 32]
    if not args.config and not args.planted_fault:
        parser.error("name at least one --config or --planted-fault")


def add_server_options(parser: argparse.ArgumentParser, start_timeout: float) -> None:
    """The options both GPU commands take: the model, what each server returns and how it is started."""
    parser.add_argument("--model", default=TARGET)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--sample-tokens", type=int, default=24)
    parser.add_argument("--sample-concurrency", type=int, default=4,
                        help="requests in flight while sampling: keep it where batch_k still speculates")
    parser.add_argument("--greedy-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--port", type=int, default=8321)
    parser.add_argument("--start-timeout", type=float, default=start_timeout)
    parser.add_argument("--work", default=None)
    parser.add_argument("--allow-eager", action="store_true", help="measure a server whose drafting step failed to "
                        "capture in CUDA graphs (default: its load points are skipped)")


# no abbreviations (the runner refuses them): a GPU call is minutes of device time, and `--out` silently meaning
# `--output-len` cost one
CLI = runner.Benchmark(SCRIPT, __doc__)
cmd = CLI.gpu("bench", bench, "GPU host: one vllm serve per config, loads, greedy texts, samples", check=check_bench)
cmd.add_argument("--config", action="append", default=[], help="a served config (none, gpu-lookup:..., gpu-fused:...)")
cmd.add_argument("--planted-fault", action="append", default=[], help="a config to serve with the planted bug")
cmd.add_argument("--dataset", action="append", choices=PROMPT_SETS, default=None)
cmd.add_argument("--temperature", action="append", type=float, default=None)
cmd.add_argument("--concurrency", action="append", type=int, default=None)
cmd.add_argument("--gpu-memory-utilization", type=float, default=0.6)
cmd.add_argument("--fail-fast", action="store_true")
add_server_options(cmd, start_timeout=600)
cmd = CLI.gpu("together", together, "GPU host: every config's server at once, points interleaved, repeats",
              plan=apply_plan, plan_keys=("configs", "batch1", "sample", "points", "allow_short", "profile",
                                          *serve_servers.PLAN_KEYS),  # decisions, sample_prefix_off, planted
              budget_s=560, check=check_together)
cmd.add_argument("--config", action="append", default=[])
cmd.add_argument("--point", action="append", default=[],
                 help="DATASET:TEMPERATURE:CONCURRENCY:PROMPTS[:REPEATS], run in the order given")
cmd.add_argument("--batch1-config", action="append", default=[], help="a config run at concurrency 1 only")
cmd.add_argument("--sample-config", action="append", default=[], help="a config whose sampling-test samples are taken")
cmd.add_argument("--kv-cache-gib", type=float, default=4.0)
cmd.add_argument("--profile-repeat", action="append", type=int, default=[], help="a repeat whose points time the "
                 "worker's steps (hqlab.bench.serve_profile): phases.parquet; its rows say profiled")
cmd.add_argument("--allow-short", action="store_true", help="run points of fewer than 10 waves (prompts < 10 x "
                 "concurrency; default: refused, since ramp-up and drain dominate them)")
add_server_options(cmd, start_timeout=420)
cmd = CLI.command("finish", finish, "CPU: one run's returned files -> data/results/serve/<tag>/")
cmd.add_argument("returned", help="the folder of one run's returned files")
main = CLI.main

if __name__ == "__main__":
    sys.exit(main())
