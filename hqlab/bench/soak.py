"""A soak (#60): one `vllm serve` kept under steady load for minutes by clients that do what clients do.

`run_load` keeps `Bounds.in_flight` requests in flight against a server on this host (127.0.0.1 only, through the
fault suite's `faults.Client`), each drawn by its index from a seeded `Mix` of the serving benchmarks' prompt sets
(chat, prose, the handbook's tasks), token limits, greedy and sampled requests, `n` = 2, log-probabilities, streamed
and whole replies, and a share of clients that close their connection at a random point (mid-stream, or a random
time into a whole reply). It stops sending after `Bounds.duration_s` or `Bounds.max_requests`, whichever comes
first; every request is cut at `Bounds.request_s` (a hang), and the wait for the server to hold no request after
the load at `Bounds.drain_s`. Every `Bounds.sample_s` it records a sample: the client's counts (sent, in flight,
served, errored, disconnected, hung, tokens received) beside the server's (`/metrics`: running, waiting, KV cache
use, preemptions, generated and prompt tokens) and its memory (the process tree's resident bytes, the card's GPU
memory in use: vLLM takes its KV cache up front, so what grows there is what lies outside it).

Outcomes: a request is served when every choice it asked for came back with a finish reason; a disconnect is the
client's own doing and no error; an error is anything else the server or the connection did (`faults.reply_error`).

`run_soak` is the GPU host's side (one server per call, benchmarks/vllm_faults.py soak, plan
benchmarks/plans/soak_k1.json); `finish` turns what a call returned into data/results/soak/<tag>/ (`series`, one row
a sample with tokens/s; `requests`, one row a request; `rows`, one row with the run's totals and its memory growth;
claims.json, the plan's pass criteria that held); `figure` draws throughput and memory over time per config.
Standard library only at import: the GPU host has no polars.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from hqlab.bench.faults import LOOPBACK, STATE_METRICS, Call, Client, Limits, reply_error
from hqlab.config import ConfigError

STUDY = "soak"
# what a sample reads of vLLM's /metrics
SOAK_METRICS = {**STATE_METRICS, "vllm:generation_tokens_total": "generation_tokens",
                "vllm:prompt_tokens_total": "prompt_tokens"}
COUNTS = ("sent", "in_flight", "done", "error", "disconnected", "hung", "tokens")
STATUSES = ("done", "error", "disconnected", "hung")
KINDS = ("whole", "stream", "n2", "logprobs", "cut_stream", "cut_whole")
# a sample of the time series (series.parquet): the client's counts (cumulative), the server's gauges and counters,
# its memory, and the rates `finish` derives between samples
SERIES_COLUMNS = ["config", "t_s", "phase", "sent", "in_flight", "done", "error", "disconnected", "hung", "tokens",
                  "running", "waiting", "kv_cache_usage", "preemptions", "generation_tokens", "prompt_tokens",
                  "unreachable", "rss_mib", "gpu_mib", "gpu_used_mib", "tokens_per_s", "client_tokens_per_s"]
REQUEST_COLUMNS = ["config", "index", "dataset", "kind", "max_tokens", "n", "temperature", "stream", "status",
                   "tokens", "start_s", "seconds", "error"]
# the run's one row (rows.parquet)
SOAK_COLUMNS = ["config", "spec", "duration_s", "in_flight", "in_flight_median", "requests", "served", "errors",
                "hangs", "disconnects", "disconnect_share", "output_tokens", "tokens_per_s", "throughput_drift",
                "left_on_server", "preemptions", "rss_mib_1min", "rss_mib_end", "rss_growth", "gpu_used_mib_1min",
                "gpu_used_mib_end", "gpu_growth", "kv_cache_usage_end", "failed_criteria", "error_detail"]
MINUTE = 60.0  # memory is compared from the first sample after this many seconds of load


@dataclass(frozen=True)
class Bounds:
    """The soak's bounds: requests in flight, seconds of load, requests at most, seconds a request may take, seconds
    the server may take to hold no request afterwards, seconds between samples."""

    in_flight: int = 64
    duration_s: float = 300.0
    max_requests: int = 100_000
    request_s: float = 45.0
    drain_s: float = 30.0
    sample_s: float = 5.0

    def __post_init__(self) -> None:
        if self.in_flight < 1 or self.max_requests < 1:
            raise ConfigError(f"a soak needs at least one request in flight and one to send (got {self})")
        if min(self.duration_s, self.request_s, self.drain_s, self.sample_s) <= 0:
            raise ConfigError(f"a soak's seconds must be positive (got {self})")

    def limits(self) -> Limits:
        """The fault client's limits for these bounds."""
        return Limits(request_s=self.request_s, case_s=self.duration_s + self.request_s, drain_s=self.drain_s,
                      concurrency=self.in_flight)


@dataclass(frozen=True)
class Mix:
    """What each request is, drawn by its index: a prompt set (uniformly, then a prompt of it), a token limit, a
    temperature (`sampled` of them at `temperature`, the rest greedy), and one kind: `disconnect` of them close the
    connection at a random point (half mid-stream after 1 to max_tokens chunks, half `cut_s` seconds into a whole
    reply), `n2` ask for two samples, `logprobs` for five log-probabilities a token, `stream` are streamed to their
    end, the rest are whole replies."""

    datasets: tuple[str, ...] = ("chat", "prose", "labd")
    max_tokens: tuple[int, ...] = (8, 32, 64, 128, 256)
    sampled: float = 0.5
    temperature: float = 0.7
    disconnect: float = 0.1
    n2: float = 0.1
    logprobs: float = 0.1
    stream: float = 0.2
    cut_s: tuple[float, float] = (0.05, 2.0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "datasets", tuple(self.datasets))
        object.__setattr__(self, "max_tokens", tuple(int(m) for m in self.max_tokens))
        object.__setattr__(self, "cut_s", tuple(float(c) for c in self.cut_s))
        shares = {"sampled": self.sampled, "disconnect": self.disconnect, "n2": self.n2, "logprobs": self.logprobs,
                  "stream": self.stream}
        bad = {k: v for k, v in shares.items() if not 0.0 <= v <= 1.0}
        if bad:
            raise ConfigError(f"mix shares must lie in [0, 1] (got {bad})")
        if self.disconnect + self.n2 + self.logprobs + self.stream > 1.0:
            raise ConfigError(f"mix: disconnect + n2 + logprobs + stream = "
                              f"{self.disconnect + self.n2 + self.logprobs + self.stream:.2f} > 1")
        if not self.datasets or not self.max_tokens or min(self.max_tokens) < 1:
            raise ConfigError(f"mix: name at least one dataset and positive max_tokens (got {self})")
        if not 0 < self.cut_s[0] <= self.cut_s[1]:
            raise ConfigError(f"mix: cut_s is [low, high] seconds, 0 < low <= high (got {list(self.cut_s)})")


@dataclass(frozen=True)
class Planned:
    """One request of the soak: its index, prompt set, kind and call."""

    index: int
    dataset: str
    kind: str
    call: Call


def planned_call(index: int, prompts: dict[str, Sequence[list[int]]], mix: Mix, seed: int = 0) -> Planned:
    """Request `index` of the soak: the same for every config and every run with the same `seed`."""
    missing = [d for d in mix.datasets if not prompts.get(d)]
    if missing:
        raise ConfigError(f"the mix draws from {', '.join(missing)}, which have no prompts")
    rng = random.Random(f"soak:{seed}:{index}")
    dataset = mix.datasets[rng.randrange(len(mix.datasets))]
    prompt = prompts[dataset][rng.randrange(len(prompts[dataset]))]
    max_tokens = mix.max_tokens[rng.randrange(len(mix.max_tokens))]
    temperature = mix.temperature if rng.random() < mix.sampled else 0.0
    body: dict[str, Any] = {"prompt": list(prompt), "max_tokens": max_tokens, "temperature": temperature}
    u, edges = rng.random(), [mix.disconnect, mix.n2, mix.logprobs, mix.stream]
    bounds = [sum(edges[:k + 1]) for k in range(4)]
    if u < bounds[0]:
        if rng.random() < 0.5:
            call, kind = Call(body, stream=True, cut_chunks=rng.randint(1, max_tokens), greedy=False), "cut_stream"
        else:
            call, kind = Call(body, cut_s=rng.uniform(*mix.cut_s), greedy=False), "cut_whole"
    elif u < bounds[1]:
        call, kind = Call({**body, "n": 2, "temperature": mix.temperature}, greedy=False), "n2"
    elif u < bounds[2]:
        call, kind = Call({**body, "logprobs": 5}, greedy=False), "logprobs"
    elif u < bounds[3]:
        call, kind = Call(body, stream=True, greedy=False), "stream"
    else:
        call, kind = Call(body, greedy=False), "whole"
    return Planned(index, dataset, kind, call)


def outcome(call: Call, reply: dict[str, Any]) -> tuple[str, str | None]:
    """(status, error) of one reply (`asdict(Reply)`): done, disconnected (the client cut it), hung, or error."""
    if reply["hung"]:
        return "hung", reply["error"]
    error = reply_error(call.body, reply)
    if error:
        return "error", error
    return ("disconnected" if reply["cut"] else "done"), None


class _Tally:
    """The load's shared counts and the requests finished since the last sample."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts = dict.fromkeys(COUNTS, 0)
        self.finished: list[dict[str, Any]] = []
        self.next = 0

    def snapshot(self) -> tuple[dict[str, int], list[dict[str, Any]]]:
        with self.lock:
            finished, self.finished = self.finished, []
            return dict(self.counts), finished


def _worker(client: Client, make: Callable[[int], Planned], bounds: Bounds, tally: _Tally, start: float,
            stop_at: float) -> None:
    """One client slot: send the next request, wait for it, count it; until the time or the count is spent."""
    while True:
        with tally.lock:
            if tally.next >= bounds.max_requests or time.monotonic() >= stop_at:
                return
            index, tally.next = tally.next, tally.next + 1
            tally.counts["sent"] += 1
            tally.counts["in_flight"] += 1
        began = time.monotonic()
        try:
            planned = make(index)
            reply = asdict(client.call(planned.call, began + bounds.request_s))
            status, error = outcome(planned.call, reply)
            body, kind, dataset, stream = planned.call.body, planned.kind, planned.dataset, planned.call.stream
        except Exception as e:  # noqa: BLE001 - a client bug is counted as an error, not a lost slot
            reply, status, error = {"choices": []}, "error", f"client: {type(e).__name__}: {e}"
            body, kind, dataset, stream = {}, "unknown", "unknown", False
        tokens = sum(len(c["token_ids"]) for c in reply["choices"])
        record = {"index": index, "dataset": dataset, "kind": kind, "max_tokens": body.get("max_tokens"),
                  "n": body.get("n", 1), "temperature": body.get("temperature"), "stream": stream,
                  "status": status, "tokens": tokens, "start_s": began - start,
                  "seconds": time.monotonic() - began, "error": error}
        with tally.lock:
            tally.counts["in_flight"] -= 1
            tally.counts[status] += 1
            tally.counts["tokens"] += tokens
            tally.finished.append(record)


def run_load(client: Client, make: Callable[[int], Planned], bounds: Bounds, *,
             probe: Callable[[], dict[str, float]], on_sample: Callable[[dict[str, Any]], None],
             on_requests: Callable[[list[dict[str, Any]]], None], log: Callable[[str], None] = print,
             progress: bool | None = None) -> dict[str, Any]:
    """Keep `bounds.in_flight` requests (`make(index)`) in flight until the time or the count is spent, let the last
    ones finish (each within `bounds.request_s`), then wait for the server to drain. Every `bounds.sample_s`, and
    once at the end of the load and after the drain: a sample (the client's counts, `probe()`'s server state and
    memory) to `on_sample`, the requests finished since the last one to `on_requests`. Returns the end: the load's
    seconds, the counts, requests left on the server (running + waiting), client slots still busy after their
    bound, and the server's state after the drain."""
    before = probe()  # the server's counters before the load
    tally, start = _Tally(), time.monotonic()
    stop_at = start + bounds.duration_s
    on_sample({"t_s": 0.0, "phase": "start", **tally.counts, **before})
    threads = [threading.Thread(target=_worker, args=(client, make, bounds, tally, start, stop_at), daemon=True,
                                name=f"soak-client-{k}") for k in range(bounds.in_flight)]
    for t in threads:
        t.start()
    from tqdm.auto import tqdm

    # on a terminal only by default (`disable=None`): in a host's log the periodic lines below show progress
    bar = tqdm(total=round(bounds.duration_s), unit="s", desc="soak", disable=True if progress is False else None)
    next_sample, next_log, give_up = start + bounds.sample_s, start + 30.0, stop_at + bounds.request_s + 10.0

    def sample(phase: str) -> dict[str, Any]:
        counts, finished = tally.snapshot()
        t = time.monotonic() - start
        taken = {"t_s": t, "phase": phase, **counts, **probe()}
        on_requests(finished)
        on_sample(taken)
        bar.update(max(0, min(round(t), bar.total) - bar.n))
        bar.set_postfix(served=counts["done"], errors=counts["error"], hung=counts["hung"], refresh=False)
        return taken

    while True:
        alive = [t for t in threads if t.is_alive()]
        now = time.monotonic()
        if not alive or now >= give_up:
            break
        if now >= next_sample:
            taken = sample("load")
            next_sample += bounds.sample_s
            if now >= next_log:
                next_log += 30.0
                log(f"{taken['t_s']:.0f} s: {taken['sent']} sent, {taken['done']} served, {taken['error']} errors, "
                    f"{taken['disconnected']} disconnected, {taken['hung']} hung, {taken['in_flight']} in flight; "
                    f"server running {taken.get('running', math.nan):.0f}, rss "
                    f"{taken.get('rss_mib', math.nan):.0f} MiB, GPU {taken.get('gpu_used_mib', math.nan):.0f} MiB")
        alive[0].join(timeout=max(0.0, min(0.5, next_sample - time.monotonic())))
    load_s = time.monotonic() - start
    last = sample("end")
    stuck = sum(t.is_alive() for t in threads)
    state = client.drain()
    drained = sample("drain")
    bar.close()
    left = None if state.get("unreachable") else int(state.get("running", 0) + state.get("waiting", 0))
    return {"load_s": load_s, "counts": {k: last[k] for k in COUNTS}, "stuck_clients": stuck,
            "left_on_server": left, "state_after": state, "drained_t_s": drained["t_s"]}


def server_probe(client: Client, pid: int | None) -> Callable[[], dict[str, float]]:
    """A sample's server side: `/metrics` (SOAK_METRICS) and, for the server process `pid`, its process tree's
    resident memory (MiB) and GPU memory (its processes', and the card's in use)."""
    from hqlab.bench.faults import gpu_used_mib, server_memory

    def probe() -> dict[str, float]:
        state = client.state(SOAK_METRICS)
        if pid is not None:
            memory = server_memory(pid)
            state.update(rss_mib=memory["rss_bytes"] / 2**20, gpu_mib=memory["gpu_mib"], gpu_used_mib=gpu_used_mib())
        return state

    return probe


class RawWriter:
    """A soak's raw files in `out`, each line on disk as it is written (a call killed at its limit keeps what it
    had): soak_<tag>.json (what ran, rewritten with the end), soak_<tag>_series.jsonl and soak_<tag>_requests.jsonl."""

    def __init__(self, out: str | Path, tag: str) -> None:
        self.out, self.tag = Path(out), tag
        self.meta_path = self.out / f"soak_{tag}.json"
        self.series_path = self.out / f"soak_{tag}_series.jsonl"
        self.requests_path = self.out / f"soak_{tag}_requests.jsonl"
        for path in (self.series_path, self.requests_path):
            if path.exists():
                raise FileExistsError(f"{path} exists: one soak a tag and a folder")
        for path in (self.series_path, self.requests_path):
            path.touch()

    def meta(self, meta: dict[str, Any]) -> None:
        from hqlab.bench import runner

        runner.save_json(self.meta_path, meta, indent=1)

    def sample(self, taken: dict[str, Any]) -> None:
        from hqlab.bench import runner

        runner.append_jsonl(self.series_path, taken)

    def requests(self, records: list[dict[str, Any]]) -> None:
        if records:
            with open(self.requests_path, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in records))


def soak_prompts(client: Client, datasets: Sequence[str], model_path: str) -> dict[str, list[list[int]]]:
    """Each prompt set's prompts as token ids, the server's chat template applied (`/tokenize`); the handbook's
    tasks cut to 2,000 tokens by the model's tokenizer, as the serving benchmark sends them."""
    from transformers import AutoTokenizer

    from hqlab.bench.serve import dataset_prompts

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return {name: [client.chat_tokens(text) for text in dataset_prompts(name, tokenizer)] for name in datasets}


def check_plan(plan: dict[str, Any], config: str) -> tuple[Bounds, Mix]:
    """A soak plan's bounds and mix, after checking that it names `config`, a setting, and criteria as claims."""
    try:
        from hqlab.bench.claims import Claim
    except ImportError:  # the GPU host has no polars; `host` checked the criteria before the call
        Claim = None  # type: ignore[assignment]
    if config not in plan.get("configs", {}):
        raise ConfigError(f"config {config!r}: the plan's configs are {', '.join(plan.get('configs', {}))}")
    if len(plan.get("settings", {})) != 1:
        raise ConfigError("a soak plan has one setting (its server's prefix caching)")
    for i, entry in enumerate(plan.get("criteria") or [] if Claim is not None else []):
        Claim.of(entry, f"criterion {i}")
    if not plan.get("criteria"):
        raise ConfigError("a soak plan states its pass criteria (`criteria`, claims on the run's rows)")
    return Bounds(**plan["bounds"]), Mix(**plan["mix"])


def run_soak(plan: dict[str, Any], config: str, tag: str, out: Any, *, port: int, start_timeout: float,
             budget: Any, commit: str, plan_path: str | None, log: Callable[[str], None] = print,
             tail_s: float = 45.0) -> int:
    """The GPU host's side: the plan's server for `config`, its prompts, then the load for the plan's seconds or
    what the `budget` (a `runner.Budget`) leaves after `tail_s` (the last requests, the drain, the stop); the raw
    files in `out` (`RawWriter`), with the plan's path and pass criteria as they ran. Returns 1 where the server
    did not start."""
    from hqlab import models
    from hqlab.bench.faults import start_servers
    from hqlab.provenance import machine_description

    bounds, mix = check_plan(plan, config)
    writer = RawWriter(out, tag)
    setting = next(iter(plan["settings"]))
    meta: dict[str, Any] = {"config": config, "spec": plan["configs"][config], "commit": commit,
                            "machine": machine_description(vllm=True), "bounds": asdict(bounds), "mix": asdict(mix),
                            "seed": plan["seed"], "server": plan["server"], "setting": setting, "plan": plan_path,
                            "criteria": plan["criteria"]}
    (name, server), = start_servers(plan, setting, tag, out, port=port, start_timeout=start_timeout,
                                    configs={config: plan["configs"][config]}, prefix="soak")
    try:
        try:
            server.wait()
        except Exception as e:  # noqa: BLE001 - the call still returns its log and what ran
            log(f"{name}: FAILED to start: {type(e).__name__}: {str(e)[-1500:]}")
            writer.meta({**meta, "ready_s": None, "end": None})
            return 1
        client = Client(server.port, "target", bounds.limits())
        prompts = soak_prompts(client, mix.datasets, models.prepare(plan["model"]))
        seconds = min(bounds.duration_s, budget.left() - tail_s)
        log(f"{name}: ready in {server.ready_s:.0f} s; {seconds:.0f} s of load at {bounds.in_flight} in flight "
            f"({', '.join(f'{k}: {len(v)} prompts' for k, v in prompts.items())})")
        if seconds < bounds.sample_s:
            writer.meta({**meta, "ready_s": server.ready_s, "end": None})
            log("budget: no time is left for the load")
            return 0
        meta.update(ready_s=server.ready_s, prompts={k: len(v) for k, v in prompts.items()},
                    duration_s=seconds)
        writer.meta({**meta, "end": None})
        bounded = Bounds(**{**asdict(bounds), "duration_s": seconds})
        end = run_load(client, lambda i: planned_call(i, prompts, mix, plan["seed"]), bounded,
                       probe=server_probe(client, server.proc.pid), on_sample=writer.sample,
                       on_requests=writer.requests, log=log)
        writer.meta({**meta, "end": end})
        c = end["counts"]
        log(f"{name}: {c['sent']} requests in {end['load_s']:.0f} s, {c['done']} served, {c['error']} errors, "
            f"{c['disconnected']} disconnected, {c['hung']} hung; {end['left_on_server']} left on the server")
    finally:
        server.stop()
    return 0


# ---------------------------------------------------------------------------------------------------------------
# the CPU's side: what a call returned -> a run of the results folder


def read_returned(returned: str | Path) -> tuple[str, dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """(tag, meta, samples, requests) of the one soak a returned folder holds; a clear error where it holds none,
    several, or a file that is not what the soak writes."""
    src = Path(returned)
    metas = sorted(p for p in src.glob("soak_*.json"))
    if len(metas) != 1:
        raise ValueError(f"{src}: finish one soak's returned files at a time (found {[p.name for p in metas]})")
    tag = metas[0].name.removeprefix("soak_").removesuffix(".json")
    meta = json.loads(metas[0].read_text())
    lines = {}
    for part in ("series", "requests"):
        path = src / f"soak_{tag}_{part}.jsonl"
        if not path.exists():
            raise ValueError(f"{src}: soak {tag} returned no {path.name}")
        try:
            lines[part] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not one JSON object a line ({e})") from None
    missing = {"config", "spec", "machine", "bounds", "criteria"} - set(meta)
    if missing:
        raise ValueError(f"{metas[0]}: no {', '.join(sorted(missing))}")
    if not lines["series"]:
        raise ValueError(f"{src}: soak {tag} has no sample (the load never ran: its server's log says why)")
    return tag, meta, lines["series"], lines["requests"]


def series_table(meta: dict[str, Any], samples: list[dict[str, Any]]) -> Any:
    """SERIES_COLUMNS: each sample with the rates since the one before it (the server's generated tokens a second,
    and the client's received tokens a second)."""
    import polars as pl

    rows = [{c: s.get(c) for c in SERIES_COLUMNS if c not in ("config", "tokens_per_s", "client_tokens_per_s")}
            for s in samples]
    frame = pl.DataFrame(rows, infer_schema_length=None).with_columns(
        pl.col(c).cast(pl.Float64) for c in ("running", "waiting", "kv_cache_usage", "preemptions",
                                             "generation_tokens", "prompt_tokens", "unreachable", "rss_mib",
                                             "gpu_mib", "gpu_used_mib"))
    dt = pl.col("t_s").diff()
    return frame.with_columns(
        pl.lit(meta["config"]).alias("config"),
        (pl.col("generation_tokens").diff() / dt).alias("tokens_per_s"),
        (pl.col("tokens").cast(pl.Float64).diff() / dt).alias("client_tokens_per_s"),
    ).select(SERIES_COLUMNS)


def requests_table(meta: dict[str, Any], records: list[dict[str, Any]]) -> Any:
    import polars as pl

    schema = {"index": pl.Int64, "dataset": pl.String, "kind": pl.String, "max_tokens": pl.Int64, "n": pl.Int64,
              "temperature": pl.Float64, "stream": pl.Boolean, "status": pl.String, "tokens": pl.Int64,
              "start_s": pl.Float64, "seconds": pl.Float64, "error": pl.String}
    frame = pl.DataFrame([{k: r.get(k) for k in schema} for r in records], schema=schema)
    return frame.with_columns(pl.lit(meta["config"]).alias("config")).select(REQUEST_COLUMNS).sort("index")


def _at(frame: Any, column: str, *, after: float | None = None, last: bool = False) -> float:
    """A load sample's `column`: the first at or after `after` seconds, or the last; NaN where none has it."""
    import polars as pl

    rows = frame.filter(pl.col(column).is_not_null() & pl.col(column).is_not_nan())
    if after is not None:
        rows = rows.filter(pl.col("t_s") >= after)
    if rows.is_empty():
        return math.nan
    return float(rows[column][-1 if last else 0])


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else math.nan


def summary(meta: dict[str, Any], series: Any, requests: Any, settle_s: float = MINUTE) -> dict[str, Any]:
    """The run's row (SOAK_COLUMNS but failed_criteria): totals of the load, its throughput and its drift (tok/s in
    the last `settle_s` ÷ in the `settle_s` after the first), requests left on the server after the drain (None
    where the call ended before it), preemptions, and memory at the end of the load against after its first
    `settle_s` (a minute: the server's allocators have met every kind of request by then)."""
    import polars as pl

    load = series.filter(pl.col("phase").is_in(["start", "load", "end"]))
    end = meta.get("end") or {}
    duration = float(end.get("load_s") or load["t_s"].max())
    counts = dict(zip(COUNTS, (int(series[c][-1]) for c in COUNTS)))
    steady = load.filter(pl.col("phase") == "load")
    first = _at(load, "generation_tokens")
    tokens = _at(load, "generation_tokens", last=True) - first
    window = steady.filter(pl.col("t_s") > settle_s)

    def rate(lo: float, hi: float) -> float:
        part = steady.filter((pl.col("t_s") > lo) & (pl.col("t_s") <= hi))["tokens_per_s"].drop_nulls()
        return float(part.mean()) if len(part) else math.nan

    rss0, rss1 = _at(load, "rss_mib", after=settle_s), _at(load, "rss_mib", last=True)
    gpu0, gpu1 = _at(load, "gpu_used_mib", after=settle_s), _at(load, "gpu_used_mib", last=True)
    errors = requests.filter(pl.col("status") == "error")["error"].drop_nulls().unique().sort().to_list()
    left = end.get("left_on_server")
    return {"config": meta["config"], "spec": meta["spec"], "duration_s": duration,
            "in_flight": int(meta["bounds"]["in_flight"]),
            "in_flight_median": float(window["in_flight"].median()) if window.height else math.nan,
            "requests": counts["sent"], "served": counts["done"], "errors": counts["error"],
            "hangs": counts["hung"] + int(end.get("stuck_clients") or 0), "disconnects": counts["disconnected"],
            "disconnect_share": counts["disconnected"] / counts["sent"] if counts["sent"] else math.nan,
            "output_tokens": tokens, "tokens_per_s": tokens / duration if duration else math.nan,
            "throughput_drift": _ratio(rate(duration - settle_s, duration), rate(settle_s, 2 * settle_s)),
            "left_on_server": None if left is None else int(left),
            "preemptions": _at(series, "preemptions", last=True) - _at(series, "preemptions"),
            "rss_mib_1min": rss0, "rss_mib_end": rss1, "rss_growth": _ratio(rss1, rss0) - 1,
            "gpu_used_mib_1min": gpu0, "gpu_used_mib_end": gpu1, "gpu_growth": _ratio(gpu1, gpu0) - 1,
            "kv_cache_usage_end": _at(series, "kv_cache_usage", last=True),
            "error_detail": "; ".join(errors)[:2000]}


def criteria_verdicts(criteria: Sequence[dict[str, Any]], rows: Any) -> list[Any]:
    """Each pass criterion of the plan (a claim on the rows) checked on the run's rows (`claims.check_frame`)."""
    from hqlab.bench import claims

    return [claims.check_frame(claims.Claim.of(c, f"criterion {i}"), rows) for i, c in enumerate(criteria)]


def finish(returned: str | Path, *, script: str, commit: str | None = None, root: str | Path | None = None,
           settle_s: float = MINUTE) -> tuple[Path, list]:
    """A returned soak -> data/results/soak/<tag>/: series, requests and rows (with the criteria that failed), the
    raw series as it came back, the call's logs, and claims.json holding the plan's criteria that held (the plan's
    as the call ran them). Returns the run's folder and every criterion's verdict."""
    import polars as pl

    from hqlab.bench import results, runner

    tag, meta, samples, records = read_returned(returned)
    series, requests = series_table(meta, samples), requests_table(meta, records)
    row = summary(meta, series, requests, settle_s)
    schema = {"failed_criteria": pl.List(pl.String), "left_on_server": pl.Int64}
    verdicts = criteria_verdicts(meta["criteria"], pl.DataFrame([{**row, "failed_criteria": []}],
                                                                schema_overrides=schema))
    rows = pl.DataFrame([{**row, "failed_criteria": [v.claim.what for v in verdicts if not v.held]}],
                        schema_overrides=schema)
    held = [c for c, v in zip(meta["criteria"], verdicts) if v.held]
    folder = runner.finish_run(
        STUDY, tag, card=results.card_of(meta["machine"]), script=script,
        tables={"rows": rows.select(SOAK_COLUMNS), "series": series, "requests": requests},
        files={"raw_series.jsonl": Path(returned) / f"soak_{tag}_series.jsonl",
               "claims.json": (json.dumps(held, indent=1) + "\n").encode()},
        logs=runner.returned_logs(returned, tag),
        info={"commit": runner.commit_of(commit, meta.get("commit")), "plan": meta.get("plan")}, root=root)
    return folder, verdicts


def report(folder: Path, verdicts: Sequence[Any], log: Callable[[str], None] = print) -> int:
    """Print each pass criterion's verdict; 0 where every one held, else 3 (the run is in place all the same, its
    claims.json holding only what held: the docs must say what failed)."""
    for verdict in verdicts:
        log(verdict.describe())
    failed = sum(not v.held for v in verdicts)
    log(f"soak -> {folder}: {len(verdicts) - failed} of {len(verdicts)} pass criteria held")
    return 3 if failed else 0


# ---------------------------------------------------------------------------------------------------------------
# the figure


def over_time(series: Any) -> Any:
    """The soak's series in long form for `figure`: minutes of load, one panel per measure (output tok/s of the
    server, its process tree's resident memory, the card's GPU memory in use), one line per run and config."""
    import polars as pl

    measures = {"tokens_per_s": "output tok/s (server)", "rss_mib": "resident memory, server processes (MiB)",
                "gpu_used_mib": "GPU memory in use (MiB)"}
    load = series.filter(pl.col("phase") == "load").with_columns(
        (pl.col("t_s") / 60).alias("minutes"), pl.format("{} ({})", pl.col("config"), pl.col("run")).alias("server"))
    return (load.unpivot(list(measures), index=["server", "minutes"], variable_name="measure")
            .drop_nulls("value").filter(pl.col("value").is_not_nan())
            .with_columns(pl.col("measure").replace_strict(measures)))


def committed(kind: str = "rows", root: str | Path | None = None) -> Any:
    """The `kind` table of every committed soak run, stacked; None, with a printed note, where there is none yet."""
    from hqlab.bench import results

    try:
        return results.load(STUDY, kind=kind, root=root)
    except results.MissingRun:
        print(f"no soak run committed yet (no {kind} table of the study {STUDY!r}): nothing to show")
        return None


def figure(root: str | Path | None = None) -> Any:
    """Throughput and memory over time per config, from every committed soak run; None, with a printed note, where
    no soak run is committed yet."""
    from hqlab import plots

    series = committed("series", root)
    if series is None:
        return None
    data = over_time(series)
    if data.is_empty():
        print("the committed soak runs have no load samples; nothing to draw")
        return None
    return plots.time_panels(data, "minutes", "value", "server", panel="measure", x_title="minutes of load")


__all__ = ["STUDY", "SOAK_METRICS", "SERIES_COLUMNS", "REQUEST_COLUMNS", "SOAK_COLUMNS", "KINDS", "STATUSES",
           "LOOPBACK", "Bounds", "Mix", "Planned", "planned_call", "outcome", "run_load", "server_probe", "RawWriter",
           "soak_prompts", "check_plan", "run_soak", "read_returned", "series_table", "requests_table", "summary",
           "criteria_verdicts", "finish", "report", "over_time", "committed", "figure"]
