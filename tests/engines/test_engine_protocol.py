"""Both engines implement one `Engine` protocol: the transformers engine and the vLLM engine wrapper decode a
request through the same `generate` signature (checked without loading a model or vLLM)."""

from __future__ import annotations

import inspect

import pytest

from hqlab.config import ConfigError, DecodeConfig
from hqlab.engines import Engine
from hqlab.engines.hf import HFEngine
from hqlab.engines.vllm.engine import VLLMEngine, setting_for


@pytest.mark.parametrize("cls, name", [(HFEngine, "hf"), (VLLMEngine, "vllm")])
def test_engines_implement_the_protocol(cls, name):
    assert cls.name == name and isinstance(object.__new__(cls), Engine)
    wanted = list(inspect.signature(Engine.generate).parameters.values())
    have = list(inspect.signature(cls.generate).parameters.values())[: len(wanted)]
    assert [(p.name, p.kind) for p in have] == [(p.name, p.kind) for p in wanted]
    assert [p.default for p in have] == [p.default for p in wanted]


def test_a_vllm_engine_runs_only_the_setting_it_was_built_for():
    engine = object.__new__(VLLMEngine)  # no vLLM started: the check comes first
    engine.setting = setting_for("lookup:nmin=2,k=7")
    with pytest.raises(ConfigError, match="runs 'lookup:nmin=2,k=7', not 'pld:k=3'"):
        engine.generate([1, 2, 3], "pld:k=3", DecodeConfig(max_new_tokens=4))


def test_the_class_paths_vllm_loads_by_name_name_the_classes():
    """vLLM imports hqlab's speculators and worker extension from dotted strings: each must name its class."""
    import importlib

    from hqlab.engines.vllm import adapter, gpu_fused, gpu_lookup, worker

    for path, cls in [(adapter.CLASS_PATH, adapter.HqlabProposer),
                      (gpu_lookup.CLASS_PATH, gpu_lookup.GpuLookupSpeculator),
                      (gpu_fused.CLASS_PATH, gpu_fused.GpuFusedSpeculator),
                      (worker.EXTENSION_PATH, worker.HqlabWorkerExtension)]:
        module, _, name = path.rpartition(".")
        assert getattr(importlib.import_module(module), name) is cls, path
    assert setting_for("gpu-lookup:k=7").worker_extension_cls == worker.EXTENSION_PATH
