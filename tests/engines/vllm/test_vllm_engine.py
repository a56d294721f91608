"""The vLLM engine's configs and bookkeeping (hqlab.engines.vllm), everything but the GPU run itself: specs to
vLLM's speculative configs, step records from vLLM's counters and the adapter's records, and the command's checks
before anything loads. Skipped where vLLM is not installed."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed (make setup-vllm installs requirements-vllm.txt)")

from vllm.config import SpeculativeConfig  # noqa: E402

from hqlab.config import ConfigError  # noqa: E402
from hqlab.engines.vllm import adapter as vllm_proposer  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


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


def test_interleaved_runs_visit_every_engine_once_per_prompt_and_check_their_limits_before_starting():
    """benchmarks/vllm_gpu.py --interleave: each prompt runs on every engine before the next prompt, the engine that
    goes first rotates, each round runs every load, and impossible settings fail before an engine starts (no GPU is
    touched)."""
    from hqlab.config import DecodeConfig
    from hqlab.bench.vllm_runs import interleaved_order, round_plan, run_interleaved
    from hqlab.engines.vllm import VLLMOptions, settings_for

    order = interleaved_order(3, 4)
    assert [i for i, _ in order] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert all(sorted(e for i, e in order if i == item) == [0, 1, 2] for item in range(4))
    assert [e for i, e in order if order.index((i, e)) % 3 == 0] == [0, 1, 2, 0]  # who goes first rotates
    # each round runs every load before the next round: a call cut short keeps as many bursts as rounds alone
    assert round_plan(3, burst=True) == [(0, "alone"), (0, "burst"), (1, "alone"), (1, "burst"), (2, "alone"),
                                         (2, "burst")]
    assert round_plan(2, burst=True, sustained=True) == [(0, "alone"), (0, "burst"), (0, "sustained"),
                                                         (1, "alone"), (1, "burst"), (1, "sustained")]
    assert round_plan(2) == [(0, "alone"), (1, "alone")]
    options = VLLMOptions(model="unused", gpu_memory_utilization=0.5)
    settings = settings_for(["lookup:k=7"])
    with pytest.raises(ConfigError, match="sustained load needs concurrency >= 2"):
        run_interleaved(options, settings, [], DecodeConfig(), sustained=True, concurrency=0)
    with pytest.raises(ConfigError, match="12 engines at once leave each 0.042"):
        run_interleaved(options, settings * 6, [], DecodeConfig())
    with pytest.raises(ConfigError, match="gpu_memory_utilization must be in"):
        VLLMOptions(model="unused", gpu_memory_utilization=0.99)


def test_cudagraph_mode_reaches_vllms_compilation_config_and_a_bad_one_is_refused():
    from vllm.config.compilation import CUDAGraphMode

    from hqlab.engines.vllm import setting_for
    from hqlab.engines.vllm.engine import CUDAGRAPH_MODES, VLLMOptions, engine_args

    assert set(CUDAGRAPH_MODES) == {m.name for m in CUDAGraphMode}  # the names vLLM parses, no more
    setting = setting_for("gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest")
    full = engine_args(VLLMOptions(model="m", cudagraph_mode="FULL"), setting).compilation_config
    assert full.cudagraph_mode == CUDAGraphMode.FULL and full.max_cudagraph_capture_size == 1024
    # FULL by default (the served configs' mode, with hqlab's capture fix), but for vLLM's own draft model
    assert engine_args(VLLMOptions(model="m"), setting).compilation_config.cudagraph_mode == CUDAGraphMode.FULL
    assert engine_args(VLLMOptions(model="m"), setting_for("none")).compilation_config.cudagraph_mode == \
        CUDAGraphMode.FULL
    draft = setting_for("vllm-draft:model=qwen2.5-coder-0.5b,k=7")
    assert engine_args(VLLMOptions(model="m"), draft).compilation_config.cudagraph_mode is None  # vLLM decides
    assert engine_args(VLLMOptions(model="m", cudagraph_mode=""), setting).compilation_config.cudagraph_mode is None
    with pytest.raises(ConfigError, match="cudagraph_mode must be one of NONE, PIECEWISE, FULL"):
        VLLMOptions(model="m", cudagraph_mode="full")
