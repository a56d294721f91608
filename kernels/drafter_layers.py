"""One Qwen2 decoder layer of the fused speculator's drafter in four Triton kernels (plus the attention).

A drafting pass of `hqlab.engines.vllm.drafter.StaticQwen2` runs 16 query rows per request through 24 small layers;
at that size a pass is bound by kernel count, not bytes (a layer's weights are ~30 MB, ~6 us of HBM time, while
its torch form launches ~14 kernels: four cuBLAS products, a split-K reduce, the compiled norm/rotary/SwiGLU
elementwise kernels and the cache write). Here the same math runs in four kernels per layer:

  K1 `norm_qkv_rope_cache`: RMSNorm of the residual stream, the fused q/k/v product + bias, the rotary embedding
     of q and k, q written out and k/v written straight into the paged KV cache at each row's flat position;
  K2 `o_proj_residual`:     x + o @ Wo^T;
  K3 `norm_gate_up_silu`:   RMSNorm, the fused gate/up product and silu(gate) * up;
  K4 `down_residual`:       x + h @ Wd^T.

Every kernel grids over (output column tiles, row blocks, splits of the reduction), so any number of rows works; a
program accumulates in float32. A skinny product (16 rows, a few MB of weights) has too few output tiles to keep
HBM busy, so a kernel may split its reduction over `split_k` programs: each stores its float32 partial sums in a
`Workspace` and counts itself in on a per-tile counter (release after a barrier); the program that arrives last
adds the partials in split order (a fixed order: the result is bitwise the same from call to call), runs the
epilogue and resets the counter for the next launch (a CUDA graph replays it as is). The norm kernels recompute
their rows' RMS in each program: a row is only H values (896 for the 0.5B), cheaper to read again from L2 than a
separate norm kernel is to launch.

Rounding follows the torch path of `StaticQwen2` (`_rms`: float32 normalisation cast to the model dtype, then
times the weight in the model dtype; each product rounded to the model dtype, as cuBLAS returns it; the residual
adds in the model dtype) so the two paths differ by little more than summation order. The rotary embedding is
computed in float32 from the rounded q/k and rounded once, as torch.compile's fused version of it does.

Nothing here allocates beyond the outputs or reads a device value on the host, so the launches can be captured in
a CUDA graph. Under TRITON_INTERPRET=1 the kernels run on CPU tensors (the tests). This module is a leaf: it
imports nothing from hqlab.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# The drafting passes of the 0.5B (H=896, 14 + 2 + 2 heads of 64, I=4864) run R <= 64 rows. The products are
# matrix-vector-like: each program streams its slice of the weights once, so what matters is enough bytes in flight
# to keep HBM busy (programs x tile x pipeline depth, or a split reduction) and few enough programs that each one's
# activation reads stay small; TILES holds what a GPU sweep found per kernel and row block.
ROW_BLOCKS = (16, 32, 64)  # rows per program: the smallest covering R (16 is the tensor-core tile's M)
# Warps per program and, in the two norm kernels, reduction steps of at most NORM_KERNEL_K_BLOCK columns beyond 16
# rows: what keeps every kernel free of register spills at 16, 32 and 64 rows per program (ptxas -v for sm_90a on
# the 0.5B's shapes; 4 warps and 128-column steps at 32 rows spill in K3).
NUM_WARPS = 4  # at 16 rows per program; 8 beyond
NORM_KERNEL_K_BLOCK = 64
# Elements of x a norm kernel's RMS loop reads per step: a whole 0.5B row block at 16 rows (896 -> 1024 columns),
# so the RMS costs one L2 round trip, not one per step of a loop that nothing pipelines.
NORM_ELEMENTS = 16 * 1024
KERNELS = ("qkv", "o_proj", "gate_up", "down")  # K1..K4, the keys of TILES
# Programmatic dependent launch (Hopper and later): each kernel lets the next one launch at once and, before its
# first memory access, waits until the previous one has finished, so that a kernel's launch and set-up overlap its
# predecessor's tail. Off by default: on the H200 it made the one-pass drafting step slower, 1.308 -> 1.509 ms at
# 2,048 positions (data/results/fused_pass_kernels/t2/ and t2n/): the early grids' programs wait on SMs that the
# running kernel's later programs need. HQLAB_DRAFTER_PDL=1 in the environment at import turns it on.
PDL = os.environ.get("HQLAB_DRAFTER_PDL", "0") == "1"


@dataclass(frozen=True)
class Tiles:
    """How one kernel runs at one row block: output columns per program (`block_n`; for K1 the columns of each rotary
    half), reduction elements per loop step (`block_k`, None: `k_block`'s choice), warps (None: `num_warps`'s),
    Triton's software-pipeline depth (`num_stages`, None: Triton's default) and the programs a reduction is split
    over (`split_k`, 1: none; more need a Workspace)."""

    block_n: int
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    split_k: int = 1

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps", "split_k"):
            value = getattr(self, name)
            if value is not None and (value < 1 or value & (value - 1)):
                raise ValueError(f"Tiles.{name} must be a power of two >= 1, got {value}")
        if self.num_stages is not None and self.num_stages < 1:
            raise ValueError(f"Tiles.num_stages must be >= 1, got {self.num_stages}")


# The tiles each kernel launches with, per (kernel, rows per program); a launcher's keyword arguments override them.
# The fastest candidates on an H200 at the 0.5B's shapes, each timed over 24 layers' own weights in a CUDA graph
# (experiments/drafter_kernel_tiles/drafter_layer_tiles.py, data/results/drafter_layer_tiles/t4/sweep.json, 16, 32
# and 64 rows). An earlier sweep (data/results/drafter_layer_tiles/t1/) first tuned 16 and 64 rows: per launch at 16
# rows K1 10.7 -> 7.6 us, K2 3.6 -> 3.3, K3 14.1 -> 11.0, K4 11.9 -> 7.1 against the first tiles; the later one at 32
# rows (a k = 31 pass) found K1 with two splits 9.6 us against 11.1 with the 64-row tiles, the others level with them.
TILES: dict[tuple[str, int], Tiles] = {
    ("qkv", 16): Tiles(16, 256, 4, 3, split_k=2), ("o_proj", 16): Tiles(16, 256, 4, 3),
    ("gate_up", 16): Tiles(64, 256, 4, 4), ("down", 16): Tiles(32, 128, 4, 4, split_k=8),
    ("qkv", 32): Tiles(16, 256, 8, 4, split_k=2), ("o_proj", 32): Tiles(16, 128, 8, 4),
    ("gate_up", 32): Tiles(64, 128, 8, 3), ("down", 32): Tiles(32, 128, 8, 4, split_k=4),
    ("qkv", 64): Tiles(16, 256, 8, 4, split_k=4), ("o_proj", 64): Tiles(16, 128, 8, 4),
    ("gate_up", 64): Tiles(64, 128, 8, 3), ("down", 64): Tiles(32, 128, 8, 4, split_k=4),
}


TILES_ENV = "HQLAB_DRAFTER_TILES"  # a tile sweep's JSON applied when this module is imported (`sweep_tiles`)


def sweep_tiles(path: str | Path) -> dict[str, dict]:
    """The "best" table of a tile sweep's JSON (experiments/drafter_kernel_tiles/drafter_layer_tiles.py), checked for
    its shape."""
    try:
        table = json.loads(Path(path).read_text())["best"]
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{path} is not a tile sweep's JSON with a 'best' table ({type(e).__name__}: {e})") from None
    if not isinstance(table, dict):
        raise ValueError(f"{path}: 'best' must map 'kernel@rows' to tiles, got {type(table).__name__}")
    return table


def set_tiles(table: dict[str, dict]) -> None:
    """Replace TILES entries from {"kernel@rows": {"block_n": .., "block_k": .., "num_warps": .., "num_stages": ..,
    "split_k": ..}} (a tile sweep's "best"); other keys of an entry, and the attention's "attention@n" entries
    (`hqlab_kernels.drafter_attention.set_tiles`), are ignored. Drafters built afterwards size their Workspace for
    the new splits."""
    fields = ("block_n", "block_k", "num_warps", "num_stages", "split_k")
    new = {}
    for key, entry in table.items():
        if key.startswith("attention@"):
            continue
        kernel, _, rows = key.partition("@")
        if kernel not in KERNELS or not rows.isdigit() or int(rows) not in ROW_BLOCKS:
            raise ValueError(f"a tiles key is 'kernel@rows' with kernel in {KERNELS} and rows in {ROW_BLOCKS}, "
                             f"got {key!r}")
        new[(kernel, int(rows))] = Tiles(**{f: entry[f] for f in fields if f in entry})
    TILES.update(new)


@dataclass(frozen=True)
class Workspace:
    """Scratch for split reductions: float32 partial sums and int32 arrival counters (zero between launches: the
    last program of a tile resets its counter). Allocate once per device and reuse for every call on one stream;
    calls that run concurrently on several streams need one each."""

    partials: torch.Tensor
    counters: torch.Tensor

    @classmethod
    def allocate(cls, floats: int, counters: int, device: str | torch.device) -> "Workspace":
        return cls(torch.empty(max(1, floats), dtype=torch.float32, device=device),
                   torch.zeros(max(1, counters), dtype=torch.int32, device=device))

    @classmethod
    def for_layer(cls, *, hidden: int, inter: int, qkv_rows: int, max_rows: int, max_split: int,
                  device: str | torch.device) -> "Workspace":
        """Room for any of the four kernels of a layer of these sizes at up to `max_rows` rows and `max_split`
        splits, whatever the tiles: partials of every output column (twice for the two-sum kernels) of every row
        block, padded to a row block."""
        rows = triton.cdiv(max_rows, ROW_BLOCKS[0]) * ROW_BLOCKS[-1]
        columns = max(hidden, 2 * inter, qkv_rows) + 64  # + a partial tile of the widest block_n
        tiles = max(hidden, 2 * inter, qkv_rows) * triton.cdiv(max_rows, ROW_BLOCKS[0])
        return cls.allocate(columns * rows * max_split, tiles, device)


def interpreted() -> bool:
    """True where these kernels run in Triton's interpreter (TRITON_INTERPRET=1 when this module was imported): the
    only way they run on CPU tensors."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_linear_residual_kernel, InterpretedFunction)


def row_block(rows: int) -> int:
    """Rows per program for a call of `rows` rows: the smallest of ROW_BLOCKS that covers them (the weights are
    then read once per call), the largest beyond (more rows take more row blocks)."""
    return next((b for b in ROW_BLOCKS if b >= rows), ROW_BLOCKS[-1])


def k_block(reduction: int) -> int:
    """Reduction elements per loop step: the largest of 256, 128, 64, 32, 16 that divides `reduction` (no masked
    tail step: 128 for H=896, 256 for I=4864), else the reduction rounded up to a power of two, at most 256."""
    for block in (256, 128, 64, 32, 16):
        if reduction % block == 0:
            return block
    return min(256, max(16, triton.next_power_of_2(reduction)))


def norm_block(hidden: int, block_rows: int) -> int:
    """Columns per step of the RMS loop (`_row_rstd`): NORM_ELEMENTS spread over the rows, at most the whole row."""
    return min(triton.next_power_of_2(hidden), max(16, NORM_ELEMENTS // block_rows))


def num_warps(block_rows: int) -> int:
    """Warps per program: NUM_WARPS at 16 rows per program, twice that beyond (see NORM_KERNEL_K_BLOCK)."""
    return NUM_WARPS if block_rows <= 16 else 2 * NUM_WARPS


def _norm_kernel_k_block(hidden: int, block_rows: int) -> int:
    """Reduction step of K1 and K3 (see NORM_KERNEL_K_BLOCK)."""
    return k_block(hidden) if block_rows <= 16 else min(k_block(hidden), NORM_KERNEL_K_BLOCK)


def grid_dependency(device: torch.device) -> bool:
    """Whether launches on `device` use programmatic dependent launch (PDL, on a CUDA GPU of compute capability 9 or
    more); the kernels' GDC flag and the launch's launch_pdl option."""
    return PDL and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _check_block(name: str, value: int, minimum: int = 1) -> int:
    """A block size as the kernels need it: a power of two (tl.arange's rule), at least `minimum`."""
    if value < minimum or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value}")
    return value


def _precision(x: torch.Tensor) -> str:
    """How the kernels multiply (`_dot`): "ieee" for float32 operands (TF32, Triton's default on the GPU, would round
    them to 10 mantissa bits), "tf32" for 16-bit ones (exact products on the tensor cores either way), "upcast" for
    16-bit operands on the CPU, i.e. in Triton's interpreter, whose dot multiplies bfloat16 bit patterns as if they
    were integers: there they are widened to float32 first (the same products, exactly). The interpreter's casts
    to 16-bit floats truncate instead of rounding to nearest, so on the CPU only float32 matches torch closely."""
    if x.dtype == torch.float32:
        return "ieee"
    return "upcast" if x.device.type == "cpu" else "tf32"


# ----------------------------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _row_rstd(x, rows, row_ok, eps, HIDDEN: tl.constexpr, BLOCK_R: tl.constexpr, NORM_K: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) per row, in float32, reading NORM_K columns at a time: `norm_block` makes that the
    whole row where BLOCK_R x row fits in a few registers per thread (one load, one L2 round trip instead of one per
    step; the loop is not pipelined) and halves it per doubling of BLOCK_R beyond."""
    sum_sq = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, HIDDEN, NORM_K):
        cols = k0 + tl.arange(0, NORM_K)
        mask = row_ok[:, None] & (cols < HIDDEN)[None, :]
        v = tl.load(x + rows[:, None] * HIDDEN + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        sum_sq += tl.sum(v * v, axis=1)
    return tl.rsqrt(sum_sq / HIDDEN + eps)


@triton.jit
def _normed_chunk(x, norm_w, rows, row_ok, rstd, k0, HIDDEN: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns [k0, k0 + BLOCK_K) of weight * (x * rstd), rounded as `StaticQwen2._rms` rounds: the float32
    normalisation cast to the model dtype, then the product with the weight in the model dtype."""
    cols = k0 + tl.arange(0, BLOCK_K)
    col_ok = cols < HIDDEN
    v = tl.load(x + rows[:, None] * HIDDEN + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    normed = (v.to(tl.float32) * rstd[:, None]).to(v.dtype)
    w = tl.load(norm_w + cols, mask=col_ok, other=0.0)
    return (w.to(tl.float32)[None, :] * normed.to(tl.float32)).to(v.dtype)


@triton.jit
def _enter(GDC: tl.constexpr):
    """With programmatic dependent launch: let the next kernel launch now (it waits in its own `_enter`), then wait
    until the previous kernel has finished and its writes are visible. Every kernel here calls it before its first
    load, so no kernel reads or writes memory that its predecessor still uses."""
    if GDC:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b in float32 (`_precision` says why PRECISION)."""
    if PRECISION == "upcast":
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc, input_precision=PRECISION)
    return out


@triton.jit
def _normed_products(x, norm_w, weight, rows, row_ok, rstd, w_a, w_b, k_lo, HIDDEN: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PER: tl.constexpr,
                     PRECISION: tl.constexpr):
    """(rms-normed x) @ weight rows `w_a` and `w_b` (each BLOCK_N rows of a [*, HIDDEN] weight) over reduction
    columns [k_lo, k_lo + K_PER): two float32 [BLOCK_R, BLOCK_N] sums over one pass of the normed activations, K1's
    two rotary halves, K3's gate and up."""
    acc_a = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    for k in range(0, K_PER, BLOCK_K):
        k0 = k_lo + k
        h = _normed_chunk(x, norm_w, rows, row_ok, rstd, k0, HIDDEN, BLOCK_K)
        acc_a = _dot(h, _weight_tile(weight, w_a, k0, HIDDEN, BLOCK_K), acc_a, PRECISION)
        acc_b = _dot(h, _weight_tile(weight, w_b, k0, HIDDEN, BLOCK_K), acc_b, PRECISION)
    return acc_a, acc_b


@triton.jit
def _weight_tile(weight, out_rows, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows `out_rows` (all in range), columns [k0, k0 + BLOCK_K) of a row-major [*, K] weight, transposed to
    [BLOCK_K, len(out_rows)] for tl.dot."""
    cols = k0 + tl.arange(0, BLOCK_K)
    w = tl.load(weight + out_rows[:, None] * K + cols[None, :], mask=(cols < K)[None, :], other=0.0)
    return tl.trans(w)


@triton.jit
def _split_k_sum(acc, acc_b, partials, counters, tile, split, SPLIT_K: tl.constexpr, TWO: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Where the reduction is split (SPLIT_K > 1): store this program's float32 sums (acc, and acc_b where TWO) as
    its split's partials of output tile `tile`, count in on the tile's counter, and, in the program that arrives
    last, return the sums of every split in split order with last = True (the counter reset to 0); the others
    return zeros and last = False, and must store nothing. With SPLIT_K == 1, (acc, acc_b, True)."""
    if SPLIT_K == 1:
        return acc, acc_b, True
    else:
        tile_size: tl.constexpr = BLOCK_R * BLOCK_N
        parts: tl.constexpr = 2 if TWO else 1
        offs = tl.arange(0, BLOCK_R)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        base = partials + tile.to(tl.int64) * (SPLIT_K * parts * tile_size)
        tl.store(base + (split * parts) * tile_size + offs, acc)
        if TWO:
            tl.store(base + (split * parts + 1) * tile_size + offs, acc_b)
        tl.debug_barrier()  # every thread's partials stored before the counter's release
        last = tl.atomic_add(counters + tile, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
        total = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
        total_b = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
        if last:
            for s in tl.static_range(SPLIT_K):  # split order: the same sum at every launch
                # .cg: read from L2, where the other programs' stores are, never a stale L1 line
                total += tl.load(base + (s * parts) * tile_size + offs, cache_modifier=".cg")
                if TWO:
                    total_b += tl.load(base + (s * parts + 1) * tile_size + offs, cache_modifier=".cg")
            tl.atomic_xchg(counters + tile, 0)  # every split has counted in: ready for the next launch
        return total, total_b, last


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["n_rows", "n_positions", "cache_rows"])
def _norm_qkv_rope_cache_kernel(x, norm_w, qkv_w, qkv_b, cos, sin, positions, cache_index, q_out, k_cache, v_cache,
                                partials, counters, n_rows, n_positions, cache_rows, eps, HIDDEN: tl.constexpr,
                                HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                                HALF_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                                NORM_K: tl.constexpr, SPLIT_K: tl.constexpr, K_PER: tl.constexpr,
                                PRECISION: tl.constexpr, GDC: tl.constexpr):
    """Program (t, b, s): rows b * BLOCK_R.. and, of head t // tiles (q heads, then k, then v), the HALF_N columns
    starting at (t % tiles) * HALF_N of each rotary half, so the program holds both members of every pair it
    rotates; split s of the reduction (`_split_k_sum`)."""
    _enter(GDC)
    half: tl.constexpr = HEAD_DIM // 2
    tiles: tl.constexpr = half // HALF_N
    head = tl.program_id(0) // tiles
    d_lo = (tl.program_id(0) % tiles) * HALF_N + tl.arange(0, HALF_N)  # columns within the head's first half
    d_hi = d_lo + half  # their rotary partners
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    rstd = _row_rstd(x, rows, row_ok, eps, HIDDEN, BLOCK_R, NORM_K)
    w_lo = head * HEAD_DIM + d_lo  # rows of the fused q/k/v weight
    w_hi = head * HEAD_DIM + d_hi
    split = tl.program_id(2)
    acc_lo, acc_hi = _normed_products(x, norm_w, qkv_w, rows, row_ok, rstd, w_lo, w_hi, split * K_PER, HIDDEN,
                                      BLOCK_R, HALF_N, BLOCK_K, K_PER, PRECISION)
    tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    acc_lo, acc_hi, last = _split_k_sum(acc_lo, acc_hi, partials, counters, tile, split, SPLIT_K, True, BLOCK_R,
                                        HALF_N)
    row_ok = row_ok & last  # from here on only the program holding the whole sums stores
    dtype = q_out.dtype.element_ty
    # the bias added to the float32 sum and the result rounded once, as cuBLAS's bias epilogue does
    lo = (acc_lo + tl.load(qkv_b + w_lo).to(tl.float32)[None, :]).to(dtype).to(tl.float32)
    hi = (acc_hi + tl.load(qkv_b + w_hi).to(tl.float32)[None, :]).to(dtype).to(tl.float32)
    pos = tl.load(positions + rows, mask=row_ok, other=0).to(tl.int64)
    if head < HEADS + KV_HEADS:  # q and k: rotate each pair (lo, hi) by its position's angle
        pos_ok = (row_ok & (pos >= 0) & (pos < n_positions))[:, None]
        c_lo = tl.load(cos + pos[:, None] * HEAD_DIM + d_lo[None, :], mask=pos_ok, other=0.0).to(tl.float32)
        s_lo = tl.load(sin + pos[:, None] * HEAD_DIM + d_lo[None, :], mask=pos_ok, other=0.0).to(tl.float32)
        c_hi = tl.load(cos + pos[:, None] * HEAD_DIM + d_hi[None, :], mask=pos_ok, other=0.0).to(tl.float32)
        s_hi = tl.load(sin + pos[:, None] * HEAD_DIM + d_hi[None, :], mask=pos_ok, other=0.0).to(tl.float32)
        lo, hi = lo * c_lo - hi * s_lo, hi * c_hi + lo * s_hi
    if head < HEADS:
        base = q_out + rows[:, None] * (HEADS * HEAD_DIM) + head * HEAD_DIM
        tl.store(base + d_lo[None, :], lo.to(dtype), mask=row_ok[:, None])
        tl.store(base + d_hi[None, :], hi.to(dtype), mask=row_ok[:, None])
    else:
        # k or v of KV head kv at cache row cache_index[r] (slot * max_len + position: the pages flattened); a
        # row outside the cache is dropped rather than written over memory that is not the cache's
        slot = tl.load(cache_index + rows, mask=row_ok, other=0).to(tl.int64)
        ok = (row_ok & (slot >= 0) & (slot < cache_rows))[:, None]
        if head < HEADS + KV_HEADS:
            base = k_cache + slot[:, None] * (KV_HEADS * HEAD_DIM) + (head - HEADS) * HEAD_DIM
        else:
            base = v_cache + slot[:, None] * (KV_HEADS * HEAD_DIM) + (head - HEADS - KV_HEADS) * HEAD_DIM
        tl.store(base + d_lo[None, :], lo.to(dtype), mask=ok)
        tl.store(base + d_hi[None, :], hi.to(dtype), mask=ok)


@triton.jit(do_not_specialize=["n_rows"])
def _linear_residual_kernel(x, a, weight, out, partials, counters, n_rows, N: tl.constexpr, K: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            SPLIT_K: tl.constexpr, K_PER: tl.constexpr, PRECISION: tl.constexpr,
                            GDC: tl.constexpr):
    """out = x + a @ weight^T for x, out [R, N], a [R, K], weight [N, K]: K2 (a = attention output, weight = Wo)
    and K4 (a = SwiGLU output, weight = Wd). The product is rounded to the model dtype before the residual add,
    as the torch path's separate matmul and add round."""
    _enter(GDC)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_rows = tl.where(col_ok, cols, 0)  # a tail tile reads row 0 for its dead columns (never stored)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    split = tl.program_id(2)
    acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    for k in range(0, K_PER, BLOCK_K):
        k0 = split * K_PER + k
        ks = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(a + rows[:, None] * K + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)
        acc = _dot(v, _weight_tile(weight, w_rows, k0, K, BLOCK_K), acc, PRECISION)
    tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    acc, _, last = _split_k_sum(acc, acc, partials, counters, tile, split, SPLIT_K, False, BLOCK_R, BLOCK_N)
    row_ok = row_ok & last  # only the program holding the whole sum stores
    dtype = out.dtype.element_ty
    mask = row_ok[:, None] & col_ok[None, :]
    offsets = rows[:, None] * N + cols[None, :]
    residual = tl.load(x + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + offsets, (residual + acc.to(dtype).to(tl.float32)).to(dtype), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])
def _norm_gate_up_silu_kernel(x, norm_w, gate_up_w, out, partials, counters, n_rows, eps, HIDDEN: tl.constexpr,
                              INTER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, NORM_K: tl.constexpr, SPLIT_K: tl.constexpr,
                              K_PER: tl.constexpr, PRECISION: tl.constexpr, GDC: tl.constexpr):
    """Program (t, b): columns t * BLOCK_N.. of silu(gate) * up for rows b * BLOCK_R..; gate is weight row n, up
    weight row INTER + n. Gate, up, silu(gate) and the product are each rounded to the model dtype (the torch
    path's separate operations)."""
    _enter(GDC)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < INTER
    w_gate = tl.where(col_ok, cols, 0)  # a tail tile reads row 0 for its dead columns (never stored)
    w_up = w_gate + INTER
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    rstd = _row_rstd(x, rows, row_ok, eps, HIDDEN, BLOCK_R, NORM_K)
    split = tl.program_id(2)
    acc_gate, acc_up = _normed_products(x, norm_w, gate_up_w, rows, row_ok, rstd, w_gate, w_up, split * K_PER,
                                        HIDDEN, BLOCK_R, BLOCK_N, BLOCK_K, K_PER, PRECISION)
    tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    acc_gate, acc_up, last = _split_k_sum(acc_gate, acc_up, partials, counters, tile, split, SPLIT_K, True,
                                          BLOCK_R, BLOCK_N)
    row_ok = row_ok & last  # only the program holding the whole sums stores
    dtype = out.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(out + rows[:, None] * INTER + cols[None, :], (silu * up).to(dtype), mask=mask)


# ----------------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------------


def _check_matrix(name: str, t: torch.Tensor, shape: tuple[int, ...], like: torch.Tensor) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.dtype != like.dtype or t.device != like.device:
        raise ValueError(f"{name} must be {like.dtype} on {like.device} like the activations, got {t.dtype} on "
                         f"{t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_rows(name: str, x: torch.Tensor) -> tuple[int, int]:
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"{name} must be a contiguous [rows, features] matrix, got shape {tuple(x.shape)}"
                         f"{'' if x.is_contiguous() else ' (not contiguous)'}")
    return x.shape[0], x.shape[1]


def _check_index(name: str, t: torch.Tensor, rows: int, like: torch.Tensor) -> None:
    if t.shape != (rows,) or t.dtype not in (torch.int32, torch.int64) or t.device != like.device:
        raise ValueError(f"{name} must be an int32 or int64 vector of {rows} entries on {like.device}, got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _tiles(kernel: str, block_r: int) -> Tiles:
    """TILES' entry for `kernel` at `block_r` rows per program (an override of block_rows outside ROW_BLOCKS takes
    the entry of the row block that covers it)."""
    return TILES.get((kernel, block_r)) or TILES[(kernel, row_block(block_r))]


def _options(kernel: str, block_r: int, reduction: int, default_k: int, parts: int, overrides: dict) -> dict:
    """The launch options of one call: `_tiles` with the caller's non-None overrides on top, checked, plus the
    reduction's share per split (K_PER, a whole number of block_k steps)."""
    base = _tiles(kernel, block_r)
    chosen = {name: overrides.get(name) if overrides.get(name) is not None else getattr(base, name)
              for name in ("block_n", "block_k", "num_warps", "num_stages", "split_k")}
    block_n = _check_block("half_block" if kernel == "qkv" else "block_n", chosen["block_n"])
    block_k = _check_block("block_k", chosen["block_k"] or default_k, 16)
    split = _check_block("split_k", chosen["split_k"])
    warps = _check_block("num_warps", chosen["num_warps"] or num_warps(block_r))
    if chosen["num_stages"] is not None and chosen["num_stages"] < 1:
        raise ValueError(f"num_stages must be >= 1, got {chosen['num_stages']}")
    k_per = triton.cdiv(triton.cdiv(reduction, split), block_k) * block_k
    return {"block_n": block_n, "block_k": block_k, "split": split, "k_per": k_per, "num_warps": warps,
            "num_stages": chosen["num_stages"], "parts": parts}


def _scratch(opts: dict, tiles: int, block_r: int, workspace: "Workspace | None",
             like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (partials, counters) a launch passes: the workspace's where the reduction is split (checked for room; a
    call given none gets one of its own, zeroed for it: pass one to reuse it), else `like` twice (never touched:
    SPLIT_K == 1 compiles the sums away)."""
    if opts["split"] == 1:
        return like, like
    floats = tiles * opts["split"] * opts["parts"] * block_r * opts["block_n"]
    if workspace is None:
        workspace = Workspace.allocate(floats, tiles, like.device)
    floats = tiles * opts["split"] * opts["parts"] * block_r * opts["block_n"]
    if workspace.partials.device != like.device or workspace.counters.device != like.device:
        raise ValueError(f"the workspace must be on {like.device} like the activations, got "
                         f"{workspace.partials.device}")
    if workspace.partials.numel() < floats or workspace.counters.numel() < tiles:
        raise ValueError(f"the workspace is too small for this call: it needs {floats} partial floats and {tiles} "
                         f"counters, it has {workspace.partials.numel()} and {workspace.counters.numel()}")
    return workspace.partials, workspace.counters


def _launch_kwargs(opts: dict, like: torch.Tensor) -> dict:
    """Triton's launch options of a call: warps, stages, and GDC + launch_pdl (`grid_dependency`)."""
    gdc = grid_dependency(like.device)
    extra = {"num_warps": opts["num_warps"], "GDC": gdc}
    if gdc:
        extra["launch_pdl"] = True
    if opts["num_stages"] is not None:
        extra["num_stages"] = opts["num_stages"]
    return extra


def norm_qkv_rope_cache(x: torch.Tensor, norm_weight: torch.Tensor, qkv_weight: torch.Tensor, qkv_bias: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, cache_index: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, *, heads: int, kv_heads: int, eps: float,
                        block_rows: int | None = None, half_block: int | None = None, block_k: int | None = None,
                        num_warps: int | None = None, num_stages: int | None = None, split_k: int | None = None,
                        workspace: "Workspace | None" = None) -> torch.Tensor:
    """K1: q [R, heads, D] of rows x [R, H], with k and v written into the caches.

    x is RMS-normalised with `norm_weight` [H] and projected by the fused `qkv_weight` [(heads + 2 kv_heads) D, H]
    (q, k, v rows in that order) plus `qkv_bias`; q and k are rotated by the rows of the rotary tables `cos`, `sin`
    [positions, D] at `positions[r]`; k and v of row r go to cache row `cache_index[r]` of `k_cache`/`v_cache`
    (any contiguous tensors whose last two dims are [kv_heads, D]: a layer's paged cache, its pages flattened).
    Rows whose position or cache row lies outside the tables or the cache rotate by zero and write no K/V.
    The tiles come from TILES["qkv", rows per program]; block_rows, half_block (block_n), block_k, num_warps,
    num_stages and split_k override them (tuning, tests); a split reduction needs `workspace`."""
    n_rows, hidden = _check_rows("x", x)
    if heads < 1 or kv_heads < 1:
        raise ValueError(f"heads and kv_heads must be >= 1, got {heads} and {kv_heads}")
    head_dim = cos.shape[-1] if cos.dim() == 2 else -1
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"cos must be a [positions, head_dim] table with an even head_dim, got {tuple(cos.shape)}")
    _check_matrix("norm_weight", norm_weight, (hidden,), x)
    _check_matrix("qkv_weight", qkv_weight, ((heads + 2 * kv_heads) * head_dim, hidden), x)
    _check_matrix("qkv_bias", qkv_bias, ((heads + 2 * kv_heads) * head_dim,), x)
    _check_matrix("cos", cos, tuple(cos.shape), x)
    _check_matrix("sin", sin, tuple(cos.shape), x)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_matrix(name, cache, tuple(cache.shape), x)
        if cache.dim() < 2 or tuple(cache.shape[-2:]) != (kv_heads, head_dim):
            raise ValueError(f"{name} must end in [kv_heads={kv_heads}, head_dim={head_dim}], got "
                             f"{tuple(cache.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    _check_index("positions", positions, n_rows, x)
    _check_index("cache_index", cache_index, n_rows, x)
    half = head_dim // 2
    block_r = _check_block("block_rows", block_rows or row_block(n_rows))
    if half_block is None:  # the table's, or the largest power of two below it that divides a small head's half
        half_block = next(b for b in (64, 32, 16, 8, 4, 2, 1) if b <= _tiles("qkv", block_r).block_n and half % b == 0)
    opts = _options("qkv", block_r, hidden, _norm_kernel_k_block(hidden, block_r), 2,
                    {"block_n": half_block, "block_k": block_k, "num_warps": num_warps, "num_stages": num_stages,
                     "split_k": split_k})
    half_n = opts["block_n"]
    if half % half_n:
        raise ValueError(f"half_block must divide head_dim / 2 = {half}, got {half_n}")
    q = torch.empty(n_rows, heads, head_dim, dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return q
    grid = ((heads + 2 * kv_heads) * (half // half_n), triton.cdiv(n_rows, block_r), opts["split"])
    partials, counters = _scratch(opts, grid[0] * grid[1], block_r, workspace, x)
    _norm_qkv_rope_cache_kernel[grid](
        x, norm_weight, qkv_weight, qkv_bias, cos, sin, positions, cache_index, q, k_cache, v_cache, partials,
        counters, n_rows, cos.shape[0], k_cache.numel() // (kv_heads * head_dim), eps, HIDDEN=hidden, HEADS=heads,
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, HALF_N=half_n, BLOCK_R=block_r, BLOCK_K=opts["block_k"],
        NORM_K=norm_block(hidden, block_r), SPLIT_K=opts["split"], K_PER=opts["k_per"], PRECISION=_precision(x),
        **_launch_kwargs(opts, x))
    return q


def _linear_residual(kernel: str, x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, what: str,
                     block_rows: int | None, overrides: dict, workspace: "Workspace | None") -> torch.Tensor:
    n_rows, n = _check_rows("x", x)
    rows_a, k = _check_rows(what, a)
    if rows_a != n_rows:
        raise ValueError(f"x and {what} must have the same rows, got {n_rows} and {rows_a}")
    _check_matrix(what, a, tuple(a.shape), x)
    _check_matrix("weight", weight, (n, k), x)
    block_r = _check_block("block_rows", block_rows or row_block(n_rows))
    opts = _options(kernel, block_r, k, k_block(k), 1, overrides)
    out = torch.empty_like(x)
    if n_rows == 0:
        return out
    grid = (triton.cdiv(n, opts["block_n"]), triton.cdiv(n_rows, block_r), opts["split"])
    partials, counters = _scratch(opts, grid[0] * grid[1], block_r, workspace, x)
    _linear_residual_kernel[grid](x, a, weight, out, partials, counters, n_rows, N=n, K=k, BLOCK_R=block_r,
                                  BLOCK_N=opts["block_n"], BLOCK_K=opts["block_k"], SPLIT_K=opts["split"],
                                  K_PER=opts["k_per"], PRECISION=_precision(x), **_launch_kwargs(opts, x))
    return out


def o_proj_residual(x: torch.Tensor, o: torch.Tensor, o_weight: torch.Tensor, *, block_rows: int | None = None,
                    block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                    num_stages: int | None = None, split_k: int | None = None,
                    workspace: "Workspace | None" = None) -> torch.Tensor:
    """K2: x + o @ o_weight^T for the residual stream x [R, H], the attention output o [R, heads * D] and the
    output projection [H, heads * D] (a new tensor; x is left as it is). Tiles: TILES["o_proj", rows per program],
    overridden by the keyword arguments; a split reduction needs `workspace`."""
    return _linear_residual("o_proj", x, o, o_weight, "o", block_rows,
                            {"block_n": block_n, "block_k": block_k, "num_warps": num_warps,
                             "num_stages": num_stages, "split_k": split_k}, workspace)


def norm_gate_up_silu(x: torch.Tensor, norm_weight: torch.Tensor, gate_up_weight: torch.Tensor, *, eps: float,
                      block_rows: int | None = None, block_n: int | None = None, block_k: int | None = None,
                      num_warps: int | None = None, num_stages: int | None = None, split_k: int | None = None,
                      workspace: "Workspace | None" = None) -> torch.Tensor:
    """K3: silu(g) * u [R, I] where g, u = rms(x) * norm_weight @ gate_up_weight^T, the fused weight [2 I, H]
    holding the gate rows first, then the up rows. Tiles: TILES["gate_up", rows per program], overridden by the
    keyword arguments; a split reduction needs `workspace`."""
    n_rows, hidden = _check_rows("x", x)
    _check_matrix("norm_weight", norm_weight, (hidden,), x)
    if gate_up_weight.dim() != 2 or gate_up_weight.shape[0] % 2:
        raise ValueError(f"gate_up_weight must be [2 * intermediate, hidden], got {tuple(gate_up_weight.shape)}")
    inter = gate_up_weight.shape[0] // 2
    _check_matrix("gate_up_weight", gate_up_weight, (2 * inter, hidden), x)
    block_r = _check_block("block_rows", block_rows or row_block(n_rows))
    opts = _options("gate_up", block_r, hidden, _norm_kernel_k_block(hidden, block_r), 2,
                    {"block_n": block_n, "block_k": block_k, "num_warps": num_warps, "num_stages": num_stages,
                     "split_k": split_k})
    out = torch.empty(n_rows, inter, dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return out
    grid = (triton.cdiv(inter, opts["block_n"]), triton.cdiv(n_rows, block_r), opts["split"])
    partials, counters = _scratch(opts, grid[0] * grid[1], block_r, workspace, x)
    _norm_gate_up_silu_kernel[grid](x, norm_weight, gate_up_weight, out, partials, counters, n_rows, eps,
                                    HIDDEN=hidden, INTER=inter, BLOCK_R=block_r, BLOCK_N=opts["block_n"],
                                    BLOCK_K=opts["block_k"], NORM_K=norm_block(hidden, block_r),
                                    SPLIT_K=opts["split"], K_PER=opts["k_per"], PRECISION=_precision(x),
                                    **_launch_kwargs(opts, x))
    return out


def down_residual(x: torch.Tensor, h: torch.Tensor, down_weight: torch.Tensor, *, block_rows: int | None = None,
                  block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, split_k: int | None = None,
                  workspace: "Workspace | None" = None) -> torch.Tensor:
    """K4: x + h @ down_weight^T for the residual stream x [R, H], the SwiGLU output h [R, I] and the down
    projection [H, I] (a new tensor; x is left as it is). Tiles: TILES["down", rows per program], overridden by the
    keyword arguments; a split reduction needs `workspace`."""
    return _linear_residual("down", x, h, down_weight, "h", block_rows,
                            {"block_n": block_n, "block_k": block_k, "num_warps": num_warps,
                             "num_stages": num_stages, "split_k": split_k}, workspace)


__all__ = ["down_residual", "grid_dependency", "interpreted", "k_block", "KERNELS", "norm_gate_up_silu",
           "norm_qkv_rope_cache", "o_proj_residual", "PDL", "row_block", "set_tiles", "sweep_tiles", "TILES", "Tiles",
           "TILES_ENV", "Workspace"]

if os.environ.get(TILES_ENV):  # a sweep's tiles for this GPU, for every drafter built in this process and its children
    set_tiles(sweep_tiles(os.environ[TILES_ENV]))
