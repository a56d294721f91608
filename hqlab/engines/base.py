"""The engine protocol: what the benchmark harness, the trace recorder and the cost model ask of an engine."""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, Sequence, runtime_checkable

from hqlab.config import DecodeConfig
from hqlab.trace import Generation


@runtime_checkable
class Engine(Protocol):
    """An engine owns a model (and its KV cache) and decodes token-id prompts into `Generation`s, one
    `hqlab.trace.step_record` per verify step.

    `name` is the `engine` column of results. `generate` decodes one request alone; `proposer` is what it
    speculates with, None meaning the engine's own setting: for the transformers engine (`hqlab.engines.hf`) any
    proposer per call, None being no speculation; a vLLM engine (`hqlab.engines.vllm`) is built for one
    speculative setting and runs every request with it (None, or that setting's spec).
    """

    name: ClassVar[str]

    def generate(self, prompt_ids: Sequence[int], proposer: Any = None, decode: DecodeConfig = DecodeConfig(),
                 request: str = "0") -> Generation:
        ...
