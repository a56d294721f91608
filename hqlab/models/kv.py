"""A batched KV cache whose rows are ragged: each request has its own length, and each step its own block length.

transformers' `DynamicCache` stores every row with the same number of columns. Requests in a batch accept
different numbers of tokens per step, so after a step each row keeps a different prefix of the block it verified.
Instead of moving memory, a boolean `valid` mask [B, L] marks which columns hold a row's real tokens; rejected
columns stay in place as holes that attention ignores, and every row carries its own position counter so RoPE
sees contiguous positions. Columns no row uses any more are cropped from the end (the batch-1 case is then exactly
a KV rollback) and from the start (after a long request leaves).

The same structure serves the target (verify steps over per-request blocks) and the model drafter (catch-up
tokens of different lengths, then one token per row per step).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F


def _new_cache(model: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


class RaggedCache:
    """KV cache + validity mask + per-row positions for a changing set of requests."""

    def __init__(self, model: Any, cache_kw: str, *, hidden: bool = False) -> None:
        """model: a causal LM (forward returns logits), or with hidden=True its decoder body (returns the last
        hidden states, so a caller can apply its own, e.g. truncated, head to the rows it needs)."""
        self.model = model
        self.hidden = hidden
        self.cache_kw = cache_kw
        self.device = next(model.parameters()).device
        self.cache: Any = None
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=self.device)  # [B, L]
        self.lengths: list[int] = []  # tokens in the cache per row (= next position id)

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def columns(self) -> int:
        return int(self.valid.shape[1])

    # ------------------------------------------------------------------------------------------------------------
    # rows come and go

    def add(self, ids: Sequence[int], logits_to_keep: int = 1) -> torch.Tensor:
        """Prefill a new row with `ids` (alone, so its numbers do not depend on the batch); returns its last
        `logits_to_keep` rows of logits [n, V]. The row is appended at index `batch - 1`."""
        if len(ids) == 0:
            raise ValueError("a request needs at least one token to prefill")
        cache = _new_cache(self.model)
        x = torch.tensor([list(ids)], device=self.device)
        extra = {} if self.hidden else {"logits_to_keep": logits_to_keep}
        logits = self._output(self.model(input_ids=x, use_cache=True, **extra, **{self.cache_kw: cache}))[0]
        n = len(ids)
        row_valid = torch.ones(1, n, dtype=torch.bool, device=self.device)
        if self.cache is None or self.batch == 0:
            self.cache, self.valid = cache, row_valid
        else:
            width = max(self.columns, n)
            self._pad_left(self.cache, width - self.columns)
            self.valid = F.pad(self.valid, (width - self.columns, 0), value=False)
            self._pad_left(cache, width - n)
            row_valid = F.pad(row_valid, (width - n, 0), value=False)
            for mine, new in zip(_layers(self.cache), _layers(cache)):
                mine.keys = torch.cat([mine.keys, new.keys], dim=0)
                mine.values = torch.cat([mine.values, new.values], dim=0)
            self.valid = torch.cat([self.valid, row_valid], dim=0)
        self.lengths.append(n)
        return logits

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Drop every row not listed (finished requests), in the given order; then trim unused columns."""
        rows = list(rows)
        if rows == list(range(self.batch)):
            return
        if not rows:
            self.cache, self.lengths = None, []
            self.valid = torch.zeros(0, 0, dtype=torch.bool, device=self.device)
            return
        index = torch.tensor(rows, device=self.device)
        for layer in _layers(self.cache):
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)
        self.valid = self.valid.index_select(0, index)
        self.lengths = [self.lengths[r] for r in rows]
        self._trim()

    # ------------------------------------------------------------------------------------------------------------
    # steps

    def forward(self, blocks: Sequence[Sequence[int]]) -> torch.Tensor:
        """Append one block of tokens per row (lengths may differ; rows may be empty) and score them.

        Returns logits [B, n_max, V]; row b's first len(blocks[b]) entries are meaningful. Every new column is
        provisionally valid for its row; call `keep` afterwards to say how many each row keeps.
        """
        if len(blocks) != self.batch:
            raise ValueError(f"need one block per row ({self.batch}), got {len(blocks)}")
        sizes = [len(b) for b in blocks]
        n = max(sizes, default=0)
        if n == 0:
            raise ValueError("every block is empty: nothing to score")
        ids = torch.zeros(self.batch, n, dtype=torch.long)
        new_valid = torch.zeros(self.batch, n, dtype=torch.bool)
        for b, block in enumerate(blocks):
            if block:
                ids[b, : len(block)] = torch.as_tensor(list(block))
                new_valid[b, : len(block)] = True
        positions = torch.tensor(self.lengths).unsqueeze(1) + torch.arange(n).unsqueeze(0)
        self.valid = torch.cat([self.valid, new_valid.to(self.device)], dim=1)
        self._pending = sizes
        mask = self.valid.long()
        if bool(self.valid.all()):
            mask = None  # nothing to hide: the same computation the batch-1 reference uses
        out = self.model(input_ids=ids.to(self.device), position_ids=positions.to(self.device),
                         attention_mask=mask, use_cache=True, **{self.cache_kw: self.cache})
        return self._output(out)

    def _output(self, out: Any) -> torch.Tensor:
        return out.last_hidden_state if self.hidden else out.logits

    def keep(self, counts: Sequence[int]) -> None:
        """After `forward`: row b keeps the first counts[b] tokens of its block; the rest become holes."""
        sizes = self._pending
        if len(counts) != self.batch:
            raise ValueError(f"need one count per row ({self.batch}), got {len(counts)}")
        n = max(sizes)
        start = self.columns - n
        for b, (c, s) in enumerate(zip(counts, sizes)):
            if not 0 <= c <= s:
                raise ValueError(f"row {b} keeps {c} of {s} tokens")
            if c < s:
                self.valid[b, start + c : start + s] = False
            self.lengths[b] += c
        self._trim()

    def truncate_rows(self, lengths: dict[int, int]) -> None:
        """Roll rows back: row b keeps only its first lengths[b] tokens (rows not named are untouched)."""
        for b, n in lengths.items():
            if not 0 <= n <= self.lengths[b]:
                raise ValueError(f"row {b} has {self.lengths[b]} tokens, cannot keep {n}")
            if n == self.lengths[b]:
                continue
            cols = torch.nonzero(self.valid[b]).flatten()
            self.valid[b, cols[n:]] = False
            self.lengths[b] = n
        if self.batch:
            self._trim()

    # ------------------------------------------------------------------------------------------------------------

    def _trim(self) -> None:
        """Crop columns that no row uses, at the end (a KV rollback) and at the start."""
        if self.batch == 0:
            return
        used = self.valid.any(dim=0)
        idx = torch.nonzero(used).flatten()
        if idx.numel() == 0:  # every row rolled back to nothing: start afresh (rows stay, with no tokens)
            self.cache.crop(-self.columns) if self.columns else None
            self.valid = self.valid[:, :0]
            return
        first, last = int(idx[0]), int(idx[-1])
        tail = self.columns - 1 - last
        if tail > 0:
            self.cache.crop(-tail)
        if first > 0:
            for layer in _layers(self.cache):
                layer.keys = layer.keys[..., first:, :]
                layer.values = layer.values[..., first:, :]
        self.valid = self.valid[:, first : last + 1]

    @staticmethod
    def _pad_left(cache: Any, n: int) -> None:
        if n <= 0:
            return
        for layer in _layers(cache):
            layer.keys = F.pad(layer.keys, (0, 0, n, 0))
            layer.values = F.pad(layer.values, (0, 0, n, 0))


def _layers(cache: Any) -> list[Any]:
    return list(cache.layers)
