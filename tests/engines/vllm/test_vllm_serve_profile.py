"""The served step profile's path on the CPU, as far as it runs without a GPU: the benchmark's client
(`hqlab.bench.serve_profile.step_profile`) calls vLLM 0.26's own `/collective_rpc` route (its development router,
served by uvicorn), which reaches hqlab's worker extension and its real step timer on a model runner; the rows come
back through the route, and the benchmark's `finish` turns the returned files into a run with `phases.parquet`.

The model runner here is a stand-in with vLLM's V2 runner's method names, called in the engine core's order
(`execute_model` with a real `SchedulerOutput`, the forward's graph replay inside it; `sample_tokens` with the sampler
and the speculator's `propose` inside it): vLLM's runner needs a GPU. The engine client that forwards the route's call
to the worker is a stand-in too (in a server it crosses to the engine core's process and back).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed (make setup-vllm)")

import polars as pl  # noqa: E402
import uvicorn  # noqa: E402
from fastapi import FastAPI  # noqa: E402
from vllm.entrypoints.serve.dev.rpc.api_router import router  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput  # noqa: E402

from hqlab.bench import runner as bench_runner  # noqa: E402
from hqlab.bench import serve, serve_profile  # noqa: E402
from hqlab.engines.vllm.worker import HqlabWorkerExtension  # noqa: E402


class Graphs:
    def run_fullgraph(self, desc: object) -> None:
        time.sleep(0.002)


class Speculator:
    def propose(self, batch: object) -> None:
        time.sleep(0.0005)


class Runner:
    """vLLM's V2 runner's calls of one decode step, in its order (what the timer wraps)."""

    def __init__(self, speculative: bool) -> None:
        self.cudagraph_manager = Graphs()
        self.speculator = Speculator() if speculative else None

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        time.sleep(0.0003)  # inputs
        self.cudagraph_manager.run_fullgraph(None)

    def sample(self, hidden: object) -> None:
        time.sleep(0.0004)

    def sample_tokens(self, grammar_output: object) -> None:
        self.sample(None)
        if self.speculator is not None:
            self.speculator.propose(None)


class Worker(HqlabWorkerExtension):
    def __init__(self, speculative: bool) -> None:
        self.model_runner = Runner(speculative)


def decode(requests: int) -> SchedulerOutput:
    return SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
                           num_scheduled_tokens={f"r{i}": 16 for i in range(requests)},
                           total_num_scheduled_tokens=16 * requests, scheduled_spec_decode_tokens={},
                           scheduled_encoder_inputs={}, num_common_prefix_blocks=[0], finished_req_ids=set(),
                           free_encoder_mm_hashes=[])


@pytest.fixture
def server():
    """vLLM's development RPC route in a real HTTP server, its engine client calling the worker in this process."""
    state = SimpleNamespace(worker=None)

    class EngineClient:
        async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            return [getattr(state.worker, method)(*args, **(kwargs or {}))]

    app = FastAPI()
    app.include_router(router)
    app.state.engine_client = EngineClient()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    http = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    while not http.started:
        time.sleep(0.01)
    yield state, f"http://127.0.0.1:{port}"
    http.should_exit = True
    thread.join(timeout=10)


def test_the_step_timer_runs_through_vllm_s_rpc_route_and_finish_writes_phases(server, tmp_path):
    state, url = server
    sink: list[dict] = []
    tag, returned = "t1", tmp_path / "returned"
    returned.mkdir()
    for config, speculative in (("none", False), ("gpu-lookup:nmin=1,nmax=32,k=15,batch_k=1:15/4:7/0", True)):
        state.worker = Worker(speculative)
        point = serve.LoadPoint("chat", 0.7, 1, 12)
        with serve_profile.step_profile(url, sink, run=tag, config=config, repeat=0, **point.__dict__):
            for _ in range(6):
                state.worker.model_runner.execute_model(decode(1))
                state.worker.model_runner.sample_tokens(None)
        with serve_profile.step_profile(url, sink, on=False, config=config):  # an unprofiled repeat: no rows
            state.worker.model_runner.execute_model(decode(1))
    assert not hasattr(state.worker, "_hqlab_timer") or state.worker._hqlab_timer is None
    assert {r["phase"] for r in sink} == {"execute_model", "run_fullgraph (cudagraph_manager)", "sample_tokens",
                                          "sample", "propose (speculator)"}
    assert len([r for r in sink if r["phase"] == "execute_model"]) == 12  # six steps a config, the last one's 7th not
    # what the GPU call returns (benchmarks/vllm_serve.py together), then finish's reading of it
    bench_runner.save_table(returned / f"serve_phases_{tag}.parquet", sink)
    row = {c: None for c in serve.SERVE_COLUMNS} | {"run": tag, "config": "none", "machine": "NVIDIA H100 80GB HBM3",
                                                    "repeat": 0, "profiled": True}
    (returned / f"vllm_serve_{tag}.jsonl").write_text(json.dumps(row) + "\n")
    _, tables, _, _ = serve.returned_run(returned)
    assert tables["rows"]["profiled"].to_list() == [True]
    parts = serve_profile.served_parts(tables["phases"])
    host = parts.filter(pl.col("timeline") == "host").group_by("config").agg(pl.col("ms").sum(),
                                                                             pl.col("interval_ms").first())
    for total, interval in zip(host["ms"], host["interval_ms"]):
        assert total == pytest.approx(interval)  # the host's parts add up to the step
    spec = parts.filter(pl.col("config") != "none")
    speculator = spec.filter(pl.col("part") == "speculator (host)")["ms"][0]
    assert speculator >= 0.5 and spec.filter(pl.col("part") == "speculator (host)")["extra_ms"][0] == speculator
    assert spec["steps"][0] == 5  # the last step of a point has no interval
