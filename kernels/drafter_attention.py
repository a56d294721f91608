"""The fused speculator's drafter attention in one Triton kernel per layer call (split-K, fused combine).

A drafting pass of `hqlab.engines.vllm.drafter.StaticQwen2` feeds Q = 16 query rows per request (1 to 4 requests)
through the 0.5B's 24 layers (14 query heads, 2 KV heads of 64). Its attention ran in vLLM's FlashAttention 3:
two kernels per layer, ~14.8 us per layer on an H200 at 2,048 cached positions (0.35 ms of a 1.5 ms pass), for
work that reads ~1 MB of K/V per request. Here it is one launch:

- grid (kv_heads, splits, n): a program takes ALL Q * groups query rows of one (request, KV head) as one M tile
  (row m = i * groups + g: query i, head kv_head * groups + g, as `StaticQwen2._mask` stacks them), so the KV
  head's keys and values are read once for all its query heads, and the key range
  [split * chunk, (split + 1) * chunk) of its causal end start[b] + Q, chunk = that end / splits in whole
  blocks (`split_chunk`, on the device: a request with 2,000 keys in a 4,096-position bucket gives every split
  work, not half of them);
- each program runs an online softmax (float32, exp2 with log2(e) folded into the scale) over blocks of BLOCK_N
  keys with tl.dot (the cache's dtype in, float32 accumulate), masking keys past each query row's own position;
- with one split it writes the output; with more it writes its partial (running max, running sum, unnormalised
  accumulator, float32) to a workspace and counts itself in on a per-(request, KV head) counter (acq_rel atomic);
  the program that arrives last combines the splits in split order (so the result is the same bit for bit from
  call to call, whatever order the programs ran in), writes the output and resets the counter to zero for the
  next launch (a CUDA-graph replay included).

Cache layout (StaticQwen2's): a layer's k_cache, v_cache are contiguous [slots * blocks, BLOCK, kv_heads, D]; as
[slots * max_len, kv_heads, D] request slot s's position p is row s * max_len + p. Only positions below each
request's start + Q (and below attn_len) are read.

Nothing here allocates beyond the output or reads a device value on the host (the workspace is allocated once, by
`attention_workspace`), so a call can be captured in a CUDA graph. Under TRITON_INTERPRET=1 the kernel runs on CPU
tensors (the tests). This module is a leaf: it imports nothing from hqlab.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# the layers' dot (float32 sums; bf16 widened in Triton's interpreter) and the rule that picks its precision
from hqlab_kernels.drafter_layers import TILES_ENV, _dot, _precision, sweep_tiles

# The defaults are the best of an H200 tile sweep (data/results/drafter_layer_tiles/t4/sweep.json): 16 query rows a
# program, 64 keys a loop step, 4 warps, 3 stages, up to 8 key splits. At 2,048 positions a layer then takes 8.4 us
# at one request of 16 queries (FlashAttention 3: 12.9; one 128-row tile of 32 keys, the best of the earlier sweep
# data/results/drafter_layer_tiles/t1/: 13.1), 9.4 at 32 queries (FlashAttention 13.3), 10.8 at four requests of 16
# (14.4).
BLOCK_N = 64  # keys per loop step: a [BLOCK_M, 64] score tile, K and V tiles of 64 x 64 (8 KB each in bf16)
MAX_TILE_ROWS = 256  # the most query rows (Q * groups) one program holds: 256 x 64 float32 is 64 KB of registers
# default_splits' bounds (its docstring says why): the sweep's best program count at four requests, 8 splits x 4
# requests x 2 KV heads
TARGET_PROGRAMS = 64
MIN_SPLIT_KEYS = 128  # keys per split at the least (also at least one BLOCK_N)
MAX_SPLITS = 8  # the combine is serial in the last program: it reads splits x rows x D float32 from L2
NUM_STAGES: int | None = 3  # Triton's pipeline depth for the key loop (None: Triton's default)
NUM_WARPS: int | None = 4  # warps per program (None: `warps`' rule)
# Query rows per program (None: all Q * groups rows of a KV head in one tile, at most MAX_BLOCK_M). Fewer rows per
# program mean more programs per split and, above all, a combine that reads only its own rows' partials: with one
# tile of the 0.5B's 112 rows and 16 splits the last program alone reads 16 x 112 x 64 float32 (459 KB) from L2.
BLOCK_M: int | None = 16
# The largest tile where BLOCK_M is None: a k = 31 pass (32 queries x 7 heads = 224 rows) takes two tiles of 128
# rows, not one of 256 with 16 warps: such passes made the k = 31 config's chat steps 0.4 ms dearer
# (data/results/vllm_fused/fl1/).
MAX_BLOCK_M = 128
# programmatic dependent launch on Hopper and later: off unless HQLAB_DRAFTER_PDL=1 (hqlab_kernels.drafter_layers.PDL
# says why)
PDL = os.environ.get("HQLAB_DRAFTER_PDL", "0") == "1"
LOG2E = 1.4426950408889634


def set_tiles(table: dict[str, dict]) -> None:
    """Take a tile sweep's attention entries (experiments/drafter_kernel_tiles/drafter_layer_tiles.py: "attention@1",
    "attention@4", the best block_m, splits, block_n, warps and stages at one and four requests): the batch-1 best sets
    BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES and MAX_SPLITS, and TARGET_PROGRAMS becomes the batch-4 best's program count
    (splits x 4 requests x 2 KV heads), so `default_splits` gives each sweep's choice back. Other entries are
    ignored."""
    global BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES, MAX_SPLITS, TARGET_PROGRAMS
    one, four = table.get("attention@1"), table.get("attention@4")
    if not one:
        return
    BLOCK_M, BLOCK_N = one.get("block_m"), one["block_n"]
    NUM_WARPS, NUM_STAGES, MAX_SPLITS = one["num_warps"], one["num_stages"], one["splits"]
    TARGET_PROGRAMS = four["splits"] * 4 * 2 if four else one["splits"] * 2


def interpreted() -> bool:
    """True where the kernel runs in Triton's interpreter (TRITON_INTERPRET=1 when this module was imported): the
    only way it runs on CPU tensors."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_decode_attention_kernel, InterpretedFunction)


def tile_rows(q_len: int, groups: int) -> int:
    """The rows of a KV head's whole query tile: Q * groups rounded up to a power of two, at least 16 (the
    tensor cores' M); the default BLOCK_M."""
    return max(16, triton.next_power_of_2(q_len * groups))


def warps(block_m: int) -> int:
    """Default warps per program: 4 up to 64 query rows, one per 16 rows beyond (8 at the 0.5B's 128-row tile, 16 at
    256), what keeps the kernel free of register spills at block_n 64 and 3 stages (ptxas -v for sm_90a, bf16, D=64:
    128 registers at 128 rows and 8 warps, and at 256 rows and 16; 4 warps at 128 rows take all 255, 8 at 256 spill)."""
    return max(4, block_m // 16)


def split_chunk(keys: int, splits: int, block_n: int = BLOCK_N) -> int:
    """Keys per split of a request whose causal end is `keys` (start + Q): keys / splits rounded up to whole blocks
    of block_n (the kernel computes the same on the device). Splits beyond keys / chunk get an empty key range."""
    return triton.cdiv(triton.cdiv(keys, splits), block_n) * block_n


def default_splits(attn_len: int, n: int, kv_heads: int, *, block_n: int | None = None) -> int:
    """How many key splits suit a call of n requests over attn_len positions (to be tuned on the GPU).

    A program's work is its key range: ~4 * BLOCK_M * D flops and 4 D bytes of K/V per key. With only n * kv_heads
    programs per split (2 to 8 for the 0.5B's drafting passes) one split would leave all but a few SMs idle and walk
    thousands of keys in one dependent loop, so the keys are split until about TARGET_PROGRAMS (one wave) run. Two
    things bound that: each split should keep at least MIN_SPLIT_KEYS keys (and one block_n), or its fixed costs
    (loading the query tile, writing a BLOCK_M x D float32 partial, ~28 KB at the 0.5B's 112 rows) outweigh its keys;
    and at most MAX_SPLITS splits, because the program that arrives last reads every split's partial alone, so the
    combine's time grows with splits (16 x 28 KB of L2 reads by one SM: roughly 1 to 3 us) while the key loop's
    shrinks. At 2,048 positions: 8 splits for 1 to 4 requests (16 to 64 programs of 256 keys per row tile)."""
    if attn_len < 1 or n < 1 or kv_heads < 1:
        raise ValueError(f"attn_len, n and kv_heads must be >= 1, got {attn_len}, {n} and {kv_heads}")
    by_programs = TARGET_PROGRAMS // (n * kv_heads)
    by_keys = triton.cdiv(attn_len, max(MIN_SPLIT_KEYS, block_n or BLOCK_N))
    return max(1, min(by_programs, by_keys, MAX_SPLITS))


@dataclass(frozen=True)
class AttentionWorkspace:
    """Scratch of the split calls, allocated once (`attention_workspace`) and reused by every call, layer and
    CUDA-graph replay on one stream (two calls in flight at once on different streams need one each).

    counters: int32, one per (request, KV head); zero between calls (each call's last program resets its own).
    row_max, row_sum: float32, one per (request, KV head, split, query row) of a call: its split's running max (in
    log2 units) and running sum. acc: float32, head_dim per such row: the unnormalised accumulator."""

    counters: torch.Tensor
    row_max: torch.Tensor
    row_sum: torch.Tensor
    acc: torch.Tensor


def attention_workspace(n_max: int, heads: int, q_max: int, splits: int, head_dim: int,
                        device: str | torch.device) -> AttentionWorkspace:
    """The workspace of calls of up to n_max requests of up to q_max query rows, `heads` query heads of head_dim,
    and up to `splits` splits (any KV head count: a call uses n * kv_heads <= n_max * heads counters and
    n * splits * Q * heads partial rows)."""
    for name, value in (("n_max", n_max), ("heads", heads), ("q_max", q_max), ("splits", splits),
                        ("head_dim", head_dim)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    rows = n_max * splits * q_max * heads
    return AttentionWorkspace(  # counters: one per (request, KV head, row tile), at most one per query row
        counters=torch.zeros(n_max * q_max * heads, dtype=torch.int32, device=device),
        row_max=torch.zeros(rows, dtype=torch.float32, device=device),
        row_sum=torch.zeros(rows, dtype=torch.float32, device=device),
        acc=torch.zeros(rows * head_dim, dtype=torch.float32, device=device))


# ----------------------------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["max_len", "cache_slots", "attn_len"])
def _decode_attention_kernel(q, k_cache, v_cache, slots, start, out, counters, ws_max, ws_sum, ws_acc, qk_scale,
                             max_len, cache_slots, attn_len, Q_LEN: tl.constexpr, HEADS: tl.constexpr,
                             KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                             GDC: tl.constexpr):
    """Program (kv_head, split, request): the request's query rows of the KV head's groups query heads against the
    keys [split * chunk, (split + 1) * chunk) clipped to [0, min(start + Q, attn_len)) (see the module docstring)."""
    if GDC:  # programmatic dependent launch: the next kernel may launch; wait for the previous one's writes
        gdc_launch_dependents()
        gdc_wait()
    groups: tl.constexpr = HEADS // KV_HEADS
    rows_used: tl.constexpr = Q_LEN * groups
    row_tiles: tl.constexpr = (rows_used + BLOCK_M - 1) // BLOCK_M
    kvh = tl.program_id(0) // row_tiles
    tile = tl.program_id(0) % row_tiles
    split = tl.program_id(1)
    b = tl.program_id(2)

    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # this program's rows of the KV head's Q * groups
    d = tl.arange(0, HEAD_DIM)
    row_ok = m < rows_used
    i = m // groups  # query index within the request
    head = kvh * groups + m % groups
    # q and out share their layout: [n * Q, heads, D], request b's query i in row b * Q + i
    qo_offsets = ((b * Q_LEN + i) * HEADS + head)[:, None] * HEAD_DIM + d[None, :]
    q_tile = tl.load(q + qo_offsets, mask=row_ok[:, None], other=0.0)

    slot = tl.load(slots + b).to(tl.int64)
    first = tl.load(start + b).to(tl.int32)
    pos = first + i  # each row's position: it sees keys 0..pos
    end = tl.minimum(first + Q_LEN, attn_len)  # keys past the request's last row are never read
    end = tl.where((slot >= 0) & (slot < cache_slots), end, 0)  # nor those of a slot outside the cache
    chunk = tl.cdiv(tl.cdiv(end, SPLITS), BLOCK_N) * BLOCK_N  # split_chunk(end, SPLITS, BLOCK_N)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, end)

    # the slot's rows of the flattened cache, at this KV head; key p is `row_stride` elements further per position
    row_stride: tl.constexpr = KV_HEADS * HEAD_DIM
    k_base = k_cache + slot * max_len * row_stride + kvh * HEAD_DIM
    v_base = v_cache + slot * max_len * row_stride + kvh * HEAD_DIM
    n_offsets = tl.arange(0, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max of the scaled scores (log2 units)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK_N):
        keys = k0 + n_offsets
        key_ok = keys < hi
        k_tile = tl.load(k_base + keys[None, :] * row_stride + d[:, None], mask=key_ok[None, :], other=0.0)  # [D, N]
        scores = _dot(q_tile, k_tile, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), PRECISION) * qk_scale
        visible = key_ok[None, :] & (keys[None, :] <= pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # a row that has seen no visible key yet keeps max -inf: shift by 0 there, so exp2 gives 0, never nan
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(scores - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_tile = tl.load(v_base + keys[:, None] * row_stride + d[None, :], mask=key_ok[:, None], other=0.0)  # [N, D]
        acc = _dot(p.to(v_tile.dtype), v_tile, acc * alpha[:, None], PRECISION)
        m_i = m_new

    dtype = out.dtype.element_ty
    if SPLITS == 1:
        # every row sees key 0 (split 0 holds it) unless its slot or position is out of range: zeros then
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out + qo_offsets, o.to(dtype), mask=row_ok[:, None])
    else:
        pair = b * KV_HEADS + kvh  # (request, KV head)
        ws_rows = (pair * SPLITS).to(tl.int64) * rows_used + m  # split s's rows are s * rows_used further
        counter = counters + pair * row_tiles + tile  # one per (request, KV head, row tile)
        mine = ws_rows + split * rows_used
        tl.store(ws_max + mine, m_i, mask=row_ok)
        tl.store(ws_sum + mine, l_i, mask=row_ok)
        tl.store(ws_acc + mine[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None])
        # All threads' partial stores precede the arrival (the barrier); the arrival (one thread's atomic, its
        # result broadcast to the program) releases them at GPU scope, and the last arrival's acquire, passed on
        # to all its threads by the second barrier, lets its .cg loads (L2, past the SM's L1) see every split's.
        # The branch is uniform over the program: every thread holds the same `arrived`.
        tl.debug_barrier()
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            tl.debug_barrier()
            total_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            for s in range(SPLITS):
                s_max = tl.load(ws_max + ws_rows + s * rows_used, mask=row_ok, other=float("-inf"),
                                cache_modifier=".cg")
                total_max = tl.maximum(total_max, s_max)
            shift = tl.where(total_max == float("-inf"), 0.0, total_max)
            total_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
            total = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            for s in range(SPLITS):  # in split order: the same sums, bit for bit, on every call
                rows_s = ws_rows + s * rows_used
                s_max = tl.load(ws_max + rows_s, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
                s_sum = tl.load(ws_sum + rows_s, mask=row_ok, other=0.0, cache_modifier=".cg")
                s_acc = tl.load(ws_acc + rows_s[:, None] * HEAD_DIM + d[None, :], mask=row_ok[:, None], other=0.0,
                                cache_modifier=".cg")
                weight = tl.exp2(s_max - shift)  # 0 for a split that saw no key of the row
                total_sum += weight * s_sum
                total += weight[:, None] * s_acc
            o = total / tl.where(total_sum > 0, total_sum, 1.0)[:, None]
            tl.store(out + qo_offsets, o.to(dtype), mask=row_ok[:, None])
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch


# ----------------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------------


def _check_block(name: str, value: int, minimum: int) -> int:
    if not isinstance(value, int) or value < minimum or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value}")
    return value


def _check_index(name: str, t: torch.Tensor, q: torch.Tensor) -> int:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an int32 or int64 vector [n], got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if t.device != q.device:
        raise ValueError(f"{name} must be on {q.device} like q, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return t.shape[0]


def _check_workspace(workspace: AttentionWorkspace | None, n: int, kv_heads: int, q_len: int, heads: int,
                     splits: int, head_dim: int, device: torch.device, row_tiles: int = 1) -> None:
    if workspace is None:
        raise ValueError(f"workspace is needed for splits={splits} > 1 (attention_workspace allocates one)")
    if not isinstance(workspace, AttentionWorkspace):
        raise ValueError(f"workspace must be an AttentionWorkspace (attention_workspace), got "
                         f"{type(workspace).__name__}")
    rows = n * splits * q_len * heads
    need = {"counters": (torch.int32, n * kv_heads * row_tiles), "row_max": (torch.float32, rows),
            "row_sum": (torch.float32, rows), "acc": (torch.float32, rows * head_dim)}
    for field, (dtype, size) in need.items():
        t = getattr(workspace, field)
        if t.device != device:
            raise ValueError(f"workspace.{field} must be on {device} like q, got {t.device}")
        if t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"workspace.{field} must be a contiguous {dtype} tensor, got {t.dtype}"
                             f"{'' if t.is_contiguous() else ' (not contiguous)'}")
        if t.numel() < size:
            raise ValueError(f"workspace is too small for n={n} requests of Q={q_len} rows, {heads} heads and "
                             f"splits={splits}: workspace.{field} holds {t.numel()} entries, the call needs {size} "
                             f"(attention_workspace(n_max, heads, q_max, splits, head_dim, device))")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     start: torch.Tensor, *, max_len: int, attn_len: int, splits: int | None = None,
                     block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                     block_m: int | None = None, workspace: AttentionWorkspace | None = None) -> torch.Tensor:
    """Causal grouped-query attention of n requests' query rows over their cached keys: o [n * Q, heads * D].

    q: [n * Q, heads, D] contiguous, request b's query i in row b * Q + i (n = slots.numel()); query i of request b
    sits at position start[b] + i and attends to positions 0..start[b] + i of cache slot slots[b] (its own K/V
    already written there). k_cache, v_cache: one layer's caches, contiguous, ending in [kv_heads, D], holding a
    whole number of slots of max_len positions (StaticQwen2's [slots * blocks, BLOCK, kv_heads, D]). slots, start:
    int32 or int64 [n] on q's device. attn_len: a bound on the positions read (every start[b] + Q - 1 < attn_len,
    which the caller guarantees; nothing at or past it is read). Query head h uses KV head h // (heads // kv_heads);
    the scale is 1 / sqrt(D); softmax in float32; o in q's dtype. A request whose slot lies outside the cache (or a
    row at a negative position) gets zeros.

    splits: key splits (default `default_splits`); beyond 1 the call needs a `workspace` (`attention_workspace`).
    block_n, num_warps, num_stages, block_m: tuning (keys per loop step; Triton's launch options; query rows per
    program, default all of a KV head's, as BLOCK_M)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a [n * Q, heads, head_dim] tensor, got shape {tuple(getattr(q, 'shape', ()))}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if not q.is_contiguous():
        raise ValueError("q must be contiguous")
    rows, heads, head_dim = q.shape
    _check_block("head_dim", head_dim, 16)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(cache, torch.Tensor) or cache.dim() < 2 or cache.shape[-1] != head_dim:
            raise ValueError(f"{name} must end in [kv_heads, head_dim={head_dim}], got shape "
                             f"{tuple(getattr(cache, 'shape', ()))}")
        if cache.dtype != q.dtype or cache.device != q.device:
            raise ValueError(f"{name} must be {q.dtype} on {q.device} like q, got {cache.dtype} on {cache.device}")
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    kv_heads = k_cache.shape[-2]
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"q's heads ({heads}) must be a multiple of the caches' kv_heads ({kv_heads})")
    groups = heads // kv_heads
    if not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be an int >= 1, got {max_len}")
    if k_cache.numel() == 0 or k_cache.numel() % (max_len * kv_heads * head_dim):
        raise ValueError(f"k_cache must hold a whole number (>= 1) of slots of max_len={max_len} positions x "
                         f"{kv_heads} KV heads x {head_dim}, got {k_cache.numel()} elements (shape "
                         f"{tuple(k_cache.shape)})")
    cache_slots = k_cache.numel() // (max_len * kv_heads * head_dim)
    n = _check_index("slots", slots, q)
    if n < 1:
        raise ValueError("slots must hold at least one request")
    if _check_index("start", start, q) != n:
        raise ValueError(f"start must have as many entries as slots ({n}), got {start.shape[0]}")
    if rows % n or rows == 0:
        raise ValueError(f"q's rows ({rows}) must be a whole, nonzero number Q of query rows per request for "
                         f"n={n} requests (slots)")
    q_len = rows // n
    if q_len * groups > MAX_TILE_ROWS:
        raise ValueError(f"q: Q * groups = {q_len} * {groups} query rows per KV head exceed one program's tile of "
                         f"at most {MAX_TILE_ROWS}")
    if not isinstance(attn_len, int) or not q_len <= attn_len <= max_len:
        raise ValueError(f"attn_len must be an int in [Q={q_len}, max_len={max_len}], got {attn_len}")
    block_n = _check_block("block_n", BLOCK_N if block_n is None else block_n, 16)
    num_warps = NUM_WARPS if num_warps is None else num_warps
    num_stages = NUM_STAGES if num_stages is None else num_stages
    if splits is None:
        splits = default_splits(attn_len, n, kv_heads, block_n=block_n)
    if not isinstance(splits, int) or splits < 1:
        raise ValueError(f"splits must be an int >= 1, got {splits}")
    if num_stages is not None and num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_warps is not None:
        _check_block("num_warps", num_warps, 1)
    block_m = BLOCK_M if block_m is None else block_m
    block_m = min(tile_rows(q_len, groups), MAX_BLOCK_M) if block_m is None else \
        min(_check_block("block_m", block_m, 16), tile_rows(q_len, groups))
    row_tiles = triton.cdiv(q_len * groups, block_m)
    out = torch.empty(rows, heads * head_dim, dtype=q.dtype, device=q.device)
    if splits > 1:
        _check_workspace(workspace, n, kv_heads, q_len, heads, splits, head_dim, q.device, row_tiles)
        counters, ws_max, ws_sum, ws_acc = workspace.counters, workspace.row_max, workspace.row_sum, workspace.acc
    else:  # unused by the one-split kernel: any float32 / int32 pointers do
        counters, ws_max, ws_sum, ws_acc = slots, out, out, out
    options = {"num_warps": num_warps or warps(block_m)}
    if num_stages is not None:
        options["num_stages"] = num_stages
    gdc = PDL and q.device.type == "cuda" and torch.cuda.get_device_capability(q.device)[0] >= 9
    if gdc:
        options["launch_pdl"] = True
    _decode_attention_kernel[(kv_heads * row_tiles, splits, n)](
        q, k_cache, v_cache, slots, start, out, counters, ws_max, ws_sum, ws_acc, LOG2E / math.sqrt(head_dim),
        max_len, cache_slots, attn_len, Q_LEN=q_len, HEADS=heads,
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, SPLITS=splits, BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION=_precision(q), GDC=gdc, **options)
    return out


__all__ = ["AttentionWorkspace", "BLOCK_N", "set_tiles", "attention_workspace", "decode_attention", "default_splits",
           "interpreted", "split_chunk", "tile_rows", "warps"]

if os.environ.get(TILES_ENV):  # a sweep's tiles for this GPU (hqlab_kernels.drafter_layers.TILES_ENV)
    set_tiles(sweep_tiles(os.environ[TILES_ENV]))
