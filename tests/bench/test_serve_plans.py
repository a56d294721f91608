"""Every committed serving plan (benchmarks/plans/serve_*.json) is one the GPU host can run: each config is a valid spec,
each point a valid load point of at least 10 waves (unless the plan predates that rule and says `allow_short`), and
the configs it samples or runs at one request only are among its configs. A plan that fails here would fail only
after the GPU host's start-up and staging, the scarcest minutes."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.vllm_serve import parse_point
from hqlab.bench import serve_servers
from hqlab.engines.vllm.gpu_fused import fused_config
from hqlab.engines.vllm.gpu_lookup import lookup_config
from hqlab.engines.vllm.serving import SERVED_NATIVE, engine_configs

# the serving plans, and the corpus plans served through it (c5 on; the corpus benchmark's own plans are tested by
# test_vllm_corpus_plan.py)
PLANS = sorted(p for p in (Path(__file__).resolve().parents[2] / "benchmarks" / "plans").glob("*.json")
               if p.name.startswith("serve_") or "benchmarks/vllm_serve.py" in json.loads(p.read_text())["command"])


@pytest.mark.parametrize("path", PLANS, ids=[p.stem for p in PLANS])
def test_plan_is_runnable(path):
    plan = json.loads(path.read_text())
    assert plan["why"] and plan["points"]
    configs = plan["configs"]
    assert "none" in configs.values()  # every group needs its reference
    for spec in configs.values():
        if spec.startswith(("none", *SERVED_NATIVE)):  # vLLM's own methods: validated as the server path builds them
            engine_configs(spec)
        else:
            (fused_config if spec.startswith("gpu-fused") else lookup_config)(spec)
    for name in plan.get("batch1", []) + plan.get("sample", []):
        assert name in configs, f"{path.name}: {name!r} is not one of its configs"
    args = SimpleNamespace(config=list(configs.values()))
    serve_servers.apply_plan(args, plan)  # decisions, sampling variants: of its configs, records of goodput ones
    serve_servers.servers(args)
    for point in plan["points"]:
        load, _ = parse_point(point)
        if not plan.get("allow_short"):  # plans written since points must measure: >= 10 waves each
            load.require_waves()


def test_the_benchmark_refuses_an_abbreviated_option(capsys):
    """`--out` is no option of `together`: it must be refused, not taken as `--output-len` (a GPU call lost so)."""
    from benchmarks.vllm_serve import main

    with pytest.raises(SystemExit) as err:
        main(["together", "--plan", "benchmarks/plans/serve_s6.json", "--tag", "x", "--out", "/tmp/x"])
    assert err.value.code == 2 and "unrecognized arguments: --out" in capsys.readouterr().err
