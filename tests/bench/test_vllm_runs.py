"""`hqlab.bench.vllm_runs` runs on the GPU host, where polars is not installed: importing it must not import polars
(nor the harness that needs it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_gpu_side_of_the_vllm_benchmark_imports_no_polars():
    probe = ("import sys; import hqlab.bench.vllm_runs; "
             "print(sorted(m for m in ('polars', 'hqlab.bench.harness') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_harness_names_still_load_from_hqlab_bench():
    import hqlab.bench as hb
    from hqlab.bench import harness, report, suites

    assert (hb.run_bench, hb.summarize, hb.run_suites) == (harness.run_bench, report.summarize, suites.run_suites)
    assert set(hb.__all__) <= set(dir(harness)) | set(dir(report)) | set(dir(suites))
