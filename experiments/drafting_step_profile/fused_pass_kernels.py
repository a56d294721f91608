"""Where one gpu-fused drafting step's GPU time goes, kernel by kernel, outside vLLM: the one-pass configs of the
fused benchmark on vLLM-shaped state (random histories, so no lookup match and the drafter's pass always runs), each
piece captured in a CUDA graph of its own (the lookup, the drafter's catch-up pass, the fusion/schedule rule) next to
the whole step's graph, and a torch.profiler table of the whole step's kernels over graph replays.

  GPU (through tools/gpu_host/vllm_host.py run, which converts the 0.5B):
      python3 experiments/drafting_step_profile/fused_pass_kernels.py [--tag a] [--config SPEC ...] \\
          [--tiles SWEEP.json]
  writes $OUT/fused_pass_kernels_<tag>.json and prints one JSON row per (config, history) and the kernel table.

  With --prefill: instead, the drafter's eager prompt prefill (`drafter_prompts.PromptReader.read`, what a new request
  costs the fused speculator before its first token; served, `gpu-fused` answered it ~20 ms after `none`), wall
  time per prompt length with the served config's layers as they are (`prefill_chunk` 1,024: one torch-path call)
  and in 64-token chunks (each through the Triton layers), the same without torch.compile's wrappers
  (`compile=false`), in passes of 64 replayed from one captured graph (`prefill_graph`), the first call at prompt
  lengths not seen before (what a served request meets: a recompile would show there, not in the warmed medians)
  with the drafter's next-token logits after it (each variant against the first: the same argmax?), and one call's
  host and GPU time from torch.profiler:
      python3 experiments/drafting_step_profile/fused_pass_kernels.py --prefill --tag p1  # -> fused_prefill_p1.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # a bare checkout on the GPU host

from hqlab.bench.gpu_timing import cuda_ms, graph_ms, standalone_speculator  # noqa: E402

# the one-pass configs of runs fj1 and fk1 (docs/vllm.md)
CONFIGS = ("gpu-fused:k=15,draft_block=1,nmax=32,policy=earliest,compile=true,schedule=long,nmin_tail=1,"
           "compile_rule=true",
           "gpu-fused:k=31,draft_block=1,nmax=32,policy=earliest,compile=true,schedule=long,nmin_tail=1,"
           "compile_rule=true,device_skip=true")
HISTORIES = (512, 1024, 2048, 3900)
# the served config of the serving runs (s5a, s5c) and the prompt lengths a prefill is timed at
PREFILL_CONFIG = ("gpu-fused:k=15,draft_block=1,nmax=32,policy=earliest,compile=true,schedule=long,nmin_tail=1,"
                  "compile_rule=true,device_skip=true,layers=triton,attention=triton")
# (name, spec): the served layers as they are, 64-token chunks through the Triton layers, no torch.compile, the
# captured 64-position passes
PREFILL_VARIANTS = (("chunk1024", PREFILL_CONFIG + ",prefill_chunk=1024"),
                    ("chunk64", PREFILL_CONFIG + ",prefill_chunk=64"),
                    ("chunk1024-nocompile", PREFILL_CONFIG.replace(",compile=true,", ",compile=false,")
                     + ",prefill_chunk=1024"),
                    ("graph64", PREFILL_CONFIG + ",prefill_chunk=1024,prefill_graph=1024"))
PROMPTS = (64, 128, 256, 512, 1024)
FRESH = (37, 53, 71, 97, 131, 173, 229, 301)  # prompt lengths each timed once, on their first call


def prefill(tag: str, out: Path, repeats: int = 7) -> None:
    """Wall time of the drafter's prefill of one prompt (median of `repeats`, after one warm-up) per prompt length
    and variant, the first call at new lengths with the logits it leaves, and a torch.profiler split of one
    256-token prefill into host and GPU time."""
    import statistics
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "config": PREFILL_CONFIG,
                    "rows": []}
    reference: dict[int, torch.Tensor] = {}  # prompt length -> the first variant's next-token logits
    for variant, spec_text in PREFILL_VARIANTS:
        torch.manual_seed(0)  # the same random histories in every variant
        spec, _ = standalone_speculator(spec_text, slots=4, width=4096)
        chunk = spec.config.prefill_chunk

        def once(length: int, name: str) -> float:
            spec.prompts.owner.pop(0, None)  # a new request in slot 0: the prefill starts from its first token
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            spec.prompts.read(name, 0, length, done=True)
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) * 1e3

        for length in PROMPTS:
            once(length, "warm")
            ms = [once(length, f"r{i}") for i in range(repeats)]
            row = {"variant": variant, "prefill_chunk": chunk, "prompt": length, "ms": statistics.median(ms),
                   "ms_min": min(ms), "ms_max": max(ms), "repeats": repeats}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
        for length in FRESH:
            row = {"variant": variant, "prefill_chunk": chunk, "prompt": length, "first_call_ms": once(length, "new"),
                   "again_ms": once(length, "again")}
            # what the drafter knows after the prompt: its logits for the token after it (the same histories in
            # every variant: seeded above)
            d, slot = spec.drafter, spec.index[:1]
            logits = d.logits(slot, spec.state[0][0, length:length + 1].long()[None], spec.index[length:length + 1],
                              spec.zeros[:1], spec.cache_len).float()[0]
            reference.setdefault(length, logits)
            row["argmax"] = int(logits.argmax())
            row["same_argmax_as_first"] = row["argmax"] == int(reference[length].argmax())
            row["max_abs_logit_diff_vs_first"] = float((logits - reference[length]).abs().max())
            result.setdefault("fresh", []).append(row)
            print(json.dumps(row), flush=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            once(256, "profiled")
        events = prof.key_averages()
        # self time: an operator's total includes its kernels', which are events of their own (no double count)
        gpu_us = sum(e.self_device_time_total for e in events)
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                            "cuLaunchKernelEx"))
        split = {"variant": variant, "prefill_chunk": chunk, "prompt": 256, "gpu_kernel_ms": gpu_us / 1e3,
                 "kernel_launches": launches,
                 "top": [{"name": e.key[:100], "calls": e.count, "gpu_us": e.device_time_total,
                          "cpu_us": e.cpu_time_total} for e in sorted(events, key=lambda e: -e.cpu_time_total)[:25]]}
        result.setdefault("profiles", []).append(split)
        print(f"{variant}, 256 tokens: {split['gpu_kernel_ms']:.2f} ms of GPU kernels, "
              f"{launches} launches", flush=True)
        del spec
        torch.cuda.empty_cache()
    (out / f"fused_prefill_{tag}.json").write_text(json.dumps(result, indent=1))


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    p = argparse.ArgumentParser()
    p.add_argument("--tag", default="a")
    p.add_argument("--config", action="append", default=None, help="gpu-fused spec (repeatable); default: "
                   "the one-pass configs of the fused benchmark")
    p.add_argument("--tiles", type=Path, help="a tile sweep's JSON (experiments/drafter_kernel_tiles/): its best "
                   "tiles replace the Triton layers' table before the drafters are built")
    p.add_argument("--pdl", action="store_true", help="Triton kernels with programmatic dependent launch (run "
                   "t2 ran with it, t2n without; without is the kernels' default)")
    p.add_argument("--prefill", action="store_true", help="time the drafter's eager prompt prefill instead (above)")
    args = p.parse_args()
    out = Path(os.environ.get("OUT", "."))
    if args.prefill:
        prefill(args.tag, out)
        return
    if args.pdl:
        from hqlab_kernels import drafter_attention, drafter_layers

        drafter_layers.PDL = drafter_attention.PDL = True
    tiles = None
    if args.tiles:
        from hqlab_kernels import drafter_layers

        from hqlab_kernels import drafter_attention

        tiles = drafter_layers.sweep_tiles(args.tiles)
        drafter_layers.set_tiles(tiles)
        drafter_attention.set_tiles(tiles)
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": [], "kernels": {},
                    "tiles": tiles, "pdl": args.pdl}
    slots_n, width = 4, 4096
    for spec_text in args.config or CONFIGS:
        spec, total = standalone_speculator(spec_text, slots=slots_n, width=width)
        n = 1
        spec.slots[:n] = 0
        spec.num_sampled[:n] = 3  # a chat step: a few tokens emitted since the drafter last ran
        spec.fresh[:n] = False
        slots = spec.slots[:n]
        for history in HISTORIES:
            bucket = next(b for b in spec.buckets if b >= history + spec.wide_width + spec.block)
            total.fill_(history)
            key = next(k for k in spec.graphs if k[0] == n and k[1] == bucket)

            def whole() -> None:
                spec.dlen[:n] = history - 3
                spec.graphs[key].replay()

            all_ids, total_len = spec.state
            lengths = total_len[slots].to(torch.int32)
            proposals, match_len, valid = spec.matcher(all_ids.view(-1), spec.row_offsets[slots], lengths)
            lookup = proposals.masked_fill(proposals < 0, spec.pad)
            ns, fresh, drafts = spec.num_sampled[:n], spec.fresh[:n], spec.drafts[:n]

            def catch_up() -> None:
                spec.dlen[:n] = history - 3
                spec._last_pass(n, bucket, spec.narrow_width)

            row = {"config": spec_text, "n": n, "history": history, "attn_len": bucket, "width": spec.narrow_width,
                   "step_ms": cuda_ms(whole, 50),
                   "lookup_ms": graph_ms(lambda: spec.matcher(all_ids.view(-1), spec.row_offsets[slots], lengths)),
                   "catch_up_pass_ms": graph_ms(catch_up),
                   "rule_ms": graph_ms(lambda: spec.step_rule(slots, ns, fresh, lookup, valid, match_len, drafts)),
                   "empty_graph_ms": graph_ms(lambda: spec.dlen[:n].fill_(history - 3))}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
        history = 2048
        bucket = next(b for b in spec.buckets if b >= history + spec.wide_width + spec.block)
        total.fill_(history)
        key = next(k for k in spec.graphs if k[0] == n and k[1] == bucket)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                spec.dlen[:n] = history - 3
                spec.graphs[key].replay()
            torch.cuda.synchronize()
        kernels = [{"name": e.key[:120], "calls": e.count // 20, "us_per_step": e.device_time_total / 20}
                   for e in prof.key_averages() if e.device_time_total > 0]
        kernels.sort(key=lambda r: -r["us_per_step"])
        result["kernels"][spec_text] = {"history": history, "attn_len": bucket, "steps": 20, "rows": kernels}
        print(f"{spec_text} @ history {history}: {sum(r['us_per_step'] for r in kernels):.1f} us of kernels a step")
        for r in kernels[:25]:
            print(f"  {r['us_per_step']:8.1f} us  x{r['calls']:<4d} {r['name']}")
        del spec
        torch.cuda.empty_cache()
    (out / f"fused_pass_kernels_{args.tag}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
