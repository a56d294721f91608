"""Make the corpus workloads (issue #42): multi-turn chats, one template over many records, and an agent loop.

Every request's input comes from the project's frozen handbook (data/documents/handbook.md, CC-BY-4.0); every
assistant message is the 0.5B model's own greedy answer to the request before it, generated here. The requests are
generated in waves (all sessions' turn t, then turn t + 1), batched on the transformers engine, and written in that
order, which is the order a client running every session at once sends them:

    python experiments/corpus_workloads/corpus_workloads.py             # all, then data/results/traces/0.5b_corpus_128/
    python experiments/corpus_workloads/corpus_workloads.py --dry-run   # the first wave's prompts and their token counts
    python experiments/corpus_workloads/corpus_workloads.py --workloads prose  # traces of the control set (prose.jsonl)
    python experiments/corpus_workloads/corpus_workloads.py --workloads records  # prompts only: no model runs

Outputs: data/workloads/corpus_{multiturn,template,agent,batch,records}.jsonl, data/workloads/corpus_workloads.meta.json
(sha256 of each file, model, dtype, device, versions, settings) and the trace set of every request (the prompt's
token ids and the greedy output whose text later turns carry). The records job (PROMPTS_ONLY) is written as built,
one request per passage: nothing decoded, no traces. Greedy outputs depend on the machine's numerics, so a rerun
elsewhere may write different answers; the committed files and their hashes are the benchmark.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tqdm.auto import tqdm

from hqlab.io import REPO, sha256_file, write_atomic
from hqlab.workloads import DOCUMENT

OUT_DIR = REPO / "data" / "workloads"
TRACE_SET = "0.5b_corpus_128"  # the run of the study `traces` (hqlab.bench.results) that holds their traces
TRACES = REPO / "data" / "results" / "traces" / TRACE_SET / "traces.parquet"
META = OUT_DIR / "corpus_workloads.meta.json"
WORKLOADS = ("multiturn", "template", "agent", "batch", "records")
PROMPTS_ONLY = ("records",)  # one request per input, no assistant messages: written without running a model
CONTROLS = ("prose",)  # traces only: its request file is data/workloads/prose.jsonl


# ----------------------------------------------------------------------------------------------------------------
# the handbook


def handbook_sections(text: str) -> dict[str, str]:
    """Heading title -> the section's text (heading line included), down to the next heading of any level.
    Lines starting with '#' inside code fences are not headings; a repeated title is numbered from its second."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"^(#{1,4}) (.+)$", line)
        if m:
            title, n = m.group(2).strip(), 2
            while title in sections:  # a repeated title ("Searching") gets its number: "Searching (2)"
                title, n = f"{m.group(2).strip()} ({n})", n + 1
            current = sections[title] = []
        if current is not None:
            current.append(line)
    return {title: "\n".join(lines).strip() for title, lines in sections.items()}


def first_code_block(section: str, language: str = "python") -> str:
    m = re.search(rf"```{language}\n(.*?)```", section, flags=re.S)
    if not m:
        raise ValueError(f"no {language} block in section {section.splitlines()[0]!r}")
    return m.group(1).strip()


def clip(text: str, chars: int) -> str:
    """`text` cut at the last paragraph break before `chars` characters (whole if shorter)."""
    if len(text) <= chars:
        return text
    cut = text.rfind("\n\n", 0, chars)
    return text[:cut].strip() if cut > 0 else text[:chars]


# ----------------------------------------------------------------------------------------------------------------
# sessions: each produces its next request from the answers so far


@dataclass
class Session:
    workload: str
    name: str
    turns: int
    next_messages: Callable[["Session"], list[dict[str, str]]]
    data: dict = field(default_factory=dict)
    messages: list[dict[str, str]] = field(default_factory=list)  # the conversation so far, as the client keeps it
    sent: list[list[dict[str, str]]] = field(default_factory=list)  # what each request sent

    def request(self) -> list[dict[str, str]]:
        msgs = self.next_messages(self)
        self.sent.append(msgs)
        return msgs


CODE_SECTIONS = ["Daily error digest", "Detecting silent hosts", "Bulk import of old log files", "Sending events"]
TEXT_SECTIONS = ["Retention policies", "Durability modes", "Alert rules", "Failover"]
ARGPARSE = "Add a command-line option for the server profile name (argparse) and show the complete updated script."
ARGPARSE_EDITED = ("Add a command-line option for the server profile name using argparse, defaulting to \"prod\", "
                   "and show the complete updated script.")


def multiturn_sessions(sections: dict[str, str]) -> list[Session]:
    """Eight chats over handbook material, three requests each. Code chats: explain a script, then change it;
    in two of them the user edits the change request and sends it again (the chat UI's "edit message": the new
    request carries the history before the edited message, not the answer it replaces); in the other two the
    user asks for a test. Text chats: summarize a section, then a checklist from it; one client retries the
    checklist request unchanged (a timeout retry sends the same messages), the others ask a follow-up."""
    out = []
    for i, title in enumerate(CODE_SECTIONS):
        code = first_code_block(sections[title])
        edit = i < 2

        def step(s: Session, code=code, edit=edit) -> list[dict[str, str]]:
            t = len(s.sent)
            if t == 0:
                s.messages = [{"role": "user", "content": f"```python\n{code}\n```\n\nExplain briefly what this "
                                                          f"script does."}]
            elif t == 1:
                s.messages = s.messages + [{"role": "user", "content": ARGPARSE}]
            elif edit:  # the edited message replaces the change request and its answer
                s.messages = s.messages[:-2] + [{"role": "user", "content": ARGPARSE_EDITED}]
            else:
                s.messages = s.messages + [{"role": "user", "content": "Now write one pytest test for the "
                                                                       "updated script."}]
            return list(s.messages)

        out.append(Session("multiturn", f"multiturn-code-{i}", 3, step))
    for i, title in enumerate(TEXT_SECTIONS):
        text = clip(sections[title], 1500)
        retry = i == 0

        def step(s: Session, text=text, retry=retry) -> list[dict[str, str]]:
            t = len(s.sent)
            if t == 0:
                s.messages = [{"role": "user", "content": f"{text}\n\nSummarize this handbook section in four "
                                                          f"bullet points."}]
            elif t == 1:
                s.messages = s.messages + [{"role": "user", "content": "Turn that into a short checklist an "
                                                                       "operator can follow."}]
            elif retry:  # the client resends the same request (the answer never arrived)
                s.messages = s.messages[:-1]
            else:
                s.messages = s.messages + [{"role": "user", "content": "What goes wrong if I skip these steps? "
                                                                       "Two sentences."}]
            return list(s.messages)

        out.append(Session("multiturn", f"multiturn-text-{i}", 3, step))
    return out


TEMPLATE_SYSTEM = "You convert entries of a product handbook into knowledge-base records."
TEMPLATE = ("Entry:\n\n{entry}\n\nReturn only a JSON object with the keys \"title\" (string), \"summary\" (one "
            "sentence), \"commands\" (list of the shell commands the entry quotes, [] if none) and \"tags\" (list "
            "of up to three lowercase keywords).")
TEMPLATE_CHAPTERS = ["Frequently Asked Questions", "Troubleshooting", "Release Notes"]


def template_entries(text: str, n: int = 24) -> list[str]:
    """The first `n` level-3 entries of the FAQ, troubleshooting and release-note chapters, in that order."""
    entries: list[str] = []
    for chapter in TEMPLATE_CHAPTERS:
        body = text.split(f"\n## {chapter}\n", 1)[1].split("\n## ", 1)[0]
        parts = re.split(r"\n(?=### )", body)[1:]
        entries += [clip(p.strip(), 1400) for p in parts]
    if len(entries) < n:
        raise ValueError(f"the handbook has {len(entries)} entries in {TEMPLATE_CHAPTERS}, fewer than {n}")
    return entries[:n]


def record_sessions(workload: str, users: list[str], digits: int, system: str = TEMPLATE_SYSTEM) -> list[Session]:
    """One request per user message, after the job's system prompt: no conversation (a batch job)."""
    out = []
    for i, user in enumerate(users):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        out.append(Session(workload, f"{workload}-{i:0{digits}d}", 1, lambda s, msgs=msgs: list(msgs)))
    return out


def template_sessions(text: str) -> list[Session]:
    """A batch job: one instruction over 24 handbook entries, one request each (no conversation)."""
    return record_sessions("template", [TEMPLATE.format(entry=e) for e in template_entries(text)], 2)


def batch_entries(text: str) -> list[str]:
    """Every level-3 entry of the handbook, in its order, each down to the next heading (code fences respected) and
    clipped as the template's are: the records a batch job over the whole handbook would convert."""
    entries = [clip(body.strip(), 1400) for body in handbook_sections(text).values() if body.startswith("### ")]
    if not entries:
        raise ValueError("the handbook has no level-3 entries")
    return entries


def batch_sessions(text: str) -> list[Session]:
    """The template's instruction over every level-3 entry of the handbook (153), one request each: a batch job long
    enough that its first wave, which finds the corpus empty, is a small part of it (with 8 in flight, 1 in 19)."""
    return record_sessions("batch", [TEMPLATE.format(entry=e) for e in batch_entries(text)], 3)


RECORDS_SYSTEM = "You write the FAQ of a product's support site from passages of the product's operator handbook."
RECORDS = ("Section: {section}\n\nPassage:\n\n{passage}\n\nReturn only a JSON object with the keys \"question\" (a "
           "question a user of the product would ask that the passage answers), \"answer\" (two sentences at most), "
           "\"section\" (the section title above) and \"keywords\" (list of up to three lowercase keywords).")
RECORDS_MIN_CHARS = 80  # shorter blocks are lead-ins to a code block ("On the primary:") or half a sentence
RECORDS_MAX_CHARS = 1400


def handbook_blocks(text: str) -> list[tuple[str, str]]:
    """(section title, block) for every text block of the handbook in order: each run of non-blank lines outside code
    fences that is neither a heading, a table nor a comment, i.e. a prose paragraph or a list; the title is the
    nearest heading above it, as written."""
    out: list[tuple[str, str]] = []
    lines: list[str] = []
    title, fenced = "", False

    def flush() -> None:
        if lines and not lines[0].startswith(("|", "<!--")):
            out.append((title, "\n".join(lines)))
        lines.clear()

    for line in text.splitlines():
        heading = None if fenced else re.match(r"^#{1,6} (.+)$", line)
        if line.startswith("```") or heading or not line.strip():
            flush()
            fenced = fenced != line.startswith("```")
            title = heading.group(1).strip() if heading else title
        elif not fenced:
            lines.append(line)
    flush()
    return out


def clip_sentences(text: str, chars: int) -> str:
    """`text` cut after the last sentence that ends before `chars` characters (whole if shorter)."""
    if len(text) <= chars:
        return text
    ends = [m.end() for m in re.finditer(r"[.!?](?=\s)", text[:chars])]
    return text[:ends[-1]] if ends else clip(text, chars)


def records_passages(text: str) -> list[tuple[str, str]]:
    """(section title, passage): every prose paragraph and list of the handbook of at least RECORDS_MIN_CHARS, in
    document order, clipped at a sentence end before RECORDS_MAX_CHARS (the handbook's longest block has 661)."""
    return [(title, clip_sentences(block, RECORDS_MAX_CHARS)) for title, block in handbook_blocks(text)
            if len(block) >= RECORDS_MIN_CHARS]


def records_sessions(text: str) -> list[Session]:
    """Another batch job, of the template's kind (one fixed instruction whose answers share a JSON structure) over
    other inputs: an FAQ entry from every passage of the handbook (335), one request each, in document order."""
    prompts = [RECORDS.format(section=title, passage=p) for title, p in records_passages(text)]
    return record_sessions("records", prompts, 3, system=RECORDS_SYSTEM)


AGENT_SYSTEM = """You are an operations assistant for the Lantern log search service. You work by calling tools. \
Reply with exactly one JSON object and nothing else, one of:
{"tool": "search_handbook", "query": "<a few keywords>"}  -- lists the handbook sections that match
{"tool": "read_section", "title": "<a section title>"}  -- returns the text of that section
{"tool": "answer", "text": "<your final answer to the user>"}  -- ends the task

Example. User: How do I check the server's health?
You: {"tool": "search_handbook", "query": "health check"}
User: Tool result:
Sections:
- Checking health
You: {"tool": "read_section", "title": "Checking health"}
User: Tool result:
### Checking health
...
You: {"tool": "answer", "text": "Run `lantern status`; it reports ..."}"""

AGENT_TASKS = [
    "Ingest on our Lantern server has become slow. What should I check first?",
    "How do I restore a single stream from a snapshot?",
    "I want an alert when a host stops sending logs. How do I set that up?",
    "The disk of our Lantern server is filling up. What can I do?",
    "How do I upgrade a single Lantern server safely?",
    "How do I run Lantern behind a reverse proxy with TLS?",
    "An agent reports \"certificate verify failed\". How do I fix it?",
    "How do I create a personal token and send a test event?",
]
AGENT_STEPS = 4
AGENT_NEXT_TASK = "Thanks. Which exact command would I run first for that?"
RESULT_CHARS = 900
TOOLS = ("search_handbook", "read_section", "answer")


def _words(s: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", s.lower()))


def run_tool(call_text: str, sections: dict[str, str]) -> str | None:
    """The tool's result for the model's reply, as the agent's harness returns it; None when the reply was the
    final answer. Unparseable replies get an error, as agent harnesses answer them."""
    m = re.search(r"\{.*\}", call_text, flags=re.S)
    try:
        call = json.loads(m.group(0)) if m else None
    except json.JSONDecodeError:
        call = None
    if not isinstance(call, dict):
        return "Error: reply with exactly one JSON object, as the system prompt shows."
    if call.get("tool") not in TOOLS:
        return f"Error: unknown tool {call.get('tool')!r}. The tools are {', '.join(TOOLS)}."
    if call["tool"] == "answer":
        return None
    if call["tool"] == "search_handbook":
        q = _words(str(call.get("query", "")))
        scored = sorted(((len(q & _words(t + " " + body[:400])), -i, t)
                         for i, (t, body) in enumerate(sections.items())), reverse=True)
        hits = [t for score, _, t in scored[:4] if score > 0]
        return "Sections:\n" + "\n".join(f"- {t}" for t in hits) if hits else "No matching sections."
    title = str(call.get("title", ""))
    best = max(sections, key=lambda t: (t.lower() == title.lower(), len(_words(title) & _words(t)), -len(t)))
    if not _words(title) & _words(best):
        return f"No section titled {title!r}."
    return clip(sections[best], RESULT_CHARS)


def agent_sessions(sections: dict[str, str]) -> list[Session]:
    """Eight tool-using tasks, four requests each: every request re-sends the system prompt, the task and every
    call and result so far (as agent loops do); a final answer is followed by the user's next question."""
    out = []
    for i, task in enumerate(AGENT_TASKS):
        def step(s: Session, task=task) -> list[dict[str, str]]:
            if not s.sent:
                s.messages = [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": task}]
            else:
                result = run_tool(s.messages[-1]["content"], sections)
                s.messages = s.messages + [{"role": "user", "content": AGENT_NEXT_TASK if result is None
                                            else f"Tool result:\n{result}"}]
            return list(s.messages)

        out.append(Session("agent", f"agent-{i}", AGENT_STEPS, step))
    return out


def prose_sessions() -> list[Session]:
    """The control: data/workloads/prose.jsonl (single prompts where nothing should be reused), for traces only."""
    from hqlab.workloads import read_jsonl

    return [Session("prose", p.id, 1, lambda s, m=list(p.messages): list(m))
            for p in read_jsonl(OUT_DIR / "prose.jsonl")]


def build_sessions(which: list[str]) -> dict[str, list[Session]]:
    text = DOCUMENT.read_text(encoding="utf-8")
    sections = handbook_sections(text)
    makers = {"multiturn": lambda: multiturn_sessions(sections), "template": lambda: template_sessions(text),
              "batch": lambda: batch_sessions(text), "records": lambda: records_sessions(text),
              "agent": lambda: agent_sessions(sections), "prose": prose_sessions}
    return {w: makers[w]() for w in which}


# ----------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default="float32", help="float32: bf16 prefill is ~4x slower on CPUs without bf16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="requests decoded together (one wave at most)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core CPU)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--dry-run", action="store_true", help="print the first wave's token counts, decode nothing")
    args = ap.parse_args(argv)
    which = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in which if w not in WORKLOADS + CONTROLS]
    if bad or not which:
        ap.error(f"unknown workload(s) {bad}; choose from {', '.join(WORKLOADS + CONTROLS)}")
    if args.batch < 1 or args.max_new_tokens < 1 or args.threads < 1:
        ap.error("--batch, --max-new-tokens and --threads must be >= 1")

    import torch

    from hqlab import models, provenance
    from hqlab.bench import results
    from hqlab.config import DecodeConfig
    from hqlab.replay.traces import Trace, TraceOrigin, load_traces, save_traces, shipped_model
    from hqlab.workloads import encode_chat

    torch.set_num_threads(args.threads)
    sessions = build_sessions(which)
    if args.dry_run:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(models.prepare(args.model))
        for w, ss in sessions.items():
            lens = [len(encode_chat(tok, s.request())) for s in ss]
            print(f"{w}: {len(ss)} sessions, first-wave prompt tokens {lens}")
        return 0
    prompts_only = {"git_commit": provenance.git_commit(), "source_sha256": sha256_file(DOCUMENT), "model": None,
                    "prompts_only": True}  # how a PROMPTS_ONLY file was made: no model ran, nothing decoded
    for w in [w for w in which if w in PROMPTS_ONLY]:
        write_requests(w, [{"workload": w, "session": s.name, "turn": 0, "messages": s.request()}
                           for s in sessions.pop(w)])
    if not sessions:
        write_meta({}, {f"corpus_{w}.jsonl": prompts_only for w in which})
        return 0

    from hqlab.engines.hf import HFEngine

    engine = HFEngine.load(args.model, device=args.device, dtype=args.dtype)
    origin = TraceOrigin.of_engine(engine)
    decode = DecodeConfig(max_new_tokens=args.max_new_tokens)
    traces: list[Trace] = []
    total = sum(s.turns for ss in sessions.values() for s in ss)
    bar = tqdm(total=total, desc="requests")
    for w, ss in sessions.items():
        rows = []
        for turn in range(max(s.turns for s in ss)):
            wave = [s for s in ss if s.turns > turn]
            msgs = [s.request() for s in wave]
            ids = [encode_chat(engine.tokenizer, m) for m in msgs]
            names = [f"{s.name}/{turn}" for s in wave]
            gens = []
            for a in range(0, len(wave), args.batch):
                gens += engine.generate_batch(ids[a:a + args.batch], None, decode, requests=names[a:a + args.batch],
                                              max_batch=args.batch)
                bar.update(len(gens) - len(gens[:a]))
            prov = provenance.provenance(engine.device)
            for s, m, pid, g, name in zip(wave, msgs, ids, gens, names):
                answer = engine.tokenizer.decode(g.output_ids, skip_special_tokens=True)
                s.messages = s.messages + [{"role": "assistant", "content": answer}]
                rows.append({"workload": w, "session": s.name, "turn": turn, "messages": m})
                traces.append(Trace(name, w, pid, list(g.output_ids), args.max_new_tokens, prov))
        if w not in CONTROLS:
            write_requests(w, rows)
    bar.close()
    if TRACES.exists():  # keep the traces of the workloads not made this time
        traces = [t for t in load_traces(TRACES) if t.category not in which] + traces
    traces.sort(key=lambda t: (WORKLOADS + CONTROLS).index(t.category))
    save_traces(traces, TRACES, model=shipped_model(origin))
    results.write_run("traces", TRACE_SET, card=results.card_of(origin.device),
                      info={"commit": provenance.git_commit(), "command": results.command_line(),
                            "benchmark": "experiments/corpus_workloads/corpus_workloads.py"})
    if not set(which) & set(WORKLOADS):  # a control's traces only: the workloads' record stays as it was
        print(f"wrote {TRACES.relative_to(REPO)} ({len(traces)} traces)")
        return 0
    record = {"generator": "experiments/corpus_workloads/corpus_workloads.py", "git_commit": provenance.git_commit(),
              "model": origin.model, "sha256": origin.sha256, "dtype": origin.dtype, "device": origin.device,
              "max_new_tokens": args.max_new_tokens, "batch": args.batch, "threads": args.threads,
              "versions": provenance.versions(), "source": str(DOCUMENT.relative_to(REPO)),
              "source_sha256": sha256_file(DOCUMENT),
              "traces": str(TRACES.relative_to(REPO))}
    write_meta({f"corpus_{w}.jsonl": record for w in which if w in WORKLOADS and w not in PROMPTS_ONLY},
               {f"corpus_{w}.jsonl": prompts_only for w in which if w in PROMPTS_ONLY})
    print(f"wrote {TRACES.relative_to(REPO)} ({len(traces)} traces)")
    return 0


def write_requests(workload: str, rows: list[dict]) -> None:
    path = OUT_DIR / f"corpus_{workload}.jsonl"
    write_atomic(path, lambda tmp: tmp.write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"))
    print(f"wrote {path.relative_to(REPO)} ({len(rows)} requests)", flush=True)


def write_meta(decoded: dict[str, dict], prompts_only: dict[str, dict]) -> None:
    """Record how the files made now were made (file name -> the run's record) and every file's sha256 in META."""
    earlier = json.loads(META.read_text()) if META.exists() else {}
    if decoded and set(earlier.get("files", {})) <= set(decoded) | set(prompts_only):
        meta, made = dict(next(iter(decoded.values()))), {}  # one decoding run made every file: its record is all
    else:  # the earlier record stays (maybe of another machine); each file made now gets its own under `made`
        meta, made = earlier, {name: {k: v for k, v in r.items() if k not in ("generator", "source", "traces")}
                               for name, r in decoded.items()}
    if made | prompts_only:
        meta["made"] = {**meta.get("made", {}), **made, **prompts_only}
    meta["files"] = {f"corpus_{w}.jsonl": sha256_file(OUT_DIR / f"corpus_{w}.jsonl") for w in WORKLOADS
                     if (OUT_DIR / f"corpus_{w}.jsonl").exists()}
    write_atomic(META, lambda tmp: tmp.write_text(json.dumps(meta, indent=1) + "\n"))
    print(f"wrote {META.relative_to(REPO)}")


if __name__ == "__main__":
    sys.exit(main())
