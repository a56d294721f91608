"""The vLLM corpus benchmark's points (benchmarks/vllm_corpus.py, #42): its requests and the order the points run
in (the GPU side: standard library only, the host has no polars), and the raw rows a GPU host returns, one per
request, turned into one row a point with the exactness check of the corpus rule (`hqlab.bench.corpus_check`) and
the point's step intervals (the CPU side: `finish`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence


@dataclass(frozen=True)
class Request:
    workload: str
    order: int  # position in the workload file
    session: str
    turn: int
    messages: tuple[tuple[str, str], ...]

    @property
    def name(self) -> str:  # no '-': vLLM's request ids append '-<n>' to it
        return f"{self.workload}.{self.order:03d}".replace("-", "_")


def read_workload(path: Path) -> list[Request]:
    """Requests in file order, read by hqlab's readers: a request log ({"workload", "session", "turn", "messages"}
    lines: `hqlab.workloads.read_requests`) or a prompt file ({"id", "prompt"} or {"turns"} lines, as
    data/workloads/prose.jsonl: `read_jsonl`, each prompt a session of one turn)."""
    from hqlab.workloads import WorkloadError, read_jsonl, read_requests

    first = next((line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()), "{}")
    try:
        if "messages" in json.loads(first):
            return [Request(r.workload, i, r.session, r.turn, tuple((m["role"], m["content"]) for m in r.messages))
                    for i, r in enumerate(read_requests(path))]
        return [Request(path.stem, i, p.id, 0, tuple((m["role"], m["content"]) for m in p.messages))
                for i, p in enumerate(read_jsonl(path))]
    except WorkloadError as e:
        raise SystemExit(str(e)) from None


def plan_points(workloads: list[str], configs: list[str], repeats: int, loads: tuple[int, ...]) -> list[tuple]:
    """(repeat, workload, load, config) in the order they run: repeat by repeat, so a call cut short keeps whole
    repeats; a (workload, load)'s configs back to back, the first rotating."""
    points = []
    for r in range(repeats):
        for w, workload in enumerate(workloads):
            for load in loads:
                shift = (r + w + load) % len(configs)
                points += [(r, workload, load, configs[(shift + j) % len(configs)]) for j in range(len(configs))]
    return points


def request_counts(specs: list[str]) -> dict[tuple[str | None, int], int]:
    """Requests per point, `LOAD=N` for every workload or `STEM:LOAD=N` for one -> {(workload stem or None, load):
    requests}; later entries win."""
    out: dict[tuple[str | None, int], int] = {}
    for item in specs:
        where, _, n = item.partition("=")
        stem, _, load = where.rpartition(":")
        try:
            out[(stem or None, int(load))] = int(n)
        except ValueError:
            raise SystemExit(f"--requests {item!r}: expected LOAD=N or WORKLOAD:LOAD=N (e.g. 8=16, prose:1=6)")
        if int(n) < 1:
            raise SystemExit(f"--requests {item!r}: N must be >= 1")
    return out


def owner(internal: str, rids: list[str]) -> str | None:
    """The request id we gave vLLM that its internal id `internal` belongs to (vLLM may append '-<suffix>')."""
    for rid in rids:
        if internal == rid or internal.startswith(rid + "-"):
            return rid
    return None


def check_rows(rows: list[dict[str, Any]], config: str) -> dict[str, Any]:
    """The replay of one point's requests (`hqlab.bench.corpus_check`); empty for `none`."""
    from hqlab.bench.corpus_check import RequestRun, Step, check_point
    from hqlab.engines.vllm.gpu_lookup import lookup_config

    if config == "none":
        return {}
    c = lookup_config(config)
    runs = []
    problems = []
    for row in sorted(rows, key=lambda x: x["order"]):
        steps = json.loads(row["steps"])
        if c.corpus and row["corpus_seq"] >= 0:
            want = len(row["output_ids"]) + (len(row["prompt_ids"]) if c.corpus_prompts else 0)
            if row["corpus_doc_len"] != want:
                problems.append(f"{row['request']}: its corpus document had {row['corpus_doc_len']} tokens, its "
                                f"recorded ids make {want}")
        runs.append(RequestRun(row["request"], tuple(row["prompt_ids"]), tuple(row["output_ids"]),
                               int(row["corpus_seq"]) if c.corpus else -1,
                               tuple(Step(s["context_len"], max(s["corpus_docs"], 0), s["emitted"],
                                          None if s["drafted"] is None else tuple(s["drafted"])) for s in steps)))
    result = check_point(runs, nmin=c.nmin, nmax=c.nmax, k=c.k, policy=c.policy, search=c.search,
                         corpus=c.corpus_config)
    result.problems += problems
    return result.summary()


SLOW_STEP = 3.0  # a step interval this many times the point's median is a slow one (an admission, a stall)


def step_intervals(steps_per_request: list[list[dict[str, Any]]]) -> dict[str, float]:
    """The point's step intervals as its requests saw them (from each request's parsed steps: the time between its
    consecutive steps on the front end's clock): their median in ms, the share of intervals over SLOW_STEP x that
    median, and the share of the requests' decode time those slow intervals took. With many requests in flight the
    slow ones come about once per request admitted (docs/corpus.md, "Where the time goes with 8 in flight")."""
    import numpy as np

    gaps = np.concatenate([np.diff([s["t_end"] for s in steps]) for steps in steps_per_request] or [np.zeros(0)])
    if gaps.size == 0:
        return {"step_ms_median": float("nan"), "slow_step_share": float("nan"), "slow_time_share": float("nan")}
    median = float(np.median(gaps))
    slow = gaps > SLOW_STEP * median
    return {"step_ms_median": 1e3 * median, "slow_step_share": float(slow.mean()),
            "slow_time_share": float(gaps[slow].sum() / gaps.sum()) if gaps.sum() > 0 else float("nan")}


def point_rows(raw: list[dict[str, Any]], run: str) -> list[dict[str, Any]]:
    """One result row per (config, workload, load, repeat)."""
    from collections import defaultdict

    from hqlab.bench.corpus_report import without_corpus

    points: dict[tuple, list[dict]] = defaultdict(list)
    for row in raw:
        points[(row["config"], row["workload"], row["load"], row["repeat"])].append(row)
    none_out = {(w, load, rep, row["order"]): row["output_ids"] for (c, w, load, rep), rs in points.items()
                if c == "none" for row in rs}
    out = []
    for (config, workload, load, repeat), rs in sorted(points.items(), key=lambda kv: (kv[0][1], kv[0][2],
                                                                                        kv[0][3], kv[0][0])):
        tokens = sum(len(r["output_ids"]) for r in rs)
        per_request = [json.loads(r["steps"]) for r in rs]
        steps = [s for request_steps in per_request for s in request_steps]
        if load == 1:
            span = sum(max(r["t_last"] - r["ttft_s"], 0.0) for r in rs)
            rate = sum(max(len(r["output_ids"]) - 1, 0) for r in rs) / span if span > 0 else float("nan")
        else:
            rate = tokens / rs[0]["point_wall_s"]
        diverged = []
        for r in rs:
            ref = none_out.get((workload, load, repeat, r["order"]))
            if ref is not None and list(ref) != list(r["output_ids"]):
                first = next((i for i, (a, b) in enumerate(zip(ref, r["output_ids"])) if a != b),
                             min(len(ref), len(r["output_ids"])))
                diverged.append(f"{r['request']}@{first}")
        row = {"run": run, "config": config, "workload": workload, "load": load, "repeat": repeat,
               "requests": len(rs), "output_tokens": tokens, "wall_s": rs[0]["point_wall_s"], "decode_tok_s": rate,
               "tokens_per_step": sum(s["emitted"] for s in steps) / len(steps) if steps else float("nan"),
               "corpus_step_share": (sum(s["source"] == "corpus" for s in steps) / len(steps)) if steps else 0.0,
               "greedy_equal_none": not diverged, "diverged": ", ".join(diverged)}
        row.update(step_intervals(per_request))
        row.update(check_rows(rs, config))
        out.append(row)
    rate_of = {(r["config"], r["workload"], r["load"], r["repeat"]): r["decode_tok_s"] for r in out}
    labels = {r["config"] for r in out}
    for r in out:
        key = (r["workload"], r["load"], r["repeat"])
        base = without_corpus(r["config"], labels)
        r["vs_none"] = r["decode_tok_s"] / rate_of.get(("none", *key), float("nan"))
        r["vs_no_corpus"] = r["decode_tok_s"] / rate_of.get((base, *key), float("nan")) if base else float("nan")
    return out


def request_rows(raw: list[dict[str, Any]], run: str) -> list[dict[str, Any]]:
    """The raw rows, one a request, with `run` and each step's fields as lists (`step_*`) in place of the steps."""
    return [{**{k: v for k, v in r.items() if k != "steps"}, "run": run, **step_columns(json.loads(r["steps"]))}
            for r in raw]


def admissions_table(phases: Any, run: str) -> Any:
    """A `--profile` run's timed calls -> one row per point: its steps that admit a request against those that only
    decode (`hqlab.bench.engine_steps.admissions`), tagged with the run."""
    import polars as pl

    from hqlab.bench.engine_steps import admissions, engine_steps

    return admissions(engine_steps(phases)).with_columns(pl.lit(run).alias("run"))


def step_columns(steps: list[dict[str, Any]]) -> dict[str, list]:
    return {"step_context_len": [s["context_len"] for s in steps],
            "step_corpus_docs": [s["corpus_docs"] for s in steps],
            "step_emitted": [s["emitted"] for s in steps], "step_accepted": [s["accepted"] for s in steps],
            "step_source": [s["source"] for s in steps]}


def returned_run(raw_paths: Sequence[str | Path], run: str, *, commit: str | None = None,
                 model: str = "") -> tuple[dict[str, Any], dict[str, Any], dict[str, Path]]:
    """The raw files a GPU call of benchmarks/vllm_corpus.py returned for one run -> (its tables: rows, one a point,
    with the run's provenance and what vLLM chose per engine; requests, one a request; and where a .phases.parquet
    lies beside a raw file, phases and admissions; the call's record (its .json); the returned files to keep). The
    commit: `commit`, else the one the call recorded, else this checkout's."""
    import polars as pl
    import pyarrow.parquet as pq

    from hqlab.bench.runner import commit_of

    raw: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    files: dict[str, Path] = {}
    for path in map(Path, raw_paths):
        raw += pq.read_table(path).to_pylist()
        if path.with_suffix(".json").exists():
            meta = json.loads(path.with_suffix(".json").read_text())
            files["raw.json"] = path.with_suffix(".json")
    if not raw:
        raise SystemExit("no requests in the raw files")
    points = pl.DataFrame(point_rows(raw, run), infer_schema_length=None)
    versions = meta.get("versions", {})
    points = points.with_columns(pl.lit(commit_of(commit, meta.get("commit"))).alias("git_commit"),
                                 pl.lit(str(versions.get("vllm"))).alias("vllm"),
                                 pl.lit(str(versions.get("device", meta.get("machine", "")))).alias("device"),
                                 pl.lit(meta.get("model", model)).alias("model"))
    if meta.get("engines"):  # what vLLM chose per engine (model runner, scheduling, CUDA graphs)
        chosen = pl.DataFrame([{"config": e["config"], "vllm_runner": str(e.get("model_runner", "")).upper(),
                                "async_scheduling": e.get("async_scheduling"),
                                "cudagraph_mode": e.get("cudagraph_mode")} for e in meta["engines"]])
        points = points.join(chosen, on="config", how="left")
    tables = {"rows": points, "requests": pl.DataFrame(request_rows(raw, run), infer_schema_length=None)}
    timed = [p for p in (Path(path).with_suffix(".phases.parquet") for path in raw_paths) if p.exists()]
    if timed:  # the profiled points' steps that admit a request against those that only decode
        phases = pl.concat([pl.read_parquet(p) for p in timed], how="diagonal_relaxed")
        tables |= {"phases": phases, "admissions": admissions_table(phases, run)}
    return tables, meta, files
