"""Verification faults planted on purpose (never for serving): a bug the sampling test must catch, and a benchmark's
fixed step.

`additional_config={"hqlab_fault": "accept_first_draft"}` makes vLLM's rejection sampler accept each request's first
draft token unconditionally: where the correct rule rejected it (the step kept one token, the target's own), the
step keeps the draft and then that target token. Greedy outputs barely change where the lookup's first drafts are
usually right; sampled outputs drift towards the drafts, which is what a distribution test must catch
(`hqlab.bench.serve.distribution_test`). The rule sits in a pure function (`accept_first_draft`, tested on the
CPU); `install` wraps vLLM 0.26's `rejection_sample` with it in the worker that builds the speculator.

`reject_all_drafts` keeps only each request's first sampled token, as if every draft were rejected: every step then
emits exactly one token a request while still verifying its full width. It is no bug to catch but a measuring
device: step costs at a chosen verify width (benchmarks/vllm_step_cost.py) need requests that advance in lockstep
whatever the drafts (with random weights the lookup would match the model's degenerate output at random). Greedy
output is unchanged by it (the first sampled token is the target's own at that position); only speed is.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from hqlab.config import ConfigError

KEY = "hqlab_fault"  # additional_config key
FAULTS = ("accept_first_draft", "reject_all_drafts")
log = logging.getLogger("hqlab.vllm")


def fault_of(vllm_config: Any) -> str | None:
    """The fault asked for in `additional_config` (None: none), validated."""
    fault = (getattr(vllm_config, "additional_config", None) or {}).get(KEY)
    if fault is not None and fault not in FAULTS:
        raise ConfigError(f"{KEY} must be one of {', '.join(FAULTS)} (got {fault!r})")
    return fault


def accept_first_draft(sampled: torch.Tensor, num_sampled: torch.Tensor, draft_sampled: torch.Tensor,
                       cu_num_logits: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The planted bug on the rejection sampler's outputs.

    sampled [num_reqs, k + 1] and num_sampled [num_reqs]: what the correct rule kept per request; draft_sampled
    [num_logits]: the input tokens at the logit positions (a request's rows are cu_num_logits[r] .. cu_num_logits[r+1],
    the first its last sampled token, then its drafts). A request that drafted a first token other than `pad` and
    kept one token only gets [draft, that token] instead."""
    first = cu_num_logits[:-1].long()
    drafts = (cu_num_logits[1:] - cu_num_logits[:-1] - 1).long()
    index = (first + 1).clamp(max=max(draft_sampled.numel() - 1, 0))
    draft0 = draft_sampled[index].to(sampled.dtype)
    force = (drafts >= 1) & (draft0 != pad) & (num_sampled == 1)
    out = sampled.clone()
    out[:, 1] = torch.where(force, sampled[:, 0], sampled[:, 1])
    out[:, 0] = torch.where(force, draft0, sampled[:, 0])
    return out, torch.where(force, num_sampled + 1, num_sampled)


def reject_all_drafts(sampled: torch.Tensor, num_sampled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The benchmark's fixed step on the rejection sampler's outputs (sampled [num_reqs, k + 1], num_sampled
    [num_reqs]): each request keeps its first sampled token only (a request that sampled none keeps none)."""
    return sampled, num_sampled.clamp(max=1)


def install(fault: str, pad: int) -> None:
    """Wrap vLLM 0.26's V2 `rejection_sample` (as its rejection sampler module holds it) with the fault."""
    import vllm.v1.worker.gpu.spec_decode.rejection_sampler as module

    if fault not in FAULTS:
        raise ConfigError(f"{KEY} must be one of {', '.join(FAULTS)} (got {fault!r})")

    original: Callable = module.rejection_sample
    if getattr(original, "_hqlab_fault", None):
        return

    def rejection_sample(target_logits: Any, draft_logits: Any, draft_sampled: torch.Tensor,
                         cu_num_logits: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        sampled, num_sampled = original(target_logits, draft_logits, draft_sampled, cu_num_logits, *args, **kwargs)
        if fault == "reject_all_drafts":
            return reject_all_drafts(sampled, num_sampled)
        return accept_first_draft(sampled, num_sampled, draft_sampled, cu_num_logits, pad)

    rejection_sample._hqlab_fault = fault  # type: ignore[attr-defined]
    module.rejection_sample = rejection_sample
    log.warning("hqlab: PLANTED FAULT %s installed in vLLM's rejection sampler (a test or benchmark engine, never for "
                "serving)", fault)
