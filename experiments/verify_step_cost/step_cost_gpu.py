"""Verify-step cost on a GPU at real model shapes: time vs verify length (1..32), context length and batch (1..64).

Models are Qwen2.5 configurations (0.5B, 1.5B, 7B, 32B) built with random bf16 weights directly on the GPU (no
weights are downloaded: timing does not depend on their values). Two ways of running the same step:

- `hf-eager`: the transformers model's own forward over a DynamicCache, the call hqlab's engine makes (logits for
  every verified position), cache cropped back after each step. Python and kernel-launch overhead included.
- `graph`: the same computation (Qwen2 layers: RMSNorm, QKV with bias, RoPE, grouped-query attention over the
  cache, SwiGLU MLP, logits for every position) written directly in torch on preallocated cache tensors and
  replayed as a CUDA graph, which is how serving engines remove launch overhead. The decoder shares the
  transformers model's weight tensors; `--check` compares its logits with transformers' on a small config.

torch, transformers and pyarrow (the GPU machine has no polars), and hqlab's graph timer (`hqlab.bench.gpu_timing`).
Writes OUT/step_cost_gpu.parquet (rows: model, mode, batch, context, verify_len, step_ms, ...) after every model,
so a run stopped by its time limit still returns what it measured.

Usage: python experiments/verify_step_cost/step_cost_gpu.py --out DIR [--models 0.5b,1.5b,7b,32b] [--budget-s 270]
           [--check]
       python experiments/verify_step_cost/step_cost_gpu.py --smoke --device cpu  (tiny shapes: every path on a CPU)
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # a bare checkout on the GPU host

from hqlab.bench.gpu_timing import median_replay_ms  # noqa: E402  (torch only)

ROPE_THETA = 1e6
# Qwen2.5 shapes (the published configs' values).
SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
}


@dataclass(frozen=True)
class Grid:
    """Which (batch, context, verify_len) points to time, per mode."""

    verify_lens: tuple[int, ...] = tuple(range(1, 33))
    staircase_batches: tuple[int, ...] = (1, 8)  # the full verify-length sweep runs at these batch sizes
    contexts: tuple[int, ...] = (512, 2048, 8192, 32768)
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    probe_lens: tuple[int, ...] = (1, 8, 16, 32)  # verify lengths used on the context and batch sweeps
    base_context: int = 2048

    def points(self, mode: str) -> list[tuple[int, int, int]]:
        pts: list[tuple[int, int, int]] = []
        batches = self.staircase_batches if mode == "graph" else self.staircase_batches[:1]
        for b in batches:
            pts += [(b, self.base_context, v) for v in self.verify_lens]
        pts += [(1, c, v) for c in self.contexts for v in self.probe_lens]
        pts += [(b, self.base_context, v) for b in self.batches for v in self.probe_lens]
        seen, out = set(), []
        for p in pts:
            if p not in seen:
                seen.add(p)
                out.append(p)
        return out


SMOKE = Grid(verify_lens=(1, 2, 3), staircase_batches=(1, 2), contexts=(16, 32), batches=(1, 2), probe_lens=(1, 3),
             base_context=16)


def build_model(name: str, device: str, dtype: torch.dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**SHAPES[name], max_position_embeddings=40960, rope_theta=ROPE_THETA, rms_norm_eps=1e-6,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():  # the library's init leaves some tensors at constants; timing wants ordinary values
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    return model.eval(), cfg


# ------------------------------------------------------------------------------------------------------------------
# The same step written directly in torch (for CUDA graphs)


class StaticDecoder:
    """Qwen2's forward over preallocated KV tensors [batch, kv_heads, capacity, head_dim], sharing the weights of
    a transformers Qwen2ForCausalLM. `step(ids, ctx)` scores ids [batch, v] at positions ctx .. ctx+v-1."""

    attention = "mask"  # "mask": a boolean causal mask; "lower-right": torch's lower-right causal bias (flash)

    def __init__(self, model, batch: int, capacity: int) -> None:
        cfg = model.config
        self.m = model.model
        self.lm_head = model.lm_head
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = cfg.hidden_size // self.nh
        self.eps = cfg.rms_norm_eps
        p = next(model.parameters())
        shape = (batch, self.nkv, capacity, self.hd)
        self.k = [torch.randn(shape, device=p.device, dtype=p.dtype) for _ in self.m.layers]
        self.v = [torch.randn(shape, device=p.device, dtype=p.dtype) for _ in self.m.layers]
        inv = 1.0 / (ROPE_THETA ** (torch.arange(0, self.hd, 2, device=p.device, dtype=torch.float32) / self.hd))
        freqs = torch.outer(torch.arange(capacity, device=p.device, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos().to(p.dtype), emb.sin().to(p.dtype)

    def _norm(self, x, w):
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    @staticmethod
    def _rotate(x):
        h = x.shape[-1] // 2
        return torch.cat([-x[..., h:], x[..., :h]], dim=-1)

    def step(self, ids: torch.Tensor, ctx: int) -> torch.Tensor:
        b, n = ids.shape
        x = self.m.embed_tokens(ids)
        cos, sin = self.cos[ctx : ctx + n][None, None], self.sin[ctx : ctx + n][None, None]
        mask = None
        if n > 1:  # position i sees the cache and positions <= i
            mask = _causal(n, ctx + n, ids.device, self.attention)
        for i, layer in enumerate(self.m.layers):
            a = layer.self_attn
            h = self._norm(x, layer.input_layernorm.weight)
            q = a.q_proj(h).view(b, n, self.nh, self.hd).transpose(1, 2)
            k = a.k_proj(h).view(b, n, self.nkv, self.hd).transpose(1, 2)
            v = a.v_proj(h).view(b, n, self.nkv, self.hd).transpose(1, 2)
            q = q * cos + self._rotate(q) * sin
            k = k * cos + self._rotate(k) * sin
            self.k[i][:, :, ctx : ctx + n] = k
            self.v[i][:, :, ctx : ctx + n] = v
            o = F.scaled_dot_product_attention(q, self.k[i][:, :, : ctx + n], self.v[i][:, :, : ctx + n],
                                               attn_mask=mask, enable_gqa=True)
            x = x + a.o_proj(o.transpose(1, 2).reshape(b, n, self.nh * self.hd))
            h = self._norm(x, layer.post_attention_layernorm.weight)
            mlp = layer.mlp
            x = x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
        return self.lm_head(self.m.norm(x))


def _causal(n: int, total: int, device, kind: str):
    if kind == "lower-right":
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(n, total)
    return torch.ones(n, total, dtype=torch.bool, device=device).tril(diagonal=total - n)


def pick_attention(device: str) -> str:
    """The lower-right causal bias lets SDPA use its flash kernel for a verify block over a cache; use it where it
    runs and agrees with the explicit mask (bf16, grouped-query shapes), else the mask."""
    g = torch.Generator(device="cpu").manual_seed(2)
    q = torch.randn(2, 8, 7, 64, generator=g).to(device, torch.bfloat16)
    k = torch.randn(2, 2, 40, 64, generator=g).to(device, torch.bfloat16)
    v = torch.randn(2, 2, 40, 64, generator=g).to(device, torch.bfloat16)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=_causal(7, 40, device, "mask"),
                                         enable_gqa=True)
    try:
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=_causal(7, 40, device, "lower-right"),
                                             enable_gqa=True)
    except Exception as e:  # noqa: BLE001 - any failure means: not usable here
        print(f"lower-right causal attention unavailable ({type(e).__name__}: {e}); using a mask")
        return "mask"
    err = float((got.float() - ref).abs().max() / ref.abs().max())
    return "lower-right" if err < 2e-2 else "mask"


def check_decoder(device: str) -> float:
    """Largest |logit difference| between StaticDecoder and transformers on a tiny fp32 model with a real prefix
    (the cache filled by transformers' own prefill), relative to the logits' scale."""
    model, cfg = build_model("tiny", device, torch.float32)
    g = torch.Generator(device="cpu").manual_seed(1)
    prefix = torch.randint(0, cfg.vocab_size, (2, 11), generator=g).to(device)
    step = torch.randint(0, cfg.vocab_size, (2, 5), generator=g).to(device)
    with torch.no_grad():
        ref = model(input_ids=torch.cat([prefix, step], 1)).logits[:, -5:]
        dec = StaticDecoder(model, 2, 32)
        out = model(input_ids=prefix, use_cache=True)
        cache = out.past_key_values
        for i in range(cfg.num_hidden_layers):
            k, v = _cache_layer(cache, i)
            dec.k[i][:, :, :11], dec.v[i][:, :, :11] = k, v
        got = dec.step(step, 11)
    return float((got - ref).abs().max() / ref.abs().max())


def _cache_layer(cache, i):
    if hasattr(cache, "layers"):  # transformers 5
        return cache.layers[i].keys, cache.layers[i].values
    return cache.key_cache[i], cache.value_cache[i]


# ------------------------------------------------------------------------------------------------------------------
# Timing


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_graph(model, batch: int, ctx: int, n: int, reps: int, device: str) -> float:
    """Median ms per replay of the step captured as a CUDA graph (eager timing on a CPU, for --smoke)."""
    dec = StaticDecoder(model, batch, ctx + n)
    ids = torch.randint(0, model.config.vocab_size, (batch, n), device=device)
    with torch.no_grad():
        if not device.startswith("cuda"):
            times = []
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                dec.step(ids, ctx)
                times.append(time.perf_counter() - t0)
            return 1e3 * statistics.median(times[1:])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                dec.step(ids, ctx)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            dec.step(ids, ctx)
        graph.replay()
        torch.cuda.synchronize()
        ms = median_replay_ms(graph, reps)
        del graph
        return ms


def time_eager(model, batch: int, ctx: int, n: int, reps: int, device: str) -> float:
    """Median ms of transformers' forward over a DynamicCache of `ctx` tokens, as hqlab's engine calls it
    (logits of every position read back), the cache cropped back after each step."""
    from transformers import DynamicCache

    cfg = model.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    p = next(model.parameters())
    try:
        cache = DynamicCache(config=cfg)
    except TypeError:  # older releases take no config
        cache = DynamicCache()
    for i in range(cfg.num_hidden_layers):  # a filled cache without paying for a prefill
        kv = torch.randn(batch, cfg.num_key_value_heads, ctx, hd, device=p.device, dtype=p.dtype)
        cache.update(kv, kv.clone(), i)
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.randint(0, cfg.vocab_size, (batch, n), device=device)
    times = []
    with torch.no_grad():
        for _ in range(reps + 2):
            _sync(device)
            t0 = time.perf_counter()
            logits = model(input_ids=ids, use_cache=True, **{kw: cache}).logits
            logits[0, -1, 0].item()  # the engine reads the verdict back: include that sync
            times.append(time.perf_counter() - t0)
            remove = cache.get_seq_length() - ctx
            if remove > 0:
                cache.crop(-remove)
    return 1e3 * statistics.median(times[2:])


def reps_for(est_ms: float) -> int:
    return int(min(20, max(5, 400 / max(est_ms, 1e-3))))


def write_rows(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--models", default="0.5b,1.5b,7b,32b")
    ap.add_argument("--modes", default="graph,hf-eager")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget-s", type=float, default=270.0, help="stop starting new points after this long")
    ap.add_argument("--check", action="store_true", help="compare the graph decoder with transformers first")
    ap.add_argument("--smoke", action="store_true", help="tiny model and grid (exercises every path on a CPU)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    grid = SMOKE if args.smoke else Grid()
    models = ["tiny"] if args.smoke else args.models.split(",")
    unknown = [m for m in models if m not in SHAPES]
    modes = args.modes.split(",")
    if unknown or not set(modes) <= {"graph", "hf-eager"}:
        print(f"unknown model(s) {unknown} or mode(s) {modes}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "step_cost_gpu.parquet"
    import transformers

    meta = {"device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
            "torch": torch.__version__, "transformers": transformers.__version__}
    print(json.dumps(meta))
    if args.device.startswith("cuda"):
        StaticDecoder.attention = pick_attention(args.device)
    meta["attention"] = StaticDecoder.attention
    print("graph attention:", StaticDecoder.attention)
    if args.check or args.smoke:
        err = check_decoder(args.device)
        print(f"decoder vs transformers (fp32, tiny): max relative logit difference {err:.2e}")
        meta["decoder_check"] = err
        if err > 1e-4:  # recorded with every row; the timings are still of the same shapes
            print("WARNING: the graph decoder's logits differ from transformers' Qwen2 step", file=sys.stderr)
    rows: list[dict] = []
    pairs_left = len(models) * len(modes)
    for name in models:
        t_model = time.perf_counter()
        model, cfg = build_model(name, args.device, torch.bfloat16)
        _sync(args.device)
        params = sum(p.numel() for p in model.parameters())
        print(f"{name}: {params / 1e9:.2f}B parameters built in {time.perf_counter() - t_model:.1f}s", flush=True)
        for mode in modes:
            timer = time_graph if mode == "graph" else time_eager
            est = 1.0
            # an equal share of what is left, so a slow early model cannot starve the later ones
            deadline = time.perf_counter() + (args.budget_s - (time.perf_counter() - t_start)) / pairs_left
            pairs_left -= 1
            for batch, ctx, n in grid.points(mode):
                if time.perf_counter() > deadline:
                    print(f"time share used: skipping the rest of {name}/{mode}", flush=True)
                    break
                try:
                    ms = timer(model, batch, ctx, n, reps_for(est), args.device)
                except torch.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    print(f"{name} {mode} b={batch} ctx={ctx} v={n}: out of memory, skipped", flush=True)
                    continue
                est = ms
                rows.append({**meta, "model": f"qwen2.5-{name}", "params": params, "mode": mode, "batch": batch,
                             "context_len": ctx, "verify_len": n, "tokens": batch * n, "step_ms": ms})
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            write_rows(rows, path)
            done = [r for r in rows if r["model"] == f"qwen2.5-{name}" and r["mode"] == mode]
            one = [r["step_ms"] for r in done if r["batch"] == 1 and r["context_len"] == grid.base_context]
            print(f"  {mode}: {len(done)} points; b=1 ctx={grid.base_context}: "
                  + " ".join(f"{x:.2f}" for x in one[:32]), flush=True)
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    write_rows(rows, path)
    print(f"wrote {path} ({len(rows)} rows) in {time.perf_counter() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
