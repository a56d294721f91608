"""Starting an interleaved call's vLLM engines at the same time (`run_interleaved(parallel_start=True)` of
`hqlab.bench.vllm_runs`).

Why: each engine takes ~60 s (0.5B) to ~100 s (1.5B) to start on the H200, most of it in its own processes, so an
interleaved call of five engines spent 8 of its 10 minutes starting them one after another. Here the
engines are built at once, one thread each (`start_engines_together`), after what must not run in several threads
at once has run in the calling one (`prepare_parallel_start`), each with an explicit KV cache, and with vLLM's
Prometheus registrations taking turns (`engine.serial_prometheus_logger`, which an engine built with
`started_together` uses). The comment before `PARALLEL_START_KV_BYTES`
says what was checked in vLLM 0.26's sources.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Callable, Sequence

from hqlab.config import ConfigError

if TYPE_CHECKING:
    from hqlab.engines.vllm.engine import EngineSetting, VLLMOptions

# Building vLLM 0.26 engines in threads of one process, as checked in its sources (paths under vllm/): hqlab builds
# one with LLMEngine.from_engine_args (v1/engine/llm_engine.py:161-186; vllm.LLM is not on the path), whose
# LLMEngine.__init__ -> EngineCoreClient.make_client (v1/engine/core_client.py:83-105) -> SyncMPClient ->
# MPClient.__init__ (core_client.py:480-) -> launch_core_engines (v1/engine/utils.py:1072-) -> CoreEngineProcManager
# (utils.py:126-214) starts the engine core in a process of its own. Nothing on that path needs the main thread:
# vLLM calls signal.signal only in its engine core's and workers' own processes (v1/engine/core.py:1320,
# v1/executor/multiproc_executor.py:829), and each engine has its own ZMQ context, sockets, IPC paths (fresh
# uuids) and processes. What the threads do share: prometheus_client's registry (`engine.serial_prometheus_logger`);
# hqlab's plugin, which patches vLLM's classes, and the model cache draft models are converted into (both done
# once in the calling thread first, `prepare_parallel_start`, as are vLLM's first imports: two threads importing
# the same modules for the first time can meet a circular import half done); and fork, which in a process with
# other threads can copy a held lock into the child: engine processes start with spawn.
#
# GPU memory: each worker measures free GPU memory before and after its profile run and takes every change for
# its own (v1/worker/gpu_worker.py:484-545), so engines starting together would size their KV caches from each
# other's allocations; with kv_cache_memory_bytes set it skips that (gpu_worker.py:462-480). What remains is the
# check at start that free memory >= gpu_memory_utilization x total (v1/worker/utils.py:425-445, called at
# gpu_worker.py:388-389): the engines' shares sum to the options' total (<= 0.95), so it holds while no engine
# takes more than its share. With the KV cache below an engine of the 1.5B model takes about 10 GiB (4 GiB of KV,
# 3.4 GiB of weights, 0.5 GiB of activations, up to 1.3 GiB of CUDA graphs, data/results/vllm_fused/fh/run.log,
# plus the CUDA context and a fused drafter's own weights and cache), well under a share of 0.85 / 5 of an H200
# (24 GiB).

# KV cache per engine when engines start together. Ample: 8 requests (max_num_seqs) of 4096 tokens (max_model_len)
# are 32,768 tokens, 0.375 GiB in Qwen2.5 0.5B (12 KiB a token) and 0.875 GiB in 1.5B (28 KiB; on the H200 vLLM
# fit 956,960 tokens in 25.55 GiB); `prepare_parallel_start` checks the model at hand (and a draft model's).
PARALLEL_START_KV_BYTES = 4 << 30


def kv_bytes_per_token(model: str, dtype: str = "bfloat16") -> int:
    """KV-cache bytes one token takes in `model` (a folder with an HF config.json): keys and values of every layer's
    key-value heads in `dtype`; 0 when there is no config to read (a hub id: vLLM checks it when it loads)."""
    from pathlib import Path

    try:
        config = json.loads((Path(model) / "config.json").read_text())
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        kv_heads = int(config.get("num_key_value_heads") or heads)
        layers = int(config["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return 0
    return 2 * layers * kv_heads * head_dim * (4 if dtype in ("float32", "fp32") else 2)


def check_parallel_start_environment() -> None:
    """Engines started together need vLLM's engine cores in processes of their own, started with spawn."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1").strip() == "0":
        raise ConfigError("parallel_start builds engines in threads, which needs vLLM's engine cores in processes "
                          "of their own: unset VLLM_ENABLE_V1_MULTIPROCESSING=0 (or start the engines one at a time)")
    # forking while another thread holds a lock (an import, a logging handler) copies the held lock into the child
    method = os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if method != "spawn":
        raise ConfigError(f"parallel_start starts engine processes from several threads at once, which with "
                          f"VLLM_WORKER_MULTIPROC_METHOD={method} can hang a child on a lock another thread held: set "
                          f"it to spawn or unset it (or start the engines one at a time)")


def prepare_parallel_start(options: VLLMOptions, settings: Sequence[EngineSetting]) -> None:
    """What every engine's construction would otherwise do in its own thread at once, done here first: vLLM's
    imports, hqlab's plugin (it patches vLLM's classes) and the draft models' folders; then checks that the KV cache
    each engine gets holds max_num_seqs requests of max_model_len tokens."""
    # what building an engine imports in this process (the model's transformers modules the caller's tokenizer
    # has usually imported already)
    import vllm.v1.executor.multiproc_executor  # noqa: F401
    from vllm import EngineArgs  # noqa: F401
    from vllm.model_executor.models import ModelRegistry  # noqa: F401
    from vllm.v1.engine.llm_engine import LLMEngine  # noqa: F401
    from vllm.v1.metrics.loggers import PrometheusStatLogger  # noqa: F401

    from hqlab import models

    if any(s.gpu for s in settings):
        from hqlab.engines.vllm import plugin

        plugin.check_vllm_version()
        plugin.register()
    per_token = kv_bytes_per_token(options.model, options.dtype)
    tokens = options.max_num_seqs * options.max_model_len
    for setting in settings:
        drafter = kv_bytes_per_token(models.prepare(setting.draft_model), options.dtype) if setting.draft_model else 0
        need = (per_token + drafter) * tokens  # vLLM keeps a draft model's KV in the same cache
        if need > options.kv_cache_bytes:
            raise ConfigError(f"{setting.label!r}: {options.max_num_seqs} requests of {options.max_model_len} tokens "
                              f"need {need / 2**30:.2f} GiB of KV cache, and engines started together get "
                              f"{options.kv_cache_bytes / 2**30:.2f} GiB each: set kv_cache_bytes to at least {need} "
                              f"(with room in each engine's share of gpu_memory_utilization), or lower max_num_seqs")


def start_engines_together(settings: Sequence[EngineSetting], make: Callable[[EngineSetting], Any]) -> list[Any]:
    """`make(setting)` for every setting at once, each in a thread of its own; the engines in the settings' order.

    If a construction fails, the others are still waited for (none is left starting), every engine that did start
    is closed, and the first failure in the settings' order is raised (failures to close are added to it as
    notes). Interrupted while waiting, it closes the engines already built and re-raises."""
    from concurrent.futures import ThreadPoolExecutor

    futures: list[Any] = []
    try:
        with ThreadPoolExecutor(max_workers=max(1, len(settings)), thread_name_prefix="hqlab-engine-start") as pool:
            for setting in settings:
                futures.append(pool.submit(make, setting))
        # leaving the block waited for every construction
    except BaseException as e:
        _close_built(futures, e)
        raise
    failures = [f.exception() for f in futures if f.exception() is not None]
    if failures:
        _close_built(futures, failures[0])
        raise failures[0]
    return [f.result() for f in futures]


def _close_built(futures: Sequence[Any], error: BaseException) -> None:
    """Closes the engine of every construction that finished without error; a failure to close becomes a note."""
    for future in futures:
        if not future.done() or future.cancelled() or future.exception() is not None:
            continue
        engine = future.result()
        try:
            engine.close()
        except Exception as e:  # the other engines must still be closed, and `error` stays what is raised
            label = getattr(getattr(engine, "setting", None), "label", engine)
            error.add_note(f"closing the engine of {label!r} failed too: {type(e).__name__}: {e}")


__all__ = ["start_engines_together", "kv_bytes_per_token", "PARALLEL_START_KV_BYTES",
           "check_parallel_start_environment", "prepare_parallel_start"]
