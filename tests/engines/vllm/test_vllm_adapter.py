"""The vLLM custom_class adapter, driven the way vLLM's model runner drives it, against vLLM's own NgramProposer;
and the engine's stat logger in vLLM's own stat-logging plumbing.

vLLM is imported without its dependencies (requirements-vllm.txt, installed by `make setup`): its CUDA kernels
cannot load on a CPU machine, but its configs, its custom-class loader and its n-gram proposer are plain Python and
Numba. These tests skip only when vLLM is not installed at all.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed (make setup installs requirements-vllm.txt)")

from vllm.config import DeviceConfig, SchedulerConfig, SpeculativeConfig, VllmConfig  # noqa: E402
from vllm.v1.spec_decode.custom_class_proposer import create_custom_proposer  # noqa: E402
from vllm.v1.spec_decode.ngram_proposer import NgramProposer  # noqa: E402

from hqlab.config import ConfigError  # noqa: E402
from hqlab.engines.vllm import adapter as vllm_proposer  # noqa: E402
from hqlab.engines.vllm.adapter import HqlabProposer  # noqa: E402
from hqlab.engines.vllm.worker import HqlabWorkerExtension  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
MAX_MODEL_LEN = 8192
MAX_SEQS = 8


def vllm_config(speculative: dict, additional: dict | None = None) -> VllmConfig:
    """A real VllmConfig as the engine builds it, on the CPU.

    vLLM's ModelConfig needs a GPU platform to resolve, and the proposers read only `max_model_len` from it, so
    that one field stands in for it.
    """
    config = VllmConfig(device_config=DeviceConfig(device="cpu"),
                        speculative_config=SpeculativeConfig(**speculative),
                        scheduler_config=SchedulerConfig(max_num_seqs=MAX_SEQS, max_model_len=MAX_MODEL_LEN,
                                                         is_encoder_decoder=False),
                        additional_config=additional or {})
    object.__setattr__(config, "model_config", SimpleNamespace(max_model_len=MAX_MODEL_LEN))
    return config


def adapter(spec: str, k: int, record: bool = False) -> HqlabProposer:
    """Built by vLLM's own loader, from the dotted class path, as the model runner does."""
    config = vllm_config({"method": "custom_class", "model": vllm_proposer.CLASS_PATH, "num_speculative_tokens": k},
                         {vllm_proposer.SPEC_KEY: spec, vllm_proposer.RECORD_KEY: record})
    proposer = create_custom_proposer(config)
    assert isinstance(proposer, HqlabProposer)
    return proposer


_NGRAM: dict[tuple[int, int, int], NgramProposer] = {}


def ngram(nmin: int, nmax: int, k: int) -> NgramProposer:
    key = (nmin, nmax, k)
    if key not in _NGRAM:  # construction JIT-compiles and allocates a max_model_len-wide scratch batch
        _NGRAM[key] = NgramProposer(vllm_config({"method": "ngram", "num_speculative_tokens": k,
                                                 "prompt_lookup_min": nmin, "prompt_lookup_max": nmax}))
    return _NGRAM[key]


def real_histories() -> list[np.ndarray]:
    """Real text with real repetition: the workload document and hqlab's own sources, one token per byte."""
    files = [ROOT / "data" / "documents" / "handbook.md", *sorted((ROOT / "hqlab").rglob("*.py"))[:12]]
    return [np.frombuffer(f.read_bytes()[:6000], dtype=np.uint8).astype(np.int32) for f in files]


def random_histories(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    """Small vocabularies and pasted-in repeats: many ties between equally long matches."""
    out = []
    for _ in range(n):
        vocab = int(rng.integers(2, 12))
        h = rng.integers(0, vocab, size=int(rng.integers(1, 400)))
        if rng.random() < 0.5 and len(h) > 20:
            a = int(rng.integers(0, len(h) - 10))
            h = np.concatenate([h, h[a : a + int(rng.integers(3, 10))]])
        out.append(h.astype(np.int32))
    return out


def batch(histories: list[np.ndarray], sampled: list[list[int]] | None = None):
    """vLLM's CPU inputs: a [max_num_seqs, max_model_len] int32 token table, int32 lengths, sampled tokens."""
    table = np.zeros((MAX_SEQS, MAX_MODEL_LEN), dtype=np.int32)
    lengths = np.zeros(MAX_SEQS, dtype=np.int32)
    for i, h in enumerate(histories):
        table[i, : len(h)] = h
        lengths[i] = len(h)
    if sampled is None:  # the last token was sampled this step (a draft's accepted tokens also end here)
        sampled = [[int(h[-1])] if len(h) else [] for h in histories]
    return sampled, lengths, table


def both(histories, nmin, nmax, k, policy="earliest", sampled=None):
    sampled, lengths, table = batch(histories, sampled)
    ours = adapter(f"lookup:nmin={nmin},nmax={nmax},k={k},policy={policy}", k)
    mine = ours.propose(sampled, lengths, table, slot_mappings=None)
    theirs = ngram(nmin, nmax, k).propose(k, sampled, lengths, table, slot_mappings=None)
    return mine, theirs


@pytest.mark.parametrize("nmin,nmax,k", [(1, 1, 4), (2, 5, 7), (3, 3, 10), (1, 8, 15)])
def test_same_drafts_as_vllm_ngram_on_real_text(nmin, nmax, k):
    histories = real_histories()
    compared = drafted = 0
    for cut in (50, 333, 1000, 2500, 6000):  # the same files at several points of a generation
        for start in range(0, len(histories), MAX_SEQS):
            group = [h[:cut] for h in histories[start : start + MAX_SEQS]]
            mine, theirs = both(group, nmin, nmax, k)
            assert mine == theirs[: len(group)], f"cut={cut}"
            compared += len(group)
            drafted += sum(1 for d in mine if d)
    assert drafted > compared // 3  # most of these histories do have matches: the comparison is not vacuous


def test_same_drafts_as_vllm_ngram_on_random_histories():
    rng = np.random.default_rng(0)
    for trial in range(40):
        nmin = int(rng.integers(1, 5))
        nmax = nmin + int(rng.integers(0, 4))
        k = int(rng.integers(1, 9))
        histories = random_histories(rng, MAX_SEQS)
        mine, theirs = both(histories, nmin, nmax, k)
        assert mine == theirs, f"trial {trial}: nmin={nmin} nmax={nmax} k={k}"


def test_partial_prefills_and_context_limit_follow_vllm():
    """No draft for a request that sampled nothing (partial prefill); none past max_model_len; k clipped near it."""
    h = np.tile(np.arange(10, dtype=np.int32), MAX_MODEL_LEN // 10 + 1)
    full = h[:MAX_MODEL_LEN]  # at the context limit: nothing may be drafted
    near = h[: MAX_MODEL_LEN - 3]  # 3 positions left: at most 3 tokens
    short = h[:40]
    histories = [full, near, short, short]
    sampled = [[int(full[-1])], [int(near[-1])], [int(short[-1])], []]
    mine, theirs = both(histories, 2, 4, 7, sampled=sampled)
    assert mine == theirs[:4]
    assert mine[0] == [] and len(mine[1]) == 3 and len(mine[2]) == 7 and mine[3] == []


def test_policy_recent_differs_from_vllm_where_matches_tie():
    """The comparison can fail: with the most recent of equally long matches the drafts change."""
    h = np.array([5, 1, 2, 9, 9, 1, 2, 7, 7, 1, 2], dtype=np.int32)  # "1 2" occurs twice before the end
    mine, theirs = both([h], 2, 2, 3, policy="recent")
    assert theirs[0] == [9, 9, 1] and mine[0] == [7, 7, 1]


def test_k_above_vllm_slots_and_missing_spec_are_clear_errors(monkeypatch):
    config = vllm_config({"method": "custom_class", "model": vllm_proposer.CLASS_PATH, "num_speculative_tokens": 4},
                         {vllm_proposer.SPEC_KEY: "lookup:k=8"})
    with pytest.raises(ConfigError, match="num_speculative_tokens is 4"):
        HqlabProposer(config)
    monkeypatch.delenv(vllm_proposer.ENV_VAR, raising=False)
    bare = vllm_config({"method": "custom_class", "model": vllm_proposer.CLASS_PATH, "num_speculative_tokens": 4})
    with pytest.raises(ConfigError, match="additional_config"):
        HqlabProposer(bare)
    monkeypatch.setenv(vllm_proposer.ENV_VAR, "lookup:nmin=2,nmax=3,k=4")
    assert HqlabProposer(bare).proposer.config.nmax == 3


def test_speculative_config_is_what_vllm_infers_from_the_class_path():
    spec = vllm_proposer.speculative_config("lookup:nmin=6,nmax=12,k=15")
    assert spec == {"method": "custom_class", "model": vllm_proposer.CLASS_PATH, "num_speculative_tokens": 15}
    inferred = SpeculativeConfig(model=vllm_proposer.CLASS_PATH, num_speculative_tokens=15)
    assert inferred.method == "custom_class"


def test_step_records_reach_the_engine_through_the_worker_extension():
    ours = adapter("lookup:nmin=2,nmax=4,k=5", 5, record=True)
    h = np.array([3, 4, 5, 6, 7, 3, 4, 5], dtype=np.int32)
    drafts = ours.propose(*batch([h]))
    worker = SimpleNamespace(model_runner=SimpleNamespace(drafter=ours))
    records = HqlabWorkerExtension.hqlab_take_records(worker)
    assert drafts == [[6, 7, 3, 4, 5]]
    assert len(records) == 1 and records[0]["context_len"] == 8 and records[0]["tokens"] == [6, 7, 3, 4, 5]
    assert records[0]["match_len"] == 3 and records[0]["propose_s"] >= 0
    assert HqlabWorkerExtension.hqlab_take_records(worker) == []  # taken once


# ----------------------------------------------------------------------------------------------------------------
# The engine's configs and bookkeeping (hqlab.engines.vllm): everything but the GPU run itself


def test_step_stat_logger_plugs_into_vllms_stat_logging():
    """The engine reads each step's spec-decode counters through vLLM's own per-engine stat-logger plumbing."""
    from vllm.v1.metrics.loggers import PerEngineStatLoggerAdapter
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    from hqlab.engines.vllm.engine import _stat_logger_factory

    sink: list = []
    config = vllm_config({"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_min": 2,
                          "prompt_lookup_max": 5})
    adapter = PerEngineStatLoggerAdapter(config, [0], _stat_logger_factory(sink))
    spec = SpecDecodingStats.new(7)
    spec.observe_draft(num_draft_tokens=7, num_accepted_tokens=3)
    adapter.record(SchedulerStats(spec_decoding_stats=spec), None)
    adapter.record(SchedulerStats(), None)  # a step without drafts (e.g. the prefill)
    assert sink == [(1, 7, 3), None]
