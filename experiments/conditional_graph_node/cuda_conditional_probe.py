"""Can a CUDA graph that torch captures hold a conditional (IF) node whose body torch fills, and what does a skipped
body cost? A probe for the device-decided drafter skip (docs/vllm-internals.md, the device-decided skip); written
before any GPU run of it, so its first run on the GPU host is its test.

On the GPU host (through tools/gpu_host/vllm_host.py run; needs `cuda-bindings`, which the host's image has):

    python3 experiments/conditional_graph_node/cuda_conditional_probe.py [--layers 24]

One graph is captured with torch: a small "lookup" kernel, then a one-thread kernel (compiled with NVRTC) that sets
the IF node's condition from a device flag, then the IF node, whose body holds `--layers` matrix products of the 0.5B
drafter's shape, then a "rule" kernel after it. Replayed with the flag 0 and 1, the probe checks that the body ran
exactly when the flag was set (its output changes only then) and times the graph in both cases against a plain
graph of the same body. Prints one JSON line per check and writes $OUT/cuda_conditional_probe.json.

The IF node is `hqlab.engines.vllm.conditional.run_if`, the one the fused speculator's device-decided skip uses, so
this probe is its GPU test. What it relies on: `cudaStreamGetCaptureInfo` (the graph torch is capturing into),
`cudaGraphConditionalHandleCreate`,
`cudaGraphAddNode` with conditional parameters (its body graph), `cudaStreamBeginCaptureToGraph` on a side stream to
fill the body with torch kernels (their memory from the step graph's private pool,
`torch._C._cuda_beginAllocateCurrentThreadToPool`), and `cudaStreamUpdateCaptureDependencies` to continue the main
capture after the node.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hqlab.engines.vllm import conditional  # noqa: E402 - after the path setup


def capture(layers: int, flag, x, weights, out, pool, body_pool, *, conditional_body: bool):
    """A torch-captured graph: lookup stand-in, (`conditional.run_if(flag, body)` | the body), rule stand-in. The IF
    body's memory comes from `body_pool`, a private pool of its own that lives as long as the process."""
    import torch

    graph = torch.cuda.CUDAGraph()
    main = torch.cuda.Stream()

    def body() -> None:
        h = x
        for w in weights[:layers]:
            h = torch.nn.functional.linear(h, w).relu_()
        out.add_(h.sum())

    torch.cuda.synchronize()  # the inputs were made on the default stream
    with torch.cuda.stream(main):  # warm up the kernels (and cuBLAS's per-stream workspace) outside capture
        body()
        conditional.run_if(flag, body, always=True)  # ... on the stream the IF body is captured on
    torch.cuda.synchronize()
    out.zero_()
    with torch.cuda.graph(graph, pool=pool, stream=main, capture_error_mode="thread_local"):
        x.mul_(1.0)  # the lookup's stand-in
        if conditional_body:
            conditional.run_if(flag, body, pool=body_pool)
        else:
            body()
        out.add_(1.0)  # the rule's stand-in
    return graph


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24, help="matrix products in the body (the 0.5B has 24 layers)")
    args = ap.parse_args(argv)
    import torch

    from hqlab.bench.gpu_timing import median_replay_ms

    if not torch.cuda.is_available():
        raise SystemExit("cuda_conditional_probe needs a CUDA GPU")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(16, 896, device=dev, dtype=torch.bfloat16, generator=g)
    weights = [torch.randn(896, 896, device=dev, dtype=torch.bfloat16, generator=g) * 0.03
               for _ in range(args.layers)]
    out = torch.zeros((), device=dev, dtype=torch.float32)
    flag = torch.zeros(1, device=dev, dtype=torch.int32)
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers}
    try:
        pools = [torch.cuda.graph_pool_handle() for _ in range(3)]  # plain graph, IF graph, IF body
        plain = capture(args.layers, flag, x, weights, out, pools[0], None, conditional_body=False)
        cond = capture(args.layers, flag, x, weights, out, pools[1], pools[2], conditional_body=True)
        runs = {}
        for value in (0, 1, 0, 1):
            flag.fill_(value)
            out.zero_()
            cond.replay()
            torch.cuda.synchronize()
            runs.setdefault(value, []).append(float(out))
        # the rule stand-in adds 1 either way; the body adds its (nonzero) sum only when the flag is set
        report["body_ran_only_when_set"] = all(v == 1.0 for v in runs[0]) and all(v != 1.0 for v in runs[1])
        report["outputs"] = runs
        flag.fill_(0)
        report["ms_conditional_skipped"] = median_replay_ms(cond, 200)
        flag.fill_(1)
        report["ms_conditional_taken"] = median_replay_ms(cond, 200)
        report["ms_plain_graph"] = median_replay_ms(plain, 200)
    except Exception as e:  # noqa: BLE001 - the probe reports whatever stopped it
        report["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(report))
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cuda_conditional_probe.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0 if "error" not in report and report.get("body_ran_only_when_set") else 1


if __name__ == "__main__":
    raise SystemExit(main())
