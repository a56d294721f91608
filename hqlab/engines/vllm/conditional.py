"""Run a piece of GPU work only where a device flag says so, inside a CUDA graph: a conditional (IF) node.

Why: a drafting step replays from one CUDA graph, and which of its parts should run (the drafter's pass, a narrow or
a wide catch-up) is known only on the device, from the lookup the same graph just ran. Deciding on the host means
reading the device first (a wait) or deciding from stale copies (gpu-fused's retired host-proven skip did). An IF
node lets the graph decide: a one-thread kernel sets the node's condition from the flag, and the node runs its body
graph only when the condition is set. Measured on the H200
(`experiments/conditional_graph_node/cuda_conditional_probe.py`): a replay costs 0.022 ms with a 24-kernel body
skipped, 0.146 ms with it taken, 0.137 ms for the same body in a plain graph.

`run_if(flag, body)` runs `body` where the flag is set; `run_while(flag, body)` runs it again and again while the
flag is set, `body` itself updating the flag (a WHILE node). While the current stream captures a CUDA graph they add
the node and capture `body` into it; otherwise they run `body` where the flag says, which reads the flag on the host
(free on the CPU, a wait on a GPU: the eager path is for tests and for steps without graphs). A body may hold
conditional nodes itself (nesting: the drafting step puts its catch-up loop and passes inside one IF node, so a step
without the drafter meets one node).

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
_SIDE: dict[tuple[int, int], Any] = {}  # (device index, nesting depth) -> the stream bodies are captured on
_DEPTH = [0]  # how many conditional bodies the current thread is inside (capturing or warming up)


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


def side_stream(device: torch.device, depth: int = 0) -> Any:
    """The stream bodies at nesting `depth` are captured on, one per device and depth for the process: cuBLAS keeps a
    workspace per stream, made on a stream's first matrix product, so the stream a body is captured on must have run
    the body's kernels before (`run_if(..., always=True)` in a warm-up runs them there), not be new at each capture.
    A nested body needs a stream of its own: its capture is open while its parent's is."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if (index, depth) not in _SIDE:
        _SIDE[index, depth] = torch.cuda.Stream(torch.device("cuda", index))
    return _SIDE[index, depth]


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
    _conditional(flag, body, pool=pool, always=always, loop=False)


def run_while(flag: torch.Tensor, body: Callable[[], None], *, pool: Any = None, always: bool = False) -> None:
    """`body()` again and again while the one-element int32 device tensor `flag` is nonzero; `body` must update
    `flag` (on the device, from what it computed), or the loop never ends.

    While capturing: a WHILE node, which tests the flag before the first run and after each; the flag's new value
    reaches the node through a condition-setting kernel captured at the end of the body. Otherwise: the same loop
    with a host read of the flag before each run; a warm-up (`always`) runs `body` once, whatever the flag."""
    _conditional(flag, body, pool=pool, always=always, loop=True)


def _run_eagerly(flag: torch.Tensor, body: Callable[[], None], *, always: bool, loop: bool) -> None:
    """`run_if` and `run_while` outside a capture: `body` where the flag says (a host read), or once whatever the
    flag in a warm-up (`always`)."""
    if always and flag.device.type == "cuda":  # a warm-up: on the stream the body will be captured on
        # and load the condition-setting kernel now: loading a module while a stream captures is not allowed
        set_if_kernel(flag.device.index if flag.device.index is not None else torch.cuda.current_device())
        current, side = torch.cuda.current_stream(flag.device), side_stream(flag.device, _DEPTH[0])
        side.wait_stream(current)
        with torch.cuda.stream(side), _inside():
            body()
        current.wait_stream(side)
    elif always:
        with _inside():
            body()
    else:
        while bool(flag.item()):
            with _inside():
                body()
            if not loop:
                break


def _conditional(flag: torch.Tensor, body: Callable[[], None], *, pool: Any, always: bool, loop: bool) -> None:
    if flag.numel() != 1 or flag.dtype != torch.int32:
        name = "run_while" if loop else "run_if"
        raise ValueError(f"{name} needs a one-element int32 flag (got {flag.dtype}, {flag.numel()} elements)")
    if not capturing(flag):
        _run_eagerly(flag, body, always=always, loop=loop)
        return
    from cuda.bindings import runtime as rt

    if pool is None:
        raise ValueError("a conditional node inside a CUDA graph capture needs the pool its body allocates from")
    device = flag.device.index if flag.device.index is not None else torch.cuda.current_device()
    main = torch.cuda.current_stream(flag.device)
    stream = main.cuda_stream
    kernel = set_if_kernel(device)
    _, _, graph, _, _, _ = ok(rt.cudaStreamGetCaptureInfo(stream), "cudaStreamGetCaptureInfo")
    assign_default = int(rt.cudaGraphConditionalHandleFlags.cudaGraphCondAssignDefault)
    handle = ok(rt.cudaGraphConditionalHandleCreate(graph, 0, assign_default), "cudaGraphConditionalHandleCreate")
    launch_set_if(kernel, handle, flag, stream)
    _, _, graph, deps, edges, n = ok(rt.cudaStreamGetCaptureInfo(stream), "cudaStreamGetCaptureInfo")
    params = rt.cudaGraphNodeParams()
    params.type = rt.cudaGraphNodeType.cudaGraphNodeTypeConditional
    params.conditional.handle = handle
    kind = rt.cudaGraphConditionalNodeType
    params.conditional.type = kind.cudaGraphCondTypeWhile if loop else kind.cudaGraphCondTypeIf
    params.conditional.size = 1
    node = ok(rt.cudaGraphAddNode(graph, deps, edges, n, params), "cudaGraphAddNode (conditional)")
    body_graph = params.conditional.phGraph_out[0]
    depth = _DEPTH[0]
    side = side_stream(flag.device, depth)
    ok(rt.cudaStreamBeginCaptureToGraph(side.cuda_stream, body_graph, None, None, 0,
                                        rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal),
       "cudaStreamBeginCaptureToGraph (the conditional body)")
    if depth == 0:  # a nested body allocates from the pool its outermost body already routes this thread to
        torch._C._cuda_beginAllocateCurrentThreadToPool(device, pool)
    try:
        with torch.cuda.stream(side), _inside():
            body()
            if loop:  # the loop's next test reads the flag the body just wrote
                launch_set_if(kernel, handle, flag, side.cuda_stream)
    except BaseException:
        rt.cudaStreamEndCapture(side.cuda_stream)  # leave the side stream usable; the step's capture fails anyway
        raise
    finally:
        if depth == 0:
            torch._C._cuda_endAllocateToPool(device, pool)
    ok(rt.cudaStreamEndCapture(side.cuda_stream), "cudaStreamEndCapture (the conditional body)")
    replace = int(rt.cudaStreamUpdateCaptureDependenciesFlags.cudaStreamSetCaptureDependencies)
    ok(rt.cudaStreamUpdateCaptureDependencies(stream, [node], None, 1, replace), "cudaStreamUpdateCaptureDependencies")


class _inside:
    """Counts the conditional bodies the current code runs in (`_DEPTH`), so a nested node picks its own stream."""

    def __enter__(self) -> None:
        _DEPTH[0] += 1

    def __exit__(self, *exc: Any) -> None:
        _DEPTH[0] -= 1


__all__ = ["run_if", "run_while", "capturing", "side_stream", "set_if_cubin", "set_if_kernel", "launch_set_if",
           "SET_IF", "ok"]
