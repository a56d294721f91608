"""The harness's names still load from `hqlab.bench`, which loads its modules lazily so that the GPU side imports no
polars (tests/bench/test_runner.py checks that on every GPU-side module)."""

from __future__ import annotations


def test_the_harness_names_still_load_from_hqlab_bench():
    import hqlab.bench as hb
    from hqlab.bench import harness, report, suites

    assert (hb.run_bench, hb.summarize, hb.run_suites) == (harness.run_bench, report.summarize, suites.run_suites)
    assert set(hb.__all__) <= set(dir(harness)) | set(dir(report)) | set(dir(suites))
