"""One drafter layer's attention at the 0.5B's shapes (14 query heads, 2 KV heads, head size 64), bf16: vLLM's
paged FlashAttention against the masked sdpa path, per attention length and query length. Random weights and
cache contents (attention time does not depend on values).

  GPU (through tools/gpu_host/vllm_host.py run):  python3 experiments/drafter_attention_flash/drafter_attention.py
  prints one JSON row per setting and writes $OUT/drafter_attention.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    import torch

    from hqlab.engines.vllm.drafter import StaticQwen2

    hidden, layers = 896, 1
    cfg = {"hidden_size": hidden, "num_attention_heads": 14, "num_key_value_heads": 2, "num_hidden_layers": layers,
           "intermediate_size": 64, "vocab_size": 64, "rope_theta": 1e6}
    w = {"model.embed_tokens.weight": torch.randn(64, hidden), "model.norm.weight": torch.ones(hidden)}
    p = "model.layers.0."
    for name, rows in (("q_proj", hidden), ("k_proj", 128), ("v_proj", 128)):
        w[f"{p}self_attn.{name}.weight"], w[f"{p}self_attn.{name}.bias"] = torch.randn(rows, hidden), torch.randn(rows)
    w[p + "self_attn.o_proj.weight"] = torch.randn(hidden, hidden)
    for name, shape in (("gate_proj", (64, hidden)), ("up_proj", (64, hidden)), ("down_proj", (hidden, 64))):
        w[f"{p}mlp.{name}.weight"] = torch.randn(*shape)
    w[p + "input_layernorm.weight"] = w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    d = StaticQwen2(cfg, w, slots=8, max_len=4119, device="cuda", attention="flash")
    d.k_cache.normal_()
    d.v_cache.normal_()
    rows = []
    for n in (1, 8):
        slots = torch.arange(n, device="cuda")
        for q_len in (1, 16):
            for length in (512, 2048, 4096):
                start = torch.full((n,), length - q_len - 8, device="cuda", dtype=torch.int64)
                q = torch.randn(n, q_len, 14, 64, device="cuda", dtype=torch.bfloat16)
                kc, vc = d.k_cache[0], d.v_cache[0]
                pos = start[:, None] + torch.arange(q_len, device="cuda")
                flash_in, mask = d._flash_inputs(slots, start, q_len, length), d._mask(pos, length)
                row = {"n": n, "q_len": q_len, "attn_len": length}
                for name, inputs, fn in (("flash", flash_in, d.flash), ("masked_sdpa", mask, None)):
                    saved, d.flash = d.flash, fn
                    for _ in range(3):
                        d._attend(q, kc, vc, slots, length, inputs)
                    torch.cuda.synchronize()
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    for _ in range(50):
                        d._attend(q, kc, vc, slots, length, inputs)
                    b.record()
                    torch.cuda.synchronize()
                    row[f"{name}_us"] = 1e3 * a.elapsed_time(b) / 50
                    d.flash = saved
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = Path(os.environ.get("OUT", "."))
    (out / "drafter_attention.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                            "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
