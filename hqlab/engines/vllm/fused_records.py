"""The fused drafting step's records: per step and request, the fused block, its decisions and what the drafter ran,
kept on the GPU (no host read while decoding) and read back in one copy (`FusedRecorder.take`).

The engine turns each into a `hqlab.trace.StepRecord` (`drafter_passes`, `drafter_width`, `drafter_tokens`); the
replay takes the drafter's own tokens from them (`hqlab.bench.vllm.fused_replay_check`).
"""

from __future__ import annotations

from typing import Any

import torch

from hqlab.engines.vllm.speculator import RecordRing


def record_meta(*columns: torch.Tensor) -> torch.Tensor:
    """A step's `FusedRecorder.FIELDS` columns as one [m, fields] int32 tensor (compiled: one kernel, not ten)."""
    return torch.stack([c.to(torch.int32) for c in columns], 1)


class FusedRecorder(RecordRing):
    """Per-step fused blocks and their decisions; the drafter's own tokens (`draft_block` a step, head first) are kept
    beside the fused block, for the replay. `ran_passes` and `ran_width`: the drafter passes the step ran (0: none)
    and its last pass's width (`drafter_flags`)."""

    FIELDS = ("context_len", "match_len", "valid", "block", "proposed", "take_flag", "head_taken", "tail_taken",
              "draft_valid", "ran_width", "ran_passes")

    def __init__(self, capacity: int, max_reqs: int, k: int, device: torch.device, draft_block: int = 1) -> None:
        super().__init__(capacity, device)
        self.draft_block = draft_block
        self.meta = torch.zeros(capacity, max_reqs, len(self.FIELDS), dtype=torch.int32, device=device)
        self.tokens = torch.zeros(capacity, max_reqs, k, dtype=torch.int64, device=device)
        self.sources = torch.zeros(capacity, max_reqs, k, dtype=torch.int8, device=device)
        self.drafts = torch.zeros(capacity, max_reqs, draft_block, dtype=torch.int64, device=device)

    def write(self, meta: torch.Tensor, tokens: torch.Tensor, sources: torch.Tensor, drafts: torch.Tensor) -> None:
        m = meta.shape[0]
        slot = self.next_slot()
        self.meta[slot, :m] = meta.to(torch.int32)[None]
        self.tokens[slot, :m] = tokens[None]
        self.sources[slot, :m] = sources.to(torch.int8)[None]
        self.drafts[slot, :m] = drafts[None]

    def take(self) -> list[dict[str, Any]]:
        """Every step since the last call, one dict per (step, request); clears them."""
        steps = self.drain()
        if not steps:
            return []
        meta, tokens, sources = self.meta.cpu().numpy(), self.tokens.cpu().numpy(), self.sources.cpu().numpy()
        drafts = self.drafts.cpu().numpy()
        out = []
        for slot, req_ids, host_s in steps:
            for i, rid in enumerate(req_ids):
                row = dict(zip(self.FIELDS, (int(x) for x in meta[slot, i])))
                n = row["proposed"]  # the block's real tokens; pad follows up to k
                # the drafter's tokens of this step, head first; none where it did not run (the buffer's are stale);
                # the loop's passes draft nothing, so a step that ran the drafter drafted its whole head
                drafted = self.draft_block if row["ran_passes"] > 0 else 0
                out.append({"request": rid, "row": i, "context_len": row["context_len"],
                            "match_len": row["match_len"], "tokens": [int(t) for t in tokens[slot, i, :n]],
                            "sources": [int(s) for s in sources[slot, i, :n]], "propose_s": host_s,
                            "batch": len(req_ids), "block": row["block"], "take_flag": bool(row["take_flag"]),
                            "head_taken": bool(row["head_taken"]), "tail_taken": bool(row["tail_taken"]),
                            "lookup_valid": row["valid"], "draft_valid": row["draft_valid"],
                            "drafter_passes": row["ran_passes"], "drafter_width": row["ran_width"],
                            "drafter_tokens": [int(t) for t in drafts[slot, i, :drafted]]})
        return out


__all__ = ["FusedRecorder", "record_meta"]
