"""A Qwen2 draft model in plain torch over a static KV cache with one row per request slot.

The fused speculator (`hqlab.engines.vllm.gpu_fused`) runs a small same-tokenizer drafter inside vLLM's GPU step,
after the target's sampling. vLLM 0.26's V2 runner has no plain draft-model path (docs/vllm-internals.md), and
its own model classes need its attention metadata and forward context. A drafter that owns its cache needs neither:

- the cache holds one row of `max_len` positions per vLLM request slot (`[layers, slots * blocks, BLOCK, kv_heads,
  head_dim]`: the rows cut into pages of BLOCK positions, so that a request's position p is page
  `slot * blocks + p // BLOCK`, offset `p % BLOCK`, and FlashAttention's paged kernel can read a row through a
  block table that is a plain function of the slot);
- every call has static shapes (batch rows, query length, attention length) and reads no device value on the host,
  so the decode passes replay from CUDA graphs;
- positions past a request's real end may be written (padded query columns, speculative drafts); the caller always
  feeds again from the request's true length, which overwrites them before any query can attend to them.

Attention runs in vLLM's FlashAttention (`vllm.vllm_flash_attn.flash_attn_varlen_func`, paged, causal aligned to
each row's end, grouped-query heads natively) on a GPU where vLLM has it, else in torch's
`scaled_dot_product_attention` with an explicit position mask (the CPU and the tests). The first GPU run used the
mask path everywhere: cuDNN's masked attention took ~61 us per layer at 4,096 positions, over half of a drafting
step (data/results/fused_drafter_profile/a/profile.json).

The layer is the transformers Qwen2 decoder (RMSNorm, rotary embedding, grouped-query attention with q/k/v biases,
SwiGLU MLP), with q/k/v and gate/up fused into one matrix each. Only the position whose logits the caller wants is
projected to the vocabulary, so a 16-token catch-up pass costs one lm_head row per request, not sixteen.

`attention="triton"` runs the drafting passes' attention in one Triton kernel per layer
(`hqlab_kernels.drafter_attention`: the query rows of a KV head's heads as one tile, the keys split over programs
and combined by the last to finish) instead of FlashAttention's two (~15 us a layer at 2,048 positions on an
H200, a quarter of a pass); prompt chunks (more query rows than one tile holds) keep FlashAttention or sdpa.

`layers="triton"` runs each layer of a small call (at most TRITON_MAX_ROWS query rows: the drafting passes) as four
Triton kernels around the attention (`hqlab_kernels.drafter_layers`: norm + q/k/v + rotary + the cache write, the
output projection + residual, norm + gate/up + SwiGLU, the down projection + residual) instead of ~14 cuBLAS and
elementwise kernels: such a pass is bound by kernel count, not bytes. Larger calls (prompt chunks) take the torch
path. Both write the same cache layout, so they mix freely from call to call. `gpu_fused` always drafts with both
Triton paths; `layers="torch"` and the other attentions in a drafting pass are the tests' reference (and what the
CPU tests run with the real drafter, where the Triton interpreter would take minutes).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch
import torch.nn.functional as F

from hqlab.config import ConfigError

BLOCK = 16  # positions per cache page (vLLM's own block size, which its FlashAttention build runs with)
# auto: FlashAttention where vLLM has it on this device, else sdpa; triton: hqlab_kernels.drafter_attention for the
# drafting passes (one kernel a layer), FlashAttention (where present) or sdpa for prompt chunks
ATTENTION = ("auto", "flash", "sdpa", "triton")
LAYERS = ("torch", "triton")  # how a layer runs: torch operations, or hqlab_kernels.drafter_layers' four kernels
# The most query rows (requests x positions) a call may have for the Triton layers: their block sizes are chosen for
# the drafting passes (16 positions for a few requests); a prompt chunk of hundreds of rows runs faster in cuBLAS.
TRITON_MAX_ROWS = 64


def _flash_attention(device: torch.device, head_dim: int) -> Callable | None:
    """vLLM's paged FlashAttention in the version vLLM itself picks for this GPU (FA3 on Hopper); None where it
    cannot run (no CUDA device, no vLLM build for it)."""
    if device.type != "cuda":
        return None
    try:
        from functools import partial

        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - any import failure means: not available here
        return None
    version = get_flash_attn_version(head_size=head_dim)
    return flash_attn_varlen_func if version is None else partial(flash_attn_varlen_func, fa_version=version)


def _cache_writer(device: torch.device) -> Callable | None:
    """vLLM's paged cache write (`reshape_and_cache_flash`: K and V of every token into its page slot, one kernel
    for both) where vLLM's CUDA ops load, else None (two index_puts per layer instead)."""
    if device.type != "cuda":
        return None
    try:
        from vllm import _custom_ops as ops

        ops.reshape_and_cache_flash  # noqa: B018 - present in this vLLM build?
    except Exception:  # noqa: BLE001 - any import failure means: not available here
        return None
    scale = torch.ones((), dtype=torch.float32, device=device)

    def write(k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, flat: torch.Tensor) -> None:
        ops.reshape_and_cache_flash(k, v, kc, vc, flat, "auto", scale, scale)

    return write


def _triton_module(name: str, setting: str, device: torch.device) -> ModuleType:
    """`hqlab_kernels.<name>` (drafter_layers for `layers='triton'`, drafter_attention for `attention='triton'`) where
    its kernels can run on `device`: a CUDA device, or the CPU under Triton's interpreter (TRITON_INTERPRET=1 before
    the first import, as the tests set it)."""
    import importlib

    try:
        module = importlib.import_module(f"hqlab_kernels.{name}")
    except ImportError as e:
        raise ConfigError(f"StaticQwen2: {setting}='triton' needs Triton and hqlab's kernels (hqlab_kernels) "
                          f"installed ({e})") from None
    if device.type != "cuda" and not module.interpreted():
        raise ConfigError(f"StaticQwen2: {setting}='triton' runs on a CUDA device, or on the CPU only under Triton's "
                          f"interpreter (TRITON_INTERPRET=1); got device {device}")
    return module


class StaticQwen2:
    """Qwen2ForCausalLM forward over a per-slot static KV cache (see the module docstring).

    layers: "torch" (torch operations, `compile` fuses their elementwise work) or "triton" (four Triton kernels per
    layer for calls of at most TRITON_MAX_ROWS query rows, the torch path above that; `compile` then applies to the
    torch path only)."""

    def __init__(self, config: dict, weights: dict[str, torch.Tensor], *, slots: int, max_len: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                 compile: bool = False, attention: str = "auto", layers: str = "torch") -> None:
        if layers not in LAYERS:
            raise ConfigError(f"StaticQwen2: layers must be one of {', '.join(LAYERS)} (got {layers!r})")
        if slots < 1 or max_len < 1:
            raise ConfigError(f"StaticQwen2 needs slots >= 1 and max_len >= 1 (got slots={slots}, max_len={max_len})")
        if attention not in ATTENTION:
            raise ConfigError(f"StaticQwen2: attention must be one of {', '.join(ATTENTION)} (got {attention!r})")
        scaling = config.get("rope_scaling") or {}
        rope_type = (config.get("rope_parameters") or {}).get("rope_type") or scaling.get("rope_type") or \
            scaling.get("type") or "default"
        if rope_type != "default":
            raise ConfigError(f"StaticQwen2 implements the default rotary embedding only; this checkpoint asks for "
                              f"rope type {rope_type!r}")
        if config.get("use_sliding_window"):
            raise ConfigError("StaticQwen2 implements full attention only; this checkpoint uses a sliding window")
        self.slots = int(slots)
        self.blocks = -(-int(max_len) // BLOCK)  # pages per slot
        self.max_len = self.blocks * BLOCK  # positions per slot (max_len rounded up to whole pages)
        self.device, self.dtype = torch.device(device), dtype
        self.layer_kernels = _triton_module("drafter_layers", "layers", self.device) if layers == "triton" else None
        self.hidden = int(config["hidden_size"])
        self.heads = int(config["num_attention_heads"])
        self.kv_heads = int(config.get("num_key_value_heads", self.heads))
        self.head_dim = int(config.get("head_dim") or self.hidden // self.heads)
        self.groups = self.heads // self.kv_heads
        self.n_layers = int(config["num_hidden_layers"])
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.vocab = int(config["vocab_size"])
        self._load_weights(weights)
        shape = (self.n_layers, self.slots * self.blocks, BLOCK, self.kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, device=self.device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=dtype)
        self._setup_kernels(attention, int(config["intermediate_size"]))
        # Rotary tables in float32 for every position the cache can hold (transformers computes them in float32
        # and casts to the activations' dtype).
        theta = float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        inv = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=self.device)
                              / self.head_dim)
        freqs = torch.outer(torch.arange(self.max_len, dtype=torch.float32, device=self.device), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)
        # What runs between two attentions (layer i's output projection and MLP, layer i+1's norm, q/k/v and
        # rotary embedding) is a pure function of its inputs: `compile=True` lets torch.compile fuse its
        # elementwise work across the layer boundary (a pass is launch-bound at small batch: kernels, not bytes).
        self._pre, self._mid, self._post = self._pre_impl, self._mid_impl, self._post_impl
        if compile:
            self._pre = torch.compile(self._pre_impl, dynamic=True)
            self._mid = torch.compile(self._mid_impl, dynamic=True)
            self._post = torch.compile(self._post_impl, dynamic=True)

    def _load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """The checkpoint's tensors on this device and dtype, q/k/v and gate/up fused into one matrix each."""

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise ConfigError(f"StaticQwen2: the checkpoint has no tensor {name!r} (not a Qwen2 causal LM?)")
            return weights[name].to(device=self.device, dtype=self.dtype)

        self.embed = w("model.embed_tokens.weight")
        self.lm_head = w("lm_head.weight") if "lm_head.weight" in weights else self.embed  # tied checkpoints
        self.norm = w("model.norm.weight")
        self.layers = []
        for i in range(self.n_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            self.layers.append({
                "in_norm": w(p + "input_layernorm.weight"),
                "qkv_w": torch.cat([w(a + "q_proj.weight"), w(a + "k_proj.weight"), w(a + "v_proj.weight")]),
                "qkv_b": torch.cat([w(a + "q_proj.bias"), w(a + "k_proj.bias"), w(a + "v_proj.bias")]),
                "o_w": w(a + "o_proj.weight"),
                "post_norm": w(p + "post_attention_layernorm.weight"),
                "gate_up_w": torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
                "down_w": w(p + "mlp.down_proj.weight"),
            })

    def _setup_kernels(self, attention: str, intermediate: int) -> None:
        """The attention of each kind of call (FlashAttention, the Triton kernel of the drafting passes, or the masked
        sdpa path) and the scratch the Triton kernels need."""
        # the Triton layers' scratch for split reductions (kernel TILES with split_k > 1), sized once for the table
        # as it stands now: the passes captured in CUDA graphs reuse it
        self.workspace = None
        if self.layer_kernels is not None:
            max_split = max(t.split_k for t in self.layer_kernels.TILES.values())
            if max_split > 1:
                self.workspace = self.layer_kernels.Workspace.for_layer(
                    hidden=self.hidden, inter=intermediate,
                    qkv_rows=(self.heads + 2 * self.kv_heads) * self.head_dim, max_rows=TRITON_MAX_ROWS,
                    max_split=max_split, device=self.device)
        half = self.dtype in (torch.bfloat16, torch.float16)  # FlashAttention's dtypes
        self.flash = _flash_attention(self.device, self.head_dim) \
            if attention in ("auto", "flash", "triton") and half else None
        # the Triton attention of the drafting passes, its scratch sized for every slot at once and its most splits
        self.attention_kernel, self.attention_workspace = None, None
        if attention == "triton":
            self.attention_kernel = _triton_module("drafter_attention", "attention", self.device)
            self.attention_workspace = self.attention_kernel.attention_workspace(
                self.slots, self.heads, self.attention_kernel.MAX_TILE_ROWS // self.groups or 1,
                self.attention_kernel.MAX_SPLITS, self.head_dim, self.device)
        if attention == "flash" and self.flash is None:
            raise ConfigError("StaticQwen2: attention='flash' needs vLLM's FlashAttention on a CUDA device and a "
                              f"bf16 or fp16 model (got {self.device}, {self.dtype})")
        self.write_cache = _cache_writer(self.device) if self.flash is not None else None

    @classmethod
    def load(cls, folder: str | Path, *, slots: int, max_len: int, device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.bfloat16, compile: bool = False,
             attention: str = "auto", **options: Any) -> "StaticQwen2":
        """Load a Hugging Face-format Qwen2 folder (config.json + *.safetensors)."""
        from safetensors.torch import load_file

        folder = Path(folder)
        cfg_file = folder / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"StaticQwen2: {folder} has no config.json (expected a Hugging Face model folder, "
                              f"e.g. hqlab.models.prepare('qwen2.5-coder-0.5b'))")
        config = json.loads(cfg_file.read_text())
        if config.get("model_type") != "qwen2":
            raise ConfigError(f"StaticQwen2 runs Qwen2 models only; {folder} holds model_type "
                              f"{config.get('model_type')!r}")
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"StaticQwen2: {folder} has no *.safetensors weights")
        weights: dict[str, torch.Tensor] = {}
        for f in files:
            weights.update(load_file(str(f)))
        return cls(config, weights, slots=slots, max_len=max_len, device=device, dtype=dtype, compile=compile,
                   attention=attention, **options)

    # ------------------------------------------------------------------------------------------------------------

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * x32.to(x.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def hidden_states(self, slots: torch.Tensor, tokens: torch.Tensor, start: torch.Tensor,
                      attn_len: int) -> torch.Tensor:
        """Feed tokens [n, Q] at positions start[r] + i of cache rows `slots`, writing their K/V; returns the final
        hidden states [n, Q, hidden] before the last norm. Attention covers cache positions < attn_len, which
        must exceed every start[r] + Q - 1."""
        n, q_len = tokens.shape
        if not 0 < attn_len <= self.max_len:
            raise ValueError(f"attn_len must be in [1, max_len={self.max_len}] (got {attn_len})")
        slots = slots.long()
        pos = start.long()[:, None] + torch.arange(q_len, device=self.device)  # [n, Q]
        flat = slots[:, None] * self.max_len + pos  # each position's index in a layer's cache, pages flattened
        if self.attention_kernel is not None and q_len * self.groups <= self.attention_kernel.MAX_TILE_ROWS:
            attend = ("triton", slots, start)  # a drafting pass: hqlab_kernels.drafter_attention
        elif self.flash is not None:
            attend = self._flash_inputs(slots, start, q_len, attn_len)
        else:
            attend = self._mask(pos, attn_len)
        x = F.embedding(tokens, self.embed)  # [n, Q, hidden]
        if self.layer_kernels is not None and n * q_len <= TRITON_MAX_ROWS:
            return self._triton_layers(x, slots, pos, flat, attn_len, attend)
        cos, sin = self.cos[pos][:, :, None, :], self.sin[pos][:, :, None, :]  # [n, Q, 1, D]
        first = self.layers[0]
        q, k, v = self._pre(x, first["in_norm"], first["qkv_w"], first["qkv_b"], cos, sin)
        for i, layer in enumerate(self.layers):
            kc, vc = self.k_cache[i], self.v_cache[i]  # [slots * blocks, BLOCK, kvh, D]
            if self.write_cache is not None:
                self.write_cache(k.reshape(-1, self.kv_heads, self.head_dim),
                                 v.reshape(-1, self.kv_heads, self.head_dim), kc, vc, flat.reshape(-1))
            else:
                kc.view(-1, self.kv_heads, self.head_dim)[flat] = k
                vc.view(-1, self.kv_heads, self.head_dim)[flat] = v
            o = self._attend(q, kc, vc, slots, attn_len, attend)
            if i + 1 < self.n_layers:
                nxt = self.layers[i + 1]
                x, q, k, v = self._mid(x, o, layer["o_w"], layer["post_norm"], layer["gate_up_w"], layer["down_w"],
                                       nxt["in_norm"], nxt["qkv_w"], nxt["qkv_b"], cos, sin)
            else:
                x = self._post(x, o, layer["o_w"], layer["post_norm"], layer["gate_up_w"], layer["down_w"])
        return x

    def _triton_layers(self, x: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, flat: torch.Tensor,
                       attn_len: int, attend: Any) -> torch.Tensor:
        """`hidden_states`' layer loop in hqlab_kernels.drafter_layers' four kernels per layer around `_attend`:
        x [n, Q, hidden] embedded tokens at positions `pos` [n, Q] (cache rows `flat`) -> final hidden states."""
        kernels, ws = self.layer_kernels, self.workspace
        n, q_len, hidden = x.shape
        rows = n * q_len
        x = x.reshape(rows, hidden)
        positions, cache_index = pos.reshape(rows), flat.reshape(rows)
        for i, layer in enumerate(self.layers):
            kc, vc = self.k_cache[i], self.v_cache[i]
            q = kernels.norm_qkv_rope_cache(x, layer["in_norm"], layer["qkv_w"], layer["qkv_b"], self.cos, self.sin,
                                            positions, cache_index, kc, vc, heads=self.heads, kv_heads=self.kv_heads,
                                            eps=self.eps, workspace=ws)  # [rows, heads, D]; K/V now in the cache
            o = self._attend(q.view(n, q_len, self.heads, self.head_dim), kc, vc, slots, attn_len, attend)
            x = kernels.o_proj_residual(x, o.reshape(rows, -1), layer["o_w"], workspace=ws)
            x = kernels.down_residual(x, kernels.norm_gate_up_silu(x, layer["post_norm"], layer["gate_up_w"],
                                                                   eps=self.eps, workspace=ws), layer["down_w"],
                                      workspace=ws)
        return x.view(n, q_len, hidden)

    def _mask(self, pos: torch.Tensor, attn_len: int) -> torch.Tensor:
        """Query i of row r sees cache positions <= its own; the query rows of one KV head are its `groups` heads
        stacked along the query axis (row = i * groups + g), so K/V are read once per KV head, never repeated."""
        n, q_len = pos.shape
        allowed = torch.arange(attn_len, device=self.device)[None, None, :] <= pos[:, :, None]  # [n, Q, L]
        return allowed[:, :, None, :].expand(n, q_len, self.groups, attn_len).reshape(
            n, 1, q_len * self.groups, attn_len)

    def _flash_inputs(self, slots: torch.Tensor, start: torch.Tensor, q_len: int,
                      attn_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """FlashAttention's paged inputs: query offsets, each row's key count (its causal end), block table."""
        n = slots.shape[0]
        cu_q = torch.arange(0, (n + 1) * q_len, q_len, dtype=torch.int32, device=self.device)
        used = (start + q_len).to(torch.int32)
        pages = -(-attn_len // BLOCK)
        table = (slots[:, None] * self.blocks + torch.arange(pages, device=self.device)).to(torch.int32)
        return cu_q, used, table

    def _attend(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor, attn_len: int,
                attend: Any) -> torch.Tensor:
        """q [n, Q, heads, D] -> attention output [n, Q, heads * D]."""
        n, q_len, h, d = q.shape
        if isinstance(attend, tuple) and attend[0] == "triton":
            kernel, (_, slots, start) = self.attention_kernel, attend
            splits = kernel.default_splits(attn_len, n, self.kv_heads)
            o = kernel.decode_attention(q.reshape(n * q_len, h, d), kc, vc, slots, start, max_len=self.max_len,
                                        attn_len=attn_len, splits=splits, workspace=self.attention_workspace)
            return o.view(n, q_len, h * d)
        if self.flash is not None:
            cu_q, used, table = attend
            o = self.flash(q.reshape(n * q_len, h, d), kc, vc, max_seqlen_q=q_len, cu_seqlens_q=cu_q,
                           max_seqlen_k=attn_len, seqused_k=used, causal=True, block_table=table,
                           num_splits=0)  # 0: FlashAttention's own key-length split
            return o.reshape(n, q_len, h * d)
        kvh, g = self.kv_heads, self.groups
        rows = slots[:, None] * self.blocks + torch.arange(-(-attn_len // BLOCK), device=self.device)
        keys = kc[rows].reshape(n, -1, kvh, d)[:, :attn_len].transpose(1, 2)  # [n, kvh, L, D]
        values = vc[rows].reshape(n, -1, kvh, d)[:, :attn_len].transpose(1, 2)
        qg = q.view(n, q_len, kvh, g, d).permute(0, 2, 1, 3, 4).reshape(n, kvh, q_len * g, d)
        o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=attend)
        return o.view(n, kvh, q_len, g, d).permute(0, 2, 1, 3, 4).reshape(n, q_len, h * d)

    def _pre_impl(self, x: torch.Tensor, norm: torch.Tensor, qkv_w: torch.Tensor, qkv_b: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Norm, q/k/v projection and rotary embedding: q as [n, Q, heads, D], k and v as [n, Q, kv_heads, D]."""
        n, q_len = x.shape[:2]
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        qkv = F.linear(self._rms(x, norm), qkv_w, qkv_b)
        q = self._rotate(qkv[..., :h * d].view(n, q_len, h, d), cos, sin)
        k = self._rotate(qkv[..., h * d:(h + kvh) * d].view(n, q_len, kvh, d), cos, sin)
        v = qkv[..., (h + kvh) * d:].view(n, q_len, kvh, d)
        return q, k, v

    def _post_impl(self, x: torch.Tensor, o: torch.Tensor, o_w: torch.Tensor, norm: torch.Tensor,
                   gate_up_w: torch.Tensor, down_w: torch.Tensor) -> torch.Tensor:
        """Attention output projection ([n, Q, heads * D] in), residual, norm, SwiGLU MLP, residual."""
        x = x + F.linear(o, o_w)
        gate, up = F.linear(self._rms(x, norm), gate_up_w).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, down_w)

    def _mid_impl(self, x: torch.Tensor, o: torch.Tensor, o_w: torch.Tensor, norm: torch.Tensor,
                  gate_up_w: torch.Tensor, down_w: torch.Tensor, next_norm: torch.Tensor, next_qkv_w: torch.Tensor,
                  next_qkv_b: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One layer's `_post` and the next layer's `_pre`, as one function (one compiled region)."""
        x = self._post_impl(x, o, o_w, norm, gate_up_w, down_w)
        return (x, *self._pre_impl(x, next_norm, next_qkv_w, next_qkv_b, cos, sin))

    def logits(self, slots: torch.Tensor, tokens: torch.Tensor, start: torch.Tensor, last: torch.Tensor,
               attn_len: int) -> torch.Tensor:
        """As `extend`, but the logits [n, vocab] at query index last[r] of each row."""
        x = self.hidden_states(slots, tokens, start, attn_len)
        picked = x[torch.arange(x.shape[0], device=self.device), last.long()]  # [n, hidden]
        return F.linear(self._rms(picked, self.norm), self.lm_head)

    def extend(self, slots: torch.Tensor, tokens: torch.Tensor, start: torch.Tensor, last: torch.Tensor,
               attn_len: int) -> torch.Tensor:
        """Feed tokens [n, Q] at positions start[r]..start[r]+Q-1 of cache rows `slots` (writing their K/V) and
        return the greedy next token [n] int64 after query index last[r]. Static shapes, no host reads."""
        return self.logits(slots, tokens, start, last, attn_len).argmax(-1)


__all__ = ["LAYERS", "TRITON_MAX_ROWS", "StaticQwen2"]
