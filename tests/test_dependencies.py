"""Every package the project imports is declared in pyproject.toml and pinned; nothing is pip-installed at run time
except the model weights themselves."""

from __future__ import annotations

import ast
import functools
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

from hqlab import models
from hqlab.models import gguf

REPO = Path(__file__).resolve().parent.parent
SOURCES = ["hqlab", "kernels", "notebooks", "tests", "benchmarks", "experiments"]
LOCAL = {"hqlab", "hqlab_kernels", "benchmarks", "kernels", "conftest"}
# import name -> distribution, for packages this environment does not have (vLLM's live in their own environment)
NOT_HERE = {"vllm": "vllm", "numba": "numba", "arctic_inference": "arctic-inference", "cuda": "cuda-bindings",
            "openai": "openai", "fastapi": "fastapi", "uvicorn": "uvicorn"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(spec: str) -> str:
    return _norm(re.split(r"[\s\[<>=!~;@]", spec.strip(), maxsplit=1)[0])


def imported_modules() -> dict[str, set[str]]:
    """Top-level modules imported anywhere in the project's Python files -> the files importing them."""
    found: dict[str, set[str]] = {}
    for folder in SOURCES:
        for path in sorted((REPO / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    # a helper module beside the importing file (tests/kernels/kernel_module.py) is the project's own
                    beside = (path.parent / f"{top}.py").exists() or (path.parent / top / "__init__.py").exists()
                    if top not in sys.stdlib_module_names and top not in LOCAL and not beside:
                        found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


@functools.cache
def _installed() -> dict[str, list[str]]:
    return packages_distributions()


def distribution(module: str) -> str:
    dists = _installed().get(module)
    if dists:
        return _norm(dists[0])
    if module in NOT_HERE:
        return NOT_HERE[module]
    raise AssertionError(f"{module} is imported but belongs to no installed or known distribution")


def test_every_import_is_declared_and_pinned():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {_requirement_name(s) for s in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        declared |= {_requirement_name(s) for s in extra}
    # arctic-inference is built from source (make arctic): its pin is the one in its extra
    pins = {_requirement_name(s) for s in project["optional-dependencies"]["arctic"] if "==" in s}
    for req in ["requirements.txt", "requirements-vllm.txt"]:
        for line in (REPO / req).read_text().splitlines():
            if "==" in line and not line.lstrip().startswith("#"):
                pins.add(_requirement_name(line))
    modules = imported_modules()
    assert {"torch", "numpy", "nbformat", "mistune"} <= set(modules)  # the scan sees imports inside functions too
    undeclared, unpinned = [], []
    for module, files in sorted(modules.items()):
        dist = distribution(module)
        if dist not in declared:
            undeclared.append(f"{dist} (import {module}: {sorted(files)[0]})")
        if dist not in pins:
            unpinned.append(dist)
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    assert not unpinned, f"imported but not pinned in the requirements files: {unpinned}"


def test_main_and_vllm_pins_name_one_version_each():
    for req in ["requirements.txt", "requirements-vllm.txt"]:
        names = [_requirement_name(line) for line in (REPO / req).read_text().splitlines()
                 if line.strip() and not line.lstrip().startswith("#")]
        assert len(names) == len(set(names)), f"{req} pins a package twice"
        assert all("==" in line for line in (REPO / req).read_text().splitlines()
                   if line.strip() and not line.lstrip().startswith("#")), f"{req} has an unpinned line"
    vllm = {_requirement_name(line): line.split("==")[1] for line in (REPO / "requirements-vllm.txt").read_text()
            .splitlines() if "==" in line}
    assert vllm["vllm"] == "0.26.0" and vllm["torch"] == "2.11.0" and vllm["numba"].startswith("0.65.")


def test_gguf_conversion_without_accelerate_is_a_clear_error_not_an_install(monkeypatch):
    """accelerate is a declared dependency; where it is missing, converting says so and installs nothing."""
    assert str(REPO) in gguf._converter_env()["PYTHONPATH"].split(":")  # here it is installed
    real = gguf._package_dir_in_env
    monkeypatch.setattr(gguf, "_package_dir_in_env", lambda m: None if m == "accelerate" else real(m))
    monkeypatch.setattr(gguf, "_pip_install", lambda *a, **k: pytest.fail("pip install at run time"))
    with pytest.raises(models.ModelError, match="needs the `accelerate` package"):
        gguf._converter_env()
