"""Tile sweep of the drafter's Triton kernels at the 0.5B's shapes, bf16, random weights (a kernel's time does not
depend on the values): the four layer kernels (`hqlab_kernels.drafter_layers`) against cuBLAS on the same products,
and the attention (`hqlab_kernels.drafter_attention`) against vLLM's FlashAttention 3 as the drafter calls it.

Each candidate `Tiles` (columns per program, reduction step, warps, pipeline depth, split of the reduction) of each
kernel is checked against the torch formula on layer 0, then timed as a drafting pass sees it: one CUDA graph
launching it once per layer over 24 layers' own weights (715 MB, so nothing stays in L2 from one launch to the next),
replayed; the time is per launch. cuBLAS runs the kernel's product alone (F.linear, the weights' reading floor of
the torch path) the same way. The best passing candidate per (kernel, rows) is written as a TILES table that
`fused_pass_kernels.py --tiles` (experiments/drafting_step_profile/) and `StaticQwen2` take; the attention's best
block_n, warps, stages and splits per batch as "attention@n" entries (fused_pass_kernels.py applies those too).

Compiling ~100 variants per kernel is what takes the time: worker processes compile them first (Triton's on-disk
cache), the timing process then loads them.

  GPU:  python3 experiments/drafter_kernel_tiles/drafter_layer_tiles.py [--tag a] [--rows 16 64] [--workers 12] \\
            [--quick]
  writes $OUT/drafter_layer_tiles_<tag>.json: every candidate's time and error, the cuBLAS times, the best table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # a bare checkout on the GPU host

H, HEADS, KV_HEADS, D, INTER, LAYERS = 896, 14, 2, 64, 4864, 24  # Qwen2.5-0.5B
QKV = (HEADS + 2 * KV_HEADS) * D
EPS = 1e-6
MAX_SPLIT = 8


def candidates(kernel: str, rows: int, quick: bool) -> list[dict]:
    """The grid swept for one kernel: columns per program around what keeps 100-600 programs on 132 SMs, splits of
    the reduction, its step and the pipeline depth."""
    block_n = {"qkv": (4, 8, 16), "o_proj": (8, 16, 32), "gate_up": (16, 32, 64), "down": (8, 16, 32)}[kernel]
    splits = (1, 2, 4, 8)
    block_k = (64, 128, 256)
    stages = (3, 4)
    warps = (4,) if rows <= 16 else (8,)  # drafter_layers.num_warps' choice: no register spills
    if quick:
        block_n, splits, block_k, stages = block_n[:2], (1, 4), (128,), (3,)
    reduction = INTER if kernel == "down" else H
    out = []
    for bn, split, bk, st, w in itertools.product(block_n, splits, block_k, stages, warps):
        if reduction / split < bk / 2:  # a split of less than half a step: all overhead
            continue
        out.append({"block_n": bn, "block_k": bk, "num_warps": w, "num_stages": st, "split_k": split})
    return out


class Problem:
    """One kernel's inputs at `rows` rows over LAYERS layers' weights, its launch per layer, and its torch formula."""

    def __init__(self, kernel: str, rows: int, device: str = "cuda") -> None:
        import torch

        from hqlab_kernels import drafter_layers as dl

        self.kernel, self.rows, self.dl = kernel, rows, dl
        g = torch.Generator(device=device).manual_seed(rows)
        bf = torch.bfloat16

        def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=g, device=device) * scale).to(bf)

        self.x = randn(rows, H)
        self.norm = [1 + randn(H, scale=0.1) for _ in range(LAYERS)]
        if kernel == "qkv":
            self.w = [randn(QKV, H, scale=0.03) for _ in range(LAYERS)]
            self.b = [randn(QKV, scale=0.1) for _ in range(LAYERS)]
            inv = 1.0 / 1e6 ** (torch.arange(0, D, 2, dtype=torch.float32, device=device) / D)
            emb = torch.outer(torch.arange(4096, dtype=torch.float32, device=device), inv).repeat(1, 2)
            self.cos, self.sin = emb.cos().to(bf), emb.sin().to(bf)
            self.pos = torch.arange(2000, 2000 + rows, device=device)
            self.index = self.pos.clone()
            self.k_cache = torch.zeros(4096, KV_HEADS, D, dtype=bf, device=device)
            self.v_cache = torch.zeros_like(self.k_cache)
        elif kernel == "o_proj":
            self.a = randn(rows, HEADS * D)
            self.w = [randn(H, HEADS * D, scale=0.03) for _ in range(LAYERS)]
        elif kernel == "gate_up":
            self.w = [randn(2 * INTER, H, scale=0.03) for _ in range(LAYERS)]
        else:
            self.a = randn(rows, INTER)
            self.w = [randn(H, INTER, scale=0.015) for _ in range(LAYERS)]
        self.ws = dl.Workspace.for_layer(hidden=H, inter=INTER, qkv_rows=QKV, max_rows=rows, max_split=MAX_SPLIT,
                                         device=device)

    def launch(self, layer: int, tiles: dict | None):
        """The kernel on layer `layer`'s weights with `tiles` (None: the table's)."""
        dl, t = self.dl, dict(tiles or {})
        if t:
            t["workspace"] = self.ws
        if self.kernel == "qkv":
            if "block_n" in t:
                t["half_block"] = t.pop("block_n")
            return dl.norm_qkv_rope_cache(self.x, self.norm[layer], self.w[layer], self.b[layer], self.cos, self.sin,
                                          self.pos, self.index, self.k_cache, self.v_cache, heads=HEADS,
                                          kv_heads=KV_HEADS, eps=EPS, **t)
        if self.kernel == "o_proj":
            return dl.o_proj_residual(self.x, self.a, self.w[layer], **t)
        if self.kernel == "gate_up":
            return dl.norm_gate_up_silu(self.x, self.norm[layer], self.w[layer], eps=EPS, **t)
        return dl.down_residual(self.x, self.a, self.w[layer], **t)

    def cublas(self, layer: int):
        """The kernel's product alone in cuBLAS (what the torch path pays for the weights)."""
        import torch.nn.functional as F

        if self.kernel == "qkv":
            return F.linear(self.x, self.w[layer], self.b[layer])
        if self.kernel == "gate_up":
            return F.linear(self.x, self.w[layer])
        return F.linear(self.a, self.w[layer])

    def reference(self):
        """The torch formula on layer 0 in float32 from the bf16 inputs (q for K1)."""
        import torch
        import torch.nn.functional as F

        def rms(x, w):
            x32 = x.float()
            return w.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS))

        x = self.x.float()
        if self.kernel == "qkv":
            qkv = F.linear(rms(self.x, self.norm[0]), self.w[0].float(), self.b[0].float())
            q = qkv[:, :HEADS * D].view(self.rows, HEADS, D)
            c, s = self.cos[self.pos].float()[:, None], self.sin[self.pos].float()[:, None]
            return q * c + torch.cat([-q[..., D // 2:], q[..., :D // 2]], -1) * s
        if self.kernel == "o_proj":
            return x + F.linear(self.a.float(), self.w[0].float())
        if self.kernel == "gate_up":
            gate, up = F.linear(rms(self.x, self.norm[0]), self.w[0].float()).chunk(2, -1)
            return F.silu(gate) * up
        return x + F.linear(self.a.float(), self.w[0].float())


def error(problem: Problem, tiles: dict | None) -> float:
    """Max |kernel - formula| / max |formula| on layer 0 (bf16 rounding alone is ~4e-3)."""
    got = problem.launch(0, tiles).float()
    want = problem.reference()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))


def per_launch_us(fn_layer, repeats: int = 20) -> float:
    """µs per launch of fn_layer(l) for l over the LAYERS layers, from one CUDA graph of all of them."""
    from hqlab.bench.gpu_timing import graph_ms

    return graph_ms(lambda: [fn_layer(layer) for layer in range(LAYERS)], repeats) * 1000 / LAYERS


ATTN_SLOTS, ATTN_MAX_LEN, Q_LEN = 4, 4160, 16  # vLLM's drafter cache for max_model_len 4096 + k 31 + block 1


def attention_candidates(quick: bool, q_len: int = Q_LEN) -> list[dict]:
    """Query rows per program (a KV head's 112 rows in one tile of 128, or tiles of 16-64; at 32 queries its 224
    rows also in one tile of 256), key splits, keys per step and warps (fewer for the small tiles); run t1 found 3
    stages and block_n 32 best with one tile."""
    out = []
    tiles = (16, 32, 64, 128) + ((256,) if q_len * HEADS // KV_HEADS > 128 else ())
    for bm, sp, bn in itertools.product(tiles, (4, 8, 16, 32), (32, 64)):
        for w in ((2, 4) if bm <= 32 else (4, 8) if bm <= 128 else (8, 16)):
            out.append({"block_m": bm, "splits": sp, "block_n": bn, "num_stages": 3, "num_warps": w})
    return out[::8] if quick else out


class AttentionProblem:
    """One drafting pass's attention: n requests of q_len query rows (Q_LEN: a k = 15 pass; 32: a k = 31 pass) at
    positions history.. over LAYERS layers' own caches, as StaticQwen2 lays them out (pages of 16 positions, one row
    of ATTN_MAX_LEN per slot)."""

    def __init__(self, n: int, history: int, device: str = "cuda", q_len: int = Q_LEN) -> None:
        import torch

        from hqlab_kernels import drafter_attention as da

        self.da, self.n, self.history, self.q_len = da, n, history, q_len
        Q = q_len
        g = torch.Generator(device=device).manual_seed(n)
        bf = torch.bfloat16
        blocks = ATTN_MAX_LEN // 16
        shape = (ATTN_SLOTS * blocks, 16, KV_HEADS, D)
        self.k = [torch.randn(*shape, generator=g, device=device).to(bf) for _ in range(LAYERS)]
        self.v = [torch.randn(*shape, generator=g, device=device).to(bf) for _ in range(LAYERS)]
        self.q = torch.randn(n * Q, HEADS, D, generator=g, device=device).to(bf)
        self.slots = torch.arange(n, device=device, dtype=torch.int64)
        self.start = torch.full((n,), history, device=device, dtype=torch.int64)
        self.ws = da.attention_workspace(ATTN_SLOTS, HEADS, Q, 32, D, device)
        # FlashAttention 3 as StaticQwen2._flash_inputs / _attend call it (plan_once: one scheduler call per pass)
        self.flash = None
        try:
            from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

            cu_q = torch.arange(0, (n + 1) * Q, Q, dtype=torch.int32, device=device)
            used = (self.start + Q).to(torch.int32)
            table = (self.slots[:, None] * blocks + torch.arange(blocks, device=device)).to(torch.int32)
            plan = get_scheduler_metadata(batch_size=n, max_seqlen_q=Q, max_seqlen_k=ATTN_MAX_LEN,
                                          num_heads_q=HEADS, num_heads_kv=KV_HEADS, headdim=D, cache_seqlens=used,
                                          qkv_dtype=bf, cu_seqlens_q=cu_q, page_size=16, causal=True, num_splits=0)

            def flash(layer: int):
                return flash_attn_varlen_func(self.q, self.k[layer], self.v[layer], max_seqlen_q=Q,
                                              cu_seqlens_q=cu_q, max_seqlen_k=ATTN_MAX_LEN, seqused_k=used,
                                              causal=True, block_table=table, scheduler_metadata=plan, num_splits=0,
                                              fa_version=3)

            self.flash = flash
        except Exception as e:  # noqa: BLE001 - no vLLM here: the Triton candidates alone
            print(f"no FlashAttention to compare with: {type(e).__name__}: {e}", flush=True)

    def launch(self, layer: int, tiles: dict | None):
        t = dict(tiles or {})
        return self.da.decode_attention(self.q, self.k[layer], self.v[layer], self.slots, self.start,
                                        max_len=ATTN_MAX_LEN, attn_len=ATTN_MAX_LEN, workspace=self.ws, **t)

    def error(self, tiles: dict | None) -> float:
        import torch

        Q = self.q_len
        got = self.launch(0, tiles).float().view(self.n, Q, HEADS, D)
        worst = 0.0
        for b in range(self.n):
            end = self.history + Q
            keys = self.k[0].view(ATTN_SLOTS, -1, KV_HEADS, D)[b, :end].float().repeat_interleave(HEADS // KV_HEADS, 1)
            vals = self.v[0].view(ATTN_SLOTS, -1, KV_HEADS, D)[b, :end].float().repeat_interleave(HEADS // KV_HEADS, 1)
            q = self.q.view(self.n, Q, HEADS, D)[b].float()
            scores = torch.einsum("qhd,khd->hqk", q, keys) / D ** 0.5
            pos = self.history + torch.arange(Q, device=q.device)
            scores = scores.masked_fill(torch.arange(end, device=q.device)[None, None, :] > pos[None, :, None],
                                        float("-inf"))
            want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals)
            worst = max(worst, float((got[b] - want).abs().max() / want.abs().max()))
        return worst


def compile_worker(jobs: list[tuple[str, int, dict]]) -> int:
    """Compile (by running once) each (kernel, rows, tiles): fills Triton's on-disk cache for the timing process."""
    import torch

    problems: dict = {}
    done = 0
    for kernel, rows, tiles in jobs:
        # attention jobs carry (requests, queries per request) as their rows
        make = (lambda: AttentionProblem(rows[0], 2048, q_len=rows[1])) if kernel == "attention" else \
            (lambda: Problem(kernel, rows))
        problem = problems.get((kernel, rows)) or problems.setdefault((kernel, rows), make())
        try:
            problem.launch(0, tiles)
            done += 1
        except Exception:  # noqa: BLE001 - the timing process records the failure
            pass
    torch.cuda.synchronize()
    return done


def main() -> None:
    import multiprocessing as mp

    import torch
    from tqdm import tqdm

    from hqlab_kernels import drafter_layers as dl

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tag", default="a")
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    p.add_argument("--kernels", nargs="+", default=list(dl.KERNELS), choices=dl.KERNELS)
    p.add_argument("--workers", type=int, default=12, help="processes compiling the variants first (0: none)")
    p.add_argument("--quick", action="store_true", help="a few candidates per kernel (a smoke run)")
    p.add_argument("--attention", type=int, nargs="*", default=[1, 4], help="batch sizes of the attention sweep "
                   "(at 2,048 cached positions; none: skip it)")
    p.add_argument("--attention-q", type=int, nargs="+", default=[Q_LEN, 32], help="query rows per request of the "
                   "attention sweep (16: a k = 15 pass, 32: a k = 31 pass; results beyond 16 are keyed attention@NqQ)")
    p.add_argument("--pdl", action="store_true", help="launch with programmatic dependent launch (the "
                   "kernels' default is without it: run t2 found it slower)")
    p.add_argument("--max-error", type=float, default=0.05, help="largest relative error a candidate may have "
                   "(bf16 rounding of gate, up and silu alone gives K3 ~3e-2 against a float32 formula)")
    args = p.parse_args()
    out = Path(os.environ.get("OUT", "."))
    if args.pdl:
        from hqlab_kernels import drafter_attention

        dl.PDL = drafter_attention.PDL = True
    jobs = [(k, r, c) for r in args.rows for k in args.kernels for c in candidates(k, r, args.quick)]
    jobs += [("attention", (args.attention[0], q), c) for q in args.attention_q
             for c in attention_candidates(args.quick, q)] if args.attention else []
    t0 = time.time()
    if args.workers > 0:
        ctx = mp.get_context("spawn")
        chunks = [jobs[i::args.workers] for i in range(args.workers)]
        with ctx.Pool(args.workers) as pool:
            compiled = sum(pool.map(compile_worker, chunks))
        print(f"compiled {compiled} of {len(jobs)} variants in {time.time() - t0:.0f} s", flush=True)
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "pdl": dl.PDL,
                    "triton": __import__("triton").__version__, "layers": LAYERS, "rows": [], "cublas": [],
                    "table_before": {f"{k}@{r}": asdict(t) for (k, r), t in dl.TILES.items()}}
    best: dict = {}
    for rows in args.rows:
        for kernel in args.kernels:
            problem = Problem(kernel, rows)
            cublas = per_launch_us(problem.cublas)
            default_us = per_launch_us(lambda layer: problem.launch(layer, None))
            result["cublas"].append({"kernel": kernel, "rows": rows, "us": cublas, "table_us": default_us,
                                     "table_error": error(problem, None)})
            print(f"{kernel}@{rows}: cuBLAS product {cublas:.2f} us, current table {default_us:.2f} us", flush=True)
            for tiles in tqdm(candidates(kernel, rows, args.quick), desc=f"{kernel}@{rows}", mininterval=5):
                row = {"kernel": kernel, "rows": rows, **tiles}
                try:
                    row["error"] = error(problem, tiles)
                    row["us"] = per_launch_us(lambda layer: problem.launch(layer, tiles))
                    row["counters_clean"] = int(problem.ws.counters.abs().sum()) == 0
                except Exception as e:  # noqa: BLE001 - a variant that fails to compile or run is recorded
                    row["failed"] = f"{type(e).__name__}: {str(e)[:200]}"
                result["rows"].append(row)
                ok = "us" in row and row["error"] <= args.max_error and row["counters_clean"]
                if ok and row["us"] < best.get((kernel, rows), {"us": float("inf")})["us"]:
                    best[(kernel, rows)] = row
            b = best.get((kernel, rows))
            if b:
                print(f"  best {kernel}@{rows}: {b['us']:.2f} us (err {b['error']:.1e}) "
                      f"{ {k: b[k] for k in ('block_n', 'block_k', 'num_warps', 'num_stages', 'split_k')} }",
                      flush=True)
            del problem
            torch.cuda.empty_cache()
    for n, q in itertools.product(args.attention, args.attention_q):
        problem = AttentionProblem(n, 2048, q_len=q)
        key = ("attention", n if q == Q_LEN else f"{n}q{q}")  # attention@1, attention@1q32
        flash_us = per_launch_us(problem.flash) if problem.flash else None
        default_us = per_launch_us(lambda layer: problem.launch(layer, None))
        result["cublas"].append({"kernel": "attention", "rows": n, "q_len": q, "flash_us": flash_us,
                                 "table_us": default_us, "table_error": problem.error(None)})
        print(f"attention n={n} q={q}: FlashAttention {flash_us} us, current defaults {default_us:.2f} us", flush=True)
        for tiles in tqdm(attention_candidates(args.quick, q), desc=f"attention n={n} q={q}", mininterval=5):
            row = {"kernel": "attention", "rows": n, "q_len": q, **tiles}
            try:
                row["error"] = problem.error(tiles)
                row["us"] = per_launch_us(lambda layer: problem.launch(layer, tiles))
                row["counters_clean"] = int(problem.ws.counters.abs().sum()) == 0
            except Exception as e:  # noqa: BLE001
                row["failed"] = f"{type(e).__name__}: {str(e)[:200]}"
            result["rows"].append(row)
            ok = "us" in row and row["error"] <= args.max_error and row["counters_clean"]
            if ok and row["us"] < best.get(key, {"us": float("inf")})["us"]:
                best[key] = row
        if b := best.get(key):
            print(f"  best attention n={n} q={q}: {b['us']:.2f} us (err {b['error']:.1e}) "
                  f"{ {k: b[k] for k in ('block_m', 'splits', 'block_n', 'num_warps', 'num_stages')} }", flush=True)
        del problem
        torch.cuda.empty_cache()
    fields = ("block_n", "block_k", "num_warps", "num_stages", "split_k", "splits", "block_m")
    result["best"] = {f"{k}@{r}": {n: b[n] for n in fields if n in b} | {"us": b["us"], "error": b["error"]}
                      for (k, r), b in best.items()}
    result["seconds"] = time.time() - t0
    path = out / f"drafter_layer_tiles_{args.tag}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path} ({len(result['rows'])} candidates, {result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
