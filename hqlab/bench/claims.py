"""What the docs say of a committed run, as data beside it: data/results/<study>/<run>/claims.json, a list of claims
that `check` evaluates on the run's own tables (`hqlab.bench.results`), so a number a page quotes fails a test the
day the run's rows say otherwise.

A claim (`Claim`):

    {"what": "the best hqlab config is at least 0.95x none in every group",  the sentence it checks
     "view": "best_ratio",         a table of the run (rows, steps, samples, ...; default rows) or a view (`VIEWS`)
     "args": {},                   the view's arguments (optional)
     "filter": "dataset = 'prose' AND max_concurrency = 1",   an SQL condition on the view's rows (optional)
     "by": ["dataset"],            group the rows: the claim must hold in every group, and there must be one (optional)
     "metric": "min(ratio)",       an SQL aggregate over the (filtered, grouped) rows: the value tested
     "op": ">=", "value": 0.95}    ==, !=, <, <=, >, >=, between [lo, hi], in [...], approx (within "tol")

The SQL is polars' (`DataFrame.sql`): the view's rows are the table `self`; a column name with spaces is quoted
("same distribution"). A metric over no rows is null and fails every op but `==` null. Views are library readers
(`serve.speedup_table`, `vllm_report.best_fused`, `corpus_report.speedups`, ...) applied to the run's tables, so a
claim states what the docs read off the same numbers; a view may read other runs of the study where the docs
compare with them (`reference_run`, `with_runs`, `rerun`).
"""

from __future__ import annotations

import json
import math
import re
import tarfile
from dataclasses import dataclass, field
from decimal import Decimal
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import polars as pl

from hqlab.bench import corpus_report, results, serve, serve_profile, vllm_report

CLAIMS = "claims.json"
OPS = ("==", "!=", "<", "<=", ">", ">=", "between", "in", "approx")
FIELDS = ("what", "view", "args", "filter", "by", "metric", "op", "value", "tol")


class ClaimError(ValueError):
    """A claim that cannot be evaluated as written (unknown view, op or field, bad SQL): names the claim."""


@dataclass(frozen=True)
class Claim:
    what: str
    metric: str
    op: str
    value: Any
    view: str = "rows"
    args: dict = field(default_factory=dict)
    filter: str | None = None
    by: tuple[str, ...] = ()
    tol: float = 0.005

    @classmethod
    def of(cls, entry: dict, where: str) -> "Claim":
        unknown = set(entry) - set(FIELDS)
        missing = {"what", "metric", "op", "value"} - set(entry)
        if unknown or missing:
            raise ClaimError(f"{where}: " + "; ".join(
                ([f"unknown field(s) {', '.join(sorted(unknown))}"] if unknown else [])
                + ([f"missing field(s) {', '.join(sorted(missing))}"] if missing else [])) + f" (fields: {FIELDS})")
        if entry["op"] not in OPS:
            raise ClaimError(f"{where}: op {entry['op']!r} is not one of {OPS}")
        if entry["op"] == "between" and not (isinstance(entry["value"], list) and len(entry["value"]) == 2):
            raise ClaimError(f"{where}: `between` takes [low, high], got {entry['value']!r}")
        return cls(**{**entry, "by": tuple(entry.get("by") or ()), "args": dict(entry.get("args") or {})})


@dataclass(frozen=True)
class Verdict:
    claim: Claim
    held: bool
    found: list[tuple[dict, Any]]  # (group, value) per group; one group ({}) without `by`

    def describe(self) -> str:
        shown = ", ".join(f"{_group(g)}{_short(v)}" for g, v in self.found[:12]) or "no rows"
        more = f" (+{len(self.found) - 12} groups)" if len(self.found) > 12 else ""
        return (f"{'held' if self.held else 'FAILED'}: {self.claim.what} -- {self.claim.metric} "
                f"{self.claim.op} {self.claim.value!r}; found {shown}{more}")


def _group(group: dict) -> str:
    return "" if not group else "[" + ", ".join(f"{k}={v}" for k, v in group.items()) + "] "


def _short(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else repr(value)


class RunData:
    """A committed run's tables, files and index entry, each read once (what views read)."""

    def __init__(self, study: str, run: str, root: str | Path | None = None):
        self.study, self.run, self.root = study, run, root
        self._tables: dict[str, pl.DataFrame] = {}
        self._views: dict[str, pl.DataFrame] = {}

    @cached_property
    def info(self) -> dict:
        return results.run_info(self.study, self.run, self.root)

    def table(self, kind: str, run: str | None = None) -> pl.DataFrame:
        """The `kind` table of this run, or of another run of the study."""
        key = f"{run or self.run}/{kind}"
        if key not in self._tables:
            self._tables[key] = results.load(self.study, run or self.run, kind, root=self.root)
        return self._tables[key]

    def tables(self, kind: str, runs: list[str]) -> pl.DataFrame:
        return pl.concat([self.table(kind, r) for r in runs], how="diagonal_relaxed")

    def view(self, name: str, args: dict) -> pl.DataFrame:
        """A view (`VIEWS`) of this run, computed once per arguments."""
        key = json.dumps([name, args], sort_keys=True)
        if key not in self._views:
            self._views[key] = VIEWS[name](self, **args)
        return self._views[key]

    def text(self, name: str) -> str:
        return results.read_text(self.study, self.run, name, self.root)

    def has(self, name: str) -> bool:
        return name in self.info["files"] or name + ".gz" in self.info["files"]


# --- views: the readers the docs use, over one run's tables -------------------------------------------------------

def _serve_labels(table: pl.DataFrame) -> pl.DataFrame:
    """A short label and, for gpu-fused configs, the drafter's head length (`block`, draft_block)."""
    from hqlab.config import parse_spec

    def block(config: str) -> int | None:
        if not config.startswith("gpu-fused"):
            return None
        return int(parse_spec(config.partition(" [")[0])[1].get("draft_block", "1"))

    return table.with_columns(pl.col("config").map_elements(serve.short_config, return_dtype=pl.String).alias("label"),
                              pl.col("config").map_elements(block, return_dtype=pl.Int64).alias("block"))


def speedup_table(data: RunData, metric: str = "output_throughput") -> pl.DataFrame:
    return _serve_labels(serve.speedup_table(data.table("rows"), metric=metric))


def best_ratio(data: RunData) -> pl.DataFrame:
    return _serve_labels(serve.best_ratio(serve.speedup_table(data.table("rows"))))


def served_heads(data: RunData) -> pl.DataFrame:
    return serve.served_heads(data.table("rows"), data.run)


def sampling_verdicts(data: RunData, reference_run: str | None = None, positions: int = 24) -> pl.DataFrame:
    """Every sampled server of the run against `none`'s samples (of `reference_run`, where this run sampled none)."""
    reference = data.table("samples", reference_run).filter(pl.col("config") == "none")
    if reference.height != 1:
        raise ClaimError(f"{data.study}/{reference_run or data.run}: expected one `none` row of samples, found "
                         f"{reference.height}")
    samples = data.table("samples").filter(pl.col("config") != "none")
    return serve.sampling_verdicts(reference["token_ids"][0].to_list(), samples, positions=positions)


def greedy_partings(data: RunData) -> pl.DataFrame:
    """Where each server's greedy text parts from `none`'s: config, prompt, position, none's margin there."""
    parted = serve.greedy_partings(data.table("greedy"))
    return pl.DataFrame(parted, schema=["config", "prompt", "position", "margin"], orient="row")


def greedy_texts(data: RunData) -> pl.DataFrame:
    """One row per (config, prompt) of the greedy texts: its length and whether it equals `none`'s."""
    greedy = data.table("greedy")
    none = greedy.filter(pl.col("config") == "none")["texts"][0].to_list()
    rows = [{"config": config, "prompt": i, "chars": len(text), "equal_none": text == none[i]}
            for config, texts in zip(greedy["config"], greedy["texts"].to_list()) for i, text in enumerate(texts)]
    return pl.DataFrame(rows)


def server_logs(data: RunData) -> pl.DataFrame:
    """What each server's log says (`serve.server_log_facts`): the loose logs and the archive's members."""
    texts = [(name, data.text(name)) for name in data.info["files"] if re.fullmatch(r"server_\d+\.log", name)]
    if data.has("server_logs.tar.gz"):
        with tarfile.open(results.run_file(data.study, data.run, "server_logs.tar.gz", data.root)) as tar:
            texts += [(m.name, tar.extractfile(m).read().decode(errors="replace")) for m in tar.getmembers()
                      if m.isfile()]
    return pl.DataFrame([{"log": name, **serve.server_log_facts(text)} for name, text in texts])


def step_costs(data: RunData, config: str, dataset: str) -> pl.DataFrame:
    """One row: the plain and the speculative step (`serve.step_costs`) at one request on `dataset`, and their ratio."""
    rows = data.table("rows").filter((pl.col("dataset") == dataset) & pl.col("config").is_in(["none", config]))
    plain, spec = serve.step_costs(rows, config)
    return pl.DataFrame({"plain_ms": [plain], "spec_ms": [spec], "ratio": [spec / plain]})


def served_step_costs(data: RunData) -> pl.DataFrame:
    """Per load and config: a served step (time per output token × tokens a step) over `none`'s, median and range
    over repeats (`serve_profile.step_cost_ratios`)."""
    return serve_profile.step_cost_ratios(data.table("rows"))


def goodput_served(data: RunData) -> pl.DataFrame:
    """Per goodput server and batch bucket: the share of calls at each width and the priced wide step over a plain
    one, beside the served step's ratio at the nearest load (`serve_profile.goodput_served_costs`)."""
    return serve_profile.goodput_served_costs(data.table("goodput_decisions"), data.table("rows"))


def run_ratios(data: RunData) -> pl.DataFrame:
    return vllm_report.run_ratios(data.table("rows"))


def concurrency(data: RunData) -> pl.DataFrame:
    return vllm_report.concurrency(data.table("rows"))




def best_fused(data: RunData) -> pl.DataFrame:
    return vllm_report.best_fused(data.table("rows"), data.table("repeats"), data.run)


def cost_model_check(data: RunData, with_runs: list[str] | None = None, host_level: bool = False) -> pl.DataFrame:
    """Each gpu-lookup config predicted from the run's other configs (pooled with `with_runs`, the calls of one
    session finished as separate runs)."""
    runs = [data.run, *(with_runs or [])]
    return vllm_report.cost_model_check(data.tables("steps", runs), runs, host_level=host_level)


def burst(data: RunData) -> pl.DataFrame:
    """The fused configs' rows in the burst, each with its tokens per step alone (median) and how far the burst's
    is off it (`off`: burst ÷ alone - 1)."""
    fused = data.table("rows").filter(pl.col("config").str.starts_with("gpu-fused"))
    alone = fused.filter(pl.col("concurrency") <= 1).group_by("config", "prompt_id").agg(
        pl.col("tokens_per_step").median().alias("alone_tokens_per_step"))
    return (fused.filter(pl.col("load") == "burst").join(alone, on=["config", "prompt_id"], how="left")
            .with_columns((pl.col("tokens_per_step") / pl.col("alone_tokens_per_step") - 1).alias("off")))


def burst_blocks(data: RunData) -> pl.DataFrame:
    return vllm_report.burst_blocks(data.table("steps"), data.run)


def replay(data: RunData, rerun: str | None = None) -> pl.DataFrame:
    """The lab's replay of the run's fused configs (`vllm_report.replay_rows`), `rerun`'s standing in where it
    repeated a config step for step."""
    runs = [data.run, *([rerun] if rerun else [])]
    return vllm_report.replay_rows(data.tables("replay", runs), data.run, data.tables("steps", runs), rerun)


def same_steps(data: RunData, rerun: str, config: str) -> pl.DataFrame:
    """One row: whether `rerun` took the run's steps of `config` step for step."""
    steps = data.tables("steps", [data.run, rerun])
    return pl.DataFrame({"same": [vllm_report.same_steps(steps, data.run, rerun, config)]})


def round_step_ms(data: RunData) -> pl.DataFrame:
    return vllm_report.round_step_ms(data.table("repeats"), data.run)




def gpu_phases(data: RunData, category: str | None = None) -> pl.DataFrame:
    return vllm_report.gpu_phases(data.table("phases"), data.run, category=category)




def speculator_host_ms(data: RunData) -> pl.DataFrame:
    return vllm_report.speculator_host_ms(data.table("steps"), [data.run])


def _corpus_labels(table: pl.DataFrame) -> pl.DataFrame:
    """The config's label as the corpus docs write it (`corpus_report.label`; `none` stays `none`)."""
    def label(config: str) -> str:
        return config if config == "none" else corpus_report.label(config)

    return table.with_columns(pl.col("config").map_elements(label, return_dtype=pl.String).alias("label"))


def corpus_speedups(data: RunData) -> pl.DataFrame:
    return _corpus_labels(corpus_report.speedups(data.table("rows")))


def greedy_differences(data: RunData) -> pl.DataFrame:
    return _corpus_labels(corpus_report.greedy_differences(data.table("requests")))


def waves(data: RunData) -> pl.DataFrame:
    return _corpus_labels(corpus_report.waves(data.table("requests")))


def sweep_ranking(data: RunData) -> pl.DataFrame:
    """The swept GPU settings ranked by their worst margin over the issue's bars (`corpus_vllm.meets`), `rank` 1
    first."""
    from hqlab.replay import corpus_vllm

    swept = data.table("rows").filter(pl.col("kind") == "sweep")
    return corpus_vllm.meets(swept, corpus_report.BAR).with_row_index("rank", offset=1)


def slow_steps(data: RunData) -> pl.DataFrame:
    return corpus_report.slow_steps(data.table("rows"))


def output_pairs(data: RunData, a: str, b: str, load_a: int = 1, load_b: int = 1) -> pl.DataFrame:
    """The greedy outputs of config `a` at `load_a` beside those of `b` at `load_b`, request by request (same
    workload, repeat and order): one row per pair, `differ` where they are not the same tokens."""
    key = ["workload", "repeat", "order"]
    requests = data.table("requests")
    left = requests.filter((pl.col("config") == a) & (pl.col("load") == load_a)).select(*key, "output_ids")
    right = requests.filter((pl.col("config") == b) & (pl.col("load") == load_b)).select(
        *key, pl.col("output_ids").alias("other"))
    return left.join(right, on=key).select(*key, (pl.col("output_ids") != pl.col("other")).alias("differ"))


def first_token(data: RunData, load: int = 1) -> pl.DataFrame:
    """Per config at `load`: its requests, the median time to the first token (ms), the prompt lengths' range and the
    correlation of the first token's time with the prompt's length (`r`)."""
    length = pl.col("prompt_ids").list.len()
    return (data.table("requests").filter(pl.col("load") == load).group_by("config")
            .agg(pl.len().alias("requests"), (pl.col("ttft_s").median() * 1e3).alias("ms"),
                 length.min().alias("shortest"), length.max().alias("longest"),
                 pl.corr(length, "ttft_s").alias("r")))




def grid_points(data: RunData, with_runs: list[str] | None = None) -> pl.DataFrame:
    """The step-cost grid as read with earlier runs' grids (`scale.newest_points(with_runs + [run])`), each point with
    its shape's single-request width-1 step at 1,024 tokens (`floor_ms`) and its step over the same point's at width
    1 (`over_width1`)."""
    from hqlab.replay import scale

    runs = [*(with_runs or []), data.run]
    costs = scale.check_step_costs(scale.newest_points(data.tables("grid", runs), runs))
    floor = (costs.filter((pl.col("batch") == 1) & (pl.col("width") == 1) & (pl.col("context") == 1024))
             .select("shape", "quant", pl.col("step_ms").alias("floor_ms")))
    width1 = costs.filter(pl.col("width") == 1).select("shape", "quant", "context", "batch",
                                                        pl.col("step_ms").alias("width1_ms"))
    return (costs.join(floor, on=["shape", "quant"], how="left")
            .join(width1, on=["shape", "quant", "context", "batch"], how="left")
            .with_columns((pl.col("step_ms") / pl.col("width1_ms")).alias("over_width1")))


def validation(data: RunData, prices: str = "as finished") -> pl.DataFrame:
    """The run's validation recomputed from its own grid and decodes (`scale.validate_runs`), beside its committed
    check table: `recomputed_ratio`, `recomputed_within` and the relative difference `ratio_drift`. `prices`: "as
    finished" prices each step as `finish` did (`scale.decode_costs`: a point's mean where the grid kept means),
    "median" with each point's median step."""
    from hqlab.replay import scale

    check = data.table("check")
    if prices not in ("as finished", "median"):
        raise ClaimError(f"validation prices {prices!r}: 'as finished' or 'median'")
    costs = scale.decode_costs(data.table("grid"))[0] if prices == "as finished" else data.table("grid")
    shapes = {run: SHAPES[run.rsplit("_", 1)[1]] for run in check["run"].unique().to_list()}
    parts = {kind: data.table(kind) if data.has(f"{kind}.parquet") else None for kind in ("phases", "repeats")}
    table = scale.validate_runs(costs, data.table("steps"), data.table("rows"), shapes, **parts)
    return check.join(table.select("run", "config", "category", pl.col("ratio").alias("recomputed_ratio"),
                                   pl.col("within").alias("recomputed_within")),
                      on=["run", "config", "category"], how="left").with_columns(
        ((pl.col("recomputed_ratio") / pl.col("ratio") - 1).abs()).alias("ratio_drift"))


def checks(data: RunData, with_runs: list[str] | None = None) -> pl.DataFrame:
    """The validation tables (check.parquet) of this run and `with_runs`, stacked: what the docs total."""
    return data.tables("check", [data.run, *(with_runs or [])])


def decode_validation(data: RunData, decodes: dict[str, list[str]], grid_runs: list[str] | None = None) -> pl.DataFrame:
    """Decodes of other studies priced with this run's grid (read with `grid_runs` before it, `scale.newest_points`)
    and the profiled pass where the grid has no fused step (`scale.validate`): `decodes` maps a study to [run, the
    grid shape of its model, the profiled run of that study or ""]."""
    from hqlab.replay import scale

    runs = [*(grid_runs or []), data.run]
    costs = scale.newest_points(data.tables("grid", runs), runs) if grid_runs else data.table("grid")
    tables = []
    for study, (run, shape, profiled_run) in decodes.items():
        other = RunData(study, run, data.root)
        profiled = None
        if profiled_run and not scale.has_fused(costs, shape):
            profiled = scale.profiled_pass_ms(other.table("phases", profiled_run), profiled_run)
        tables.append(scale.validate(costs, other.table("steps"), other.table("rows"), run, shape, fused_shape=shape,
                                     profiled_pass=profiled))
    return pl.concat(tables, how="diagonal_relaxed")


SHAPES = {"05b": "qwen2.5-0.5b", "15b": "qwen2.5-1.5b"}  # a seed-scale decode run's suffix -> the grid shape


VIEWS: dict[str, Callable[..., pl.DataFrame]] = {
    f.__name__: f for f in (
        speedup_table, best_ratio, served_heads, sampling_verdicts, greedy_partings, greedy_texts, server_logs,
        step_costs, served_step_costs, goodput_served, run_ratios, concurrency, best_fused, cost_model_check, burst,
        burst_blocks, replay, same_steps, round_step_ms, gpu_phases, speculator_host_ms, corpus_speedups,
        greedy_differences, waves, sweep_ranking, slow_steps, output_pairs, first_token, grid_points, validation,
        checks, decode_validation)}


# --- evaluation ---------------------------------------------------------------------------------------------------

def frame_of(claim: Claim, data: RunData) -> pl.DataFrame:
    """The rows a claim tests: its view over the run (a view, or a table of the run), filtered."""
    if claim.view in VIEWS:
        frame = data.view(claim.view, claim.args)
    elif claim.args:
        raise ClaimError(f"{claim.what!r}: the table {claim.view!r} takes no args (views: {', '.join(VIEWS)})")
    elif data.has(f"{claim.view}.parquet"):
        frame = data.table(claim.view)
    else:
        raise ClaimError(f"{claim.what!r}: no view and no table {claim.view!r} of run {data.study}/{data.run} "
                         f"(views: {', '.join(VIEWS)}; its files: {', '.join(data.info['files'])})")
    return _sql(claim, frame, f"SELECT * FROM self WHERE {claim.filter}") if claim.filter else frame


def _sql(claim: Claim, frame: pl.DataFrame, query: str) -> pl.DataFrame:
    try:
        return frame.sql(query)
    except Exception as e:  # polars raises several kinds for bad SQL
        raise ClaimError(f"{claim.what!r}: {query!r} does not run on the view {claim.view!r} "
                         f"(columns: {', '.join(frame.columns)}): {str(e).splitlines()[0]}") from None


def _value(value: Any) -> Any:
    if isinstance(value, pl.Series):
        return value.to_list()
    if isinstance(value, Decimal):  # what polars' SQL gives for round()
        return float(value)
    if isinstance(value, list):
        return [_value(v) for v in value]
    return value


def holds(op: str, found: Any, value: Any, tol: float = 0.005) -> bool:
    """Whether `found op value` (`OPS`); a null or NaN found fails every test but `==` null."""
    if found is None or (isinstance(found, float) and math.isnan(found)):
        return op == "==" and value is None
    if op == "==":
        return found == value
    if op == "!=":
        return found != value
    if op == "in":
        return found in value
    if op == "between":
        return value[0] <= found <= value[1]
    if op == "approx":
        return abs(found - value) <= tol
    return {"<": found < value, "<=": found <= value, ">": found > value, ">=": found >= value}[op]


def check(claim: Claim, data: RunData) -> Verdict:
    """Evaluate one claim on a run: its metric over the view's (filtered) rows, per group where `by` names them."""
    return _verdict(claim, frame_of(claim, data))


def check_frame(claim: Claim, rows: pl.DataFrame) -> Verdict:
    """Evaluate a claim on a run's rows in hand, before they are committed (a plan's pass criteria checked by the
    `finish` that writes the run): its filter, grouping and metric over `rows`. Only a claim on the rows table."""
    if claim.view != "rows" or claim.args:
        raise ClaimError(f"{claim.what!r}: a claim on rows in hand reads the rows table, not {claim.view!r}")
    return _verdict(claim, _sql(claim, rows, f"SELECT * FROM self WHERE {claim.filter}") if claim.filter else rows)


def _verdict(claim: Claim, frame: pl.DataFrame) -> Verdict:
    keys = ", ".join(f'"{k}"' for k in claim.by)
    query = (f"SELECT {keys}, {claim.metric} AS value FROM self GROUP BY {keys}" if claim.by
             else f"SELECT {claim.metric} AS value FROM self")
    out = _sql(claim, frame, query)
    found = [({k: row[k] for k in claim.by}, _value(row["value"])) for row in out.iter_rows(named=True)]
    held = bool(found) and all(holds(claim.op, v, claim.value, claim.tol) for _, v in found)
    return Verdict(claim, held, found)


def claims_of(study: str, run: str, root: str | Path | None = None) -> list[Claim]:
    """The claims committed beside a run (none where it has no claims.json)."""
    entry = results.run_info(study, run, root)
    if CLAIMS not in entry["files"]:
        return []
    path = results.run_file(study, run, CLAIMS, root)
    entries = json.loads(path.read_text())
    if not isinstance(entries, list):
        raise ClaimError(f"{path}: a list of claims, got {type(entries).__name__}")
    return [Claim.of(e, f"{path} claim {i}") for i, e in enumerate(entries)]


def manifest(root: str | Path | None = None) -> list[tuple[str, str, Claim]]:
    """(study, run, claim) of every claim of every committed run, in the index's order."""
    return [(r["study"], r["run"], claim) for r in results.index(root)
            for claim in claims_of(r["study"], r["run"], root)]


def check_run(study: str, run: str, root: str | Path | None = None) -> list[Verdict]:
    data = RunData(study, run, root)
    return [check(claim, data) for claim in claims_of(study, run, root)]


__all__ = ["CLAIMS", "OPS", "Claim", "ClaimError", "Verdict", "RunData", "VIEWS", "frame_of", "holds", "check",
           "check_frame", "claims_of", "manifest", "check_run"]
