"""Exact offline replay of greedy speculative decoding over a recorded target output, step by step.

Under greedy decoding the target's output does not depend on the proposer (that is what lossless means), so a
proposer's acceptance at every step is fully determined by the output sequence: at each step, propose from the
history, accept the longest prefix that equals what the target emitted next, and advance by accepted + 1.
This mirrors `HFEngine.generate` step for step (same budgets, same truncation at the end), and emits the same
`StepRecord`s, so every metric is computed the same way for live and replayed runs.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from hqlab.proposers.base import Proposer
from hqlab.rules.verify import greedy_verify
from hqlab.trace import StepRecord, budget, step_record


def step_replay(prompt_ids: Sequence[int], output_ids: Sequence[int], proposer: Proposer, *, max_new_tokens: int,
                request: str = "0", time_proposals: bool = False) -> list[StepRecord]:
    """Step records that `proposer` would produce live, given the target's greedy `output_ids`.

    `max_new_tokens` is the limit the output was generated with: near the end it caps the proposal budget
    exactly as the engine does.
    """
    out = np.asarray(output_ids, dtype=np.int64)
    if out.size == 0:
        return []
    history = np.concatenate([np.asarray(prompt_ids, dtype=np.int64), out])
    prompt_len = len(prompt_ids)
    done = 1  # the first token comes from prefill, not from a verify step
    records: list[StepRecord] = []
    while done < out.size:
        allowed = budget(max_new_tokens, done)
        view = history[: prompt_len + done]
        t0 = time.perf_counter() if time_proposals else 0.0
        proposal = proposer.propose([view], [allowed], keys=[request])[0].truncated(allowed)
        propose_s = time.perf_counter() - t0 if time_proposals else 0.0
        tokens = proposal.tokens
        # The recorded output is the target's argmax sequence, so the engine's own greedy rule decides. Past an
        # EOS the output has no tokens to compare: there the engine keeps nothing either.
        m = min(tokens.size, out.size - done - 1)
        accepted = greedy_verify(tokens[:m], out[done : done + m + 1]).accepted
        emitted = accepted + 1
        records.append(step_record(request, len(records), context_len=prompt_len + done - 1, proposal=proposal,
                                   block=proposer.k, accepted=accepted, emitted=emitted, step_s=propose_s,
                                   propose_s=propose_s))
        done += emitted
    return records
