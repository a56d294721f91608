"""Workloads: the HyperQwen task suite over one frozen document, short chat prompts, and user JSONL files.

Suite names: `labd` (the six document tasks), each task alone (`copy`, `code`, `edit`, `quote`, `summary`,
`qa`), `chat` (short real prompts), `all` (both). Anything else is read as a JSONL file path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from hqlab.io import REPO, json_lines

DATA_DIR = REPO / "data"
DOCUMENT = DATA_DIR / "documents" / "handbook.md"
CHAT_PROMPTS = DATA_DIR / "workloads" / "chat.jsonl"

# The instructions of the six document tasks (SPEC §3), phrased so they work for any prefix of the document.
TASKS: dict[str, str] = {
    # Naming the first line matters: asked only to "reproduce the document", the 0.5B model copies its first code
    # block and stops (214 tokens); anchored on the first line it copies from the start for 640+ tokens.
    "copy": "Repeat the document above exactly, word for word, from its first line to its last line, starting "
            "with the line \"{first_line}\". Output only the document.",
    "code": "List every shell command that appears in the document above, verbatim and in order of appearance, "
            "one per line. Output only the commands.",
    "edit": "Rewrite the first section of the document above (from the title down to the second heading) so that "
            "it is about half as long. Keep every shell command and code block exactly as written.",
    "quote": "Quote, word for word, every sentence of the document above that begins with \"Warning:\" or "
             "\"Caution:\". After each quote, explain in one sentence why it matters.",
    "summary": "Summarize the document above in three short paragraphs.",
    "qa": "What is the software described in the document above for, and what are the first steps to install "
          "and start it? Answer briefly.",
}
SUITES = {"labd": list(TASKS), **{t: [t] for t in TASKS}}


class WorkloadError(ValueError):
    pass


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    messages: tuple[dict[str, str], ...]


def render_chat(tokenizer: Any, messages: Sequence[dict[str, str]]) -> str:
    """A chat as the text the model answers: the tokenizer's chat template with the generation prompt. The one
    rendering of prompts: `encode_chat` tokenizes it, and the serving benchmarks send it to `vllm serve`."""
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)


def encode_chat(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """A chat's token ids, ready for the model to answer: `render_chat`, tokenized without adding special tokens
    again. The one encoding of prompts: every engine, the trace cache (whose keys hold these ids) and
    self-generation use it."""
    return list(tokenizer.encode(render_chat(tokenizer, messages), add_special_tokens=False))


def suite_names() -> list[str]:
    return sorted([*SUITES, "chat", "all"])


def read_document(doc_tokens: int | None = None, tokenizer: Any = None, path: Path = DOCUMENT) -> str:
    """The frozen document, cut at a line break to at most `doc_tokens` tokens (None = whole document)."""
    text = path.read_text(encoding="utf-8")
    if doc_tokens is None:
        return text
    if tokenizer is None:
        raise WorkloadError("doc_tokens needs a tokenizer to count tokens")
    if doc_tokens < 64:
        raise WorkloadError(f"doc_tokens must be >= 64 (got {doc_tokens})")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= doc_tokens:
        return text
    prefix = tokenizer.decode(ids[:doc_tokens])
    # Cut at a paragraph break outside any code fence: a document that ends inside an open ``` block makes the
    # model continue the block instead of following the instruction.
    cut = prefix.rfind("\n\n")
    while cut > 0 and prefix[:cut].count("```") % 2:
        cut = prefix.rfind("\n\n", 0, cut)
    return prefix[: cut + 1] if cut > 0 else prefix


def document_prompt(task: str, document: str) -> Prompt:
    first_line = next((line for line in document.splitlines() if line.strip() and not line.startswith("<!--")), "")
    instruction = TASKS[task].replace("{first_line}", first_line)
    content = f"<document>\n{document.rstrip()}\n</document>\n\n{instruction}"
    return Prompt(id=task, category=task, messages=({"role": "user", "content": content},))


def load_workload(name_or_path: str, *, doc_tokens: int | None = None, tokenizer: Any = None) -> list[Prompt]:
    """Prompts of a named suite or a JSONL file (see `read_jsonl`)."""
    if name_or_path in SUITES or name_or_path == "all":
        document = read_document(doc_tokens, tokenizer)
        tasks = list(TASKS) if name_or_path == "all" else SUITES[name_or_path]
        prompts = [document_prompt(t, document) for t in tasks]
        return prompts + (read_jsonl(CHAT_PROMPTS) if name_or_path == "all" else [])
    if name_or_path == "chat":
        return read_jsonl(CHAT_PROMPTS)
    path = Path(name_or_path)
    if not path.exists():
        raise WorkloadError(f"unknown suite {name_or_path!r} and no such file; suites: {', '.join(suite_names())}")
    return read_jsonl(path)


def _turns_to_messages(turns: Any, where: str) -> tuple[dict[str, str], ...]:
    if not isinstance(turns, list) or not turns:
        raise WorkloadError(f"{where}: 'turns' must be a non-empty list")
    messages = []
    for i, turn in enumerate(turns):
        if isinstance(turn, str):
            messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": turn})
        elif isinstance(turn, dict) and isinstance(turn.get("content"), str) and \
                turn.get("role") in ("system", "user", "assistant"):
            messages.append({"role": turn["role"], "content": turn["content"]})
        else:
            raise WorkloadError(f"{where}: turn {i} must be a string or {{'role': system|user|assistant, "
                                f"'content': str}}, got {turn!r:.80}")
    if messages[-1]["role"] != "user":
        raise WorkloadError(f"{where}: the last turn must be the user's (the model answers it)")
    return tuple(messages)


def read_jsonl(path: Path) -> list[Prompt]:
    """One prompt per line: {"prompt": str} or {"turns": [str | {role, content}, ...]}, optional id/category.

    Errors name the file and line; nothing is returned unless every line is valid.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise WorkloadError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for lineno, where, obj in json_lines(text, path, WorkloadError):
        if not isinstance(obj, dict):
            raise WorkloadError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        if ("prompt" in obj) == ("turns" in obj):
            raise WorkloadError(f"{where}: give exactly one of 'prompt' or 'turns'")
        if "prompt" in obj:
            if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
                raise WorkloadError(f"{where}: 'prompt' must be a non-empty string")
            messages: tuple[dict[str, str], ...] = ({"role": "user", "content": obj["prompt"]},)
        else:
            messages = _turns_to_messages(obj["turns"], where)
        pid = obj.get("id", f"{path.stem}-{lineno}")
        category = obj.get("category", "custom")
        if not isinstance(pid, str) or not isinstance(category, str):
            raise WorkloadError(f"{where}: 'id' and 'category' must be strings")
        if pid in seen:
            raise WorkloadError(f"{where}: duplicate id {pid!r}")
        seen.add(pid)
        prompts.append(Prompt(pid, category, messages))
    if not prompts:
        raise WorkloadError(f"{path}: no prompts (empty file)")
    return prompts



# ----------------------------------------------------------------------------------------------------------------
# request logs: requests in the order a client sends them (the corpus workloads, data/workloads/corpus_*.jsonl)


@dataclass(frozen=True)
class Request:
    """One request of a request log: its workload, session, turn within the session and the messages it sends
    (a later turn re-sends the earlier turns' text, as a client does)."""

    workload: str
    session: str
    turn: int
    messages: tuple[dict[str, str], ...]

    @property
    def id(self) -> str:
        return f"{self.session}/{self.turn}"

    def prompt(self) -> Prompt:
        return Prompt(self.id, self.workload, self.messages)


def read_requests(path: str | Path) -> list[Request]:
    """A request log, one JSON object per line in sending order: {"workload": str, "session": str, "turn": int,
    "messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]} ending with the user's message.

    Within a session the turns are 0, 1, 2, ... in order. Errors name the file and line; nothing is returned
    unless every line is valid."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise WorkloadError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    keys = {"workload", "session", "turn", "messages"}
    out: list[Request] = []
    turns: dict[str, int] = {}
    for _, where, obj in json_lines(text, path, WorkloadError):
        if not isinstance(obj, dict) or set(obj) != keys:
            raise WorkloadError(f"{where}: expected an object with exactly the keys {sorted(keys)}")
        if not isinstance(obj["workload"], str) or not isinstance(obj["session"], str) or \
                not obj["workload"] or not obj["session"]:
            raise WorkloadError(f"{where}: 'workload' and 'session' must be non-empty strings")
        turn = obj["turn"]
        expected = turns.get(obj["session"], -1) + 1
        if not isinstance(turn, int) or isinstance(turn, bool) or turn != expected:
            raise WorkloadError(f"{where}: session {obj['session']!r} expects turn {expected}, got {turn!r}")
        turns[obj["session"]] = turn
        if not isinstance(obj["messages"], list) or not obj["messages"] or \
                not all(isinstance(m, dict) for m in obj["messages"]):
            raise WorkloadError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        out.append(Request(obj["workload"], obj["session"], turn, _turns_to_messages(obj["messages"], where)))
    if not out:
        raise WorkloadError(f"{path}: no requests (empty file)")
    return out
