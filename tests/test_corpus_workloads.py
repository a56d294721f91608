"""The corpus workloads (data/workloads/corpus_*.jsonl, issue #42): they parse as request logs, match their recorded
hashes, every input comes from the frozen handbook as the generator builds it, later turns re-send what the client
would, and the assistant messages are the recorded greedy outputs of the requests before them. The records job (no
model ran for it) is one instruction over distinct paragraphs of the handbook, as many as 10 waves at 32 in flight."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from hqlab.io import sha256_file
from hqlab.workloads import DOCUMENT, WorkloadError, read_requests

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = REPO / "data" / "workloads"
META = json.loads((WORKLOADS / "corpus_workloads.meta.json").read_text())
NAMES = ("multiturn", "template", "agent", "batch", "records")
COUNTS = {"multiturn": 24, "template": 24, "agent": 32, "batch": 153, "records": 335}
DECODED = ("multiturn", "template", "agent", "batch")  # made with the model's greedy answers, each request traced


def _generator():
    path = REPO / "experiments" / "corpus_workloads" / "corpus_workloads.py"
    spec = importlib.util.spec_from_file_location("corpus_workloads", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("corpus_workloads", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def requests():
    return {w: read_requests(WORKLOADS / f"corpus_{w}.jsonl") for w in NAMES}


@pytest.fixture(scope="module")
def traces():
    from hqlab.replay.traces import load_traces

    return {t.prompt_id: t for t in load_traces(REPO / META["traces"]) if t.category in NAMES}


def test_files_match_their_recorded_hashes_and_source():
    assert set(META["files"]) == {f"corpus_{w}.jsonl" for w in NAMES}
    for name, digest in META["files"].items():
        assert sha256_file(WORKLOADS / name) == digest, name
    assert META["source_sha256"] == sha256_file(DOCUMENT)
    assert META["model"] == "qwen2.5-coder-0.5b" and META["max_new_tokens"] == 128
    records = META["made"]["corpus_records.jsonl"]  # written as built: no model, so nothing machine-dependent
    assert records["prompts_only"] is True and records["model"] is None
    assert records["source_sha256"] == sha256_file(DOCUMENT)


@pytest.mark.parametrize("name", NAMES)
def test_request_logs_parse_with_their_fields(requests, name):
    reqs = requests[name]
    assert len(reqs) == COUNTS[name]
    assert {r.workload for r in reqs} == {name}
    assert all(r.messages[-1]["role"] == "user" for r in reqs)
    # sent in waves: every session's turn t before any turn t + 1
    assert [r.turn for r in reqs] == sorted(r.turn for r in reqs)
    assert len({r.id for r in reqs}) == len(reqs)


def test_inputs_come_from_the_handbook(requests):
    gen = _generator()
    text = DOCUMENT.read_text(encoding="utf-8")
    sections = gen.handbook_sections(text)
    entries = gen.template_entries(text)
    for r, entry in zip(requests["template"], entries, strict=True):
        assert r.messages[1]["content"] == gen.TEMPLATE.format(entry=entry)
        assert entry in text
    # the batch job: the same instruction over every level-3 entry, in the handbook's order
    entries = gen.batch_entries(text)
    assert len(entries) == len([line for line in text.splitlines() if line.startswith("### ")]) == 153
    for r, entry in zip(requests["batch"], entries, strict=True):
        assert list(r.messages) == [{"role": "system", "content": gen.TEMPLATE_SYSTEM},
                              {"role": "user", "content": gen.TEMPLATE.format(entry=entry)}]
        assert entry in text and entry.startswith("### ") and len(entry) <= 1400
    assert entries[:3] != gen.template_entries(text)[:3]  # not the template's FAQ entries first
    # the records job is the generator's, so the same file every run
    assert [list(r.messages) for r in requests["records"]] == [s.request() for s in gen.records_sessions(text)]
    for r in requests["multiturn"]:
        if r.turn == 0:
            material = r.messages[0]["content"].rsplit("\n\n", 1)[0].removeprefix("```python\n").removesuffix("\n```")
            assert material in text, r.id
    # every tool result is what the harness returns for the call before it
    for r in requests["agent"]:
        assert r.messages[0]["content"] == gen.AGENT_SYSTEM
        for call, result in zip(r.messages[2::2], r.messages[3::2]):
            expected = gen.run_tool(call["content"], sections)
            assert result["content"] == (gen.AGENT_NEXT_TASK if expected is None else f"Tool result:\n{expected}")


def test_records_are_one_instruction_over_distinct_handbook_paragraphs(requests):
    """Enough requests for 10 waves at 32 in flight in one pass; every request the same system prompt and instruction
    (not the batch job's) over a passage that is a whole paragraph or list of the handbook, outside its code and
    tables, or one clipped at a sentence end, in the handbook's order, none twice, under its section's title."""
    gen = _generator()
    text = DOCUMENT.read_text(encoding="utf-8")
    reqs = requests["records"]
    assert 320 <= len(reqs) <= 400
    assert [(r.session, r.turn) for r in reqs] == [(f"records-{i:03d}", 0) for i in range(len(reqs))]
    head, rest = gen.RECORDS.split("{section}")
    between, instruction = rest.split("{passage}")
    assert instruction.startswith("\n\nReturn only a JSON object") and '"question"' in instruction
    assert gen.RECORDS_SYSTEM != gen.TEMPLATE_SYSTEM and instruction not in gen.TEMPLATE
    paragraphs = {p.strip("\n") for p in re.split(r"\n{2,}", text)}
    fences = [m.start() for m in re.finditer(r"^```", text, flags=re.M)]
    code = list(zip(fences[::2], fences[1::2]))
    headings = [(m.start(), m.group(1).strip()) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)
                if not any(a < m.start() < b for a, b in code)]
    passages, at = [], -1
    for r in reqs:
        assert len(r.messages) == 2 and r.messages[0] == {"role": "system", "content": gen.RECORDS_SYSTEM}
        user = r.messages[1]["content"]
        assert user.startswith(head) and user.endswith(instruction), r.id
        section, passage = user[len(head):-len(instruction)].split(between)
        assert gen.RECORDS_MIN_CHARS <= len(passage) <= gen.RECORDS_MAX_CHARS, r.id
        whole = passage in paragraphs
        clipped = [p for p in paragraphs if p.startswith(passage) and len(p) > gen.RECORDS_MAX_CHARS]
        assert whole or (clipped and passage[-1] in ".!?"), r.id
        at = text.index(passage, at + 1)  # in document order
        assert not any(a < at < b for a, b in code), r.id
        assert not passage.startswith(("#", "|", "```", "<!--")), r.id
        assert section == [t for start, t in headings if start < at][-1], r.id
        passages.append(passage)
    assert len(set(passages)) == len(passages)


def test_later_turns_resend_the_conversation(requests):
    for name in NAMES:
        by_session: dict[str, list] = {}
        for r in requests[name]:
            by_session.setdefault(r.session, []).append(r)
        for session, turns in by_session.items():
            for before, after in zip(turns, turns[1:]):
                shared = after.messages[: len(before.messages)]
                edited = session in ("multiturn-code-0", "multiturn-code-1") and after.turn == 2
                retried = session == "multiturn-text-0" and after.turn == 2
                if edited:  # the edited message replaces the change request and its answer
                    assert after.messages[:-1] == before.messages[:-1]
                    assert after.messages[-1] != before.messages[-1]
                elif retried:  # the same request sent again
                    assert after.messages == before.messages
                else:
                    assert shared == before.messages and after.messages[len(before.messages)]["role"] == "assistant"


def test_request_log_errors_name_file_and_line(tmp_path):
    good = {"workload": "w", "session": "s", "turn": 0, "messages": [{"role": "user", "content": "q"}]}
    cases = [
        ({**good, "extra": 1}, ":1: expected an object with exactly the keys"),
        ({**good, "turn": 1}, ":1: session 's' expects turn 0, got 1"),
        ({**good, "session": ""}, ":1: 'workload' and 'session' must be non-empty strings"),
        ({**good, "messages": []}, ":1: 'messages' must be a non-empty list"),
        ({**good, "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
         ":1: the last turn must be the user's"),
    ]
    for obj, message in cases:
        path = tmp_path / "r.jsonl"
        path.write_text(json.dumps(obj) + "\n")
        with pytest.raises(WorkloadError) as e:
            read_requests(path)
        assert message in str(e.value) and str(path) in str(e.value)


@pytest.mark.slow
def test_assistant_messages_are_the_recorded_greedy_outputs(requests, traces):
    """The tokenizer turns every request into its trace's prompt, and every assistant message a later turn carries
    is the decoded output of the request that produced it."""
    from transformers import AutoTokenizer

    from hqlab import models
    from hqlab.workloads import encode_chat

    tok = AutoTokenizer.from_pretrained(models.prepare("qwen2.5-coder-0.5b"))
    assert len(traces) == sum(len(requests[name]) for name in DECODED)
    assert not {t.category for t in traces.values()} - set(DECODED)  # the records job has none
    for name in DECODED:
        answers: dict[tuple[str, int], str] = {}
        for r in requests[name]:
            trace = traces[r.id]
            assert trace.category == name
            assert trace.prompt_ids == encode_chat(tok, r.messages), r.id
            answers[(r.session, r.turn)] = tok.decode(trace.output_ids, skip_special_tokens=True)
            carried = [m["content"] for m in r.messages if m["role"] == "assistant"]
            produced = [answers[(r.session, t)] for t in range(r.turn)]
            assert set(carried) <= set(produced), r.id  # an edited or retried turn drops the answer it replaces
            assert len(carried) >= min(r.turn, 1) or name in ("template", "batch")
