"""The gpu-lookup corpus (`corpus=N`) without a GPU: the speculator built from a real VllmConfig drafts, on vLLM-shaped
request state, exactly what the reference rule (`hqlab.rules.corpus.propose`) drafts from a corpus rebuilt from the
speculator's own insertion log, step after step as requests finish; its records say which source won and how many
documents the corpus held; a reset is exact; the keys are validated; the plugin installs the corpus delivery.
Without CUDA the Triton kernels run in the interpreter; with CUDA the drafting runs on the GPU (the kernels cannot
read CPU tensors there). The vLLM run is benchmarks/vllm_corpus.py.
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first @triton.jit definition

pytest.importorskip("vllm", reason="the vllm extra is not installed (make setup installs its CPU-side packages)")

from vllm.config import DeviceConfig, SchedulerConfig, SpeculativeConfig, VllmConfig  # noqa: E402
from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers  # noqa: E402

from hqlab.config import ConfigError  # noqa: E402
from hqlab.engines.vllm import gpu_lookup, plugin  # noqa: E402
from hqlab.engines.vllm.engine import setting_for  # noqa: E402
from hqlab.engines.vllm.gpu_lookup import GpuLookupSpeculator  # noqa: E402
from hqlab.rules.corpus import Corpus, propose  # noqa: E402
from hqlab.trace import Source  # noqa: E402

SLOTS, WIDTH, VOCAB = 4, 512, 151936
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where the kernels can run


def vllm_config(spec: str, k: int) -> VllmConfig:
    """A real VllmConfig on the CPU (ModelConfig needs a GPU platform: the fields the speculator reads stand in)."""
    config = VllmConfig(device_config=DeviceConfig(device="cpu"),
                        speculative_config=SpeculativeConfig(method="custom_class", model=gpu_lookup.CLASS_PATH,
                                                             num_speculative_tokens=k),
                        scheduler_config=SchedulerConfig(max_num_seqs=SLOTS, max_model_len=WIDTH,
                                                         is_encoder_decoder=False),
                        additional_config={gpu_lookup.SPEC_KEY: spec, gpu_lookup.RECORD_KEY: True})
    object.__setattr__(config, "model_config", SimpleNamespace(max_model_len=WIDTH, get_vocab_size=lambda: VOCAB))
    return config


def words() -> np.ndarray:
    """Real text as token ids (one per word of the repository's README): natural repetition across requests."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    ids: dict[str, int] = {}
    return np.array([ids.setdefault(w, len(ids)) for w in re.findall(r"\w+|[^\w\s]", text)], dtype=np.int64)


def batch(rows: list[int], ids: list[str]) -> InputBatch:
    made = InputBatch.make_dummy(len(rows), len(rows), InputBuffers(SLOTS, 64, DEVICE))
    return dataclasses.replace(made, idx_mapping=torch.tensor(rows, dtype=torch.int32, device=DEVICE),
                               idx_mapping_np=np.array(rows, dtype=np.int32), req_ids=ids)


SPECS = ["gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest,corpus=600",
         "gpu-lookup:nmin=2,nmax=8,k=7,corpus=300,corpus_policy=longest,corpus_docs=3",
         "gpu-lookup:nmin=1,nmax=16,k=7,policy=earliest,corpus=2000,corpus_prompts=1,corpus_policy=longest"]


@pytest.mark.parametrize("spec", SPECS)
def test_drafts_equal_the_rule_over_the_logged_corpus(spec):
    """Requests run in waves of SLOTS, each drafting a few steps; finished ones reach the corpus through
    `corpus_step` (what the plugin calls from vLLM's runner), and every draft equals the rule's over the corpus the
    log rebuilds, with the same source and the same count of documents."""
    config = gpu_lookup.lookup_config(spec)
    speculator = GpuLookupSpeculator(vllm_config(spec, config.k), device=DEVICE)
    rows = torch.zeros(SLOTS, WIDTH, dtype=torch.int32, device=DEVICE)
    lengths = torch.zeros(SLOTS, dtype=torch.int32, device=DEVICE)
    speculator.bind(rows, lengths)
    text, rng = words(), np.random.default_rng(0)
    log: list[dict] = []
    finished: list[tuple[str, list[int], list[int]]] = []
    outputs: dict[str, tuple[list[int], list[int]]] = {}
    sources = set()
    for wave in range(4):
        ids = [f"w{wave}r{i}" for i in range(SLOTS)]
        speculator.corpus_step(finished, ids)  # last wave's documents, this wave's admissions
        log += speculator.take_corpus_log()
        finished = []
        full = {}
        for slot, rid in enumerate(ids):
            start = int(rng.integers(0, len(text) - 400))
            prompt_len = int(rng.integers(20, 120))
            full[rid] = text[start : start + prompt_len + 150]
            outputs[rid] = (full[rid][:prompt_len].tolist(), [])
        for step in range(3):
            for slot, rid in enumerate(ids):  # each step emits a few tokens per request
                prompt = outputs[rid][0]
                n = len(prompt) + 20 * (step + 1) + slot
                rows[slot, :n] = torch.from_numpy(full[rid][:n].astype(np.int32))
                lengths[slot] = n
                outputs[rid] = (prompt, full[rid][len(prompt):n].tolist())
            order = list(rng.permutation(SLOTS))
            drafts = speculator.propose(batch(order, [ids[s] for s in order]))
            records = {r["request"]: r for r in speculator.take_records()}
            for i, slot in enumerate(order):
                rid = ids[slot]
                reference = Corpus(config.corpus_config)
                seen = records[rid]["corpus_docs"]
                for doc in log[:seen]:
                    p, o = outputs[doc["request"]]
                    assert reference.add(p + o if config.corpus_prompts else o) == doc["seq"]
                history = np.asarray(rows[slot, : int(lengths[slot])].cpu().numpy(), dtype=np.int64)
                source, want = propose(history, reference, nmin=config.nmin, nmax=config.nmax, k=config.k,
                                       policy=config.policy)
                got = drafts[i].tolist()
                assert got[: want.valid] == want.tokens.tolist(), (spec, wave, step, rid)
                assert got[want.valid:] == [speculator.pad] * (config.k - want.valid)
                assert (records[rid]["source"], records[rid]["match_len"]) == (source, want.match_len)
                tag = Source.CORPUS if source == "corpus" else Source.LOOKUP
                assert records[rid]["sources"] == [int(tag)] * want.valid
                sources.add(source)
        finished = [(rid, *outputs[rid]) for rid in ids]
    assert {"own", "corpus"} <= sources  # both sources won somewhere
    assert [d["seq"] for d in log] == list(range(len(log))) and len(log) == 3 * SLOTS


def test_reset_drops_what_was_on_its_way_and_starts_numbering_again():
    spec = SPECS[0]
    speculator = GpuLookupSpeculator(vllm_config(spec, 15), device="cpu")
    speculator.corpus_step([], ["a", "b"])
    speculator.corpus_step([("a", [1, 2], [3, 4, 5])], ["c"])
    assert [(d["seq"], d["request"], d["length"]) for d in speculator.take_corpus_log()] == [(0, "a", 3)]
    speculator.reset_corpus()
    # b and c were admitted before the reset: their documents arrive after it and are not added
    speculator.corpus_step([("b", [1], [7, 8]), ("c", [1], [9])], ["d"])
    speculator.corpus_step([("d", [1], [])], [])  # an empty output adds nothing
    speculator.corpus_step([("d", [1], [6, 6])], [])  # nor is a request added twice
    assert speculator.take_corpus_log() == [] and speculator.corpus.inserted == 0 and speculator.corpus.live == 0
    speculator.corpus_step([], ["e"])
    speculator.corpus_step([("e", [1], [2, 2])], [])
    assert [(d["seq"], d["request"]) for d in speculator.take_corpus_log()] == [(0, "e")]


def test_keys_are_validated_and_reach_the_engine_setting():
    config = gpu_lookup.lookup_config("gpu-lookup:nmin=1,nmax=32,k=15,corpus=65536,corpus_policy=longest,"
                                      "corpus_prompts=1,corpus_docs=64")
    assert (config.corpus_config.tokens, config.corpus_config.docs, config.corpus_config.policy,
            config.corpus_config.prompts) == (65536, 64, "longest", True)
    assert gpu_lookup.lookup_config("gpu-lookup:k=15").corpus_config is None
    setting = setting_for("gpu-lookup:nmin=1,nmax=32,k=15,corpus=4096")
    assert setting.gpu and setting.k == 15
    for bad, fix in [("corpus=-1", "0 for none"), ("corpus=64,corpus_policy=corpus", "corpus_policy"),
                     ("corpus_policy=longest", "add corpus=N"), ("corpus_prompts=1", "add corpus=N"),
                     ("corpus=64,full=true", "full=true"), ("corpus=64,corpus_docs=0", "docs"),
                     ("corpus=abc", "integer")]:
        with pytest.raises(ConfigError, match=fix):
            gpu_lookup.lookup_config(f"gpu-lookup:k=15,{bad}")


def test_plugin_installs_the_corpus_delivery_for_corpus_configs_only():
    from vllm.v1.core.sched.scheduler import Scheduler

    plugin.register()
    assert getattr(Scheduler.schedule, "_hqlab_patched", False)
    assert getattr(Scheduler._free_request, "_hqlab_patched", False)
    plugin._patch_finish_requests()
    plugin._patch_finish_requests()  # idempotent
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    assert getattr(GPUModelRunner.finish_requests, "_hqlab_patched", False)
    assert not getattr(GPUModelRunner.finish_requests.__wrapped__, "_hqlab_patched", False)
    assert plugin._corpus_prompts(vllm_config(SPECS[2], 7)) is True
    assert plugin._corpus_prompts(vllm_config(SPECS[0], 15)) is False
    assert plugin._corpus_prompts(vllm_config("gpu-lookup:k=15", 15)) is None  # no corpus: nothing delivered


def test_finished_requests_travel_from_the_scheduler_to_the_speculator():
    """The plugin's three steps on vLLM's own Request and SchedulerOutput objects: the scheduler frees a finished
    request (its exact ids are kept), the next scheduler output carries them, the runner hands them to the
    speculator with the step's new requests. A scheduler of a config without a corpus keeps nothing."""
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
    from vllm.v1.request import Request

    def request(rid, prompt, output):
        r = Request(rid, prompt, SamplingParams(max_tokens=8), None)
        r.append_output_token_ids(output)
        return r

    config = vllm_config(SPECS[0], 15)
    scheduler = SimpleNamespace(vllm_config=config)
    runner = SimpleNamespace(speculator=GpuLookupSpeculator(config, device="cpu"))
    a, b = request("a-1", [1, 2, 3], [4, 5, 6, 7]), request("b-2", [9], [8])
    first = SchedulerOutput.make_empty()
    first.scheduled_new_reqs = [NewRequestData.from_request(r, ([],)) for r in (a, b)]
    plugin._attach_freed(scheduler, first)
    plugin._deliver(runner, first)  # admits a and b
    plugin._note_freed(scheduler, b)
    plugin._note_freed(scheduler, a)
    a.append_output_token_ids([99])  # vLLM's lists are not ours: the copy keeps what was freed
    second = SchedulerOutput.make_empty()
    plugin._attach_freed(scheduler, second)
    assert getattr(second, plugin.CORPUS_DOCS) == [("b-2", [9], [8]), ("a-1", [1, 2, 3], [4, 5, 6, 7])]
    plugin._deliver(runner, second)
    assert [(d["seq"], d["request"], d["length"]) for d in runner.speculator.take_corpus_log()] == \
        [(0, "b-2", 1), (1, "a-1", 4)]
    third = SchedulerOutput.make_empty()
    plugin._attach_freed(scheduler, third)
    assert getattr(third, plugin.CORPUS_DOCS) == []  # each freed request travels once
    plain = SimpleNamespace(vllm_config=vllm_config("gpu-lookup:k=15", 15))
    plugin._note_freed(plain, a)
    out = SchedulerOutput.make_empty()
    plugin._attach_freed(plain, out)
    assert not hasattr(out, plugin.CORPUS_DOCS) and "_hqlab_freed" not in plain.__dict__


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_corpus_drafting_sees_documents_added_after_capture():
    """The drafting step with the corpus, captured in CUDA graphs before any document arrived, drafts exactly what
    the rule drafts once documents have entered (the ring's tensors and its [head, live] state are the graph's),
    also after a reset."""
    config = gpu_lookup.lookup_config("gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest,corpus=4096,"
                                      "corpus_policy=longest")
    text = words()
    rows = torch.zeros(SLOTS, WIDTH, dtype=torch.int32, device="cuda")
    lengths = torch.zeros(SLOTS, dtype=torch.int32, device="cuda")
    s = GpuLookupSpeculator.standalone(config, max_num_reqs=SLOTS, max_model_len=WIDTH, pad=VOCAB - 1, device="cuda",
                                       record=True)
    s.bind(rows, lengths)
    s.use_graphs = True
    s.capture()
    assert len(s.graphs) == SLOTS
    for round_ in range(2):
        s.reset_corpus()
        docs = [text[300 * i + 40 * round_: 300 * i + 40 * round_ + 250].tolist() for i in range(6)]
        s.corpus_step([], [f"d{i}" for i in range(6)])
        s.corpus_step([(f"d{i}", [], d) for i, d in enumerate(docs)], [])
        reference = Corpus(config.corpus_config)
        for d in docs:
            reference.add(d)
        histories = [np.concatenate([text[2000 + 90 * j: 2000 + 90 * j + 60], docs[j][: 30 + 17 * j]])
                     for j in range(SLOTS)]
        for j, h in enumerate(histories):
            rows[j, : len(h)] = torch.from_numpy(h.astype(np.int32)).cuda()
            lengths[j] = len(h)
        drafts = s.lookup(torch.arange(SLOTS, dtype=torch.int32, device="cuda"), SLOTS).cpu()
        for j, h in enumerate(histories):
            _, want = propose(h, reference, nmin=1, nmax=32, k=15, policy="earliest")
            assert drafts[j, : want.valid].tolist() == want.tokens.tolist(), (round_, j)
            assert (drafts[j, want.valid:] == VOCAB - 1).all()
