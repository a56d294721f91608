"""Model drafter (SPEC §2.3): a smaller model with the target's tokenizer drafts k tokens autoregressively.

The drafter keeps its own KV cache per request (rows of one `RaggedCache`, so a batch drafts together) and keeps
it in step with what the target accepted without being told: at every call it compares the tokens it has fed
with the request's history, keeps the common prefix (its accepted drafts stay cached), rolls back the rest and
feeds what is new, usually the target's correction or bonus token. So the same proposer works in the engine, in
the replay and behind any other engine that only hands over histories.

Greedy drafting takes the drafter's argmax (a point mass, like the lookup). With `temperature > 0` it samples and
returns its distribution q per position, which sampled verification needs to stay exact.

`vocab=PATH` restricts drafting to a draft vocabulary (SPEC §2.7): the head scores only those rows, so a token
outside the list can never be proposed. Row i of that head stands for target token `draft_to_target[i]` (absolute
ids, `hqlab.vocab.runtime.load_mapping`; vLLM's EAGLE-3 `d2t` holds offsets instead, see
`hqlab.vocab.runtime.eagle3_d2t`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import numpy as np
import torch

from hqlab.config import ConfigError
from hqlab.models.kv import RaggedCache
from hqlab.proposers.base import Proposal, Source


@dataclass(frozen=True)
class DraftConfig:
    """model: registry name, hub id or path of the drafter (same tokenizer as the target).
    k: tokens drafted per step (HyperQwen's draft_block, 7). dtype/device: as for the target ("auto").
    temperature: 0 drafts greedily; > 0 samples and returns q for sampled verification.
    vocab: a draft-vocabulary file (`hqlab vocab build`); empty = the full vocabulary. seed: sampling seed."""

    model: str = "qwen2.5-coder-0.5b"
    k: int = 7
    dtype: str = "auto"
    device: str = "auto"
    temperature: float = 0.0
    vocab: str = ""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ConfigError(f"draft: k must be >= 1 (got {self.k})")
        if self.temperature < 0:
            raise ConfigError(f"draft: temperature must be >= 0, 0 meaning greedy (got {self.temperature})")
        if not self.model:
            raise ConfigError("draft: model must name the drafter (e.g. qwen2.5-coder-0.5b)")


_LOADED: dict[tuple[str, str, str], Any] = {}


def load_drafter(name: str, device: str, dtype: str) -> Any:
    """Load (once per process) a drafter model; several proposers drafting with it share the weights."""
    key = (name, device, dtype)
    if key not in _LOADED:
        from hqlab import models

        model, _tokenizer, _info = models.load(name, device=device, dtype=dtype)
        model.eval()
        _LOADED[key] = model
    return _LOADED[key]


class DraftProposer:
    name: ClassVar[str] = "draft"
    Config = DraftConfig

    def __init__(self, config: DraftConfig | None = None, model: Any = None) -> None:
        self.config = c = config or DraftConfig()
        self.k = c.k
        self.model = model if model is not None else load_drafter(c.model, c.device, c.dtype)
        self.device = next(self.model.parameters()).device
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.body = self.model.get_decoder()
        weight = self.model.get_output_embeddings().weight
        # draft row -> target token id (absolute ids, hqlab.vocab's draft_to_target; not vLLM's offset d2t)
        self.draft_to_target: torch.Tensor | None = None
        if c.vocab:
            from pathlib import Path

            from hqlab.vocab.runtime import VocabError, load_draft_vocab, load_mapping

            try:  # a published folder's map (checked against its id list), or a JSON id list
                ids = load_mapping(c.vocab)[0] if Path(c.vocab).is_dir() else load_draft_vocab(c.vocab)
            except VocabError as e:
                raise ConfigError(f"draft: vocab: {e}") from None
            ids = ids.to(self.device)
            if ids.numel() == 0 or int(ids.max()) >= weight.shape[0]:
                raise ConfigError(f"draft: vocabulary {c.vocab} has ids outside the drafter's {weight.shape[0]} rows")
            self.draft_to_target = ids
            weight = weight.index_select(0, ids)  # the truncated head: only these rows are ever scored
        self.head_weight = weight
        self.full_vocab = self.model.get_output_embeddings().weight.shape[0]
        self.generator = torch.Generator(device=self.device).manual_seed(c.seed)
        self.kv = RaggedCache(self.body, self._cache_kw, hidden=True)
        self.keys: list[str] = []  # request key per cache row
        self.fed: list[np.ndarray] = []  # tokens whose KV is in the row

    # ------------------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, histories: Sequence[np.ndarray], budgets: Sequence[int],
                keys: Sequence[str] | None = None) -> list[Proposal]:
        keys = [str(i) for i in range(len(histories))] if keys is None else [str(x) for x in keys]
        hist = [np.asarray(h.cpu() if hasattr(h, "cpu") else h, dtype=np.int64) for h in histories]
        self._sync_rows(keys, hist)
        order = [self.keys.index(key) for key in keys]  # call position -> cache row

        # catch up: roll each row back to what it shares with its history, feed the rest (>= 1 token)
        keep = []
        blocks: list[list[int]] = [[] for _ in self.keys]
        for key, h, row in zip(keys, hist, order):
            fed = self.fed[row]
            n = min(len(fed), len(h) - 1)
            mismatch = np.flatnonzero(fed[:n] != h[:n])
            common = int(mismatch[0]) if mismatch.size else n
            keep.append((row, common))
            blocks[row] = h[common:].tolist()
            self.fed[row] = h.copy()
        self.kv.truncate_rows({row: common for row, common in keep})

        steps = min(self.k, max((int(b) for b in budgets), default=0))
        if steps <= 0:  # nothing to draft, but stay in step with the histories
            self._feed(blocks)
            return [Proposal.empty() for _ in histories]
        drafted = [[] for _ in self.keys]
        qs: list[list[torch.Tensor]] = [[] for _ in self.keys]
        for i in range(steps):
            hidden = self._feed(blocks)
            tokens, q = self._choose(hidden)
            for row in range(len(self.keys)):
                drafted[row].append(tokens[row])
                if q is not None:
                    qs[row].append(q[row])
            if i + 1 < steps:
                blocks = [[t] for t in tokens]
                for row in range(len(self.keys)):
                    self.fed[row] = np.append(self.fed[row], tokens[row])

        out = []
        for row, budget in zip(order, budgets):
            n = max(0, min(self.k, int(budget)))
            toks = np.asarray(drafted[row][:n], dtype=np.int64)
            q = torch.stack(qs[row][:n]) if qs[row] and n else None
            out.append(Proposal(toks, np.full(n, Source.DRAFT, dtype=np.int8), 0, q))
        return out

    def exact(self, histories: Sequence[np.ndarray], budgets: Sequence[int],
              keys: Sequence[str] | None = None) -> list[Proposal]:
        """The `Drafter` protocol's real drafts: a live drafter's drafts always are."""
        return self.propose(histories, budgets, keys)

    # ------------------------------------------------------------------------------------------------------------

    def _sync_rows(self, keys: list[str], hist: list[np.ndarray]) -> None:
        """Drop rows of requests that are gone; prefill rows for new requests (all but the last token)."""
        live = set(keys)
        rows = [i for i, key in enumerate(self.keys) if key in live]
        if len(rows) != len(self.keys):
            self.kv.keep_rows(rows)
            self.keys = [self.keys[i] for i in rows]
            self.fed = [self.fed[i] for i in rows]
        for key, h in zip(keys, hist):
            if key in self.keys:  # known request (even if its history changed: the catch-up keeps what matches)
                continue
            if len(h) < 2:
                raise ValueError(f"request {key!r}: a drafter needs a history of at least 2 tokens")
            self.kv.add(h[:-1].tolist(), logits_to_keep=0)
            self.keys.append(key)
            self.fed.append(h[:-1].copy())

    def _feed(self, blocks: list[list[int]]) -> torch.Tensor:
        """Feed every row its block; returns the last real hidden state per row [B, H]."""
        hidden = self.kv.forward(blocks)
        self.kv.keep([len(b) for b in blocks])
        last = torch.tensor([max(len(b), 1) - 1 for b in blocks], device=hidden.device)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]

    def _choose(self, hidden: torch.Tensor) -> tuple[list[int], torch.Tensor | None]:
        logits = torch.nn.functional.linear(hidden, self.head_weight).float()
        if self.config.temperature == 0:
            idx = logits.argmax(dim=-1)
            q = None
        else:
            probs = torch.softmax(logits / self.config.temperature, dim=-1)
            idx = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
            if self.draft_to_target is not None:
                full = torch.zeros(probs.shape[0], self.full_vocab, dtype=probs.dtype, device=probs.device)
                probs = full.index_copy(1, self.draft_to_target, probs)
            q = probs
        if self.draft_to_target is not None:
            idx = self.draft_to_target[idx]
        return idx.tolist(), q
