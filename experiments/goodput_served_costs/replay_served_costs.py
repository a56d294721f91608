"""Would the goodput controller have lost at 32 in flight had it known what a served step costs? The replay
(`hqlab.replay.goodput.compare_online`) over the committed greedy chat traces, priced with the step costs a serving
run measured (time per output token x tokens a step, `hqlab.bench.serve_profile.step_cost_ratios`), against the
committed grid it decided with.

    python experiments/goodput_served_costs/replay_served_costs.py   # ~10 s, CPU -> result.json here,
                                                      # and the table as data/goodput/served_s8a.json

The served table: a plain step is `none`'s median time per output token at each load; a wide step (7 or 15 drafts,
priced alike: the run cannot tell them apart) the goodput servers' median time per output token x their acceptance
length, the two servers' median; one request keeps the fixed file's row (a wide step 1.36x a plain one, as served
one request at a time). Batch = the load (the points' mean batch was 29 and 7.7).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    import polars as pl

    from hqlab.bench import results, serve_profile
    from hqlab.config import LookupConfig
    from hqlab.engines.vllm.gpu_lookup import lookup_config
    from hqlab.replay import goodput as rg
    from hqlab.replay.traces import load_traces
    from hqlab.rules.goodput import DEFAULT_STEP_COSTS, StepCosts

    run = sys.argv[1] if len(sys.argv) > 1 else "s8a"
    spec = lookup_config("gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest,batch_k=1:15/4:7/0")
    lookup = LookupConfig(nmin=spec.nmin, nmax=spec.nmax, k=spec.k, policy=spec.policy)
    ratios = serve_profile.step_cost_ratios(results.load("serve", run))
    goodput = ratios.filter(pl.col("config").str.contains("goodput="))
    fixed = StepCosts.from_json("data/goodput/served_x2.4.json")
    rows = [(1, fixed.at(1, 0), fixed.at(1, 15))]
    for load, part in goodput.group_by("max_concurrency", maintain_order=True):
        rows.append((int(load[0]), float(part["plain_ms"].median()), float(part["step_ms"].median())))
    rows.sort()
    truth = StepCosts(tuple(b for b, _, _ in rows), (0, 7, 15), tuple((p, w, w) for _, p, w in rows),
                      source=f"served, run {run}: plain = none's time per output token, wide = goodput servers' "
                             f"time per output token x acceptance length; one request from served_x2.4.json")
    chat = [t for t in load_traces(results.trace_files(["1.5b_prose_chat_256"])[0]) if t.category == "chat"]
    tables = rg.TraceTables(lookup)
    out = {"truth": truth.to_dict(), "points": []}
    for load in (1, 8, 32):
        frame = rg.compare_online(chat, lookup, DEFAULT_STEP_COSTS, truth, concurrency=load,
                                  batch_k_value=spec.batch_k, tables=tables, workload="chat")
        for row in frame.iter_rows(named=True):
            out["points"].append({k: row[k] for k in ("concurrency", "policy", "speedup", "vs_truth", "g0", "gx")})
            print(f"{load:3d} {row['policy']:15s} {row['speedup']:.3f}x none")
    (HERE / "result.json").write_text(json.dumps(out, indent=1) + "\n")
    truth.to_json(f"data/goodput/served_{run}.json")  # a fixed table a server can price with (goodput=PATH.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
