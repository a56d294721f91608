"""hqlab's lookup inside vLLM's GPU step: what can be checked without a GPU.

- The speculator's drafts, computed by the Triton kernel (in the interpreter here) on histories laid out as vLLM's
  model runner V2 keeps them ([slots, max_model_len] int32 rows, a length per slot, a batch of slot indices in
  vLLM's own `InputBatch`), equal the reference rule `hqlab.rules.lookup.suffix_match`, draft for draft.
- The plugin changes vLLM's decisions only for configs that ask for hqlab's speculator: model runner V2 and
  asynchronous scheduling for ours, vLLM's own choices for everything else; it refuses other vLLM versions.
- The engine's bookkeeping for fixed-width verify steps and concurrent runs.
The GPU run itself is benchmarks/vllm_gpu.py (docs/vllm.md).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="the vllm extra is not installed (make setup installs its CPU-side packages)")

from vllm.config import DeviceConfig, SchedulerConfig, SpeculativeConfig, VllmConfig  # noqa: E402
from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers  # noqa: E402

from hqlab.config import ConfigError, DecodeConfig, LookupConfig  # noqa: E402
from hqlab.engines.vllm import gpu_lookup, plugin  # noqa: E402
from hqlab.bench.vllm import frames_from_raw  # noqa: E402
from hqlab.bench.vllm_runs import Run, raw_table, runs_from_raw  # noqa: E402
from hqlab.engines.vllm.engine import StepEvent, setting_for, step_records  # noqa: E402
from hqlab.engines.vllm.gpu_lookup import RECORD_CAPACITY, GpuLookupSpeculator  # noqa: E402
from hqlab.rules.lookup import suffix_match  # noqa: E402
from hqlab.trace import Generation  # noqa: E402

SLOTS, WIDTH, VOCAB = 8, 2048, 151936
DOC = "data/documents/handbook.md"


def vllm_config(spec: str | None, *, async_scheduling: bool | None = None, method: str = "custom_class",
                model: str | None = gpu_lookup.CLASS_PATH, k: int = 7, stand_in: bool = True) -> VllmConfig:
    """A real VllmConfig on the CPU (ModelConfig needs a GPU platform: the fields the speculator reads stand in)."""
    config = VllmConfig(device_config=DeviceConfig(device="cpu"),
                        speculative_config=SpeculativeConfig(method=method, model=model, num_speculative_tokens=k),
                        scheduler_config=SchedulerConfig(max_num_seqs=SLOTS, max_model_len=WIDTH,
                                                         is_encoder_decoder=False, async_scheduling=async_scheduling),
                        additional_config={} if spec is None else {gpu_lookup.SPEC_KEY: spec,
                                                                   gpu_lookup.RECORD_KEY: True})
    if stand_in:
        object.__setattr__(config, "model_config", SimpleNamespace(max_model_len=WIDTH, get_vocab_size=lambda: VOCAB))
    return config


def vllm_rows(histories: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's request state: one int32 row per slot (garbage past the history, as in a reused slot)."""
    rng = np.random.default_rng(1)
    tokens = torch.from_numpy(rng.integers(0, 50, size=(SLOTS, WIDTH)).astype(np.int32))
    lengths = torch.zeros(SLOTS, dtype=torch.int32)
    for slot, h in enumerate(histories):
        tokens[slot, : len(h)] = torch.from_numpy(h.astype(np.int32))
        lengths[slot] = len(h)
    return tokens.contiguous(), lengths


def real_histories() -> list[np.ndarray]:
    """Workload text with real repetition, one token per byte, cut at different lengths; plus edge cases."""
    from pathlib import Path

    text = np.frombuffer((Path(__file__).resolve().parents[3] / DOC).read_bytes()[:12000], dtype=np.uint8)
    cuts = [WIDTH, 1500, 700, 64, 9]
    out = [text[i * 900: i * 900 + n].astype(np.int32) for i, n in enumerate(cuts)]
    out.append(np.tile(np.array([5, 6, 7], dtype=np.int32), 40))  # a period-3 repetition
    out.append(np.array([3], dtype=np.int32))  # one token: no candidate end
    out.append(np.array([], dtype=np.int32))  # an empty slot
    return out


def batch(rows: list[int]) -> InputBatch:
    """vLLM's own InputBatch for these slots (the runner's order, not slot order)."""
    made = InputBatch.make_dummy(len(rows), len(rows), InputBuffers(SLOTS, 64, torch.device("cpu")))
    return dataclasses.replace(made, idx_mapping=torch.tensor(rows, dtype=torch.int32),
                               idx_mapping_np=np.array(rows, dtype=np.int32), req_ids=[f"r{s}-x" for s in rows])


@pytest.mark.parametrize("spec", ["gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest", "gpu-lookup:nmin=6,nmax=12,k=7",
                                  "gpu-lookup:nmin=2,nmax=4,k=5,full=true", "gpu-lookup:nmin=3,nmax=8,k=9,search=300"])
def test_drafts_equal_the_reference_rule_on_vllm_shaped_state(spec):
    config = gpu_lookup.lookup_config(spec)
    speculator = GpuLookupSpeculator(vllm_config(spec, k=config.k), device="cpu")
    histories = real_histories()
    tokens, lengths = vllm_rows(histories)
    speculator.bind(tokens, lengths)
    rows = [3, 0, 6, 1, 7, 4, 2, 5]
    drafts = speculator.propose(batch(rows))
    assert drafts.dtype == torch.int64 and tuple(drafts.shape) == (len(rows), config.k)
    records = {r["request"]: r for r in speculator.take_records()}
    for i, slot in enumerate(rows):
        want = suffix_match(histories[slot], nmin=config.nmin, nmax=config.nmax, k=config.k, search=config.search,
                            policy=config.policy, full=config.full)
        got = drafts[i].tolist()
        assert got[: want.valid] == want.tokens.tolist(), (spec, slot)
        assert got[want.valid:] == [speculator.pad] * (config.k - want.valid)  # the rest is rejected padding
        rec = records[f"r{slot}-x"]
        assert (rec["context_len"], rec["match_len"], rec["tokens"]) == (len(histories[slot]), want.match_len,
                                                                         want.tokens.tolist())
    assert any(r["match_len"] > 0 for r in records.values())  # the workload text does repeat


def test_dummy_runs_and_an_unbound_speculator_draft_nothing():
    speculator = GpuLookupSpeculator(vllm_config("gpu-lookup:k=4", k=4), device="cpu")
    assert speculator.propose(batch([0, 1]), dummy_run=True).shape == (2, 4)
    assert speculator.propose(batch([0, 1])).shape == (2, 4)  # vLLM's warm-up runs come before load_model
    assert speculator.take_records() == [] and speculator.draft_logits is None


def test_records_are_taken_once_and_overflow_is_an_error():
    speculator = GpuLookupSpeculator.standalone(LookupConfig(nmin=1, nmax=4, k=3), max_num_reqs=2,
                                                max_model_len=64, pad=9, device="cpu", record=True)
    h = np.array([1, 2, 3, 1, 2], dtype=np.int32)
    tokens = torch.zeros(2, 64, dtype=torch.int32)
    tokens[0, :5] = torch.from_numpy(h)
    speculator.bind(tokens, torch.tensor([5, 0], dtype=torch.int32))
    out = speculator.lookup(torch.tensor([0], dtype=torch.int32), 1)
    speculator.recorder.note(["a"], 0.0)
    assert out.tolist() == [[3, 1, 2]]  # after "1 2" came "3 1 2"
    assert [r["tokens"] for r in speculator.take_records()] == [[3, 1, 2]] and speculator.take_records() == []
    for _ in range(RECORD_CAPACITY + 1):
        speculator.recorder.note(["a"], 0.0)
    with pytest.raises(RuntimeError, match="take them more often"):
        speculator.take_records()


def test_bad_configs_are_clear_errors():
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        GpuLookupSpeculator(vllm_config("gpu-lookup:k=8", k=4), device="cpu")
    with pytest.raises(ConfigError, match="nmin must be <= nmax"):
        setting_for("gpu-lookup:nmin=9,nmax=3")
    with pytest.raises(ConfigError, match="V1 custom_class proposer"):  # vLLM's V1 runner builds it with no device
        GpuLookupSpeculator(vllm_config("gpu-lookup:k=4", k=4))
    with pytest.raises(ConfigError, match="not a gpu-lookup spec"):
        gpu_lookup.lookup_config("pld:n=3")


def test_plugin_moves_only_hqlab_speculators_to_v2_and_async_scheduling():
    plugin.register()
    plugin.register()  # idempotent: vLLM loads plugins in every process, sometimes twice
    assert getattr(VllmConfig.__post_init__, "_hqlab_patched", False)
    assert not getattr(VllmConfig.__post_init__.__wrapped__, "_hqlab_patched", False)  # wrapped once
    ours = vllm_config("gpu-lookup:nmin=1,nmax=32,k=7", k=7, stand_in=False)
    assert ours.scheduler_config.async_scheduling is True
    assert not any("custom_class" in f for f in ours._get_v2_model_runner_unsupported_features())
    asked = vllm_config("gpu-lookup:k=7", k=7, async_scheduling=True)  # vLLM alone would refuse this
    assert asked.scheduler_config.async_scheduling is True
    off = vllm_config("gpu-lookup:k=7", k=7, async_scheduling=False)  # the user's choice stands
    assert off.scheduler_config.async_scheduling is False
    other = vllm_config(None, model="some.other.Proposer", k=7, stand_in=False)  # another custom_class: vLLM's own decisions
    assert other.scheduler_config.async_scheduling is False
    assert "speculative method 'custom_class'" in other._get_v2_model_runner_unsupported_features()
    ngram = vllm_config(None, method="ngram", model=None, k=7, stand_in=False)
    assert "ngram/ngram_gpu speculative decoding" in ngram._get_v2_model_runner_unsupported_features()


def test_plugin_refuses_other_vllm_versions(monkeypatch, caplog):
    with pytest.raises(ConfigError, match="built for vLLM 0.26.0 and refuse vLLM 0.27.1"):
        plugin.check_vllm_version("0.27.1")
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.27.1")
    with caplog.at_level(logging.WARNING, logger="hqlab.vllm"):
        plugin.register()
    assert "plugin inactive" in caplog.text
    with pytest.raises(ConfigError, match="refuse vLLM 0.27.1"):
        plugin.check_vllm_version()


def test_the_entry_point_vllm_loads_is_the_plugin():
    from importlib.metadata import entry_points

    found = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert found.get("hqlab") == "hqlab.engines.vllm.plugin:register"


def test_settings_for_the_gpu_path_and_vllms_gpu_ngram():
    gpu = setting_for("gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest")
    assert gpu.gpu and gpu.fixed_width and gpu.uses_adapter and gpu.k == 15
    assert gpu.speculative_config == {"method": "custom_class", "model": gpu_lookup.CLASS_PATH,
                                      "num_speculative_tokens": 15}
    ngram_gpu = setting_for("vllm-ngram-gpu:nmin=2,nmax=5,k=7")
    assert ngram_gpu.speculative_config == {"method": "ngram_gpu", "num_speculative_tokens": 7,
                                            "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    assert not ngram_gpu.gpu and not ngram_gpu.fixed_width


def test_vllm_draft_is_vllms_own_draft_model_with_the_drafter_made_a_folder(monkeypatch):
    """`vllm-draft:model=..,k=..` (the fused drafter's baseline) asks vLLM for its own draft_model method; the
    engine makes the drafter's name a folder vLLM can load (hqlab.models.prepare) before vLLM sees it."""
    from vllm.v1.engine.llm_engine import LLMEngine

    from hqlab import models
    from hqlab.engines.vllm.engine import VLLMEngine, VLLMOptions

    draft = setting_for("vllm-draft:model=qwen2.5-coder-0.5b,k=7")
    assert draft.speculative_config == {"method": "draft_model", "num_speculative_tokens": 7}
    assert draft.draft_model == "qwen2.5-coder-0.5b" and draft.k == 7
    assert not draft.gpu and not draft.uses_adapter and not draft.fixed_width
    assert setting_for("vllm-draft").k == 7  # the draft proposer's defaults: the 0.5B, k = 7
    for bad, why in [("vllm-draft:k=0", "k must be >= 1"), ("vllm-draft:temperature=0.5", "takes only model and k"),
                     ("vllm-draft:vocab=x", "takes only model and k"), ("vllm-draft:nmin=2", "nmin")]:
        with pytest.raises(ConfigError, match=why):
            setting_for(bad)
    seen = {}

    def capture(args, **kwargs):  # vLLM needs a GPU from here on: keep what it was asked for
        seen["speculative"] = args.speculative_config
        raise RuntimeError("stop before vLLM starts")

    monkeypatch.setattr(LLMEngine, "from_engine_args", staticmethod(capture))
    with pytest.raises(RuntimeError, match="stop before"):
        VLLMEngine(VLLMOptions(model="target-folder"), draft)
    assert seen["speculative"] == {"method": "draft_model", "num_speculative_tokens": 7,
                                   "model": models.prepare("qwen2.5-coder-0.5b")}


def test_fixed_width_steps_count_what_was_emitted_and_verified():
    events = [StepEvent(0.010, 1, 0, 0), StepEvent(0.012, 4, 7, 3), StepEvent(0.014, 1, 7, 0),
              StepEvent(0.016, 1, 7, 5)]  # vLLM's counters lag a step under async scheduling: ignored here
    made = [{"context_len": 101, "tokens": [5, 6, 7], "sources": [1, 1, 1], "match_len": 4, "propose_s": 1e-4,
             "batch": 1},
            {"context_len": 105, "tokens": [], "sources": [], "match_len": 0, "propose_s": 1e-4, "batch": 1,
             "drafter_passes": 0, "drafter_width": 0}]  # gpu-fused's records say how much of its drafter ran
    ttft, records = step_records("p", 100, events, k=7, adapter=made, fixed_width=True)
    assert ttft == 0.010
    assert [r.verify_len for r in records] == [8, 8, 8]  # k + 1 positions verified every step
    assert [r.accepted for r in records] == [3, 0, 0] and [r.emitted for r in records] == [4, 1, 1]
    assert records[0].proposed == [5, 6, 7] and records[1].proposed == [] and records[2].proposed == []
    assert records[2].match_len == 0 and math.isnan(records[2].propose_s)  # no record for that history length
    assert [r.drafter_passes for r in records] == [-1, 0, -1]  # -1: not recorded (the lookup's, or none at all)


def _gen(ids, records=(), margins=(), total=1.0):
    return Generation(request="p", prompt_len=10, output_ids=list(ids), finish="length", ttft_s=0.01, total_s=total,
                      t_last=total, records=list(records), margins=list(margins))


def test_concurrent_runs_round_trip_and_become_rows_with_throughput_and_step_efficiency():
    from hqlab.trace import StepRecord

    def rec(acc):
        return StepRecord("p", 0, 10, 8, [1] * acc, [1] * acc, 3, acc, acc + 1, 0.01, 1e-4, 0.5, 7, 1)

    ref = _gen([1, 2, 3, 4], margins=[2.0, 2.0, 2.0, 2.0])
    runs = [Run("none", "a", "chat", -1, ref), Run("none", "a", "chat", 0, _gen([1, 2, 3, 4], [rec(0)] * 4, total=2.0)),
            Run("gpu-lookup:k=7", "a", "chat", 0, _gen([1, 2, 3, 4], [rec(3)], total=1.0)),
            Run("none", "a", "chat", 0, _gen([1, 2, 3, 4]), 2, 0.5), Run("none", "b", "chat", 0, _gen([7, 8]), 2, 0.5),
            Run("gpu-lookup:k=7", "a", "chat", 0, _gen([1, 2, 3, 9]), 2, 0.25),
            Run("gpu-lookup:k=7", "b", "chat", 0, _gen([7, 8]), 2, 0.25)]
    back = runs_from_raw(raw_table(runs))
    assert [(r.concurrency, r.batch_wall_s) for r in back][3:] == [(2, 0.5), (2, 0.5), (2, 0.25), (2, 0.25)]
    results, _ = frames_from_raw(back, DecodeConfig(max_new_tokens=4), {"dtype": "bfloat16"})
    alone = results.filter(results["concurrency"] == 1)
    assert alone["config"].to_list() == ["none", "gpu-lookup:k=7"]
    eff = alone.filter(alone["config"] == "gpu-lookup:k=7")["step_efficiency"][0]
    # decode speedup over none / tokens per step: the speculative step's cost relative to a plain step
    assert eff == pytest.approx(alone.filter(alone["config"] == "gpu-lookup:k=7")["speedup_decode"][0] / 4.0)
    together = results.filter(results["concurrency"] == 2).sort("config", "prompt_id")
    assert together["batch_tok_s"].to_list() == [24.0, 24.0, 12.0, 12.0]  # 6 tokens / wall
    # checked against the batch-1 reference, where there is one
    assert together["divergence"].to_list() == ["mismatch", None, "identical", None]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_drafting_equals_eager_drafting_on_the_gpu():
    histories = real_histories()
    tokens, lengths = vllm_rows(histories)
    config = LookupConfig(nmin=1, nmax=32, k=15, policy="earliest")

    def build(graphs: bool) -> GpuLookupSpeculator:
        s = GpuLookupSpeculator.standalone(config, max_num_reqs=SLOTS, max_model_len=WIDTH, pad=VOCAB - 1,
                                           device="cuda", record=True)
        s.bind(tokens.cuda(), lengths.cuda())
        s.use_graphs = graphs
        s.capture()
        return s

    eager, graphed = build(False), build(True)
    assert len(graphed.graphs) == SLOTS and not eager.graphs
    for rows in ([3, 0, 6], [7], [0, 1, 2, 3, 4, 5, 6, 7], [5, 2]):
        idx = torch.tensor(rows, dtype=torch.int32, device="cuda")
        want = eager.lookup(idx, len(rows)).clone()
        got = graphed.lookup(idx, len(rows))
        for s in (eager, graphed):
            s.recorder.note([f"r{r}" for r in rows], 0.0)
        assert torch.equal(got, want), rows
    assert graphed.take_records() == eager.take_records()


@pytest.mark.parametrize("retired", ["width=stale", "width=fixed", "min_valid=3"])
def test_the_retired_width_settings_are_refused_with_where_to_read_why(retired):
    """width=stale (with min_valid) was measured slower than the fixed width and removed with the vLLM scheduler
    patches it needed: a spec naming either key fails before an engine starts, says why and what to do instead."""
    assert gpu_lookup.lookup_config("gpu-lookup:nmin=2,nmax=8,k=6").k == 6
    with pytest.raises(ConfigError, match=r"gpu-lookup: '(width|min_valid)' was retired \(.*slower than the fixed "
                                          r"width.*\); drop it: every request verifies the same width.*docs/journal/"):
        gpu_lookup.lookup_config(f"gpu-lookup:nmin=2,nmax=8,k=6,{retired}")
    with pytest.raises(ConfigError, match="was retired"):
        setting_for(f"gpu-lookup:k=6,{retired}")


def test_several_workers_tensor_parallel_options_and_one_ranks_records():
    from hqlab.engines.vllm.engine import VLLMOptions, records_from_workers

    assert VLLMOptions(model="m", tensor_parallel_size=2).tensor_parallel_size == 2
    with pytest.raises(ConfigError, match="tensor_parallel_size and pipeline_parallel_size must be >= 1"):
        VLLMOptions(model="m", tensor_parallel_size=0)
    from hqlab.bench.vllm import bench_suite

    with pytest.raises(ConfigError, match="do not support pipeline parallelism"):  # refused before any model
        bench_suite("qwen2.5-coder-0.5b", "copy", ["gpu-lookup:k=4"], DecodeConfig(), doc_tokens=100,
                    pipeline_parallel_size=2)
    # two tensor-parallel ranks run the same speculator on the same histories: identical records, kept once
    speculators = []
    for _ in range(2):
        s = GpuLookupSpeculator(vllm_config("gpu-lookup:nmin=1,nmax=8,k=4", k=4), device="cpu")
        s.bind(*vllm_rows(real_histories()))
        s.propose(batch([0, 5]))
        speculators.append(s)
    per_worker = [s.take_records() for s in speculators]
    drafted = [[{k: v for k, v in r.items() if k != "propose_s"} for r in w] for w in per_worker]  # not the timing
    assert drafted[0] == drafted[1] and len(drafted[0]) == 2
    assert records_from_workers(per_worker) == per_worker[0]
    assert records_from_workers([[], per_worker[1]]) == per_worker[1]  # a pipeline stage that drafts nothing
    assert records_from_workers([]) == []
