"""The gate rule (`hqlab.rules.gate`): its incremental state equals the lookup rule's match length on real traces."""

from __future__ import annotations

import numpy as np
import pytest

from hqlab.bench import results
from hqlab.config import ConfigError
from hqlab.replay.traces import load_traces
from hqlab.rules.gate import GateConfig, SuffixGate, batch_width
from hqlab.rules.lookup import suffix_match

@pytest.fixture(scope="module")
def traces():
    all_128, corpus_128 = results.trace_files(["0.5b_all_128", "0.5b_corpus_128"])
    picked = load_traces(all_128)  # chat and the copying classes
    prose = [t for t in load_traces(corpus_128) if t.category == "prose"]
    return picked + prose[:6]


@pytest.mark.parametrize("min_match", [1, 2, 3, 5, 8])
def test_open_equals_the_lookup_rule_on_every_prefix(traces, min_match):
    """Fed token by token over prompt and output, `open` is the lookup rule's "a match of min_match or more"."""
    opened = 0
    for trace in traces:
        history = np.asarray(trace.prompt_ids + trace.output_ids, dtype=np.int64)
        gate = SuffixGate(min_match)
        start = len(trace.prompt_ids)
        gate.extend(history[:start])
        for t in range(start, len(history) + 1):
            if t > start:
                gate.extend(history[t - 1:t])
            rule = suffix_match(history[:t], nmin=min_match, nmax=min_match, k=1).match_len > 0
            assert gate.open == rule, (trace.prompt_id, t)
            opened += rule
    assert opened > 0  # the traces do repeat themselves


def test_catch_up_reads_only_what_is_new_and_refuses_a_shrinking_history():
    gate = SuffixGate(2)
    assert not gate.catch_up([5, 6, 7])
    assert gate.catch_up([5, 6, 7, 5, 6]) and gate.length == 5
    assert not gate.catch_up([5, 6, 7, 5, 6, 9])
    with pytest.raises(ValueError, match="shrank from 6 to 2"):
        gate.catch_up([5, 6])


def test_a_step_speculates_when_any_request_is_open():
    assert batch_width([False, True, False], 15) == 15
    assert batch_width([False, False], 15) == 0
    assert batch_width([], 7) == 0


def test_config_is_validated():
    with pytest.raises(ConfigError, match="min_match must be >= 1"):
        GateConfig(0)
    with pytest.raises(ConfigError, match="behind must be >= 1"):
        GateConfig(2, behind=0)
    assert GateConfig(3).behind == 3
