"""What clients do to a server, with speculation on (#60): the client side of the fault-and-feature suite.

Each case sends a fixed set of requests to a `vllm serve` process on this host (127.0.0.1 only) through its
OpenAI-compatible `/v1/completions`, prompts as token ids (`/tokenize` applies the chat template), every reply's
token ids and log-probabilities returned (`return_token_ids`, `logprobs=2`):

| case | what the clients do |
|---|---|
| `disconnect` | stream, and two in three close the connection after a random number of chunks |
| `abort` | half close a non-streamed request's connection after a random 0.05-1 s (vLLM aborts it) |
| `n4` | n = 4 samples at T = 0.8: the sampling test against the reference's samples |
| `logprobs` | 5 log-probabilities a token and 5 a prompt token |
| `stop` | stop strings |
| `max_tokens_1`, `max_tokens_2` | one or two new tokens |
| `json_schema` | a JSON schema through vLLM's structured-output backend; every reply must parse and fit it |
| `long_prompt` | prompts of the server's max_model_len minus a few tokens, filled to the limit |

Every loop is bounded: a case has its fixed number of requests, `Limits.concurrency` of them in flight; a request
that has not finished `Limits.request_s` after it started, or when the case's deadline (`Limits.case_s`) passes, is
cut and counted as a hang, as is every request the server still holds `Limits.drain_s` after the case
(`/metrics`). `case_record` keeps what a case returned (JSON, written as it completes); `rows` compares each
config's records with the reference's (`none`) on the same requests: greedy token ids (equal, or parting at a
recorded near-tie: `hqlab.bench.lossless`), log-probabilities, prompt log-probabilities, the sampling test's p.
The server side (starting `vllm serve` with a small KV cache so that it preempts, prefix caching on and off) is
benchmarks/vllm_faults.py with its plan benchmarks/plans/faults_f1.json.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from hqlab.bench.lossless import NEAR_TIE_TOL, compare
from hqlab.config import ConfigError

LOOPBACK = "127.0.0.1"  # the only host this client talks to
NEAR_TIE = NEAR_TIE_TOL["bfloat16"]
SAMPLED_POSITIONS = 8  # output positions the n = 4 case's sampling test compares
CASES = ("disconnect", "abort", "n4", "logprobs", "stop", "max_tokens_1", "max_tokens_2", "json_schema",
         "long_prompt")
# one row per (config, setting, case)
FAULT_COLUMNS = ["config", "setting", "case", "requests", "errors", "hangs", "left_on_server", "greedy_compared",
                 "greedy_equal", "near_ties", "mismatches", "partings", "logprob_max_diff",
                 "prompt_logprob_max_diff", "sampling_p", "preemptions", "wall_s", "state_before", "state_after",
                 "error_detail"]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "languages": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "languages"], "additionalProperties": False}
PERSON_PROMPT = "Invent a software engineer and describe them as JSON with their name, age and languages."
# what `Client.state` reads of vLLM's /metrics (counters carry Prometheus' `_total`)
STATE_METRICS = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
                 "vllm:kv_cache_usage_perc": "kv_cache_usage", "vllm:num_preemptions_total": "preemptions"}


@dataclass(frozen=True)
class Limits:
    """The bounds of every loop: seconds a request may take, seconds a case may take, seconds the server may take
    to hold no request after a case, requests in flight."""

    request_s: float = 120.0
    case_s: float = 600.0
    drain_s: float = 60.0
    concurrency: int = 16

    def __post_init__(self) -> None:
        if min(self.request_s, self.case_s, self.drain_s) <= 0 or self.concurrency < 1:
            raise ConfigError(f"limits must be positive with at least one request in flight (got {self})")


@dataclass(frozen=True)
class Call:
    """One request of a case: its `/v1/completions` body (the client adds the model and the returned fields), and
    what the client does: stream it, close the connection after `cut_chunks` streamed chunks or `cut_s` seconds,
    compare its tokens with the reference's (`greedy`)."""

    body: dict[str, Any]
    stream: bool = False
    cut_chunks: int | None = None
    cut_s: float | None = None
    greedy: bool = True


@dataclass
class Choice:
    """One completion of a reply: its token ids, text, finish reason, each token's log-probability and top-two
    margin, and each prompt token's log-probability (None where the server gave none)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)


@dataclass
class Reply:
    """What one call returned: its choices, or the error; `hung`: it did not end within its limit; `cut`: the client
    closed it on purpose."""

    choices: list[Choice] = field(default_factory=list)
    error: str | None = None
    hung: bool = False
    cut: bool = False
    seconds: float = 0.0


class Client:
    """vLLM's OpenAI-compatible server on 127.0.0.1:`port`, over plain HTTP (`http.client`)."""

    def __init__(self, port: int, model: str, limits: Limits = Limits(), host: str = LOOPBACK) -> None:
        if host != LOOPBACK:
            raise ConfigError(f"the fault suite talks to a server on this host only ({LOOPBACK}), not {host!r}")
        if not 0 < int(port) < 65536:
            raise ConfigError(f"port must be in 1..65535 (got {port})")
        self.port, self.model, self.limits = int(port), model, limits

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(LOOPBACK, self.port, timeout=max(timeout, 0.01))

    def post(self, path: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """POST `body` as JSON, the JSON reply; RuntimeError naming the status and the reply's start otherwise."""
        conn = self._connection(timeout or self.limits.request_s)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        if response.status != 200:
            raise RuntimeError(f"POST {path}: HTTP {response.status}: {data[:300].decode(errors='replace')}")
        return json.loads(data)

    def get(self, path: str, timeout: float = 10.0) -> str:
        conn = self._connection(timeout)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            text = response.read().decode(errors="replace")
        finally:
            conn.close()
        if response.status != 200:
            raise RuntimeError(f"GET {path}: HTTP {response.status}: {text[:300]}")
        return text

    def chat_tokens(self, text: str) -> list[int]:
        """A user turn's prompt token ids, the server's chat template applied (`/tokenize`)."""
        reply = self.post("/tokenize", {"model": self.model, "messages": [{"role": "user", "content": text}],
                                        "add_generation_prompt": True})
        return [int(t) for t in reply["tokens"]]

    def text_tokens(self, text: str) -> tuple[list[int], int]:
        """A plain text's token ids and the server's max_model_len (`/tokenize`)."""
        reply = self.post("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False})
        return [int(t) for t in reply["tokens"]], int(reply["max_model_len"])

    def state(self, wanted: dict[str, str] | None = None) -> dict[str, float]:
        """The server's gauges and counters this suite watches (`/metrics`; `wanted`: metric -> short name, default
        STATE_METRICS), summed over label sets; `unreachable` where the server does not answer (it crashed: the
        case's row counts an error)."""
        try:
            return parse_metrics(self.get("/metrics"), wanted or STATE_METRICS)
        except (OSError, RuntimeError, ValueError, http.client.HTTPException):
            return {"unreachable": 1.0}

    def drain(self, deadline_s: float | None = None) -> dict[str, float]:
        """Wait (at most `Limits.drain_s`) until the server holds no request; its state then."""
        end = time.monotonic() + (deadline_s or self.limits.drain_s)
        while True:
            state = self.state()
            if state.get("running", 0) + state.get("waiting", 0) == 0 or time.monotonic() >= end:
                return state
            time.sleep(0.25)

    def call(self, call: Call, deadline: float) -> Reply:
        """Run one call; never raises (errors, hangs and cuts are in the reply)."""
        start = time.monotonic()
        budget = min(self.limits.request_s, deadline - start)
        body = {**call.body, "model": self.model, "stream": call.stream, "return_token_ids": True,
                "return_tokens_as_token_ids": True}
        if call.stream:
            body["stream_options"] = {"include_usage": False}
        reply = Reply()
        try:
            if budget <= 0:
                raise TimeoutError("the case's deadline passed before the request started")
            (self._stream if call.stream else self._whole)(body, call, reply, start + budget)
        except TimeoutError:  # the socket's timeout, or the stream's wall limit
            if not reply.cut:
                reply.hung, reply.error = True, f"no reply within {max(budget, 0):.0f} s"
        except (OSError, RuntimeError, ValueError, KeyError, http.client.HTTPException) as e:
            reply.error = f"{type(e).__name__}: {str(e)[:300]}"
        reply.seconds = time.monotonic() - start
        return reply

    def _whole(self, body: dict[str, Any], call: Call, reply: Reply, end: float) -> None:
        timeout = end - time.monotonic() if call.cut_s is None else min(call.cut_s, end - time.monotonic())
        conn = self._connection(timeout)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            try:
                response = conn.getresponse()
                data = response.read()
            except (TimeoutError, OSError):
                if call.cut_s is not None and time.monotonic() < end:  # the client's abort, not a hang
                    reply.cut = True
                raise
        finally:
            conn.close()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {data[:300].decode(errors='replace')}")
        payload = json.loads(data)
        prompt_ids = payload["choices"][0].get("prompt_token_ids") if payload.get("choices") else None
        reply.choices = [parse_choice(c, prompt_ids or c.get("prompt_token_ids")) for c in payload["choices"]]

    def _stream(self, body: dict[str, Any], call: Call, reply: Reply, end: float) -> None:
        conn = self._connection(end - time.monotonic())
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {response.read()[:300].decode(errors='replace')}")
            choice, chunks = Choice(), 0
            reply.choices = [choice]
            while True:
                if time.monotonic() > end:
                    raise TimeoutError("the stream did not end within its limit")
                line = response.readline()
                if not line:
                    raise RuntimeError("the stream ended without [DONE]")
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(f"error event: {str(event['error'])[:300]}")
                for c in event.get("choices", []):
                    extend_choice(choice, c)
                chunks += 1
                if call.cut_chunks is not None and chunks >= call.cut_chunks and choice.finish_reason is None:
                    reply.cut = True  # the client goes away mid-stream
                    return
        finally:
            conn.close()


def parse_choice(c: dict[str, Any], prompt_ids: Sequence[int] | None) -> Choice:
    """A non-streamed completion choice: token ids, text, finish reason, log-probabilities and margins, the prompt
    tokens' log-probabilities."""
    choice = Choice()
    extend_choice(choice, c)
    plps = c.get("prompt_logprobs")
    if plps is not None and prompt_ids is not None:
        choice.prompt_logprobs = [None if d is None else float(d[str(t)]["logprob"]) if str(t) in d else None
                                  for d, t in zip(plps, prompt_ids)]
    return choice


def extend_choice(choice: Choice, c: dict[str, Any]) -> None:
    """Add a (streamed or whole) choice's tokens to `choice`."""
    choice.token_ids += [int(t) for t in c.get("token_ids") or []]
    choice.text += c.get("text") or ""
    choice.finish_reason = c.get("finish_reason") or choice.finish_reason
    lp = c.get("logprobs") or {}
    choice.logprobs += [float(x) if x is not None else math.nan for x in lp.get("token_logprobs") or []]
    for top in lp.get("top_logprobs") or []:
        best = sorted((float(v) for v in (top or {}).values()), reverse=True)
        choice.margins.append(best[0] - best[1] if len(best) > 1 else math.inf)


def parse_metrics(text: str, wanted: dict[str, str]) -> dict[str, float]:
    """Prometheus text -> {short name: value summed over label sets} for the metrics in `wanted`."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        if "}" in line:
            head, rest = line.rsplit("}", 1)
            name, value = head.split("{", 1)[0], rest.split()[0]
        else:
            name, value = line.split()[:2]
        if name in wanted:
            out[wanted[name]] = out.get(wanted[name], 0.0) + float(value)
    return out


def process_tree(pid: int) -> list[int]:
    """A process and every descendant (Linux `/proc`): a server's API process, engine core and workers."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def process_tree_rss(pid: int) -> int:
    """Resident bytes of a process and its descendants; 0 where they are gone."""
    total = 0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
        except OSError:
            continue
    return total


def gpu_mib(pids: Sequence[int]) -> float:
    """GPU memory (MiB) the processes hold, from nvidia-smi; NaN where it cannot say."""
    import subprocess

    try:
        text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return float("nan")
    used = {int(p): float(m) for p, m in (line.split(",") for line in text.splitlines() if line.strip())}
    return sum(used.get(p, 0.0) for p in pids)


def gpu_used_mib() -> float:
    """GPU memory in use on the first card (MiB), whoever holds it, from nvidia-smi; NaN where it cannot say. Where
    one server has the card to itself this is its memory even when nvidia-smi cannot map a container's process ids
    to the card's processes (then `gpu_mib` of the server's processes reads 0)."""
    import subprocess

    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30, check=True).stdout
        return float(text.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return float("nan")


def server_memory(pid: int) -> dict[str, float]:
    """A server's resident memory (its process tree's, bytes) and the GPU memory it holds (MiB)."""
    return {"rss_bytes": float(process_tree_rss(pid)), "gpu_mib": gpu_mib(process_tree(pid))}


def fits_schema(text: str, schema: dict[str, Any] = PERSON) -> bool:
    """Whether `text` is JSON that fits an object schema of string, integer and string-array properties (the
    suite's schema)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    types = {"string": str, "integer": int, "array": list}
    if not isinstance(value, dict) or not set(schema["required"]) <= set(value):
        return False
    if schema.get("additionalProperties") is False and not set(value) <= set(schema["properties"]):
        return False
    for key, item in value.items():
        kind = schema["properties"][key]["type"]
        if not isinstance(item, types[kind]) or isinstance(item, bool):
            return False
        if kind == "array" and not all(isinstance(x, str) for x in item):
            return False
    return True


def case_calls(case: str, prompts: Sequence[list[int]], *, long_prompts: Sequence[list[int]] = (),
               json_prompt: list[int] | None = None, seed: int = 0) -> list[Call]:
    """The calls of one case, the same for every config (seeded): `prompts` are chat prompts as token ids,
    `long_prompts` prompts filled to the server's limit (`long_prompt`), `json_prompt` the JSON case's."""
    rng = random.Random(f"{case}:{seed}")
    greedy = {"temperature": 0.0, "logprobs": 2}
    if case == "disconnect":
        return [Call({"prompt": p, "max_tokens": 96, **greedy}, stream=True,
                     cut_chunks=rng.randint(1, 40) if rng.random() < 2 / 3 else None) for p in prompts]
    if case == "abort":
        return [Call({"prompt": p, "max_tokens": 160, **greedy},
                     cut_s=rng.uniform(0.05, 1.0) if i % 2 == 0 else None) for i, p in enumerate(prompts)]
    if case == "n4":
        return [Call({"prompt": p, "max_tokens": 32, "n": 4, "temperature": 0.8, "top_p": 1.0}, greedy=False)
                for p in list(prompts)[:6] for _ in range(4)]
    if case == "logprobs":
        return [Call({"prompt": p, "max_tokens": 48, "temperature": 0.0, "logprobs": 5, "prompt_logprobs": 5})
                for p in prompts]
    if case == "stop":
        return [Call({"prompt": p, "max_tokens": 128, "stop": [rng.choice(["\n\n", ".", ":"]), "```"], **greedy})
                for p in prompts]
    if case in ("max_tokens_1", "max_tokens_2"):
        return [Call({"prompt": p, "max_tokens": int(case[-1]), **greedy}) for p in prompts]
    if case == "json_schema":
        if json_prompt is None:
            raise ConfigError("the json_schema case needs its prompt (json_prompt)")
        schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
        return [Call({"prompt": json_prompt, "max_tokens": 128, "response_format": schema, **greedy})] * 4
    if case == "long_prompt":
        return [Call({"prompt": p, "max_tokens": 4, **greedy}) for p in long_prompts]
    raise ConfigError(f"unknown case {case!r}: the cases are {', '.join(CASES)}")


def run_case(client: Client, calls: Sequence[Call]) -> dict[str, Any]:
    """Run a case's calls (`Limits.concurrency` in flight, each bounded, the case by its deadline) and wait for
    the server to drain; the server's state before and after, and every reply."""
    limits, before = client.limits, client.state()
    start = time.monotonic()
    deadline = start + limits.case_s
    with ThreadPoolExecutor(max_workers=limits.concurrency) as pool:
        replies = list(pool.map(lambda c: client.call(c, deadline), calls))
    wall = time.monotonic() - start
    after = client.drain()
    return {"replies": [asdict(r) for r in replies], "wall_s": wall, "state_before": before, "state_after": after}


def case_record(config: str, setting: str, case: str, calls: Sequence[Call], run: dict[str, Any]) -> dict[str, Any]:
    """One case's JSON record: what was asked (the calls) and what came back (`run_case`)."""
    return {"config": config, "setting": setting, "case": case, "calls": [asdict(c) for c in calls], **run}


def _choices(record: dict[str, Any]) -> list[list[Choice]]:
    return [[Choice(**c) for c in r["choices"]] for r in record["replies"]]


def _errors(record: dict[str, Any]) -> list[str]:
    """Every call's error, a call that ended without a finish reason or, in the JSON case, with a reply that does
    not fit the schema, and a server that stopped answering."""
    out = ["the server did not answer /metrics after the case"] if record["state_after"].get("unreachable") else []
    for i, (call, reply) in enumerate(zip(record["calls"], record["replies"])):
        error = reply_error(call["body"], reply, schema=record["case"] == "json_schema")
        if error:
            out.append(f"{i}: {error}")
    return out


def reply_error(body: dict[str, Any], reply: dict[str, Any], *, schema: bool = False) -> str | None:
    """What is wrong with one reply (as `asdict(Reply)`) to a request of `body`: its error, or, where it was neither
    cut nor hung, a count of choices other than the request's `n` or one without a finish reason, or (`schema`) a
    reply that does not fit the JSON case's schema; None where nothing is."""
    if reply["error"]:
        return reply["error"]
    if reply["cut"] or reply["hung"]:
        return None
    want = body.get("n", 1)
    if len(reply["choices"]) != want or any(c["finish_reason"] is None for c in reply["choices"]):
        return f"{len(reply['choices'])} choices of {want}, or one without a finish reason"
    if schema and not all(fits_schema(c["text"]) for c in reply["choices"]):
        return "a reply that does not fit the schema"
    return None


def row(record: dict[str, Any], reference: dict[str, Any] | None) -> dict[str, Any]:
    """One row of FAULT_COLUMNS: a case's record against the reference config's record of the same case."""
    errors, replies = _errors(record), record["replies"]
    before, after = record["state_before"], record["state_after"]
    out = {"config": record["config"], "setting": record["setting"], "case": record["case"],
           "requests": len(replies), "errors": len(errors), "hangs": sum(r["hung"] for r in replies),
           "left_on_server": int(after.get("running", 0) + after.get("waiting", 0)), "greedy_compared": 0,
           "greedy_equal": 0, "near_ties": 0, "mismatches": 0, "partings": "[]", "logprob_max_diff": math.nan,
           "prompt_logprob_max_diff": math.nan, "sampling_p": math.nan, "wall_s": record["wall_s"],
           "preemptions": after.get("preemptions", 0) - before.get("preemptions", 0),
           "state_before": json.dumps(before), "state_after": json.dumps(after),
           "error_detail": "; ".join(errors)[:2000]}
    if reference is not None and reference is not record:
        out.update(compare_records(reference, record))
    return out


VERDICTS = {"identical": "greedy_equal", "near-tie": "near_ties", "mismatch": "mismatches"}  # lossless -> column


def compare_records(reference: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """Greedy equality (or the parting's margin in the reference), log-probability differences where the tokens
    agree, and for sampled calls the sampling test's smallest p over SAMPLED_POSITIONS (Bonferroni-corrected)."""
    if [c["body"] for c in reference["calls"]] != [c["body"] for c in record["calls"]]:
        raise ValueError(f"{record['config']} {record['case']}: its calls are not the reference's")
    counts = {"greedy_compared": 0, "greedy_equal": 0, "near_ties": 0, "mismatches": 0}
    partings, lp, plp = [], [0.0], [0.0]
    samples: tuple[list[list[int]], list[list[int]]] = ([], [])
    for i, (call, a, b) in enumerate(zip(record["calls"], _choices(reference), _choices(record))):
        done = [r["replies"][i] for r in (reference, record)]
        if any(d["error"] or d["hung"] or d["cut"] for d in done):
            continue
        if not call["greedy"]:
            samples[0].extend(c.token_ids for c in a)
            samples[1].extend(c.token_ids for c in b)
            continue
        for ca, cb in zip(a, b):
            verdict = compare(ca.token_ids, ca.margins, cb.token_ids, NEAR_TIE)
            counts["greedy_compared"] += 1
            counts[VERDICTS[verdict.status]] += 1
            if verdict.first_divergence is not None:
                partings.append([i, verdict.first_divergence, verdict.margin])
            agree = verdict.first_divergence if verdict.first_divergence is not None else len(ca.token_ids)
            lp += [abs(x - y) for x, y in zip(ca.logprobs[:agree], cb.logprobs[:agree])]
            plp += [abs(x - y) for x, y in zip(ca.prompt_logprobs, cb.prompt_logprobs)
                    if x is not None and y is not None]
    out: dict[str, Any] = {**counts, "partings": json.dumps(partings), "logprob_max_diff": max(lp),
                           "prompt_logprob_max_diff": max(plp)}
    if samples[0] and samples[1]:
        from hqlab.bench.serve import distribution_test

        per = distribution_test(samples[0], samples[1], positions=SAMPLED_POSITIONS)
        out["sampling_p"] = min(1.0, min(r["p"] for r in per) * len(per))
    return out


def rows(records: Sequence[dict[str, Any]], reference: str = "none") -> list[dict[str, Any]]:
    """FAULT_COLUMNS rows for every record, each compared with the reference config's record of the same setting
    and case (none: no comparison columns)."""
    ref = {(r["setting"], r["case"]): r for r in records if r["config"] == reference}
    return [row(r, ref.get((r["setting"], r["case"]))) for r in records]


# ---------------------------------------------------------------------------------------------------------------
# the GPU host's side: a plan's servers for one setting, every case (benchmarks/vllm_faults.py run)


def plan_prompts(plan: dict[str, Any], client: "Client", root: Any) -> tuple[list[list[int]], list[list[int]],
                                                                          list[int]]:
    """The chat prompts as token ids, prompts filled to the server's limit less 1 to 4 tokens (of the plan's long
    document, a path under `root`), and the JSON case's prompt."""
    from pathlib import Path

    texts = []
    for path in plan["prompts"]["chat"]:
        lines = (Path(root) / path).read_text().splitlines()
        texts += [json.loads(line)["prompt"] for line in lines if line.strip()][:plan["prompts"]["per_file"]]
    document, limit = client.text_tokens((Path(root) / plan["prompts"]["long"]).read_text())
    new = 4  # the long_prompt case's max_tokens (case_calls)
    long = [document[i * 97:i * 97 + limit - new - i] for i in range(4)]
    return [client.chat_tokens(t) for t in texts], long, client.chat_tokens(PERSON_PROMPT)


def start_servers(plan: dict[str, Any], setting: str, tag: str, out: Any, *, port: int, start_timeout: float,
                  configs: dict[str, str] | None = None, prefix: str = "faults") -> list[tuple[str, Any]]:
    """One `vllm serve` per config of the plan (or of `configs`), all started at once, each on its own port with
    its share of the GPU, prefix caching as the setting says, a KV cache of the plan's `server.kv_blocks` where it
    names them (else what the share leaves), its log `out/<prefix>_<config>_<tag>.log` (the name `finish` finds
    with the run's logs) and its compile cache in a work folder outside `out` (a call returns 8 files at most)."""
    import sys
    import tempfile
    from pathlib import Path

    from hqlab import models
    from hqlab.bench import serve
    from hqlab.engines.vllm.gpu_fused import fused_config
    from hqlab.engines.vllm.serving import serve_command, serve_env

    configs = plan["configs"] if configs is None else configs
    srv, model = plan["server"], models.prepare(plan["model"])
    for spec in configs.values():
        if spec.startswith("gpu-fused"):
            models.prepare(fused_config(spec).model)
    share, servers = 0.9 / len(configs), []
    work = Path(tempfile.gettempdir()) / f"hqlab-{prefix}" / tag
    for n, (name, spec) in enumerate(configs.items()):
        blocks = ["--num-gpu-blocks-override", str(srv["kv_blocks"])] if srv.get("kv_blocks") else []
        extra = ["--served-model-name", "target", "--max-model-len", str(srv["max_model_len"]), *blocks,
                 "--gpu-memory-utilization", f"{share:.3f}",
                 "--enable-prefix-caching" if plan["settings"][setting]["prefix_caching"]
                 else "--no-enable-prefix-caching", "--disable-uvicorn-access-log", "--seed", "0"]
        argv = [sys.executable, "-m", "vllm.entrypoints.cli.main"] + serve_command(
            model, spec, max_num_seqs=srv["max_num_seqs"], port=port + n, extra=extra)[1:]
        env = {**os.environ, "VLLM_CACHE_ROOT": str(work / f"vllm-cache-{n}"), **serve_env(spec)}
        servers.append((name, serve.Server(argv, Path(out) / f"{prefix}_{name}_{tag}.log", port=port + n, env=env,
                                           timeout_s=start_timeout)))
    for _, server in servers:
        server.start()
    return servers


def run_suite(plan: dict[str, Any], setting: str, tag: str, out: Any, *, port: int, start_timeout: float,
              budget: Any, root: Any, log: Any = print) -> int:
    """Every case of the plan against every live server in turn, one record a (config, case) appended to
    `out/faults_<tag>.jsonl` as it completes, with the server's memory before and after; no case starts that the
    `budget` (a `runner.Budget`) cannot fit. Returns 1 where no server started."""
    from pathlib import Path

    from hqlab.bench import runner

    limits = Limits(**plan["limits"])
    records = Path(out) / f"faults_{tag}.jsonl"
    servers, live = start_servers(plan, setting, tag, out, port=port, start_timeout=start_timeout), []
    try:
        for name, server in servers:
            try:
                live.append((name, server.wait(), Client(server.port, "target", limits)))
                log(f"{name}: ready in {server.ready_s:.0f} s")
            except Exception as e:  # noqa: BLE001 - the other servers still run
                log(f"{name}: FAILED to start: {type(e).__name__}: {str(e)[-1500:]}")
        if not live:
            return 1
        chat, long, person = plan_prompts(plan, live[0][2], root)
        for case in plan["cases"]:
            calls = case_calls(case, chat, long_prompts=long, json_prompt=person, seed=plan["seed"])
            for name, server, client in live:
                if not budget.fits(limits.case_s + limits.drain_s):
                    log(f"budget: {case} on {name} and later cases not run")
                    return 0
                before = server_memory(server.proc.pid)
                result = run_case(client, calls)
                result["state_before"].update(before)
                result["state_after"].update(server_memory(server.proc.pid))
                record = case_record(name, setting, case, calls, result)
                runner.append_jsonl(records, record)
                r = row(record, None)
                log(f"{case} on {name}: {r['requests']} requests, {r['errors']} errors, {r['hangs']} hangs, "
                    f"{r['left_on_server']} left on the server, {r['preemptions']:.0f} preemptions, "
                    f"{r['wall_s']:.1f} s")
    finally:
        for _, server in servers:
            server.stop()
    return 0


def finish(returned: Any, *, script: str, commit: str | None = None, root: Any = None,
           log: Any = print) -> Any:
    """One call's returned records (faults_<tag>.jsonl, faults_<tag>.json, its logs) -> data/results/faults/<tag>/:
    FAULT_COLUMNS rows, the raw records, the logs; the plan is faults_<tag less its a/b>.json. Returns the folder."""
    from pathlib import Path

    import polars as pl

    from hqlab.bench import results, runner

    src = Path(returned)
    raws = sorted(src.glob("faults_*.jsonl"))
    tags = sorted({f.name.removeprefix("faults_").removesuffix(".jsonl") for f in raws})
    if len(tags) != 1:
        raise SystemExit(f"{src}: finish one run's returned files at a time (found runs {tags or 'none'})")
    tag = tags[0]
    records = [json.loads(line) for line in raws[0].read_text().splitlines() if line.strip()]
    table = pl.DataFrame(rows(records), schema_overrides={"preemptions": pl.Float64}).select(FAULT_COLUMNS)
    meta = json.loads((src / f"faults_{tag}.json").read_text())
    folder = runner.finish_run("faults", tag, card=results.card_of(meta["machine"]), script=script,
                               tables={"rows": table}, files={"raw.jsonl": raws[0]},
                               logs=runner.returned_logs(src, tag),
                               info={"commit": runner.commit_of(commit, meta.get("commit")),
                                     "plan": runner.plan_path("faults", tag.rstrip("ab"))}, root=root)
    log(table.select("config", "setting", "case", "requests", "errors", "hangs", "greedy_equal", "near_ties",
                     "mismatches", "logprob_max_diff", "sampling_p", "preemptions"))
    log(f"{table.height} rows of run {tag} -> {folder}")
    return folder


__all__ = ["LOOPBACK", "CASES", "FAULT_COLUMNS", "PERSON", "PERSON_PROMPT", "Limits", "Call", "Choice", "Reply",
           "Client", "STATE_METRICS", "parse_choice", "parse_metrics", "process_tree", "process_tree_rss", "gpu_mib",
           "gpu_used_mib", "server_memory", "plan_prompts", "start_servers", "run_suite", "fits_schema", "case_calls",
           "run_case", "case_record", "row", "reply_error", "compare_records", "rows", "finish"]
