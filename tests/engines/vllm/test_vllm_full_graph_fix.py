"""The FULL-graph capture fix (hqlab/engines/vllm/full_graph_fix.py), on the CPU, through vLLM 0.26's own capture path.

vLLM's `InputBatch.make_dummy` (the batch model runner V2 captures a graph on) and `DefaultModelState.prepare_attn`
(`for_capture=True`, as `cudagraph_utils.prepare_inputs_to_capture` calls it) run unchanged, down through vLLM's
`build_attn_metadata` and the base builder's `build_for_cudagraph_capture`; only the attention backend's `build` is a
recorder, which keeps the `CommonAttentionMetadata` FlashAttention's builder would read. Checked:
- with HQLAB_FULL_GRAPH_QUERY_FIX=1 and the plugin registered, a FULL-mode capture reaches the backend with
  max_query_len = num_tokens (the graph's size), also where the dummy is uniform (1 token a request);
- without the patch the same capture carries the dummy's own max (128 for 1,024 tokens at 8 requests), so the
  first check fails when the patch is off or broken;
- decode-only full graphs (FULL_AND_PIECEWISE, FULL_DECODE_ONLY) and steps that are not captures keep vLLM's value;
- without the variable nothing is patched.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="the vllm extra is not installed (make setup installs its CPU-side packages)")

import vllm.v1.worker.gpu.model_states.default as default  # noqa: E402
from vllm.config import CompilationConfig, CUDAGraphMode  # noqa: E402
from vllm.v1.attention.backend import AttentionMetadataBuilder  # noqa: E402
from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers  # noqa: E402
from vllm.v1.worker.gpu.model_states.default import DefaultModelState  # noqa: E402
from vllm.v1.worker.utils import AttentionGroup  # noqa: E402

from hqlab.engines.vllm import full_graph_fix, plugin  # noqa: E402

SEQS, MAX_MODEL_LEN = 8, 4096


class Recorder(AttentionMetadataBuilder):
    """An attention backend's builder that keeps what vLLM hands it."""

    def __init__(self, mode: str) -> None:
        super().__init__(None, ["layer.0"], SimpleNamespace(compilation_config=CompilationConfig(cudagraph_mode=mode)),
                         torch.device("cpu"))
        self.seen: list = []

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        self.seen.append(common_attn_metadata)
        return object()


def capture(mode: str, num_reqs: int, num_tokens: int, *, for_capture: bool = True) -> tuple[int, int]:
    """vLLM's capture of one graph: (the max_query_len and max_seq_len the backend got, the dummy's own max)."""
    recorder = Recorder(mode)
    group = AttentionGroup(backend=None, layer_names=["layer.0"], kv_cache_spec=None, kv_cache_group_id=0,
                           metadata_builders=[recorder])
    batch = InputBatch.make_dummy(num_reqs, num_tokens, InputBuffers(SEQS, 1024, torch.device("cpu")))
    state = SimpleNamespace(max_model_len=MAX_MODEL_LEN, supports_mm_inputs=False, encoder_cache=None)
    kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=["layer.0"])])
    built = DefaultModelState.prepare_attn(
        state, batch, CUDAGraphMode.NONE, (torch.zeros(SEQS, 64, dtype=torch.int32),),
        torch.zeros(1, 1024, dtype=torch.int64), [[group]], kv_cache_config, for_capture=for_capture)
    assert list(built) == ["layer.0"] and len(recorder.seen) == 1
    seen = recorder.seen[0]
    if for_capture:
        assert seen.max_seq_len == MAX_MODEL_LEN  # vLLM's own worst case, untouched
    assert seen.num_actual_tokens == num_tokens
    return seen.max_query_len, int(batch.num_scheduled_tokens.max())


@pytest.fixture
def restore(monkeypatch):
    """vLLM's module as it was, after each test (the patch is process-wide)."""
    monkeypatch.setattr(default, "build_attn_metadata", default.build_attn_metadata)
    return monkeypatch


SHAPES = [(8, 1024), (8, 1021), (6, 6), (8, 8)]  # 128 each; uneven (127 .. 132); 1 each (uniform), at capacity


@pytest.mark.parametrize("num_reqs,num_tokens", SHAPES)
def test_without_the_patch_a_full_capture_keeps_the_dummy_batchs_query_length(restore, num_reqs, num_tokens):
    restore.setattr(default, "build_attn_metadata", getattr(default.build_attn_metadata, "__wrapped__",
                                                            default.build_attn_metadata))  # vLLM's own
    got, dummy = capture("FULL", num_reqs, num_tokens)
    assert got == dummy == num_tokens // num_reqs + num_tokens % num_reqs < num_tokens  # vLLM 0.26's value: the bug


@pytest.mark.parametrize("num_reqs,num_tokens", SHAPES)
def test_with_the_fix_a_full_capture_gets_the_worst_case_query_length(restore, num_reqs, num_tokens):
    restore.setenv(full_graph_fix.ENV_VAR, "1")
    plugin.register()  # what vLLM runs in each of its processes
    assert getattr(default.build_attn_metadata, "_hqlab_patched", False)
    got, dummy = capture("FULL", num_reqs, num_tokens)
    assert got == num_tokens and dummy == num_tokens // num_reqs + num_tokens % num_reqs
    plugin.register()  # idempotent: one wrapper
    assert not getattr(default.build_attn_metadata.__wrapped__, "_hqlab_patched", False)


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"])
def test_decode_only_full_graphs_and_real_steps_keep_vllms_value(restore, mode):
    restore.setenv(full_graph_fix.ENV_VAR, "1")
    assert full_graph_fix.apply()
    assert capture(mode, 8, 32) == (4, 4)  # a uniform decode graph (k = 3): its exact query length
    assert capture("FULL", 8, 1024, for_capture=False) == (128, 128)  # a step's metadata: its real max


def test_without_the_variable_nothing_is_patched(restore):
    restore.delenv(full_graph_fix.ENV_VAR, raising=False)
    original = default.build_attn_metadata
    plugin.register()
    assert not full_graph_fix.apply() and not full_graph_fix.enabled()
    assert default.build_attn_metadata is original
    restore.setenv(full_graph_fix.ENV_VAR, "0")
    assert not full_graph_fix.apply() and default.build_attn_metadata is original


def test_an_engine_asked_for_full_graphs_asks_for_the_fix(restore):
    """`VLLMOptions(cudagraph_mode="FULL")`: the variable for the engine's processes, the patch in this one."""
    from hqlab.engines.vllm import engine

    restore.setenv(full_graph_fix.ENV_VAR, "")  # so that the variable the engine sets goes after the test
    engine._ask_full_graph_fix()
    assert full_graph_fix.enabled() and getattr(default.build_attn_metadata, "_hqlab_patched", False)



def hqlab_config(mode: str):
    """A VllmConfig of hqlab's lookup asking for graph mode `mode`, built as the CPU scheduler's is (the CPU platform
    turns graphs off, after the plugin's checks)."""
    from vllm.config import (CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, SpeculativeConfig,
                             VllmConfig)

    from hqlab import models
    from hqlab.engines.vllm import gpu_lookup

    plugin.register()
    spec = "gpu-lookup:nmin=1,nmax=32,k=7,policy=earliest"
    return VllmConfig(
        model_config=ModelConfig(model=str(models.prepare("qwen2.5-coder-0.5b")), dtype="float32", max_model_len=1024),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_model_len=1024, max_num_batched_tokens=1024,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=16), device_config=DeviceConfig("cpu"),
        speculative_config=SpeculativeConfig(**gpu_lookup.speculative_config(spec)),
        additional_config={gpu_lookup.SPEC_KEY: spec}, compilation_config=CompilationConfig(cudagraph_mode=mode))


def test_full_graphs_for_hqlabs_speculators_are_refused_without_the_fix(restore):
    """A config of hqlab's speculator asking for FULL graphs is refused unless the environment asks for the fix: the
    mistake it prevents (a served line copied without its variable) gives wrong answers and no error."""
    restore.delenv(full_graph_fix.ENV_VAR, raising=False)
    with pytest.raises(ValueError, match=f"needs {full_graph_fix.ENV_VAR}=1"):  # ConfigError, in vLLM's wrapping
        hqlab_config("FULL")
    hqlab_config("FULL_AND_PIECEWISE")  # decode-only full graphs need no fix
    restore.setenv(full_graph_fix.ENV_VAR, "1")
    hqlab_config("FULL")


def test_the_server_log_says_the_plugin_turned_asynchronous_scheduling_on(restore, caplog):
    """vLLM logs "Asynchronous scheduling is disabled" for a custom speculator before the plugin turns it on: the
    plugin's own line goes to vLLM's logger, which a server's log keeps (`hqlab.bench.serve.server_log_facts`)."""
    caplog.set_level("INFO", logger="vllm.hqlab")
    config = hqlab_config("FULL_AND_PIECEWISE")
    assert config.scheduler_config.async_scheduling
    assert [r.getMessage() for r in caplog.records if r.name == "vllm.hqlab"] == [plugin.ASYNC_ON]
