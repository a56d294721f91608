"""Notebooks run under papermill with non-default parameters, unedited: another model (SmolLM2-135M from the
offline registry instead of the 0.5B), another workload file (a JSONL written here), other grids, and output
folders elsewhere, all chosen by one YAML parameters file as `hqlab figures --params` takes it. This sweep is also
these notebooks' small run (tests/site/test_notebooks.py runs the others)."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
import yaml

from hqlab.bench import results
from hqlab.models import native_bf16
from hqlab.site.notebooks import REPO, notebook_paths, run_all

MODEL = "smollm2-135m"
# every notebook that takes a model and a workload, and the kernels notebook on another results folder
SWEPT = ("suffix_lengths", "core_benchmark", "new_proposer", "explorer", "kernels")

# Two short prompts whose answers repeat their input (lookup has something to find) plus a chat one.
WORKLOAD = [
    {"id": "echo-list", "category": "copy", "prompt": "Repeat this list exactly, one item per line:\n"
     "- alpha: the first item\n- beta: the second item\n- gamma: the third item\n- delta: the fourth item"},
    {"id": "chat-hello", "category": "chat", "prompt": "Say hello and name three colors."},
]


@pytest.fixture(scope="module")
def sweep_run(tmp_path_factory):
    """Every notebook that takes a model and a workload, run once through a YAML parameters file."""
    tmp = tmp_path_factory.mktemp("params")
    workload = tmp / "mine.jsonl"
    workload.write_text("".join(json.dumps(r) + "\n" for r in WORKLOAD))
    kernels = tmp / "kernels_results"  # another results folder: one run of the kernels, its batch-1 rows
    results.write_run("kernels", "batch1", card="h200", root=kernels,
                      tables={"rows": results.load("kernels", "h200").filter(pl.col("batch") == 1)})
    params = {
        "defaults": {"model": MODEL, "suite": str(workload), "max_new_tokens": 12, "device": "cpu",
                     "dtype": "bfloat16" if native_bf16() else "float32",  # emulated bf16 is slower than fp32
                     "figures_dir": str(tmp / "figures"), "results_dir": str(tmp / "results")},
        "suffix_lengths": {"nmin_grid": [1, 3], "nmax_grid": [4], "k_grid": [5], "policies": ["earliest"],
                           "live_configs": ["lookup:nmin=1,nmax=4,k=5,policy=earliest"],
                           "cost_contexts": [64, 256], "cost_verify_lens": [1, 6], "rerun": True},
        "core_benchmark": {"rerun": True, "tags": ["params"], "suites": {str(workload): 12},
                           "configs": ["lookup:nmin=2,nmax=6,k=6"]},
        "new_proposer": {"toy_grid": {"k": [3], "min_count": [1, 2]}, "builtins": ["pld:n=2,k=5"],
                         "live_configs": ["bigram:k=3,min_count=1", "pld:n=2,k=5"], "live_limit": 1},
        "explorer": {"request": "echo-list", "compare": ["pld:n=2,k=5"], "start": "lookup:nmin=1,nmax=4,k=5"},
        "kernels": {"run": "batch1", "published_dir": str(kernels)},
    }
    stems = [p.stem for p in notebook_paths() if p.stem in params]
    assert set(stems) == set(SWEPT)
    params_file = tmp / "sweep.yaml"
    params_file.write_text(yaml.safe_dump(params))
    assert run_all(params_file=params_file, only=stems, out_dir=tmp / "out") == 0
    return tmp, params


def _injected(out: Path) -> dict:
    import ast

    import nbformat

    nb = nbformat.read(out, as_version=4)
    cell = next(c for c in nb.cells if "injected-parameters" in c.metadata.get("tags", []))
    return {n.targets[0].id: ast.literal_eval(n.value) for n in ast.parse(cell.source).body}


@pytest.mark.slow
def test_parameters_reach_every_notebook(sweep_run):
    tmp, params = sweep_run
    for stem in [s for s in params if s != "defaults"]:
        out = tmp / "out" / f"{stem}.ipynb"
        assert out.exists(), f"{stem} was not executed"
        injected = _injected(out)
        for key, value in params[stem].items():
            assert injected[key] == value, f"{stem}: {key}"
    figures = {p.name for p in (tmp / "figures").glob("*.svg")}
    # the acceptance curves exist only where the lookup drafted: the small run did the work
    assert {"suffix_tokens_per_step.svg", "core_params_speedup.svg", "core_params_acceptance_by_position.svg",
            "core_params_acceptance_hist.svg", "new_proposer_live.svg", "explorer_timeline.svg",
            "kernels_latency.svg"} <= figures
    assert not any((REPO / "figures" / name).stat().st_mtime > (tmp / "sweep.yaml").stat().st_mtime
                   for name in figures if (REPO / "figures" / name).exists()), "a notebook wrote into figures/"


@pytest.mark.slow
def test_results_come_from_the_chosen_model_workload_and_grids(sweep_run):
    tmp, params = sweep_run
    root = tmp / "results"
    core = results.load("core", "params", root=root)
    assert set(core["model"]) == {MODEL}
    assert set(core["prompt_id"]) == {r["id"] for r in WORKLOAD}
    assert set(core["config"]) == {"none", *params["core_benchmark"]["configs"]}
    assert (core["divergence"] != "mismatch").all()
    assert results.load("core", "params", "steps", root=root).height > 0

    sweep = results.load("suffix_lengths", "cpu", "sweep", root=root)
    assert sorted(set(sweep["config"])) == ["lookup:nmin=1,nmax=4,k=5,policy=earliest",
                                            "lookup:nmin=3,nmax=4,k=5,policy=earliest"]
    assert set(sweep["prompt_id"]) == {r["id"] for r in WORKLOAD}

    toy = results.load("new_proposer", "cpu", "replay", root=root)
    assert set(toy["config"]) == {"bigram:k=3,min_count=1", "bigram:k=3,min_count=2", "pld:n=2,k=5"}
    live = results.load("new_proposer", "cpu", "live", root=root)
    assert set(live["model"]) == {MODEL}
    assert live["prompt_id"].to_list() == ["chat-hello"] * 3  # live_limit=1: the shortest prompt, three configs


def test_unknown_parameter_is_refused_before_running(tmp_path):
    params_file = tmp_path / "bad.yaml"
    params_file.write_text(yaml.safe_dump({"explorer": {"modle": MODEL}}))
    with pytest.raises(ValueError, match="unknown parameter.*modle"):
        run_all(params_file=params_file, only=["explorer"], out_dir=tmp_path / "out")


def test_every_notebook_exposes_model_workload_and_outputs_as_parameters():
    """What a batch sweep changes must be a parameter, in every notebook (present and future): where results
    and figures go, the model any notebook loads, and the workload any notebook reads."""
    import re

    import jupytext

    from hqlab.site.notebooks import declared_parameters

    for path in notebook_paths():
        nb = jupytext.read(path)
        declared = declared_parameters(nb)
        code = "\n".join(c.source for c in nb.cells if c.cell_type == "code"
                         and "parameters" not in c.get("metadata", {}).get("tags", []))
        assert "figures_dir" in declared, f"{path.name}: no figures_dir parameter"
        if re.search(r"\b(?:HFEngine|models)\.load\(", code):
            assert declared & {"model", "target"}, f"{path.name} loads a model but has no model parameter"
        if "load_workload(" in code:
            assert declared & {"suite", "suites"}, f"{path.name} reads a workload but has no suite parameter"
        hard = re.findall(r"""["'](?:figures|data/results)/[\w.\-]+["']""", code)
        assert not hard, f"{path.name} writes to fixed paths {hard}: use figures_dir / results_dir"
