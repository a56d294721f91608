"""Serving benchmarks: real `vllm serve` processes, loaded by vLLM's own load generator, checked by an OpenAI client.

- `Server`: one `vllm serve` process per config (`hqlab.engines.vllm.serving.serve_command`), started, waited for
  (`/health`) and stopped (its whole process group) by the benchmark; its log kept.
- `run_load`: `vllm bench serve` (vLLM's load generator, not a client of ours) against it for one (dataset,
  temperature, max_concurrency); `load_row` turns its result file into a row of `SERVE_COLUMNS`.
- `chat_texts` and `sample_token_ids`: the `openai` package against the same server, for the greedy equality check
  and the sampling test's samples (token ids, through vLLM's `return_token_ids`).
- `distribution_test`: per-position token frequencies of two sample sets compared with a chi-square test of
  homogeneity (scipy's), Bonferroni over positions: the sampling test that a speculator keeps the target's
  distribution, and that fails on a planted verification bug (`hqlab.engines.vllm.fault`).

Everything that starts processes runs on the GPU host (benchmarks/vllm_serve.py); the rows, the test and the tables
run anywhere.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from hqlab.config import ConfigError

# one row per (config, dataset, temperature, max_concurrency) of a serving run (data/results/serve/<run>/rows.parquet)
SERVE_COLUMNS = ["run", "config", "dataset", "temperature", "max_concurrency", "num_prompts", "completed",
                 "output_throughput", "request_throughput", "total_output_tokens", "duration_s",
                 "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
                 "median_e2el_ms", "p99_e2el_ms", "acceptance_length", "acceptance_rate",
                 "per_position_acceptance", "model", "machine", "vllm_version", "git_commit"]
# what a load point measured in steady state (`steady_state`), in rows of runs that saved vLLM's per-request detail
STEADY_COLUMNS = ["waves", "failed", "steady_window_s", "steady_output_tokens", "steady_output_throughput"]

# A load point runs at least this many waves (prompts >= MIN_WAVES x max_concurrency): ramp-up (every slot's prompt
# at once) and drain (the last requests alone, where a load-dependent width such as batch_k=.../0 speculates again)
# then weigh at most about a wave in ten, and the steady-state window (`steady_state`) excludes them altogether.
MIN_WAVES = 10


@dataclass(frozen=True)
class LoadPoint:
    """One load level of the benchmark: a dataset at one temperature and concurrency."""

    dataset: str
    temperature: float
    max_concurrency: int
    num_prompts: int

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0 (got {self.temperature})")
        if self.max_concurrency < 1:
            raise ConfigError(f"max_concurrency must be >= 1 (got {self.max_concurrency})")
        if self.num_prompts < self.max_concurrency:
            raise ConfigError(f"num_prompts ({self.num_prompts}) must be >= max_concurrency "
                              f"({self.max_concurrency}), else the load never reaches its level")

    @property
    def waves(self) -> float:
        """How many times over each concurrency slot is refilled: prompts ÷ max_concurrency."""
        return self.num_prompts / self.max_concurrency

    def require_waves(self, minimum: int = MIN_WAVES) -> "LoadPoint":
        """This point, if it runs at least `minimum` waves; else a ConfigError that says how many prompts it needs."""
        if self.num_prompts < minimum * self.max_concurrency:
            raise ConfigError(f"{self.dataset} at {self.max_concurrency} in flight: {self.num_prompts} prompts are "
                              f"{self.waves:.1f} waves; a point that measures needs >= {minimum} waves "
                              f"({minimum * self.max_concurrency} prompts), else ramp-up and drain dominate")
        return self


def parse_point(text: str) -> tuple[LoadPoint, int]:
    """A point of a serving plan, DATASET:TEMPERATURE:CONCURRENCY:PROMPTS[:REPEATS] (`prose:0.7:1:12:3`,
    `batch:0:32:320:3`) -> (its LoadPoint, its repeats, 1 by default); a ConfigError naming the part at fault."""
    parts = text.split(":")
    if len(parts) not in (4, 5):
        raise ConfigError(f"point {text!r}: write DATASET:TEMPERATURE:CONCURRENCY:PROMPTS[:REPEATS]")
    if parts[0] not in DATASETS:
        raise ConfigError(f"point {text!r}: dataset must be one of {', '.join(DATASETS)}")
    try:
        temperature = float(parts[1])
    except ValueError:
        raise ConfigError(f"point {text!r}: temperature {parts[1]!r} is not a number") from None
    whole = []
    for name, value in zip(("concurrency", "prompts", "repeats"), parts[2:]):
        if not value.isdigit():
            raise ConfigError(f"point {text!r}: {name} {value!r} is not a whole number")
        whole.append(int(value))
    repeats = whole[2] if len(whole) == 3 else 1
    if repeats < 1:
        raise ConfigError(f"point {text!r}: repeats must be >= 1")
    return LoadPoint(parts[0], temperature, whole[0], whole[1]), repeats


def load_points(datasets: Sequence[str], temperatures: Sequence[float], concurrencies: Sequence[int], *,
                prompts_per_slot: int = MIN_WAVES, min_prompts: int = 12) -> list[LoadPoint]:
    """Every (dataset, temperature, concurrency), with enough prompts that each concurrency slot runs
    `prompts_per_slot` requests (at least `min_prompts`)."""
    return [LoadPoint(d, float(t), int(c), max(min_prompts, prompts_per_slot * int(c)))
            for d in datasets for t in temperatures for c in concurrencies]


# The corpus workloads (docs/corpus.md): request logs in which order is part of the workload, since the corpus drafts
# from earlier requests' answers. A point of P prompts sends the file's requests in file order, pass after pass
# (request i of the point is request i mod n of the file), each its messages through the model's chat template (system
# turn included); vLLM's load generator keeps that order (no shuffle, no oversampling, no warm-up or test request,
# which would put request 0's answer in the corpus first), and the benchmark empties every server's corpus and prefix
# cache before each such point (`serve_profile.reset_server`), so every point starts from nothing. A re-sent request
# finds its own earlier answer only while the corpus still holds it: between the two, about n - C other documents
# enter (C in flight); with the batch job's documents as vLLM served them those hold more than the served bound of
# 32,768 tokens at up to 32 in flight, so later passes draft as the first did, but at 64 in flight about half the
# re-sent requests still find their own; the template's 24 documents fit, so its passes after the first are retries
# (tests/bench/test_serve_corpus.py). The records job (another instruction with fixed JSON keys over 335 passages of
# the handbook) carries the template's kind of reuse under load: up to 320 prompts (10 waves at 32) are one pass.
CORPUS_DATASETS = {"batch": "corpus_batch.jsonl", "template": "corpus_template.jsonl",
                   "records": "corpus_records.jsonl"}
PROMPT_SETS = ("chat", "labd", "prose")  # sent in vLLM's shuffled order, with its warm-up requests
DATASETS = (*PROMPT_SETS, *CORPUS_DATASETS)  # the serving benchmarks' prompt sets (`dataset_prompts`)


def ordered(dataset: str) -> bool:
    """Whether a dataset's points send its requests in file order from an emptied corpus (the corpus workloads)."""
    return dataset in CORPUS_DATASETS


def dataset_prompts(name: str, tokenizer: Any) -> list[str]:
    """The prompts of a dataset: the user turn of each prompt of `chat` (data/workloads/chat.jsonl), `prose`
    (data/workloads/prose.jsonl) and `labd` (the handbook's six tasks over its first 2,000 tokens by `tokenizer`),
    which vLLM's load generator sends through the chat template; for the corpus workloads (CORPUS_DATASETS) each
    request's whole chat with the template applied by `tokenizer` (`hqlab.workloads.encode_chat`'s text), in file
    order."""
    from hqlab.io import REPO
    from hqlab.workloads import load_workload, read_requests, render_chat

    if name not in DATASETS:
        raise ConfigError(f"dataset {name!r}: one of {', '.join(DATASETS)}")
    if ordered(name):
        return [render_chat(tokenizer, r.messages)
                for r in read_requests(REPO / "data" / "workloads" / CORPUS_DATASETS[name])]
    source = str(REPO / "data" / "workloads" / "prose.jsonl") if name == "prose" else name
    prompts = load_workload(source, doc_tokens=2000 if name == "labd" else None, tokenizer=tokenizer)
    out = []
    for p in prompts:
        if len(p.messages) != 1 or p.messages[0]["role"] != "user":
            raise ValueError(f"{name}:{p.id}: the load benchmark sends one user turn per request")
        out.append(p.messages[0]["content"])
    return out


# ---------------------------------------------------------------------------------------------------------------
# the server


class Server:
    """A `vllm serve` process (argv from `serving.serve_command`), ready once `/health` answers.

    A context manager: entering starts it in a process group of its own and waits; leaving stops the group (the
    API server, its engine core and workers). The output goes to `log_path`; a server that exits while starting
    raises with the log's tail."""

    def __init__(self, argv: list[str], log_path: str | Path, *, port: int, env: dict[str, str] | None = None,
                 timeout_s: float = 900.0) -> None:
        self.argv, self.log_path, self.port, self.env, self.timeout_s = list(argv), Path(log_path), port, env, timeout_s
        self.proc: subprocess.Popen | None = None
        self.ready_s = float("nan")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "Server":
        self.start()
        return self.wait()

    def start(self) -> "Server":
        """Start the process without waiting (servers started together each `wait` afterwards)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self._start = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        return self

    def wait(self) -> "Server":
        """Wait until the started server answers `/health` (stopping it if it fails to)."""
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.perf_counter() - self._start
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode} while starting; its log ends:\n"
                                   + tail(self.log_path))
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vllm serve did not answer /health within {self.timeout_s:.0f} s; its log ends:\n"
                           + tail(self.log_path))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=60)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=30)
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# ---------------------------------------------------------------------------------------------------------------
# vLLM's load generator


def bench_args(base_url: str, served_model: str, tokenizer: str, dataset_path: str | Path, point: LoadPoint, *,
               output_len: int, result_dir: str | Path, result_file: str, seed: int = 0) -> list[str]:
    """`vllm bench serve`'s flags for one load point: the dataset's prompts (a JSONL of {"prompt": ...}, sent through
    the model's chat template by vLLM's custom dataset), `output_len` new tokens at most (a request may stop earlier
    at end of sequence), all requests at once held to `max_concurrency` in flight, the spec-decode counters read
    from the server's /metrics before and after. `vllm bench serve ARGS` on a shell; `run_load` in this process."""
    return ["--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", served_model, "--tokenizer", tokenizer,
            "--dataset-name", "custom", "--dataset-path", str(dataset_path), "--custom-output-len", str(output_len),
            "--num-prompts", str(point.num_prompts), "--max-concurrency", str(point.max_concurrency),
            "--request-rate", "inf", "--temperature", str(point.temperature), "--top-p", "1.0", "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", result_file,
            *(["--skip-chat-template", "--disable-shuffle", "--no-oversample", "--num-warmups", "0",
               "--ready-check-timeout-sec", "0"] if ordered(point.dataset)
              else ["--num-warmups", str(min(2, point.max_concurrency))])]


def point_dataset(folder: Path, point: LoadPoint) -> Path:
    """The prompt file a point sends: the dataset's (`folder/<dataset>.jsonl`, written by the benchmark from
    `dataset_prompts`); for a corpus workload exactly the point's prompts in order, pass after pass
    (`<dataset>_<P>.jsonl`, written here once)."""
    whole = Path(folder) / f"{point.dataset}.jsonl"
    if not ordered(point.dataset):
        return whole
    path = Path(folder) / f"{point.dataset}_{point.num_prompts}.jsonl"
    if not path.exists():
        lines = [line for line in whole.read_text().splitlines() if line.strip()]
        if not lines:
            raise ValueError(f"{whole}: no prompts")
        path.write_text("".join(lines[i % len(lines)] + "\n" for i in range(point.num_prompts)))
    return path


def bench_namespace(args: list[str]) -> Any:
    """`vllm bench serve`'s own parser applied to `args` (a flag it does not know fails here)."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    return parser.parse_args(args)


def run_load(args: list[str]) -> dict:
    """Run `vllm bench serve` with `args` in this process (one import of vLLM for every load point) and return its
    result (the same dictionary it saves)."""
    from vllm.benchmarks.serve import main

    return main(bench_namespace(args))


def load_row(result: dict[str, Any], *, run: str, config: str, point: LoadPoint, model: str, machine: str,
             vllm_version: str, git_commit: str) -> dict[str, Any]:
    """One row of `SERVE_COLUMNS` from `vllm bench serve`'s result; configs without speculation have no
    acceptance (NaN)."""
    def num(key: str) -> float:
        value = result.get(key)
        return float(value) if value is not None else float("nan")

    per_pos = result.get("spec_decode_per_position_acceptance_rates") or []
    steady = (steady_state(result["start_times"], result["ttfts"], result["itls"], result["output_lens"])
              if all(result.get(k) for k in ("start_times", "ttfts", "itls", "output_lens"))
              else {"window_s": float("nan"), "tokens": float("nan"), "throughput": float("nan")})
    return {"run": run, "config": config, "dataset": point.dataset, "temperature": point.temperature,
            "max_concurrency": point.max_concurrency, "num_prompts": point.num_prompts,
            "completed": int(result.get("completed", 0)), "output_throughput": num("output_throughput"),
            "request_throughput": num("request_throughput"),
            "total_output_tokens": int(result.get("total_output_tokens", 0)), "duration_s": num("duration"),
            **{f"{s}_{m}_ms": num(f"{s}_{m}_ms") for m in ("ttft", "tpot", "itl", "e2el") for s in ("median", "p99")},
            "acceptance_length": num("spec_decode_acceptance_length"),
            "acceptance_rate": num("spec_decode_acceptance_rate") / 100.0,
            "per_position_acceptance": [float(x) for x in per_pos], "model": model, "machine": machine,
            "vllm_version": vllm_version, "git_commit": git_commit,
            "waves": point.waves, "failed": int(result.get("failed", 0) or 0),
            "steady_window_s": steady["window_s"], "steady_output_tokens": steady["tokens"],
            "steady_output_throughput": steady["throughput"],
            # a corpus workload's greedy texts one request at a time, in sending order, for `greedy_partings`
            **({"texts": list(result.get("generated_texts") or [])}
               if ordered(point.dataset) and point.temperature == 0 and point.max_concurrency == 1 else {})}


def steady_state(start_times: Sequence[float], ttfts: Sequence[float], itls: Sequence[Sequence[float]],
                 output_lens: Sequence[int]) -> dict[str, float]:
    """Output tokens per second while the load held its level: between the first request's end (every slot has then
    been busy since the start, and requests start as others end) and the last request's start (from then on fewer
    remain in flight). Ramp-up and drain are left out. A request's tokens are placed at its streamed chunks (the first
    at its first token, each later one an inter-chunk gap after the previous), its output spread evenly over them: a
    chunk is one engine step's output for that request, so this is exact where every step emits the same number of
    tokens and an estimate where speculation makes them vary. `window_s` is NaN where the window is empty (a point
    with a single wave)."""
    import numpy as np

    if not (len(start_times) == len(ttfts) == len(itls) == len(output_lens)) or not start_times:
        raise ValueError(f"steady_state needs one start time, first-token time, chunk gaps and output length per "
                         f"request (got {len(start_times)}, {len(ttfts)}, {len(itls)}, {len(output_lens)})")
    chunks = [float(s) + float(t) + np.concatenate([[0.0], np.cumsum(np.asarray(gaps, dtype=float))])
              for s, t, gaps in zip(start_times, ttfts, itls)]
    begin, end = min(c[-1] for c in chunks), max(float(s) for s in start_times)
    if end <= begin:
        return {"window_s": float("nan"), "tokens": float("nan"), "throughput": float("nan")}
    tokens = sum(n * float(np.count_nonzero((c >= begin) & (c < end))) / len(c) for c, n in zip(chunks, output_lens))
    return {"window_s": end - begin, "tokens": tokens, "throughput": tokens / (end - begin)}


# ---------------------------------------------------------------------------------------------------------------
# the OpenAI client: greedy texts and samples


def _client(base_url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=base_url + "/v1", api_key="EMPTY", timeout=600.0, max_retries=0)


def chat_texts(base_url: str, served_model: str, prompts: Sequence[str], *, max_tokens: int) -> list[str]:
    """Greedy chat completions of `prompts`, one request at a time, through the `openai` package."""
    client = _client(base_url)
    out = []
    for prompt in prompts:
        reply = client.chat.completions.create(model=served_model, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=max_tokens, temperature=0.0, seed=0)
        out.append(reply.choices[0].message.content or "")
    return out


def greedy_tokens(base_url: str, served_model: str, prompts: Sequence[str], *, max_tokens: int,
                  top: int = 2) -> list[dict[str, Any]]:
    """Greedy chat completions of `prompts` through the `openai` package with each position's token ids and `top`
    log-probabilities: where two servers' greedy texts part, the reference's margin (top-1 minus top-2
    log-probability) at that position says whether it was a near tie that bf16 rounding can flip
    (`first_divergence`)."""
    client = _client(base_url)
    out = []
    for prompt in prompts:
        reply = client.chat.completions.create(
            model=served_model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=0.0, seed=0, logprobs=True, top_logprobs=top, extra_body={"return_token_ids": True})
        choice = reply.choices[0]
        ids = getattr(choice, "token_ids", None)
        if ids is None:
            ids = (choice.model_extra or {}).get("token_ids")
        content = (choice.logprobs.content if choice.logprobs is not None else None) or []
        margins = [(c.top_logprobs[0].logprob - c.top_logprobs[1].logprob) if len(c.top_logprobs) > 1
                   else float("inf") for c in content]
        out.append({"text": choice.message.content or "", "token_ids": [int(t) for t in ids or []],
                    "margins": margins})
    return out


def greedy_row(base_url: str, served_model: str, prompts: Sequence[str], *, run: str, config: str,
               max_tokens: int) -> dict[str, Any]:
    """A server's greedy texts of `prompts` as the serve benchmark's greedy file keeps them (one row a server):
    texts, token ids and margins per prompt (`greedy_tokens`)."""
    greedy = greedy_tokens(base_url, served_model, prompts, max_tokens=max_tokens)
    return {"run": run, "config": config, "texts": [g["text"] for g in greedy],
            "token_ids": [g["token_ids"] for g in greedy], "margins": [g["margins"] for g in greedy]}


def first_divergence(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """The first position where two token sequences differ (a shorter one differs where it ends); None if equal."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def greedy_partings(rows: Any, reference: str = "none") -> list[tuple[str, int, int, float]]:
    """Where each server's greedy text parts from the reference's, in one run's greedy rows (columns config,
    token_ids: one list per prompt, and the reference's margins: its top-two logit gap at every position): one
    (config, prompt index, position, the reference's margin there) per prompt whose texts part. A verify step's
    shape can flip a bf16 near-tie; a parting at a clear margin is a lossless failure."""
    import polars as pl

    ref = rows.filter(pl.col("config") == reference)
    if ref.height != 1:
        raise ValueError(f"expected one {reference!r} row of greedy texts, found {ref.height}")
    ref_row = ref.row(0, named=True)
    out = []
    for row in rows.filter(pl.col("config") != reference).iter_rows(named=True):
        for i, (ref_ids, margins, ids) in enumerate(zip(ref_row["token_ids"], ref_row["margins"], row["token_ids"])):
            at = first_divergence(ref_ids, ids)
            if at is not None:
                out.append((row["config"], i, at, float(margins[at]) if at < len(margins) else float("inf")))
    return out


def point_text_partings(rows: Any, reference: str = "none") -> Any:
    """Where the greedy texts of a corpus workload's points one request at a time (the load rows' `texts`, in sending
    order) part from the reference's in the same (run, dataset, repeat): one row per such point of every other config
    with how many requests it sent, how many texts differ and the first that does (-1: none). Texts, not token ids:
    vLLM's load generator keeps no ids, and two equal texts come from equal tokens but at a tokenizer's rare
    re-spellings of one text."""
    import polars as pl

    keys = ["run", "dataset", "repeat"]
    if "texts" not in rows.columns:
        raise ValueError("no `texts` column: the rows hold no corpus workload's greedy point at one request")
    rows = rows.filter(pl.col("texts").is_not_null() & (pl.col("texts").list.len() > 0))
    if "repeat" not in rows.columns:
        rows = rows.with_columns(pl.lit(0).alias("repeat"))
    ref = {tuple(r[k] for k in keys): r["texts"]
           for r in rows.filter(pl.col("config") == reference).iter_rows(named=True)}
    out = []
    for r in rows.filter(pl.col("config") != reference).iter_rows(named=True):
        want = ref.get(tuple(r[k] for k in keys))
        if want is None:
            raise ValueError(f"no {reference!r} texts for {r['dataset']} repeat {r['repeat']} of run {r['run']}")
        if len(want) != len(r["texts"]):
            raise ValueError(f"{r['config']} sent {len(r['texts'])} requests of {r['dataset']}, {reference} "
                             f"{len(want)}: not the same point")
        differ = [i for i, (a, b) in enumerate(zip(want, r["texts"])) if a != b]
        out.append({**{k: r[k] for k in keys}, "config": r["config"], "requests": len(want), "differ": len(differ),
                    "first": differ[0] if differ else -1})
    return pl.DataFrame(out, schema={"run": pl.String, "dataset": pl.String, "repeat": pl.Int64, "config": pl.String,
                                     "requests": pl.Int64, "differ": pl.Int64, "first": pl.Int64})


def sample_token_ids(base_url: str, served_model: str, prompt: str, *, samples: int, max_tokens: int,
                     temperature: float, concurrency: int = 32) -> list[list[int]]:
    """`samples` independent sampled chat completions of one prompt (no seed: each request draws its own), their
    token ids as vLLM generated them (`return_token_ids`), `concurrency` requests in flight."""
    from concurrent.futures import ThreadPoolExecutor

    client = _client(base_url)

    def one(_: int) -> list[int]:
        reply = client.chat.completions.create(
            model=served_model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=temperature, top_p=1.0, extra_body={"return_token_ids": True})
        choice = reply.choices[0]
        ids = getattr(choice, "token_ids", None)
        if ids is None:
            ids = (choice.model_extra or {}).get("token_ids")
        if ids is None:
            raise RuntimeError("the server returned no token_ids (vLLM's return_token_ids extension)")
        return [int(t) for t in ids]

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(one, range(samples)))


# ---------------------------------------------------------------------------------------------------------------
# the sampling test


def distribution_test(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]], *, positions: int,
                      min_expected: float = 5.0) -> list[dict[str, Any]]:
    """Per output position < `positions`: are the tokens of sample sets `a` and `b` drawn from one distribution?

    Each position is a 2 x C contingency table (set x token) over the samples that reached it; tokens too rare for
    the chi-square approximation (expected count < `min_expected` in either set) are pooled into one "other" column
    (dropped if that is still too rare). Returns one dict per position with the chi-square statistic, its degrees of
    freedom and p-value (scipy.stats.chi2_contingency, no continuity correction); a position where every sample
    agrees has p = 1. A sample that ended before a position (end of sequence) counts as the token -1 there, so
    lengths are compared too."""
    import numpy as np
    from scipy.stats import chi2_contingency

    if not a or not b:
        raise ValueError("both sample sets must be non-empty")
    out = []
    for pos in range(positions):
        ta = [s[pos] if pos < len(s) else -1 for s in a]
        tb = [s[pos] if pos < len(s) else -1 for s in b]
        tokens = sorted(set(ta) | set(tb))
        counts = np.array([[ta.count(t) for t in tokens], [tb.count(t) for t in tokens]], dtype=float)
        expected = counts.sum(0) * counts.sum(1)[:, None] / counts.sum()
        common = (expected >= min_expected).all(0)
        table = counts[:, common]
        rare = counts[:, ~common].sum(1)
        if (~common).any() and (rare.sum() * counts.sum(1) / counts.sum() >= min_expected).all():
            table = np.column_stack([table, rare])
        if table.shape[1] < 2:
            out.append({"position": pos, "chi2": 0.0, "dof": 0, "p": 1.0, "tokens": len(tokens)})
            continue
        chi2, p, dof, _ = chi2_contingency(table, correction=False)
        out.append({"position": pos, "chi2": float(chi2), "dof": int(dof), "p": float(p), "tokens": len(tokens)})
    return out


def same_distribution(per_position: Sequence[dict[str, Any]], alpha: float = 0.01) -> bool:
    """The verdict over positions: no position rejects at `alpha` after Bonferroni's correction."""
    if not per_position:
        raise ValueError("no positions tested")
    return min(r["p"] for r in per_position) * len(per_position) >= alpha


def speedup_table(rows: Any, reference: str = "none", metric: str = "output_throughput") -> Any:
    """`metric` (output throughput; `steady_output_throughput` for the steady-state window) of each config ÷ the
    reference config's, per (dataset, temperature, max_concurrency) of the same run (a polars frame of
    `SERVE_COLUMNS` rows -> one row per group and config with `ratio`).

    A run with repeats (column `repeat`) divides each repeat by the reference's same repeat (measured minutes
    apart, so a drift of the host's speed touches both alike) and reports the median ratio, its range
    (`ratio_min`, `ratio_max`) and `repeats`; every other number is the median over repeats."""
    import polars as pl

    keys = ["run", "dataset", "temperature", "max_concurrency"]
    repeat = pl.col("repeat").fill_null(0) if "repeat" in rows.columns else pl.lit(0)
    rows = rows.with_columns(repeat.cast(pl.Int64).alias("repeat"))
    if metric not in rows.columns:
        raise ValueError(f"no column {metric!r} to compare (columns: {', '.join(rows.columns)})")
    ref = rows.filter(pl.col("config") == reference).select(keys + ["repeat", pl.col(metric).alias("ref")])
    if ref.is_empty():
        raise ValueError(f"no {reference!r} rows to divide by")
    per = (rows.join(ref, on=keys + ["repeat"], how="inner")
           .with_columns((pl.col(metric) / pl.col("ref")).alias("ratio")))
    group = keys + ["config"]
    numeric = [c for c, t in per.schema.items() if t.is_numeric() and c not in group + ["repeat"]]
    other = [c for c in per.columns if c not in numeric and c not in group + ["repeat"]]
    return (per.group_by(group)
            .agg([pl.col(c).median() for c in numeric] + [pl.col(c).first() for c in other]
                 + [pl.col("ratio").min().alias("ratio_min"), pl.col("ratio").max().alias("ratio_max"),
                    pl.len().alias("repeats")])
            .sort(group))


def best_ratio(table: Any, reference: str = "none") -> Any:
    """Per group, the best non-reference config's ratio (the issue's 'best hqlab config ≥ 0.95× none')."""
    import polars as pl

    keys = ["run", "dataset", "temperature", "max_concurrency"]
    return (table.filter(pl.col("config") != reference).sort("ratio", descending=True)
            .group_by(keys, maintain_order=True).first().sort(keys))


def short_config(config: str) -> str:
    """A config's name for plots and tables: its proposer and batch schedule (the rest is in docs/serving.md), the
    settings that tell vLLM's own methods apart (the suffix tree's size, ngram_gpu's match lengths, the drafter), and
    a planted fault's bracket where the server had one."""
    from hqlab.config import parse_spec

    if config == "none":
        return "none"
    if config.startswith("none:"):  # a plain server with the speculative configs' capture size
        return f"none capture={parse_spec(config)[1]['capture']}"
    spec, bracket, fault = config.partition(" [")
    name, values = parse_spec(spec)
    block = f" block={values['draft_block']}" if values.get("draft_block", "1") != "1" else ""
    suffix = f" gate={values['gate']}" if values.get("gate", "0") != "0" else ""
    suffix += " sampled drafts" if values.get("draft_sample", "greedy") != "greedy" else ""
    suffix += " corpus" if values.get("corpus", "0") != "0" else ""
    suffix += " prefill graph" if values.get("prefill_graph", "0") != "0" else ""
    suffix += f" goodput={Path(values['goodput']).stem}" if values.get("goodput") else ""
    suffix += f" cached={values['cached']}" if name == "arctic-suffix" and "cached" in values else ""
    suffix += f" nmin={values.get('nmin', '?')} nmax={values.get('nmax', '?')}" if name == "vllm-ngram-gpu" else ""
    suffix += f" drafter={Path(values['model']).name}" if name == "vllm-draft" and "model" in values else ""
    suffix += f" [{fault}" if bracket else ""
    return (f"{name}{block} {values['batch_k']}{suffix}" if "batch_k" in values
            else f"{name}{block} k={values.get('k', '?')}{suffix}")


def sampling_verdicts(reference: Sequence[Sequence[int]], samples: Any, *, positions: int,
                      alpha: float = 0.01) -> Any:
    """The sampling test of every sampled server in `samples` (rows with run, config, token_ids: the samples
    parquet) against `reference` (`none`'s samples of the same prompt and temperature): per server its samples,
    the smallest p over `positions` and whether it keeps the distribution (`same_distribution` at `alpha`)."""
    import polars as pl

    rows = []
    for run, config, got in zip(samples["run"], samples["config"], samples["token_ids"].to_list()):
        per_position = distribution_test(reference, got, positions=positions)
        rows.append({"run": run, "config": short_config(config), "samples": len(got),
                     "min p": min(x["p"] for x in per_position),
                     "same distribution": same_distribution(per_position, alpha)})
    return pl.DataFrame(rows, schema={"run": pl.String, "config": pl.String, "samples": pl.Int64,
                                      "min p": pl.Float64, "same distribution": pl.Boolean})


def step_costs(rows: Any, config: str, *, reference: str = "none") -> tuple[float, float]:
    """(plain, speculative) step time in ms at one request in flight, from a serving run's rows of one (dataset,
    temperature): the reference's median time per output token is a plain step; `config`'s median time per output
    token × its acceptance length (tokens a step) is one of its steps. What the speculation gate's replay prices
    with (`hqlab.replay.gate.price`)."""
    import polars as pl

    one = rows.filter(pl.col("max_concurrency") == 1)
    keys = one.select("dataset", "temperature").unique()
    if keys.height != 1:
        raise ValueError(f"step costs come from one (dataset, temperature) at one request; got {keys.height}")
    ref, spec = (one.filter(pl.col("config") == c) for c in (reference, config))
    if ref.is_empty() or spec.is_empty():
        raise ValueError(f"no rows at one request for {reference!r} and {config!r}")
    return (float(ref["median_tpot_ms"].median()),
            float((spec["median_tpot_ms"] * spec["acceptance_length"]).median()))


def served_heads(serve_rows: Any, run: str, *, dataset: str = "prose", temperature: float = 0.7) -> Any:
    """What a serving run measured of `gpu-fused`'s heads, one request at a time on `dataset` at `temperature`: one
    row per config with its head length (`head`), its drafts (`draft`: "greedy" or "drawn"), its output throughput
    ÷ `none`'s (`ratio`, median over repeats, each divided by `none`'s same repeat; `ratio_min`, `ratio_max`),
    `tokens_a_step` (vLLM's acceptance length) and `step_ms` (time per output token × tokens a step: one verify
    step, drafting included), and `step_ratio`, that step ÷ `none`'s time per output token (a plain step).

    A head pays where its tokens a step grow by more than its step's cost: ratio ≈ tokens_a_step ÷ step_ratio (less
    what the first token's time adds)."""
    import polars as pl

    from hqlab.config import parse_spec
    from hqlab.proposers.fused import FusedConfig

    rows = serve_rows.filter((pl.col("run") == run) & (pl.col("dataset") == dataset)
                             & (pl.col("temperature") == temperature) & (pl.col("max_concurrency") == 1))
    if rows.filter(pl.col("config") == "none").is_empty():
        raise ValueError(f"run {run!r} has no `none` rows on {dataset} at T={temperature}, one request at a time")
    table = speedup_table(rows)
    out = []
    for r in table.iter_rows(named=True):
        name, values = parse_spec(r["config"])
        if name != "gpu-fused":
            continue
        plain, step = step_costs(rows, r["config"])
        out.append({"config": r["config"], "head": int(values.get("draft_block", FusedConfig.draft_block)),
                    "draft": "greedy" if values.get("draft_sample", "greedy") == "greedy" else "drawn",
                    "ratio": r["ratio"], "ratio_min": r["ratio_min"], "ratio_max": r["ratio_max"],
                    "repeats": r["repeats"], "tokens_a_step": r["acceptance_length"], "step_ms": step,
                    "step_ratio": step / plain, "plain_step_ms": plain, "machine": r["machine"]})
    if not out:
        raise ValueError(f"run {run!r} has no gpu-fused rows on {dataset} at T={temperature}, one request at a time")
    return pl.DataFrame(out).sort("draft", "head", descending=[True, False])


def load_curves(rows: Any) -> Any:
    """The rows a throughput/latency-against-load figure draws: a `config` label, a `group` per (dataset,
    temperature) and the metrics (a polars frame of `SERVE_COLUMNS` rows)."""
    import polars as pl

    return (rows.with_columns(pl.col("config").map_elements(short_config, return_dtype=pl.String).alias("label"),
                              pl.format("{} · T={}", pl.col("dataset"), pl.col("temperature")).alias("group"),
                              pl.format("{} in flight", pl.col("max_concurrency")).alias("load"))
            .sort("dataset", "temperature", "label", "max_concurrency"))


def server_log_facts(text: str) -> dict[str, Any]:
    """What a `vllm serve` log says about the engine it started: the hqlab spec it served ("none" without one), whether
    a planted fault was in it, the model runner vLLM chose ("V2" or "V1"; None where the log does not say), and
    whether hqlab's drafting step failed to capture in CUDA graphs and ran eagerly (`drafting_eager`: the speculator
    warns and carries on with the same drafts, slower, so a run's speed would not be the config's), and whether it
    scheduled asynchronously (`async_scheduling`): for hqlab's speculators the plugin's line says so (vLLM's own line
    before it says "disabled", then the plugin turns it on), for `none` vLLM's line; None where the log does not say
    (hqlab's servers logged no such line before December 2026)."""
    import re

    from hqlab.engines.vllm.plugin import ASYNC_ON

    spec = re.search(r"'hqlab_proposer': '([^']+)'", text)
    runner = "V2" if "Using V2 Model Runner" in text else "V1" if "Using V1 Model Runner" in text else None
    eager = re.search(r"gpu-(?:fused|lookup): capturing the drafting step (?:in a CUDA graph )?failed", text)
    said = re.findall(r"Asynchronous scheduling is (enabled|disabled)", text)
    asynchronous = True if ASYNC_ON in text else None if spec else (said[-1] == "enabled" if said else None)
    return {"config": spec.group(1) if spec else "none", "planted": "hqlab_fault" in text, "vllm_runner": runner,
            "drafting_eager": eager is not None, "async_scheduling": asynchronous}


def save_together(out: Path, results: list[Path], server_logs: list[Path], tag: str) -> None:
    """On the GPU host: the result files as they are, the server logs in one archive (a GPU host call returns at most
    eight files; `returned_logs` reads it back)."""
    import tarfile

    from hqlab.bench import runner

    runner.copy_out(results, out)
    logs = [f for f in server_logs if f.exists()]
    if logs:
        tmp = out / f".serve_{tag}_logs.tar.gz"
        with tarfile.open(tmp, "w:gz") as tar:
            for f in logs:
                tar.add(f, arcname=f.name)
        tmp.replace(out / f"serve_{tag}_logs.tar.gz")


def returned_logs(src: Path) -> list[tuple[str, str]]:
    """(name, text) of every server log a GPU call returned: loose files and the members of serve_*_logs.tar.gz
    archives (benchmarks/vllm_serve.py `together` packs them: a call returns at most eight files)."""
    import tarfile

    logs = [(f.name, f.read_text(errors="replace")) for f in sorted(src.glob("serve_*_[0-9]*.log"))]
    for archive in sorted(src.glob("serve_*_logs.tar.gz")):
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.endswith(".log"):
                    logs.append((member.name, tar.extractfile(member).read().decode(errors="replace")))
    return logs


def log_columns(rows: Any, logs: list[tuple[str, str]]) -> Any:
    """A serving run's load rows with what each config's server log says (`server_log_facts`, matched by the spec
    the log names): `vllm_runner`, `drafting_eager` (warned about on stderr: such a run's speed is not the config's)
    and `async_scheduling`. Servers with the planted fault serve samples only and are left out."""
    import polars as pl

    facts: dict[str, dict[str, Any]] = {}
    for name, text in logs:
        found = server_log_facts(text)
        if not found["planted"]:
            facts[found["config"]] = found
            if found["drafting_eager"]:
                print(f"WARNING {name}: {found['config']}'s drafting step ran eagerly (its CUDA graph capture "
                      f"failed): its speed is not the config's", file=sys.stderr)
    return rows.with_columns(
        pl.col("config").replace_strict({c: f[key] for c, f in facts.items()}, default=None, return_dtype=dtype)
        .alias(key) for key, dtype in (("vllm_runner", pl.String), ("drafting_eager", pl.Boolean),
                                       ("async_scheduling", pl.Boolean)))


def returned_run(returned: str | Path) -> tuple[str, dict[str, Any], dict[str, Path], list[Path]]:
    """The files a GPU call of benchmarks/vllm_serve.py returned for one run -> (its tag, its tables: rows with the
    model runner each server used, whether its drafting ran eagerly and whether it scheduled asynchronously, as the
    server's own log says (`log_columns`), samples,
    greedy texts and the step timer's phases of profiled points (`serve_profile`); the returned files to keep as
    they came; the host's logs). A folder holding two runs' rows is refused: finish each from a folder of its own."""
    import polars as pl

    src = Path(returned)
    raws = sorted(src.glob("vllm_serve_*.jsonl"))
    tags = sorted({f.name.removeprefix("vllm_serve_").removesuffix(".jsonl") for f in raws})
    if not tags:
        raise SystemExit(f"no vllm_serve_*.jsonl rows under {src}")
    if len(tags) > 1:
        raise SystemExit(f"{src} holds the rows of {len(tags)} runs ({', '.join(tags)}): finish each run from a "
                         "folder of its own files")
    tag = tags[0]
    frame = pl.DataFrame([json.loads(line) for line in raws[0].read_text().splitlines() if line.strip()])
    frame = frame.select(SERVE_COLUMNS + [c for c in ["repeat", "profiled", *STEADY_COLUMNS, "texts"]
                                         if c in frame.columns])
    frame = log_columns(frame, returned_logs(src))
    tables: dict[str, Any] = {"rows": frame}
    files: dict[str, Path] = {"raw.jsonl": raws[0]}
    for kind in ("samples", "greedy"):
        raw = src / f"serve_{kind}_{tag}.jsonl"
        if raw.exists():
            tables[kind] = pl.DataFrame([json.loads(line) for line in raw.read_text().splitlines() if line.strip()])
            files[f"{kind}.jsonl"] = raw
    if (src / f"serve_phases_{tag}.parquet").exists():  # the step timer's rows of the profiled points
        tables["phases"] = pl.read_parquet(src / f"serve_phases_{tag}.parquet")
    if (src / f"serve_goodput_decisions_{tag}.parquet").exists():  # hqlab.bench.serve_servers.collect
        tables["goodput_decisions"] = pl.read_parquet(src / f"serve_goodput_decisions_{tag}.parquet")
        if (src / f"serve_goodput_timed_{tag}.parquet").exists():  # the steps goodput=online servers timed
            tables["goodput_timed"] = pl.read_parquet(src / f"serve_goodput_timed_{tag}.parquet")
        from hqlab.replay.goodput_served import check_run

        for r in check_run(tables["goodput_decisions"], tables.get("goodput_timed")).iter_rows(named=True):
            verdict = {True: "yes", False: "NO", None: f"not checkable ({r['why']})"}[r["same_widths"]]
            what = "width and price" if r["online"] and r["timed"] is not None else "width"
            print(f"goodput decisions of {short_config(r['config'])}: {r['decisions']} calls, the rule fixes every "
                  f"recorded {what}: {verdict} ({ {k: v for k, v in r.items() if k != 'prices'} })")
            if r["prices"]:  # what the server learnt: ms per step by width at its last prices
                learnt = json.loads(r["prices"])
                print(f"  learnt prices (g0 {r['g0']:.2f}, gx {r['gx']:.2f}; ms by width {learnt['widths']}): "
                      + "; ".join(f"batch {b}: " + "/".join(f"{x:.2f}" for x in ms)
                                  for b, ms in zip(learnt["batches"], learnt["ms"]) if b in (1, 2, 4, 8, 16, 32, 64)))
    if (src / f"serve_{tag}_logs.tar.gz").exists():
        files["server_logs.tar.gz"] = src / f"serve_{tag}_logs.tar.gz"
    for server_log in sorted(src.glob(f"serve_{tag}_[0-9]*.log")):
        files[f"server_{server_log.stem.rsplit('_', 1)[1]}.log"] = server_log
    host_logs = [f for f in sorted(src.glob("*.log")) + sorted(src.glob("*.log.gz"))
                 if not f.name.startswith(f"serve_{tag}_")]
    return tag, tables, files, host_logs
