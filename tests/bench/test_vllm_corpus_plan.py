"""benchmarks/vllm_corpus.py --plan: a JSON plan fills in what the command line leaves out (CPU, --dry-run), and the
committed corpus plans (benchmarks/plans/corpus_*.json) run as planned and pair every corpus config with its lookup
without the corpus, as the ratio the issue asks for needs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from hqlab.bench.corpus_report import without_corpus

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "benchmarks" / "plans" / "corpus_c2.json"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("vllm_corpus_plan_bench", ROOT / "benchmarks" / "vllm_corpus.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_plan_of_five_configs_runs_every_multi_turn_request_as_planned(bench, capsys):
    plan = json.loads(PLAN.read_text())
    assert bench.main(["bench", "--tag", "c2", "--plan", str(PLAN), "--dry-run"]) == 0
    out = capsys.readouterr().out
    configs = list(plan["configs"].values())
    assert f"{len(configs)} engines" in out and f"{3 * 2 * 3 * len(configs)} points, repeats 3" in out
    assert "corpus_multiturn.jsonl: 24 requests in the file; load 1 runs 24, load 8 runs 24" in out
    assert "prose.jsonl: 32 requests in the file; load 1 runs 6, load 8 runs 16" in out
    assert "(budget 480 s)" in out
    labels = set(configs)
    corpus = [c for c in configs if "corpus=" in c]
    assert len(corpus) == 2 and all(without_corpus(c, labels) in labels for c in corpus)
    from hqlab.engines.vllm.gpu_lookup import lookup_config

    for c in configs[1:]:
        lookup_config(c)  # every config is one the speculator accepts


def test_the_batch_job_plan_runs_every_request_at_8_in_flight(bench, capsys):
    """The batch-job plan (#42, docs/corpus.md): the batch workload, all 153 requests at 8 in flight and the first 24
    one at a time, `none`, the lookup k = 15 and the same lookup with the first corpus config, three repeats."""
    path = PLAN.with_name("corpus_c3.json")
    plan = json.loads(path.read_text())
    assert bench.main(["bench", "--tag", "c3", "--plan", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "3 engines" in out and "18 points, repeats 3" in out and "(budget 480 s)" in out
    assert "corpus_batch.jsonl: 153 requests in the file; load 1 runs 24, load 8 runs 153" in out
    configs = list(plan["configs"].values())
    corpus = [c for c in configs if "corpus=" in c]
    assert len(corpus) == 1 and without_corpus(corpus[0], set(configs)) in configs


def test_the_command_line_wins_over_the_plan(bench, tmp_path, capsys):
    plan = tmp_path / "p.json"
    plan.write_text(json.dumps({"configs": ["none", "gpu-lookup:k=7"], "repeats": 4, "budget_s": 99,
                                "workloads": ["data/workloads/prose.jsonl"], "loads": [1], "why": "a note"}))
    assert bench.main(["bench", "--tag", "t", "--plan", str(plan), "--repeats", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "2 engines" in out and "4 points, repeats 2" in out and "(budget 99 s)" in out
    assert bench.main(["bench", "--tag", "t", "--workload", "data/workloads/prose.jsonl", "--load", "1",
                       "--dry-run"]) == 0  # no plan: the defaults (3 configs, 2 repeats, 330 s)
    out = capsys.readouterr().out
    assert "3 engines" in out and "6 points, repeats 2" in out and "(budget 330 s)" in out
    plan.write_text(json.dumps({"loads": 8}))
    with pytest.raises(SystemExit, match="loads must be a list"):
        bench.main(["bench", "--tag", "t", "--plan", str(plan), "--dry-run"])


def test_each_pair_of_admission_plans_differs_in_the_capture_size_alone(bench, capsys):
    """The four admission plans (#42, docs/corpus.md "admissions"): two pairs that run the same points back to back on
    one machine, CUDA graphs up to 1,024 tokens in one of each pair, the worker's phases timed; the second pair is
    the first cut to the batch job at 8 in flight with the lookup's ratio pair. Every plan runs as planned
    (--dry-run) and pairs its corpus configs with their lookup without the corpus."""
    tags = ("c4a", "c4b", "c4c", "c4d")
    plans = {tag: json.loads(PLAN.with_name(f"corpus_{tag}.json").read_text()) for tag in tags}
    a, b, c, d = plans["c4a"], plans["c4b"], plans["c4c"], plans["c4d"]

    def points(plan: dict) -> dict:  # what a plan runs, less its notes and its capture size
        return {k: v for k, v in plan.items() if k not in ("why", "command", "finish", "capture")}

    assert b["capture"] == c["capture"] == 1024 and "capture" not in a and "capture" not in d
    assert points(a) == points(b) and points(d) == points(c)
    assert a["profile"] and b["profile"] and c["profile"]
    assert c["loads"] == [8] and c["requests"] == ["corpus_batch:8=153"]
    assert c["configs"] == {k: b["configs"][k] for k in ("lookup-k15", "corpus-c1")}
    for tag, plan in plans.items():
        assert f"--tag {tag} --plan benchmarks/plans/corpus_{tag}.json" in plan["command"]
        assert bench.main(["bench", "--tag", tag, "--plan", str(PLAN.with_name(f"corpus_{tag}.json")),
                           "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert f"(budget {plan['budget_s']} s)" in out
        configs = list(plan["configs"].values())
        corpus = [x for x in configs if "corpus=" in x]
        assert corpus and all(without_corpus(x, set(configs)) in configs for x in corpus), tag
