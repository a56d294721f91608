"""Run the jupytext notebooks with papermill (the README's main command, `hqlab figures`).

Every figure in docs/ is written by one of these notebooks. A YAML parameters file can override any notebook's
parameters for a batch sweep (another model, workload file, grid, device):

    defaults:            # applied to every notebook that has the parameter
      model: qwen2.5-coder-0.5b
    suffix_lengths:      # per notebook, by file stem
      max_new_tokens: 64

Everything is checked before the first notebook runs (`plan`): notebook names, the parameters file, every
parameter's name and type (against the default in the notebook's parameters cell), and the values that name a
model, device, dtype or workload. Notebooks that record greedy traces share them through the trace cache
(`hqlab.replay.traces.cached_traces`), so a trace set is recorded once per run of `hqlab figures`, and can take
them from trace sets the repository ships where those are what this machine would record (parameter
`shipped_traces`; docs/notebooks.md).
"""

from __future__ import annotations

import ast
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hqlab.config import ConfigError
from hqlab.io import REPO, check_writable

NOTEBOOKS = REPO / "notebooks"

# Parameters whose values name something that can be checked without loading it.
MODEL_PARAMETERS = ("model", "target", "drafter", "accept_target", "accept_drafter")


class NotebookError(ConfigError):
    """A notebook name, parameters file or parameter value is invalid; the message says which and why."""


def notebook_paths() -> list[Path]:
    return sorted(p for p in NOTEBOOKS.glob("*.py") if not p.name.startswith("_"))


def load_params(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    import yaml

    path = Path(path)
    if not path.is_file():
        raise NotebookError(f"parameters file {path}: no such file")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        detail = " ".join(str(e).split())
        raise NotebookError(f"cannot read parameters file {path}: {detail}") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise NotebookError(f"{path}: expected a mapping of notebook stem (or 'defaults') to a mapping of "
                            f"parameters")
    return data


def _parameters_cell(nb: Any) -> str | None:
    for cell in nb.cells:
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            return cell.source
    return None


_NO_DEFAULT = object()


def declared_defaults(nb: Any) -> dict[str, Any]:
    """Name -> default value of every assignment in the cell tagged `parameters` (`_NO_DEFAULT` where the
    default is not a literal)."""
    source = _parameters_cell(nb)
    if source is None:
        return {}
    out: dict[str, Any] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        else:
            continue
        for t in targets:
            if isinstance(t, ast.Name):
                try:
                    out[t.id] = ast.literal_eval(value) if value is not None else _NO_DEFAULT
                except (ValueError, SyntaxError, TypeError):
                    out[t.id] = _NO_DEFAULT
    return out


def declared_parameters(nb: Any) -> set[str]:
    """Names assigned in the cell tagged `parameters`."""
    return set(declared_defaults(nb))


def _type_name(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a mapping"}.get(type(value), type(value).__name__)


def _check_type(name: str, value: Any, default: Any) -> None:
    """A parameter must have the type of its default (an integer where a number is expected is fine)."""
    if default is _NO_DEFAULT or default is None:
        return
    if isinstance(default, bool) or isinstance(value, bool):
        ok = isinstance(value, bool) and isinstance(default, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float))
    elif isinstance(default, (list, tuple)):
        ok = isinstance(value, (list, tuple))
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise NotebookError(f"{name} must be {_type_name(default)} like its default {default!r} "
                            f"(got {value!r})")


def _check_value(name: str, value: Any) -> None:
    """Values that name a model, device, dtype or workload are checked without loading anything."""
    from hqlab import models
    from hqlab.bench import check_workload
    from hqlab.workloads import WorkloadError

    try:
        if name in MODEL_PARAMETERS and isinstance(value, str) and value:
            models.resolve(value)
        elif name == "device" and isinstance(value, str):
            models.resolve_device(value)
        elif name == "dtype" and isinstance(value, str):
            models.resolve_dtype(value)
        elif name == "suite" and isinstance(value, str):
            check_workload(value)
        elif name == "suites" and isinstance(value, dict):
            for suite in value:
                check_workload(str(suite))
    except (models.ModelError, WorkloadError) as e:
        raise NotebookError(f"{name}: {e}") from None


@dataclass(frozen=True)
class Run:
    path: Path
    parameters: dict[str, Any]

    @property
    def stem(self) -> str:
        return self.path.stem


def check_parameters(path: Path, parameters: dict[str, Any], defaults: dict[str, Any] | None = None) -> None:
    """Every parameter given to notebook `path` is declared there, has its default's type and a valid value."""
    if defaults is None:
        import jupytext

        defaults = declared_defaults(jupytext.read(path))
    unknown = sorted(set(parameters) - set(defaults))
    if unknown:
        raise NotebookError(f"{path.name}: unknown parameter(s) {', '.join(unknown)}; "
                            f"declared: {', '.join(sorted(defaults))}")
    for name, value in parameters.items():
        try:
            _check_type(name, value, defaults[name])
            _check_value(name, value)
        except NotebookError as e:
            raise NotebookError(f"{path.stem}: {e}") from None


def plan(params_file: Path | None = None, only: list[str] | None = None,
         out_dir: Path = Path("notebooks/out")) -> list[Run]:
    """The notebooks to run with their parameters, everything validated; raises NotebookError."""
    paths = notebook_paths()
    stems = [p.stem for p in paths]
    if only:
        missing = sorted(set(only) - set(stems))
        if missing:
            raise NotebookError(f"no notebook named {', '.join(missing)}; have: {', '.join(stems)}")
        paths = [p for p in paths if p.stem in only]
    params = load_params(params_file)
    where = f"{params_file}: " if params_file else ""
    stray = sorted(set(params) - {"defaults"} - set(stems))
    if stray:
        raise NotebookError(f"{where}unknown notebook(s) {', '.join(stray)}; have: {', '.join(stems)}")
    check_writable(out_dir if out_dir.is_absolute() else REPO / out_dir, "--out-dir", NotebookError, into=True)
    import jupytext

    runs = []
    for path in paths:
        defaults = declared_defaults(jupytext.read(path))
        chosen = {k: v for k, v in params.get("defaults", {}).items() if k in defaults}
        chosen.update(params.get(path.stem, {}))
        try:
            check_parameters(path, chosen, defaults)
        except NotebookError as e:
            raise NotebookError(f"{where}{e}") from None
        runs.append(Run(path, chosen))
    return runs


def run_notebook(path: Path, parameters: dict[str, Any], out_dir: Path) -> Path:
    import jupytext
    import papermill

    nb = jupytext.read(path)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    check_parameters(path, parameters, declared_defaults(nb))
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{path.stem}.ipynb"
    papermill.execute_notebook(nb, str(out), parameters=parameters, kernel_name="python3", cwd=str(REPO),
                               progress_bar=True)
    return out


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 90 else f"{seconds / 60:.1f} min"


def run_all(params_file: Path | None = None, only: list[str] | None = None,
            out_dir: Path = Path("notebooks/out")) -> int:
    """Run the notebooks (all, or `only`), printing the time each takes and a summary. Returns 0, or 1 when a
    notebook failed (the run stops there; its executed notebook shows the failing cell)."""
    runs = plan(params_file, only, out_dir)  # raises before anything runs
    out_dir = out_dir if out_dir.is_absolute() else REPO / out_dir
    times: list[tuple[str, float]] = []
    failed = None
    start = time.time()
    for run in runs:
        t0 = time.time()
        print(f"== {run.stem} {run.parameters or ''}", flush=True)
        try:
            run_notebook(run.path, run.parameters, out_dir)
        except Exception as e:  # papermill's execution error (or a kernel that died): report, stop
            failed = (run.stem, e)
            times.append((run.stem, time.time() - t0))
            break
        times.append((run.stem, time.time() - t0))
        print(f"== {run.stem} done in {_minutes(times[-1][1])}", flush=True)
    print("== time per notebook: " + ", ".join(f"{stem} {_minutes(s)}" for stem, s in times)
          + f"; total {_minutes(time.time() - start)}", flush=True)
    if failed is not None:
        stem, e = failed
        what = f"{getattr(e, 'ename', type(e).__name__)}: {getattr(e, 'evalue', e)}"
        print(f"hqlab figures: notebook {stem} failed after {_minutes(times[-1][1])}: {' '.join(what.split())} "
              f"(executed notebook: {out_dir / (stem + '.ipynb')})", file=sys.stderr, flush=True)
        return 1
    return 0

