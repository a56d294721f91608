"""vLLM 0.26's own `AsyncScheduler`, built on the CPU for a served `gpu-lookup` or `gpu-fused` spec with hqlab's
plugin registered: what the replays of the scheduler-side rules (the gate, the goodput controller) are checked
against step for step, with no GPU and no model weights (the model folder supplies only its config and tokenizer)."""

from __future__ import annotations

from typing import Any, Callable


def cpu_async_scheduler(spec: str, *, max_len: int, max_num_seqs: int, batched_tokens: int | None = None,
                        blocks: int = 4096) -> Any:
    """An AsyncScheduler for `spec` with room for `blocks` KV blocks of 16 tokens; `batched_tokens` (default
    `max_len`) bounds a step's tokens, so a larger one admits several prompts in one step without chunking."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from hqlab import models
    from hqlab.engines.vllm import gpu_fused, gpu_lookup, plugin

    plugin.register()
    module = gpu_fused if spec.strip().startswith(gpu_fused.NAME) else gpu_lookup
    config = VllmConfig(
        model_config=ModelConfig(model=str(models.prepare("qwen2.5-coder-0.5b")), dtype="float32",
                                 max_model_len=max_len),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_len,
                                         max_num_batched_tokens=batched_tokens or max_len, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=16, enable_prefix_caching=False),
        speculative_config=SpeculativeConfig(**module.speculative_config(spec)),
        device_config=DeviceConfig("cpu"), additional_config={module.SPEC_KEY: spec})
    if not config.scheduler_config.async_scheduling:  # the plugin turns it on, as vLLM does for EAGLE
        raise RuntimeError(f"{spec!r}: vLLM's config kept synchronous scheduling; is hqlab's plugin registered?")
    config.cache_config.num_gpu_blocks = blocks
    kv = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1,
                                                      dtype=torch.float32))])
    return AsyncScheduler(vllm_config=config, kv_cache_config=kv, log_stats=False,
                          structured_output_manager=StructuredOutputManager(config), block_size=16)


def drive(scheduler: Any, run: Callable[[Any], Any], on_schedule: Callable[[Any], None] | None = None) -> None:
    """Run `scheduler` to the end as vLLM's engine core does under asynchronous scheduling, with a batch queue of two:
    each non-empty step is scheduled (`on_schedule` sees it) before the previous one's output returns; `run(step)`
    plays the worker and returns that step's ModelRunnerOutput."""
    from collections import deque

    queue: deque = deque()
    while scheduler.has_requests() or queue:
        if scheduler.has_requests():
            step = scheduler.schedule()
            if step.total_num_scheduled_tokens > 0:
                if on_schedule is not None:
                    on_schedule(step)
                queue.appendleft(step)
                if len(queue) < 2:
                    continue
        if queue:
            step = queue.pop()
            scheduler.update_from_output(step, run(step))
