"""Engines own the model and its KV cache: `hf` (transformers, CPU and CUDA, the embedded default) and `vllm`
(vLLM's engine, with the plugin that runs hqlab's speculators inside its GPU step). Both implement `Engine`."""

from hqlab.engines.base import Engine

__all__ = ["Engine"]
