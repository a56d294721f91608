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



def test_the_corpus_reset_empties_vllms_suffix_cache():
    """A served `arctic-suffix` counts as having a corpus: the worker extension's reset gives vLLM's real
    SuffixDecodingProposer a new, empty Arctic cache, so a request after it drafts nothing from the answers before it,
    while one before it did; a proposer without a global tree (cached=0) answers False. Needs arctic-inference in this
    environment (`make arctic`); the GPU host's cp312 build is checked in tests/tools/test_arctic_suffix_reset.py."""
    pytest.importorskip("arctic_inference.suffix_decoding", reason="arctic-inference is not installed (make arctic)")
    from types import SimpleNamespace as NS

    import numpy as np
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

    from hqlab.engines.vllm.worker import HqlabWorkerExtension

    def proposer(cached: int) -> SuffixDecodingProposer:  # what it reads of VllmConfig
        spec = NS(num_speculative_tokens=8, suffix_decoding_max_tree_depth=24, suffix_decoding_max_spec_factor=4.0,
                  suffix_decoding_min_token_prob=0.1, suffix_decoding_max_cached_requests=cached)
        return SuffixDecodingProposer(NS(speculative_config=spec, model_config=NS(max_model_len=64)))

    def step(drafter: SuffixDecodingProposer, req: str, history: list[int], prompt_len: int) -> list[int]:
        """One decode step of a batch holding `req` alone: the InputBatch fields `propose` reads, its last token
        the one just sampled."""
        tokens = np.zeros((1, 64), dtype=np.int32)
        tokens[0, :len(history)] = history
        batch = NS(req_ids=[req], req_id_to_index={req: 0}, token_ids_cpu=tokens,
                   num_tokens_no_spec=np.array([len(history)]), num_prompt_tokens=np.array([prompt_len]))
        return drafter.propose(8, batch, [[history[-1]]])[0]

    def answer(drafter: SuffixDecodingProposer, req: str, prompt: list[int], out: list[int]) -> list[int]:
        return [step(drafter, req, prompt + out[:n], len(prompt)) for n in range(1, len(out) + 1)][-1]  # the last draft

    worker = HqlabWorkerExtension()
    worker.model_runner = NS(drafter=proposer(16))
    answer(worker.model_runner.drafter, "a", [1, 2, 3], [4, 5, 6, 7, 8])
    assert answer(worker.model_runner.drafter, "b", [9, 1, 2, 3], [4]) == [5, 6, 7, 8]  # from a's answer
    assert worker.hqlab_corpus_reset() is True
    assert not list(worker.model_runner.drafter.suffix_cache.cached_requests)
    assert answer(worker.model_runner.drafter, "c", [9, 1, 2, 3], [4]) == []
    worker.model_runner = NS(drafter=proposer(0))
    assert worker.hqlab_corpus_reset() is False
