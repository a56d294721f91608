"""Tokens a step of the fused proposer under sampling, greedy drafts against drafts drawn from the drafter, with
drafter heads of one, two and three tokens: the real models decoding on the CPU through the lab's engine.

`gpu-fused`'s `draft_sample=probabilistic` draws its head from the drafter and hands vLLM's rejection sampler the
drafter's distribution; the lab's `fused` proposer does the same with a sampling drafter (`temperature` = the
request's), and the transformers engine verifies it with the same rule (`hqlab.rules.verify.sample_verify`). Its
greedy-draft twin (`temperature=0`) proposes the drafter's argmax as a point mass, as `gpu-fused` does by default.
Both run the settings of plan s5 (k 15, the long schedule, nmax 32, ties to the earliest, nmin_tail 1), without the
GPU-only keys (they change where work runs, not what is proposed) and without `device_skip` (every step drafts).

`draft_sampling_cpu.py` (beside this file) measures one drafted position; this measures whole steps, where a drawn
head's tokens are accepted together and the lookup's tail follows, so what plan s5's GPU run should find in tokens a
step is measured, not assumed. Tokens a step do not depend on the machine (up to float rounding of near ties); no
timing.

Target Qwen2.5-Coder-1.5B-Instruct, drafter Qwen2.5-Coder-0.5B-Instruct, fp32, one request at a time, the serving
benchmark's prose set (`data/workloads/prose.jsonl`, chat-templated), seeded sampling at the temperature.

Writes the run data/results/drawn_heads/cpu/ (one row per config, prompt and verify step); the figure comes from
notebooks/serving.py.
Usage: python experiments/drawn_draft_heads/drawn_heads_cpu.py [--prompts 12] [--new-tokens 96] [--temperature 0.7]
           [--heads 1,2,3]   (~30 min on 2 cores)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import polars as pl
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hqlab.config import DecodeConfig  # noqa: E402
from hqlab.bench import results  # noqa: E402
from hqlab.provenance import git_commit, machine_description  # noqa: E402
from hqlab.proposers import make_proposer  # noqa: E402
from hqlab.replay.sampled_drafts import head_summary  # noqa: E402
from hqlab.rules.fusion import SOURCE_DRAFT  # noqa: E402
from hqlab.workloads import load_workload  # noqa: E402

# plan s5's gpu-fused settings that decide what is proposed (benchmarks/plans/serve_s5.json)
BASE = "fused:k=15,nmax=32,policy=earliest,schedule=long,nmin_tail=1,model={drafter},dtype=float32"


def configs(heads: list[int], temperature: float, drafter: str) -> dict[str, tuple[int, str, str]]:
    """name -> (head, draft, proposer spec), greedy and drawn for every head."""
    out = {}
    for head in heads:
        for draft, t in (("greedy", 0.0), ("drawn", temperature)):
            spec = BASE.format(drafter=drafter) + f",draft_block={head},temperature={t:g}"
            out[f"{draft}-b{head}"] = (head, draft, spec)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--heads", default="1,2,3", help="comma-separated drafter head lengths (draft_block)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", type=Path, default=None, help="the results folder (default data/results)")
    args = ap.parse_args()
    if args.temperature <= 0:
        ap.error("--temperature must be > 0: greedy and drawn drafts differ only under sampling")
    try:
        heads = sorted({int(x) for x in args.heads.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--heads must be comma-separated integers, got {args.heads!r}")
    if not heads or any(not 1 <= h <= 15 for h in heads):
        ap.error(f"every --heads value must be in 1..15 (k is 15), got {args.heads!r}")
    from hqlab.engines.hf import HFEngine

    engine = HFEngine.load(args.target, device="cpu", dtype="float32")
    prompts = load_workload(str(ROOT / "data" / "workloads" / "prose.jsonl"))[:args.prompts]
    encoded = [(p.id, engine.encode_chat(list(p.messages))) for p in prompts]
    decode = DecodeConfig(max_new_tokens=args.new_tokens, temperature=args.temperature, seed=args.seed)
    frames = []
    for name, (head, draft, spec) in configs(heads, args.temperature, args.drafter).items():
        proposer = make_proposer(spec)
        for pid, ids in tqdm(encoded, desc=name):
            g = engine.generate(ids, proposer, decode, request=pid)
            rows = [{"config": name, "head": head, "draft": draft, "prompt": pid, "step": r.step,
                     "accepted": r.accepted, "emitted": r.emitted, "proposed": len(r.proposed),
                     "drafter_tokens": sum(1 for s in r.sources if s == SOURCE_DRAFT)} for r in g.records]
            frames.append(pl.DataFrame(rows))
    rows = pl.concat(frames).with_columns(
        temperature=pl.lit(args.temperature), target=pl.lit(args.target), drafter=pl.lit(args.drafter),
        seed=pl.lit(args.seed), machine=pl.lit(machine_description("cpu")), git_commit=pl.lit(git_commit()))
    folder = results.write_run("drawn_heads", "cpu", card="cpu", tables={"rows": rows}, root=args.results,
                               info={"commit": git_commit(), "command": results.command_line(),
                                     "benchmark": "experiments/drawn_draft_heads/drawn_heads_cpu.py"})
    print(head_summary(rows))
    print(f"wrote {folder}")


if __name__ == "__main__":
    main()
