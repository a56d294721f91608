"""GPU timers for the probes that time kernels outside vLLM (experiments/): a CUDA-event timer, a CUDA-graph timer,
the median of a captured graph's replays, and the fused speculator built outside vLLM on vLLM-shaped state (random
token histories, so the lookup finds no match and the drafter's pass runs). torch is imported inside each."""

from __future__ import annotations

from typing import Any, Callable


def cuda_ms(fn: Callable[[], Any], repeats: int = 10) -> float:
    """Mean GPU ms of `fn` over `repeats` calls after one warm-up, between two CUDA events."""
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def graph_ms(fn, repeats: int = 50) -> float:
    """Mean GPU ms of `fn` replayed `repeats` times from its own CUDA graph (captured after one warm-up call)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_ms(graph.replay, repeats)


def median_replay_ms(graph: Any, reps: int) -> float:
    """Median GPU ms of `reps` replays of a captured CUDA graph, each timed by a pair of events."""
    import statistics

    import torch

    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def standalone_speculator(spec_text: str, *, slots: int, width: int) -> tuple[Any, Any]:
    """A `GpuFusedSpeculator` for `spec_text` with the real drafter, bound to random histories of `slots` rows and
    `width` positions and captured in CUDA graphs; returns it and the histories' length tensor (set it per test)."""
    import torch

    from hqlab.engines.vllm.gpu_fused import GpuFusedSpeculator, fused_config

    spec = GpuFusedSpeculator.standalone(fused_config(spec_text), max_num_reqs=slots, max_model_len=width,
                                         pad=151935, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 150000, (slots, width), dtype=torch.int32, device="cuda")
    total = torch.zeros((slots,), dtype=torch.int32, device="cuda")
    spec.bind(ids, total)
    spec.load_drafter()
    spec.use_graphs = True
    spec.capture()
    return spec, total
