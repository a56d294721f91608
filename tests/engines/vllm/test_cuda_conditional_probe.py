"""hqlab.engines.vllm.conditional without a GPU: the kernel that sets a CUDA graph conditional node compiles with
NVRTC and no CUDA headers (the GPU image lacks crt/host_defines.h), into the same cubin as through the device
runtime's header, whose call is a driver syscall (nothing to link); and `run_if` outside a capture runs its body
exactly where the flag is set. The capture itself needs the GPU host
(experiments/conditional_graph_node/cuda_conditional_probe.py, which passed on the H200 with run fi1;
docs/vllm-internals.md, the device-decided skip)."""

from __future__ import annotations

import pytest
import torch

from hqlab.engines.vllm import conditional


def load_probe():
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (a vLLM dependency) is not installed")
    return conditional


def test_run_if_outside_a_capture_runs_the_body_where_the_flag_is_set():
    ran = []
    flag = torch.zeros(1, dtype=torch.int32)
    for value in (0, 1, 0, 2):
        flag.fill_(value)
        conditional.run_if(flag, lambda: ran.append(int(flag)))
    assert ran == [1, 2]
    conditional.run_if(flag.zero_(), lambda: ran.append(-1), always=True)  # a warm-up runs it whatever the flag
    assert ran == [1, 2, -1]
    with pytest.raises(ValueError, match="one-element int32"):
        conditional.run_if(torch.zeros(2, dtype=torch.int32), lambda: None)
    with pytest.raises(ValueError, match="one-element int32"):
        conditional.run_if(torch.zeros(1, dtype=torch.bool), lambda: None)


def test_the_condition_setting_kernel_compiles_for_hopper():
    probe = load_probe()
    try:
        cubin = probe.set_if_cubin(9, 0)
    except Exception as e:  # noqa: BLE001 - only a missing NVRTC library or header skips; a compile error fails
        if "NVRTC could not compile" in str(e):
            raise
        pytest.skip(f"NVRTC is not available here ({type(e).__name__}: {e})")
    assert cubin[:4] == b"\x7fELF"
    assert b"set_if" in cubin
    with pytest.raises(RuntimeError, match="failed"):  # cuda-bindings errors surface with the call's name
        probe.ok((probe_error(),), "a failing call")


def probe_error():
    from cuda.bindings import runtime

    return runtime.cudaError_t.cudaErrorInvalidValue


def test_the_header_free_kernel_is_the_device_runtime_headers_kernel():
    """The probe declares cudaGraphSetConditional itself; where the CUDA headers exist, compiling through them gives
    the same bytes, so the declaration is the header's."""
    probe = load_probe()
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        include = find_nvidia_header_directory("cudart")
        kernel = probe.SET_IF[probe.SET_IF.index('extern "C" __global__'):]  # the probe's kernel, through the header
        with_header = probe.set_if_cubin(9, 0, source="#include <cuda_device_runtime_api.h>\n" + kernel,
                                         include=include)
    except Exception as e:  # noqa: BLE001 - no NVRTC or no headers here: nothing to compare against
        pytest.skip(f"NVRTC or the CUDA runtime headers are not available here ({type(e).__name__}: {e})")
    assert probe.set_if_cubin(9, 0) == with_header


def test_run_while_outside_a_capture_loops_while_its_body_keeps_the_flag_set():
    """The WHILE node's eager twin: the body runs until it clears the flag itself (never, if the flag starts clear),
    a warm-up runs it once, and a nested node's body runs inside its parent's."""
    flag, ran = torch.zeros(1, dtype=torch.int32), []

    def count_down() -> None:
        ran.append(int(flag))
        flag.sub_(1)

    conditional.run_while(flag, count_down)
    assert ran == []
    conditional.run_while(flag.fill_(3), count_down)
    assert ran == [3, 2, 1] and int(flag) == 0
    conditional.run_while(flag, count_down, always=True)
    assert ran == [3, 2, 1, 0]
    outer, inner = torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    conditional.run_if(outer, lambda: conditional.run_while(inner.fill_(2), lambda: ran.append(-int(inner.sub_(1)))))
    assert ran[-2:] == [-1, 0]
    with pytest.raises(ValueError, match="run_while needs a one-element int32"):
        conditional.run_while(torch.zeros(2, dtype=torch.int32), lambda: None)
