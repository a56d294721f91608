"""The worker extension's step timer reads what vLLM's scheduler gave each step from vLLM's own `SchedulerOutput`
(the timer itself needs CUDA events; its GPU runs are `benchmarks/vllm_corpus.py bench --profile`)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed (make setup installs requirements-vllm.txt)")

from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402

from hqlab.engines.vllm.worker import STEP_FACTS, step_facts  # noqa: E402


def _new(req_id: str, prompt: list[int]) -> NewRequestData:
    return NewRequestData(req_id=req_id, prompt_token_ids=prompt, mm_features=[], sampling_params=None,
                          pooling_params=None, block_ids=([0],), num_computed_tokens=0, lora_request=None)


def test_step_facts_count_what_the_scheduler_admitted_and_finished():
    # A step that admits one 5-token prompt beside two decoding requests verifying 16 positions each, after one
    # request finished.
    out = SchedulerOutput(
        scheduled_new_reqs=[_new("c", [1, 2, 3, 4, 5])], scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={"a": 16, "b": 16, "c": 5}, total_num_scheduled_tokens=37,
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, num_common_prefix_blocks=[0],
        finished_req_ids={"z"}, free_encoder_mm_hashes=[])
    assert step_facts(out) == {"tokens": 37, "requests": 3, "new_requests": 1, "finished_requests": 1}


def test_calls_without_a_scheduler_output_share_the_schema():
    # sample_tokens takes a grammar output (None without structured output), propose an input batch
    for arg in (None, object()):
        assert step_facts(arg) == dict.fromkeys(STEP_FACTS, -1)

