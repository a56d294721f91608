"""benchmarks/seed_scale_validation.py (#41): which grid points the validation prices (`hqlab.bench.seed_scale`), the
budget's skipping, and `finish` on a returned dir written by `run` itself with the GPU tools stood in for (the step-cost
benchmark's `one` and vllm_gpu.py's bench write their files as they do on the host). No vLLM, no GPU."""

from __future__ import annotations

import json
import types
from pathlib import Path

import polars as pl
import pytest

from benchmarks import seed_scale_validation as v
from benchmarks import vllm_step_cost as grid_bench
from hqlab.bench import results, runner
from hqlab.bench import seed_scale as plan
from hqlab.replay import scale

MACHINE = "NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, vllm 0.26.0"


# --- which points -------------------------------------------------------------------------------------------------


def test_verify_widths_and_bracketing_contexts():
    configs = ("none", plan.LOOKUP_15, plan.LOOKUP_31, plan.FUSED_15, plan.FUSED_31_SKIP)
    assert [plan.verify_width(c) for c in configs] == [1, 16, 32, 16, 32]
    with pytest.raises(ValueError, match="no integer k"):
        plan.verify_width("gpu-lookup:nmin=1")
    with pytest.raises(ValueError, match="prices only"):
        plan.verify_width("lookup:k=31")  # the CPU lookup: its width varies step by step
    assert plan.bracketing_contexts(140, 2323) == (128, 256, 512, 1024, 2048, 2560)  # the top: the longest step's,
    assert plan.bracketing_contexts(1024, 1024) == (1024,)                           # rounded up to 512, not 4,096
    assert plan.bracketing_contexts(1025, 1030) == (1024, 1536)
    assert plan.bracketing_contexts(140, 2048) == (128, 256, 512, 1024, 2048)
    assert plan.bracketing_contexts(140, 2323, top_step=1) == (128, 256, 512, 1024, 2048, 2323)
    with pytest.raises(ValueError, match="top_step"):
        plan.bracketing_contexts(140, 2323, top_step=0)


def test_plan_measures_batch_one_at_the_configs_widths_then_decodes():
    items = plan.make_plan(plan.DEFAULT_CONFIGS)
    assert [(x.kind, x.model) for x in items] == [
        ("grid", "qwen2.5-coder-0.5b"), ("grid", "qwen2.5-coder-1.5b"),
        ("decode", "qwen2.5-coder-0.5b"), ("decode", "qwen2.5-coder-1.5b")]
    assert items[0].points == {"widths": (1, 16, 32), "contexts": (128, 256, 512, 1024, 2048, 2560),
                               "batches": (1,)}
    assert v.grid_argv(items[0], "t", "c", 100.0, Path("w"))[-2:] == ["--steps", str(plan.GRID_STEPS)]
    assert items[1].points["widths"] == (1, 16, 32)  # gpu-lookup k=31 and gpu-fused k=15
    assert [x.profile for x in items[2:]] == [False, True]  # the fused pass from the 1.5B's own profile
    # the default plan fits the budget it is meant for
    assert sum(x.est_s for x in items) <= 520
    fused = plan.make_plan(plan.DEFAULT_CONFIGS, fused_grid=True)
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


@pytest.mark.parametrize("study, run, configs, shape", [
    ("vllm_gpu", "w2", [plan.LOOKUP_15, plan.LOOKUP_31], "qwen2.5-0.5b"),
    ("vllm_fused", "fn2", [plan.LOOKUP_15, plan.LOOKUP_31, plan.FUSED_15, plan.FUSED_31_SKIP], "qwen2.5-1.5b")])
def test_the_chosen_points_price_every_step_of_the_committed_runs_without_clamping(study, run, configs, shape):
    """Every step of the committed H200 runs whose configs the validation decodes again (the same suite) lies inside
    the grid the plan measures: priced with outside_context="error"; a grid of fewer contexts is refused on the same
    steps."""
    steps, decodes = results.load(study, run, "steps"), results.load(study, run)
    grid = plan.grid_points(configs, plan.step_contexts(configs), fused_grid=True)
    ms = {1: 2.0, 16: 2.5, 32: 3.0}
    rows = _flat_grid(shape, grid["gpu-lookup"], ms)
    if "gpu-fused" in grid:
        rows += _flat_grid(shape, grid["gpu-fused"], {w: ms[w] + 1.0 for w in ms}, "gpu-fused")
    costs = pl.DataFrame(rows, schema=scale.STEP_COST_SCHEMA)
    table = scale.validate(costs, steps, decodes, run, shape, configs=["none", *configs], fused_shape=shape,
                           outside_context="error")
    assert table.height == 7 * (1 + len(configs)) and (table["clamped_share"] == 0).all()
    short = plan.grid_points(configs, (1024, 2048))["gpu-lookup"]  # what the first H100 grid measured, about
    costs = pl.DataFrame(_flat_grid(shape, short, ms), schema=scale.STEP_COST_SCHEMA)
    with pytest.raises(scale.ScaleError, match="outside the grid"):
        scale.validate(costs, steps, decodes, run, shape, configs=["none", configs[0]], outside_context="error")


# --- the budget ---------------------------------------------------------------------------------------------------


def test_each_item_keeps_the_later_items_minimum_and_skips_what_does_not_fit():
    items = plan.make_plan(plan.DEFAULT_CONFIGS)
    ok = {"qwen2.5-coder-0.5b": True, "qwen2.5-coder-1.5b": True}
    go, limit, _ = plan.decide(items, 0, 520, {})
    assert go and limit == pytest.approx(520 - plan.END_MARGIN_S - sum(x.min_s for x in items[1:]))
    go, limit, _ = plan.decide(items, 0, 300, {})  # short of time: the first item still gets 1.5 x its estimate
    assert go and limit == pytest.approx(1.5 * items[0].est_s)
    go, limit, _ = plan.decide(items, 3, 520, ok)  # the last item gets what is left
    assert go and limit == pytest.approx(520 - plan.END_MARGIN_S)
    go, _, why = plan.decide(items, 3, items[3].min_s, ok)
    assert not go and "needs at least" in why
    # the 1.5B's grid failed: its decodes are skipped, and the 0.5B's decodes no longer keep time for them
    items[0].status, items[1].status = "done", "failed"
    go, limit, _ = plan.decide(items, 2, 300, {"qwen2.5-coder-0.5b": True, "qwen2.5-coder-1.5b": False})
    assert go and limit == pytest.approx(300 - plan.END_MARGIN_S)
    go, _, why = plan.decide(items, 3, 300, {"qwen2.5-coder-0.5b": True, "qwen2.5-coder-1.5b": False})
    assert not go and "no grid rows" in why


# --- run with the GPU tools stood in for, then finish ---------------------------------------------------------------

COST = {("qwen2.5-0.5b", 1): 2.0, ("qwen2.5-0.5b", 16): 2.4, ("qwen2.5-0.5b", 32): 2.6,
        ("qwen2.5-1.5b", 1): 2.8, ("qwen2.5-1.5b", 16): 3.0, ("qwen2.5-1.5b", 32): 3.3}
PASS_MS = 1.1  # the 1.5B's fused drafter pass, as its profile times it
SLOW = {plan.LOOKUP_15: 1.25}  # this config's decodes ran 25 % slower than the grid says: a miss the check must show
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

    width = plan.verify_width(config)
    per_step = 1 if width == 1 else 8
    ms = COST[(shape, width)] + (PASS_MS if plan.config_kind(config) == "gpu-fused" else 0.0)
    ms *= SLOW.get(config, 1.0)
    records, t = [], 0.05
    for j in range(tokens // per_step):
        t += ms / 1e3
        records.append(step_record(config, j, context_len=prompt_len + j * per_step, accepted=per_step - 1,
                                   emitted=per_step, verify_len=width, step_s=ms / 1e3, t_end=t,
                                   drafter_passes=1 if plan.config_kind(config) == "gpu-fused" else -1))
    return Generation(config, prompt_len, list(range(tokens + 1)), "length", 0.05, t, t, records, [])


def _write_bench(cmd: list[str], out: Path) -> None:
    """What vllm_gpu.py bench writes into $OUT (through the runner's writers): the raw runs and their description."""
    from hqlab.bench.vllm_runs import Run, raw_table

    model, tag = _value(cmd, "--model"), _value(cmd, "--tag")
    configs = ["none", *[cmd[i + 1] for i, a in enumerate(cmd) if a == "--config"]]
    shape = plan.SHAPE_OF[model]
    runs = [Run("none", pid, cat, -1, _generation("none", shape, n)) for pid, cat, n in PROMPTS]
    for r in runs:
        r.generation.margins[:] = [5.0] * len(r.generation.output_ids)
    runs += [Run(c, pid, cat, rep, _generation(c, shape, n)) for rep in range(int(_value(cmd, "--repeats")))
             for pid, cat, n in PROMPTS for c in configs]
    runner.save_table(out / f"vllm_gpu_{tag}.parquet", raw_table(runs))
    engines = [{"config": c, "model_runner": "v1", "async_scheduling": False} for c in configs]
    if "--profile" in cmd:
        for e in engines:
            phase = "propose (speculator)" if plan.config_kind(e["config"]) == "gpu-fused" else "execute_model"
            e["profile"] = [{"prompt_id": pid, "category": cat, "steps": [],
                             "phases": [{"phase": phase, "host_start_ms": 0.0, "host_ms": 0.1, "gpu_start_ms": 0.0,
                                         "gpu_ms": PASS_MS}]} for pid, cat, _ in PROMPTS]
    meta = {"machine": MACHINE, "versions": {"vllm": "0.26.0"}, "model": model, "dtype": "bfloat16",
            "doc_tokens": 2000, "suite": "all", "max_new_tokens": 32, "repeats": 2, "concurrency": 0,
            "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "parallel_start": True,
            "engines": engines}
    runner.save_json(out / f"vllm_gpu_{tag}.json", meta)


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
    monkeypatch.setattr(runner, "time", fake_time)  # the budget's clock
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

    monkeypatch.setattr(runner, "run_bounded", bounded)
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
    root = tmp_path / "results"
    assert v.main(["finish", str(gpu_side.out), "--results", str(root)]) == 0
    costs = results.load("seed_scale", "v7", "grid", root=root)
    assert set(costs["run"]) == {"v7"} and set(costs["engine"]) == {"process"} and set(costs["batch"]) == {1}
    rows = results.load("seed_scale", "v7", root=root)
    assert set(rows["run"]) == {"v7_05b", "v7_15b"} and set(rows["git_commit"]) == {"abc"}
    entry = results.run_info("seed_scale", "v7", root)
    assert entry["card"] == "h100" and entry["commit"] == "abc"
    assert {"validation.json", "raw_05b.parquet", "raw_15b.parquet", "steps.parquet"} <= set(entry["files"])
    check = results.load("seed_scale", "v7", "check", root=root)
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
        v.main(["finish", str(gpu_side.out), "--results", str(tmp_path / "results")])


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


def test_finish_reproduces_a_committed_run_from_its_returned_files(tmp_path):
    """`finish` of a committed validation run's files as the GPU host returned them writes the same grid, decodes and
    validation table, and run.json the same command and card."""
    from polars.testing import assert_frame_equal

    returned = tmp_path / "returned"
    returned.mkdir()
    names = {"validation.json": "validation_v2a.json", "grid.jsonl": "seed_scale_v2a.jsonl",
             "raw_05b.parquet": "vllm_gpu_v2a_05b.parquet", "raw_05b.json": "vllm_gpu_v2a_05b.json",
             "run.log": "seed_scale_v2a.log"}
    for name, as_returned in names.items():
        (returned / as_returned).write_bytes(results.run_file("seed_scale", "v2a", name).read_bytes())
    root = tmp_path / "results"
    assert v.main(["finish", str(returned), "--results", str(root)]) == 0
    for kind in ("grid", "rows", "steps", "repeats", "check"):
        finished = results.load("seed_scale", "v2a", kind, root=root)
        committed = results.load("seed_scale", "v2a", kind).select(finished.columns)
        assert_frame_equal(finished, committed, check_dtypes=False)
    entry = results.run_info("seed_scale", "v2a", root)
    assert entry["command"] == results.run_info("seed_scale", "v2a")["command"] and entry["card"] == "h100"


def test_the_none_grid_comes_last_at_width_one_and_the_lookups_contexts():
    items = plan.make_plan(plan.DEFAULT_CONFIGS, none_grid=True)
    assert [x.name for x in items[-2:]] == ["grid qwen2.5-0.5b none", "grid qwen2.5-1.5b none"]
    assert items[:4] == plan.make_plan(plan.DEFAULT_CONFIGS)[:4]  # the rest of the plan, in its order, unchanged
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
    assert one == [(0, p, 48) for p in points]  # one burst a point, as the first validations timed it
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
    plain = plan.make_plan(plan.DEFAULT_CONFIGS, none_grid=True)
    longer = plan.make_plan(plan.DEFAULT_CONFIGS, none_grid=True, grid_steps=480, grid_rounds=8)
    for a, b in zip(plain, longer):
        if a.kind == "decode":
            assert (a.est_s, a.min_s) == (b.est_s, b.min_s)
            continue
        n = len(grid_bench.points(a.grid_config, plan.SHAPE_OF[a.model], **a.points))
        warm = grid_bench.WARM_STEPS + 1
        more = n * (480 + 8 * warm - (plan.GRID_STEPS + warm)) * plan.GRID_STEP_S
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
