"""A corpus of earlier documents in a GPU ring buffer, searched for every request's suffix in one launch (#42).

Decision for decision equal to the reference rule `hqlab.rules.corpus` (`Corpus.add` and `Corpus.match`;
tests/kernels/test_corpus_match.py): FIFO eviction of whole documents bounded by tokens and documents, a match never
spans two documents nor runs past the history's start, proposals clipped at the document's end, longest match
(capped at nmax) first, then the most recent corpus position ("recent") or the earliest ("earliest").

Layout (`CorpusRing`). The live documents sit contiguously in a ring of `capacity` token slots, oldest first from
`head`: live document tokens occupy ring slots head, head+1, ... (mod capacity), `live` of them. Per slot the ring
keeps the token, its offset inside its document (`doc_off`) and how many tokens of its document follow it
(`doc_rem`), so the kernel finds a document's bounds from the candidate slot alone: no document table on the
device, and a document may wrap around the ring's end. Eviction is host bookkeeping (the host knows every
document's length, so it never reads the device): the head moves past the evicted documents, and their slots are
simply no longer scanned (the kernel scans the `live` slots from `head` only), to be overwritten later.
`state` = [head, live] lives on the device, so a captured CUDA graph sees documents added after its capture.

The corpus position of a live slot is j = (slot - head) mod capacity: exactly the position in the reference's
concatenation of the live documents, oldest first. The kernel maximises the packed score of the lookup kernels,

    (min(match_len, nmax) << 32) | j              policy "recent"
    (min(match_len, nmax) << 32) | (2^32-1 - j)   policy "earliest"

Launch: a grid of (requests, splits); program s of a request scans the blocks s, s+splits, ... of the live slots,
folds its best score into a per-request scratch slot with atomic_max, and the last program of the request to arrive
writes the proposal and resets the scratch (the fused variant of `suffix_match`: one launch, no allocation, no host
read, so it can be captured in a CUDA graph). This module is a leaf: it imports nothing from hqlab.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch
import triton
import triton.language as tl

POLICIES = ("recent", "earliest")
DEFAULT_BLOCK = 1024
MAX_SPLITS = 256
PAD_TOKEN = -1  # proposal entries past `valid`, and `end` where nothing matched
_PAD = tl.constexpr(PAD_TOKEN)


@triton.jit
def _low32():
    return (tl.full((), 1, tl.int64) << 32) - 1


@triton.jit
def _wrap(x, capacity):
    """x mod capacity for any int32 x (Triton's % truncates towards zero, like C)."""
    return ((x % capacity) + capacity) % capacity


@triton.jit
def _score_block(ring, doc_off, doc_rem, hist, j0, live, head, capacity, t, last_token, nmin, nmax,
                 BLOCK: tl.constexpr, EARLIEST: tl.constexpr):
    """Best packed score over corpus positions [j0, j0 + BLOCK) (0 where nothing matches nmin tokens)."""
    j = j0 + tl.arange(0, BLOCK)
    in_range = j < live
    slot = _wrap(head + j, capacity)
    x = tl.load(ring + slot, mask=in_range, other=0)
    off = tl.load(doc_off + slot, mask=in_range, other=-1)
    rem = tl.load(doc_rem + slot, mask=in_range, other=0)
    # A candidate has room for nmin tokens in its document, something after it, and the history's last token.
    alive = in_range & (off >= nmin - 1) & (rem >= 1) & (x == last_token)
    best = tl.full((), 0, dtype=tl.int64)
    if tl.max(alive.to(tl.int32), axis=0) > 0:  # the rare branch: extend the survivors (see suffix_match)
        n = alive.to(tl.int32)
        for i in range(1, nmax):
            # Neither past the document's start (i <= off) nor past the history's (t - i >= 0).
            ok = alive & (off >= i) & (t - i >= 0)
            a = tl.load(ring + _wrap(slot - i, capacity), mask=ok, other=0)
            b = tl.load(hist + (t - i), mask=(t - i) >= 0, other=0)
            alive = ok & (a == b)
            n += alive.to(tl.int32)
        n = tl.where(n >= nmin, n, 0)
        if EARLIEST:
            low = _low32() - j.to(tl.int64)
        else:
            low = j.to(tl.int64)
        best = tl.max(tl.where(n > 0, (n.to(tl.int64) << 32) | low, 0), axis=0)
    return best


@triton.jit(do_not_specialize=["nmin", "nmax", "k", "capacity"])
def _corpus_kernel(tokens, offsets, lengths, ring, doc_off, doc_rem, state, scratch, arrivals, out_tokens, out_len,
                   out_valid, out_end, nmin, nmax, k, capacity, BLOCK: tl.constexpr, K_BLOCK: tl.constexpr,
                   EARLIEST: tl.constexpr):
    req = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    hist = tokens + tl.load(offsets + req).to(tl.int64)
    t = tl.load(lengths + req).to(tl.int32) - 1
    head = tl.load(state)  # int64: head + j may pass 2^31 in a ring near the 2^31 limit
    live = tl.load(state + 1).to(tl.int32)
    score = tl.full((), 0, dtype=tl.int64)
    if t >= nmin - 1:  # the history holds nmin tokens
        last_token = tl.load(hist + t)
        n_blocks = (live + BLOCK - 1) // BLOCK
        for blk in range(split, n_blocks, splits):
            s = _score_block(ring, doc_off, doc_rem, hist, blk * BLOCK, live, head, capacity, t, last_token, nmin,
                             nmax, BLOCK, EARLIEST)
            score = tl.maximum(score, s)
    if score > 0:
        tl.atomic_max(scratch + req, score, sem="relaxed")
    # The last program of the request to arrive sees every score (acq_rel) and writes the proposal.
    arrived = tl.atomic_add(arrivals + req, 1, sem="acq_rel")
    if arrived == splits - 1:
        best = tl.atomic_xchg(scratch + req, tl.zeros((), dtype=tl.int64))
        tl.store(arrivals + req, 0)
        n = (best >> 32).to(tl.int32)
        low = best & _low32()
        if EARLIEST:
            j = (_low32() - low).to(tl.int32)
        else:
            j = low.to(tl.int32)
        slot = _wrap(head + j, capacity)
        rem = tl.load(doc_rem + slot, mask=n > 0, other=0)
        valid = tl.where(n > 0, tl.minimum(rem, k), 0)
        col = tl.arange(0, K_BLOCK)
        proposal = tl.load(ring + _wrap(slot + 1 + col, capacity), mask=col < valid, other=_PAD)
        row = req.to(tl.int64) * k
        tl.store(out_tokens + row + col, proposal, mask=col < k)
        tl.store(out_len + req, n)
        tl.store(out_valid + req, valid)
        tl.store(out_end + req, tl.where(n > 0, j, _PAD))


# ----------------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------------


class CorpusRing:
    """The corpus on the device: a ring of `capacity` token slots holding at most `max_docs` whole documents.

    `add(tokens)` appends one document with the reference's FIFO eviction (oldest whole documents out until the
    new one fits both bounds; a document longer than the ring keeps its last `capacity` tokens; an empty one is
    not added and returns -1) and returns its insertion number. It launches a few small device ops and one
    host-to-device copy of the document, never reads the device, and must not run while a captured graph that
    reads the ring is replaying on another stream (the speculator adds documents between steps, on its stream)."""

    def __init__(self, capacity: int, max_docs: int, device: torch.device | str) -> None:
        if not 1 <= capacity < 2**31:
            raise ValueError(f"capacity must be in [1, 2^31), got {capacity}")
        if max_docs < 1:
            raise ValueError(f"max_docs must be >= 1, got {max_docs}")
        self.capacity, self.max_docs, self.device = int(capacity), int(max_docs), torch.device(device)
        self.tokens = torch.zeros(self.capacity, dtype=torch.int32, device=self.device)
        self.doc_off = torch.full((self.capacity,), -1, dtype=torch.int32, device=self.device)
        self.doc_rem = torch.zeros(self.capacity, dtype=torch.int32, device=self.device)
        self.state = torch.zeros(2, dtype=torch.int64, device=self.device)  # [head, live]
        self._arange = torch.arange(self.capacity, dtype=torch.int64, device=self.device)
        self.docs: deque[tuple[int, int, int]] = deque()  # (insertion number, start slot, length), oldest first
        self.head = self.write = self.live = 0
        self.inserted = 0

    def add(self, tokens: torch.Tensor | np.ndarray | list[int]) -> int:
        doc = torch.as_tensor(np.asarray(tokens, dtype=np.int64) if not isinstance(tokens, torch.Tensor) else tokens)
        if doc.dim() != 1:
            raise ValueError(f"a document must be 1-D, got shape {tuple(doc.shape)}")
        n = int(doc.shape[0])
        if n == 0:
            return -1
        if n > self.capacity:
            doc, n = doc[-self.capacity:], self.capacity
        while self.docs and (self.live + n > self.capacity or len(self.docs) + 1 > self.max_docs):
            _, _, old = self.docs.popleft()
            self.live -= old
        start = self.write
        slots = self._arange[:n] + start
        slots = torch.where(slots >= self.capacity, slots - self.capacity, slots)
        if doc.device.type == "cpu" and self.device.type == "cuda":
            doc = doc.to(torch.int32).pin_memory().to(self.device, non_blocking=True)
        self.tokens[slots] = doc.to(device=self.device, dtype=torch.int32)
        self.doc_off[slots] = self._arange[:n].to(torch.int32)
        self.doc_rem[slots] = ((n - 1) - self._arange[:n]).to(torch.int32)
        self.write = (start + n) % self.capacity
        self.live += n
        seq = self.inserted
        self.docs.append((seq, start, n))
        self.inserted += 1
        self.head = self.docs[0][1]  # the oldest live document's first slot
        self.state[0].fill_(self.head)
        self.state[1].fill_(self.live)
        return seq

    def clear(self) -> None:
        """Empty the corpus, keeping its tensors (a captured graph reads them) and restarting insertion numbers."""
        self.docs.clear()
        self.head = self.write = self.live = 0
        self.inserted = 0
        self.state.zero_()

    def documents(self) -> list[tuple[int, np.ndarray]]:
        """(insertion number, tokens) of every live document, oldest first, read back from the device (tests)."""
        ring = self.tokens.cpu().numpy()
        return [(seq, ring[(start + np.arange(n)) % self.capacity].astype(np.int64)) for seq, start, n in self.docs]


def _k_block(k: int) -> int:
    return max(16, triton.next_power_of_2(k))


class CorpusMatcher:
    """Preallocated outputs and scratch for corpus lookups over batches of up to `max_batch` requests.

    `matcher(tokens, offsets, lengths, ring)` searches `ring` for each request's history (the ragged batch of
    `suffix_match`: int32 tokens, int64 offsets, lengths) and returns views (proposals [B, k] int32, match_len [B]
    int32, valid [B] int32, end [B] int32: the corpus position of the match, -1 for none) of the matcher's buffers,
    overwritten by the next call. One launch; no allocation, no host read: capturable in a CUDA graph.
    splits: programs per request; default enough for `capacity` tokens in blocks of `block` (at most MAX_SPLITS)."""

    def __init__(self, max_batch: int, k: int, *, nmin: int, nmax: int, policy: str = "recent",
                 capacity: int | None = None, device: torch.device | str = "cuda", block: int = DEFAULT_BLOCK,
                 splits: int | None = None, num_warps: int = 4) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if not 1 <= nmin <= nmax < 2**31:
            raise ValueError(f"need 1 <= nmin <= nmax < 2^31, got nmin={nmin}, nmax={nmax}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if block < 16 or block & (block - 1):
            raise ValueError(f"block must be a power of two >= 16, got {block}")
        if splits is None:
            splits = min(triton.cdiv(max(int(capacity or 1), 1), block), MAX_SPLITS)
        if splits < 1:
            raise ValueError(f"splits must be >= 1, got {splits}")
        self.max_batch, self.k, self.nmin, self.nmax, self.policy = int(max_batch), int(k), int(nmin), int(nmax), policy
        self.block, self.splits, self.num_warps = int(block), int(splits), int(num_warps)
        device = torch.device(device)
        self.proposals = torch.full((self.max_batch, self.k), PAD_TOKEN, dtype=torch.int32, device=device)
        self.match_len = torch.zeros(self.max_batch, dtype=torch.int32, device=device)
        self.valid = torch.zeros(self.max_batch, dtype=torch.int32, device=device)
        self.end = torch.full((self.max_batch,), PAD_TOKEN, dtype=torch.int32, device=device)
        self.scratch = torch.zeros(self.max_batch, dtype=torch.int64, device=device)  # zeros between calls
        self.arrivals = torch.zeros(self.max_batch, dtype=torch.int32, device=device)

    def __call__(self, tokens: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor, ring: CorpusRing):
        if tokens.dtype != torch.int32 or offsets.dtype != torch.int64:
            raise TypeError(f"tokens must be int32 and offsets int64, got {tokens.dtype} and {offsets.dtype}")
        batch = offsets.shape[0]
        if batch > self.max_batch:
            raise ValueError(f"batch {batch} exceeds max_batch {self.max_batch}")
        out = (self.proposals[:batch], self.match_len[:batch], self.valid[:batch], self.end[:batch])
        if batch == 0:
            return out
        _corpus_kernel[(batch, self.splits)](
            tokens, offsets, lengths, ring.tokens, ring.doc_off, ring.doc_rem, ring.state, self.scratch,
            self.arrivals, *out, self.nmin, self.nmax, self.k, ring.capacity, BLOCK=self.block,
            K_BLOCK=_k_block(self.k), EARLIEST=self.policy == "earliest", num_warps=self.num_warps)
        return out


__all__ = ["CorpusRing", "CorpusMatcher", "PAD_TOKEN", "POLICIES"]
