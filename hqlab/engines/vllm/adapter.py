"""hqlab proposers inside vLLM, through vLLM's `custom_class` speculative-decoding hook.

vLLM (0.25 to 0.33) builds `HqlabProposer(vllm_config)` in its model runner when the speculative config reads

    {"method": "custom_class", "model": "hqlab.engines.vllm.adapter.HqlabProposer", "num_speculative_tokens": k}

and, after each step's bookkeeping, calls `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
slot_mappings=...)` on CPU data: per running request, the tokens sampled this step (an empty list means a partial
prefill: no draft), the history length, and one row of token ids per request holding prompt + output so far. The
return value is one (possibly empty) list of draft token ids per request.

The adapter does no matching of its own: it hands the histories to the proposer that `hqlab.proposers.make_proposer`
builds, the same code the transformers engine and the replay simulator run.

Which proposer: the spec string (e.g. `lookup:nmin=6,nmax=12,k=15`) is read from
`vllm_config.additional_config["hqlab_proposer"]` (pass `additional_config={...}` to `vllm.LLM`/`EngineArgs`; it
travels to vLLM's worker processes with the rest of the config), else from the environment variable
`HQLAB_VLLM_PROPOSER`. The proposer's k must not exceed `num_speculative_tokens` (vLLM sizes its buffers by it).

Step records: with `additional_config["hqlab_record"] = True` the adapter keeps one record per draft it makes
(history length, tokens, match length, time spent). Add `hqlab.engines.vllm.worker.HqlabWorkerExtension` as vLLM's
`worker_extension_cls` and call `llm.collective_rpc("hqlab_take_records")` to collect (and clear) them from the
worker.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from hqlab.config import ConfigError
from hqlab.engines.vllm.speculator import ENV_VAR, RECORD_KEY, SPEC_KEY, proposer_spec, recording
from hqlab.proposers import make_proposer

CLASS_PATH = "hqlab.engines.vllm.adapter.HqlabProposer"


def speculative_config(spec: str, num_speculative_tokens: int | None = None) -> dict[str, Any]:
    """vLLM's `speculative_config` for an hqlab proposer (num_speculative_tokens defaults to the proposer's k)."""
    k = make_proposer(spec).k if num_speculative_tokens is None else num_speculative_tokens
    return {"method": "custom_class", "model": CLASS_PATH, "num_speculative_tokens": int(k)}


class HqlabProposer:
    """vLLM `custom_class` proposer running an hqlab proposer on the CPU histories vLLM passes in."""

    def __init__(self, vllm_config: Any) -> None:
        self.spec = proposer_spec(vllm_config)
        self.proposer = make_proposer(self.spec)
        slots = vllm_config.speculative_config.num_speculative_tokens
        if self.proposer.k > slots:
            raise ConfigError(f"hqlab proposer {self.spec!r} proposes up to k={self.proposer.k} tokens but vLLM's "
                              f"num_speculative_tokens is {slots}; make them equal")
        self.k = self.proposer.k
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.recording = recording(vllm_config)
        self.records: list[dict[str, Any]] = []

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None) -> list[list[int]]:
        start = time.perf_counter()
        rows, histories, budgets = [], [], []
        for i, sampled in enumerate(sampled_token_ids):
            if not len(sampled):  # partial prefill, or a request vLLM discards this step
                continue
            n = int(num_tokens_no_spec[i])
            budget = min(self.k, self.max_model_len - n)  # never draft past the model's context
            if budget <= 0:
                continue
            rows.append(i)
            histories.append(token_ids_cpu[i, :n])
            budgets.append(budget)
        drafts: list[list[int]] = [[] for _ in range(len(sampled_token_ids))]
        proposals = self.proposer.propose(histories, budgets) if histories else []
        for i, proposal in zip(rows, proposals):
            drafts[i] = [int(t) for t in proposal.tokens]
        if self.recording and rows:
            elapsed = time.perf_counter() - start
            for i, proposal in zip(rows, proposals):
                self.records.append({"row": i, "context_len": int(num_tokens_no_spec[i]), "tokens": drafts[i],
                                     "sources": [int(s) for s in proposal.sources],
                                     "match_len": int(proposal.match_len), "propose_s": elapsed,
                                     "batch": len(rows)})
        return drafts

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM calls this on proposers that have it; a lookup proposer has no weights."""

    def take_records(self) -> list[dict[str, Any]]:
        records, self.records = self.records, []
        return records


__all__ = ["HqlabProposer", "proposer_spec", "speculative_config", "CLASS_PATH", "SPEC_KEY", "RECORD_KEY", "ENV_VAR"]
