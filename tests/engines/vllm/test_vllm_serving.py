"""The server path on the CPU, as far as a CPU allows: `vllm serve`'s own parser takes the command hqlab builds and
hands the engine hqlab's configs; the batch schedule is vLLM's own table; a speculator skips its drafting where that
table says the next step verifies nothing; the planted verification bug does what it says; `vllm bench serve`'s own
parser takes the load benchmark's flags. The server itself runs on the GPU host (benchmarks/vllm_serve.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="the vllm extra is not installed (make setup-vllm)")

from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup  # noqa: E402

from hqlab.config import ConfigError  # noqa: E402
from hqlab.engines.vllm import batch_k, fault, gpu_fused, gpu_lookup, plugin  # noqa: E402
from hqlab.engines.vllm import full_graph_fix  # noqa: E402
from hqlab.engines.vllm.serving import engine_configs, serve_command, serve_env  # noqa: E402

LOOKUP = "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest,batch_k=1:15/8:3/0"
FUSED = ("gpu-fused:k=15,draft_block=1,nmax=32,policy=earliest,schedule=long,nmin_tail=1,device_skip=true,"
         "batch_k=1:15/16:7/0")


@pytest.fixture
def cpu_platform(monkeypatch):
    """vLLM's argument parser builds config defaults that ask the platform for its device type; this machine has
    no GPU platform, so the device type stands in (nothing else of the platform is used)."""
    import vllm.platforms as platforms

    monkeypatch.setattr(type(platforms.current_platform), "device_type", "cpu", raising=False)


def parse_serve(argv: list[str]):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(parser.add_subparsers())
    args = parser.parse_args(argv[1:])  # argv[0] is `vllm`
    args.model = args.model_tag  # what `vllm serve`'s command does before building the engine
    return AsyncEngineArgs.from_cli_args(args)


@pytest.mark.parametrize("spec", [LOOKUP, FUSED, "gpu-lookup:nmin=1,nmax=32,k=7,policy=earliest"])
def test_vllm_serves_parser_hands_the_engine_hqlabs_configs(cpu_platform, spec):
    engine = parse_serve(serve_command("/models/target", spec, max_num_seqs=32, port=8321,
                                       extra=["--max-model-len", "4096"]))
    speculative, extra = engine_configs(spec)
    assert engine.model == "/models/target" and engine.max_num_seqs == 32 and engine.max_model_len == 4096
    assert engine.speculative_config == speculative and engine.additional_config == extra
    assert extra[gpu_lookup.SPEC_KEY] == spec
    k = speculative["num_speculative_tokens"]
    assert engine.compilation_config.max_cudagraph_capture_size == max(1024, 32 * (k + 1))
    if spec == FUSED:  # its drafter's own graphs: no run has checked them under FULL (serving.full_graphs)
        assert engine.compilation_config.cudagraph_mode is None and serve_env(spec) == {}
    else:
        assert engine.compilation_config.cudagraph_mode.name == "FULL"
        assert serve_env(spec) == {full_graph_fix.ENV_VAR: "1"}
    assert ("batch_k" in spec) == ("num_speculative_tokens_per_batch_size" in speculative)
    # the plugin recognises the config the server built: model runner V2, asynchronous scheduling
    plugin.register()
    assert plugin._ours(type("C", (), {"speculative_config": engine.speculative_config})())


def test_none_adds_no_flags_and_other_methods_are_refused(cpu_platform):
    assert serve_command("m", "none") == ["vllm", "serve", "m", "--max-num-seqs", "32", "--port", "8000"]
    assert serve_env("none") == {}  # vLLM's defaults throughout
    with pytest.raises(ConfigError, match="server path runs"):
        engine_configs("lookup:k=7")
    with pytest.raises(ConfigError, match="planted_fault"):
        engine_configs(LOOKUP, planted_fault="accept_everything")
    _, extra = engine_configs(LOOKUP, planted_fault="accept_first_draft")
    assert extra[fault.KEY] == "accept_first_draft"


@pytest.mark.parametrize("value,k", [("1:15/8:3/0", 15), ("4:15/16:3/0", 15), ("7", 7), ("2:31/4:15/16:7/32:3", 31),
                                     ("1:3/2:2/3:1/0", 3)])
def test_the_batch_table_is_vllms_own(value, k):
    entries = batch_k.parse(value, k)
    schedule = batch_k.vllm_schedule(entries)
    for max_batch in (1, 8, 32, 256):
        theirs = build_dynamic_sd_schedule_lookup(schedule, vllm_max_batch_size=max_batch, vllm_num_speculative_tokens=k)
        assert batch_k.dense(entries, max_batch, k) == theirs
        assert [batch_k.next_k(theirs, b, k) for b in range(1, max_batch + 1)] == theirs[1:]
    assert batch_k.next_k(None, 5, k) == k


@pytest.mark.parametrize("value,match", [("", "empty"), ("4:16/0", r"\[0, k=15\]"), ("8:3/4:1/0", "increase"),
                                         ("0:3/0", ">= 1"), ("3/8:1", "batch bound"), ("a:b", "integers")])
def test_bad_batch_schedules_say_what_to_fix(value, match):
    with pytest.raises(ConfigError, match=match):
        batch_k.parse(value, 15)


def test_fused_takes_a_width_of_zero_with_or_without_the_device_skip():
    """At width 0 no drafting step runs and the drafter catches up when drafting resumes, whatever skips it between:
    any gpu-fused config may turn drafting off under load."""
    for spec in ("gpu-fused:k=15,draft_block=1,batch_k=4:15/0", "gpu-fused:k=15,draft_block=3,batch_k=4:15/0",
                 "gpu-fused:k=15,draft_block=1,batch_k=4:15/3"):
        assert gpu_fused.fused_config(spec).batch_k == spec.rpartition("=")[2]
    assert gpu_fused.fused_config(FUSED).batch_k == "1:15/16:7/0"
    with pytest.raises(ConfigError, match=r"\[0, k=15\]"):
        gpu_fused.fused_config("gpu-fused:k=15,draft_block=1,batch_k=4:16/0")


def test_the_lookup_skips_its_drafting_where_the_next_step_verifies_nothing():
    """Batch 1 drafts (equal to the reference rule), batches 9+ skip the kernel and count the step."""
    from hqlab.rules.lookup import suffix_match

    config = gpu_lookup.lookup_config(LOOKUP)
    spec = gpu_lookup.GpuLookupSpeculator.standalone(config, max_num_reqs=16, max_model_len=256, pad=99,
                                                     device="cpu")
    hist = np.tile(np.array([5, 6, 7, 8], dtype=np.int32), 20)
    tokens = torch.zeros(16, 256, dtype=torch.int32)
    tokens[:, :hist.size] = torch.from_numpy(hist)
    lengths = torch.full((16,), hist.size, dtype=torch.int32)
    spec.bind(tokens, lengths)

    class Batch:
        def __init__(self, n: int) -> None:
            self.num_reqs, self.req_ids = n, [f"r{i}" for i in range(n)]
            self.idx_mapping = torch.arange(n, dtype=torch.int32)

    one = spec.propose(Batch(1), num_sampled=torch.ones(1, dtype=torch.int32))
    ref = suffix_match(hist.tolist(), nmin=1, nmax=32, k=15, policy="earliest")
    assert one[0, :ref.valid].tolist() == list(ref.tokens) and spec.skipped_steps == 0
    before = spec.draft_tokens.clone()
    spec.draft_tokens.fill_(-7)  # a skipped step must not write drafts
    nine = spec.propose(Batch(9), num_sampled=torch.ones(9, dtype=torch.int32))
    assert spec.skipped_steps == 1 and bool((nine == -7).all())
    assert before.shape == spec.draft_tokens.shape


def test_the_speculator_refuses_a_schedule_vllm_does_not_have():
    from types import SimpleNamespace

    with_table = batch_k.with_schedule({}, "1:15/8:3/0", 15)["num_speculative_tokens_per_batch_size"]
    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens_per_batch_size=None),
                             scheduler_config=SimpleNamespace(max_num_seqs=16))
    with pytest.raises(ConfigError, match="speculative_config"):
        batch_k.table_for(config, "1:15/8:3/0", 15)
    config.speculative_config.num_speculative_tokens_per_batch_size = [tuple(r) for r in with_table]
    table = batch_k.table_for(config, "1:15/8:3/0", 15)
    assert table == build_dynamic_sd_schedule_lookup(with_table, vllm_max_batch_size=16, vllm_num_speculative_tokens=15)
    assert batch_k.table_for(config, "", 15) == table  # vLLM's own schedule is followed without one in the spec


def test_the_planted_fault_accepts_a_rejected_first_draft_and_nothing_else():
    pad = 99
    # three requests: 3 logits (2 drafts) rejected at the first; 3 logits, first draft is pad; 1 logit (no drafts)
    cu = torch.tensor([0, 3, 6, 7], dtype=torch.int32)
    draft_sampled = torch.tensor([10, 11, 12, 20, pad, pad, 30])
    sampled = torch.tensor([[41, -1, -1], [42, -1, -1], [43, -1, -1]])
    num_sampled = torch.tensor([1, 1, 1], dtype=torch.int32)
    out, n = fault.accept_first_draft(sampled, num_sampled, draft_sampled, cu, pad)
    assert out[0, :2].tolist() == [11, 41] and n.tolist() == [2, 1, 1]
    assert out[1].tolist() == [42, -1, -1] and out[2].tolist() == [43, -1, -1]
    # a step the correct rule accepted is left alone
    same, n2 = fault.accept_first_draft(torch.tensor([[11, 12, 5]]), torch.tensor([3], dtype=torch.int32),
                                        torch.tensor([10, 11, 12]), torch.tensor([0, 3], dtype=torch.int32), pad)
    assert same.tolist() == [[11, 12, 5]] and n2.tolist() == [3]


def test_the_benchmarks_fixed_step_keeps_one_token_a_request():
    # accepted 2 drafts + bonus, rejected at the first draft, and a request with nothing sampled (a padded row)
    sampled = torch.tensor([[11, 12, 5], [42, -1, -1], [-1, -1, -1]])
    num_sampled = torch.tensor([3, 1, 0], dtype=torch.int32)
    out, n = fault.reject_all_drafts(sampled, num_sampled)
    assert n.tolist() == [1, 1, 0] and out[:, 0].tolist() == [11, 42, -1]
    assert "reject_all_drafts" in fault.FAULTS
    _, extra = engine_configs(LOOKUP, planted_fault="reject_all_drafts")
    assert extra[fault.KEY] == "reject_all_drafts"


def test_the_load_benchmarks_flags_are_vllm_bench_serves_own():
    from hqlab.bench import serve

    point = serve.LoadPoint("chat", 0.7, 8, 16)
    ns = serve.bench_namespace(serve.bench_args("http://127.0.0.1:8321", "target", "/models/target", "chat.jsonl",
                                                point, output_len=256, result_dir="/tmp/r", result_file="r.json"))
    assert (ns.dataset_name, ns.max_concurrency, ns.temperature, ns.num_prompts) == ("custom", 8, 0.7, 16)
    assert ns.custom_output_len == 256 and ns.save_result and ns.percentile_metrics == "ttft,tpot,itl,e2el"
    assert ns.metric_percentiles == "50,99" and ns.base_url == "http://127.0.0.1:8321"
    # a corpus workload's point: its file's order, no shuffle, no oversampling, nothing sent before it
    batch = serve.bench_namespace(serve.bench_args("http://127.0.0.1:8321", "target", "/models/target", "b.jsonl",
                                                   serve.LoadPoint("batch", 0.0, 32, 320), output_len=256,
                                                   result_dir="/tmp/r", result_file="r.json"))
    assert batch.skip_chat_template and batch.disable_shuffle and batch.no_oversample
    assert (batch.num_warmups, batch.ready_check_timeout_sec, batch.num_prompts) == (0, 0, 320)


@pytest.mark.parametrize("settings", ["draft_block=1,schedule=long,nmin_tail=1,device_skip=true",
                                      "draft_block=3"], ids=["device-skip", "every-step"])
def test_fused_drafting_off_under_load_reads_nothing_then_catches_up(settings):
    """gpu-fused with `batch_k=1:7/0`: while two requests run, the next step verifies nothing, so the speculator runs
    no drafter call at all, not even the prompts' prefill; once one request is left, drafting resumes, the prompt
    noted meanwhile is read and the catch-up reads the tokens emitted meanwhile, so the drafter then knows the
    request's history as a drafter fed it from the start does; with or without the device skip."""
    import importlib.util
    import sys
    from pathlib import Path

    # the fused tests' driver and tiny drafter (test modules are not importable by name under --import-mode=importlib)
    where = importlib.util.spec_from_file_location("_fused_tests", Path(__file__).with_name("test_vllm_gpu_fused.py"))
    fused_tests = sys.modules.setdefault("_fused_tests", importlib.util.module_from_spec(where))
    where.loader.exec_module(fused_tests)
    drive, copy_and_prose, tiny_qwen2 = fused_tests.drive, fused_tests.copy_and_prose, fused_tests.tiny_qwen2

    config = gpu_fused.fused_config(f"gpu-fused:k=7,nmax=8,{settings},batch_k=1:7/0")
    spec = gpu_fused.GpuFusedSpeculator.standalone(config, max_num_reqs=2, max_model_len=480, pad=63, device="cpu",
                                                   dtype=torch.float32, record=True)
    ids, total = torch.zeros(2, 480, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    spec.bind(ids, total)
    spec.attach_drafter(tiny_qwen2(2, spec.cache_len))
    calls: list[int] = []  # the step (steps so far, drafted or not) of every drafter call
    for name in ("hidden_states", "extend"):
        original = getattr(spec.drafter, name)

        def counted(*args, original=original, **kwargs):
            calls.append(spec.drafting_steps + spec.off_steps)
            return original(*args, **kwargs)

        setattr(spec.drafter, name, counted)
    steps = drive(spec, copy_and_prose(), {"copy": 1, "prose": 0}, ids, total, config.k)
    both = sum(1 for s in steps if len(s) == 2)
    assert both > 0 and spec.off_steps == both  # every two-request step was off ...
    assert not [c for c in calls if c < both]  # ... and called the drafter nothing
    assert spec.drafting_steps == len(steps) - both > 0 and calls  # then it drafted for "copy" alone
    # "copy"'s prompt, noted while off, was read when it drafted again; "prose" finished under load: never read
    assert list(spec.prompts.unread) == [0] and spec.prompts.unread[0][0] == "prose"
    # the drafter's cache for "copy" holds its history up to what it has read: the same next-token logits as a
    # drafter fed that history in one call
    d = int(spec.dlen[1])
    assert d > len(copy_and_prose()["copy"][0])  # past the prompt: the catch-up read generated tokens too
    got = spec.drafter.logits(torch.tensor([1]), ids[1, d - 1:d].long()[None], torch.tensor([d - 1]),
                              torch.tensor([0]), spec.cache_len)
    fresh = tiny_qwen2(2, spec.cache_len)
    fresh.hidden_states(torch.tensor([1]), ids[1, :d].long()[None], torch.tensor([0]), d)
    want = fresh.logits(torch.tensor([1]), ids[1, d - 1:d].long()[None], torch.tensor([d - 1]), torch.tensor([0]),
                        spec.cache_len)
    assert torch.allclose(got, want, atol=1e-4)


SUFFIX = "arctic-suffix:k=24,depth=24,min_prob=0.1,cached=256"


def test_vllm_serves_parser_hands_the_engine_vllms_suffix_config(cpu_platform):
    """`arctic-suffix:...,cached=N` serves vLLM's own `suffix` method under vLLM 0.26's key names: no hqlab
    additional config (hqlab's plugin leaves the server alone), the speculative configs' capture size; `cached` must be
    named (hqlab's proposer keeps no global tree by default, vLLM's server 10,000 requests)."""
    engine = parse_serve(serve_command("/models/target", SUFFIX, max_num_seqs=32, port=8321))
    assert engine.speculative_config == {
        "method": "suffix", "num_speculative_tokens": 24, "suffix_decoding_max_tree_depth": 24,
        "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1,
        "suffix_decoding_max_cached_requests": 256}
    assert not engine.additional_config and engine.compilation_config.max_cudagraph_capture_size == 1024
    assert engine.compilation_config.cudagraph_mode.name == "FULL"
    from vllm.config.speculative import SpeculativeConfig

    assert set(engine.speculative_config) - {"method", "num_speculative_tokens"} <= set(
        SpeculativeConfig.__dataclass_fields__)
    plugin.register()
    assert not plugin._ours(type("C", (), {"speculative_config": engine.speculative_config})())
    with pytest.raises(ConfigError, match="cached=N"):
        engine_configs("arctic-suffix:k=24")
    with pytest.raises(ConfigError, match="cached >= 0"):
        engine_configs("arctic-suffix:k=24,cached=-1")
    with pytest.raises(ConfigError, match="planted fault"):
        engine_configs(SUFFIX, planted_fault="reject_all_drafts")


def test_the_suffix_cache_the_reset_empties_is_where_vllm_keeps_it():
    """The reset (`suffix_reset.reset_suffix_cache`, checked against Arctic's real cache in
    tests/tools/test_arctic_suffix_reset.py) finds the cache at `model_runner.drafter.suffix_cache`: vLLM 0.26's V1
    runner makes a SuffixDecodingProposer its drafter, which keeps the cache there; model runner V2 refuses `suffix`
    (so a suffix server runs V1, whatever the hqlab servers beside it run)."""
    import inspect

    from vllm.config.vllm import VllmConfig
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer
    from vllm.v1.worker import gpu_model_runner

    assert "self.suffix_cache = SuffixDecodingCache(" in inspect.getsource(SuffixDecodingProposer.__init__)
    assert "self.drafter = SuffixDecodingProposer(self.vllm_config)" in inspect.getsource(gpu_model_runner)
    unsupported = inspect.getsource(VllmConfig._get_v2_model_runner_unsupported_features)
    assert '"suffix"' not in unsupported and "unsupported.append(f\"speculative method" in unsupported


NGRAM_GPU = "vllm-ngram-gpu:nmin=2,nmax=5,k=7"
DRAFT = "vllm-draft:model=qwen2.5-coder-0.5b,k=7"


def test_vllm_builds_its_own_ngram_gpu_and_draft_model_from_the_served_flags(cpu_platform):
    """`vllm-ngram-gpu:...` and `vllm-draft:model=..,k=..` serve vLLM's own `ngram_gpu` and `draft_model`: `vllm
    serve`'s parser takes the command, and vLLM's own SpeculativeConfig, built from it against the 1.5B's config as
    the engine builds it, runs the method, widths and drafter the spec names (the drafter the local folder
    `hqlab.models.prepare` made, at the target's tensor parallelism and context); no hqlab additional config, the
    speculative configs' capture size, and the same translation as the offline engine's."""
    from vllm.config import ParallelConfig

    from hqlab import models
    from hqlab.engines.vllm.engine import setting_for
    from hqlab.engines.vllm.serving import vllm_args

    target, drafter = models.prepare("qwen2.5-coder-1.5b"), models.prepare("qwen2.5-coder-0.5b")
    ngram = parse_serve(serve_command(target, NGRAM_GPU, max_num_seqs=32, extra=["--max-model-len", "4096"]))
    draft = parse_serve(serve_command(target, DRAFT, max_num_seqs=32, extra=["--max-model-len", "4096"]))
    assert ngram.speculative_config == {"method": "ngram_gpu", "num_speculative_tokens": 7, "prompt_lookup_min": 2,
                                        "prompt_lookup_max": 5}
    assert draft.speculative_config == {"method": "draft_model", "num_speculative_tokens": 7, "model": drafter}
    plugin.register()
    # FULL graphs but for vLLM's draft model, whose drafter's own graphs no run has checked under FULL
    assert ngram.compilation_config.cudagraph_mode.name == "FULL" and draft.compilation_config.cudagraph_mode is None
    assert serve_env(NGRAM_GPU) == {full_graph_fix.ENV_VAR: "1"} and serve_env(DRAFT) == {}
    for spec, args in ((NGRAM_GPU, ngram), (DRAFT, draft)):
        assert not args.additional_config and args.compilation_config.max_cudagraph_capture_size == 1024
        assert not plugin._ours(type("C", (), {"speculative_config": args.speculative_config})())
        offline = setting_for(spec)  # one translation: the offline engine's differs only in preparing the drafter
        assert offline.k == 7 and {**offline.speculative_config, **(
            {"model": drafter} if offline.draft_model else {})} == args.speculative_config
    target_config = draft.create_model_config()  # the 1.5B's, as `vllm serve` builds it
    built = {spec: args.create_speculative_config(target_config, ParallelConfig())
             for spec, args in ((NGRAM_GPU, ngram), (DRAFT, draft))}
    n, d = built[NGRAM_GPU], built[DRAFT]
    assert (n.method, n.num_speculative_tokens, n.prompt_lookup_min, n.prompt_lookup_max) == ("ngram_gpu", 7, 2, 5)
    assert (d.method, d.num_speculative_tokens, d.draft_tensor_parallel_size) == ("draft_model", 7, 1)
    assert d.draft_model_config.model == drafter and d.draft_model_config.max_model_len == 4096
    assert d.draft_model_config.hf_config.num_hidden_layers < target_config.hf_config.num_hidden_layers
    wide = vllm_args(NGRAM_GPU, max_num_seqs=256)
    assert wide[wide.index("--compilation-config") + 1] == \
        '{"max_cudagraph_capture_size":2048,"cudagraph_mode":"FULL"}'  # 256 x (7 + 1)


@pytest.mark.parametrize("spec,says", [
    ("vllm-draft:model=qwen2.5-coder-0.5b,k=7,temperature=0.5", "draft_model takes only model and k .got temperature"),
    ("vllm-draft:vocab=x", "got vocab.: it drafts with the full vocabulary"),
    ("vllm-draft:k=7,seed=1", "got seed"),
    ("vllm-draft:k=0", "k must be >= 1"),
    ("vllm-ngram-gpu:nmin=2,nmax=5,k=7,policy=earliest", "ngram_gpu takes only nmin, nmax and k .got policy.$"),
    ("vllm-ngram-gpu:k=7,max_model_len=512", "got max_model_len.: the engine's max_model_len"),
    ("vllm-ngram-gpu:nmin=6,nmax=5,k=7", "nmin <= nmax"),
    ("vllm-ngram:nmin=2,nmax=5,k=7", "server path runs .* vllm-ngram-gpu, vllm-draft"),
])
def test_bad_native_specs_say_what_to_fix(spec, says):
    with pytest.raises(ConfigError, match=says):
        engine_configs(spec)


def test_vllms_own_methods_take_no_planted_fault_and_a_missing_drafter_is_refused():
    from hqlab.models import ModelError

    for spec in (NGRAM_GPU, DRAFT):
        with pytest.raises(ConfigError, match="planted fault needs hqlab's speculator"):
            engine_configs(spec, planted_fault="accept_first_draft")
    with pytest.raises(ModelError, match="does not exist"):
        engine_configs("vllm-draft:model=/no/such/drafter,k=7")
