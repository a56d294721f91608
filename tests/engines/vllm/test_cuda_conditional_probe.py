"""benchmarks/cuda_conditional_probe.py without a GPU: the kernel that sets a CUDA graph conditional node compiles
with NVRTC and no CUDA headers (the GPU image lacks crt/host_defines.h), into the same cubin as through the device
runtime's header, whose call is a driver syscall (nothing to link). The capture itself needs the GPU host
(docs/vllm-fused-design.md §9)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (a vLLM dependency) is not installed")

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "cuda_conditional_probe.py"


def load_probe():
    spec = importlib.util.spec_from_file_location("cuda_conditional_probe", SCRIPT)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    return probe


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
