"""Provenance: what produced a result row or a recorded trace (code commit, library versions, device).

One definition, used by every writer of results (`hqlab.bench` rows, `hqlab sweep` output) and of cached traces
(`hqlab.replay.traces`), so they all say the same thing the same way:

- `git_commit`    the commit of the hqlab checkout the code runs from, with `+dirty` when tracked files differ
                  from it; "unknown" when hqlab does not run from a git checkout (an installed copy, a tarball)
- `torch`, `transformers`, `triton`, `vllm`: installed versions (None where a package is not installed)
- `device`        what computed the numbers: `cpu (<processor>)` or `cuda (<GPU name>)`. No thread count or
                  device index: it also keys the trace cache, where it separates numerics (bf16 near-ties differ
                  between CPU and CUDA, and between GPU models), not runs.

`machine_description` is the longer line every results row carries in its `machine` column (threads, versions).

A leaf module (imports nothing from hqlab), so every floor may use it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import platform
import subprocess
from pathlib import Path
from typing import Any

from hqlab.io import REPO

COLUMNS = ("git_commit", "torch", "transformers", "triton", "vllm", "python", "device")


@functools.lru_cache(maxsize=4)
def git_commit(repo: str | Path = REPO) -> str:
    """HEAD of the git checkout at `repo` (+dirty if tracked files are modified), or "unknown" when `repo` is not
    the top of a checkout (hqlab installed elsewhere, no git binary, a copy without .git)."""
    repo = Path(repo)

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=20,
                              check=True).stdout.strip()

    try:
        top = Path(git("rev-parse", "--show-toplevel")).resolve()
        if top != repo.resolve():  # e.g. hqlab installed in a virtual environment that lies inside another repo
            return "unknown"
        sha = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def package_version(name: str) -> str | None:
    """Installed version of a distribution, None if it is not installed (never imports it)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    import torch

    return {"torch": torch.__version__, "transformers": package_version("transformers"),
            "triton": package_version("triton"), "vllm": package_version("vllm"),
            "python": platform.python_version()}


@functools.lru_cache(maxsize=1)
def cpu_name() -> str:
    name = platform.processor() or platform.machine() or "unknown processor"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return name


def device_name(device: Any) -> str:
    """`cpu (<processor>, <ISA>)` or `cuda (<GPU name>)` for a torch device or a device string ("cpu", "cuda:1").

    A CPU is named with the instruction set torch's kernels dispatch to (AVX2, AVX512, ...): bf16 matrix products
    round differently with and without native bf16, and virtual machines often report only the vendor and family
    ("AMD EPYC") for processors that differ in exactly this."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(dev)})"
    if dev.type == "cpu":
        return f"cpu ({cpu_name()}, {torch.backends.cpu.get_cpu_capability()})"
    return dev.type


def machine_description(device: Any = "cpu", *, vllm: bool = False) -> str:
    """The machine in one line: `<GPU name>, torch X` or `CPU <processor>, N threads, torch X`.

    `vllm`: the machine of a vLLM run: the GPU named by nvidia-smi (asking CUDA here would make vLLM spawn rather
    than fork its engine processes) and vLLM's version after torch's."""
    import torch

    if vllm:
        import shutil

        smi = shutil.which("nvidia-smi")
        gpu = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True).stdout.strip().splitlines() if smi else []
        return f"{gpu[0] if gpu else 'unknown GPU'}, torch {torch.__version__}, vllm {package_version('vllm')}"
    dev = torch.device(device)
    if dev.type == "cuda":
        return f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}"
    return f"CPU {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def provenance(device: Any) -> dict[str, str | None]:
    """The provenance columns (`COLUMNS`) of results computed on `device` by this process."""
    return {"git_commit": git_commit(), **versions(), "device": device_name(device)}


__all__ = ["COLUMNS", "git_commit", "package_version", "versions", "device_name", "provenance", "cpu_name",
           "machine_description"]
