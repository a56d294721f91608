"""Configs and specs: bad values are clear errors, specs round-trip, and one resolver turns a spec into what runs
it, for every table of names (proposers, the benchmark's engine baselines, vLLM's settings, the GPU lookup)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hqlab.config import ConfigError, DecodeConfig, LookupConfig, parse_spec, resolve_spec
from hqlab.proposers import REGISTRY, make_proposer

HQLAB = Path(__file__).resolve().parents[1] / "hqlab"


@pytest.mark.parametrize("spec, message", [
    ("lookup:nmin=8,nmax=4", "nmin must be <= nmax"),
    ("lookup:k=0", "k must be >= 1"),
    ("lookup:nmin=0", "nmin must be >= 1"),
    ("lookup:frobnicate=3", "unknown key(s) frobnicate"),
    ("lookup:nmin=six", "nmin must be an integer"),
    ("lookup:policy=oldest", "policy must be 'recent' or 'earliest'"),
    ("lookup:nmin", "is not key=value"),
    ("lookup:k=3,k=4", "given twice"),
    ("pld:n=0", "n must be >= 1"),
    ("nonesuch", "unknown proposer 'nonesuch'"),
    ("", "empty proposer spec"),
])
def test_bad_specs(spec, message):
    with pytest.raises(ConfigError) as e:
        make_proposer(spec)
    assert message in str(e.value)


def test_spec_round_trip():
    assert parse_spec(" lookup : nmin=3 , k=9 ") == ("lookup", {"nmin": "3", "k": "9"})
    p = make_proposer("lookup:nmin=3,nmax=5,k=9,policy=earliest,full=true")
    assert p.config == LookupConfig(nmin=3, nmax=5, k=9, policy="earliest", full=True)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        DecodeConfig(max_new_tokens=0)
    with pytest.raises(ConfigError, match="top_p"):
        DecodeConfig(top_p=0)


def test_the_resolver_gives_the_name_and_the_validated_config():
    from hqlab.bench import HFPLDConfig, known

    assert resolve_spec("lookup:nmin=3,k=9", REGISTRY) == ("lookup", LookupConfig(nmin=3, k=9))
    assert resolve_spec("hf-pld:k=4", known()) == ("hf-pld", HFPLDConfig(k=4))  # a config class names itself
    with pytest.raises(ConfigError, match="unknown proposer 'hf-pld' in 'hf-pld:k=4'; known: arctic-rule, arctic-suffix"):
        resolve_spec("hf-pld:k=4", REGISTRY)
    with pytest.raises(ConfigError, match="^no such thing: 'x' in 'x:k=1'$"):
        resolve_spec("x:k=1", REGISTRY, unknown="no such thing: {name!r} in {spec!r}")
    with pytest.raises(ConfigError, match="^mine: unknown key"):
        resolve_spec("lookup:depth=3", REGISTRY, context="mine")


def test_every_spec_reader_resolves_through_the_one_resolver():
    """`build_config` (keys and values into a config) is called by `resolve_spec` alone, and every other reader of
    specs (proposers, the benchmark, sweeps, the teacher-forced grid, the explorer, vLLM's settings and its GPU
    lookup) goes through `resolve_spec`."""
    callers, resolvers = [], set()
    for path in HQLAB.rglob("*.py"):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            called = {getattr(c.func, "id", getattr(c.func, "attr", None)) for c in ast.walk(fn)
                      if isinstance(c, ast.Call)}
            where = f"{path.relative_to(HQLAB).with_suffix('')}.{fn.name}".replace("/", ".")
            if "build_config" in called:
                callers.append(where)
            if "resolve_spec" in called:
                resolvers.add(where)
    assert callers == ["config.resolve_spec"]
    assert {"proposers.__init__.make_proposer", "bench.harness.parse_configs", "bench.harness.check_specs",
            "engines.vllm.engine.setting_for", "engines.vllm.gpu_lookup.lookup_config",
            "replay.teacher.replay_fused_grid", "site.explorer._build_controls"} <= resolvers
