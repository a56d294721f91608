"""The house plan (docs/architecture.md) holds in the import graph: every module of hqlab sits on a floor, imports
only its own floor or lower ones (lazy imports inside functions included), and no modules import each other in a
circle, when they load or later (lazy imports counted). The Triton kernels import nothing from hqlab; at most 8
modules lie loose in hqlab/, every package is installed (pyproject.toml), and the notebooks call the library
instead of running other programs."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# floor 1: leaves; 2: pure rules, models; 3: proposers, draft vocabulary; 4: engines, replay; 5: the benchmark
# harness, the site; 6: the command line (and the notebooks, outside the package).
FLOORS = {
    "hqlab": 1, "hqlab.config": 1, "hqlab.trace": 1, "hqlab.io": 1, "hqlab.provenance": 1, "hqlab.workloads": 1,
    "hqlab.plots": 1, "hqlab_kernels": 1,
    "hqlab.rules": 2, "hqlab.models": 2,
    "hqlab.proposers": 3, "hqlab.vocab": 3,
    "hqlab.engines": 4, "hqlab.replay": 4,
    "hqlab.bench": 5, "hqlab.site": 5,
    "hqlab.cli": 6,
}
ROOTS = {"hqlab": REPO / "hqlab", "hqlab_kernels": REPO / "kernels"}


def module_files() -> dict[str, Path]:
    """Dotted name -> file of every module of hqlab and hqlab_kernels (a package by its __init__.py)."""
    found = {}
    for top, folder in ROOTS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [top, *path.relative_to(folder).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = module_files()


def floor(module: str) -> int:
    """The floor of a module: that of the longest declared name it is, or lies in."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in FLOORS:
            return FLOORS[".".join(parts[:n])]
    raise AssertionError(f"{module} sits on no floor of the plan")


def imports(path: Path, *, top_level_only: bool = False) -> set[str]:
    """The hqlab modules a file imports: `from pkg import name` counts as pkg.name where that is a module."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                     for a in node.names]
        else:
            continue
        found |= {n for n in names if n.split(".")[0] in ROOTS}
    return found


def test_every_module_sits_on_a_floor_and_imports_nothing_above_it():
    upward = []
    for module, path in MODULES.items():
        for target in imports(path):
            if floor(target) > floor(module):
                upward.append(f"{module} (floor {floor(module)}) imports {target} (floor {floor(target)})")
    assert not upward, "imports running up a floor:\n" + "\n".join(sorted(upward))


def test_the_kernels_import_nothing_from_hqlab():
    assert not {t for m, p in MODULES.items() if m.startswith("hqlab_kernels") for t in imports(p)
                if t.split(".")[0] == "hqlab"}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """A cycle of `graph` (node -> the nodes it imports) as [a, b, ..., a], or [] where there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
            if state.get(nxt) is None and (found := visit(nxt, path + [node])):
                return found
        state[node] = 2
        return []

    for start in sorted(graph):
        if state.get(start) is None and (found := visit(start, [])):
            return found
    return []


def import_graph(files: dict[str, Path], *, top_level_only: bool = False) -> dict[str, set[str]]:
    """module -> the modules of `files` it imports: when it loads (`top_level_only`), or ever (lazy imports inside
    functions too)."""
    return {m: {t for t in imports(p, top_level_only=top_level_only) if t in files} for m, p in files.items()}


def test_no_modules_import_each_other_in_a_circle():
    """Neither the load-time graph (the imports a module runs when it loads) nor the whole graph (lazy imports
    inside functions included) has a cycle: a lazy import that closes a circle only hides it until the call."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]  # it sees one
    for top_level_only in (True, False):
        assert not (cycle := find_cycle(import_graph(MODULES, top_level_only=top_level_only))), " -> ".join(cycle)


def test_the_circle_check_catches_a_lazy_import_that_closes_a_circle(tmp_path):
    """The check above can fail: two modules that import each other, one of them inside a function, form a circle
    the load-time graph does not show and the whole graph does."""
    (tmp_path / "hqlab").mkdir()
    (tmp_path / "hqlab" / "loader.py").write_text("from hqlab.helper import f\n")
    (tmp_path / "hqlab" / "helper.py").write_text("def f():\n    import hqlab.loader\n    return hqlab.loader\n")
    files = {**MODULES, "hqlab.loader": tmp_path / "hqlab" / "loader.py",
             "hqlab.helper": tmp_path / "hqlab" / "helper.py"}
    planted = {m: g for m, g in import_graph(files).items() if m in ("hqlab.loader", "hqlab.helper")}
    assert planted == {"hqlab.loader": {"hqlab.helper"}, "hqlab.helper": {"hqlab.loader"}}
    assert not find_cycle({m: g for m, g in import_graph(files, top_level_only=True).items() if m in planted})
    assert find_cycle(planted) == ["hqlab.helper", "hqlab.loader", "hqlab.helper"]


def test_the_floors_check_catches_an_upward_import(tmp_path):
    """The check above can fail: a rule that imports the engine runs up two floors."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from hqlab.engines.hf import HFEngine\n    from hqlab import bench\n")
    assert imports(bad) == {"hqlab.engines.hf", "hqlab.bench"}
    assert floor("hqlab.rules.lookup") < floor("hqlab.engines.hf") < floor("hqlab.bench.harness")


def test_few_loose_modules_and_every_package_installed():
    loose = sorted(p.name for p in (REPO / "hqlab").glob("*.py"))
    assert len(loose) <= 8, loose
    packages = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert packages == set(tool["packages"])
    assert all(tool["package-dir"][pkg] == str(MODULES[pkg].parent.relative_to(REPO)) for pkg in packages)


def test_notebooks_call_the_library_not_other_programs():
    for path in sorted((REPO / "notebooks").glob("*.py")):
        modules = {a.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Import)
                   for a in node.names} | {node.module for node in ast.walk(ast.parse(path.read_text()))
                                           if isinstance(node, ast.ImportFrom)}
        assert not modules & {"subprocess", "os.system"}, path.name


def top_level_imports(path: Path) -> set[str]:
    """The top-level package of every absolute import of a file, lazy imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_experiments_import_hqlab_not_the_benchmarks_or_each_other(tmp_path):
    """An experiment is kept to be run again: it may use hqlab (its GPU timers are `hqlab.bench.gpu_timing`), never a
    benchmark script, whose options and files change with the benchmark, nor another experiment's script (a module
    beside it, in its own folder, is its own)."""
    paths = sorted((REPO / "experiments").rglob("*.py"))
    for path in paths:
        others = {p.stem for p in paths if p.parent != path.parent}
        bad = top_level_imports(path) & ({"benchmarks", "experiments"} | others)
        assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"
    planted = tmp_path / "probe.py"  # the check can fail: a lazy import of a benchmark's helper
    planted.write_text("def main():\n    from benchmarks.vllm_step_cost import run_bounded\n")
    assert "benchmarks" in top_level_imports(planted)
