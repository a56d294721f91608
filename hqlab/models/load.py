"""Loading a model by name: prepare what `from_pretrained` loads (an offline entry or a .gguf file is converted
once, `hqlab.models.gguf`), resolve dtype and device, and load model and tokenizer."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hqlab.io import sha256_file
from hqlab.models.gguf import _gguf_cache_folder, cache_root, ensure_converted, ensure_gguf
from hqlab.models.registry import _REGISTRY, DEFAULT_MODEL, ModelError, resolve


@dataclass(frozen=True)
class ModelInfo:
    """What `load` loaded. `path` is what `from_pretrained` got (folder or hub id); `sha256` is the GGUF's."""

    name: str
    source: str  # "offline" | "path" | "hub"
    path: str
    sha256: str | None
    dtype: str
    device: str
    max_context: int
    vocab_size: int  # rows of the output layer (config.vocab_size; may exceed len(tokenizer) in general)
    eos_token_ids: tuple[int, ...]



def _prepare(name: str | os.PathLike, cache_dir: str | Path | None) -> tuple[str, str, str | None]:
    """(source, what from_pretrained should load, GGUF sha256 or None)."""
    source, key = resolve(name)
    cache = cache_root(cache_dir)
    if source == "offline":
        entry = _REGISTRY[key]
        folder = ensure_converted(cache / "models" / entry.name, lambda: ensure_gguf(entry, cache),
                                  sha256=entry.sha256, expected_name=entry.gguf_name,
                                  eos_token_ids=entry.eos_token_ids, cache=cache)
        return source, str(folder), entry.sha256
    if source == "path" and Path(key).is_file():
        if not key.endswith(".gguf"):
            raise ModelError(f"{key} is a file but not a .gguf; give a model folder, a .gguf file or a hub id")
        gguf_path = Path(key)
        sha = sha256_file(gguf_path, f"sha256 {gguf_path.name}")
        folder = ensure_converted(_gguf_cache_folder(gguf_path, sha, cache), lambda: gguf_path, sha256=sha,
                                  expected_name=None, cache=cache)
        return source, str(folder), sha
    return source, key, None


def prepare(name: str | os.PathLike, *, cache_dir: str | Path | None = None) -> str:
    """What `from_pretrained` should load for `name`: a folder path or a hub id.

    Offline entries (and .gguf files) are installed, assembled, verified and converted on first use; later calls
    only check the completion marker.
    """
    return _prepare(name, cache_dir)[1]


# --------------------------------------------------------------------------------------------------------------
# load()
# --------------------------------------------------------------------------------------------------------------

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def resolve_dtype(dtype: str) -> str:
    """Canonical dtype name. "auto" is bfloat16 everywhere, so that a trace, a result and a shipped trace set mean
    the same precision on every machine. On a CPU with AVX512_BF16 bf16 measured ~2x faster than fp32. On one
    without (AVX2 only) it is faster for one-token steps, which read the weights (0.5B, 2 cores: 0.16 s against
    0.28 s), and slower for many positions at once, which compute (a 1,500-token prefill: 100 s against 20 s; a
    16-position verify: 1.1-1.4 s against 0.75-0.87 s): pass dtype="float32" there for prompt-heavy work."""
    if dtype == "auto":
        return "bfloat16"
    try:
        return _DTYPES[dtype]
    except (KeyError, TypeError):
        raise ModelError(f"unknown dtype {dtype!r}; accepted: auto, {', '.join(_DTYPES)}") from None


def native_bf16() -> bool:
    """Whether this CPU computes in bf16 itself (x86: AVX512_BF16 or AMX-BF16; ARM64: the BF16 extension). Without
    it PyTorch emulates bf16 matmuls, which is slower than fp32 wherever many positions are scored at once (see
    `resolve_dtype`), so work that only needs some real model (the tests) runs in fp32 there."""
    import torch

    caps = torch.cpu.get_capabilities()
    return any(caps.get(flag) for flag in ("avx512_bf16", "amx_bf16", "bf16"))


def resolve_device(device: str) -> str:
    """"auto" is cuda when available, else cpu; an explicit cuda without CUDA is an error, not a silent cpu."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ModelError(f"unknown device {device!r} ({e}); use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"device {device!r} requested but CUDA is not available; use device='cpu' or 'auto'")
    return device


def _eos_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """Generation config eos id(s) first, then the tokenizer's, without duplicates."""
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    ids += list(eos) if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def load(name: str | os.PathLike = DEFAULT_MODEL, *, device: str = "auto", dtype: str = "auto",
         cache_dir: str | Path | None = None) -> tuple[Any, Any, ModelInfo]:
    """Load (model, tokenizer, info): model in eval mode on `device` in `dtype`."""
    # Validate the cheap arguments before any download or conversion.
    dtype_name = resolve_dtype(dtype)
    device_name = resolve_device(device)
    source, target, sha = _prepare(name, cache_dir)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype_name))
    model.to(device_name).eval()
    cfg = model.config
    info = ModelInfo(
        name=os.fspath(name),
        source=source,
        path=target,
        sha256=sha,
        dtype=dtype_name,
        device=str(next(model.parameters()).device),
        max_context=int(cfg.max_position_embeddings),
        vocab_size=int(cfg.vocab_size),
        eos_token_ids=_eos_ids(model, tokenizer),
    )
    return model, tokenizer, info

