"""Starting an interleaved call's engines at the same time (`run_interleaved(parallel_start=True)`,
`benchmarks/vllm_gpu.py bench --interleave --parallel-start`), without a GPU: the KV-cache option and the flag's
checks, the concurrent start-up with stand-in engines (real classes that record their thread and can fail; vLLM is
not mocked), and vLLM's own Prometheus logger, whose registrations engines built in threads must serialise."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed (make setup-vllm installs requirements-vllm.txt)")

from hqlab.config import ConfigError, DecodeConfig  # noqa: E402
from hqlab.bench.vllm_runs import run_interleaved  # noqa: E402
from hqlab.engines.vllm import VLLMOptions, engine_args, settings_for  # noqa: E402
from hqlab.engines.vllm.startup import (PARALLEL_START_KV_BYTES, kv_bytes_per_token,  # noqa: E402
                                        start_engines_together)
from hqlab.trace import Generation  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
SPECS = ["lookup:k=7", "vllm-ngram:nmin=2,nmax=5,k=7"]  # + `none`: three engines, none of them a GPU speculator


@pytest.fixture
def spawn(monkeypatch):
    """The start method parallel_start needs, set for this test only (run_interleaved sets it when it is unset)."""
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)


class Recorder:
    """What stand-in engines did, in order: (event, config label, thread name)."""

    def __init__(self, barrier: threading.Barrier | None = None, fail: str = "", fail_close: str = "",
                 fail_together_only: bool = False) -> None:
        self.events: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()
        self.barrier, self.fail, self.fail_close = barrier, fail, fail_close
        self.fail_together_only = fail_together_only  # `fail` fails only when built together with the others

    def log(self, event: str, label: str) -> None:
        with self.lock:
            self.events.append((event, label, threading.current_thread().name))

    def of(self, event: str) -> list[tuple[str, str]]:
        return [(label, thread) for e, label, thread in self.events if e == event]


def stand_in(recorder: Recorder):
    """An engine class in the shape `run_interleaved` uses: built from (options, setting), it waits on the recorder's
    barrier (so it only finishes if every other engine is being built at the same time), can fail, and logs its
    requests and its close."""

    class StandInEngine:
        def __init__(self, options: VLLMOptions, setting, started_together: bool = False) -> None:
            self.options, self.setting, self.started_together = options, setting, started_together
            recorder.log("start", setting.label)
            if recorder.barrier is not None:
                recorder.barrier.wait()
            if setting.label == recorder.fail and (started_together or not recorder.fail_together_only):
                raise RuntimeError(f"{setting.label} failed to start")
            time.sleep(0.05)  # the failing engine's error comes first: the others finish after it
            recorder.log("built", setting.label)

        def describe(self) -> dict:
            return {"config": self.setting.label, "model_runner": "v1", "async_scheduling": False}

        def generate(self, ids, decode=DecodeConfig(), request="0", margins=False) -> Generation:
            recorder.log(f"generate {request}", self.setting.label)
            return Generation(request=request, prompt_len=len(ids), output_ids=[1, 2], finish="length", ttft_s=0.01,
                              total_s=0.02, t_last=0.02, records=[])

        def close(self) -> None:
            recorder.log("close", self.setting.label)
            if self.setting.label == recorder.fail_close:
                raise OSError("engine core already gone")

    return StandInEngine


def test_kv_cache_bytes_is_checked_and_reaches_vllm_only_when_set():
    with pytest.raises(ConfigError, match="kv_cache_bytes must be >= 0"):
        VLLMOptions(model="unused", kv_cache_bytes=-1)
    setting = settings_for(["lookup:k=7"])[1]
    assert engine_args(VLLMOptions(model="unused"), setting).kv_cache_memory_bytes is None  # vLLM profiles, as before
    assert engine_args(VLLMOptions(model="unused", kv_cache_bytes=3 << 30), setting).kv_cache_memory_bytes == 3 << 30


def test_kv_bytes_per_token_from_the_models_config(tmp_path):
    # Qwen2.5-Coder 1.5B: on the H200 vLLM fit 956,960 tokens in 25.55 GiB (data/results/vllm_fused/fh/run.log)
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 28, "num_attention_heads": 12,
                                                      "num_key_value_heads": 2, "hidden_size": 1536}))
    assert kv_bytes_per_token(str(tmp_path)) == 28672
    assert 956_960 * 28672 / 2**30 == pytest.approx(25.55, abs=0.01)
    assert kv_bytes_per_token(str(tmp_path), "float32") == 2 * 28672
    assert kv_bytes_per_token(str(tmp_path / "missing")) == 0  # a hub id: nothing to read, vLLM checks it


def test_parallel_start_flag_needs_interleave(capsys):
    spec = importlib.util.spec_from_file_location("vllm_gpu", ROOT / "benchmarks" / "vllm_gpu.py")
    vllm_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vllm_gpu)
    with pytest.raises(SystemExit) as refused:
        vllm_gpu.main(["bench", "--parallel-start", "--config", "lookup:k=7"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "--parallel-start" in err and "add --interleave" in err


def test_engines_start_together_in_threads_and_come_back_in_the_settings_order():
    settings = settings_for(SPECS)
    recorder = Recorder(threading.Barrier(len(settings), timeout=5))  # passes only if all are being built at once
    Engine = stand_in(recorder)
    engines = start_engines_together(settings, lambda s: Engine(VLLMOptions(model="unused"), s))
    assert [e.setting.label for e in engines] == [s.label for s in settings]
    threads = {thread for _, thread in recorder.of("built")}
    assert len(threads) == len(settings) and threading.current_thread().name not in threads
    # the control: built one after another, the same engines never get past the barrier
    one_by_one = stand_in(Recorder(threading.Barrier(len(settings), timeout=0.2)))
    with pytest.raises(threading.BrokenBarrierError):
        [one_by_one(VLLMOptions(model="unused"), s) for s in settings]


def test_a_failed_start_closes_every_engine_that_started_and_raises_the_failure():
    settings = settings_for(SPECS)
    recorder = Recorder(threading.Barrier(len(settings), timeout=5), fail=settings[1].label)
    Engine = stand_in(recorder)
    with pytest.raises(RuntimeError, match="lookup:k=7 failed to start"):
        start_engines_together(settings, lambda s: Engine(VLLMOptions(model="unused"), s))
    # the others finished after the failure and were closed all the same; the failed one has nothing to close
    assert sorted(label for label, _ in recorder.of("close")) == sorted([settings[0].label, settings[2].label])
    # closing one fails too: the others are still closed, and the start-up failure stays the error, with a note
    recorder = Recorder(threading.Barrier(len(settings), timeout=5), fail=settings[1].label,
                        fail_close=settings[0].label)
    Engine = stand_in(recorder)
    with pytest.raises(RuntimeError, match="failed to start") as raised:
        start_engines_together(settings, lambda s: Engine(VLLMOptions(model="unused"), s))
    assert len(recorder.of("close")) == 2
    assert any("closing the engine of 'none' failed too: OSError" in note for note in raised.value.__notes__)


def test_interleaved_call_starts_engines_together_then_warms_them_up_in_order(spawn):
    settings = settings_for(SPECS)
    prompts = [("p1", "copy", [1, 2, 3]), ("p2", "chat", [4, 5])]
    options = VLLMOptions(model="unused", gpu_memory_utilization=0.6)
    recorder = Recorder(threading.Barrier(len(settings), timeout=5))
    built: list = []

    def make(*args, **kwargs):
        built.append(stand_in(recorder)(*args, **kwargs))
        return built[-1]

    runs, described = run_interleaved(options, settings, prompts, DecodeConfig(max_new_tokens=8),
                                      parallel_start=True, make_engine=make)
    labels = [s.label for s in settings]
    assert [d["config"] for d in described] == labels
    events = [e for e, _, _ in recorder.events]
    assert events.index("generate warmup") > max(i for i, e in enumerate(events) if e == "built")
    main = threading.current_thread().name
    assert recorder.of("generate warmup") == [(label, main) for label in labels]  # one at a time, in order
    assert sorted(label for label, _ in recorder.of("close")) == sorted(labels)
    assert {r.config for r in runs if r.repeat == 0} == set(labels)
    # every engine got its share of the memory and an explicit KV cache (vLLM's profiling is skipped)
    assert all(e.started_together for e in built)
    assert {(e.options.gpu_memory_utilization, e.options.kv_cache_bytes) for e in built} == {
        (0.2, PARALLEL_START_KV_BYTES)}
    built.clear()
    recorder = Recorder(threading.Barrier(len(settings), timeout=5))
    run_interleaved(VLLMOptions(model="unused", kv_cache_bytes=6 << 30), settings, prompts,
                    DecodeConfig(max_new_tokens=8), parallel_start=True, make_engine=make)
    assert {e.options.kv_cache_bytes for e in built} == {6 << 30}  # a size given is kept


def test_interleaved_call_without_parallel_start_builds_and_warms_up_one_engine_at_a_time():
    settings = settings_for(SPECS)
    recorder = Recorder()
    built: list = []

    def make(*args, **kwargs):
        built.append(stand_in(recorder)(*args, **kwargs))
        return built[-1]

    run_interleaved(VLLMOptions(model="unused"), settings, [("p1", "copy", [1, 2, 3])], DecodeConfig(),
                    make_engine=make)
    order = [(e, label) for e, label, _ in recorder.events if e in ("built", "generate warmup")]
    assert order == [(e, s.label) for s in settings for e in ("built", "generate warmup")]
    assert {thread for _, _, thread in recorder.events} == {threading.current_thread().name}
    assert all(not e.started_together and e.options.kv_cache_bytes == 0 for e in built)


def test_an_interleaved_call_whose_engines_fail_to_start_together_starts_them_one_after_another(spawn):
    """A GPU call is minutes of a small budget: when starting together fails, the engines that did start are closed
    and the call starts them one after another, with vLLM sizing their caches as without parallel_start."""
    settings = settings_for(SPECS)
    labels = [s.label for s in settings]
    recorder = Recorder(fail=labels[2], fail_together_only=True)
    built: list = []

    def make(*args, **kwargs):
        built.append(stand_in(recorder)(*args, **kwargs))
        return built[-1]

    with pytest.warns(RuntimeWarning, match="starting the engines together failed .*failed to start.*one after"):
        runs, described = run_interleaved(VLLMOptions(model="unused"), settings, [("p1", "copy", [1, 2, 3])],
                                          DecodeConfig(max_new_tokens=8), parallel_start=True, make_engine=make)
    assert [d["config"] for d in described] == labels
    together = [e for e in built if e.started_together]
    one_by_one = [e for e in built if not e.started_together]
    assert sorted(e.setting.label for e in together) == sorted(labels[:2])
    assert [e.setting.label for e in one_by_one] == labels and all(e.options.kv_cache_bytes == 0 for e in one_by_one)
    # the two started together were closed before the others started; every engine built was closed once
    closes = [label for label, _ in recorder.of("close")]
    assert sorted(closes) == sorted(labels[:2] + labels)
    assert {r.config for r in runs if r.repeat == 0} == set(labels)


def test_a_config_that_cannot_start_fails_the_interleaved_call_and_closes_the_others(spawn):
    settings = settings_for(SPECS)
    labels = [s.label for s in settings]
    recorder = Recorder(fail=labels[2])  # no barrier: the engines also start one after another here
    saved: list = []
    with pytest.warns(RuntimeWarning, match="starting the engines together failed"):
        with pytest.raises(RuntimeError, match="failed to start"):
            run_interleaved(VLLMOptions(model="unused"), settings, [("p1", "copy", [1])], DecodeConfig(),
                            parallel_start=True, make_engine=stand_in(recorder), saved=lambda *a: saved.append(a))
    # together: the first two started and were closed; one after another: they started again, warmed up, and were
    # closed when the third failed again
    assert sorted(label for label, _ in recorder.of("close")) == sorted(labels[:2] * 2)
    assert [label for label, _ in recorder.of("generate warmup")] == labels[:2] and not saved


def test_parallel_start_refuses_what_cannot_work_before_any_engine_starts(monkeypatch, tmp_path):
    settings = settings_for(SPECS)
    recorder = Recorder()
    options = VLLMOptions(model="unused")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    with pytest.raises(ConfigError, match="VLLM_WORKER_MULTIPROC_METHOD=fork can hang"):
        run_interleaved(options, settings, [], DecodeConfig(), parallel_start=True, make_engine=stand_in(recorder))
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with pytest.raises(ConfigError, match="unset VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        run_interleaved(options, settings, [], DecodeConfig(), parallel_start=True, make_engine=stand_in(recorder))
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    # a model whose 8 requests of 4096 tokens do not fit the default KV cache: 80 layers x 8 heads x 128 -> 10 GiB
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 80, "num_attention_heads": 64,
                                                      "num_key_value_heads": 8, "hidden_size": 8192}))
    with pytest.raises(ConfigError, match=r"need 10.00 GiB of KV cache.*set kv_cache_bytes to at least 10737418240"):
        run_interleaved(VLLMOptions(model=str(tmp_path)), settings, [], DecodeConfig(), parallel_start=True,
                        make_engine=stand_in(recorder))
    assert not recorder.events  # nothing was built


# ----------------------------------------------------------------------------------------------------------------
# vLLM's Prometheus logger, built in threads


@pytest.fixture
def vllm_config():
    """A real VllmConfig on the CPU, with the few model fields the Prometheus logger reads standing in (a ModelConfig
    needs a GPU platform); vLLM's metrics are unregistered again afterwards."""
    from vllm.config import DeviceConfig, SchedulerConfig, VllmConfig
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    config = VllmConfig(device_config=DeviceConfig(device="cpu"),
                        scheduler_config=SchedulerConfig(max_num_seqs=8, max_model_len=4096, is_encoder_decoder=False))
    object.__setattr__(config, "model_config", SimpleNamespace(max_model_len=4096, served_model_name="stand-in",
                                                               is_diffusion=False))
    yield config
    unregister_vllm_metrics()


def test_vllms_own_prometheus_logger_fails_when_two_engines_start_together(vllm_config):
    """The order two engines finishing their start in threads can take: vLLM's logger registers a metric twice,
    the serialised one does not."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    from hqlab.engines.vllm.engine import serial_prometheus_logger

    first, second = PrometheusStatLogger(vllm_config), PrometheusStatLogger(vllm_config)
    first.log_engine_initialized()
    with pytest.raises(ValueError, match="Duplicated timeseries.*vllm:cache_config_info"):
        second.log_engine_initialized()
    serial = serial_prometheus_logger()
    first, second = serial(vllm_config), serial(vllm_config)
    first.log_engine_initialized()
    second.log_engine_initialized()
    assert isinstance(first, PrometheusStatLogger)


def test_the_serialised_prometheus_logger_waits_its_turn_and_replaces_vllms_own(vllm_config):
    from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerManager

    from hqlab.engines.vllm import engine

    serial = engine.serial_prometheus_logger()
    done = threading.Event()
    with engine._PROMETHEUS_LOCK:  # another engine is registering its metrics
        builder = threading.Thread(target=lambda: (serial(vllm_config), done.set()))
        builder.start()
        assert not done.wait(0.3)
    assert done.wait(10)
    builder.join()
    manager = StatLoggerManager(vllm_config, custom_stat_loggers=[serial], enable_default_loggers=False)
    assert [type(logger) for logger in manager.stat_loggers] == [serial]  # no second Prometheus logger of vLLM's
    assert isinstance(manager.stat_loggers[0], PrometheusStatLogger)
