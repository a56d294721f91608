"""The transformers engine on CUDA: lossless greedy speculation and the GPU lookup path, at the 0.5B's shape.

The GPU host has no model weights, so the target is Qwen2.5-0.5B's architecture with random weights (bf16).
Random models still produce deterministic greedy outputs, which is all the lossless check needs, and they fall
into repetitive loops that context lookup predicts. Checks:
  1. every proposer config reproduces the engine's own no-speculation output token for token;
  2. the lookup proposer given CUDA histories (Triton kernel) returns exactly the reference proposals.
Writes $OUT/gpu_engine_check.json (or ./gpu_engine_check.json).

Usage (on a CUDA machine): PYTHONPATH=. python experiments/hf_engine_on_cuda/gpu_engine_check.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch


def ensure_kernels_importable() -> None:
    """`hqlab_kernels` is an install-time name for kernels/; map it when running from a bare checkout."""
    try:
        import hqlab_kernels  # noqa: F401
    except ImportError:
        root = Path(__file__).resolve().parents[2] / "kernels"
        spec = importlib.util.spec_from_file_location("hqlab_kernels", root / "__init__.py",
                                                      submodule_search_locations=[str(root)])
        module = importlib.util.module_from_spec(spec)
        sys.modules["hqlab_kernels"] = module
        spec.loader.exec_module(module)


def main() -> None:
    ensure_kernels_importable()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hqlab.config import DecodeConfig
    from hqlab.engines.hf import HFEngine
    from hqlab.bench.lossless import NEAR_TIE_TOL, compare
    from hqlab.proposers import make_proposer

    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--init", type=float, default=0.08, help="weight init std: larger gives confident logits")
    args = ap.parse_args()
    torch.manual_seed(0)
    # Random weights at the default init give nearly flat logits, so exact ties (margin 0) are everywhere and any
    # verify shape flips them. A wider init makes the argmax clear, as in a trained model.
    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                      tie_word_embeddings=True, rope_theta=1e6, initializer_range=args.init)
    model = Qwen2ForCausalLM(cfg).to(device="cuda", dtype=getattr(torch, args.dtype)).eval()

    class Tok:
        eos_token_id = 151645
        pad_token_id = 151643

    engine = HFEngine(model, Tok(), eos_token_ids=[151645])
    rng = np.random.default_rng(0)
    report: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "dtype": args.dtype,
                    "init": args.init, "runs": []}
    specs = ["lookup:nmin=6,nmax=12,k=15", "lookup:nmin=2,nmax=8,k=7", "pld:n=3,k=10"]
    decode = DecodeConfig(max_new_tokens=256)
    for p in range(4):
        segment = rng.integers(0, 150_000, 300).tolist()
        prompt = rng.integers(0, 150_000, 200).tolist() + segment + rng.integers(0, 150_000, 100).tolist() + segment[:40]
        engine.generate(prompt, None, DecodeConfig(max_new_tokens=8))  # warm-up
        ref = engine.generate(prompt, None, decode)
        report["runs"].append({"prompt": p, "config": "none", "new_tokens": ref.new_tokens,
                               "tokens_per_step": ref.tokens_per_step(), "decode_tok_s": ref.decode_tok_s()})
        for spec in specs:
            g = engine.generate(prompt, make_proposer(spec), decode)
            c = compare(ref.output_ids, ref.margins, g.output_ids, tol=NEAR_TIE_TOL[args.dtype])
            report["runs"].append({"prompt": p, "config": spec, "new_tokens": g.new_tokens,
                                   "tokens_per_step": g.tokens_per_step(), "decode_tok_s": g.decode_tok_s(),
                                   "divergence": c.status, "first_divergence": c.first_divergence,
                                   "margin": c.margin})
        h = engine.generate_hf(prompt, decode, prompt_lookup_num_tokens=10)
        c = compare(ref.output_ids, ref.margins, h.output_ids, tol=NEAR_TIE_TOL[args.dtype])
        report["runs"].append({"prompt": p, "config": "hf-pld:k=10", "new_tokens": h.new_tokens,
                               "tokens_per_step": h.tokens_per_step(), "decode_tok_s": h.decode_tok_s(),
                               "divergence": c.status, "first_divergence": c.first_divergence, "margin": c.margin})

    # GPU lookup path vs the reference, on histories with repeats, several configs and budgets
    mismatches, cases = 0, 0
    t0 = time.time()
    for spec in ["lookup:nmin=6,nmax=12,k=15", "lookup:nmin=1,nmax=4,k=8,policy=earliest",
                 "lookup:nmin=2,nmax=5,k=6,full=true", "pld:n=3,k=10", "lookup:nmin=3,nmax=9,k=12,search=500"]:
        proposer = make_proposer(spec)
        for _ in range(40):
            hist = [rng.integers(0, 20, int(rng.integers(1, 3000))) for _ in range(int(rng.integers(1, 9)))]
            budgets = [int(rng.integers(0, 20)) for _ in hist]
            cpu = proposer.propose(hist, budgets)
            gpu = proposer.propose([torch.as_tensor(h, device="cuda") for h in hist], budgets)
            for a, b in zip(cpu, gpu):
                cases += 1
                same = a.tokens.tolist() == b.tokens.tolist() and (a.match_len == b.match_len or a.valid == 0)
                mismatches += not same
    report["gpu_lookup"] = {"cases": cases, "mismatches": mismatches, "seconds": time.time() - t0}
    out = Path(os.environ.get("OUT", ".")) / f"gpu_engine_check_{args.dtype}.json"
    out.write_text(json.dumps(report, indent=1))
    bad = [r for r in report["runs"] if r.get("divergence") == "mismatch"]
    print(json.dumps(report["gpu_lookup"]), "mismatching runs:", len(bad))
    for r in report["runs"]:
        print(r)


if __name__ == "__main__":
    main()
