"""The vLLM custom_class adapter, driven the way vLLM's model runner drives it, against vLLM's own NgramProposer.

vLLM is imported without its dependencies (requirements-vllm.txt, installed by `make setup`): its CUDA kernels
cannot load on a CPU machine, but its configs, its custom-class loader and its n-gram proposer are plain Python and
Numba. These tests skip only when vLLM is not installed at all.
"""

from __future__ import annotations

import math
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
from hqlab.engines.vllm.adapter import HqlabProposer, HqlabWorkerExtension  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
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


def test_engine_settings_map_specs_to_vllms_own_speculative_configs():
    from hqlab.engines.vllm import setting_for, settings_for

    assert settings_for(["lookup:k=7", "none", "lookup:k=7"])[0].label == "none"
    assert [s.label for s in settings_for(["lookup:k=7", "lookup:k=7"])] == ["none", "lookup:k=7"]
    lookup = setting_for("lookup:nmin=6,nmax=12,k=15")
    assert lookup.speculative_config == {"method": "custom_class", "model": vllm_proposer.CLASS_PATH,
                                         "num_speculative_tokens": 15}
    assert lookup.additional_config[vllm_proposer.SPEC_KEY] == "lookup:nmin=6,nmax=12,k=15" and lookup.uses_adapter
    ngram_setting = setting_for("vllm-ngram:nmin=2,nmax=5,k=7")
    assert ngram_setting.speculative_config == {"method": "ngram", "num_speculative_tokens": 7,
                                                "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    assert not ngram_setting.uses_adapter
    suffix = setting_for("arctic-suffix:k=16,depth=24,min_prob=0.2")
    assert suffix.speculative_config["method"] == "suffix"
    assert suffix.speculative_config["suffix_decoding_min_token_prob"] == 0.2
    assert suffix.speculative_config["suffix_decoding_max_cached_requests"] == 0  # each request on its own context
    for spec in (lookup, ngram_setting):  # vLLM's own config class accepts what the engine will pass
        built = SpeculativeConfig(**spec.speculative_config)
        assert built.num_speculative_tokens == spec.k
    for bad, message in (("none:k=3", "takes no keys"), ("eagle:k=3", "unknown proposer"),
                         ("arctic-suffix:offset=1", "no offset"), ("lookup:k=0", "k must be >= 1")):
        with pytest.raises(ConfigError, match=message):
            setting_for(bad)


def test_step_records_from_vllm_counters_and_adapter_records():
    from hqlab.engines.vllm import UNKNOWN_TOKEN, StepEvent, step_records
    from hqlab.trace import tokens_per_step

    prompt_len = 100
    events = [StepEvent(0.050, 1, 0, 0),  # prefill: the first token
              StepEvent(0.060, 4, 5, 3),  # 5 drafted, 3 accepted + 1
              StepEvent(0.070, 1, 5, 0),
              StepEvent(0.081, 2, 5, 4)]  # 4 accepted but EOS after 2 tokens: accepted is clipped to 1
    adapter = [{"context_len": 101, "tokens": [1, 2, 3, 4, 5], "sources": [1] * 5, "match_len": 7, "propose_s": 1e-4},
               {"context_len": 105, "tokens": [6, 7, 8, 9, 10], "sources": [1] * 5, "match_len": 6,
                "propose_s": 2e-4}]
    ttft, records = step_records("copy", prompt_len, events, k=5, adapter=adapter)
    assert ttft == 0.050 and len(records) == 3
    assert [r.context_len for r in records] == [100, 104, 105]  # KV content before each step
    assert records[0].proposed == [1, 2, 3, 4, 5] and records[0].match_len == 7 and records[0].accepted == 3
    assert records[1].proposed == [6, 7, 8, 9, 10] and records[1].propose_s == 2e-4
    assert records[2].proposed == [UNKNOWN_TOKEN] * 5 and math.isnan(records[2].propose_s)  # no adapter record
    assert records[2].accepted == 1 and records[2].emitted == 2
    assert [round(r.step_s, 3) for r in records] == [0.010, 0.010, 0.011] and records[-1].t_end == 0.081
    assert sum(r.emitted for r in records) + events[0].tokens == 8
    assert tokens_per_step(records) == pytest.approx((4 + 1 + 2) / 3)
    _, plain = step_records("copy", prompt_len, [StepEvent(0.05, 1, 0, 0), StepEvent(0.06, 1, 0, 0)], k=0)
    assert plain[0].proposed == [] and plain[0].propose_s == 0.0 and plain[0].verify_len == 1


def _generation(ids, margins=(), steps=3, total=1.0):
    from hqlab.trace import Generation, StepRecord

    records = [StepRecord("p", j, 10 + j, 2, [UNK], [1], 0, 1 if j % 2 else 0, 2 if j % 2 else 1, 0.01, math.nan,
                          0.1 + 0.01 * j, 1, 1) for j in range(steps)]
    return Generation("p", 10, list(ids), "length", 0.1, total, records[-1].t_end, records, list(margins))


UNK = -1


def test_raw_runs_round_trip_and_become_bench_rows():
    import polars as pl

    from hqlab.config import DecodeConfig
    from hqlab.engines.vllm import Run, frames_from_raw, raw_table, runs_from_raw

    ref = [5, 6, 7, 8, 9, 10]
    runs = [Run("none", "copy", "copy", -1, _generation(ref, margins=[3.0, 0.2, 4.0, 4.0, 4.0, 4.0], total=9.0)),
            Run("none", "copy", "copy", 0, _generation(ref, total=2.0)),
            Run("none", "copy", "copy", 1, _generation(ref, total=2.2)),
            Run("lookup:k=7", "copy", "copy", 0, _generation(ref, total=1.0)),
            Run("vllm-ngram:k=7", "copy", "copy", 0, _generation([5, 99, 7, 8, 9, 10], total=1.5)),
            Run("pld:k=3", "copy", "copy", 0, _generation([5, 6, 7, 99, 9, 10], total=1.5))]
    table = raw_table(runs)
    back = runs_from_raw(pl.from_arrow(table))
    assert [(r.config, r.repeat, r.generation.output_ids) for r in back] == \
           [(r.config, r.repeat, r.generation.output_ids) for r in runs]
    assert back[3].generation.records[1].emitted == 2 and math.isnan(back[3].generation.records[0].propose_s)
    results, steps = frames_from_raw(back, DecodeConfig(max_new_tokens=6), {"dtype": "bfloat16", "model": "m"})
    by = {r["config"]: r for r in results.to_dicts()}
    assert list(by) == ["none", "lookup:k=7", "vllm-ngram:k=7", "pld:k=3"] and results["engine"][0] == "vllm"
    assert by["none"]["total_s"] == pytest.approx(2.1)  # timed runs only: the margins pass is not timed
    assert by["lookup:k=7"]["speedup_e2e"] == pytest.approx(2.1) and by["lookup:k=7"]["divergence"] == "identical"
    assert by["vllm-ngram:k=7"]["divergence"] == "near-tie" and by["vllm-ngram:k=7"]["first_divergence"] == 1
    assert by["pld:k=3"]["divergence"] == "mismatch" and by["pld:k=3"]["divergence_margin"] == 4.0
    assert steps.height == 4 * 3 and set(steps["config"]) == set(by)


def test_parts_round_trip_and_refuse_damage(tmp_path):
    """tools/gpu_host/pack_parts.py: files split over parts come back byte-identical; a damaged part is refused."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pack_parts", ROOT / "tools" / "gpu_host" / "pack_parts.py")
    pack_parts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pack_parts)
    rng = np.random.default_rng(1)
    files = []
    for name, size in (("a.whl", 1_500_000), ("b.whl", 10), ("model.gguf", 2_700_000)):
        files.append(tmp_path / name)
        files[-1].write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    manifest = pack_parts.pack(files, tmp_path / "parts", 1 << 20)
    assert [p["size"] for p in manifest["parts"]] == [1 << 20] * 4 + [4_200_010 - 4 * (1 << 20)]
    arrived = tmp_path / "arrived"
    pack_parts.stash(tmp_path / "parts" / "manifest.json", sorted((tmp_path / "parts").glob("part-*.bin")), arrived)
    out = pack_parts.unpack(arrived, tmp_path / "out")
    assert [p.read_bytes() for p in out] == [f.read_bytes() for f in files]
    damaged = bytearray((arrived / "part-002.bin").read_bytes())
    damaged[7] ^= 1
    (arrived / "part-002.bin").write_bytes(bytes(damaged))
    with pytest.raises(pack_parts.PartsError, match="part-002.bin: sha256"):
        pack_parts.unpack(arrived, tmp_path / "again")
    assert not (tmp_path / "again").exists() or not any((tmp_path / "again").iterdir())
    with pytest.raises(pack_parts.PartsError, match="sha256"):
        pack_parts.stash(arrived / "manifest.json", [arrived / "part-002.bin"], tmp_path / "elsewhere")


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


def test_cli_vllm_engine_checks_specs_and_gpu_before_loading_anything(capsys):
    import torch

    from hqlab.cli import main

    out = ROOT / "never-written.parquet"
    assert main(["bench", "--engine", "vllm", "--proposer", "eagle:k=3", "--out", str(out)]) == 2
    assert "unknown proposer 'eagle'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "--engine", "vllm", "--proposer", "lookup:k=7", "--out", str(out)]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
    assert main(["bench", "--engine", "tgi", "--out", str(out)]) == 2
    assert not out.exists()


def test_gpu_finish_turns_returned_raw_runs_into_bench_results(tmp_path):
    """benchmarks/vllm_gpu.py finish: the GPU host's raw runs (+ engine descriptions) -> results parquet."""
    import importlib.util
    import json

    import polars as pl
    import pyarrow.parquet as pq

    from hqlab.engines.vllm import Run, raw_table

    spec = importlib.util.spec_from_file_location("vllm_gpu", ROOT / "benchmarks" / "vllm_gpu.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    ref = [5, 6, 7, 8, 9, 10]
    parts = {"a": [Run("none", "copy", "copy", -1, _generation(ref, margins=[1.0] * 6)),
                   Run("none", "copy", "copy", 0, _generation(ref, total=2.0))],
             "b": [Run("lookup:k=7", "copy", "copy", 0, _generation(ref, total=1.0))]}
    raw = []
    for tag, runs in parts.items():
        raw.append(tmp_path / f"vllm_gpu_{tag}.parquet")
        pq.write_table(raw_table(runs), raw[-1])
        engines = [{"config": r.config, "model_runner": "v2" if r.config == "none" else "v1",
                    "async_scheduling": r.config == "none"} for r in runs[-1:]]
        raw[-1].with_suffix(".json").write_text(json.dumps(
            {"machine": "NVIDIA H200, torch 2.11.0+cu130, vllm 0.26.0", "model": "qwen2.5-coder-0.5b",
             "dtype": "bfloat16", "doc_tokens": 2000, "suite": "labd", "max_new_tokens": 6, "engines": engines}))
    out = tmp_path / "core_vllm-h200.parquet"
    script.main(["finish", *map(str, raw), "--out", str(out)])
    results = pl.read_parquet(out)
    assert results["config"].to_list() == ["none", "lookup:k=7"]
    assert results["vllm_runner"].to_list() == ["v2", "v1"] and results["speedup_e2e"][1] == pytest.approx(2.0)
    assert results["machine"][0].startswith("NVIDIA H200") and results["engine"][0] == "vllm"
    assert pl.read_parquet(tmp_path / "core_vllm-h200.steps.parquet").height == 6
