"""No function of the vLLM wing (`hqlab/engines/vllm/`) runs over 60 lines, docstring and nested functions included:
a function that long does several things, and the fused step's code is read one screen at a time."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 60


def long_functions(folder: Path, limit: int, root: Path = REPO) -> list[str]:
    """`file:line name (n lines)`, the file relative to `root`, for every function or method of the .py files under
    `folder` over `limit` lines (from its `def` to its last line)."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_of_the_vllm_wing_is_over_60_lines():
    assert not long_functions(REPO / "hqlab" / "engines" / "vllm", MAX_LINES)


def test_the_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "probe.py").write_text(f"def long():\n{body}\n\n\ndef short():\n    return 1\n")
    assert long_functions(tmp_path, MAX_LINES, root=tmp_path) == [f"probe.py:1 long ({MAX_LINES + 1} lines)"]
