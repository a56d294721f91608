"""Why does the same vLLM step cost 2.3 ms on one request and 3.5 ms on the next? A probe of the host threads.

At batch 1 the 0.5B's decode step is host-bound, and its cost is bimodal per request: the profiled worker phases
all slow by the same factor, as a thread does when a busy sibling shares its core. This probe runs the suite on one
engine per config, samples which threads of the front end and the engine core are busy and on which CPUs they ran
(`affinity.ThreadSampler`, beside this file), then pins the busy threads to cores of their own
(`affinity.pin_busy`) and runs the suite again on the same engine. Its answer on the lent H200 (pinning leaves both
speeds; the CPU itself has two) is in docs/vllm.md, "The host has two speeds".

  GPU (through tools/gpu_host/vllm_host.py run):
      python3 experiments/host_two_speeds/vllm_host_threads.py --tag a --passes 2 --config none \\
          --config gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest
    writes $OUT/host_threads_<tag>.parquet (one row per request: config, variant free|pinned, pass, prompt, median
    step ms, decode tok/s, the busy threads and their CPUs) and $OUT/host_threads_<tag>.json (topology, plans).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # affinity.py


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tag", default="a")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--suite", default="all")
    ap.add_argument("--config", action="append", default=None)
    ap.add_argument("--passes", type=int, default=2, help="passes over the suite per variant")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--min-share", type=float, default=0.25, help="a thread using this much of a CPU is busy")
    args = ap.parse_args(argv)

    import vllm  # noqa: F401

    from hqlab import models
    from hqlab.config import DecodeConfig
    from hqlab.engines import vllm as hv
    import affinity
    from hqlab.workloads import load_workload

    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    topo = {"cores": [list(c) for c in affinity.cores()], "cpus": sorted(os.sched_getaffinity(0))}
    try:
        topo["lscpu"] = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as e:
        topo["lscpu"] = f"unavailable: {e}"
    log(f"{len(topo['cpus'])} CPUs in {len(topo['cores'])} cores: {topo['cores']}")
    print(topo["lscpu"], flush=True)
    folder = models.prepare(args.model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    encoded = hv.encode_prompts(tokenizer, load_workload(args.suite, doc_tokens=2000, tokenizer=tokenizer))
    options = hv.VLLMOptions(model=folder, max_num_seqs=8)
    decode = DecodeConfig(max_new_tokens=args.max_new_tokens)
    rows: list[dict] = []
    plans: dict[str, object] = {}

    def save() -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = out / f"host_threads_{args.tag}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), str(path) + ".tmp")
        os.replace(str(path) + ".tmp", path)
        (out / f"host_threads_{args.tag}.json").write_text(json.dumps({"topology": topo, "plans": plans}) + "\n")

    for setting in hv.settings_for(args.config or ["gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest"]):
        engine = hv.VLLMEngine(options, setting)
        try:
            engine.generate(encoded[0][2], decode=DecodeConfig(max_new_tokens=32), request="warmup")
            pids = [os.getpid(), *affinity.children(os.getpid())]
            for variant in ("free", "pinned"):
                with affinity.ThreadSampler(pids) as whole:
                    for p in range(args.passes):
                        for pid, category, ids in encoded:
                            with affinity.ThreadSampler(pids) as s:
                                g = engine.generate(ids, decode=decode, request=pid)
                            steps = [r.step_s * 1000 for r in g.records]
                            busy = s.busy(args.min_share)
                            rows.append({
                                "config": setting.label, "variant": variant, "pass": p, "prompt_id": pid,
                                "category": category, "steps": len(steps),
                                "step_ms": statistics.median(steps) if steps else None,
                                "decode_tok_s": g.decode_tok_s(), "tokens_per_step": g.tokens_per_step(),
                                "busy": json.dumps([{"thread": f"{u.thread.pid}/{u.thread.name}",
                                                     "share": round(u.share(s.wall_s), 2),
                                                     "cpus": dict(sorted(u.cpus.items(), key=lambda kv: -kv[1])[:3])}
                                                    for u in busy])})
                            log(f"{setting.label} {variant} {p} {pid}: {rows[-1]['step_ms']:.2f} ms/step, "
                                + ", ".join(f"{u.thread.name}@{max(u.cpus, key=u.cpus.get)}" for u in busy))
                save()
                if variant == "free":
                    plans[setting.label] = affinity.pin_busy(pids, whole, min_share=args.min_share)
                    log(f"pinned: {plans[setting.label]}")
                    save()
            for variant in ("free", "pinned"):
                ms = [r["step_ms"] for r in rows if r["config"] == setting.label and r["variant"] == variant]
                log(f"{setting.label} {variant}: median step {statistics.median(ms):.2f} ms, "
                    f"spread {min(ms):.2f}-{max(ms):.2f}")
        finally:
            engine.close()
            affinity.unpin()  # the next engine's processes start from this thread and would inherit its one CPU
    return 0


if __name__ == "__main__":
    sys.exit(main())
