"""The committed greedy outputs of the 0.5B (labd and chat suites, 128 new tokens) that the replay tests run over."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def real_traces():
    """The 0.5B's greedy outputs on the labd and chat suites (128 new tokens), as committed with the results."""
    from hqlab.bench import results
    from hqlab.replay.traces import load_traces

    return load_traces(results.trace_files(["0.5b_all_128"])[0])
