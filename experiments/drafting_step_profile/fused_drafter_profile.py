"""Where a gpu-fused drafting step spends its GPU time, outside vLLM: the real drafter, the lookup kernel and the
fusion rule on vLLM-shaped state, timed per (batch size, history length) and per piece, plus a torch.profiler table.

  GPU (through tools/gpu_host/vllm_host.py run, which converts the 0.5B):
      python3 experiments/drafting_step_profile/fused_drafter_profile.py [--tag a] [--variants] [--autotune]
  writes $OUT/fused_drafter_profile_<tag>.json (timings) and prints the profiler's top kernels. --variants also times
  the whole step under the drafter's FlashAttention settings (splits=1, plan_once) and --autotune under
  torch.compile's max-autotune mode: which of them makes a pass cheaper (docs/vllm.md prices what a pass must cost).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hqlab.bench.gpu_timing import cuda_ms, standalone_speculator  # noqa: E402


# drafter settings per variant (gpu-fused spec keys); the first two are the ones the docs' figure plots
VARIANTS = {"eager": "compile=false", "compiled": "compile=true"}
EXTRA_VARIANTS = {"compiled, no split": "compile=true,splits=1",
                  "compiled, plan once": "compile=true,plan_once=true",
                  "compiled, no split, plan once": "compile=true,splits=1,plan_once=true"}
AUTOTUNE = {"autotuned, no split, plan once":
            "compile=true,compile_mode=max-autotune-no-cudagraphs,splits=1,plan_once=true"}


def main() -> None:
    import torch

    p = argparse.ArgumentParser()
    p.add_argument("--tag", default="a")
    p.add_argument("--variants", action="store_true",
                   help="also time the drafter's kernel settings (no key-length split, one FA3 plan per pass), "
                        "whole drafting steps only")
    p.add_argument("--autotune", action="store_true",
                   help="and torch.compile's max-autotune-no-cudagraphs mode (minutes of tuning on first use)")
    args = p.parse_args()
    out = Path(os.environ.get("OUT", "."))
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    slots_n, width = 8, 4096
    variants = dict(VARIANTS)
    if args.variants:
        variants |= EXTRA_VARIANTS
    if args.autotune:
        variants |= AUTOTUNE
    for variant, settings in variants.items():
        compile_ = "compile=true" in settings
        pieces = variant in VARIANTS  # the two base settings get every piece timed; the others the step only
        spec, total = standalone_speculator(f"gpu-fused:k=15,draft_block=7,nmax=32,policy=earliest,{settings}",
                                            slots=slots_n, width=width)
        d = spec.drafter
        path = "flash" if d.flash is not None else "sdpa"
        for n in (1, 8):
            spec.slots[:n] = torch.arange(n, device="cuda")
            spec.num_sampled[:n] = 8
            spec.fresh[:n] = False
            for history in (512, 1024, 2048, 3900):
                bucket = next((b for b in spec.buckets if b >= history + spec.q + spec.block), spec.buckets[-1])
                total.fill_(history)

                def step():
                    spec.dlen[:n] = history - 8
                    spec.graphs[(n, bucket)].replay()
                if not pieces:
                    row = {"variant": variant, "compile": compile_, "n": n, "history": history, "attn_len": bucket,
                           "attention": path, "graph_step_ms": cuda_ms(step)}
                    result["rows"].append(row)
                    print(json.dumps(row), flush=True)
                    continue
                slots = torch.arange(n, device="cuda")
                start = torch.full((n,), history - 8, device="cuda", dtype=torch.int64)
                toks16 = torch.randint(0, 1000, (n, 16), device="cuda")
                toks1 = toks16[:, :1]
                last = torch.zeros(n, dtype=torch.int64, device="cuda")
                row = {"variant": variant, "compile": compile_, "n": n, "history": history, "attn_len": bucket,
                       "attention": path, "graph_step_ms": cuda_ms(step),
                       "catchup_pass_ms": cuda_ms(lambda: d.extend(slots, toks16, start, last, bucket)),
                       "decode_pass_ms": cuda_ms(lambda: d.extend(slots, toks1, start, last, bucket))}
                # one layer's attention at this length, in the FlashAttention path and in the masked-sdpa one
                q = torch.randn(n, 16, d.heads, d.head_dim, device="cuda", dtype=torch.bfloat16)
                kc, vc = d.k_cache[0], d.v_cache[0]
                pos = start[:, None] + torch.arange(16, device="cuda")
                if d.flash is not None:
                    inputs = d._flash_inputs(slots, start, 16, bucket)
                    row["attention_flash_ms"] = cuda_ms(lambda: d._attend(q, kc, vc, slots, bucket, inputs))
                flash, d.flash = d.flash, None
                ladder = history + 16
                mask = d._mask(pos, ladder)
                row["attention_sdpa_mask_ms"] = cuda_ms(lambda: d._attend(q, kc, vc, slots, ladder, mask))
                d.flash = flash
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
        if variant == "compiled":
            from torch.profiler import ProfilerActivity, profile

            history = 2048
            bucket = next((b for b in spec.buckets if b >= history + spec.q + spec.block), spec.buckets[-1])
            total.fill_(history)
            spec.slots[:1] = 0
            spec.num_sampled[:1] = 8
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    spec.dlen[:1] = history - 8
                    spec._draft(1, bucket)
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
            print(table)
            result["profile_eager_n1"] = {"history": history, "attn_len": bucket, "steps": 3}
            result["attention"] = path
            result["profile_table"] = table
        del spec, d
        torch.cuda.empty_cache()
    (out / f"fused_drafter_profile_{args.tag}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
