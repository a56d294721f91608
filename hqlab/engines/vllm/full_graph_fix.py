"""An opt-in fix for vLLM 0.26's model runner V2 under `cudagraph_mode` FULL: capture mixed-step graphs with the
worst-case query length. ON only in a process whose environment has HQLAB_FULL_GRAPH_QUERY_FIX=1 (the plugin's
`register` calls `apply` in every vLLM process; `engine.VLLMOptions(cudagraph_mode="FULL")` sets the variable).

What vLLM 0.26 does wrong. The V2 runner captures each CUDA graph on a dummy batch (`InputBatch.make_dummy`:
num_reqs = min(num_tokens, max_num_seqs) requests of num_tokens // num_reqs tokens each) and builds its attention
metadata in `DefaultModelState.prepare_attn(for_capture=True)` (model_states/default.py): max_seq_len is the worst
case (max_model_len, "so the graph is valid at any replay"), but max_query_len is the dummy's own
`num_scheduled_tokens.max()`: 1 for every capture size up to max_num_seqs, 128 for a 1024-token graph at 8 requests.
FlashAttention 3 takes max_seqlen_q as a host integer, so the captured kernel keeps it. With cudagraph_mode FULL
there is one graph per size for every step (no separate decode routine: `CUDAGraphMode.FULL.separate_routine()` is
False), so a step that admits a prompt replays a graph captured for that small query length. At replay only tensors
are refreshed: FlashAttention's builder recomputes its scheduler metadata into the same buffer with the real
max_query_len, but the kernel launched is the captured one. On an H100 every prompt longer than 128 tokens in such
a step came out wrong (greedy outputs unlike vLLM's default mode's, NaN logits). vLLM's V1 runner captures the same
(mixed) graphs with max_query_len = num_tokens (gpu_model_runner.py, `_dummy_run`: `max_query_len =
self.uniform_decode_query_len if uniform_decode else num_tokens`).

Why the patch is right. num_tokens is the graph's own size, so no step it replays has a request with more query
tokens: it is an upper bound, as max_seq_len already is, and it is the V1 runner's value. Only the captures' value
changes; steps that run eagerly or replay still build their metadata with their real max_query_len.

Where it applies. Only to full graphs that replay mixed steps: calls with for_cudagraph_capture=True under
cudagraph_mode FULL. FULL_AND_PIECEWISE and FULL_DECODE_ONLY capture full graphs for uniform decode steps only
(dispatched to batches whose query length equals the graph's, `cudagraph_utils._is_compatible`), where the dummy's
max is exact and a larger one could only change the kernel FlashAttention picks for decode; their piecewise captures
build no attention metadata (`skip_attn`, unless breakable graphs are on). The dummy batch itself cannot tell the two
apart (a FULL graph of up to max_num_seqs tokens has a uniform dummy of 1 token a request, as a decode graph has),
so the test is the engine's mode, read from the attention builders' config. Only `model_states.default` is patched:
the Mamba-hybrid and encoder-decoder model states have the same line but other metadata builders, untried here.
"""

from __future__ import annotations

import os
from typing import Any, Callable

ENV_VAR = "HQLAB_FULL_GRAPH_QUERY_FIX"
_PATCHED = "_hqlab_patched"  # the marker plugin._wrap uses: one wrapper per process, however often applied


def enabled() -> bool:
    """Whether this process asks for the fix."""
    return os.environ.get(ENV_VAR, "").strip() == "1"


def replays_mixed_steps(attn_groups: Any) -> bool:
    """Whether the engine's full graphs also serve steps that admit prompts: cudagraph_mode FULL, read from the
    first attention builder's config (all builders share the engine's); False with no attention layers."""
    from vllm.config import CUDAGraphMode

    for group in attn_groups:
        for attn_group in group:
            config = attn_group.get_metadata_builder(0).vllm_config
            return config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL
    return False


def worst_case_query(original: Callable) -> Callable:
    """`build_attn_metadata` that captures mixed-step graphs with max_query_len = num_tokens."""
    def build_attn_metadata(*args: Any, **kwargs: Any) -> Any:
        if (kwargs.get("for_cudagraph_capture") and "num_tokens" in kwargs
                and replays_mixed_steps(kwargs.get("attn_groups", ()))):
            kwargs["max_query_len"] = int(kwargs["num_tokens"])
        return original(*args, **kwargs)
    return build_attn_metadata


def apply() -> bool:
    """Patch the `build_attn_metadata` that vLLM's default model state calls, if the environment asks for it
    (idempotent). Returns whether the patch is in place."""
    if not enabled():
        return False
    import vllm.v1.worker.gpu.model_states.default as default

    original = default.build_attn_metadata
    if not getattr(original, _PATCHED, False):
        wrapped = worst_case_query(original)
        setattr(wrapped, _PATCHED, True)
        wrapped.__wrapped__ = original
        default.build_attn_metadata = wrapped
    return True


__all__ = ["ENV_VAR", "apply", "enabled", "replays_mixed_steps", "worst_case_query"]
