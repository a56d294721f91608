"""Workloads: the built-in suites, JSONL files with errors that name file and line, and the one chat encoding."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from hqlab.workloads import WorkloadError, encode_chat, load_workload, read_jsonl

HQLAB = Path(__file__).resolve().parents[1] / "hqlab"


def _write(tmp_path, lines, name="w.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "ok"}', '{"prompt": "fine"}', '{"prompt": "broken'], ":3: invalid JSON"),
    (['{"prompt": 5}'], ":1: 'prompt' must be a non-empty string"),
    (['{"prompt": "a", "turns": ["b"]}'], ":1: give exactly one of 'prompt' or 'turns'"),
    (['{"text": "a"}'], ":1: give exactly one of 'prompt' or 'turns'"),
    (['["prompt"]'], ":1: expected a JSON object"),
    (['{"turns": []}'], ":1: 'turns' must be a non-empty list"),
    (['{"turns": ["hi", "hello"]}'], ":1: the last turn must be the user's"),
    (['{"turns": [{"role": "robot", "content": "x"}]}'], ":1: turn 0 must be"),
    (['{"prompt": "a", "id": "x"}', '{"prompt": "b", "id": "x"}'], ":2: duplicate id 'x'"),
    (['{"prompt": "a", "category": 3}'], ":1: 'id' and 'category' must be strings"),
    ([""], "no prompts (empty file)"),
])
def test_malformed_workloads_name_file_and_line(tmp_path, lines, message):
    path = _write(tmp_path, lines)
    with pytest.raises(WorkloadError) as e:
        read_jsonl(path)
    assert message in str(e.value) and str(path) in str(e.value)


def test_binary_workload_file(tmp_path):
    path = tmp_path / "blob.jsonl"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    with pytest.raises(WorkloadError, match="not UTF-8"):
        read_jsonl(path)


def test_good_workload_forms(tmp_path):
    path = _write(tmp_path, [json.dumps({"prompt": "hi"}),
                             json.dumps({"turns": ["q", "a", "q2"], "category": "multi", "id": "t"}),
                             json.dumps({"turns": [{"role": "system", "content": "be brief"},
                                                   {"role": "user", "content": "q"}]})])
    prompts = load_workload(str(path))
    assert [p.category for p in prompts] == ["custom", "multi", "custom"]
    assert [m["role"] for m in prompts[1].messages] == ["user", "assistant", "user"]
    assert prompts[0].id == "w-1"


def test_builtin_suites():
    assert [p.id for p in load_workload("labd")] == ["copy", "code", "edit", "quote", "summary", "qa"]
    chat = load_workload("chat")
    assert len(chat) == 8 and {p.category for p in chat} == {"chat"}
    assert len(load_workload("all")) == 14
    assert "Warning:" in load_workload("copy")[0].messages[0]["content"]


class _Tokenizer:
    """Renders a chat as the template would and tokenizes one id per character, counting special tokens added."""

    def __init__(self):
        self.calls = []

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        self.calls.append((add_generation_prompt, tokenize))
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text, add_special_tokens):
        return [ord(c) for c in text] + ([0] if add_special_tokens else [])


def test_encode_chat_renders_the_template_with_the_generation_prompt():
    tok = _Tokenizer()
    prompt = load_workload("chat")[0]
    ids = encode_chat(tok, prompt.messages)
    assert tok.calls == [(True, False)] and 0 not in ids
    assert "".join(map(chr, ids)) == f"<user>{prompt.messages[0]['content']}<assistant>"


def test_chat_prompts_are_encoded_in_one_function_only():
    """Every engine, the trace cache and self-generation encode prompts through `encode_chat`, and the serving
    benchmarks render them through `render_chat`, which it calls: the chat template is applied nowhere else."""
    users = []
    for path in HQLAB.rglob("*.py"):
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                    isinstance(c, ast.Call) and getattr(c.func, "attr", None) == "apply_chat_template"
                    for c in ast.walk(fn)):
                users.append(f"{path.relative_to(HQLAB)}:{fn.name}")
    assert users == ["workloads.py:render_chat"]
