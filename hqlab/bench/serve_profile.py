"""Where a served step's time goes: the worker's step timer (`hqlab.engines.vllm.worker.StepTimer`) inside a real
`vllm serve` process, started and stopped around a load point by the benchmark, and the tables and figure read from
what it returns.

- A profiled server gets hqlab's worker extension (`--worker-extension-cls`, `PROFILE_FLAGS`) and vLLM's development
  routes (`VLLM_SERVER_DEV_MODE=1`, `PROFILE_ENV`), among them `POST /collective_rpc`, which calls a method on every
  worker: `hqlab_profile_start` before a point, `hqlab_profile_stop` after it (`step_profile`), whose rows are the
  timer's calls of that point; and `hqlab_corpus_reset` with `POST /reset_prefix_cache` before a corpus workload's
  point (`reset_server`). Every config of a run gets the same flags, `none` included, so that their plain steps
  are timed the same way; the timer costs a few microseconds a call (two CUDA events and a clock read), which is why
  the benchmark profiles chosen repeats only (`profiled` in the load rows) and the others measure the speed.
- `served_steps` turns a run's `phases.parquet` (the timer's rows tagged with the point) into one row per engine step
  (`hqlab.bench.engine_steps`), `served_parts` into the mean ms a step spends in each part at the point's full load,
  on the host's timeline and the GPU's (`engine_steps.step_parts`).
- `step_cost_ratios`: a served step's cost from the load rows, time per output token × tokens a step, ÷ `none`'s
  in the same repeat: the number issue #62's acceptance reads (≤ 1.15× at one request, ≤ 1.3× at 32 in flight).
- `goodput_served_costs`: that ratio beside what a goodput server's controller chose and priced a wide step at.

Standard library only at import: the GPU host runs the first half without polars.
"""

from __future__ import annotations

import json
import time
import urllib.request
from contextlib import contextmanager
from typing import Any, Iterator

PROFILE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}  # vLLM mounts /collective_rpc only in development mode
PROFILE_KEYS = ["run", "config", "dataset", "temperature", "max_concurrency", "repeat"]  # what tags a point's rows


def profile_flags() -> list[str]:
    """The `vllm serve` flags of a profiled server: hqlab's worker extension, which holds the step timer."""
    from hqlab.engines.vllm.worker import EXTENSION_PATH

    return ["--worker-extension-cls", EXTENSION_PATH]


def worker_rpc(base_url: str, method: str, *, timeout_s: float = 120.0) -> list[Any]:
    """Call `method` on every worker of a server through vLLM's `/collective_rpc`; one result per worker."""
    request = urllib.request.Request(base_url + "/collective_rpc", data=json.dumps({"method": method}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        body = json.loads(reply.read() or b"{}")
    if not isinstance(body.get("results"), list):
        raise RuntimeError(f"{base_url}/collective_rpc {method}: no results in the reply ({str(body)[:200]})")
    return body["results"]


def keeps_corpus(spec: str) -> bool:
    """Whether a served config drafts from earlier requests, so that its reset must answer True: a gpu-lookup with
    `corpus` > 0, or vLLM's suffix method (`arctic-suffix`) with a global tree (`cached` > 0)."""
    from hqlab.config import parse_spec

    name, values = parse_spec(spec)
    if name == "arctic-suffix":
        return values.get("cached", "0") != "0"
    return values.get("corpus", "0") != "0"


def reset_server(base_url: str, spec: str, *, timeout_s: float = 120.0) -> None:
    """Empty a server's corpus and prefix cache before a corpus workload's point, through vLLM's development routes
    (the server started with `profile_flags()` and `PROFILE_ENV`), so that the point's corpus holds
    only its own earlier answers and every repeat pays the same prefills. Raises where a config with a corpus did not
    empty one, or the prefix cache was not reset."""
    has_corpus = keeps_corpus(spec)
    emptied = [str(x) for x in worker_rpc(base_url, "hqlab_corpus_reset", timeout_s=timeout_s)]
    if emptied != [str(has_corpus)]:
        raise RuntimeError(f"{base_url}: corpus reset answered {emptied} for {spec!r} (expected [{has_corpus}])")
    for attempt in range(5):  # vLLM refuses while blocks are still held (a finished point's last frees), then agrees
        request = urllib.request.Request(base_url + "/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            if json.loads(reply.read() or b"{}").get("success"):
                return
        time.sleep(1.0)
    raise RuntimeError(f"{base_url}: the prefix cache was not reset after 5 tries (requests still running?)")


def check_repeats(repeats: list[int], point: Any, runs: int) -> None:
    """ConfigError unless every profiled repeat is one that `point` runs (it runs `runs` repeats, 0 to runs - 1): a
    point would otherwise end without a profile."""
    from hqlab.config import ConfigError

    if any(not 0 <= r < runs for r in repeats):
        raise ConfigError(f"profiled repeats {repeats}: {point.dataset} at {point.max_concurrency} in flight runs "
                          f"repeats 0 to {runs - 1}")


@contextmanager
def step_profile(base_url: str, sink: list[dict[str, Any]], *, on: bool = True, **tags: Any) -> Iterator[None]:
    """Time the worker's steps while the block runs (a load point), then append the timer's rows, each with `tags`
    (the point: PROFILE_KEYS), to `sink`; with `on` false the block just runs. A server started without
    `profile_flags` and `PROFILE_ENV` is refused."""
    if not on:
        yield
        return
    started = worker_rpc(base_url, "hqlab_profile_start")
    if [str(x) for x in started] != ["True"]:  # the route sends a result that is no list or dict as its str()
        raise RuntimeError(f"{base_url}: the step timer did not start on its one worker (got {started}): start the "
                           "server with profile_flags() and PROFILE_ENV")
    try:
        yield
    finally:
        rows = worker_rpc(base_url, "hqlab_profile_stop")[0]
        sink.extend({**row, **tags} for row in rows)


def served_steps(phases: Any) -> Any:
    """One row per engine step of every profiled point of a serving run (`engine_steps` over PROFILE_KEYS)."""
    from hqlab.bench.engine_steps import engine_steps

    return engine_steps(phases, PROFILE_KEYS)


def served_parts(phases: Any) -> Any:
    """Mean ms a step spends in each part (host and GPU timelines: `engine_steps.step_parts`) per profiled point,
    over the steps that ran the point's full load, with each config's short label and `extra_ms`, the part's ms
    beyond `none`'s at the same point."""
    import polars as pl

    from hqlab.bench.engine_steps import step_parts
    from hqlab.bench.serve import short_config

    parts = step_parts(served_steps(phases), PROFILE_KEYS, load="max_concurrency")
    point = [k for k in PROFILE_KEYS if k != "config"]
    plain = parts.filter(pl.col("config") == "none").select(*point, "part", pl.col("ms").alias("none_ms"))
    return (parts.join(plain, on=[*point, "part"], how="left")
            .with_columns((pl.col("ms") - pl.col("none_ms")).alias("extra_ms"),
                          pl.col("config").map_elements(short_config, return_dtype=pl.String).alias("label"))
            .sort(*point, "config", "timeline", "part"))


def part_bars(parts: Any) -> Any:
    """`served_parts` as the stacked-bar figure draws it (`hqlab.plots.stacked_time`): one bar per (config, timeline)
    at each load, its parts as columns (null where a part is the other timeline's)."""
    import polars as pl

    bars = (parts.group_by("label", "timeline", "max_concurrency", "part").agg(pl.col("ms").mean())
            .with_columns(pl.format("{} · {}", pl.col("label"), pl.col("timeline")).alias("bar"),
                          pl.format("{} in flight", pl.col("max_concurrency")).alias("load")))
    return (bars.pivot(on="part", index=["bar", "load", "max_concurrency"], values="ms")
            .sort("max_concurrency", "bar").drop("max_concurrency"))


def step_cost_ratios(rows: Any, reference: str = "none") -> Any:
    """Per serving point and repeat: each config's step (median time per output token × tokens a step, vLLM's
    acceptance length; a plain step emits one token) ÷ `reference`'s in the same repeat, then the median and range
    over repeats, per (run, dataset, temperature, max_concurrency, config). Repeats that ran the step timer
    (`profiled`) are left out: the timer adds to every step."""
    import polars as pl

    if "profiled" in rows.columns:
        rows = rows.filter(~pl.col("profiled").fill_null(False))

    keys = ["run", "dataset", "temperature", "max_concurrency"]
    repeat = pl.col("repeat").fill_null(0) if "repeat" in rows.columns else pl.lit(0)
    tokens = pl.when(pl.col("config") == reference).then(1.0).otherwise(pl.col("acceptance_length"))
    steps = rows.with_columns(repeat.cast(pl.Int64).alias("repeat"),
                              (pl.col("median_tpot_ms") * tokens).alias("step_ms"), tokens.alias("tokens_a_step"))
    ref = steps.filter(pl.col("config") == reference).select(*keys, "repeat", pl.col("step_ms").alias("plain_ms"))
    if ref.is_empty():
        raise ValueError(f"no {reference!r} rows to divide by")
    per = steps.join(ref, on=[*keys, "repeat"]).with_columns((pl.col("step_ms") / pl.col("plain_ms")).alias("ratio"))
    return (per.group_by(*keys, "config")
            .agg(pl.col("step_ms", "plain_ms", "tokens_a_step").median(), pl.col("ratio").median(),
                 pl.col("ratio").min().alias("ratio_min"), pl.col("ratio").max().alias("ratio_max"),
                 pl.len().alias("repeats"))
            .sort(*keys, "config"))


def goodput_served_costs(decisions: Any, rows: Any, reference: str = "none") -> Any:
    """The goodput servers of a serving run, what their controllers chose and priced beside what their steps cost:
    `hqlab.replay.goodput_served.served_widths` of the run's decisions (per server `config` and batch bucket: the
    share of calls at each width, `wide`, and `priced_x`, the priced cost of the chosen wide width over a plain step,
    with `prices` saying whence), `label` (`serve.short_config`), and `step_cost_ratios` of the same server at the
    served load nearest the bucket: `load` (on a log scale, from the bucket's geometric middle), `in_bucket` (the
    load lies in the bucket), `measured`, `measured_min`, `measured_max` (the median and range over repeats) and
    `tokens_a_step`. The measured step is a whole served step (time per output token × tokens a step), plain ones
    among them; the priced one is a wide decode step. A server's record spans every point it served, so `rows` must
    hold one dataset and temperature."""
    import polars as pl

    from hqlab.bench.serve import short_config
    from hqlab.config import require
    from hqlab.replay.goodput_served import served_widths

    chosen = served_widths(decisions)
    rows = rows.filter(pl.col("config").is_in(chosen["config"].unique().implode()) | (pl.col("config") == reference))
    points = rows.select("dataset", "temperature").unique()
    require(points.height == 1, f"the goodput servers' rows hold {points.height} (dataset, temperature) pairs: a "
            "server's decisions span them all, so give the rows of one (one workload a run)")
    ratios = step_cost_ratios(rows, reference).select(
        "config", pl.col("max_concurrency").alias("load"), pl.col("ratio").alias("measured"),
        pl.col("ratio_min").alias("measured_min"), pl.col("ratio_max").alias("measured_max"), "tokens_a_step")
    middle = (pl.col("lo") * (2 * pl.col("lo") - 1)).sqrt()
    nearest = (chosen.join(ratios, on="config", how="left")
               .with_columns((pl.col("load").log(2) - middle.log(2)).abs().alias("_far"))
               .sort("config", "lo", "_far", "load", nulls_last=True).group_by("config", "lo", maintain_order=True)
               .first().drop("_far"))
    return (chosen.select("config", "lo").join(nearest, on=["config", "lo"], how="left")  # the served widths' order
            .with_columns(pl.col("config").map_elements(short_config, return_dtype=pl.String).alias("label"),
                          ((pl.col("lo") <= pl.col("load")) & (pl.col("load") < 2 * pl.col("lo"))).alias("in_bucket"))
            .select("config", "label", *[c for c in chosen.columns if c != "config"], "load", "in_bucket",
                    pl.col("^measured.*$"), "tokens_a_step"))


def goodput_served_bars(costs: Any) -> tuple[Any, Any]:
    """`goodput_served_costs` as its figure draws it: (shares, steps). `shares` (`hqlab.plots.stacked_time`): per
    `server` ("<label> (prices: <whence>)") and bucket (`batches`), `width <w>` per candidate width, the share of
    calls fixing it. `steps` (`hqlab.plots.ranges`): per server and load lying in a bucket (`load`, "N in flight"),
    a row per `series`, "<label>: priced (<whence>)" (`ratio` the priced wide step over a plain one, `lo` = `hi` =
    it) and "<label>: measured" (the served step's ratio, median and range over repeats)."""
    import polars as pl

    widths = sorted(int(c.removeprefix("chose_")) for c in costs.columns if c.startswith("chose_"))
    shares = costs.select(pl.format("{} (prices: {})", pl.col("label"), pl.col("prices")).alias("server"), "batches",
                          *[pl.col(f"chose_{w}").alias(f"width {w}") for w in widths])
    loaded = costs.filter(pl.col("in_bucket")).with_columns(pl.format("{} in flight", pl.col("load")).alias("load"))
    server = {c: i for i, c in enumerate(costs["config"].unique(maintain_order=True))}
    loaded = loaded.with_columns(pl.col("config").replace_strict(server, return_dtype=pl.Int64).alias("server"))
    priced = loaded.select("server", "load", pl.format("{}: priced ({})", pl.col("label"), pl.col("prices"))
                           .alias("series"), *[pl.col("priced_x").alias(c) for c in ("ratio", "lo", "hi")])
    measured = loaded.select("server", "load", pl.format("{}: measured", pl.col("label")).alias("series"),
                             pl.col("measured").alias("ratio"), pl.col("measured_min").alias("lo"),
                             pl.col("measured_max").alias("hi"))
    # each server's priced series beside its measured one, servers in the table's order
    return shares, pl.concat([priced, measured]).sort("server", maintain_order=True).drop("server")


__all__ = ["PROFILE_ENV", "PROFILE_KEYS", "profile_flags", "worker_rpc", "keeps_corpus", "reset_server",
           "check_repeats", "step_profile", "served_steps", "served_parts", "part_bars", "step_cost_ratios",
           "goodput_served_costs", "goodput_served_bars"]
