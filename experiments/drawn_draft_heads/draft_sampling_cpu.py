"""What `gpu-fused`'s sampled drafts (`draft_sample=probabilistic`) are worth against its greedy drafts, measured with
the real models on the CPU: per output position of the target's own sampled answers, the acceptance of the
drafter's argmax as a point mass, p(argmax q), and of a draft drawn from the drafter, 1 - TV(p, q)
(`hqlab.replay.sampled_drafts`).

Target Qwen2.5-Coder-1.5B samples each answer at the temperature (transformers' `generate`, seeded, no top-k/top-p:
the serving benchmark's sampling); one forward pass of each model over prompt + answer gives both distributions at
every answer position. No timing: the numbers are probabilities, the same on any machine up to float rounding.
Datasets: the serving benchmark's prose and chat sets, their first `--prompts` prompts, chat-templated as `vllm bench
serve` sends them.

With `--draft-scales`, also the acceptance of a draft drawn at temperature x scale (a tempered drafter, verified
against its own tempered distribution) at the same positions: does drawing the drafter hotter or colder than the
request bring it closer to the target?

Writes the run data/results/draft_sampling/cpu/ (one row per dataset, prompt, temperature and answer position)
and, with --draft-scales, data/results/draft_temperature/cpu/ (the same, per scale); the figures come from
notebooks/serving.py.
Usage: python experiments/drawn_draft_heads/draft_sampling_cpu.py [--prompts 6] [--new-tokens 96]
           [--temperature 0.7 ...] [--draft-scales 0.6,0.8,0.9,1,1.1,1.25]   (~15 min on 2 cores)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import polars as pl
import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hqlab import models  # noqa: E402
from hqlab.bench import results  # noqa: E402
from hqlab.provenance import git_commit, machine_description  # noqa: E402
from hqlab.replay.sampled_drafts import acceptance, draft_temperature_summary  # noqa: E402
from hqlab.workloads import load_workload  # noqa: E402

DATASETS = {"prose": str(ROOT / "data" / "workloads" / "prose.jsonl"), "chat": "chat"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, action="append", default=[])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draft-scales", default="", help="comma-separated multipliers of the temperature to draw the "
                    "drafter at (1 is added: the others are compared with it)")
    ap.add_argument("--results", type=Path, default=None, help="the results folder (default data/results)")
    args = ap.parse_args()
    try:
        scales = sorted({1.0, *(float(x) for x in args.draft_scales.split(",") if x.strip())}) \
            if args.draft_scales else []
    except ValueError:
        ap.error(f"--draft-scales must be comma-separated numbers, got {args.draft_scales!r}")
    if any(x <= 0 for x in scales):
        ap.error(f"every --draft-scales value must be > 0, got {args.draft_scales!r}")
    temperatures = args.temperature or [0.7]
    if any(t <= 0 for t in temperatures):
        ap.error("every --temperature must be > 0 (greedy drafts and sampled drafts differ only under sampling)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folders = {name: models.prepare(name) for name in (args.target, args.drafter)}
    tokenizer = AutoTokenizer.from_pretrained(folders[args.target])
    target = AutoModelForCausalLM.from_pretrained(folders[args.target], dtype=torch.float32).eval()
    drafter = AutoModelForCausalLM.from_pretrained(folders[args.drafter], dtype=torch.float32).eval()
    work = [(name, prompt) for name, source in DATASETS.items() for prompt in load_workload(source)[:args.prompts]]
    frames, scale_frames = [], []
    with torch.inference_mode():
        for t in temperatures:
            for name, prompt in tqdm(work, desc=f"T={t:g}"):
                text = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=False)
                ids = tokenizer(text, return_tensors="pt").input_ids
                torch.manual_seed(args.seed)
                out = target.generate(ids, max_new_tokens=args.new_tokens, do_sample=True, temperature=t, top_k=0,
                                      top_p=1.0, pad_token_id=tokenizer.eos_token_id)
                start = ids.shape[1]
                target_logits, draft_logits = target(out).logits[0, start - 1:-1], drafter(out).logits[0, start - 1:-1]
                cols = acceptance(target_logits, draft_logits, t)
                n = len(cols["greedy_draft"])
                for x in scales:
                    drawn = acceptance(target_logits, draft_logits, t, draft_temperature=t * x)["sampled_draft"]
                    scale_frames.append(pl.DataFrame({"dataset": [name] * n, "prompt": [prompt.id] * n,
                                                      "temperature": [t] * n, "draft_scale": [x] * n,
                                                      "position": list(range(n)), "sampled_draft": drawn.tolist()}))
                frames.append(pl.DataFrame({"dataset": [name] * n, "prompt": [prompt.id] * n,
                                            "temperature": [t] * n, "position": list(range(n)),
                                            **{k: v.tolist() for k, v in cols.items()}}))
    provenance = dict(target=pl.lit(args.target), drafter=pl.lit(args.drafter),
                      machine=pl.lit(machine_description("cpu")), git_commit=pl.lit(git_commit()))
    rows = pl.concat(frames).with_columns(**provenance)
    info = {"commit": git_commit(), "command": results.command_line(),
            "benchmark": "experiments/drawn_draft_heads/draft_sampling_cpu.py"}
    folder = results.write_run("draft_sampling", "cpu", card="cpu", tables={"rows": rows}, info=info,
                               root=args.results)
    if scale_frames:
        by_scale = pl.concat(scale_frames).with_columns(**provenance)
        scales_folder = results.write_run("draft_temperature", "cpu", card="cpu", tables={"rows": by_scale},
                                          info=info, root=args.results)
        print(draft_temperature_summary(by_scale))
        print(f"wrote {scales_folder}")
    summary = rows.group_by("dataset", "temperature").agg(pl.col("greedy_draft", "sampled_draft").mean(),
                                                         pl.len().alias("positions")).sort("dataset", "temperature")
    print(summary)
    print(f"wrote {folder}")


if __name__ == "__main__":
    main()
