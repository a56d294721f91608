"""The harness resolves benchmark specs against what is registered when it runs: a proposer registered after
import (as the new-proposer notebook does) is a config like any other, next to transformers' own baselines."""

from __future__ import annotations

import pytest

from hqlab import bench
from hqlab.config import ConfigError
from hqlab.proposers import REGISTRY
from hqlab.proposers.lookup import LookupProposer


def test_a_proposer_registered_later_is_a_benchmark_config(monkeypatch):
    with pytest.raises(ConfigError, match="unknown proposer 'late'"):
        bench.check_specs(["late:k=3"])
    monkeypatch.setitem(REGISTRY, "late", LookupProposer)
    bench.check_specs(["late:k=3", "hf-pld:k=4"])
    configs = bench.parse_configs(["late:k=3", "hf-pld:k=4", "late:k=3"])
    assert [c.label for c in configs] == ["none", "late:k=3", "hf-pld:k=4"]
    assert configs[1].proposer.k == 3 and configs[2].external == bench.HFPLDConfig(k=4)
    assert bench.parse_configs(configs)[1:] == configs[1:]  # built configs pass through (a fresh reference)
