"""Does the host prove gpu-fused's drafter skip in time, and what does the host side of a drafting step cost?

Outside vLLM, on the GPU: the real 0.5B drafter, the lookup kernel and the fusion rule (`GpuFusedSpeculator`, CUDA
graphs as in vLLM), driven the way vLLM's asynchronous V2 runner drives it: one request copying a passage of its
prompt (`copy`) or copying it with one token in `edit_every` changed (`edit`), its verification done on the GPU
against the known output (no host read), a stand-in for the target's forward (`--target-ms` of GPU time per step)
and for vLLM's own host work (`--host-ms` of busy host time per step), and the host at most `--ahead` steps ahead of
the GPU (it waits on the event of the step that many steps back, as vLLM's scheduler waits on an older step's output).

Per config (`--configs`, gpu-fused spec suffixes: no skip, skip=2, skip=4) and `ahead`: the share of steps of each
kind (full, catch_up, lookup: what the host chose), the median host time of `step()` and of its parts (the kind
choice, the graph launch, the bookkeeping), GPU ms per step and tokens per step. Run on the GPU host through
tools/gpu_host/vllm_host.py run (it converts the 0.5B):

    python3 experiments/host_proven_skip/fused_skip_host.py [--tag a]

writes $OUT/fused_skip_host_<tag>.json.
`TRITON_INTERPRET=1 python experiments/host_proven_skip/fused_skip_host.py --device cpu --steps 3 --repeats 1`
runs the same code on the CPU (the kernel in Triton's interpreter; no graphs, no stand-ins): a check of the script,
not a measurement. Here (CPU):
`python experiments/host_proven_skip/fused_skip_host.py --fold RETURNED/fused_skip_host_a.json` puts the run in place,
data/results/fused_skip_host/<tag>/ (hqlab.bench.results): the medians over repeats (rows.parquet) and the returned
JSON (raw.json), from which the fusion benchmark notebook draws figures/fused_skip_host_h200.svg.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

BASE = "gpu-fused:k=15,draft_block=1,nmax=32,policy=earliest,compile=true,schedule=long,nmin_tail=1"
CONFIGS = ["", "skip=2,skip_on=head", "skip=4,skip_on=head"]
PAD = 151935
MAX_LEN = 4096


class TimedGraph:
    """A captured graph whose replay's host time is kept."""

    def __init__(self, graph: Any, times: list[float]) -> None:
        self.graph, self.times = graph, times

    def replay(self) -> None:
        t = time.perf_counter()
        self.graph.replay()
        self.times.append(time.perf_counter() - t)


def timed(fn: Any, times: list[float]) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        times.append(time.perf_counter() - t)
        return out
    return wrapper


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def run(spec: Any, prompt: list[int], target: list[int], *, steps: int, target_ms: float, host_ms: float,
        ahead: int, sleep_cycles_per_ms: int) -> dict[str, Any]:
    """One request through `spec` (slot 0): prefill, then `steps` - 1 decode steps (a fixed count, so that the host
    never reads how far the request got: a read would let the GPU drain and every copy of the marks arrive)."""
    import numpy as np
    import torch

    dev = spec.device
    cuda = dev.type == "cuda"
    k = spec.k
    ids, total = spec.state
    plen = len(prompt)
    ids[0, :plen] = torch.tensor(prompt, dtype=torch.int32, device=dev)
    want = torch.tensor(target + [PAD] * (k + 2), dtype=torch.int64, device=dev)
    ids[0, plen] = want[0].to(torch.int32)
    total[0] = plen + 1
    done = torch.ones((), dtype=torch.int64, device=dev)  # tokens emitted so far
    num_sampled = torch.ones(1, dtype=torch.int32, device=dev)
    slots = torch.zeros(1, dtype=torch.int32, device=dev)
    slots_np = np.zeros(1, dtype=np.int32)
    ar = torch.arange(k + 1, device=dev)
    parts: dict[str, list[float]] = {"choose": [], "replay": [], "after": []}
    spec._choose_kind = timed(spec._choose_kind, parts["choose"])  # a fresh speculator per run: wrapped once
    spec._after_step = timed(spec._after_step, parts["after"])
    spec.graphs = {key: TimedGraph(g, parts["replay"]) for key, g in spec.graphs.items()}
    events: list[Any] = []
    step_host: list[float] = []
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    wall = time.perf_counter()
    t_gpu = torch.cuda.Event(enable_timing=True) if cuda else None
    if t_gpu is not None:
        t_gpu.record()
    for step in range(steps):
        if len(events) >= ahead:
            events[-ahead].synchronize()  # the host is at most `ahead` steps ahead of the GPU
        first = step == 0
        t = time.perf_counter()
        out = spec.step(["r"], slots, slots_np, num_sampled, np.array([first]), np.zeros(1, dtype=np.int64),
                        np.array([plen if first else k + 1]), np.array([plen]),
                        np.array([0 if first else min(plen + step * (k + 1), MAX_LEN - k - 2)]))
        step_host.append(time.perf_counter() - t)
        # the target's verify forward, then its acceptance, on the GPU
        if target_ms > 0 and cuda:
            torch.cuda._sleep(int(target_ms * sleep_cycles_per_ms))
        cand = want[(done + ar[:k]).clamp(max=want.numel() - 1)]
        accepted = torch.cumprod((out[0] == cand).long(), 0).sum()
        emitted = accepted + 1
        pos = (done + ar).clamp(max=want.numel() - 1)
        ids[0, (plen + pos).clamp(max=MAX_LEN - 1)] = want[pos].to(torch.int32)  # the fixed output, ahead of time
        done += emitted
        total[0] = (plen + done).clamp(max=MAX_LEN - k - 2).to(torch.int32)
        num_sampled[0] = emitted.to(torch.int32)
        if cuda:
            ev = torch.cuda.Event()
            ev.record()
            events.append(ev)
        if host_ms > 0:
            spin(host_ms / 1000)  # vLLM's own host work of a step
    t_end = torch.cuda.Event(enable_timing=True) if cuda else None
    if t_end is not None:
        t_end.record()
    sync()
    wall = time.perf_counter() - wall
    n = steps
    records = spec.take_records()
    kinds = [r["drafter"] for r in records]
    emitted_total = min(int(done), len(target))
    med = lambda xs: 1e3 * statistics.median(xs) if xs else float("nan")  # noqa: E731
    return {"steps": n, "tokens_per_step": emitted_total / n, "wall_ms_per_step": 1e3 * wall / n,
            "gpu_ms_per_step": t_gpu.elapsed_time(t_end) / n if cuda else float("nan"),
            "share_full": kinds.count("full") / len(kinds), "share_catch_up": kinds.count("catch_up") / len(kinds),
            "share_lookup": kinds.count("lookup") / len(kinds),
            "host_step_ms": med(step_host[1:]), "host_step_ms_p90": 1e3 * float(np.quantile(step_host[1:], 0.9)),
            "host_choose_ms": med(parts["choose"]), "host_replay_ms": med(parts["replay"]),
            "host_after_ms": med(parts["after"])}


def sleep_rate() -> int:
    """torch.cuda._sleep cycles per millisecond of GPU time, measured."""
    import torch

    cycles = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return int(cycles / start.elapsed_time(end))


def workload(kind: str, *, edit_every: int) -> tuple[list[int], list[int]]:
    """(prompt, output): a prompt holding a passage of 1,500 tokens, the output copying 1,200 of them (`copy`),
    with every `edit_every`-th token replaced by one not in the passage (`edit`)."""
    import torch

    g = torch.Generator().manual_seed(7)
    passage = torch.randint(0, 150_000, (1500,), generator=g).tolist()
    prompt = torch.randint(0, 150_000, (300,), generator=g).tolist() + passage
    out = passage[:1200]
    if kind == "edit":
        out = [150_100 + i if i % edit_every == edit_every - 1 else t for i, t in enumerate(out)]
    return prompt, out


def fold(raw: Path, tag: str) -> None:
    """Medians over repeats of a GPU run's rows -> the run `tag` of data/results/fused_skip_host/."""
    import polars as pl

    from hqlab.bench import results

    data = json.loads(raw.read_text())
    rows = pl.DataFrame(data["rows"])
    if rows.is_empty():
        raise SystemExit(f"{raw}: no rows (did the GPU run finish a config?)")
    skip = pl.col("config").str.extract(r"skip=(\d)").fill_null("0")
    table = (rows.with_columns(pl.when(skip == "0").then(pl.lit("no skip")).otherwise("skip=" + skip).alias("skip"),
                               (pl.col("share_lookup") * 100).alias("drafter_free_pct"))
             .group_by("skip", "task", "ahead").agg(pl.len().alias("repeats"), pl.exclude("config", "repeat").median())
             .sort("task", "ahead", "skip")
             .with_columns(pl.lit(data["device"]).alias("device"), pl.lit(data["base"]).alias("base"),
                           pl.lit(data["target_ms"]).alias("target_ms"), pl.lit(data["host_ms"]).alias("host_ms")))
    out = results.write_run("fused_skip_host", tag, card=results.card_of(data["device"]), tables={"rows": table},
                            files={"raw.json": raw},
                            info={"benchmark": "experiments/host_proven_skip/fused_skip_host.py"})
    print(table)
    print(f"wrote {out} (notebooks/fusion_benchmark.py plots it)")


def main() -> None:
    if "--fold" in sys.argv:
        raw = Path(sys.argv[sys.argv.index("--fold") + 1])
        tag = sys.argv[sys.argv.index("--tag") + 1] if "--tag" in sys.argv else raw.stem.rsplit("_", 1)[-1]
        fold(raw, tag)
        return
    import torch

    from hqlab.engines.vllm.gpu_fused import GpuFusedSpeculator, fused_config

    p = argparse.ArgumentParser()
    p.add_argument("--tag", default="a")
    p.add_argument("--configs", default=";".join(CONFIGS), help="';'-separated spec suffixes ('' = no skip)")
    p.add_argument("--target-ms", type=float, default=1.9, help="GPU ms per step standing in for the target")
    p.add_argument("--host-ms", type=float, default=2.3, help="host ms per step standing in for vLLM's own work")
    p.add_argument("--ahead", default="1,2", help="how many steps the host may run ahead of the GPU")
    p.add_argument("--edit-every", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=60, help="steps per request (a copy emits at most 16 a step)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--fold", metavar="JSON", help="(CPU) a GPU run's JSON -> parquet and figure, see above")
    args = p.parse_args()
    cuda = args.device == "cuda"
    out = Path(os.environ.get("OUT", "."))
    rate = sleep_rate() if cuda else 0
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                              "base": BASE, "target_ms": args.target_ms, "host_ms": args.host_ms, "rows": []}
    drafter = None
    configs = args.configs.split(";")
    # the widest catch-up first (a skipping config), so one loaded drafter's cache serves every config
    configs.sort(key=lambda s: "skip" not in s)
    for suffix in configs:
        spec_str = BASE + ("," + suffix if suffix else "")
        config = fused_config(spec_str)
        for ahead in (int(a) for a in args.ahead.split(",")):
            for task in ("copy", "edit"):
                prompt, target = workload(task, edit_every=args.edit_every)
                for rep in range(args.repeats):
                    spec = GpuFusedSpeculator.standalone(config, max_num_reqs=1, max_model_len=MAX_LEN, pad=PAD,
                                                         device=args.device,
                                                         dtype=torch.bfloat16 if cuda else torch.float32,
                                                         record=True)
                    ids = torch.zeros(1, MAX_LEN, dtype=torch.int32, device=args.device)
                    total = torch.zeros(1, dtype=torch.int32, device=args.device)
                    spec.bind(ids, total)
                    if drafter is None:
                        spec.load_drafter()
                        drafter = spec.drafter
                    else:
                        spec.drafter = drafter
                        spec.buckets = [spec.cache_len]
                    spec.use_graphs = True
                    spec.capture()
                    row = {"config": spec_str, "ahead": ahead, "task": task, "repeat": rep,
                           **run(spec, prompt, target, steps=args.steps, target_ms=args.target_ms,
                                 host_ms=args.host_ms, ahead=ahead, sleep_cycles_per_ms=rate)}
                    result["rows"].append(row)
                    print(json.dumps(row), flush=True)
                    (out / f"fused_skip_host_{args.tag}.json").write_text(json.dumps(result, indent=1))
                    del spec
    if cuda:
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
