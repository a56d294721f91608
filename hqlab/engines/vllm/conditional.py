"""Run a piece of GPU work only where a device flag says so, inside a CUDA graph: a conditional (IF) node.

Why: a drafting step replays from one CUDA graph, and which of its parts should run (the drafter's pass, a narrow or
a wide catch-up) is known only on the device, from the lookup the same graph just ran. Deciding on the host means
reading the device first (a wait) or deciding from stale copies (the host-proven skip, `gpu_fused`'s `skip`). An IF
node lets the graph decide: a one-thread kernel sets the node's condition from the flag, and the node runs its body
graph only when the condition is set. Measured on the H200 (`benchmarks/cuda_conditional_probe.py`): a replay costs
0.022 ms with a 24-kernel body skipped, 0.146 ms with it taken, 0.137 ms for the same body in a plain graph.

`run_if(flag, body)` is the one entry point. While the current stream captures a CUDA graph it adds the IF node
and captures `body` into it; otherwise it runs `body` when the flag is set, which reads the flag on the host (free
on the CPU, a wait on a GPU: the eager path is for tests and for steps without graphs).

What the capture relies on (torch 2.11 does not expose conditional nodes; `cuda-bindings` does):
`cudaStreamGetCaptureInfo` (the graph torch is capturing into), `cudaGraphConditionalHandleCreate`,
`cudaGraphAddNode` with conditional parameters (its body graph), `cudaStreamBeginCaptureToGraph` on a side stream to
fill the body with torch kernels (their memory from a private pool, `torch._C._cuda_beginAllocateCurrentThreadToPool`),
and `cudaStreamUpdateCaptureDependencies` so that what the main capture records next waits for the node. The main
capture must use `capture_error_mode="thread_local"` (the side capture runs while it is open).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

# The device runtime's one call, declared here instead of through cuda_device_runtime_api.h: that header includes
# crt/host_defines.h, which the GPU image's CUDA wheels lack (the probe's first run failed there). The attribute is
# what the header's __cudart_builtin__ expands to under NVRTC. The call compiles to a driver syscall in the cubin
# (EIATTR_SYSCALL_OFFSETS), no cudadevrt link needed; a test checks the cubin is byte for byte the header's.
SET_IF = r"""
typedef unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __attribute__((cudart_builtin)) void cudaGraphSetConditional(cudaGraphConditionalHandle handle,
                                                                                   unsigned int value);
extern "C" __global__ void set_if(cudaGraphConditionalHandle handle, const int* flag) {
    cudaGraphSetConditional(handle, *flag != 0 ? 1u : 0u);
}
"""

_KERNELS: dict[int, Any] = {}  # device index -> the loaded set_if kernel
_SIDE: dict[int, Any] = {}  # device index -> the stream IF bodies are captured on (`side_stream`)


def ok(result: Any, what: str) -> Any:
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


def set_if_kernel(device: int) -> Any:
    """`set_if_cubin` for this GPU, loaded through the driver API once per device."""
    if device not in _KERNELS:
        from cuda.bindings import driver

        cubin = set_if_cubin(*torch.cuda.get_device_capability(device))
        module = ok(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        _KERNELS[device] = ok(driver.cuModuleGetFunction(module, b"set_if"), "cuModuleGetFunction")
    return _KERNELS[device]


def launch_set_if(kernel: Any, handle: Any, flag: torch.Tensor, stream_ptr: int) -> None:
    import ctypes

    from cuda.bindings import driver

    args = ((int(handle), flag.data_ptr()), (ctypes.c_ulonglong, ctypes.c_void_p))
    ok(driver.cuLaunchKernel(kernel, 1, 1, 1, 1, 1, 1, 0, driver.CUstream(stream_ptr), args, 0), "launch set_if")


def side_stream(device: torch.device) -> Any:
    """The stream IF bodies are captured on, one per device for the process: cuBLAS keeps a workspace per stream,
    made on a stream's first matrix product, so the stream a body is captured on must have run the body's kernels
    before (`run_if(..., always=True)` in a warm-up runs them there), not be new at each capture."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE:
        _SIDE[index] = torch.cuda.Stream(torch.device("cuda", index))
    return _SIDE[index]


def capturing(flag: torch.Tensor) -> bool:
    """True while the current stream of `flag`'s device is capturing a CUDA graph."""
    return flag.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def run_if(flag: torch.Tensor, body: Callable[[], None], *, pool: Any = None, always: bool = False) -> None:
    """`body()` where the one-element int32 device tensor `flag` is nonzero when the step runs.

    While capturing: an IF node whose body graph holds what `body` launches (its memory from `pool`, a graph pool
    handle that must outlive the graph); the node waits for everything captured before it and everything captured
    after it waits for the node. Otherwise: `body()` if the flag is set (a host read), or whatever the flag when
    `always` (warm-ups, which must run every kernel a capture will record, and on a GPU load the kernel that sets the
    condition: a capture cannot load it)."""
    if flag.numel() != 1 or flag.dtype != torch.int32:
        raise ValueError(f"run_if needs a one-element int32 flag (got {flag.dtype}, {flag.numel()} elements)")
    if not capturing(flag):
        if always and flag.device.type == "cuda":  # a warm-up: on the stream the body will be captured on
            # and load the condition-setting kernel now: loading a module while a stream captures is not allowed
            set_if_kernel(flag.device.index if flag.device.index is not None else torch.cuda.current_device())
            current, side = torch.cuda.current_stream(flag.device), side_stream(flag.device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                body()
            current.wait_stream(side)
        elif always or bool(flag.item()):
            body()
        return
    from cuda.bindings import runtime as rt

    if pool is None:
        raise ValueError("run_if inside a CUDA graph capture needs the pool the IF body allocates from")
    device = flag.device.index if flag.device.index is not None else torch.cuda.current_device()
    main = torch.cuda.current_stream(flag.device)
    stream = main.cuda_stream
    _, _, graph, _, _, _ = ok(rt.cudaStreamGetCaptureInfo(stream), "cudaStreamGetCaptureInfo")
    assign_default = int(rt.cudaGraphConditionalHandleFlags.cudaGraphCondAssignDefault)
    handle = ok(rt.cudaGraphConditionalHandleCreate(graph, 0, assign_default), "cudaGraphConditionalHandleCreate")
    launch_set_if(set_if_kernel(device), handle, flag, stream)
    _, _, graph, deps, edges, n = ok(rt.cudaStreamGetCaptureInfo(stream), "cudaStreamGetCaptureInfo")
    params = rt.cudaGraphNodeParams()
    params.type = rt.cudaGraphNodeType.cudaGraphNodeTypeConditional
    params.conditional.handle = handle
    params.conditional.type = rt.cudaGraphConditionalNodeType.cudaGraphCondTypeIf
    params.conditional.size = 1
    node = ok(rt.cudaGraphAddNode(graph, deps, edges, n, params), "cudaGraphAddNode (conditional)")
    body_graph = params.conditional.phGraph_out[0]
    side = side_stream(flag.device)
    ok(rt.cudaStreamBeginCaptureToGraph(side.cuda_stream, body_graph, None, None, 0,
                                        rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal),
       "cudaStreamBeginCaptureToGraph (the IF body)")
    torch._C._cuda_beginAllocateCurrentThreadToPool(device, pool)
    try:
        with torch.cuda.stream(side):
            body()
    finally:
        torch._C._cuda_endAllocateToPool(device, pool)
    ok(rt.cudaStreamEndCapture(side.cuda_stream), "cudaStreamEndCapture (the IF body)")
    replace = int(rt.cudaStreamUpdateCaptureDependenciesFlags.cudaStreamSetCaptureDependencies)
    ok(rt.cudaStreamUpdateCaptureDependencies(stream, [node], None, 1, replace), "cudaStreamUpdateCaptureDependencies")


__all__ = ["run_if", "capturing", "side_stream", "set_if_cubin", "set_if_kernel", "launch_set_if", "SET_IF", "ok"]
