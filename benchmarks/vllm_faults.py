"""The fault-and-feature suite through `vllm serve` (#60): every config of a plan served at once for one setting
(prefix caching on or off; a KV cache of a few blocks, so that vLLM preempts), each case of `hqlab.bench.faults` sent
to every server in turn, one JSON record per (config, case) written as it completes, with the server's processes'
memory before and after.

  GPU (through tools/gpu_host/vllm_host.py run):
      python3 benchmarks/vllm_faults.py run --plan benchmarks/plans/faults_f1.json --setting prefix-on --tag NAME
    writes faults_<tag>.jsonl (the records) and the servers' logs to $OUT.
  CPU (here):
      python benchmarks/vllm_faults.py finish RETURNED_DIR --out data/results/faults_NAME.parquet
    writes one row per (config, setting, case): hqlab.bench.faults.FAULT_COLUMNS.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a bare checkout on the GPU host


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def gpu_mib(pids: list[int]) -> float:
    """GPU memory (MiB) the processes hold, from nvidia-smi; NaN where it cannot say."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return float("nan")
    used = {int(p): float(m) for p, m in (line.split(",") for line in text.splitlines() if line.strip())}
    return sum(used.get(p, 0.0) for p in pids)


def memory(server) -> dict[str, float]:
    from hqlab.bench.faults import process_tree, process_tree_rss

    return {"rss_bytes": float(process_tree_rss(server.proc.pid)), "gpu_mib": gpu_mib(process_tree(server.proc.pid))}


def prompts(plan: dict, client) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """The chat prompts as token ids, prompts filled to the server's limit less 1 to 4 tokens (of the plan's long
    document), and the JSON case's prompt."""
    from hqlab.bench.faults import PERSON_PROMPT

    texts = []
    for path in plan["prompts"]["chat"]:
        texts += [json.loads(line)["prompt"] for line in (ROOT / path).read_text().splitlines() if line.strip()][
            :plan["prompts"]["per_file"]]
    document, limit = client.text_tokens((ROOT / plan["prompts"]["long"]).read_text())
    new = 4  # the long_prompt case's max_tokens (hqlab.bench.faults.case_calls)
    long = [document[i * 97:i * 97 + limit - new - i] for i in range(4)]
    return [client.chat_tokens(t) for t in texts], long, client.chat_tokens(PERSON_PROMPT)


def run(args: argparse.Namespace) -> int:
    import vllm  # noqa: F401  (first: a wheel missing from the carried set fails here)

    from hqlab import models
    from hqlab.bench import faults, serve
    from hqlab.engines.vllm.gpu_fused import fused_config
    from hqlab.engines.vllm.serving import serve_command

    started, plan = time.monotonic(), json.loads(Path(args.plan).read_text())
    setting, srv = plan["settings"][args.setting], plan["server"]
    limits = faults.Limits(**plan["limits"])
    out = Path(os.environ.get("OUT") or Path(tempfile.gettempdir()) / "hqlab-faults" / args.tag)
    out.mkdir(parents=True, exist_ok=True)
    records = out / f"faults_{args.tag}.jsonl"
    model = models.prepare(plan["model"])
    for spec in plan["configs"].values():
        if spec.startswith("gpu-fused"):
            models.prepare(fused_config(spec).model)
    share = 0.9 / len(plan["configs"])
    servers = []
    for n, (name, spec) in enumerate(plan["configs"].items()):
        extra = ["--served-model-name", "target", "--max-model-len", str(srv["max_model_len"]),
                 "--num-gpu-blocks-override", str(srv["kv_blocks"]), "--gpu-memory-utilization", f"{share:.3f}",
                 "--enable-prefix-caching" if setting["prefix_caching"] else "--no-enable-prefix-caching",
                 "--disable-uvicorn-access-log", "--seed", "0"]
        argv = [sys.executable, "-m", "vllm.entrypoints.cli.main"] + serve_command(
            model, spec, max_num_seqs=srv["max_num_seqs"], port=args.port + n, extra=extra)[1:]
        env = {**os.environ, "VLLM_CACHE_ROOT": str(out / f"vllm-cache-{n}")}
        servers.append((name, serve.Server(argv, out / f"faults_{args.tag}_{name}.log", port=args.port + n, env=env,
                                           timeout_s=args.start_timeout)))
    live = []
    try:
        for _, server in servers:
            server.start()
        for name, server in servers:
            try:
                live.append((name, server.wait(), faults.Client(server.port, "target", limits)))
                log(f"{name}: ready in {server.ready_s:.0f} s")
            except Exception as e:  # the other servers still run
                log(f"{name}: FAILED to start: {type(e).__name__}: {str(e)[-1500:]}")
        if not live:
            return 1
        chat, long, person = prompts(plan, live[0][2])
        for case in plan["cases"]:
            calls = faults.case_calls(case, chat, long_prompts=long, json_prompt=person, seed=plan["seed"])
            for name, server, client in live:
                if time.monotonic() - started + limits.case_s + limits.drain_s > args.budget_s:
                    log(f"budget: {case} on {name} and later cases not run")
                    return 0
                before = memory(server)
                result = faults.run_case(client, calls)
                result["state_before"].update(before)
                result["state_after"].update(memory(server))
                record = faults.case_record(name, args.setting, case, calls, result)
                with open(records, "a") as f:
                    f.write(json.dumps(record) + "\n")
                r = faults.row(record, None)
                log(f"{case} on {name}: {r['requests']} requests, {r['errors']} errors, {r['hangs']} hangs, "
                    f"{r['left_on_server']} left on the server, {r['preemptions']:.0f} preemptions, "
                    f"{r['wall_s']:.1f} s")
    finally:
        for _, server in servers:
            server.stop()
    return 0


def finish(args: argparse.Namespace) -> int:
    import polars as pl

    from hqlab.bench.faults import FAULT_COLUMNS, rows

    records = [json.loads(line) for path in sorted(Path(args.returned).glob("faults_*.jsonl"))
               for line in path.read_text().splitlines() if line.strip()]
    table = pl.DataFrame(rows(records), schema_overrides={"preemptions": pl.Float64}).select(FAULT_COLUMNS)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    table.write_parquet(args.out)
    print(table.select("config", "setting", "case", "requests", "errors", "hangs", "greedy_equal", "near_ties",
                       "mismatches", "logprob_max_diff", "sampling_p", "preemptions"))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="GPU host: the plan's servers for one setting, every case", allow_abbrev=False)
    r.add_argument("--plan", required=True)
    r.add_argument("--setting", required=True, help="one of the plan's settings (prefix caching on or off)")
    r.add_argument("--tag", required=True)
    r.add_argument("--port", type=int, default=8421)
    r.add_argument("--start-timeout", type=float, default=420)
    r.add_argument("--budget-s", type=float, default=540, help="start no case after this many seconds, less its limits")
    f = sub.add_parser("finish", help="CPU: the returned records -> one parquet of rows", allow_abbrev=False)
    f.add_argument("returned")
    f.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    return run(args) if args.command == "run" else finish(args)


if __name__ == "__main__":
    sys.exit(main())
