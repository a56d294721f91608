"""The servers a `together` serving run starts (benchmarks/vllm_serve.py): one per config, and the variants a plan
asks for, which only take the sampling test's samples: a config with prefix caching off (`sample_prefix_off`) and
with the planted verification bug (`planted`, `hqlab.engines.vllm.fault`: its test must fail). A variant's label
is its spec and a bracket (`[prefix caching off]`, `[planted accept_first_draft]`), so its samples and logs never
pass for the config's own (`hqlab.bench.serve.short_config` keeps the bracket).

The goodput controller's decisions: the servers of the configs a plan names under `decisions` (and their prefix
variants) get `HQLAB_GOODPUT_RECORD` in their environment, so their hook writes each call's candidates, cells and
width and each outcome, and, for costs measured online, each call's prices and each timed step
(`hqlab.engines.vllm.goodput_record`); `collect` reads the files into two parquet files, one row per (server, call,
candidate request) and one per (server, timed step), that `finish` keeps as `goodput_decisions.parquet` and
`goodput_timed.parquet` and `hqlab.replay.goodput_served.check_run` checks.

Standard library only at import (numpy and pyarrow inside `collect`): the GPU host has no polars.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from hqlab.config import ConfigError

PLAN_KEYS = ("decisions", "sample_prefix_off", "planted")
PREFIX_OFF = "prefix caching off"
PLANTED = "accept_first_draft"  # the bug the sampling test must catch (hqlab.engines.vllm.fault)


@dataclass(frozen=True)
class Served:
    """One server of a run: its label (the rows' and samples' config), spec, extra `vllm serve` flags, planted fault
    and whether it records the goodput controller's decisions."""

    label: str
    spec: str
    flags: tuple[str, ...] = ()
    planted: str | None = None
    record: bool = False

    @property
    def samples_only(self) -> bool:
        """A variant: the sampling test's samples only (no greedy texts, no load points)."""
        return self.label != self.spec


def apply_plan(args: Any, plan: Mapping[str, Any]) -> None:
    """A plan's `decisions`, `sample_prefix_off` and `planted` (config names of its `configs`) onto `args`."""
    named = plan["configs"]
    for key in PLAN_KEYS:
        unknown = [n for n in plan.get(key, []) if n not in named]
        if unknown:
            raise ConfigError(f"plan key {key!r} names {unknown}, which are not among its configs {sorted(named)}")
        setattr(args, key, list(getattr(args, key, None) or []) + [named[n] for n in plan.get(key, [])])


def servers(args: Any) -> list[Served]:
    """Every server of a run, configs first, then the variants `args` asks for (`apply_plan`)."""
    configs = list(args.config)
    decisions = list(getattr(args, "decisions", None) or [])
    prefix_off = list(getattr(args, "sample_prefix_off", None) or [])
    planted = list(getattr(args, "planted", None) or [])
    stray = [s for s in decisions + prefix_off + planted if s not in configs]
    if stray:
        raise ConfigError(f"{stray}: a variant or a record is of a config the run serves")
    plain = [s for s in decisions if "goodput=" not in s]
    if plain:
        raise ConfigError(f"only a goodput config records decisions (got {plain})")
    if any(s == "none" or s.startswith("none:") for s in planted):
        raise ConfigError("a planted fault needs a speculator to plant it in")
    out = [Served(s, s, record=s in decisions) for s in configs]
    out += [Served(f"{s} [{PREFIX_OFF}]", s, ("--no-enable-prefix-caching",), record=s in decisions)
            for s in prefix_off]
    out += [Served(f"{s} [planted {PLANTED}]", s, planted=PLANTED) for s in planted]
    return out


def record_env(served: Served, work: Path, n: int) -> dict[str, str]:
    """The environment a server's hook records its decisions by ({} for a server that records nothing)."""
    from hqlab.engines.vllm.goodput_record import RECORD_ENV

    return {RECORD_ENV: str(record_path(work, n))} if served.record else {}


def record_path(work: Path, n: int) -> Path:
    return Path(work) / f"goodput_decisions_{n}.bin"


def collect(served: Sequence[Served], work: Path, tag: str) -> tuple[Path, Path]:
    """The records of the servers that kept one (server n's at `record_path(work, n)`) -> two parquet files in `work`
    (their paths returned, written or not). `serve_goodput_decisions_<tag>.parquet`: `config` (the server's label),
    `header` (the record's header, JSON, with the file's `version`), `truncated`, then the rows of
    `goodput_record.read_record` (outcomes null where a request verified nothing; `priced_us` null where the call
    recorded no prices). `serve_goodput_timed_<tag>.parquet`: `config` and the timed steps of the servers that
    measured their costs online (`hqlab.replay.goodput_served.TIMED_COLUMNS`), written with the first. A record
    cut mid-write (its server still running) is left for a later call."""
    import numpy as np
    import pyarrow as pa

    import pyarrow.parquet as pq

    from hqlab.bench.runner import log
    from hqlab.io import write_atomic
    from hqlab.engines.vllm.goodput_record import read_record

    out = Path(work) / f"serve_goodput_decisions_{tag}.parquet"
    out_timed = Path(work) / f"serve_goodput_timed_{tag}.parquet"
    parts, timed_parts = [], []
    for n, server in enumerate(served):
        path = record_path(work, n)
        if not (server.record and path.exists()):
            continue
        try:
            header, cols = read_record(path)
        except ValueError as e:
            log(f"{server.label}: decisions record not read yet ({e})")
            continue
        rows = len(cols["decision"])
        table = {"config": [server.label] * rows, "header": [json.dumps({**header, "version": cols["version"]})] * rows,
                 "truncated": [bool(cols["truncated"])] * rows}
        for name in ("decision", "width", "request", "tokens", "match", "accept", "confidence"):
            table[name] = pa.array(cols[name].astype(np.int32))
        ids = cols["request_ids"]
        table["request_id"] = [ids[i] for i in cols["request"]]
        for name in ("drafted", "accepted", "observed_before"):
            table[name] = pa.array(cols[name].astype(np.int32), mask=cols[name] < 0)
        priced = cols["priced"]
        m = priced.shape[1]
        table["priced_us"] = pa.ListArray.from_arrays(
            pa.array(np.arange(rows + 1, dtype=np.int32) * m), pa.array(priced.reshape(-1).astype(np.int64)),
            mask=pa.array(priced[:, 0] < 0 if m else np.ones(rows, dtype=bool)))
        parts.append(pa.table(table))
        steps = cols["timed"]
        timed_parts.append(pa.table({"config": pa.array([server.label] * len(steps["us"]), type=pa.string()),
                                     "step": pa.array(np.arange(len(steps["us"]), dtype=np.int64)),
                                     **{c: pa.array(steps[c]) for c in ("before", "batch", "width", "us",
                                                                        "decode_only")}}))
    if not parts:
        return out, out_timed
    for path, tables in ((out, parts), (out_timed, timed_parts)):
        table = pa.concat_tables(tables)  # zstd: the columns repeat themselves step after step
        write_atomic(path, lambda tmp, table=table: pq.write_table(table, str(tmp), compression="zstd"))
    return out, out_timed


def replay_greedy(decisions: Any, greedy: Any, *, model: str = "qwen2.5-coder-1.5b", prompts: int = 3,
                  max_tokens: int = 128) -> dict[str, Any]:
    """The replay check (`hqlab.replay.goodput_served.replay_served`) of every recording server of a run that has a
    greedy row (`greedy.parquet`: the first `prompts` chat prompts, answered one at a time before anything else,
    `max_tokens` new tokens at most): config label -> its `ReplayCheck`. The prompts' tokens are the chat template's
    through `model`'s tokenizer, as the server renders them (a record that opens with other prompt lengths is
    refused). Servers that measured their costs online are left out: the replay prices with a fixed table."""
    import polars as pl
    from transformers import AutoTokenizer

    from hqlab import models
    from hqlab.bench.serve import dataset_prompts
    from hqlab.workloads import encode_chat
    from hqlab.replay.goodput_served import greedy_traces, replay_served, served_records

    tokenizer = AutoTokenizer.from_pretrained(models.prepare(model))
    ids = [encode_chat(tokenizer, [{"role": "user", "content": p}])
           for p in dataset_prompts("chat", tokenizer)[:prompts]]
    out = {}
    for config, header, rows in served_records(decisions):
        row = greedy.filter(pl.col("config") == config)
        if row.height == 1 and not header.get("online"):
            traces = greedy_traces(ids, row["token_ids"][0].to_list(), max_new_tokens=max_tokens)
            out[config] = replay_served(rows, header, traces)
    return out


__all__ = ["replay_greedy", "PLAN_KEYS", "Served", "apply_plan", "servers", "record_env", "record_path", "collect", "PREFIX_OFF",
           "PLANTED"]
