"""`hqlab.bench.vllm_runs` and `hqlab.bench.serve` run on the GPU host, where polars is not installed: importing them
must not import polars (nor the harness that needs it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["hqlab.bench.vllm_runs", "hqlab.bench.serve"])
def test_the_gpu_side_of_the_vllm_benchmarks_imports_no_polars(module):
    """benchmarks/vllm_gpu.py and benchmarks/vllm_serve.py import these on the GPU host."""
    probe = (f"import sys; import {module}; "
             "print(sorted(m for m in ('polars', 'hqlab.bench.harness') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_harness_names_still_load_from_hqlab_bench():
    import hqlab.bench as hb
    from hqlab.bench import harness, report, suites

    assert (hb.run_bench, hb.summarize, hb.run_suites) == (harness.run_bench, report.summarize, suites.run_suites)
    assert set(hb.__all__) <= set(dir(harness)) | set(dir(report)) | set(dir(suites))
