"""benchmarks/vllm_corpus.py without a GPU: the plan (--dry-run), and `finish` (`hqlab.bench.corpus_runs`) with its
exactness check on runs recorded by the real GpuLookupSpeculator (its Triton kernels in the interpreter) decoding real
text: requests in a closed loop with 1 or 3 in flight, finished requests' documents delivered between steps as the
plugin delivers them, the target's greedy output standing in as the recorded text. The replay
(`hqlab.bench.corpus_check`) must predict every step exactly from the rows alone, and must notice a wrong insertion
order.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first @triton.jit definition

from hqlab.bench import corpus_runs  # noqa: E402
from hqlab.bench.corpus_check import emitted_tokens  # noqa: E402
from hqlab.bench.corpus_report import without_corpus  # noqa: E402
from hqlab.engines.vllm.gpu_lookup import GpuLookupSpeculator, lookup_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("vllm_corpus_bench", ROOT / "benchmarks" / "vllm_corpus.py")
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench
spec.loader.exec_module(bench)

BASE = bench.BASE
CORPUS = f"{BASE},corpus=2048,corpus_policy=longest"
CORPUS_OF = {1: CORPUS, 3: f"{CORPUS},corpus_prompts=1"}  # one at a time: outputs; 3 in flight: prompts too
WIDTH, SLOTS = 1024, 4


def words() -> np.ndarray:
    text = (ROOT / "docs" / "vllm.md").read_text()
    ids: dict[str, int] = {}
    return np.array([ids.setdefault(w, len(ids)) for w in re.findall(r"\w+|[^\w\s]", text)], dtype=np.int64)


def requests(n: int = 6) -> list[tuple[str, list[int], list[int]]]:
    """(name, prompt, output): outputs that overlap the earlier ones (a template filled again, an answer quoted),
    prompts of their own."""
    w = words()
    out = []
    for i in range(n):
        prompt = w[2000 + 50 * i : 2000 + 50 * i + 30 + 7 * i].tolist()
        output = w[300 + 40 * i : 300 + 40 * i + 70].tolist()
        out.append((f"w.{i:03d}", prompt, output))
    return out


def simulate(config: str, reqs, in_flight: int) -> list[dict]:
    """Raw rows as `run_point` writes them, from a closed loop on the speculator itself (see the module docstring)."""
    c = lookup_config(config) if config != "none" else None
    speculator = GpuLookupSpeculator.standalone(c, max_num_reqs=SLOTS, max_model_len=WIDTH, pad=151935,
                                                device="cpu", record=True) if c else None
    rows_t = torch.zeros(SLOTS, WIDTH, dtype=torch.int32)
    lengths = torch.zeros(SLOTS, dtype=torch.int32)
    if speculator:
        speculator.bind(rows_t, lengths)
    queue, running, free = list(range(len(reqs))), {}, list(range(SLOTS))
    steps: dict[int, list[dict]] = {i: [] for i in range(len(reqs))}
    finished, admitted = [], []
    while queue or running:
        while queue and len(running) < in_flight:
            i = queue.pop(0)
            slot = free.pop(0)
            name, prompt, output = reqs[i]
            running[slot] = [i, 1]  # the prefill emitted the first output token
            history = prompt + output[:1]
            rows_t[slot, : len(history)] = torch.tensor(history, dtype=torch.int32)
            lengths[slot] = len(history)
            admitted.append(name)
        order = sorted(running)
        if speculator:
            speculator.corpus_step(finished, admitted)  # what the plugin does in vLLM's finish_requests
            speculator.draft(SimpleNamespace(num_reqs=len(order), idx_mapping=torch.tensor(order, dtype=torch.int32),
                                             req_ids=[reqs[running[s][0]][0] for s in order]), None, False)
            made = {r["request"]: r for r in speculator.take_records()}
        finished, admitted = [], []
        for slot in order:
            i, pos = running[slot]
            name, prompt, output = reqs[i]
            rec = made[name] if speculator else {"tokens": [], "corpus_docs": -1, "source": ""}
            rest = output[pos:]
            emitted = emitted_tokens(rec["tokens"], rest)  # greedy verification against the recorded text
            steps[i].append({"context_len": len(prompt) + pos, "emitted": emitted, "accepted": emitted - 1,
                             "corpus_docs": rec.get("corpus_docs", -1),
                             "drafted": rec["tokens"] if speculator else None,
                             "source": rec.get("source", ""), "match_len": rec.get("match_len", -1), "t_end": 0.0})
            pos += emitted
            history = prompt + output[:pos]
            rows_t[slot, : len(history)] = torch.tensor(history, dtype=torch.int32)
            lengths[slot] = len(history)
            running[slot][1] = pos
            if pos == len(output):
                finished.append((name, prompt, output))
                del running[slot]
                free.append(slot)
    log = {d["request"]: d for d in speculator.take_corpus_log()} if speculator else {}
    rows = []
    for i, (name, prompt, output) in enumerate(reqs):
        entry = log.get(name, {})
        rows.append({"workload": "w", "order": i, "session": f"s{i // 2}", "turn": i % 2, "request": name,
                     "vllm_request": name, "prompt_ids": prompt, "output_ids": output, "finish": "length",
                     "ttft_s": 0.01, "total_s": 0.01 + 0.001 * len(steps[i]), "t_last": 0.01 + 0.001 * len(steps[i]),
                     "corpus_seq": int(entry.get("seq", -1)), "corpus_doc_len": int(entry.get("length", -1)),
                     "corpus_output_len": int(entry.get("output_len", -1)), "point_wall_s": 1.0,
                     "steps": json.dumps(steps[i]), "config": config, "workload_file": "w.jsonl",
                     "load": in_flight, "repeat": 0, "point": 0})
    return rows


@pytest.fixture(scope="module")
def recorded():
    reqs = requests()
    return {load: [row for config in ("none", BASE, CORPUS_OF[load]) for row in simulate(config, reqs, load)]
            for load in (1, 3)}


@pytest.mark.parametrize("load", [1, 3])
def test_the_replay_predicts_every_recorded_step(recorded, load):
    points = {r["config"]: r for r in corpus_runs.point_rows(recorded[load], "t")}
    corpus = points[CORPUS_OF[load]]
    assert corpus["replay_exact"] and corpus["replay_problems"] == "", corpus["replay_first_mismatch"]
    assert corpus["replay_exact_steps"] == corpus["replay_steps"] > 0
    assert corpus["replay_draft_equal"] == corpus["replay_draft_steps"] == corpus["replay_steps"]
    assert corpus["replay_corpus_steps"] > 0 and corpus["corpus_step_share"] > 0  # the corpus won steps
    assert points[BASE]["replay_exact"] and points[BASE]["replay_corpus_steps"] == 0
    assert all(p["greedy_equal_none"] for p in points.values())
    # the corpus drafted more of the outputs it had seen: fewer steps, more tokens per step than without it
    assert corpus["tokens_per_step"] > points[BASE]["tokens_per_step"]
    assert corpus["vs_no_corpus"] == pytest.approx(corpus["decode_tok_s"] / points[BASE]["decode_tok_s"])


def test_the_replay_notices_a_wrong_insertion_order(recorded):
    rows = [dict(r) for r in recorded[1] if r["config"] == CORPUS]
    seqs = [r["corpus_seq"] for r in rows]
    assert sorted(seqs) == [-1, *range(len(rows) - 1)]  # the last request's document arrives after the last step
    a, b = rows[0], rows[1]
    a["corpus_seq"], b["corpus_seq"] = b["corpus_seq"], a["corpus_seq"]
    swapped = corpus_runs.check_rows(rows, CORPUS)
    assert not swapped["replay_exact"] and swapped["replay_first_mismatch"]
    rows = [dict(r) for r in recorded[1] if r["config"] == CORPUS]
    rows[2]["corpus_doc_len"] += 1  # a document that is not the recorded output
    assert "corpus document" in corpus_runs.check_rows(rows, CORPUS)["replay_problems"]


def test_finish_writes_points_and_requests(recorded, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import polars as pl

    from hqlab.bench import results

    raw = tmp_path / "vllm_corpus_t.parquet"
    pq.write_table(pa.Table.from_pylist(recorded[3]), raw)
    root = tmp_path / "results"
    with pytest.raises(SystemExit, match="give --card"):  # no .json beside the raw file names the machine
        bench.main(["finish", str(raw), "--run", "t", "--results", str(root), "--commit", "abc"])
    assert bench.main(["finish", str(raw), "--run", "t", "--results", str(root), "--commit", "abc",
                       "--card", "cpu"]) == 0
    points, reqs = results.load("corpus", "t", root=root), results.load("corpus", "t", "requests", root=root)
    assert results.run_info("corpus", "t", root)["commit"] == "abc"
    assert points.height == 3 and reqs.height == 3 * 6
    assert set(points["config"]) == {"none", BASE, CORPUS_OF[3]} and (points["git_commit"] == "abc").all()
    row = reqs.filter(pl.col("config") == CORPUS_OF[3]).sort("order").row(0, named=True)
    assert row["corpus_doc_len"] == len(row["prompt_ids"]) + len(row["output_ids"])  # prompt and output
    assert row["step_emitted"] and sum(row["step_emitted"]) == len(row["output_ids"]) - 1
    assert [e - 1 for e in row["step_emitted"]] == row["step_accepted"]
    assert "corpus" in capsys.readouterr().out


def test_dry_run_prints_the_plan(tmp_path, capsys):
    workload = tmp_path / "tiny.jsonl"
    lines = [{"workload": "tiny", "session": f"s{i // 2}", "turn": i % 2,
              "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(5)]
    workload.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    prose = ROOT / "data" / "workloads" / "prose.jsonl"
    assert bench.main(["bench", "--tag", "t", "--dry-run", "--workload", str(workload), "--workload", str(prose),
                       "--requests", "tiny:1=3"]) == 0
    out = capsys.readouterr().out
    assert "24 points" in out  # 2 repeats x 2 workloads x 2 loads x 3 configs
    assert "load 1 runs 3, load 8 runs 5" in out and "load 1 runs 6, load 8 runs 16" in out  # tiny, prose
    assert "start no engine" not in out and "point 23:" in out


def test_points_interleave_configs_and_keep_whole_repeats():
    points = corpus_runs.plan_points(["a", "b"], ["none", "x", "y"], 2, (1, 8))
    assert len(points) == 24 and [p[0] for p in points] == [0] * 12 + [1] * 12
    groups = [points[i : i + 3] for i in range(0, 24, 3)]
    assert all(sorted(p[3] for p in g) == ["none", "x", "y"] for g in groups)
    assert len({g[0][3] for g in groups}) == 3  # the config that goes first rotates
    assert without_corpus(CORPUS, {"none", BASE, CORPUS}) == BASE
    assert without_corpus(BASE, {"none", BASE, CORPUS}) is None
    assert corpus_runs.request_counts(["1=12", "8=16", "prose:1=6", "1=4"]) == \
        {(None, 1): 4, (None, 8): 16, ("prose", 1): 6}
    with pytest.raises(SystemExit, match="LOAD=N"):
        corpus_runs.request_counts(["prose=3"])
