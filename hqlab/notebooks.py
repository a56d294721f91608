"""Run the jupytext notebooks with papermill (the README's main command, `hqlab figures`).

Every figure in docs/ is written by one of these notebooks. A YAML parameters file can override any notebook's
parameters for a batch sweep (another model, workload file, grid, device):

    defaults:            # applied to every notebook that has the parameter
      model: qwen2.5-coder-0.5b
    suffix_lengths:      # per notebook, by file stem
      max_new_tokens: 64
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"


def notebook_paths() -> list[Path]:
    return sorted(p for p in NOTEBOOKS.glob("*.py") if not p.name.startswith("_"))


def load_params(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read parameters file {path}: {e}") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(f"{path}: expected a mapping of notebook stem (or 'defaults') to a mapping of parameters")
    return data


def declared_parameters(nb: Any) -> set[str]:
    """Names assigned in the cell tagged `parameters`."""
    import ast

    for cell in nb.cells:
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            tree = ast.parse(cell.source)
            return {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                    for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                    if isinstance(t, ast.Name)}
    return set()


def run_notebook(path: Path, parameters: dict[str, Any], out_dir: Path) -> Path:
    import jupytext
    import papermill

    nb = jupytext.read(path)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    declared = declared_parameters(nb)
    unknown = sorted(set(parameters) - declared)
    if unknown:
        raise ValueError(f"{path.name}: unknown parameter(s) {', '.join(unknown)}; "
                         f"declared: {', '.join(sorted(declared))}")
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{path.stem}.ipynb"
    papermill.execute_notebook(nb, str(out), parameters=parameters, kernel_name="python3", cwd=str(REPO),
                               progress_bar=True)
    return out


def run_all(params_file: Path | None = None, only: list[str] | None = None,
            out_dir: Path = Path("notebooks/out")) -> int:
    import jupytext

    params = load_params(params_file)
    paths = notebook_paths()
    if only:
        missing = sorted(set(only) - {p.stem for p in paths})
        if missing:
            raise ValueError(f"no notebook named {', '.join(missing)}; have: {', '.join(p.stem for p in paths)}")
        paths = [p for p in paths if p.stem in only]
    stray = sorted(set(params) - {"defaults"} - {p.stem for p in notebook_paths()})
    if stray:
        raise ValueError(f"parameters file names unknown notebook(s): {', '.join(stray)}")
    out_dir = out_dir if out_dir.is_absolute() else REPO / out_dir
    for path in paths:
        declared = declared_parameters(jupytext.read(path))
        chosen = {k: v for k, v in params.get("defaults", {}).items() if k in declared}
        chosen.update(params.get(path.stem, {}))
        t0 = time.time()
        print(f"== {path.stem} {chosen or ''}", flush=True)
        run_notebook(path, chosen, out_dir)
        print(f"== {path.stem} done in {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_all())
