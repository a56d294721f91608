"""The fused speculator inside vLLM's GPU step, checked on the CPU against the lab's reference, step for step.

`GpuFusedSpeculator` runs the real Qwen2.5-Coder-0.5B drafter (`drafter.StaticQwen2`), the suffix-match kernel (in
the Triton interpreter) and the fusion/schedule rule on tensors, over histories laid out as vLLM's model runner V2
keeps them (one int32 row per request slot, a length per slot), driven the way the runner drives it: prompt chunks
(one request prefilled in two chunks), then decode steps whose emitted counts come from a deterministic target.
`hqlab.proposers.fused.FusedProposer` with the transformers drafter proposes for the same histories; every fused
block must be the same, token for token, with the pad token after it.

The GPU run (graphs, vLLM itself) is benchmarks/vllm_gpu.py; the config plumbing is tested here too.
"""

from __future__ import annotations

import itertools
import json
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="the vllm extra is not installed (make setup installs its CPU-side packages)")

from hqlab.config import ConfigError  # noqa: E402
from hqlab.engines.vllm import gpu_fused, plugin  # noqa: E402
from hqlab.engines.vllm.engine import setting_for  # noqa: E402
from hqlab.engines.vllm.drafter_flags import WIDE_STEPS  # noqa: E402
from hqlab.engines.vllm.drafter_prompts import PREFILL_ROWS  # noqa: E402
from hqlab.engines.vllm.gpu_fused import GpuFusedSpeculator, fused_config  # noqa: E402
from hqlab.proposers.fused import FusedConfig, FusedProposer  # noqa: E402
from hqlab.rules.fusion import SOURCE_DRAFT, SOURCE_LOOKUP  # noqa: E402

SLOTS, WIDTH, VOCAB = 4, 1024, 151936
DOC = Path(__file__).resolve().parents[3] / "data/documents/handbook.md"
SPEC = "gpu-fused:k=15,draft_block=7,nmax=32,policy=earliest"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from hqlab import models

    return AutoTokenizer.from_pretrained(models.prepare("qwen2.5-coder-0.5b"))


def requests(tok) -> dict[str, tuple[list[int], list[int], int]]:
    """request id -> (prompt, the target's output, prefill chunk). "copy" repeats a passage of its prompt (long
    blocks); "prose" continues with text of its own (the drafter's head decides); it is prefilled in two chunks."""
    text = DOC.read_text()
    passage = tok(text[2000:2400]).input_ids
    copy_prompt = tok("Repeat this passage exactly:\n").input_ids + passage + tok("\nRepeated:\n").input_ids
    prose = tok(text[6000:6500]).input_ids
    return {"copy": (copy_prompt, passage[:60], len(copy_prompt)),
            "prose": (prose[:100], prose[100:160], 64)}


def verified(drafts: list[int], target: list[int], done: int) -> list[int]:
    """What a greedy target emits after `done` tokens of `target` when it verifies `drafts`: the longest agreeing
    prefix, then its own next token."""
    accepted = 0
    for d, t in zip(drafts, target[done:]):
        if d != t:
            break
        accepted += 1
    return target[done:done + accepted + 1]


# tests/conftest.py turns Triton's interpreter on only without a GPU
INTERPRETER_ONLY = ("runs the suffix-match kernel in Triton's interpreter on CPU tensors; on a GPU the captured-graph "
                    "test and the bench's replay check compare the same blocks")


@pytest.mark.skipif(torch.cuda.is_available(), reason=INTERPRETER_ONLY)
@pytest.mark.parametrize("settings", ["draft_block=3", "draft_block=1,schedule=long,nmin_tail=1,device_skip=true"],
                         ids=["every-step", "one-pass-long-block-device-skip"])
def test_fused_blocks_equal_the_reference_step_for_step(tokenizer, settings):
    # a short head (at most 3 drafter passes per step) keeps the two 0.5B drafters' CPU time to about a minute
    from hqlab import models
    from hqlab.engines.vllm.drafter import StaticQwen2

    config = fused_config(f"gpu-fused:k=7,nmax=32,policy=earliest,{settings}")
    spec = GpuFusedSpeculator.standalone(config, max_num_reqs=SLOTS, max_model_len=WIDTH, pad=VOCAB - 1,
                                         device="cpu", dtype=torch.float32, record=True)
    rules = {f: getattr(config, f) for f in FusedConfig.__dataclass_fields__}
    reference = FusedProposer(FusedConfig(**{**rules, "dtype": "float32", "device": "cpu"}))
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(0, 1000, size=(SLOTS, WIDTH)).astype(np.int32))  # reused-slot garbage
    total = torch.zeros(SLOTS, dtype=torch.int32)
    spec.bind(ids, total)
    # the real drafter on its torch reference paths (the Triton ones would run in the interpreter for minutes)
    spec.attach_drafter(StaticQwen2.load(models.prepare(config.model), slots=SLOTS, max_len=spec.cache_len,
                                         dtype=torch.float32))

    reqs = requests(tokenizer)
    slot_of = {"copy": 2, "prose": 0}
    state = {}
    for rid, (prompt, _, _) in reqs.items():
        s = slot_of[rid]
        ids[s, :len(prompt)] = torch.tensor(prompt, dtype=torch.int32)
        total[s] = len(prompt)
        state[rid] = {"computed": 0, "out": [], "drafts": None}

    compared, sources = 0, []
    for _ in range(8):
        rows = [r for r in reqs if len(state[r]["out"]) < len(reqs[r][1]) - 1]
        if not rows:
            break
        num_sampled, prefilling, computed_prefill, scheduled, prefill_len, computed = [], [], [], [], [], []
        for rid in rows:
            prompt, target, chunk = reqs[rid]
            st, s = state[rid], slot_of[rid]
            prefill_len.append(len(prompt))
            computed.append(st["computed"])
            if st["computed"] < len(prompt):  # a prompt chunk; the last one samples the first output token
                prefilling.append(True)
                computed_prefill.append(st["computed"])
                n = min(chunk, len(prompt) - st["computed"])
                scheduled.append(n)
                st["computed"] += n
                emitted = [target[0]] if st["computed"] == len(prompt) else []
            else:  # verify last step's drafts against the target's output: the longest agreeing prefix + 1
                prefilling.append(False)
                computed_prefill.append(len(prompt))
                scheduled.append(1 + config.k)
                emitted = verified(st["drafts"], target, len(st["out"]))
                st["computed"] += len(emitted)
            start = len(prompt) + len(st["out"])
            ids[s, start:start + len(emitted)] = torch.tensor(emitted, dtype=torch.int32)
            total[s] = start + len(emitted)
            st["out"] += emitted
            num_sampled.append(len(emitted))
        slots = [slot_of[r] for r in rows]
        out = spec.step(rows, torch.tensor(slots, dtype=torch.int32), np.array(slots, dtype=np.int32),
                        torch.tensor(num_sampled, dtype=torch.int32), np.array(prefilling),
                        np.array(computed_prefill), np.array(scheduled), np.array(prefill_len), np.array(computed))
        sampling = [i for i, n in enumerate(num_sampled) if n > 0]
        histories = [ids[slots[i], :int(total[slots[i]])].numpy().astype(np.int64) for i in sampling]
        want = reference.propose(histories, [config.k] * len(sampling), keys=[rows[i] for i in sampling])
        for i, w in zip(sampling, want):
            got = out[i].tolist()
            n = len(w.tokens)
            assert got[:n] == w.tokens.tolist(), (rows[i], len(state[rows[i]]["out"]))
            assert got[n:] == [VOCAB - 1] * (config.k - n)
            state[rows[i]]["drafts"] = got
            compared += 1
            sources += w.sources.tolist()
    records = spec.take_records()
    assert compared >= 8 and SOURCE_DRAFT in sources and SOURCE_LOOKUP in sources  # both proposers exercised
    assert any(r["block"] == config.k for r in records)  # the copy request reached the long block
    assert state["copy"]["computed"] > len(reqs["copy"][0]) + 25  # and its long blocks were accepted
    # the drafter's own tokens, head first, as the replay takes them: draft_block of them on a step that ran the
    # drafter, none on a step without it, and the block's token wherever the block took the drafter's
    for r in records:
        assert len(r["drafter_tokens"]) == (config.draft_block if r["drafter_passes"] > 0 else 0), r
        for i, (token, source) in enumerate(zip(r["tokens"], r["sources"])):
            if source == SOURCE_DRAFT:
                assert token == r["drafter_tokens"][i], r


def test_spec_and_engine_setting():
    config = fused_config(SPEC)
    assert (config.k, config.draft_block, config.nmax) == (15, 7, 32)
    assert gpu_fused.speculative_config(SPEC) == {"method": "custom_class", "model": gpu_fused.CLASS_PATH,
                                                  "num_speculative_tokens": 15}
    setting = setting_for(SPEC)
    assert setting.gpu and setting.fixed_width and setting.k == 15
    assert setting.additional_config["hqlab_proposer"] == SPEC
    with pytest.raises(ConfigError, match="draft_block must be <= k"):
        fused_config("gpu-fused:k=5,draft_block=7")
    with pytest.raises(ConfigError, match="temperature"):
        fused_config("gpu-fused:temperature=0.5")
    with pytest.raises(ConfigError, match="vocab"):
        fused_config("gpu-fused:vocab=some.json")
    for key, value in (("dtype", "float32"), ("device", "cpu")):  # the target's, inside vLLM
        with pytest.raises(ConfigError, match=f"the drafter runs on the target's {key}|in the target's {key}"):
            fused_config(f"gpu-fused:{key}={value}")
    # how many prompt tokens the drafter reads per call: a host-side setting, not a rule of the lab's proposer
    assert fused_config("gpu-fused:prefill_chunk=2048").prefill_chunk == 2048
    assert fused_config("gpu-fused:k=7").prefill_chunk == gpu_fused.PREFILL_CHUNK
    with pytest.raises(ConfigError, match="prefill_chunk must be >= 1"):
        fused_config("gpu-fused:prefill_chunk=0")


SERVED = ("gpu-fused:k=15,draft_block=1,nmax=32,policy=earliest,compile=true,schedule=long,nmin_tail=1,"
          "compile_rule=true,device_skip=true,layers=triton,attention=triton,batch_k=1:15/4:7/0,prefill_graph=1024")


@pytest.mark.parametrize("key, value, instead", [
    ("skip", "2", "device_skip=true"), ("skip_on", "head", "device_skip=true"), ("nmin_alone", "1", "drop it"),
    ("catch_up", "bounded", "reads what it missed at the next step that needs its token"),
    ("graphs", "false", "enforce_eager"), ("layers", "torch", "Triton layers"),
    ("attention", "auto", "Triton attention"), ("attention", "sdpa", "Triton attention"), ("splits", "1", "drop it"), ("plan_once", "true", "drop it"),
    ("compile_mode", "max-autotune-no-cudagraphs", "compile=true")])
def test_retired_settings_are_refused_saying_why_and_what_to_use_instead(key, value, instead):
    """The host-proven skip, the bounded catch-up, the eager drafting step, the torch drafting passes and the
    FlashAttention settings were retired: a spec naming one fails before an engine starts, says why it went and what
    to use instead; the same spec without it is fine."""
    spec = "gpu-fused:k=15,draft_block=1,nmax=32"
    assert fused_config(spec).k == 15
    with pytest.raises(ConfigError, match=rf"gpu-fused: '{key}' was retired \(.+\); .*{instead}.*docs/journal/"):
        fused_config(f"{spec},{key}={value}")
    with pytest.raises(ConfigError, match=f"'{key}' was retired"):
        setting_for(f"{spec},{key}={value}")


def test_the_served_spec_parses_and_keys_naming_what_always_runs_are_accepted():
    """The served spec names layers=triton and attention=triton, which now always run: accepted, as are skip=0,
    nmin_alone=0, catch_up=lazy and graphs=true, each giving the config without the key."""
    served = fused_config(SERVED)
    assert (served.k, served.draft_block, served.device_skip, served.batch_k, served.prefill_graph) == (
        15, 1, True, "1:15/4:7/0", 1024)
    assert served == fused_config(SERVED.replace(",layers=triton,attention=triton", ""))
    base = "gpu-fused:k=15,draft_block=1,nmax=32"
    for kept in ("skip=0", "nmin_alone=0", "catch_up=lazy", "graphs=true", "layers=triton", "attention=triton"):
        assert fused_config(f"{base},{kept}") == fused_config(base), kept
    assert gpu_fused.speculative_config(SERVED)["num_speculative_tokens_per_batch_size"][-1][-1] == 0
    with pytest.raises(ConfigError, match="'skip' was retired"):  # built directly, not parsed
        gpu_fused.GpuFusedConfig(k=15, draft_block=1, skip=2)


def test_recorded_runs_keep_their_rule_settings_whatever_retired_keys_they_name():
    """A recorded run's spec (results keep the spec as it ran) gives the lab proposer's settings for the replay,
    the host-proven skip included, though gpu-fused no longer parses it."""
    recorded = ("gpu-fused:k=15,draft_block=1,nmax=32,policy=earliest,compile=true,schedule=long,nmin_tail=1,skip=2,"
                "skip_on=head,nmin_alone=1,compile_rule=true,catch_up=bounded,layers=torch")
    rules = gpu_fused.recorded_rules(recorded)
    assert (rules.k, rules.skip, rules.skip_on, rules.nmin_alone, rules.schedule) == (15, 2, "head", 1, "long")
    with pytest.raises(ConfigError, match="'skip' was retired"):
        fused_config(recorded)


def test_the_plugin_puts_gpu_fused_on_model_runner_v2_with_async_scheduling():
    from vllm.config import DeviceConfig, SchedulerConfig, SpeculativeConfig, VllmConfig

    plugin.register()
    config = VllmConfig(device_config=DeviceConfig(device="cpu"),
                        speculative_config=SpeculativeConfig(method="custom_class", model=gpu_fused.CLASS_PATH,
                                                             num_speculative_tokens=15),
                        scheduler_config=SchedulerConfig(max_num_seqs=SLOTS, max_model_len=WIDTH,
                                                         is_encoder_decoder=False),
                        additional_config={"hqlab_proposer": SPEC})
    assert not any("custom_class" in f for f in config._get_v2_model_runner_unsupported_features())
    object.__setattr__(config, "model_config", SimpleNamespace(max_model_len=WIDTH, get_vocab_size=lambda: VOCAB))
    assert plugin._ours(config)
    assert config.scheduler_config.async_scheduling  # the plugin's __post_init__ turned it on, as for gpu-lookup


def test_attention_buckets_cover_every_length():
    buckets = gpu_fused.attention_buckets(1046)
    assert buckets == [512, 1024, 1046]
    assert gpu_fused.attention_buckets(300) == [300]


def test_a_burst_can_mix_named_categories_and_ids():
    from hqlab.bench.vllm_runs import burst_group

    prompts = [("copy", "copy", [1]), ("qa", "qa", [2]), ("chat-a", "chat", [3]), ("chat-b", "chat", [4])]
    assert burst_group(prompts, 2) == prompts[:2]  # default: the suite's first prompts
    assert [p[0] for p in burst_group(prompts, 0, ["copy", "chat", "chat", "qa"])] == ["copy", "chat-a", "chat-b",
                                                                                        "qa"]
    assert [p[0] for p in burst_group(prompts, 2, ["chat-b", "chat"])] == ["chat-b", "chat-a"]
    with pytest.raises(ConfigError, match="no prompt id or category 'chat'"):
        burst_group(prompts, 0, ["chat", "chat", "chat"])
    with pytest.raises(ConfigError, match="not concurrency=4"):
        burst_group(prompts, 4, ["copy", "qa"])


# Where the drafter's Triton kernels run: the GPU where there is one, else the CPU under Triton's interpreter (which
# tests/conftest.py turns on only on machines without a GPU)
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_a_drafter_with_another_vocabulary_is_refused():
    from vllm.config import DeviceConfig, SchedulerConfig, SpeculativeConfig, VllmConfig

    config = VllmConfig(device_config=DeviceConfig(device="cpu"),
                        speculative_config=SpeculativeConfig(method="custom_class", model=gpu_fused.CLASS_PATH,
                                                             num_speculative_tokens=15),
                        scheduler_config=SchedulerConfig(max_num_seqs=2, max_model_len=256,
                                                         is_encoder_decoder=False),
                        additional_config={"hqlab_proposer": SPEC})
    object.__setattr__(config, "model_config", SimpleNamespace(max_model_len=256, get_vocab_size=lambda: 32000,
                                                               dtype=torch.float32))
    speculator = GpuFusedSpeculator(config, device=KERNEL_DEVICE)
    with pytest.raises(ConfigError, match="vocabulary of 151936 rows and the target 32000"):
        speculator.load_drafter()
    assert speculator.drafter is None


def tiny_qwen2(slots: int, max_len: int, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
               attention: str = "auto", compile: bool = False, **options: Any) -> "StaticQwen2":
    """A 2-layer random-weight Qwen2 with head size 64 (what FlashAttention takes); the bookkeeping and the attention
    paths under test do not depend on the weights."""
    from hqlab.engines.vllm.drafter import StaticQwen2

    cfg, weights = tiny_qwen2_weights()
    return StaticQwen2(cfg, weights, slots=slots, max_len=max_len, device=device, dtype=dtype, attention=attention,
                       compile=compile, **options)


def tiny_qwen2_weights() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """tiny_qwen2's (config, weights), seeded: the same every call."""
    hidden, inter, vocab = 256, 384, 64
    cfg = {"hidden_size": hidden, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
           "intermediate_size": inter, "vocab_size": vocab, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    g = torch.Generator().manual_seed(0)
    weights = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g),
               "model.norm.weight": torch.ones(hidden), "lm_head.weight": torch.randn(vocab, hidden, generator=g)}
    for i in range(2):
        p = f"model.layers.{i}."
        for name, rows in (("self_attn.q_proj", hidden), ("self_attn.k_proj", 128), ("self_attn.v_proj", 128)):
            weights[p + name + ".weight"] = torch.randn(rows, hidden, generator=g) * 0.1
            weights[p + name + ".bias"] = torch.randn(rows, generator=g) * 0.1
        weights[p + "self_attn.o_proj.weight"] = torch.randn(hidden, hidden, generator=g) * 0.1
        weights[p + "mlp.gate_proj.weight"] = torch.randn(inter, hidden, generator=g) * 0.1
        weights[p + "mlp.up_proj.weight"] = torch.randn(inter, hidden, generator=g) * 0.1
        weights[p + "mlp.down_proj.weight"] = torch.randn(hidden, inter, generator=g) * 0.1
        weights[p + "input_layernorm.weight"] = torch.ones(hidden)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    return cfg, weights


def test_the_drafter_loads_with_its_drafting_passes_in_triton_kernels(tmp_path):
    """`load_drafter` builds the drafter with the Triton layers and attention of the drafting passes (their kernels:
    tests/kernels/test_drafter_layers.py and test_drafter_attention.py), whatever the spec: the torch paths are the
    tests' reference and the prompt chunks' path only. One graph per batch size then serves every length."""
    from safetensors.torch import save_file

    from hqlab_kernels import drafter_attention, drafter_layers

    cfg, weights = tiny_qwen2_weights()
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen2"}))
    save_file(weights, str(tmp_path / "model.safetensors"))
    for spec_text in ("gpu-fused:k=3,draft_block=2,nmax=4", "gpu-fused:k=3,draft_block=2,nmax=4,layers=triton"):
        speculator = GpuFusedSpeculator.standalone(fused_config(spec_text), max_num_reqs=2, max_model_len=600, pad=0,
                                                   device=KERNEL_DEVICE, dtype=torch.float32)
        assert len(speculator.buckets) > 1  # before a drafter: the masked path's ladder of lengths
        speculator.load_drafter(str(tmp_path))
        assert speculator.drafter.layer_kernels is drafter_layers
        assert speculator.drafter.attention_kernel is drafter_attention
        assert speculator.buckets == [speculator.cache_len]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's FlashAttention needs a CUDA device")
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_flash_and_masked_attention_agree_on_the_gpu_for_a_tiny_model(compile):
    """The paged FlashAttention path (vLLM's cache write and attention; torch.compile'd layers or not) against the
    eager masked-sdpa path (bf16, GPU): a prompt in chunks into two slots, a padded catch-up batch, single-token
    passes; hidden states close, greedy tokens equal."""
    flash = tiny_qwen2(3, 200, device="cuda", dtype=torch.bfloat16, attention="flash", compile=compile)
    assert flash.write_cache is not None  # vLLM's paged cache write, not the index_put fallback
    sdpa = tiny_qwen2(3, 200, device="cuda", dtype=torch.bfloat16, attention="sdpa")
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (3, 200), generator=g).cuda()
    t = lambda *x: torch.tensor(x, device="cuda")  # noqa: E731
    outs = []
    for d in (flash, sdpa):
        got = [d.hidden_states(t(2), ids[2:3, :37], t(0), 48), d.hidden_states(t(0), ids[0:1, :100], t(0), 112),
               d.hidden_states(t(2, 0), torch.stack([ids[2, 37:53], ids[0, 100:116]]), t(37, 100), 128)]
        tok = d.extend(t(2, 0), ids[[2, 0], 60:61], t(60, 116), t(0, 0), 128)
        for j in range(5):
            tok = d.extend(t(2, 0), tok[:, None], t(61 + j, 117 + j), t(0, 0), 128)
            got.append(tok)
        outs.append(got)
    for a, b in zip(*outs):
        if a.is_floating_point():
            assert (a.float() - b.float()).abs().max() < 0.05 * b.float().abs().max()
        else:
            assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host-device synchronisation exists on CUDA only")
def test_the_drafter_prefill_never_waits_for_the_gpu():
    """Feeding a prompt to the drafter (two chunks) queues its work without a host-device synchronisation: it runs
    in vLLM's step, and a wait there would hold the first token until the GPU drained its queue."""
    config = fused_config("gpu-fused:k=7,draft_block=2,nmax=8")
    spec = GpuFusedSpeculator.standalone(config, max_num_reqs=2, max_model_len=2 * gpu_fused.PREFILL_CHUNK + 64,
                                         pad=63, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 60, (2, spec.max_model_len), dtype=torch.int32, device="cuda")
    spec.bind(ids, torch.zeros(2, dtype=torch.int32, device="cuda"))
    spec.attach_drafter(tiny_qwen2(2, spec.cache_len, device="cuda", dtype=torch.bfloat16))
    spec.prompts.read("warm", 1, 40, done=True)  # first calls may allocate or compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        spec.prompts.read("a", 1, gpu_fused.PREFILL_CHUNK + 40, done=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert int(spec.dlen[1]) == gpu_fused.PREFILL_CHUNK + 40


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_the_captured_prompt_pass_reads_prompts_as_the_eager_calls_do_on_the_gpu():
    """`prefill_graph` on the GPU (float32, masked attention, a tiny random-weight drafter): prompts of 5 to 200
    tokens read by replaying the captured 64-position pass leave the drafter's next-token logits as the eager calls
    do, and the replays queue their work without a host-device synchronisation."""
    logits = {}
    for bound in (0, 256):
        config = fused_config(f"gpu-fused:k=7,draft_block=2,nmax=8,prefill_graph={bound}")
        spec = GpuFusedSpeculator.standalone(config, max_num_reqs=2, max_model_len=320, pad=63, device="cuda",
                                             dtype=torch.float32)
        ids = torch.randint(0, 60, (2, spec.max_model_len), dtype=torch.int32, device="cuda",
                            generator=torch.Generator("cuda").manual_seed(4))
        spec.bind(ids, torch.zeros(2, dtype=torch.int32, device="cuda"))
        spec.attach_drafter(tiny_qwen2(2, spec.cache_len, device="cuda", dtype=torch.float32, attention="sdpa"))
        spec.use_graphs = True
        spec.capture()
        assert (spec.prompts.graph is not None) == bool(bound)
        for length in (5, 64, 100, 200):
            spec.prompts.owner.pop(1, None)  # a new request in slot 1
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                spec.prompts.read(f"r{length}", 1, length, done=True)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            nxt = ids[1, length:length + 2].long()[None]
            logits[bound, length] = spec.drafter.logits(spec.index[1:2], nxt, spec.index[length:length + 1],
                                                        spec.index[1:2], spec.cache_len)
    for length in (5, 64, 100, 200):
        assert torch.allclose(logits[256, length], logits[0, length], atol=1e-4), length


def test_the_prefill_chunk_changes_the_calls_not_what_the_drafter_knows():
    """A prompt fed in chunks of 7 tokens or in one call leaves the drafter with the same cache: the same next-token
    logits (float32 on the CPU), in 6 calls against 1."""
    ids = torch.randint(0, 63, (1, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(2))
    logits, calls = [], []
    for chunk in (7, 1024):
        config = fused_config(f"gpu-fused:k=3,draft_block=2,nmax=4,prefill_chunk={chunk}")
        spec = GpuFusedSpeculator.standalone(config, max_num_reqs=1, max_model_len=64, pad=63, device="cpu",
                                             dtype=torch.float32)
        spec.bind(ids, torch.full((1,), 40, dtype=torch.int32))
        spec.attach_drafter(tiny_qwen2(1, spec.cache_len))  # seeded: the same weights for both
        feed, seen = spec.drafter.hidden_states, []

        def counted(*args, feed=feed, seen=seen, **kwargs):
            seen.append(args[1].shape[1])
            return feed(*args, **kwargs)

        spec.drafter.hidden_states = counted
        spec.prompts.read("a", 0, 40, done=True)
        calls.append(list(seen))  # (the logits below feed one more token)
        logits.append(spec.drafter.logits(torch.tensor([0]), ids[0, 39:40].long()[None], torch.tensor([39]),
                                          torch.tensor([0]), 64))
    assert calls == [[7, 7, 7, 7, 7, 5], [40]]
    assert torch.allclose(logits[0], logits[1], atol=1e-5)


def test_the_captured_prompt_pass_pads_past_the_prompt_and_the_next_pass_overwrites_it():
    """`prefill_graph`: a prompt of 100 tokens read in two passes of PREFILL_ROWS (the second padded past position
    100 with whatever the history row holds) leaves the drafter as one eager call does: the same logits for the next
    three tokens fed from position 100 (which overwrite the padding), float32 on the CPU. Prompts longer than the
    bound, or whose padded passes would run past the row, take the eager calls."""
    width, rows = 160, PREFILL_ROWS
    ids = torch.randint(0, 63, (1, width), dtype=torch.int32, generator=torch.Generator().manual_seed(3))
    logits, calls = {}, {}
    for name, spec_text, prompt in (("eager", "prefill_graph=0", 100), ("graph", "prefill_graph=128", 100),
                                    ("over-bound", "prefill_graph=64", 100), ("past-row", "prefill_graph=160", 150)):
        config = fused_config(f"gpu-fused:k=3,draft_block=2,nmax=4,{spec_text}")
        spec = GpuFusedSpeculator.standalone(config, max_num_reqs=1, max_model_len=width, pad=63, device="cpu",
                                             dtype=torch.float32)
        spec.bind(ids, torch.full((1,), prompt, dtype=torch.int32))
        spec.attach_drafter(tiny_qwen2(1, spec.cache_len))
        feed, seen = spec.drafter.hidden_states, []

        def counted(*args, feed=feed, seen=seen, **kwargs):
            seen.append(args[1].shape[1])
            return feed(*args, **kwargs)

        spec.drafter.hidden_states = counted
        spec.prompts.read("a", 0, prompt, done=True)
        calls[name] = list(seen)
        assert int(spec.dlen[0]) == prompt
        nxt = ids[0, prompt:prompt + 3].long()[None]
        logits[name] = spec.drafter.logits(torch.tensor([0]), nxt, torch.tensor([prompt]), torch.tensor([2]),
                                           spec.cache_len)
    assert calls == {"eager": [100], "graph": [rows, rows], "over-bound": [100], "past-row": [150]}
    assert torch.allclose(logits["graph"], logits["eager"], atol=1e-5)
    with pytest.raises(ConfigError, match="prefill_graph is the longest unread prompt"):
        fused_config("gpu-fused:prefill_graph=-1")


def test_a_prompt_resumed_in_a_slot_another_request_used_is_prefilled_again():
    """Chunked prefill continues where the drafter stopped only while its cache row still holds the request; after
    another request took the slot (preemption, then resumption), the drafter starts the prompt over."""
    config = fused_config("gpu-fused:k=3,draft_block=2,nmax=4")
    spec = GpuFusedSpeculator.standalone(config, max_num_reqs=2, max_model_len=64, pad=63, device="cpu",
                                         dtype=torch.float32)
    ids = torch.randint(0, 63, (2, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    spec.bind(ids, torch.full((2,), 40, dtype=torch.int32))
    spec.attach_drafter(tiny_qwen2(2, spec.cache_len))
    row = lambda slot, upto: spec.drafter.logits(  # noqa: E731 - the drafter's next-token logits after `upto`
        torch.tensor([slot]), ids[slot, upto - 1:upto].long()[None], torch.tensor([upto - 1]),
        torch.tensor([0]), 64)
    spec.prompts.read("a", 0, 20, done=False)
    spec.prompts.read("b", 0, 30, done=False)  # another request takes slot 0
    spec.prompts.read("a", 0, 40, done=True)  # "a" again: must not trust the row for its first 20 tokens
    again = row(0, 40)
    fresh = tiny_qwen2(2, spec.cache_len)
    fresh.hidden_states(torch.tensor([0]), ids[0, :40].long()[None], torch.tensor([0]), 40)
    want = fresh.logits(torch.tensor([0]), ids[0, 39:40].long()[None], torch.tensor([39]), torch.tensor([0]), 64)
    assert torch.allclose(again, want, atol=1e-5)
    spec.prompts.read("c", 1, 20, done=False)  # an undisturbed request continues from its own chunk
    spec.prompts.read("c", 1, 40, done=True)
    fresh.hidden_states(torch.tensor([1]), ids[1, :40].long()[None], torch.tensor([0]), 40)
    want = fresh.logits(torch.tensor([1]), ids[1, 39:40].long()[None], torch.tensor([39]), torch.tensor([0]), 64)
    assert torch.allclose(row(1, 40), want, atol=1e-5)
    assert "a" not in spec.prompts.read_upto and "c" not in spec.prompts.read_upto  # finished prompts: forgotten


def drive(spec: GpuFusedSpeculator, reqs: dict[str, tuple[list[int], list[int]]], slot_of: dict[str, int],
          ids: torch.Tensor, total: torch.Tensor, k: int, widths: tuple[int, ...] = ()) -> list[dict[str, list[int]]]:
    """Step `spec` the way vLLM's runner does (whole-prompt prefill, then decode steps verified against each
    request's fixed target output) until every target is emitted; each step's drafts per request. `widths`: the
    width the scheduler hands over for the step after each step, cycled (a step verifies that many of the drafts
    before it, none at 0); default every step k, with no width handed over."""
    script = itertools.cycle(widths) if widths else None
    state = {r: {"out": [], "drafts": None, "fresh": True} for r in reqs}
    for r, (prompt, _) in reqs.items():
        ids[slot_of[r], :len(prompt)] = torch.tensor(prompt, dtype=torch.int32)
        total[slot_of[r]] = len(prompt)
    steps = []
    while rows := [r for r in reqs if len(state[r]["out"]) < len(reqs[r][1]) - k - 1]:
        num_sampled, prefilling = [], []
        for r in rows:
            prompt, target = reqs[r]
            st, done = state[r], len(state[r]["out"])
            if st["fresh"]:  # the prompt's only chunk: it samples the first output token
                emitted = [target[0]]
            else:
                emitted = verified(st["drafts"][:st["width"]], target, done)
            prefilling.append(st["fresh"])
            start = len(prompt) + done
            ids[slot_of[r], start:start + len(emitted)] = torch.tensor(emitted, dtype=torch.int32)
            total[slot_of[r]] = start + len(emitted)
            st["out"] += emitted
            num_sampled.append(len(emitted))
        slots = np.array([slot_of[r] for r in rows], dtype=np.int32)
        plen = np.array([len(reqs[r][0]) for r in rows])
        computed = np.array([len(reqs[r][0]) + len(state[r]["out"]) - n for r, n in zip(rows, num_sampled)])
        spec.scheduled_width = next(script) if script is not None else None
        out = spec.step(rows, torch.from_numpy(slots), slots, torch.tensor(num_sampled, dtype=torch.int32),
                        np.array(prefilling), np.where(prefilling, 0, plen), np.where(prefilling, plen, 1 + k), plen,
                        computed)
        steps.append({r: out[i].tolist() for i, r in enumerate(rows)})
        for i, r in enumerate(rows):
            state[r]["drafts"], state[r]["fresh"] = out[i].tolist(), False
            state[r]["width"] = k if spec.scheduled_width is None else spec.scheduled_width
    return steps


def by_step(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """A speculator's records (`take_records`, one per step and row, in step order) grouped into steps."""
    steps, i = [], 0
    while i < len(records):
        steps.append(records[i:i + records[i]["batch"]])
        i += records[i]["batch"]
    return steps


def copy_and_prose() -> dict[str, tuple[list[int], list[int]]]:
    """Tiny-vocabulary requests (prompt, the target's output): "copy" copies 170 tokens of a passage in its prompt
    with one foreign token after the first 80 (the copy breaks and resumes), then stops copying (the drafter runs
    again after drafter-free steps); "prose" is short and never copies."""
    g = torch.Generator().manual_seed(3)
    passage = torch.randint(0, 60, (200,), generator=g).tolist()
    return {"copy": (torch.randint(0, 60, (30,), generator=g).tolist() + passage + [61],
                     passage[:80] + [62] + passage[80:170] + torch.randint(0, 60, (30,), generator=g).tolist()),
            "prose": (torch.randint(0, 60, (50,), generator=g).tolist(),
                      torch.randint(0, 60, (20,), generator=g).tolist())}


@pytest.mark.skipif(torch.cuda.is_available(), reason=INTERPRETER_ONLY)
def test_a_step_copies_slots_and_fresh_marks_only_when_they_change():
    """Each CUDA call is host time on the step's critical path, so a decode step whose batch is the one before copies
    neither its slots nor its (all False) fresh marks; whatever the batch does (grows, shrinks, reorders, a request
    samples its first token), the device buffers the drafting step reads hold what the host passed."""
    config = fused_config("gpu-fused:k=3,draft_block=1,nmax=8")
    spec = GpuFusedSpeculator.standalone(config, max_num_reqs=4, max_model_len=256, pad=63, device="cpu",
                                         dtype=torch.float32)
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, 60, size=(4, 256)).astype(np.int32))
    total = torch.full((4,), 40, dtype=torch.int32)
    spec.bind(ids, total)
    spec.attach_drafter(tiny_qwen2(4, spec.cache_len))
    # (slots, which rows sampled their first token) per step: fresh requests, steady decode, a new request joins,
    # the batch reorders, shrinks, then repeats itself
    batches = [([0, 1], [True, True]), ([0, 1], [False, False]), ([0, 1], [False, False]),
               ([0, 1, 3], [False, False, True]), ([0, 1, 3], [False, False, False]), ([3, 0, 1], [False] * 3),
               ([3, 1], [False, False]), ([3, 1], [False, False]), ([2], [True]), ([2], [False])]
    kept, turns = [], []
    for slots, fresh in batches:
        n = len(slots)
        slots_np = np.array(slots, dtype=np.int32)
        fresh_np = np.array(fresh)
        total[slots_np] += 2
        spec.step([f"r{s}" for s in slots], torch.from_numpy(slots_np), slots_np,
                  torch.full((n,), 2, dtype=torch.int32), fresh_np, np.where(fresh_np, 0, 40),
                  np.where(fresh_np, 40, 4), np.full(n, 40), np.where(fresh_np, 0, total[slots_np].numpy() - 2))
        assert spec.slots[:n].tolist() == slots
        assert spec.fresh[:n].tolist() == fresh
        assert not spec.fresh[:spec._fresh_known_false].any()  # the rows the host counts on being False are
        kept.append(spec._slots_host)
        turns.append(spec._fresh_ring_index)
    # the unchanged batches reused the slots already on the device: no new copy was made for them
    assert [kept[i] is kept[i - 1] for i in range(1, len(batches))] == [
        True, True, False, True, False, False, True, False, True]
    # the fresh marks went to the device where a row was fresh or a row not known False joined (a new ring buffer)
    copied = [i for i in range(len(batches)) if turns[i] != (turns[i - 1] if i else 0)]
    assert copied == [0, 1, 3, 4, 8, 9]


def device_skip_runs(device: str, dtype: torch.dtype, attention: str = "sdpa", graphs: bool = False,
                     nested: bool = True) -> list[Any]:
    """The copy and prose requests through `device_skip` and through the same config without it (every step runs
    the drafter's pass): per run, the config, each step's drafts per request and the records. `nested=False`: the
    conditional nodes side by side instead of inside one IF node."""
    reqs = copy_and_prose()
    runs = []
    base = "gpu-fused:k=7,draft_block=1,nmax=8,schedule=long,nmin_tail=1"
    for spec_text in (f"{base},device_skip=true", base):
        config = fused_config(spec_text)
        spec = GpuFusedSpeculator.standalone(config, max_num_reqs=2, max_model_len=480, pad=63, device=device,
                                             dtype=dtype, record=True)
        ids = torch.zeros(2, 480, dtype=torch.int32, device=device)
        total = torch.zeros(2, dtype=torch.int32, device=device)
        spec.bind(ids, total)
        spec.attach_drafter(tiny_qwen2(2, spec.cache_len, device=device, dtype=dtype, attention=attention))
        spec.nested_nodes = nested
        if graphs:
            spec.init_cudagraph_manager(SimpleNamespace(name="FULL"))
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                spec.capture()
            fell_back = [str(w.message) for w in seen if "capturing" in str(w.message)]
            assert not fell_back, fell_back  # the capture fell back (nodes side by side, or eager)
            assert spec.graphs, "capturing the drafting step failed"
        steps = drive(spec, reqs, {"copy": 1, "prose": 0}, ids, total, config.k)
        runs.append((config, steps, spec.take_records()))
    return runs


def check_device_skip_records(config: Any, records: list[dict[str, Any]]) -> None:
    """The device skipped the drafter only on steps where every row's block is the lookup's whatever the drafter
    says, did skip on the copy, ran it only where the lookup did not decide, and caught up after skipped steps with
    narrow and wide passes, after more skipped steps than one wide pass feeds in a loop of them."""
    narrow, wide = config.k + 1, (config.k + 1) * WIDE_STEPS
    steps = by_step(records)
    skipped = [step for step in steps if step[0]["drafter_passes"] == 0]
    assert skipped, "the device never skipped the drafter's pass"
    for step in skipped:
        assert all(r["match_len"] >= config.nstrong and r["lookup_valid"] >= 1 and r["head_taken"] for r in step), step
    assert {r["drafter_width"] for r in records} == {0, narrow, wide}  # none, narrow and wide passes all ran
    assert all((r["drafter_passes"] > 0) == (r["drafter_width"] > 0) for r in records)
    # the drafter's own token (draft_block=1) is recorded where it ran, and is the head wherever the block took it
    for r in records:
        assert len(r["drafter_tokens"]) == (1 if r["drafter_passes"] > 0 else 0), r
        if r["sources"] and r["sources"][0] == SOURCE_DRAFT:
            assert r["tokens"][0] == r["drafter_tokens"][0], r
    run, longest = 0, 0
    for step in steps:
        run = run + 1 if step[0]["drafter_passes"] == 0 else 0
        longest = max(longest, run)
        if step[0]["drafter_passes"] > 0:  # the drafter ran because it was needed
            assert not all(r["match_len"] >= config.nstrong and r["lookup_valid"] >= 1 for r in step), step
    # the copy's drafter lagged more than one wide pass feeds, and caught up in a loop of them
    assert longest > WIDE_STEPS - 1 and max(r["drafter_passes"] for r in records) >= 2


@pytest.mark.skipif(torch.cuda.is_available(), reason=INTERPRETER_ONLY)
def test_the_device_skip_changes_no_draft():
    """`device_skip`: the drafting step skips the drafter where the lookup alone decides every row's block, deciding
    on the device; each step's drafts equal those of the same config running the drafter every step, and the records
    show it skipped on the copy, only at strong matches, and caught up with the narrow, wide and looped passes."""
    (config, fast, records), (_, slow, every) = device_skip_runs("cpu", torch.float32)
    assert fast == slow
    check_device_skip_records(config, records)
    assert len(records) == len(every)
    assert all(r["drafter_passes"] == 1 for r in every)  # the config without it: a pass every step
    # where the skipping config ran its drafter, its head token is the every-pass config's (float32)
    ran = [(r["drafter_tokens"], e["drafter_tokens"]) for r, e in zip(records, every) if r["drafter_tokens"]]
    assert ran and all(a == b for a, b in ran)


def test_the_device_skip_is_refused_where_it_would_change_decisions():
    for bad, why in (("draft_block=3", "draft_block=1"), ("rule=score", "threshold")):
        with pytest.raises(ConfigError, match=why):
            fused_config(f"gpu-fused:k=7,draft_block=1,nmax=8,device_skip=true,{bad}")
    assert fused_config("gpu-fused:k=7,draft_block=1,device_skip=true").device_skip
    assert not fused_config("gpu-fused:k=7,draft_block=3,device_skip=false").device_skip  # the every-pass reference


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("dtype, attention, nested", [(torch.float32, "sdpa", True), (torch.bfloat16, "flash", True),
                                                      (torch.float32, "sdpa", False)])
def test_the_device_skip_in_cuda_graphs_changes_no_draft(dtype, attention, nested):
    """The same with the drafting step captured in CUDA graphs: the loop of wide passes sits behind a WHILE node
    and the last pass behind IF nodes, all inside one IF node (`nest`; else side by side), set by the step's own
    lookup. In float32 the drafts equal those of the every-pass run; in bf16 only the records' decisions are checked:
    a wide pass feeds 8 steps' positions at once where the every-pass run feeds them a step at a time, and the GPU's
    matrix products may round a row differently with the number of rows, which flips near-tied argmaxes of a
    random-weight drafter."""
    (config, fast, records), (_, slow, _) = device_skip_runs("cuda", dtype, attention, graphs=True, nested=nested)
    if dtype == torch.float32:
        assert fast == slow
    assert len(fast) == len(slow)
    check_device_skip_records(config, records)


def test_the_drafter_flags_decide_as_their_definition_compiled_or_not():
    """`drafter_flags.at_start`, `after_loop_pass` and `before_last_pass` (what a drafting step runs of the drafter)
    against their definition in plain Python on random batches, eager and through torch.compile (`compile_rule`)."""
    from hqlab.engines.vllm import drafter_flags as df

    narrow, wide, nstrong = 8, 64, 2
    rules = (df.at_start, df.after_loop_pass, df.before_last_pass)
    compiled = tuple(torch.compile(f, dynamic=None) for f in rules)
    rng = np.random.default_rng(5)
    for trial in range(40):
        m, slots_n = int(rng.integers(1, 5)), 6
        total_len = torch.from_numpy(rng.integers(100, 400, slots_n).astype(np.int32))
        dlen = total_len.long() - torch.from_numpy(rng.choice([0, 1, 5, 8, 9, 60, 64, 65, 200], slots_n))
        slots = torch.from_numpy(rng.permutation(slots_n)[:m].astype(np.int64))
        ns = torch.from_numpy(rng.integers(0, 3, m).astype(np.int32))
        match_len = torch.from_numpy(rng.integers(0, 4, m).astype(np.int32))
        valid = torch.from_numpy(rng.integers(0, 3, m).astype(np.int32))
        lag = [int(total_len[s]) - int(dlen[s]) if n > 0 else 0 for s, n in zip(slots.tolist(), ns.tolist())]
        for lookup_decides in (True, False):
            decided = [lookup_decides and ml >= nstrong and v >= 1 for ml, v in zip(match_len.tolist(), valid.tolist())]
            need = int(not all(n <= 0 or d for n, d in zip(ns.tolist(), decided)))
            want = [need, int(need and max(lag) > wide), 0, 0, 0, 0]
            for first in (rules[0], compiled[0]):
                got = first(total_len, dlen, slots, ns, match_len, valid, nstrong, lookup_decides, wide)
                assert got.tolist() == want, (trial, lookup_decides)
        flags = torch.tensor([1, 1, 0, 0, 0, 2], dtype=torch.int32)
        for after_loop_pass, before_last_pass in (rules[1:], compiled[1:]):
            assert after_loop_pass(flags, total_len, dlen, slots, ns, wide).tolist() == [1, int(max(lag) > wide), 0,
                                                                                          0, 0, 3]
            is_narrow = int(max(lag) <= narrow)
            for head in (1, 3):
                want = [1, 1, is_narrow, 1 - is_narrow, narrow if is_narrow else wide, 2 + head]
                assert before_last_pass(flags, total_len, dlen, slots, ns, narrow, wide, head).tolist() == want, trial
            # not needed: no pass
            assert before_last_pass(flags * 0, total_len, dlen, slots, ns, narrow, wide, 3).tolist() == [0] * 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_widths_flipping_at_one_batch_size_in_cuda_graphs_change_no_draft():
    """The goodput controller's widths on the GPU: vLLM's scheduler hands the speculator 15, 0, 7, 15, ... for the
    step after each step at one batch size. With the drafting step captured in CUDA graphs (the drafter behind its
    conditional nodes), the steps that draft give the drafts of the same steps run eagerly (float32), the steps at
    width 0 launch nothing (the drafting-step counters), and the drafter's catch-up after them ran narrow and wide
    passes. The CPU half (the blocks equal the reference's through vLLM's scheduler) is
    test_vllm_lifecycle.py's flip test."""
    flips = (15, 0, 7, 15)
    runs = []
    for graphs in (True, False):
        config = fused_config("gpu-fused:k=15,draft_block=1,nmax=16,schedule=long,nmin_tail=1,device_skip=true,"
                              "batch_k=1:15/2:7/0")
        spec = GpuFusedSpeculator.standalone(config, max_num_reqs=2, max_model_len=480, pad=63, device="cuda",
                                             dtype=torch.float32, record=True)
        ids = torch.zeros(2, 480, dtype=torch.int32, device="cuda")
        total = torch.zeros(2, dtype=torch.int32, device="cuda")
        spec.bind(ids, total)
        spec.attach_drafter(tiny_qwen2(2, spec.cache_len, device="cuda", dtype=torch.float32, attention="sdpa"))
        if graphs:
            spec.init_cudagraph_manager(SimpleNamespace(name="FULL"))
            spec.capture()
            assert spec.graphs, "capturing the drafting step failed"
        steps = drive(spec, copy_and_prose(), {"copy": 1, "prose": 0}, ids, total, config.k, widths=flips)
        runs.append((steps, spec.take_records(), spec.drafting_steps, spec.off_steps))
    (steps, records, drafting, off), (eager, _, eager_drafting, eager_off) = runs
    assert (drafting, off) == (eager_drafting, eager_off) and off >= len(steps) // 4 - 1
    plain = {i for i in range(len(steps)) if flips[i % len(flips)] == 0}  # their drafts are never verified
    assert [s for i, s in enumerate(steps) if i not in plain] == [s for i, s in enumerate(eager) if i not in plain]
    assert {r["drafter_width"] for r in records} >= {16, 16 * WIDE_STEPS}  # narrow and wide catch-up passes ran
