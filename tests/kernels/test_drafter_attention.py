"""The drafter's one-kernel attention (`hqlab_kernels.drafter_attention.decode_attention`) against torch.

On the CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set below before the kernel is imported),
in float32, on small shapes (head_dim 16; 4 query heads over 2 KV heads, the
0.5B's grouping of 14 over 2, and 2 over 2):

- against a torch reference written out from the formula (each query row's causal mask at its own position,
  softmax, @ v, in float64): 1 and 3 requests, 1, 5 and 16 query rows each, scattered slots and starts (start 0,
  rows ending at attn_len - 1), 1 to 7 key splits (splits past the keys, with empty ranges, included), several key
  blocks per split; cache positions past each request's last row hold NaN, so a read of any of them would show;
- determinism and the arrival counters: repeated calls are equal bit for bit and leave the counters at zero;
- agreement with `StaticQwen2._attend` (the sdpa path) on caches laid out as StaticQwen2 lays them out;
- inputs the kernel cannot run are refused with a ValueError naming the argument.

With CUDA, one test runs the 0.5B's attention shapes (14 heads over 2 KV heads of 64, 16 query rows per request,
2,048 positions) in bf16: against the float32 reference within bf16 tolerance, and replayed from a CUDA graph
against its eager call.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first @triton.jit definition

pytest.importorskip("triton", reason="the Triton attention needs Triton")

from hqlab.engines.vllm.drafter import BLOCK, StaticQwen2  # noqa: E402
from hqlab_kernels import drafter_attention as da  # noqa: E402
from rounding import assert_within  # noqa: E402  (tests/kernels/rounding.py)

# The interpreter turns the kernel's runtime loop bounds (one-element arrays) into ints in a way NumPy deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")


# --------------------------------------------------------------------------------------------------------------
# inputs and the reference
# --------------------------------------------------------------------------------------------------------------


def caches(slots_total: int, max_len: int, kv_heads: int, head_dim: int, g: torch.Generator,
           dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V caches in StaticQwen2's layout of one layer: [slots * blocks, BLOCK, kv_heads, D]."""
    shape = (slots_total * max_len // BLOCK, BLOCK, kv_heads, head_dim)
    return torch.randn(*shape, generator=g).to(dtype), torch.randn(*shape, generator=g).to(dtype)


def poison(cache: torch.Tensor, slots: list[int], ends: list[int], max_len: int) -> None:
    """NaN at every position a call must not read: past each request's last row, and all of the other slots."""
    rows = cache.view(-1, max_len, *cache.shape[-2:])
    keep = torch.zeros(rows.shape[:2], dtype=torch.bool)
    for slot, end in zip(slots, ends):
        keep[slot, :end] = True
    rows[~keep] = float("nan")


# What float32 rounding can do to one output element, o = sum_j p_j v_j / sum_j p_j over the row's N visible keys with
# p_j = exp(s_j - max), s_j = q . k_j / sqrt(D). With u = 2^-24 (float32's unit roundoff) and a float32 sum of n
# terms of mass m (the sum of their |values|) off by at most SIGMAS * u * m * sqrt(n / 3) (its n - 1 roundings are
# independent, mean zero, each at most u times a partial sum no larger than m: see tests/kernels/
# test_drafter_layers.py):
# - each score's dot product is off by at most SIGMAS u sqrt(D / 3) m_j / sqrt(D), m_j = sum_d |q_d k_jd|; the
#   log2(e) / sqrt(D) scale, the subtraction of the running max, exp2 and the rescaling of earlier blocks and splits
#   by exp2(old max - new max) add at most 8 u (1 + max_j |s_j|) more to each exponent. An error e in an exponent
#   scales p_j by exp(e), about 1 + e: every weight p_j / sum p is off by at most eta, relative, and a weighted
#   average with weights off by eta moves by at most 2 eta max_j |v_j|;
# - the two sums over the N keys (positive weights; mass at most sum_j p_j * max_j |v_j|) and the division: at most
#   (2 SIGMAS u sqrt(N / 3) + 3 u) max_j |v_j|.
# A bf16 kernel also casts p to bf16 before its product with v, and the output, by truncation (2^-7 relative each):
# 2 * 2^-7 max_j |v_j| + 2^-7 |o| more.
U = 2.0 ** -24
SIGMAS = 6.0
BF16_CAST = 2.0 ** -7


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
              start: torch.Tensor, max_len: int) -> torch.Tensor:
    """o [n * Q, heads * D] in float64: query i of request b at position start[b] + i attends to positions
    0..start[b] + i of its slot, query head h to KV head h // groups, scores scaled by 1 / sqrt(D)."""
    return attend(q, k_cache, v_cache, slots, start, max_len)[0]


def rounding_bound(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   start: torch.Tensor, max_len: int) -> torch.Tensor:
    """How far a float32 (or, for bf16 inputs, a bf16) kernel's o can be from the reference's, element by element
    (the derivation above)."""
    return attend(q, k_cache, v_cache, slots, start, max_len)[1]


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, start: torch.Tensor,
           max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = slots.numel()
    rows, heads, head_dim = q.shape
    q_len, kv_heads = rows // n, k_cache.shape[-2]
    groups = heads // kv_heads
    k_rows = k_cache.reshape(-1, kv_heads, head_dim).double()
    v_rows = v_cache.reshape(-1, kv_heads, head_dim).double()
    out = torch.empty(rows, heads, head_dim, dtype=torch.float64, device=q.device)
    bound = torch.empty(rows, heads, head_dim, dtype=torch.float64, device=q.device)
    bf16 = q.dtype == torch.bfloat16
    for b in range(n):
        first = int(start[b])
        end = first + q_len  # the request's keys: positions 0 .. its last row's position
        flat = int(slots[b]) * max_len + torch.arange(end, device=q.device)
        keys = k_rows[flat].repeat_interleave(groups, dim=1)  # [end, heads, D]
        values = v_rows[flat].repeat_interleave(groups, dim=1)
        qb = q[b * q_len:(b + 1) * q_len].double()  # [Q, heads, D]
        scores = torch.einsum("qhd,khd->hqk", qb, keys) / math.sqrt(head_dim)
        position = first + torch.arange(q_len, device=q.device)
        visible = torch.arange(end, device=q.device)[None, :] <= position[:, None]  # [Q, end]
        scores = scores.masked_fill(~visible, float("-inf"))
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
        out[b * q_len:(b + 1) * q_len] = o
        # the bound, per query row and head: [heads, Q] maxima over the row's visible keys
        dot_mass = (torch.einsum("qhd,khd->hqk", qb.abs(), keys.abs()) / math.sqrt(head_dim)).masked_fill(~visible, 0)
        score_max = scores.abs().masked_fill(~visible, 0).amax(-1)
        eta = SIGMAS * U * math.sqrt(head_dim / 3) * dot_mass.amax(-1) + 8 * U * (1 + score_max)
        v_max = (values.abs().amax(-1).T[:, None, :] * visible[None]).amax(-1)  # [heads, Q]
        keys_seen = visible.sum(-1).double()[None, :]  # N, per query row
        per_row = v_max * (2 * eta + 2 * SIGMAS * U * (keys_seen / 3).sqrt() + 3 * U)
        if bf16:
            per_row = per_row + 2 * BF16_CAST * v_max
        row_bound = per_row.T[:, :, None].expand(q_len, heads, head_dim)
        bound[b * q_len:(b + 1) * q_len] = row_bound + (BF16_CAST * o.abs() if bf16 else 0)
    return out.reshape(rows, heads * head_dim), bound.reshape(rows, heads * head_dim)


def index(values: list[int], dtype: torch.dtype = torch.long, device: str = "cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


# --------------------------------------------------------------------------------------------------------------
# (a) against the reference
# --------------------------------------------------------------------------------------------------------------

# (heads, kv_heads, head_dim, slots, starts, Q, splits, block_n, attn_len, max_len)
CASES = [
    (4, 2, 16, [3], [0], 1, 1, 16, 40, 48),  # one row seeing one key
    (4, 2, 16, [3], [24], 16, 1, 16, 40, 48),  # three key blocks in one split, rows ending at attn_len - 1
    (4, 2, 16, [4, 1, 5], [35, 0, 17], 5, 2, 16, 40, 48),  # two blocks in split 0; request 1's split 1 is empty
    (4, 2, 16, [4, 1, 5], [24, 0, 11], 16, 3, 16, 40, 48),  # one block per split
    (4, 2, 16, [0, 5, 2], [0, 39, 22], 1, 7, 16, 40, 48),  # four of seven splits past the keys
    (4, 2, 16, [2, 0, 4], [0, 24, 11], 16, 7, 16, 40, 48),
    (4, 2, 16, [5, 0, 3], [84, 0, 50], 16, 3, 16, 100, 112),  # three blocks per split, the last partial
    (14, 2, 16, [3], [24], 16, 7, 16, 40, 48),  # the 0.5B's grouping: 112 rows in a tile of 128
    (14, 2, 16, [1], [0], 5, 2, 16, 40, 48),
    (14, 2, 16, [4, 1, 5], [35, 0, 17], 5, 3, 16, 40, 48),
    (14, 2, 16, [4, 1, 5], [24, 0, 11], 16, 2, 64, 40, 48),  # one block of 64 covers all; split 1 is empty
    (14, 2, 16, [2, 0, 5], [39, 0, 22], 1, 1, 64, 40, 48),
    (14, 2, 16, [2, 0, 5], [24, 3, 9], 16, None, 16, 40, 48),  # default_splits
    (2, 2, 16, [4, 1, 5], [35, 0, 17], 5, 3, 16, 40, 48),  # one query head per KV head
    (4, 1, 32, [1, 0, 2], [9, 0, 20], 5, 2, 16, 25, 32),  # head_dim 32, all heads on one KV head
]


@pytest.mark.parametrize("heads, kv_heads, head_dim, slots, starts, q_len, splits, block_n, attn_len, max_len", CASES)
def test_decode_attention_matches_the_reference(heads, kv_heads, head_dim, slots, starts, q_len, splits, block_n,
                                                attn_len, max_len):
    g = torch.Generator().manual_seed(len(slots) * 100 + q_len * 10 + (splits or 0))
    slots_total = 6
    n = len(slots)
    k_cache, v_cache = caches(slots_total, max_len, kv_heads, head_dim, g)
    want_k, want_v = k_cache.clone(), v_cache.clone()  # finite everywhere: the reference reads what it needs
    ends = [s + q_len for s in starts]
    poison(k_cache, slots, ends, max_len)
    poison(v_cache, slots, ends, max_len)
    q = torch.randn(n * q_len, heads, head_dim, generator=g)
    slot_t, start_t = index(slots), index(starts, torch.int32)
    workspace = da.attention_workspace(n, heads, q_len, splits or da.MAX_SPLITS, head_dim, "cpu")

    got = da.decode_attention(q, k_cache, v_cache, slot_t, start_t, max_len=max_len, attn_len=attn_len,
                              splits=splits, block_n=block_n, workspace=workspace)

    assert got.shape == (n * q_len, heads * head_dim) and got.dtype == q.dtype
    want, bound = attend(q, want_k, want_v, slot_t, start_t, max_len)
    assert_within(got, want, bound)
    assert not workspace.counters.any()
    # the bound still sees a real bug: one element of the value at the last request's position 0 (a key every one
    # of its rows sees) read off by 1e-3 (the values' scale is 1) fails the same comparison
    v_cache.view(-1, kv_heads, head_dim)[int(slots[-1]) * max_len, 0, 0] += 1e-3
    bad = da.decode_attention(q, k_cache, v_cache, slot_t, start_t, max_len=max_len, attn_len=attn_len,
                              splits=splits, block_n=block_n, workspace=workspace)
    with pytest.raises(AssertionError, match="beyond the rounding bound"):
        assert_within(bad, want, bound)


def test_a_request_outside_the_cache_gets_zeros_and_the_others_are_unaffected():
    g = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim, max_len, q_len = 4, 2, 16, 32, 5
    k_cache, v_cache = caches(3, max_len, kv_heads, head_dim, g)
    q = torch.randn(3 * q_len, heads, head_dim, generator=g)
    workspace = da.attention_workspace(3, heads, q_len, 2, head_dim, "cpu")
    for splits in (1, 2):
        got = da.decode_attention(q, k_cache, v_cache, index([1, 3, 0]), index([4, 0, 20]), max_len=max_len,
                                  attn_len=max_len, splits=splits, block_n=16, workspace=workspace)
        assert torch.equal(got[q_len:2 * q_len], torch.zeros(q_len, heads * head_dim))  # slot 3 of 3
        keep = torch.cat([torch.arange(q_len), torch.arange(2 * q_len, 3 * q_len)])
        assert_within(got[keep], *attend(q[keep], k_cache, v_cache, index([1, 0]), index([4, 20]), max_len))
        assert not workspace.counters.any()


def test_bf16_in_the_interpreter_is_close_to_the_reference():
    """The 16-bit path (operands widened to float32 for the interpreter's dot; its casts to bf16 truncate: the bound
    allows 2^-7 for each)."""
    g = torch.Generator().manual_seed(12)
    heads, kv_heads, head_dim, max_len, q_len = 14, 2, 16, 48, 16
    k_cache, v_cache = caches(4, max_len, kv_heads, head_dim, g, torch.bfloat16)
    q = torch.randn(2 * q_len, heads, head_dim, generator=g).bfloat16()
    slots, start = index([2, 0]), index([24, 7])
    workspace = da.attention_workspace(2, heads, q_len, 3, head_dim, "cpu")
    got = da.decode_attention(q, k_cache, v_cache, slots, start, max_len=max_len, attn_len=40, splits=3,
                              block_n=16, workspace=workspace)
    assert got.dtype == torch.bfloat16
    assert_within(got, *attend(q, k_cache, v_cache, slots, start, max_len))


# --------------------------------------------------------------------------------------------------------------
# (b) determinism and the counters
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case, block_m", [(7, 16), (9, 32), (12, 16), (3, 16)],
                         ids=["seven-tiles-seven-splits", "four-tiles-three-requests", "one-split-seven-tiles",
                              "4-2-grouping-two-tiles"])
def test_row_tiles_split_a_kv_heads_rows_over_programs(case, block_m):
    """block_m below a KV head's Q * groups rows: each program takes block_m of them (its own counter and combine),
    with the same results as the whole tile."""
    heads, kv_heads, head_dim, slots, starts, q_len, splits, block_n, attn_len, max_len = CASES[case]
    g = torch.Generator().manual_seed(500 + case)
    n = len(slots)
    k_cache, v_cache = caches(6, max_len, kv_heads, head_dim, g)
    q = torch.randn(n * q_len, heads, head_dim, generator=g)
    slot_t, start_t = index(slots), index(starts, torch.int32)
    workspace = da.attention_workspace(n, heads, q_len, splits or da.MAX_SPLITS, head_dim, "cpu")
    got = da.decode_attention(q, k_cache, v_cache, slot_t, start_t, max_len=max_len, attn_len=attn_len,
                              splits=splits, block_n=block_n, block_m=block_m, workspace=workspace)
    want, bound = attend(q, k_cache, v_cache, slot_t, start_t, max_len)
    assert_within(got, want, bound)
    assert not workspace.counters.any()
    whole = da.decode_attention(q, k_cache, v_cache, slot_t, start_t, max_len=max_len, attn_len=attn_len,
                                splits=splits, block_n=block_n, workspace=workspace)
    assert_within(got, whole, 2 * bound)  # each within the bound of the exact value


def test_split_calls_are_deterministic_and_leave_the_counters_at_zero():
    g = torch.Generator().manual_seed(21)
    heads, kv_heads, head_dim, max_len, q_len, attn_len = 14, 2, 16, 48, 16, 40
    k_cache, v_cache = caches(6, max_len, kv_heads, head_dim, g)
    slots, start = index([4, 1, 5]), index([24, 0, 11])
    q_a = torch.randn(3 * q_len, heads, head_dim, generator=g)
    q_b = torch.randn(3 * q_len, heads, head_dim, generator=g)
    workspace = da.attention_workspace(4, heads, q_len, 8, head_dim, "cpu")  # larger than the calls need

    def call(q: torch.Tensor) -> torch.Tensor:
        return da.decode_attention(q, k_cache, v_cache, slots, start, max_len=max_len, attn_len=attn_len, splits=7,
                                   block_n=16, workspace=workspace)

    first = call(q_a)
    assert not workspace.counters.any()
    assert workspace.row_sum.any()  # the partials went through the workspace
    other = call(q_b)  # another call in between: it starts from reset counters and gives its own result
    assert_within(other, *attend(q_b, k_cache, v_cache, slots, start, max_len))
    again = call(q_a)
    assert torch.equal(first, again)
    assert not workspace.counters.any()
    assert_within(first, *attend(q_a, k_cache, v_cache, slots, start, max_len))


def test_split_choices():
    assert da.tile_rows(16, 7) == 128 and da.tile_rows(1, 7) == 16 and da.tile_rows(16, 2) == 32
    assert [da.warps(m) for m in (16, 32, 64, 128, 256)] == [4, 4, 4, 8, 16]
    assert da.split_chunk(40, 7, 16) == 16 and da.split_chunk(40, 2, 16) == 32 and da.split_chunk(2048, 16) == 128
    # the 0.5B's drafting passes at 2,048 positions: 8 splits of 256 keys for 1 to 4 requests (sweep t4's choice)
    assert [da.default_splits(2048, n, 2) for n in (1, 2, 3, 4)] == [8, 8, 8, 8]
    assert [da.default_splits(2048, n, 2) for n in (5, 8, 16)] == [6, 4, 2]  # then about TARGET_PROGRAMS programs
    assert da.default_splits(40, 1, 2) == 1 and da.default_splits(300, 1, 2) == 3
    for attn_len in (1, 16, 100, 1000, 4096, 32768):
        for n in (1, 2, 4, 16, 64, 200):
            splits = da.default_splits(attn_len, n, 2)
            assert 1 <= splits <= da.MAX_SPLITS
            assert splits == 1 or n * 2 * splits <= da.TARGET_PROGRAMS
            assert splits == 1 or (splits - 1) * da.split_chunk(attn_len, splits) < attn_len  # no empty split
    with pytest.raises(ValueError, match="attn_len, n and kv_heads"):
        da.default_splits(0, 1, 2)


# --------------------------------------------------------------------------------------------------------------
# (c) StaticQwen2's sdpa attention
# --------------------------------------------------------------------------------------------------------------


def random_qwen2(heads: int, kv_heads: int, head_dim: int, hidden: int = 32, inter: int = 48, vocab: int = 64,
                 seed: int = 0) -> tuple[dict, dict[str, torch.Tensor]]:
    """A one-layer random Qwen2 (config, weights): StaticQwen2 only needs to be built; the tests call its
    attention alone."""
    g = torch.Generator().manual_seed(seed)
    cfg = {"hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "head_dim": head_dim, "num_hidden_layers": 1, "intermediate_size": inter, "vocab_size": vocab,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "self_attn.q_proj.weight": (heads * head_dim, hidden), "self_attn.q_proj.bias": (heads * head_dim,),
              "self_attn.k_proj.weight": (kv_heads * head_dim, hidden), "self_attn.k_proj.bias": (kv_heads * head_dim,),
              "self_attn.v_proj.weight": (kv_heads * head_dim, hidden), "self_attn.v_proj.bias": (kv_heads * head_dim,),
              "self_attn.o_proj.weight": (hidden, heads * head_dim), "mlp.gate_proj.weight": (inter, hidden),
              "mlp.up_proj.weight": (inter, hidden), "mlp.down_proj.weight": (hidden, inter),
              "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,)}
    weights = {(name if name.startswith("model.") else f"model.layers.0.{name}"): torch.randn(*shape, generator=g)
               for name, shape in shapes.items()}
    return cfg, weights


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (14, 2)])
def test_decode_attention_equals_static_qwen2_sdpa_attention(heads, kv_heads):
    head_dim, slots_total, max_len = 16, 4, 40
    cfg, weights = random_qwen2(heads, kv_heads, head_dim)
    model = StaticQwen2(cfg, weights, slots=slots_total, max_len=max_len, dtype=torch.float32, attention="sdpa")
    assert model.flash is None and model.max_len == 48  # rounded up to whole pages of BLOCK
    g = torch.Generator().manual_seed(31)
    kc, vc = model.k_cache[0], model.v_cache[0]  # [slots * blocks, BLOCK, kv_heads, D]
    kc.copy_(torch.randn(kc.shape, generator=g))
    vc.copy_(torch.randn(vc.shape, generator=g))
    workspace = da.attention_workspace(3, heads, 16, 4, head_dim, "cpu")
    for slots, starts, q_len, attn_len, splits in (([2, 0, 3], [24, 0, 9], 16, 40, 3),
                                                   ([1], [47], 1, 48, 4),
                                                   ([3, 1], [0, 20], 5, 32, 1)):
        n = len(slots)
        slot_t, start_t = index(slots), index(starts)
        q = torch.randn(n, q_len, heads, head_dim, generator=g)
        pos = start_t[:, None] + torch.arange(q_len)
        want = model._attend(q, kc, vc, slot_t, attn_len, model._mask(pos, attn_len))  # [n, Q, heads * D]
        got = da.decode_attention(q.reshape(n * q_len, heads, head_dim), kc, vc, slot_t, start_t,
                                  max_len=model.max_len, attn_len=attn_len, splits=splits, block_n=16,
                                  workspace=workspace)
        # sdpa is a float32 computation too: each side within the bound of the exact value
        bound = rounding_bound(q.reshape(n * q_len, heads, head_dim), kc, vc, slot_t, start_t, model.max_len)
        assert_within(got.view(n, q_len, heads * head_dim), want, 2 * bound.view(n, q_len, heads * head_dim))


# --------------------------------------------------------------------------------------------------------------
# (d) inputs the kernel cannot run
# --------------------------------------------------------------------------------------------------------------


def test_decode_attention_refuses_inputs_it_cannot_run():
    heads, kv_heads, head_dim, max_len = 4, 2, 16, 32
    kc = torch.zeros(2 * max_len // BLOCK, BLOCK, kv_heads, head_dim)
    q = torch.zeros(2 * 5, heads, head_dim)
    slots, start = index([0, 1]), index([0, 3])
    ws = da.attention_workspace(2, heads, 5, 2, head_dim, "cpu")

    def call(**changes):
        args = dict(q=q, k_cache=kc, v_cache=kc, slots=slots, start=start, max_len=max_len, attn_len=16, splits=2,
                    block_n=16, workspace=ws)
        args.update(changes)
        return da.decode_attention(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), args.pop("slots"),
                                   args.pop("start"), **args)

    call()  # the defaults run
    cases = [
        (dict(q=q.view(10, -1)), r"q must be a \[n \* Q, heads, head_dim\] tensor"),
        (dict(q=q.double()), "q must be float16, bfloat16 or float32"),
        (dict(q=torch.zeros(10, head_dim, heads).transpose(1, 2)), "q must be contiguous"),
        (dict(q=q.half()), "k_cache must be torch.float16"),
        (dict(v_cache=kc.bfloat16()), "v_cache must be torch.float32"),
        (dict(q=torch.zeros(10, heads, 24), k_cache=torch.zeros(4, BLOCK, kv_heads, 24)), "head_dim must be a power"),
        (dict(q=torch.zeros(10, 3, head_dim)), r"q's heads \(3\) must be a multiple of the caches' kv_heads \(2\)"),
        (dict(k_cache=torch.zeros(4, BLOCK, kv_heads, 32)), r"k_cache must end in \[kv_heads, head_dim=16\]"),
        (dict(v_cache=torch.zeros(2, BLOCK, kv_heads, head_dim)), "k_cache and v_cache must have one shape"),
        (dict(k_cache=kc[:3], v_cache=kc[:3]), "k_cache must hold a whole number"),
        (dict(slots=index([0, 1, 1]), start=index([0, 0, 0])), r"q's rows \(10\) must be a whole"),
        (dict(slots=torch.zeros(2)), "slots must be an int32 or int64 vector"),
        (dict(start=index([0])), r"start must have as many entries as slots \(2\)"),
        (dict(slots=index([])), "slots must hold at least one request"),
        (dict(attn_len=0), r"attn_len must be an int in \[Q=5, max_len=32\]"),
        (dict(attn_len=33), "attn_len must be an int in"),
        (dict(max_len=0), "max_len must be an int >= 1"),
        (dict(splits=0), "splits must be an int >= 1"),
        (dict(block_n=24), "block_n must be a power of two >= 16"),
        (dict(block_n=8), "block_n must be a power of two >= 16"),
        (dict(workspace=None), "workspace is needed for splits=2"),
        (dict(splits=3), "workspace is too small"),
        (dict(workspace=da.attention_workspace(1, heads, 5, 2, head_dim, "cpu")), "workspace is too small"),
        (dict(workspace=da.attention_workspace(2, heads, 5, 2, head_dim, "meta")),
         "workspace.counters must be on cpu like q"),
        (dict(workspace=da.AttentionWorkspace(ws.counters.long(), ws.row_max, ws.row_sum, ws.acc)),
         "workspace.counters must be a contiguous torch.int32"),
    ]
    for changes, message in cases:
        with pytest.raises(ValueError, match=message):
            call(**changes)
    with pytest.raises(ValueError, match="must be >= 1"):
        da.attention_workspace(0, heads, 5, 2, head_dim, "cpu")


# --------------------------------------------------------------------------------------------------------------
# GPU: the 0.5B's shapes in bf16
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not CUDA, reason="runs the compiled Triton kernel on a CUDA device")
def test_decode_attention_on_the_gpu_at_the_05b_shapes_and_in_a_cuda_graph():
    """bf16, 14 query heads over 2 KV heads of 64, 16 query rows per request, 2,048 positions of 2,064: 1 and 4
    requests at 1, the default and the most splits against the float32 reference, repeated calls equal bit for bit;
    then a call captured in a CUDA graph and replayed with new queries, slots and starts gives its eager result."""
    heads, kv_heads, head_dim, q_len, max_len, attn_len, slots_total = 14, 2, 64, 16, 2064, 2048, 6
    g = torch.Generator().manual_seed(41)
    k_cache, v_cache = (c.cuda() for c in caches(slots_total, max_len, kv_heads, head_dim, g, torch.bfloat16))
    workspace = da.attention_workspace(4, heads, q_len, da.MAX_SPLITS, head_dim, "cuda")
    bf16 = dict(rtol=2e-2, atol=2e-2)

    def call(q: torch.Tensor, slots: torch.Tensor, start: torch.Tensor, splits: int | None,
             block_m: int | None = None) -> torch.Tensor:
        return da.decode_attention(q, k_cache, v_cache, slots, start, max_len=max_len, attn_len=attn_len,
                                   splits=splits, block_m=block_m, workspace=workspace)

    for slots, starts in (([3], [attn_len - q_len]), ([5, 0, 2, 4], [attn_len - q_len, 0, 1000, 517])):
        n = len(slots)
        slot_t, start_t = index(slots, device="cuda"), index(starts, torch.int32, "cuda")
        q = torch.randn(n * q_len, heads, head_dim, generator=g).bfloat16().cuda()
        want = reference(q.float(), k_cache.float(), v_cache.float(), slot_t, start_t, max_len)
        for splits, block_m in ((1, None), (None, None), (da.MAX_SPLITS, None), (da.MAX_SPLITS, 16), (8, 32)):
            got = call(q, slot_t, start_t, splits, block_m)
            what = f"n={n} splits={splits} block_m={block_m}"
            torch.testing.assert_close(got.double(), want, **bf16, msg=lambda m: f"{what}: {m}")
            assert torch.equal(call(q, slot_t, start_t, splits, block_m), got), f"{what}: not deterministic"
            assert not workspace.counters.any()

    # a CUDA graph: warm-up on a side stream (Triton compiles there), capture, new inputs, replay
    slot_t, start_t = index([1, 3, 0, 5], device="cuda"), index([2032, 100, 1500, 0], torch.int32, "cuda")
    q = torch.randn(4 * q_len, heads, head_dim, generator=g).bfloat16().cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call(q, slot_t, start_t, None)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call(q, slot_t, start_t, None)
    q.copy_(torch.randn(4 * q_len, heads, head_dim, generator=g).bfloat16())
    slot_t.copy_(index([4, 2, 1, 0], device="cuda"))
    start_t.copy_(index([7, 2032, 64, 1999], torch.int32, "cuda"))
    graph.replay()
    replayed = captured.clone()
    graph.replay()  # a second replay: the first left the counters at zero
    assert torch.equal(captured, replayed)
    assert torch.equal(replayed, call(q, slot_t, start_t, None))
    torch.testing.assert_close(replayed.double(), reference(q.float(), k_cache.float(), v_cache.float(), slot_t,
                                                            start_t, max_len), **bf16)
    assert not workspace.counters.any()
