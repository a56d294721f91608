"""hqlab through `vllm serve`: throughput and latency under load (vLLM's own `vllm bench serve`), greedy text through
the `openai` package, and the sampling test's samples; one server process per config, results saved after every
load point.

  GPU (through tools/gpu_host/vllm_host.py run, which installs vLLM and the models on an offline host):
      python3 benchmarks/vllm_serve.py bench --tag s1 --commit $(git rev-parse --short HEAD) \\
          --config none --config "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest,batch_k=1:15/8:3/0"
    keeps its files under a work folder that outlives one call (a later call with the same tag adds the configs it
    names; a config already done is skipped) and copies them to $OUT: vllm_serve_<tag>.jsonl (one row per load point,
    hqlab.bench.serve.SERVE_COLUMNS), serve_greedy_<tag>.jsonl (greedy chat texts), serve_samples_<tag>.jsonl (the
    sampling test's token ids), serve_<tag>_<n>.log (each server's log).
  CPU (here):
      python benchmarks/vllm_serve.py finish RETURNED_DIR
    puts the run in place, data/results/serve/<tag>/ (hqlab.bench.results): rows.parquet (the load rows),
    samples.parquet, greedy.parquet, the returned files as they came (raw.jsonl, samples.jsonl, greedy.jsonl, the
    server logs) and the call's log as run.log, with run.json (card, commit, plan, vLLM runner, command, date).

--planted-fault CONFIG starts one more server for CONFIG with the planted verification bug (hqlab.engines.vllm.fault)
and takes only the sampling test's samples from it (the test must fail there).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a bare checkout on the GPU host

TARGET = "qwen2.5-coder-1.5b"
DATASETS = ("chat", "labd", "prose")
PROSE = ROOT / "data" / "workloads" / "prose.jsonl"
# the sampling test's prompt: a list the answer repeats, so the lookup drafts at most steps, and sampling at
# temperature 1 leaves several likely tokens at most positions
SAMPLE_PROMPT = ("Write the sequence 'red, green, blue, yellow' five times on one line, separated by commas, "
                 "then name one more colour.")
GREEDY_PROMPTS = 3  # chat prompts whose greedy text every server returns through the openai package


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def dataset_prompts(name: str, tokenizer) -> list[str]:
    """The user turn of each prompt of a dataset (`vllm bench serve` applies the chat template)."""
    from hqlab.workloads import load_workload

    prompts = load_workload(str(PROSE) if name == "prose" else name, doc_tokens=2000 if name == "labd" else None,
                            tokenizer=tokenizer)
    out = []
    for p in prompts:
        if len(p.messages) != 1 or p.messages[0]["role"] != "user":
            raise ValueError(f"{name}:{p.id}: the load benchmark sends one user turn per request")
        out.append(p.messages[0]["content"])
    return out


def append_jsonl(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def done_configs(path: Path) -> set[str]:
    if not path.exists():
        return set()
    return {json.loads(line)["config"] for line in path.read_text().splitlines() if line.strip()}


def bench(args: argparse.Namespace) -> int:
    import vllm  # noqa: F401  (first: a wheel missing from the carried set fails here)

    from transformers import AutoTokenizer

    from hqlab import models
    from hqlab.bench import serve  # no polars needed: hqlab.bench loads its harness lazily (the GPU host has none)
    from hqlab.engines.vllm.serving import serve_command
    from hqlab.provenance import machine_description, package_version

    work = Path(args.work or Path(tempfile.gettempdir()) / "hqlab-serve" / args.tag)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(os.environ.get("OUT") or work / "out")
    out.mkdir(parents=True, exist_ok=True)
    rows_path = work / f"vllm_serve_{args.tag}.jsonl"
    greedy_path, samples_path = work / f"serve_greedy_{args.tag}.jsonl", work / f"serve_samples_{args.tag}.jsonl"
    model = models.prepare(args.model)
    for spec in args.config:  # the drafter's folder, made once here rather than in a server's worker
        if spec.startswith("gpu-fused"):
            from hqlab.engines.vllm.gpu_fused import fused_config

            models.prepare(fused_config(spec).model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    data = work / "datasets"
    data.mkdir(exist_ok=True)
    for name in args.dataset:
        with open(data / f"{name}.jsonl", "w") as f:
            for text in dataset_prompts(name, tokenizer):
                f.write(json.dumps({"prompt": text}) + "\n")
    chat = dataset_prompts("chat", tokenizer)[:GREEDY_PROMPTS]
    machine, version = machine_description(vllm=True), package_version("vllm")
    points = serve.load_points(args.dataset, args.temperature, args.concurrency)
    servers = [(spec, None) for spec in args.config] + [(spec, "accept_first_draft") for spec in args.planted_fault]
    already = done_configs(rows_path) | done_configs(samples_path)
    for n, (spec, planted) in enumerate(servers):
        label = spec if planted is None else f"{spec} [planted {planted}]"
        if label in already:
            log(f"{label}: done in an earlier call, skipped")
            continue
        argv = [sys.executable, "-m", "vllm.entrypoints.cli.main"] + serve_command(
            model, spec, max_num_seqs=args.max_num_seqs, port=args.port, planted_fault=planted,
            extra=["--served-model-name", "target", "--max-model-len", str(args.max_model_len),
                   "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--disable-uvicorn-access-log",
                   "--seed", "0"])[1:]
        log(f"{label}: starting `{' '.join(argv[3:6])} ...`")
        server_log = work / f"serve_{args.tag}_{len(already) + n}.log"
        try:
            with serve.Server(argv, server_log, port=args.port, timeout_s=args.start_timeout) as server:
                log(f"{label}: ready in {server.ready_s:.0f} s")
                eager = warn_if_eager(label, server_log, args.allow_eager)
                if planted is None:
                    texts = serve.chat_texts(server.base_url, "target", chat, max_tokens=args.greedy_tokens)
                    append_jsonl(greedy_path, {"run": args.tag, "config": label, "texts": texts})
                t0 = time.perf_counter()
                samples = serve.sample_token_ids(server.base_url, "target", SAMPLE_PROMPT, samples=args.samples,
                                                 max_tokens=args.sample_tokens, temperature=1.0,
                                                 concurrency=args.sample_concurrency)
                append_jsonl(samples_path, {"run": args.tag, "config": label, "temperature": 1.0,
                                            "concurrency": args.sample_concurrency, "prompt": SAMPLE_PROMPT,
                                            "token_ids": samples})
                log(f"{label}: {len(samples)} samples in {time.perf_counter() - t0:.0f} s")
                if planted is not None or (eager and not args.allow_eager):
                    continue
                for point in points:
                    name = f"{point.dataset}_t{point.temperature:g}_c{point.max_concurrency}"
                    bench_args = serve.bench_args(server.base_url, "target", model, data / f"{point.dataset}.jsonl",
                                                  point, output_len=args.output_len, result_dir=work / "bench",
                                                  result_file=f"{n}_{name}.json")
                    (work / "bench").mkdir(exist_ok=True)
                    result = serve.run_load(bench_args)
                    row = serve.load_row(result, run=args.tag, config=spec, point=point, model=args.model,
                                         machine=machine, vllm_version=version, git_commit=args.commit)
                    append_jsonl(rows_path, row)
                    shutil.copy(rows_path, out / rows_path.name)  # what a call cut at its limit still returns
                    log(f"{label} {name}: {row['output_throughput']:.0f} tok/s, TPOT p50 "
                        f"{row['median_tpot_ms']:.2f} ms, TTFT p50 {row['median_ttft_ms']:.0f} ms, "
                        f"acceptance length {row['acceptance_length']:.2f}")
        except Exception as e:  # the next config still runs; what was saved stays
            log(f"{label}: FAILED {type(e).__name__}: {e}")
            if args.fail_fast:
                break
        finally:
            for f in [rows_path, greedy_path, samples_path, server_log]:
                if f.exists():
                    shutil.copy(f, out / f.name)
    return 0


def parse_point(text: str) -> tuple["object", int]:
    """`prose:0.7:1:12:3` -> (LoadPoint(prose, T 0.7, 1 in flight, 12 prompts), 3 repeats); the repeats default to 1."""
    from hqlab.bench.serve import LoadPoint

    parts = text.split(":")
    if len(parts) not in (4, 5):
        raise SystemExit(f"--point {text!r}: write DATASET:TEMPERATURE:CONCURRENCY:PROMPTS[:REPEATS]")
    if parts[0] not in DATASETS:
        raise SystemExit(f"--point {text!r}: dataset must be one of {', '.join(DATASETS)}")
    return LoadPoint(parts[0], float(parts[1]), int(parts[2]), int(parts[3])), int(parts[4]) if len(parts) == 5 else 1


def together(args: argparse.Namespace) -> int:
    """Every config's server started at once (each its own port, KV cache and compile cache), then the load points
    run server after server, repeat after repeat: the configs of a point are measured minutes apart, not a config's
    whole run apart, so a drift of the host's speed touches them alike, and the servers' start-up is paid once."""
    import vllm  # noqa: F401

    from transformers import AutoTokenizer

    from hqlab import models
    from hqlab.bench import serve
    from hqlab.engines.vllm.serving import serve_command
    from hqlab.provenance import machine_description, package_version

    started = time.monotonic()
    if args.plan:  # a committed plan: configs by name, which run at batch 1 only, which are sampled, the points
        plan = json.loads(Path(args.plan).read_text())
        named = plan["configs"]
        args.config += list(named.values())
        args.batch1_config += [named[n] for n in plan.get("batch1", [])]
        args.sample_config += [named[n] for n in plan.get("sample", [])]
        args.point += plan["points"]
        args.allow_short = args.allow_short or bool(plan.get("allow_short"))  # plans written before the rule
    if not args.config or not args.point:
        raise SystemExit("name the configs and points (--config/--point or --plan)")
    work = Path(args.work or Path(tempfile.gettempdir()) / "hqlab-serve" / args.tag)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(os.environ.get("OUT") or work / "out")
    out.mkdir(parents=True, exist_ok=True)
    rows_path = work / f"vllm_serve_{args.tag}.jsonl"
    greedy_path, samples_path = work / f"serve_greedy_{args.tag}.jsonl", work / f"serve_samples_{args.tag}.jsonl"
    model = models.prepare(args.model)
    for spec in args.config:
        if spec.startswith("gpu-fused"):
            from hqlab.engines.vllm.gpu_fused import fused_config

            models.prepare(fused_config(spec).model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    data = work / "datasets"
    data.mkdir(exist_ok=True)
    points = [parse_point(p) for p in args.point]
    if not args.allow_short:  # refused before any server starts: a short point's ratio is ramp-up and drain
        for point, _ in points:
            point.require_waves()
    for name in sorted({p.dataset for p, _ in points}):
        with open(data / f"{name}.jsonl", "w") as f:
            for text in dataset_prompts(name, tokenizer):
                f.write(json.dumps({"prompt": text}) + "\n")
    chat = dataset_prompts("chat", tokenizer)[:GREEDY_PROMPTS]
    machine, version = machine_description(vllm=True), package_version("vllm")
    share = min(0.9 / len(args.config), 0.9)
    servers = []
    for n, spec in enumerate(args.config):
        argv = [sys.executable, "-m", "vllm.entrypoints.cli.main"] + serve_command(
            model, spec, max_num_seqs=args.max_num_seqs, port=args.port + n,
            extra=["--served-model-name", "target", "--max-model-len", str(args.max_model_len),
                   "--gpu-memory-utilization", f"{share:.3f}", "--kv-cache-memory-bytes",
                   str(int(args.kv_cache_gib * (1 << 30))), "--disable-uvicorn-access-log", "--seed", "0"])[1:]
        env = {**os.environ, "VLLM_CACHE_ROOT": str(work / f"vllm-cache-{n}")}  # no two compiles share a file
        servers.append((spec, serve.Server(argv, work / f"serve_{args.tag}_{n}.log", port=args.port + n, env=env,
                                           timeout_s=args.start_timeout)))
    live, eager = [], set()  # eager: servers whose drafting runs outside CUDA graphs (no load points)
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

        def save() -> None:
            save_together(out, [rows_path, greedy_path, samples_path], [srv.log_path for _, srv in servers],
                          args.tag)

        for spec, server in live:
            greedy = serve.greedy_tokens(server.base_url, "target", chat, max_tokens=args.greedy_tokens)
            append_jsonl(greedy_path, {"run": args.tag, "config": spec, "texts": [g["text"] for g in greedy],
                                       "token_ids": [g["token_ids"] for g in greedy],
                                       "margins": [g["margins"] for g in greedy]})
        save()
        for spec, server in live:
            if spec not in args.sample_config:
                continue
            t0 = time.perf_counter()
            samples = serve.sample_token_ids(server.base_url, "target", SAMPLE_PROMPT, samples=args.samples,
                                             max_tokens=args.sample_tokens, temperature=1.0,
                                             concurrency=args.sample_concurrency)
            append_jsonl(samples_path, {"run": args.tag, "config": spec, "temperature": 1.0,
                                        "concurrency": args.sample_concurrency, "prompt": SAMPLE_PROMPT,
                                        "token_ids": samples})
            log(f"{spec}: {len(samples)} samples in {time.perf_counter() - t0:.0f} s")
        save()
        (work / "bench").mkdir(exist_ok=True)
        for point, repeats in points:
            name = f"{point.dataset}_t{point.temperature:g}_c{point.max_concurrency}"
            for repeat in range(repeats):
                for n, (spec, server) in enumerate(live):
                    if (point.max_concurrency > 1 and spec in args.batch1_config) or spec in eager:
                        continue
                    if time.monotonic() - started > args.budget_s:
                        log(f"budget of {args.budget_s:.0f} s spent: {name} repeat {repeat} and later not run")
                        save()
                        return 0
                    bench_args = serve.bench_args(server.base_url, "target", model, data / f"{point.dataset}.jsonl",
                                                  point, output_len=args.output_len, result_dir=work / "bench",
                                                  result_file=f"{n}_{name}_r{repeat}.json")
                    result = serve.run_load(bench_args)
                    row = serve.load_row(result, run=args.tag, config=spec, point=point, model=args.model,
                                         machine=machine, vllm_version=version, git_commit=args.commit)
                    row["repeat"] = repeat
                    append_jsonl(rows_path, row)
                    shutil.copy(rows_path, out / rows_path.name)
                    log(f"{short(spec)} {name} r{repeat}: {row['output_throughput']:.0f} tok/s, TPOT p50 "
                        f"{row['median_tpot_ms']:.2f} ms, TTFT p50 {row['median_ttft_ms']:.0f} ms, "
                        f"acceptance length {row['acceptance_length']:.2f}")
        save()
    finally:
        for _, server in servers:
            server.stop()
        save_together(out, [rows_path, greedy_path, samples_path], [srv.log_path for _, srv in servers], args.tag)
    return 0


def save_together(out: Path, results: list[Path], server_logs: list[Path], tag: str) -> None:
    """The results as they are, the server logs in one archive: a GPU host call returns at most eight files."""
    import tarfile

    for f in results:
        if f.exists():
            shutil.copy(f, out / f.name)
    logs = [f for f in server_logs if f.exists()]
    if logs:
        tmp = out / f".serve_{tag}_logs.tar.gz"
        with tarfile.open(tmp, "w:gz") as tar:
            for f in logs:
                tar.add(f, arcname=f.name)
        tmp.replace(out / f"serve_{tag}_logs.tar.gz")


def server_logs(src: Path) -> list[tuple[str, str]]:
    """(name, text) of every server log returned: loose files and the members of serve_*_logs.tar.gz archives."""
    import tarfile

    logs = [(f.name, f.read_text(errors="replace")) for f in sorted(src.glob("serve_*_[0-9]*.log"))]
    for archive in sorted(src.glob("serve_*_logs.tar.gz")):
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.endswith(".log"):
                    logs.append((member.name, tar.extractfile(member).read().decode(errors="replace")))
    return logs


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
    import polars as pl

    from hqlab.bench import results
    from hqlab.bench.serve import SERVE_COLUMNS, STEADY_COLUMNS, server_log_facts

    src = Path(args.returned)
    raws = sorted(src.glob("vllm_serve_*.jsonl"))
    tags = sorted({f.name.removeprefix("vllm_serve_").removesuffix(".jsonl") for f in raws})
    if not tags:
        raise SystemExit(f"no vllm_serve_*.jsonl rows under {src}")
    if len(tags) > 1:
        raise SystemExit(f"{src} holds the rows of {len(tags)} runs ({', '.join(tags)}): finish each run from a "
                         "folder of its own files")
    tag = tags[0]
    rows = [json.loads(line) for line in raws[0].read_text().splitlines() if line.strip()]
    frame = pl.DataFrame(rows)
    frame = frame.select(SERVE_COLUMNS + [c for c in ["repeat", *STEADY_COLUMNS] if c in frame.columns])
    # the model runner each server used, as its own log says (a served config's log names its spec)
    runners, eager = {}, {}
    for name, text in server_logs(src):
        facts = server_log_facts(text)
        if not facts["planted"]:
            runners[facts["config"]] = facts["vllm_runner"]
            eager[facts["config"]] = facts["drafting_eager"]
            if facts["drafting_eager"]:
                print(f"WARNING {name}: {facts['config']}'s drafting step ran eagerly (its CUDA graph capture "
                      f"failed): its speed is not the config's", file=sys.stderr)
    frame = frame.with_columns(pl.col("config").replace_strict(runners, default=None, return_dtype=pl.String)
                               .alias("vllm_runner"),
                               pl.col("config").replace_strict(eager, default=None, return_dtype=pl.Boolean)
                               .alias("drafting_eager"))
    tables = {"rows": frame}
    files: dict[str, Path] = {"raw.jsonl": raws[0]}
    for kind in ("samples", "greedy"):
        raw = src / f"serve_{kind}_{tag}.jsonl"
        if raw.exists():
            tables[kind] = pl.DataFrame([json.loads(line) for line in raw.read_text().splitlines() if line.strip()])
            files[f"{kind}.jsonl"] = raw
    if (src / f"serve_{tag}_logs.tar.gz").exists():
        files["server_logs.tar.gz"] = src / f"serve_{tag}_logs.tar.gz"
    for server_log in sorted(src.glob(f"serve_{tag}_[0-9]*.log")):
        files[f"server_{server_log.stem.rsplit('_', 1)[1]}.log"] = server_log
    host_logs = [f for f in sorted(src.glob("*.log")) + sorted(src.glob("*.log.gz"))
                 if not f.name.startswith(f"serve_{tag}_")]
    logs, info = results.run_logs(host_logs, "benchmarks/vllm_serve.py")
    cards = {results.card_of(m) for m in frame["machine"].unique()}
    if len(cards) != 1:
        raise SystemExit(f"run {tag}'s rows name {len(cards)} cards ({sorted(cards)}): one run is one machine")
    plan = ROOT / "benchmarks" / "plans" / f"serve_{tag}.json"
    info |= {"commit": frame["git_commit"][0], "benchmark": "benchmarks/vllm_serve.py",
             "plan": str(plan.relative_to(ROOT)) if plan.exists() else None,
             "vllm_runner": sorted({str(r).upper() for r in frame["vllm_runner"].drop_nulls()}) or None}
    folder = results.write_run("serve", tag, card=cards.pop(), tables=tables, files=files | logs, info=info,
                               root=args.results)
    print(f"{len(rows)} load rows of run {tag} -> {folder}")
    return 0


def main(argv: list[str] | None = None) -> int:
    # no abbreviations: a GPU call is minutes of device time, and `--out` silently meaning `--output-len` cost one
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="GPU host: one vllm serve per config, loads, greedy texts, samples",
                       allow_abbrev=False)
    b.add_argument("--tag", required=True)
    b.add_argument("--commit", default="unknown", help="the code's commit (the host's copy has no git history)")
    b.add_argument("--model", default=TARGET)
    b.add_argument("--config", action="append", default=[],
                   help="a served config (none, gpu-lookup:..., gpu-fused:...)")
    b.add_argument("--planted-fault", action="append", default=[], help="a config to serve with the planted bug")
    b.add_argument("--dataset", action="append", choices=DATASETS, default=None)
    b.add_argument("--temperature", action="append", type=float, default=None)
    b.add_argument("--concurrency", action="append", type=int, default=None)
    b.add_argument("--output-len", type=int, default=256)
    b.add_argument("--samples", type=int, default=600)
    b.add_argument("--sample-tokens", type=int, default=24)
    b.add_argument("--sample-concurrency", type=int, default=4,
                   help="requests in flight while sampling: keep it where batch_k still speculates")
    b.add_argument("--greedy-tokens", type=int, default=128)
    b.add_argument("--max-num-seqs", type=int, default=32)
    b.add_argument("--max-model-len", type=int, default=4096)
    b.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    b.add_argument("--port", type=int, default=8321)
    b.add_argument("--start-timeout", type=float, default=600)
    b.add_argument("--work", default=None)
    b.add_argument("--fail-fast", action="store_true")
    b.add_argument("--allow-eager", action="store_true", help="measure a server whose drafting step failed to "
                   "capture in CUDA graphs (default: its load points are skipped)")
    t = sub.add_parser("together", help="GPU host: every config's server at once, points interleaved, repeats",
                       allow_abbrev=False)
    t.add_argument("--tag", required=True)
    t.add_argument("--commit", default="unknown")
    t.add_argument("--model", default=TARGET)
    t.add_argument("--plan", default=None, help="a JSON plan: {configs: {name: spec}, batch1: [name], sample: [name], "
                   "points: [point]}")
    t.add_argument("--config", action="append", default=[])
    t.add_argument("--point", action="append", default=[],
                   help="DATASET:TEMPERATURE:CONCURRENCY:PROMPTS[:REPEATS], run in the order given")
    t.add_argument("--batch1-config", action="append", default=[], help="a config run at concurrency 1 only")
    t.add_argument("--sample-config", action="append", default=[], help="a config whose sampling-test samples "
                   "are taken")
    t.add_argument("--output-len", type=int, default=256)
    t.add_argument("--samples", type=int, default=600)
    t.add_argument("--sample-tokens", type=int, default=24)
    t.add_argument("--sample-concurrency", type=int, default=4)
    t.add_argument("--greedy-tokens", type=int, default=128)
    t.add_argument("--max-num-seqs", type=int, default=32)
    t.add_argument("--max-model-len", type=int, default=4096)
    t.add_argument("--kv-cache-gib", type=float, default=4.0)
    t.add_argument("--port", type=int, default=8321)
    t.add_argument("--start-timeout", type=float, default=420)
    t.add_argument("--budget-s", type=float, default=560, help="start no load point after this many seconds")
    t.add_argument("--allow-eager", action="store_true", help="measure a server whose drafting step failed to "
                   "capture in CUDA graphs (default: its load points are skipped)")
    t.add_argument("--allow-short", action="store_true", help="run points of fewer than 10 waves (prompts < 10 x "
                   "concurrency; default: refused, since ramp-up and drain dominate them)")
    t.add_argument("--work", default=None)
    f = sub.add_parser("finish", help="CPU: one run's returned files -> data/results/serve/<tag>/", allow_abbrev=False)
    f.add_argument("returned", help="the folder of one run's returned files")
    f.add_argument("--results", default=None, help="the results folder (default data/results)")
    args = p.parse_args(argv)
    if args.cmd == "bench":
        args.dataset = args.dataset or list(DATASETS)
        args.temperature = args.temperature or [0.0, 0.7]
        args.concurrency = args.concurrency or [1, 32]
        if not args.config and not args.planted_fault:
            p.error("name at least one --config or --planted-fault")
        return bench(args)
    if args.cmd == "together":
        return together(args)
    return finish(args)


if __name__ == "__main__":
    sys.exit(main())
