"""benchmarks/seed_scale_validation.py (#41): which grid points the validation prices, the budget's skipping, and
`finish` on a returned dir written by `run` itself with the GPU tools stood in for (the step-cost benchmark's `one`
and vllm_gpu.py's bench write their files as they do on the host). No vLLM, no GPU."""

from __future__ import annotations

import json
import types
from pathlib import Path

import polars as pl
import pytest

from benchmarks import seed_scale_validation as v
from benchmarks import vllm_step_cost as grid_bench
from hqlab.replay import scale

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "data" / "results"
MACHINE = "NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, vllm 0.26.0"


# --- which points -------------------------------------------------------------------------------------------------


def test_verify_widths_and_bracketing_contexts():
    assert [v.verify_width(c) for c in ("none", v.LOOKUP_15, v.LOOKUP_31, v.FUSED_15, v.FUSED_31_SKIP)] == \
        [1, 16, 32, 16, 32]
    with pytest.raises(ValueError, match="no integer k"):
        v.verify_width("gpu-lookup:nmin=1")
    with pytest.raises(ValueError, match="prices only"):
        v.verify_width("lookup:k=31")  # the CPU lookup: its width varies step by step
    assert v.bracketing_contexts(140, 2323) == (128, 256, 512, 1024, 2048, 2560)  # the top: the longest step's,
    assert v.bracketing_contexts(1024, 1024) == (1024,)                           # rounded up to 512, not 4,096
    assert v.bracketing_contexts(1025, 1030) == (1024, 1536)
    assert v.bracketing_contexts(140, 2048) == (128, 256, 512, 1024, 2048)
    assert v.bracketing_contexts(140, 2323, top_step=1) == (128, 256, 512, 1024, 2048, 2323)
    with pytest.raises(ValueError, match="top_step"):
        v.bracketing_contexts(140, 2323, top_step=0)


def test_plan_measures_batch_one_at_the_configs_widths_then_decodes():
    items = v.make_plan(v.DEFAULT_CONFIGS)
    assert [(x.kind, x.model) for x in items] == [
        ("grid", "qwen2.5-coder-0.5b"), ("grid", "qwen2.5-coder-1.5b"),
        ("decode", "qwen2.5-coder-0.5b"), ("decode", "qwen2.5-coder-1.5b")]
    assert items[0].points == {"widths": (1, 16, 32), "contexts": (128, 256, 512, 1024, 2048, 2560),
                               "batches": (1,)}
    assert v.grid_argv(items[0], "t", "c", 100.0, Path("w"))[-2:] == ["--steps", str(v.GRID_STEPS)]
    assert items[1].points["widths"] == (1, 16, 32)  # gpu-lookup k=31 and gpu-fused k=15
    assert [x.profile for x in items[2:]] == [False, True]  # the fused pass from the 1.5B's own profile
    # the default plan fits the budget it is meant for
    assert sum(x.est_s for x in items) <= 520
    fused = v.make_plan(v.DEFAULT_CONFIGS, fused_grid=True)
    assert [(x.name, x.points.get("widths")) for x in fused if x.kind == "grid"][-1] == \
        ("grid qwen2.5-1.5b gpu-fused", (16,))
    assert not fused[-1].profile
    # the step-cost benchmark measures exactly these points (gpu-fused never at width 1)
    assert grid_bench.points("gpu-fused", "qwen2.5-1.5b", **fused[2].points) == \
        [(c, 1, 16) for c in (128, 256, 512, 1024, 2048, 2560)]


def _flat_grid(shape: str, points: dict, ms: dict[int, float], config: str = "gpu-lookup") -> list[dict]:
    return [{"run": "v", "shape": shape, "target_params_b": 1.0, "layers": 1, "hidden": 1, "quant": "bf16",
             "config": config, "width": w, "context": c, "batch": 1, "step_ms": ms[w], "step_ms_p10": ms[w],
             "step_ms_p90": ms[w], "steps": 12, "drafter": "", "engine_start_s": 0.0, "machine": "m",
             "vllm_version": "0", "git_commit": "c"} for c in points["contexts"] for w in points["widths"]]


@pytest.mark.parametrize("run, file, configs, shape", [
    ("w2", "vllm_gpu_h200", [v.LOOKUP_15, v.LOOKUP_31], "qwen2.5-0.5b"),
    ("fn2", "vllm_fused_h200", [v.LOOKUP_15, v.LOOKUP_31, v.FUSED_15, v.FUSED_31_SKIP], "qwen2.5-1.5b")])
def test_the_chosen_points_price_every_step_of_the_committed_runs_without_clamping(run, file, configs, shape):
    """Every step of w2's and fn2's configs (the suite the new decodes run) lies inside the grid the plan measures:
    priced with outside_context="error"; a grid of fewer contexts is refused on the same steps."""
    steps = pl.read_parquet(RESULTS / f"{file}.steps.parquet").filter(pl.col("run") == run)
    results = pl.read_parquet(RESULTS / f"{file}.parquet").filter(pl.col("run") == run)
    grid = v.grid_points(configs, v.step_contexts(configs), fused_grid=True)
    ms = {1: 2.0, 16: 2.5, 32: 3.0}
    rows = _flat_grid(shape, grid["gpu-lookup"], ms)
    if "gpu-fused" in grid:
        rows += _flat_grid(shape, grid["gpu-fused"], {w: ms[w] + 1.0 for w in ms}, "gpu-fused")
    costs = pl.DataFrame(rows, schema=scale.STEP_COST_SCHEMA)
    table = scale.validate(costs, steps, results, run, shape, configs=["none", *configs], fused_shape=shape,
                           outside_context="error")
    assert table.height == 7 * (1 + len(configs)) and (table["clamped_share"] == 0).all()
    short = v.grid_points(configs, (1024, 2048))["gpu-lookup"]  # what s2 measured, about
    costs = pl.DataFrame(_flat_grid(shape, short, ms), schema=scale.STEP_COST_SCHEMA)
    with pytest.raises(scale.ScaleError, match="outside the grid"):
        scale.validate(costs, steps, results, run, shape, configs=["none", configs[0]], outside_context="error")


# --- the budget ---------------------------------------------------------------------------------------------------


def test_each_item_keeps_the_later_items_minimum_and_skips_what_does_not_fit():
    items = v.make_plan(v.DEFAULT_CONFIGS)
    ok = {"qwen2.5-coder-0.5b": True, "qwen2.5-coder-1.5b": True}
    go, limit, _ = v.decide(items, 0, 520, {})
    assert go and limit == pytest.approx(520 - v.END_MARGIN_S - sum(x.min_s for x in items[1:]))
    go, limit, _ = v.decide(items, 0, 300, {})  # short of time: the first item still gets 1.5 x its estimate
    assert go and limit == pytest.approx(1.5 * items[0].est_s)
    go, limit, _ = v.decide(items, 3, 520, ok)  # the last item gets what is left
    assert go and limit == pytest.approx(520 - v.END_MARGIN_S)
    go, _, why = v.decide(items, 3, items[3].min_s, ok)
    assert not go and "needs at least" in why
    # the 1.5B's grid failed: its decodes are skipped, and the 0.5B's decodes no longer keep time for them
    items[0].status, items[1].status = "done", "failed"
    go, limit, _ = v.decide(items, 2, 300, {"qwen2.5-coder-0.5b": True, "qwen2.5-coder-1.5b": False})
    assert go and limit == pytest.approx(300 - v.END_MARGIN_S)
    go, _, why = v.decide(items, 3, 300, {"qwen2.5-coder-0.5b": True, "qwen2.5-coder-1.5b": False})
    assert not go and "no grid rows" in why


# --- run with the GPU tools stood in for, then finish ---------------------------------------------------------------

COST = {("qwen2.5-0.5b", 1): 2.0, ("qwen2.5-0.5b", 16): 2.4, ("qwen2.5-0.5b", 32): 2.6,
        ("qwen2.5-1.5b", 1): 2.8, ("qwen2.5-1.5b", 16): 3.0, ("qwen2.5-1.5b", 32): 3.3}
PASS_MS = 1.1  # the 1.5B's fused drafter pass, as its profile times it
SLOW = {v.LOOKUP_15: 1.25}  # this config's decodes ran 25 % slower than the grid says: a miss the check must show
PROMPTS = [("copy", "copy", 2029), ("chat-module", "chat", 191)]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def monotonic(self) -> float:
        return self.t


def _value(cmd: list[str], name: str) -> str:
    for i, a in enumerate(cmd):
        if a == name:
            return cmd[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    raise KeyError(name)


def _generation(config: str, shape: str, prompt_len: int, tokens: int = 32):
    from hqlab.trace import Generation, step_record

    width = v.verify_width(config)
    per_step = 1 if width == 1 else 8
    ms = COST[(shape, width)] + (PASS_MS if v.config_kind(config) == "gpu-fused" else 0.0)
    ms *= SLOW.get(config, 1.0)
    records, t = [], 0.05
    for j in range(tokens // per_step):
        t += ms / 1e3
        records.append(step_record(config, j, context_len=prompt_len + j * per_step, accepted=per_step - 1,
                                   emitted=per_step, verify_len=width, step_s=ms / 1e3, t_end=t,
                                   drafter_passes=1 if v.config_kind(config) == "gpu-fused" else -1))
    return Generation(config, prompt_len, list(range(tokens + 1)), "length", 0.05, t, t, records, [])


def _write_bench(cmd: list[str], out: Path) -> None:
    """What vllm_gpu.py bench writes into $OUT: the raw runs and their description."""
    import pyarrow.parquet as pq

    from hqlab.bench.vllm_runs import Run, raw_table

    model, tag = _value(cmd, "--model"), _value(cmd, "--tag")
    configs = ["none", *[cmd[i + 1] for i, a in enumerate(cmd) if a == "--config"]]
    shape = v.SHAPE_OF[model]
    runs = [Run("none", pid, cat, -1, _generation("none", shape, n)) for pid, cat, n in PROMPTS]
    for r in runs:
        r.generation.margins[:] = [5.0] * len(r.generation.output_ids)
    runs += [Run(c, pid, cat, rep, _generation(c, shape, n)) for rep in range(int(_value(cmd, "--repeats")))
             for pid, cat, n in PROMPTS for c in configs]
    pq.write_table(raw_table(runs), out / f"vllm_gpu_{tag}.parquet")
    engines = [{"config": c, "model_runner": "v1", "async_scheduling": False} for c in configs]
    if "--profile" in cmd:
        for e in engines:
            phase = "propose (speculator)" if v.config_kind(e["config"]) == "gpu-fused" else "execute_model"
            e["profile"] = [{"prompt_id": pid, "category": cat, "steps": [],
                             "phases": [{"phase": phase, "host_start_ms": 0.0, "host_ms": 0.1, "gpu_start_ms": 0.0,
                                         "gpu_ms": PASS_MS}]} for pid, cat, _ in PROMPTS]
    meta = {"machine": MACHINE, "versions": {"vllm": "0.26.0"}, "model": model, "dtype": "bfloat16",
            "doc_tokens": 2000, "suite": "all", "max_new_tokens": 32, "repeats": 2, "concurrency": 0,
            "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "parallel_start": True,
            "engines": engines}
    (out / f"vllm_gpu_{tag}.json").write_text(json.dumps(meta) + "\n")


def _one(cmd: list[str]) -> None:
    """What vllm_step_cost.py one appends to the rows file: a row per point, every step at the grid's cost."""
    args = types.SimpleNamespace(tag=_value(cmd, "--tag"), shape=_value(cmd, "--shape"), quant=_value(cmd, "--quant"),
                                 engine=_value(cmd, "--engine"), commit=_value(cmd, "--commit"))
    config = _value(cmd, "--config")
    chosen = grid_bench.points(config, args.shape, contexts=grid_bench.int_list(_value(cmd, "--contexts")),
                               batches=grid_bench.int_list(_value(cmd, "--batches")),
                               widths=grid_bench.int_list(_value(cmd, "--widths")))
    with open(_value(cmd, "--rows"), "a") as f:
        for c, b, w in chosen:
            f.write(json.dumps(grid_bench.point_row(args, config, w, c, b, [COST[(args.shape, w)] / 1e3] * 12, 70.0,
                                                    MACHINE, "0.26.0")) + "\n")


@pytest.fixture
def gpu_side(tmp_path, monkeypatch):
    """`run` with the GPU tools stood in for and a clock that advances by what each takes (`took`, seconds)."""
    clock = Clock()
    fake_time = types.SimpleNamespace(monotonic=clock.monotonic, strftime=lambda *a: "00:00:00")
    monkeypatch.setattr(v, "time", fake_time)
    monkeypatch.setattr(grid_bench, "time", fake_time)
    out = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out))
    calls: list[tuple[str, float]] = []
    took = {"prepare": 5.0, "one": 90.0, "bench": 150.0}

    def bounded(cmd, timeout_s, **kwargs):
        what = "prepare" if "-c" in cmd else "one" if "one" in cmd else "bench"
        calls.append((what, timeout_s))
        if took[what] > timeout_s:
            clock.t += timeout_s
            return "timeout"
        clock.t += took[what]
        if what == "one":
            _one(list(cmd))
        elif what == "bench":
            _write_bench(list(cmd), out)
        return 0

    monkeypatch.setattr(grid_bench, "run_bounded", bounded)
    return types.SimpleNamespace(out=out, calls=calls, took=took, work=tmp_path / "work")


def test_run_skips_what_the_budget_cannot_hold_and_says_so(gpu_side):
    assert v.main(["run", "--tag", "v9", "--commit", "abc", "--budget-s", "400", "--work", str(gpu_side.work)]) == 0
    status = json.loads((gpu_side.out / "validation_v9.json").read_text())
    got = {x["name"]: x["status"] for x in status["items"]}
    # 5 + 90 + 90 + 150 = 335 s spent; the 1.5B's decodes need at least 145 of the 55 left
    assert got == {"grid qwen2.5-0.5b gpu-lookup": "done", "grid qwen2.5-1.5b gpu-lookup": "done",
                   "decode qwen2.5-coder-0.5b": "done", "decode qwen2.5-coder-1.5b": "skipped"}
    assert "needs at least" in status["items"][-1]["why"]
    assert [w for w, _ in gpu_side.calls] == ["prepare", "one", "one", "bench"]
    assert all(t <= 400 for _, t in gpu_side.calls)
    # the grid rows went to $OUT as the step-cost benchmark copies them
    rows = [json.loads(line) for line in (gpu_side.out / "seed_scale_v9.jsonl").read_text().splitlines()]
    assert {(r["shape"], r["width"], r["engine"]) for r in rows} == \
        {(s, w, "process") for s in ("qwen2.5-0.5b", "qwen2.5-1.5b") for w in (1, 16, 32)}


def test_a_decode_past_its_limit_is_cut_and_a_model_without_grid_rows_gets_none(gpu_side):
    gpu_side.took["bench"] = 1000.0
    v.main(["run", "--tag", "v8", "--budget-s", "520", "--work", str(gpu_side.work),
            "--model", "qwen2.5-coder-0.5b"])
    status = json.loads((gpu_side.out / "validation_v8.json").read_text())
    assert [x["status"] for x in status["items"]] == ["done", "cut"]
    assert "rounds it finished are saved" in status["items"][-1]["why"]
    assert status["elapsed_s"] <= 520


def test_finish_writes_grid_and_decodes_and_validates_against_the_same_hosts_decodes(gpu_side, tmp_path, capsys):
    assert v.main(["run", "--tag", "v7", "--commit", "abc", "--budget-s", "600", "--work", str(gpu_side.work)]) == 0
    assert len(list(gpu_side.out.iterdir())) <= 7  # a GPU call returns at most eight files, its log among them
    grid, decodes = tmp_path / "seed_scale_h100.parquet", tmp_path / "seed_scale_validation_h100.parquet"
    assert v.main(["finish", str(gpu_side.out), "--grid-out", str(grid), "--out", str(decodes)]) == 0
    costs = pl.read_parquet(grid)
    assert set(costs["run"]) == {"v7"} and set(costs["engine"]) == {"process"} and set(costs["batch"]) == {1}
    results = pl.read_parquet(decodes)
    assert set(results["run"]) == {"v7_05b", "v7_15b"} and set(results["git_commit"]) == {"abc"}
    check = pl.read_parquet(decodes.with_name("seed_scale_validation_h100.check.parquet"))
    within = {(r["run"], r["label"], r["category"]): r["within"] for r in check.iter_rows(named=True)}
    # every config priced exactly as its steps ran, but gpu-lookup k=15, 25 % slower than the grid says
    assert within == {(run, label, cat): label != "gpu-lookup k=15"
                      for run, labels in (("v7_05b", ("none", "gpu-lookup k=15", "gpu-lookup k=31")),
                                          ("v7_15b", ("none", "gpu-lookup k=31", "gpu-fused k=15")))
                      for label in labels for cat in ("copy", "chat")}
    fused = check.filter(pl.col("label") == "gpu-fused k=15")
    assert fused["ratio"].to_list() == pytest.approx([1.0, 1.0], rel=0.02)  # the pass from the run's own profile
    printed = capsys.readouterr().out
    assert "run v7_05b: within ±10 %: 4 of 6" in printed and "run v7_15b: within ±10 %: 6 of 6" in printed
    assert "the fused pass from this run's own profile" in printed


def test_finish_refuses_decodes_from_another_machine(gpu_side, tmp_path):
    v.main(["run", "--tag", "v6", "--budget-s", "600", "--work", str(gpu_side.work)])
    meta = gpu_side.out / "vllm_gpu_v6_05b.json"
    meta.write_text(meta.read_text().replace("H100 80GB HBM3", "H200"))
    with pytest.raises(SystemExit, match="not the same machine"):
        v.main(["finish", str(gpu_side.out), "--grid-out", str(tmp_path / "g.parquet"),
                "--out", str(tmp_path / "d.parquet")])


def test_validate_same_machine_refuses_step_costs_of_another_host():
    costs = pl.DataFrame(_flat_grid("t", {"widths": (1, 4), "contexts": (1024,)}, {1: 2.0, 4: 2.0}),
                         schema=scale.STEP_COST_SCHEMA)
    steps = pl.DataFrame({"request": ["r1"], "category": ["copy"], "config": ["none"], "context_len": [1024],
                          "verify_len": [1], "emitted": [1], "drafter_passes": [-1], "step_s": [0.002],
                          "load": ["alone"], "run": ["x"]})
    results = pl.DataFrame({"run": ["x"], "config": ["none"], "category": ["copy"], "prompt_id": ["r1"],
                            "concurrency": [1], "decode_tok_s": [500.0], "model": ["m"], "git_commit": ["c"],
                            "machine": ["m"]})
    table = scale.validate(costs, steps, results, "x", "t", same_machine=True)
    assert table["within"].to_list() == [True]
    with pytest.raises(scale.ScaleError, match="not the same machine"):
        scale.validate(costs, steps, results.with_columns(pl.lit("other").alias("machine")), "x", "t",
                       same_machine=True)


def test_run_v1_the_validation_on_one_h100_as_docs_seed_scale_reports_it():
    """Run v1 (one H100, grid and decodes in one call): 28 of 42 (config, class) pairs within ±10 % (the 1.5B 19 of
    21, the 0.5B 9 of 21), below the issue's 80 %. The 0.5B's own repeats spread up to 2x: of the 16 pairs whose
    every prompt repeated within 1.1x, 13 are within. Recomputed from the committed grid and decodes, and equal to
    the committed check table."""
    from polars.testing import assert_frame_equal

    from hqlab.replay import scale

    decodes = RESULTS / "seed_scale_validation_h100.parquet"
    part = {name: pl.read_parquet(decodes.with_suffix(f".{name}.parquet")) for name in ("steps", "phases", "repeats")}
    costs = pl.read_parquet(RESULTS / "seed_scale_h100.parquet").filter(pl.col("run") == "v1")
    table = scale.validate_runs(costs, part["steps"], pl.read_parquet(decodes),
                                {"v1_05b": "qwen2.5-0.5b", "v1_15b": "qwen2.5-1.5b"}, phases=part["phases"],
                                repeats=part["repeats"])
    committed = pl.read_parquet(RESULTS / "seed_scale_validation_h100.check.parquet").filter(
        pl.col("run").str.starts_with("v1_"))
    assert set(committed["cost_statistic"]) == {"median"}  # v1's grid kept no means
    committed = committed.select(table.columns)
    # sums of step costs in another order may differ in the last bits: equal to 1e-9 relative
    assert_frame_equal(table.sort("run", "config", "category"), committed.sort("run", "config", "category"),
                       check_exact=False, rel_tol=1e-9)
    assert table.height == 42 and int(table["within"].sum()) == 28
    assert dict(table.group_by("run").agg(pl.col("within").sum()).iter_rows()) == {"v1_05b": 9, "v1_15b": 19}
    assert (table["repeat_spread"] >= 1).all()
    steady = table.filter(pl.col("repeat_spread") <= 1.1)
    assert steady.height == 16 and int(steady["within"].sum()) == 13
    # the 0.5B's repeats, not the 1.5B's, are the unsteady ones
    assert table.filter(pl.col("run") == "v1_05b")["repeat_spread"].median() > 1.3
    assert table.filter(pl.col("run") == "v1_15b")["repeat_spread"].median() < 1.05


def test_run_v2a_the_0_5b_with_its_none_grid_as_docs_seed_scale_reports_it():
    """Run v2a (one H100, the 0.5B only: 48 steps a grid point, top context 2,560, a `none` grid, six repeats): 11 of
    21 pairs within ±10 % (v1: 9). The `none` grid prices plain decoding at 2.0-2.1 ms a step, while the decodes'
    own repeats of one prompt ran between 1.7 and 2.9 ms: no pair repeated within 1.1x, so what the 0.5B can show
    here is bounded by its host, not by the step-cost model."""
    from polars.testing import assert_frame_equal

    decodes = RESULTS / "seed_scale_validation_h100.parquet"
    part = {name: pl.read_parquet(decodes.with_suffix(f".{name}.parquet")) for name in ("steps", "phases", "repeats")}
    costs = pl.read_parquet(RESULTS / "seed_scale_h100.parquet").filter(pl.col("run") == "v2a")
    assert set(costs["config"]) == {"gpu-lookup", "none"} and set(costs["target_params_b"].round(1)) == {0.5}
    table = scale.validate_runs(costs, part["steps"], pl.read_parquet(decodes), {"v2a_05b": "qwen2.5-0.5b"},
                                phases=part["phases"], repeats=part["repeats"])
    committed = pl.read_parquet(RESULTS / "seed_scale_validation_h100.check.parquet").filter(
        pl.col("run") == "v2a_05b").select(table.columns)
    assert_frame_equal(table.sort("config", "category"), committed.sort("config", "category"), check_exact=False,
                       rel_tol=1e-9)
    assert table.height == 21 and int(table["within"].sum()) == 11
    assert (table["repeat_spread"] > 1.1).all()
    plain = table.filter(pl.col("config") == "none")
    assert plain["predicted_step_ms"].is_between(1.85, 2.15).all() and plain["recorded_step_ms"].max() > 2.6
    repeats = part["repeats"].filter((pl.col("run") == "v2a_05b") & (pl.col("config") == "none"))
    ms = repeats["decode_s"] / repeats["steps"] * 1000
    assert ms.min() < 1.8 and ms.max() > 2.8


def test_runs_v3a_and_v2b_as_docs_seed_scale_reports_them():
    """Runs v3a (the 0.5B, each grid point timed in eight passes over the grid) and v2b (the 1.5B; its `none` grid
    cut by the call's budget, so `none` is priced with the lookup's width-1 step): 12 and 8 of 21 pairs within
    ±10 %, recomputed from the committed grid and decodes and equal to the committed check table. v2b's grid met
    the host slow: every `none` and fused pair is predicted below its measured tok/s, while those decodes' repeats
    agreed within 1.1x (median over classes); over all five one-machine runs 59 of 105 pairs are within."""
    from polars.testing import assert_frame_equal

    decodes = RESULTS / "seed_scale_validation_h100.parquet"
    part = {name: pl.read_parquet(decodes.with_suffix(f".{name}.parquet")) for name in ("steps", "phases", "repeats")}
    grid = pl.read_parquet(RESULTS / "seed_scale_h100.parquet")
    assert set(grid.filter(pl.col("run") == "v2b")["config"]) == {"gpu-lookup"}  # the none grid was cut
    assert set(grid.filter(pl.col("run") == "v3a")["rounds"]) == {8}
    committed = pl.read_parquet(RESULTS / "seed_scale_validation_h100.check.parquet")
    within = {}
    for run, grid_run, shape in (("v3a_05b", "v3a", "qwen2.5-0.5b"), ("v2b_15b", "v2b", "qwen2.5-1.5b")):
        table = scale.validate_runs(grid.filter(pl.col("run") == grid_run), part["steps"], pl.read_parquet(decodes),
                                    {run: shape}, phases=part["phases"], repeats=part["repeats"])
        assert_frame_equal(table.sort("config", "category"),
                           committed.filter(pl.col("run") == run).select(table.columns).sort("config", "category"),
                           check_exact=False, rel_tol=1e-9)
        within[run] = int(table["within"].sum())
    assert within == {"v3a_05b": 12, "v2b_15b": 8}
    slow = committed.filter((pl.col("run") == "v2b_15b") & (pl.col("label") != "gpu-lookup k=31"))
    assert (slow["ratio"] < 0.95).all()
    assert slow.group_by("label").agg(pl.col("repeat_spread").median())["repeat_spread"].max() <= 1.11
    first_five = committed.filter(pl.col("run").str.contains(r"^v[123]"))
    assert int(first_five["within"].sum()) == 59 and first_five.height == 105


def test_runs_v4a_to_v4d_as_docs_seed_scale_reports_them():
    """Runs v4a-v4d (one H100 lease: the 0.5B twice, the 1.5B twice, each grid point's 480 steps in eight passes over
    the grid, a `none` grid, decodes priced with each point's mean step): 21, 21, 21 and 20 of 21 pairs within
    ±10 %, recomputed and equal to the committed check table. That host held one speed: every point's mean is
    within 6 % of its median, and pricing with the medians gives the same counts, so these runs credit the host's
    steadiness, not the statistic. Over all nine one-machine runs 142 of 189 pairs are within; of the 79 pairs whose
    every prompt repeated within 1.1x, 71."""
    from polars.testing import assert_frame_equal

    decodes = RESULTS / "seed_scale_validation_h100.parquet"
    part = {name: pl.read_parquet(decodes.with_suffix(f".{name}.parquet")) for name in ("steps", "phases", "repeats")}
    grid = pl.read_parquet(RESULTS / "seed_scale_h100.parquet")
    committed = pl.read_parquet(RESULTS / "seed_scale_validation_h100.check.parquet")
    within, with_median = {}, {}
    for run, shape in (("v4a_05b", "qwen2.5-0.5b"), ("v4b_15b", "qwen2.5-1.5b"), ("v4c_05b", "qwen2.5-0.5b"),
                       ("v4d_15b", "qwen2.5-1.5b")):
        costs = grid.filter(pl.col("run") == run[:3])
        assert set(costs["rounds"]) == {8} and set(costs["config"]) == {"gpu-lookup", "none"}
        assert (costs["step_ms_mean"] / costs["step_ms"]).is_between(0.99, 1.06).all()
        priced, statistic = scale.decode_costs(costs)
        assert statistic == "mean"
        args = dict(phases=part["phases"], repeats=part["repeats"])
        table = scale.validate_runs(priced, part["steps"], pl.read_parquet(decodes), {run: shape}, **args)
        mine = committed.filter(pl.col("run") == run)
        assert set(mine["cost_statistic"]) == {"mean"}
        assert_frame_equal(table.sort("config", "category"), mine.select(table.columns).sort("config", "category"),
                           check_exact=False, rel_tol=1e-9)
        within[run] = int(table["within"].sum())
        with_median[run] = int(scale.validate_runs(costs, part["steps"], pl.read_parquet(decodes), {run: shape},
                                                   **args)["within"].sum())
    assert within == {"v4a_05b": 21, "v4b_15b": 21, "v4c_05b": 21, "v4d_15b": 20}
    assert with_median == within
    assert int(committed["within"].sum()) == 142 and committed.height == 189
    steady = committed.filter(pl.col("repeat_spread") <= 1.1)
    assert steady.height == 79 and int(steady["within"].sum()) == 71


def test_finish_keeps_the_check_rows_of_earlier_runs(tmp_path):
    """`finish` of run v2a on top of the files as they were after v1: the check table gains v2a's rows and keeps
    v1's (it used to be overwritten with the latest run's alone); the grid and decodes gain v2a beside v1."""
    names = ["seed_scale_validation_h100" + s for s in ("", ".steps", ".phases", ".repeats", ".check")]
    for name in names + ["seed_scale_h100"]:
        frame = pl.read_parquet(RESULTS / f"{name}.parquet")
        if "run" in frame.columns:  # the files as they were after v1: no later run
            frame = frame.filter(~pl.col("run").str.contains(r"^v[2-9]"))
        frame.write_parquet(tmp_path / f"{name}.parquet")
    before = pl.read_parquet(tmp_path / "seed_scale_validation_h100.check.parquet")
    assert set(before["run"]) == {"v1_05b", "v1_15b"}
    out = tmp_path / "seed_scale_validation_h100.parquet"
    assert v.main(["finish", str(RESULTS / "seed_scale_v2"), "--out", str(out),
                   "--grid-out", str(tmp_path / "seed_scale_h100.parquet")]) == 0
    after = pl.read_parquet(tmp_path / "seed_scale_validation_h100.check.parquet")
    assert after.group_by("run").len().sort("run").rows() == [("v1_05b", 21), ("v1_15b", 21), ("v2a_05b", 21)]
    assert after.filter(pl.col("run").str.starts_with("v1_")).sort("run", "config", "category").equals(
        before.sort("run", "config", "category"))
    assert "v2a" in set(pl.read_parquet(tmp_path / "seed_scale_h100.parquet")["run"])


def test_the_none_grid_comes_last_at_width_one_and_the_lookups_contexts():
    items = v.make_plan(v.DEFAULT_CONFIGS, none_grid=True)
    assert [x.name for x in items[-2:]] == ["grid qwen2.5-0.5b none", "grid qwen2.5-1.5b none"]
    assert items[:4] == v.make_plan(v.DEFAULT_CONFIGS)[:4]  # the rest of the plan, in its order, unchanged
    lookup, plain = items[0], items[-2]
    assert plain.points == {"widths": (1,), "contexts": lookup.points["contexts"], "batches": (1,)}
    assert grid_bench.points("none", "qwen2.5-0.5b", **plain.points) == [(c, 1, 1) for c in lookup.points["contexts"]]
    assert grid_bench.points("none", "qwen2.5-0.5b") == [(1024, 1, 1), (1024, 8, 1), (8192, 1, 1), (8192, 8, 1)]
    argv = v.grid_argv(plain, "t", "c", 100.0, Path("w"))
    assert argv[argv.index("--only") + 1] == "qwen2.5-0.5b:bf16:none"
    assert ("qwen2.5-0.5b", "bf16", "none") in grid_bench.PLAN  # what `--only shape:bf16:none` selects


def test_rounds_spread_a_points_steps_over_passes_of_the_whole_grid():
    points = [(128, 1, 1), (128, 1, 16), (2560, 1, 32)]
    one = grid_bench.round_schedule(points, 48, 1)
    assert one == [(0, p, 48) for p in points]  # one burst a point, as runs v1 and v2a
    spread = grid_bench.round_schedule(points, 50, 4)
    assert [p for _, p, _ in spread] == points * 4  # every pass visits every point, in the grid's order
    per_point = {p: sum(n for _, q, n in spread if q == p) for p in points}
    assert per_point == {p: 50 for p in points}
    assert [n for r, q, n in spread if q == points[0]] == [13, 13, 12, 12]  # the remainder in the first passes
    with pytest.raises(ValueError, match="every round times a step"):
        grid_bench.round_schedule(points, 3, 4)
    with pytest.raises(ValueError, match="rounds must be"):
        grid_bench.round_schedule(points, 3, 0)


def test_grid_rounds_reach_the_step_cost_benchmark_and_the_estimate():
    plain = v.make_plan(v.DEFAULT_CONFIGS, none_grid=True)
    longer = v.make_plan(v.DEFAULT_CONFIGS, none_grid=True, grid_steps=480, grid_rounds=8)
    for a, b in zip(plain, longer):
        if a.kind == "decode":
            assert (a.est_s, a.min_s) == (b.est_s, b.min_s)
            continue
        n = len(grid_bench.points(a.grid_config, v.SHAPE_OF[a.model], **a.points))
        more = n * (480 + 8 * (grid_bench.WARM_STEPS + 1) - (v.GRID_STEPS + grid_bench.WARM_STEPS + 1)) * v.GRID_STEP_S
        assert b.est_s == pytest.approx(a.est_s + more) and b.min_s == pytest.approx(a.min_s + more)
    argv = v.grid_argv(longer[0], "t", "c", 100.0, Path("w"), steps=480, rounds=8)
    assert argv[-4:] == ["--steps", "480", "--rounds", "8"]
    assert "--rounds" not in v.grid_argv(longer[0], "t", "c", 100.0, Path("w"))
    import argparse

    parsed = argparse.ArgumentParser()
    grid_bench.add_point_options(parsed)
    ns = parsed.parse_args(["--steps", "480", "--rounds", "8"])
    assert grid_bench.point_argv(ns) == ["--steps=480", "--rounds=8"]  # what `run` hands each `one`
    with pytest.raises(SystemExit):
        v.main(["plan", "--grid-rounds", "100"])
