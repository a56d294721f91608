"""A kernel module of `hqlab_kernels` by name, or the file itself under kernels/ where the package is not installed
(the kernel tests run from a bare checkout too). Import it after TRITON_INTERPRET is set: the kernels read it when
their @triton.jit functions are defined."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def kernel_module(name: str) -> ModuleType:
    try:
        return importlib.import_module(f"hqlab_kernels.{name}")
    except ImportError:
        path = Path(__file__).resolve().parents[2] / "kernels" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(f"hqlab_kernels.{name}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
