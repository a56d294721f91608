"""Every notebook runs under papermill with small, non-default parameters (here, or in the parameter sweep of
tests/site/test_notebook_params.py), and every figure the docs reference is written by some notebook (so `make
figures` regenerates all of them)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from hqlab.models import native_bf16
from hqlab.site.notebooks import (NOTEBOOKS, REPO, declared_defaults, declared_parameters, notebook_paths,
                                  run_notebook)

DOCS = REPO / "docs"

# Small parameter sets for CI: few prompts, few tokens, tiny grids, and where a notebook runs the model the CPU's
# fast dtype: bf16 where the CPU computes in it, else float32 (emulated bf16 is several times slower wherever many
# positions are scored at once; the notebooks' logic is the same in either dtype). Output locations go to a temp dir.
DTYPE = dict(dtype="bfloat16" if native_bf16() else "float32")
# The parameter sweep (tests/site/test_notebook_params.py: SmolLM2-135M, a workload file, small grids) runs these
# notebooks with small non-default parameters already; a second run of each here checked the same again.
IN_SWEEP = "run by the parameter sweep"
SMALL = {
    # the 0.5B drafting for itself keeps these cheap; the defaults use the 1.5B target
    # rerun: replay here (their default re-plots the committed replay); the shipped 1.5B traces do not match
    "fusion": dict(**DTYPE, target="qwen2.5-coder-0.5b", limit=2, doc_tokens=300, max_new_tokens=16, rerun=True,
                   fusion_grid=["nstrong=6,agree=0", "nstrong=8,agree=2"]),
    "sticky_exit": dict(**DTYPE, target="qwen2.5-coder-0.5b", limit=1, doc_tokens=300, max_new_tokens=16,
                        sticky_grid=[0, 3], entry_grid=[2], stale_grid=[0, 1], rerun=True),
    "fusion_benchmark": dict(published_dir=str(REPO / "data" / "results")),  # re-plot the committed runs
    "suffix_lengths": IN_SWEEP,
    "kernels": IN_SWEEP,
    # the corpus replay on two workloads, two corpus sizes, one request at a time; the warm-up on one workload
    "corpus": dict(workloads=["template", "prose"], corpus_sizes=[0, 1024], nmins=[2], inflight=[1],
                   prompts=[False], warmup_workloads=["template"], warmup_vllm={}, warmup_loads=[1],
                   warmup_tokens=[1024, 4096], warmup_docs=[1, 1024], warmup_arctic_cached=[1]),
    "vllm_gpu": dict(),  # re-plots the committed vLLM runs
    "serving": dict(gate_min_matches=[0, 2]),  # re-plots the committed serving run; the gate's replay, two points
    "seed_scale": dict(shapes=["qwen2.5-0.5b", "qwen2.5-7b"], batches=[1]),  # the committed step costs
    "core_benchmark": IN_SWEEP,
    "explorer": IN_SWEEP,
    "replay_and_cost": dict(zoo_rerun="no"),  # re-plots committed results (the zoo needs optional extras)
    "new_proposer": IN_SWEEP,
    "draft_vocab": dict(corpora={"qwen2.5-coder-0.5b": "data/selfgen/qwen2.5-coder-0.5b.jsonl"},
                        sizes=[1024, 16384], latency_sizes=[1024], latency_repeats=2, latency_context=64,
                        accept_target="qwen2.5-coder-0.5b", accept_sizes=[1024, 0], accept_prompts=1,
                        accept_max_new_tokens=12, live_prompts=1, accept_rerun=True, **DTYPE),
}



def referenced_figures() -> set[str]:
    names = set()
    for page in DOCS.glob("*.md"):
        names |= set(re.findall(r"\]\((?:\.\./)?figures/([\w.\-]+\.(?:svg|png))\)", page.read_text()))
    return names


def written_by_notebooks() -> set[str]:
    """Figure names the notebooks write with their default parameters: literal names in their sources, plus the
    core and fusion benchmarks' figures for each default tag (named by `bench.core_figure_names` and
    `bench.fusion_figure_names`) and the fusion benchmark's figure of its default run of the study vllm_fused
    (`vllm_report.run_figure`)."""
    import jupytext

    from hqlab.bench import core_figure_names, fusion_figure_names, vllm_report

    names: set[str] = set()
    for path in notebook_paths():
        names |= set(re.findall(r"[\w\-]+\.svg", path.read_text()))
    for stem, names_for in (("core_benchmark", core_figure_names),
                            ("fusion_benchmark", lambda tag: list(fusion_figure_names(tag).values()))):
        for tag in declared_defaults(jupytext.read(NOTEBOOKS / f"{stem}.py"))["tags"]:
            names |= set(names_for(tag))
    fusion = declared_defaults(jupytext.read(NOTEBOOKS / "fusion_benchmark.py"))
    names.add(vllm_report.run_figure("vllm_fused", fusion["run"]))
    return names


def test_every_docs_figure_is_written_by_a_notebook():
    written = written_by_notebooks()
    figures = referenced_figures()
    assert figures, "docs reference no figures"
    missing = sorted(f for f in figures if Path(f).with_suffix(".svg").name not in written)
    assert not missing, f"figures referenced in docs but written by no notebook: {missing}"
    absent = sorted(f for f in figures if not (REPO / "figures" / f).exists())
    assert not absent, f"figures referenced in docs but not committed: {absent}"


def test_every_notebook_has_a_small_parameter_set():
    assert {p.stem for p in notebook_paths()} == set(SMALL)
    spec = importlib.util.spec_from_file_location("notebook_params", Path(__file__).with_name(
        "test_notebook_params.py"))
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    assert {stem for stem, params in SMALL.items() if params == IN_SWEEP} == set(sweep.SWEPT)


@pytest.mark.slow
@pytest.mark.parametrize("stem", sorted(stem for stem, params in SMALL.items() if params != IN_SWEEP))
def test_notebook_runs_with_small_parameters(tmp_path, stem):
    import jupytext

    path = NOTEBOOKS / f"{stem}.py"
    params = dict(SMALL[stem])
    declared = declared_parameters(jupytext.read(path))
    params.update({k: str(tmp_path / k) for k in ("figures_dir", "results_dir") if k in declared})
    run_notebook(path, params, tmp_path / "out")
    assert (tmp_path / "out" / f"{stem}.ipynb").exists()
    assert list((tmp_path / "figures_dir").glob("*.svg")), "the notebook wrote no figures"
