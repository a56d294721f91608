"""The house stays small enough to read (#59): the fused step fits its budget, benchmarks/ stays a set of plans and
short drivers around one runner (`hqlab.bench.runner`), the README and the reference pages of docs/ stay short (run
history goes to docs/journal/), and the README states what the test suite costs on CI's CPU. `tools/check_house.py`
prints these measurements beside the other checks of the house (function length, layering, run tags, results)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Files or folders (their .py files: benchmarks/plans/ holds the plans, which are data) and their most lines.
MAX_LINES = {"hqlab/engines/vllm/gpu_fused.py": 400, "benchmarks": 2500, "README.md": 150}
MAX_DOC_PAGE = 300  # a reference page of docs/; the journal's entries are history and may run longer
MAX_CI_MINUTES = 30.0
# The README's sentence on CI's test time: the CPU as it names itself, then the minutes in bold.
CI_TIME = re.compile(r"CI's 2-core (?P<cpu>(?:AMD|Intel)[^,;()]*)[^*]{0,400}\*\*(?P<minutes>\d+(?:\.\d+)?) minutes\*\*")


def code_lines(relative: str, root: Path = REPO) -> int:
    """Lines of a file, or of the .py files under a folder."""
    path = root / relative
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return sum(len(f.read_text().splitlines()) for f in files)


def doc_pages(root: Path = REPO) -> dict[str, int]:
    """Lines of every page of docs/ outside the journal."""
    return {p.relative_to(root).as_posix(): len(p.read_text().splitlines())
            for p in sorted((root / "docs").rglob("*.md")) if "journal" not in p.relative_to(root / "docs").parts}


def _builds(tree: ast.AST, call: str) -> bool:
    """The tree calls `<something>.<call>(...)` or `<call>(...)`."""
    return any(isinstance(n, ast.Call) and call in (getattr(n.func, "attr", None), getattr(n.func, "id", None))
               for n in ast.walk(tree))


def runners(root: Path = REPO) -> list[str]:
    """The modules of hqlab/bench/ that build a command line of subcommands: the one runner's place."""
    return [p.relative_to(root).as_posix() for p in sorted((root / "hqlab" / "bench").glob("*.py"))
            if _builds(ast.parse(p.read_text()), "add_subparsers")]


def gpu_drivers(root: Path = REPO) -> dict[str, bool]:
    """Every GPU driver of benchmarks/ (a `vllm_*.py`, or any script that imports `hqlab.bench.runner`) -> whether it
    builds its command line with `runner.Benchmark` and builds no subcommands of its own."""
    found = {}
    for path in sorted((root / "benchmarks").glob("*.py")):
        source = path.read_text()
        if path.name.startswith("vllm_") or "hqlab.bench import runner" in source:
            tree = ast.parse(source)
            found[path.name] = _builds(tree, "Benchmark") and not _builds(tree, "add_subparsers")
    return found


def ci_test_time(readme: str) -> tuple[str, float] | None:
    """(CPU, minutes) of the README's sentence on what `make test` took on CI, or None where it has none."""
    m = CI_TIME.search(" ".join(readme.split()))
    return (m["cpu"].strip(), float(m["minutes"])) if m else None


def test_the_fused_step_benchmarks_and_readme_keep_their_line_budgets():
    over = {where: lines for where, most in MAX_LINES.items() if (lines := code_lines(where)) > most}
    assert not over, f"over budget: {over} (budgets: {MAX_LINES})"


def test_no_reference_page_runs_past_300_lines():
    assert not {p: n for p, n in doc_pages().items() if n > MAX_DOC_PAGE}


def test_the_gpu_benchmarks_share_one_runner():
    assert runners() == ["hqlab/bench/runner.py"]
    drivers = gpu_drivers()
    assert len(drivers) >= 5 and all(drivers.values()), drivers


def test_the_readme_states_cis_test_time_and_cpu():
    stated = ci_test_time((REPO / "README.md").read_text())
    assert stated, "the README says nothing of the form: CI's 2-core <CPU> ... **N minutes**"
    assert stated[1] <= MAX_CI_MINUTES, stated


def test_the_checks_can_fail(tmp_path):
    """Each measure sees what it is meant to: a long file, a long page, a second runner, a driver of its own."""
    (tmp_path / "docs" / "journal").mkdir(parents=True)
    (tmp_path / "docs" / "long.md").write_text("x\n" * 301)
    (tmp_path / "docs" / "journal" / "01-run.md").write_text("x\n" * 999)
    assert doc_pages(tmp_path) == {"docs/long.md": 301}
    (tmp_path / "hqlab" / "bench").mkdir(parents=True)
    (tmp_path / "hqlab" / "bench" / "other.py").write_text("p = argparse.ArgumentParser()\np.add_subparsers()\n")
    assert runners(tmp_path) == ["hqlab/bench/other.py"]
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "vllm_own.py").write_text("import argparse\nargparse.ArgumentParser().add_subparsers()")
    (tmp_path / "benchmarks" / "vllm_kept.py").write_text("from hqlab.bench import runner\nCLI = runner.Benchmark()\n")
    assert gpu_drivers(tmp_path) == {"vllm_kept.py": True, "vllm_own.py": False}
    assert code_lines("benchmarks", tmp_path) == 4
    assert ci_test_time("On CI's 2-core AMD EPYC (no GPU) it took\n**23.7 minutes**.") == ("AMD EPYC", 23.7)
    assert ci_test_time("It took 23.7 minutes on CI.") is None
