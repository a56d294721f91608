"""Batched suffix-match lookup on the GPU (SPEC §2.1–2.2), bit-identical to `hqlab.rules.lookup.suffix_match`.

Input is a ragged batch: all token histories concatenated into one int32 vector `tokens`, with per-request
`offsets` (int64, where the history starts) and `lengths`. For each request the kernels find the candidate end e
that maximises the packed score

    (min(match_len, nmax) << 32) | e            policy "recent"   (longest, then most recent)
    (min(match_len, nmax) << 32) | (2^32-1 - e) policy "earliest" (longest, then earliest)

and write the k tokens after e (clipped at the end of the history), match_len and valid. A score of 0 means no
match, since every real match has match_len >= nmin >= 1.

Kernel variants:
  single: one program per request scans all candidate ends, BLOCK at a time, then writes the proposal.
  split:  SPLITS programs per request, program s scanning blocks s, s+SPLITS, ...; each folds its best score into a
          per-request int64 scratch slot with atomic_max, and a tiny extract kernel turns the score into the
          proposal and resets the slot to 0 for the next call.
  fused:  the split scan in one launch: each program also bumps a per-request arrival counter, and the last
          program to arrive does the extract kernel's work (and resets both slots).
The single variant is latency bound at long contexts (one program walks ~L/BLOCK dependent iterations); the split
variants spread those iterations over the GPU.

Row offsets are int64 (the concatenated batch may exceed 2^31 elements); positions inside one history are int32,
so one history must be shorter than 2^31 tokens.

Nothing here allocates or synchronises with the host when called through `SuffixMatcher`, so a call can be
captured in a CUDA graph. This module is a leaf: it imports nothing from hqlab.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

POLICIES = ("recent", "earliest")
VARIANTS = ("auto", "single", "split", "fused")
DEFAULT_BLOCK = 1024
# "auto" uses the one-program variant only when every history fits in a few blocks: there the split variant's
# second launch costs more than the loop it removes.
SINGLE_MAX_BLOCKS = 4
# The split-scan flavour "auto" uses beyond that.
AUTO_SPLIT_VARIANT = "fused"
MAX_SPLITS = 256
# Proposal entries past `valid` hold this value.
PAD_TOKEN = -1
_PAD = tl.constexpr(PAD_TOKEN)  # the same, readable inside kernels


# ----------------------------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _low32():
    return (tl.full((), 1, tl.int64) << 32) - 1


@triton.jit
def _candidate_range(length, nmin, k, search, FULL: tl.constexpr):
    """Last position t and the inclusive range [lo, hi] of candidate ends, exactly as the reference computes it.

    With nmin >= 1, lo >= 0, so a history too short to hold any candidate (t < 1) yields hi < lo."""
    t = length - 1
    lo = nmin - 1
    lo = tl.where(search > 0, tl.maximum(lo, t - search), lo)
    if FULL:
        hi = t - k
    else:
        hi = t - 1
    return t, lo, hi


@triton.jit
def _pack(n, e, EARLIEST: tl.constexpr):
    n64 = n.to(tl.int64)
    e64 = e.to(tl.int64)
    if EARLIEST:
        low = _low32() - e64
    else:
        low = e64
    return tl.where(n > 0, (n64 << 32) | low, 0)


@triton.jit
def _score_block(hist, start, lo, hi, t, last_token, nmin, nmax, BLOCK: tl.constexpr, EARLIEST: tl.constexpr):
    """Best packed score over the candidate ends in [start, start + BLOCK) (0 where none matches nmin tokens)."""
    e = start + tl.arange(0, BLOCK)
    in_range = (e >= lo) & (e <= hi)
    x = tl.load(hist + e, mask=in_range, other=0)
    alive = in_range & (x == last_token)
    best = tl.full((), 0, dtype=tl.int64)
    # Cheap reject: with a real vocabulary the last token rarely recurs inside a block, so most blocks stop here
    # after one coalesced load. Survivors are extended one position at a time up to nmax (masked loads: dead
    # lanes read nothing). Reducing to a scalar here, inside the rare branch, keeps the common path free of
    # 64-bit vectors (fewer registers, more programs resident per SM).
    if tl.max(alive.to(tl.int32), axis=0) > 0:
        n = alive.to(tl.int32)
        for i in range(1, nmax):
            p = e - i
            ok = alive & (p >= 0)
            a = tl.load(hist + p, mask=ok, other=0)
            b = tl.load(hist + (t - i), mask=(t - i) >= 0, other=0)
            alive = ok & (a == b)
            n += alive.to(tl.int32)
        n = tl.where(n >= nmin, n, 0)
        best = tl.max(_pack(n, e, EARLIEST), axis=0)
    return best


@triton.jit
def _history(tokens, offsets, lengths, req):
    """Pointer to request `req`'s history (int64 offset) and its length as int32."""
    offset = tl.load(offsets + req).to(tl.int64)
    length = tl.load(lengths + req).to(tl.int32)
    return tokens + offset, length


@triton.jit
def _write_proposal(hist, t, score, req, k, out_tokens, out_len, out_valid, K_BLOCK: tl.constexpr,
                    EARLIEST: tl.constexpr):
    n = (score >> 32).to(tl.int32)
    low = score & _low32()
    if EARLIEST:
        e64 = _low32() - low
    else:
        e64 = low
    e = e64.to(tl.int32)
    # In 64-bit on purpose: the 32-bit form min(k, t - e) here was compiled by ptxas 12.8 (sm_90) into a fused
    # add-min that dropped the negation of e (valid = min(k, t + e)); the GPU tests caught it.
    gap = t.to(tl.int64) - e64
    valid = tl.where(n > 0, tl.minimum(gap, k.to(tl.int64)), 0).to(tl.int32)
    j = tl.arange(0, K_BLOCK)
    proposal = tl.load(hist + (e + 1 + j), mask=j < valid, other=_PAD)
    row = req.to(tl.int64) * k
    tl.store(out_tokens + row + j, proposal, mask=j < k)
    tl.store(out_len + req, n)
    tl.store(out_valid + req, valid)


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------


# Scalar parameters are not specialised on their values: one compiled kernel serves every nmin/nmax/k/search.
_RUNTIME_SCALARS = ["nmin", "nmax", "k", "search"]


@triton.jit(do_not_specialize=_RUNTIME_SCALARS)
def _single_kernel(tokens, offsets, lengths, out_tokens, out_len, out_valid, nmin, nmax, k, search,
                   BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, FULL: tl.constexpr, EARLIEST: tl.constexpr):
    req = tl.program_id(0)
    hist, length = _history(tokens, offsets, lengths, req)
    t, lo, hi = _candidate_range(length, nmin, k, search, FULL)
    last_token = tl.load(hist + t, mask=t >= 0, other=0)
    score = tl.full((), 0, dtype=tl.int64)
    for start in range(lo, hi + 1, BLOCK):
        score = tl.maximum(score, _score_block(hist, start, lo, hi, t, last_token, nmin, nmax, BLOCK, EARLIEST))
    _write_proposal(hist, t, score, req, k, out_tokens, out_len, out_valid, K_BLOCK, EARLIEST)


@triton.jit
def _split_share(hist, t, lo, hi, split, splits, nmin, nmax, BLOCK: tl.constexpr, EARLIEST: tl.constexpr):
    """Best score over this program's share of the candidate blocks: blocks split, split + splits, ..."""
    n_blocks = tl.maximum(hi - lo + BLOCK, 0) // BLOCK  # ceil((hi - lo + 1) / BLOCK), 0 when hi < lo
    best = tl.full((), 0, dtype=tl.int64)
    if split < n_blocks:
        last_token = tl.load(hist + t)
        for blk in range(split, n_blocks, splits):
            start = lo + blk * BLOCK
            best = tl.maximum(best, _score_block(hist, start, lo, hi, t, last_token, nmin, nmax, BLOCK, EARLIEST))
    return best


@triton.jit(do_not_specialize=_RUNTIME_SCALARS)
def _split_scan_kernel(tokens, offsets, lengths, scratch, nmin, nmax, k, search,
                       BLOCK: tl.constexpr, FULL: tl.constexpr, EARLIEST: tl.constexpr):
    req = tl.program_id(0)
    hist, length = _history(tokens, offsets, lengths, req)
    t, lo, hi = _candidate_range(length, nmin, k, search, FULL)
    score = _split_share(hist, t, lo, hi, tl.program_id(1), tl.num_programs(1), nmin, nmax, BLOCK, EARLIEST)
    if score > 0:
        tl.atomic_max(scratch + req, score, sem="relaxed")  # the kernel boundary orders it before the extract


@triton.jit(do_not_specialize=_RUNTIME_SCALARS)
def _fused_kernel(tokens, offsets, lengths, scratch, arrivals, out_tokens, out_len, out_valid, nmin, nmax, k, search,
                  BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, FULL: tl.constexpr, EARLIEST: tl.constexpr):
    """Split scan whose last program to finish, per request, also writes the proposal: one launch."""
    req = tl.program_id(0)
    splits = tl.num_programs(1)
    hist, length = _history(tokens, offsets, lengths, req)
    t, lo, hi = _candidate_range(length, nmin, k, search, FULL)
    score = _split_share(hist, t, lo, hi, tl.program_id(1), splits, nmin, nmax, BLOCK, EARLIEST)
    if score > 0:
        tl.atomic_max(scratch + req, score, sem="relaxed")
    # Every program of the request arrives once. The arrival's release orders the program's atomic_max before it
    # and its acquire lets the last program to arrive see every score; that one also resets both slots.
    arrived = tl.atomic_add(arrivals + req, 1, sem="acq_rel")
    if arrived == splits - 1:
        best = tl.atomic_xchg(scratch + req, tl.zeros((), dtype=tl.int64))
        tl.store(arrivals + req, 0)
        _write_proposal(hist, t, best, req, k, out_tokens, out_len, out_valid, K_BLOCK, EARLIEST)


@triton.jit(do_not_specialize=["k"])
def _split_extract_kernel(tokens, offsets, lengths, scratch, out_tokens, out_len, out_valid, k,
                          K_BLOCK: tl.constexpr, EARLIEST: tl.constexpr):
    req = tl.program_id(0)
    hist, length = _history(tokens, offsets, lengths, req)
    score = tl.load(scratch + req)
    tl.store(scratch + req, tl.zeros((), dtype=tl.int64))  # ready for the next call
    _write_proposal(hist, length - 1, score, req, k, out_tokens, out_len, out_valid, K_BLOCK, EARLIEST)


# ----------------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------------


def _k_block(k: int) -> int:
    # At least 16 so that every k <= 16 shares one compiled kernel; entries j >= k are masked.
    return max(16, triton.next_power_of_2(k))


def check_params(*, nmin: int, nmax: int, k: int, search: int = 0, policy: str = "recent") -> None:
    """Raise ValueError for parameters the kernels do not implement (they never silently differ)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if not 1 <= nmin <= nmax:
        raise ValueError(f"need 1 <= nmin <= nmax, got nmin={nmin}, nmax={nmax}")
    if nmax >= 2**31:
        raise ValueError(f"nmax must fit in 31 bits, got {nmax}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if search < 0:
        raise ValueError(f"search must be >= 0 (0 = whole history), got {search}")


def plan_launch(max_len: int | None, variant: str, block: int = DEFAULT_BLOCK,
                splits: int | None = None) -> tuple[str, int]:
    """(variant, programs per request) for histories of at most `max_len` tokens.

    max_len only steers speed: every launch scans each history to its end whatever its length."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    blocks = triton.cdiv(max(int(max_len), 1), block) if max_len is not None else MAX_SPLITS
    if variant == "auto":
        variant = "single" if max_len is not None and blocks <= SINGLE_MAX_BLOCKS else AUTO_SPLIT_VARIANT
    if variant == "single":
        return "single", 1
    if splits is None:
        splits = min(blocks, MAX_SPLITS)
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    return variant, int(splits)


def _check_inputs(tokens: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor) -> None:
    if tokens.dtype != torch.int32 or tokens.dim() != 1:
        raise TypeError(f"tokens must be a 1-D int32 tensor, got {tokens.dtype} {tuple(tokens.shape)}")
    if offsets.dtype != torch.int64 or offsets.dim() != 1:
        raise TypeError(f"offsets must be a 1-D int64 tensor, got {offsets.dtype} {tuple(offsets.shape)}")
    if lengths.dtype not in (torch.int32, torch.int64) or lengths.shape != offsets.shape:
        raise TypeError(f"lengths must be int32 or int64 shaped like offsets, got {lengths.dtype} "
                        f"{tuple(lengths.shape)}")
    if not (tokens.is_contiguous() and offsets.is_contiguous() and lengths.is_contiguous()):
        raise ValueError("tokens, offsets and lengths must be contiguous")
    if not (tokens.device == offsets.device == lengths.device):
        raise ValueError("tokens, offsets and lengths must be on one device")


class SuffixMatcher:
    """Preallocated outputs and scratch for repeated lookups over batches of up to `max_batch` requests.

    `matcher(tokens, offsets, lengths)` launches the kernels and returns views
    (proposals [B, k] int32, match_len [B] int32, valid [B] int32) of the matcher's own buffers, overwritten by
    the next call. Proposal entries past `valid` are -1. The call neither allocates nor synchronises, so it can
    be captured in a CUDA graph (capture with the same input tensors that will be refilled before each replay).

    variant: "single", "split", "fused" (see the module docstring) or "auto": single when max_len is at most
    SINGLE_MAX_BLOCKS blocks, else AUTO_SPLIT_VARIANT.
    max_len: the longest history expected; it picks the variant under "auto" and the programs per request of the
    split variants (up to MAX_SPLITS), and affects speed only.
    """

    def __init__(self, max_batch: int, k: int, *, nmin: int = 6, nmax: int = 12, search: int = 0,
                 full: bool = False, policy: str = "recent", variant: str = "auto", max_len: int | None = None,
                 device: torch.device | str = "cuda", block: int = DEFAULT_BLOCK, splits: int | None = None,
                 num_warps: int = 4):
        check_params(nmin=nmin, nmax=nmax, k=k, search=search, policy=policy)
        if block < 16 or block & (block - 1):
            raise ValueError(f"block must be a power of two >= 16, got {block}")
        self.max_batch, self.k, self.nmin, self.nmax = int(max_batch), int(k), int(nmin), int(nmax)
        self.search, self.full, self.policy = int(search), bool(full), policy
        self.block, self.num_warps = int(block), int(num_warps)
        self.variant, self.splits = plan_launch(max_len, variant, self.block, splits)
        device = torch.device(device)
        self.proposals = torch.full((self.max_batch, self.k), PAD_TOKEN, dtype=torch.int32, device=device)
        self.match_len = torch.zeros(self.max_batch, dtype=torch.int32, device=device)
        self.valid = torch.zeros(self.max_batch, dtype=torch.int32, device=device)
        # Invariant between calls: all zeros (the extract step resets what the scan wrote).
        self.scratch = torch.zeros(self.max_batch, dtype=torch.int64, device=device)
        self.arrivals = torch.zeros(self.max_batch, dtype=torch.int32, device=device)

    def __call__(self, tokens: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor):
        _check_inputs(tokens, offsets, lengths)
        batch = offsets.shape[0]
        if batch > self.max_batch:
            raise ValueError(f"batch {batch} exceeds max_batch {self.max_batch}")
        out = (self.proposals[:batch], self.match_len[:batch], self.valid[:batch])
        if batch == 0:
            return out
        flags = dict(EARLIEST=self.policy == "earliest", num_warps=self.num_warps)
        scalars = (self.nmin, self.nmax, self.k, self.search)
        k_block = _k_block(self.k)
        if self.variant == "single":
            _single_kernel[(batch,)](tokens, offsets, lengths, *out, *scalars, BLOCK=self.block, K_BLOCK=k_block,
                                     FULL=self.full, **flags)
        elif self.variant == "fused":
            _fused_kernel[(batch, self.splits)](tokens, offsets, lengths, self.scratch, self.arrivals, *out, *scalars,
                                                BLOCK=self.block, K_BLOCK=k_block, FULL=self.full, **flags)
        else:
            _split_scan_kernel[(batch, self.splits)](tokens, offsets, lengths, self.scratch, *scalars,
                                                     BLOCK=self.block, FULL=self.full, **flags)
            _split_extract_kernel[(batch,)](tokens, offsets, lengths, self.scratch, *out, self.k, K_BLOCK=k_block,
                                            EARLIEST=flags["EARLIEST"], num_warps=1)
        return out


def suffix_match_batch(tokens: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor, *, nmin: int,
                       nmax: int, k: int, search: int = 0, full: bool = False, policy: str = "recent",
                       variant: str = "auto", max_len: int | None = None, block: int = DEFAULT_BLOCK,
                       splits: int | None = None, scratch: torch.Tensor | None = None):
    """One-shot batched lookup: returns new (proposals [B, k] int32, match_len [B] int32, valid [B] int32).

    Convenient, not for the hot path: it allocates outputs, and unless `max_len` (or `splits`, or variant
    "single") is given it reads max(lengths) back to the host to plan the launch. Use `SuffixMatcher` in a decode loop.
    scratch: optional int64 zeros of at least B entries for the split variants (left zeroed on return).
    """
    _check_inputs(tokens, offsets, lengths)
    if variant != "single" and splits is None and max_len is None and lengths.numel():
        max_len = int(lengths.max())
    batch = offsets.shape[0]
    matcher = SuffixMatcher(max(batch, 1), k, nmin=nmin, nmax=nmax, search=search, full=full, policy=policy,
                            variant=variant, max_len=max_len, device=tokens.device, block=block, splits=splits)
    if scratch is not None:
        if scratch.dtype != torch.int64 or scratch.numel() < batch:
            raise ValueError("scratch must be int64 with at least one entry per request")
        matcher.scratch = scratch
    return matcher(tokens, offsets, lengths)


# ----------------------------------------------------------------------------------------------------------------
# Torch-vectorized baseline (all candidate ends at once, unfold style, like vLLM's GPU n-gram drafter)
# ----------------------------------------------------------------------------------------------------------------


def suffix_match_torch(padded: torch.Tensor, lengths: torch.Tensor, *, nmin: int, nmax: int, k: int,
                       search: int = 0, full: bool = False, policy: str = "recent"):
    """Same result as the kernels from a padded [B, W] int32 batch (history b in padded[b, :lengths[b]]).

    Materialises a [B, W, nmax] comparison, so it moves about nmax times the bytes of the kernels. Static shapes
    only: capturable in a CUDA graph."""
    check_params(nmin=nmin, nmax=nmax, k=k, search=search, policy=policy)
    batch, width = padded.shape
    dev = padded.device
    lengths = lengths.to(torch.int64)
    t = lengths - 1
    steps = torch.arange(nmax, device=dev)
    suffix = padded.gather(1, (t[:, None] - steps).clamp(min=0, max=max(width - 1, 0)))  # h[t - i]
    windows = torch.nn.functional.pad(padded, (nmax - 1, 0)).unfold(1, nmax, 1).flip(-1)  # h[e - i]
    ends = torch.arange(width, device=dev)
    inside = (ends[:, None] - steps[None, :]) >= 0
    equal = (windows == suffix[:, None, :]) & inside
    run = equal.to(torch.int32).cumprod(-1).sum(-1)  # match length, capped at nmax

    lo = torch.full_like(t, nmin - 1)
    if search > 0:
        lo = torch.maximum(lo, t - search)
    hi = t - k if full else t - 1
    candidate = (ends[None, :] >= lo[:, None]) & (ends[None, :] <= hi[:, None]) & (run >= nmin)
    low = (2**32 - 1 - ends) if policy == "earliest" else ends
    score = torch.where(candidate, (run.to(torch.int64) << 32) | low[None, :], 0).amax(1)

    match_len = (score >> 32).to(torch.int32)
    low_best = score & (2**32 - 1)
    end = (2**32 - 1 - low_best) if policy == "earliest" else low_best
    valid = torch.where(match_len > 0, torch.minimum(torch.full_like(t, k), t - end), 0)
    cols = torch.arange(k, device=dev)
    picked = padded.gather(1, (end[:, None] + 1 + cols).clamp(max=max(width - 1, 0)))
    proposals = torch.where(cols[None, :] < valid[:, None], picked, PAD_TOKEN).to(torch.int32)
    return proposals, match_len, valid.to(torch.int32)
