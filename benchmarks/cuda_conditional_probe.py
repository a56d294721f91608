"""Can a CUDA graph that torch captures hold a conditional (IF) node whose body torch fills, and what does a skipped
body cost? A probe for the device-decided drafter skip (docs/vllm-fused-design.md §9); written before any GPU run of
it, so its first run on the GPU host is its test.

On the GPU host (through tools/gpu_host/vllm_host.py run; needs `cuda-bindings`, which the host's image has):

    python3 benchmarks/cuda_conditional_probe.py [--layers 24]

One graph is captured with torch: a small "lookup" kernel, then a one-thread kernel (compiled with NVRTC) that sets
the IF node's condition from a device flag, then the IF node, whose body holds `--layers` matrix products of the 0.5B
drafter's shape, then a "rule" kernel after it. Replayed with the flag 0 and 1, the probe checks that the body ran
exactly when the flag was set (its output changes only then) and times the graph in both cases against a plain
graph of the same body. Prints one JSON line per check and writes $OUT/cuda_conditional_probe.json.

What it relies on: `cudaStreamGetCaptureInfo` (the graph torch is capturing into), `cudaGraphConditionalHandleCreate`,
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The device runtime's one call, declared here instead of through cuda_device_runtime_api.h: that header includes
# crt/host_defines.h, which the GPU image's CUDA wheels lack (its first run failed there). The attribute is what the
# header's __cudart_builtin__ expands to under NVRTC. The call compiles to a driver syscall in the cubin
# (EIATTR_SYSCALL_OFFSETS), no cudadevrt link needed; the test checks the cubin is byte for byte the header's.
SET_IF = r"""
typedef unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __attribute__((cudart_builtin)) void cudaGraphSetConditional(cudaGraphConditionalHandle handle,
                                                                                   unsigned int value);
extern "C" __global__ void set_if(cudaGraphConditionalHandle handle, const int* flag) {
    cudaGraphSetConditional(handle, *flag != 0 ? 1u : 0u);
}
"""


def ok(result, what: str):
    """cuda-bindings calls return (error, *values): raise on an error, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err!r}")
    return values[0] if len(values) == 1 else values


def set_if_cubin(major: int, minor: int, *, source: str = SET_IF, include: str | None = None) -> bytes:
    """The condition-setting kernel compiled by NVRTC for sm_<major><minor> (no GPU, no CUDA headers needed)."""
    from cuda.bindings import nvrtc

    prog = ok(nvrtc.nvrtcCreateProgram(source.encode(), b"set_if.cu", 0, [], []), "nvrtcCreateProgram")
    opts = [f"--gpu-architecture=sm_{major}{minor}".encode(), b"-std=c++17"]
    if include:
        opts += [f"-I{include}".encode(), b"-diag-suppress=1105"]  # the header's note that it includes an internal one
    err = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if int(err[0]) != 0:
        size = ok(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"NVRTC could not compile set_if: {log.decode(errors='replace')}")
    size = ok(nvrtc.nvrtcGetCUBINSize(prog), "cubin size")
    cubin = b" " * size
    ok(nvrtc.nvrtcGetCUBIN(prog, cubin), "cubin")
    return cubin


def compile_set_if(device: int):
    """`set_if_cubin` for this GPU, loaded through the driver API."""
    import torch
    from cuda.bindings import driver

    module = ok(driver.cuModuleLoadData(set_if_cubin(*torch.cuda.get_device_capability(device))), "cuModuleLoadData")
    return ok(driver.cuModuleGetFunction(module, b"set_if"), "cuModuleGetFunction")


def launch_set_if(kernel, handle, flag, stream_ptr: int) -> None:
    import ctypes

    from cuda.bindings import driver

    args = ((int(handle), flag.data_ptr()), (ctypes.c_ulonglong, ctypes.c_void_p))
    ok(driver.cuLaunchKernel(kernel, 1, 1, 1, 1, 1, 1, 0, driver.CUstream(stream_ptr), args, 0), "launch set_if")


def capture(layers: int, flag, x, weights, out, kernel, pool, body_pool, *, conditional: bool):
    """A torch-captured graph: lookup stand-in, (set_if + IF node with the body | the body), rule stand-in. The IF
    body's memory comes from `body_pool`, a private pool of its own that lives as long as the process."""
    import torch
    from cuda.bindings import runtime as rt

    graph = torch.cuda.CUDAGraph()
    main = torch.cuda.Stream()
    side = torch.cuda.Stream()

    def body() -> None:
        h = x
        for w in weights[:layers]:
            h = torch.nn.functional.linear(h, w).relu_()
        out.add_(h.sum())

    torch.cuda.synchronize()  # the inputs were made on the default stream
    for stream in (main, side):  # warm up the kernels (and cuBLAS's per-stream workspace) outside capture
        with torch.cuda.stream(stream):
            body()
    torch.cuda.synchronize()
    out.zero_()
    with torch.cuda.graph(graph, pool=pool, stream=main, capture_error_mode="thread_local"):
        x.mul_(1.0)  # the lookup's stand-in
        if not conditional:
            body()
        else:
            stream = main.cuda_stream
            _, _, g, deps, edges, n = ok(rt.cudaStreamGetCaptureInfo(stream), "cudaStreamGetCaptureInfo")
            assign_default = int(rt.cudaGraphConditionalHandleFlags.cudaGraphCondAssignDefault)
            handle = ok(rt.cudaGraphConditionalHandleCreate(g, 0, assign_default), "cudaGraphConditionalHandleCreate")
            launch_set_if(kernel, handle, flag, stream)
            _, _, g, deps, edges, n = ok(rt.cudaStreamGetCaptureInfo(stream), "cudaStreamGetCaptureInfo")
            params = rt.cudaGraphNodeParams()
            params.type = rt.cudaGraphNodeType.cudaGraphNodeTypeConditional
            params.conditional.handle = handle
            params.conditional.type = rt.cudaGraphConditionalNodeType.cudaGraphCondTypeIf
            params.conditional.size = 1
            node = ok(rt.cudaGraphAddNode(g, deps, edges, n, params), "cudaGraphAddNode (conditional)")
            body_graph = params.conditional.phGraph_out[0]
            ok(rt.cudaStreamBeginCaptureToGraph(side.cuda_stream, body_graph, None, None, 0,
                                                rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal),
               "cudaStreamBeginCaptureToGraph (the IF body)")
            torch._C._cuda_beginAllocateCurrentThreadToPool(torch.cuda.current_device(), body_pool)
            try:
                with torch.cuda.stream(side):
                    body()
            finally:
                torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), body_pool)
            ok(rt.cudaStreamEndCapture(side.cuda_stream), "cudaStreamEndCapture (the IF body)")
            replace = int(rt.cudaStreamUpdateCaptureDependenciesFlags.cudaStreamSetCaptureDependencies)
            ok(rt.cudaStreamUpdateCaptureDependencies(stream, [node], None, 1, replace),
               "cudaStreamUpdateCaptureDependencies")
        out.add_(1.0)  # the rule's stand-in
    return graph


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24, help="matrix products in the body (the 0.5B has 24 layers)")
    args = ap.parse_args(argv)
    import torch

    from benchmarks.step_cost_gpu import median_replay_ms

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
        kernel = compile_set_if(torch.cuda.current_device())
        pools = [torch.cuda.graph_pool_handle() for _ in range(3)]  # plain graph, IF graph, IF body
        plain = capture(args.layers, flag, x, weights, out, kernel, pools[0], None, conditional=False)
        cond = capture(args.layers, flag, x, weights, out, kernel, pools[1], pools[2], conditional=True)
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
