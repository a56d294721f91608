"""The benchmark harness: workloads × configs × engine → one results row per (config, prompt) and the step
records, written together (`write_results`: `<out>.parquet` and `<out>.steps.parquet`), with provenance.

- `harness`: `run_bench` and `run_batch_bench` (one engine, interleaved configs, lossless checks), spec and
  workload checks, `write_results`.
- `vllm_runs`: configs on vLLM, one engine each or all alive at once with interleaved requests, and the raw runs a
  GPU host returns (vLLM, torch and pyarrow only: it runs where polars is not installed).
- `vllm`: those raw runs turned into results, and the same benchmark on vLLM from here.
- `suites`: `run_suites` (suites through the transformers engine or vLLM) and the project's benchmarks (core,
  fusion, draft-vocabulary acceptance) as library calls.
- `report`: summaries and the benchmarks' figures; `vllm_report`: vLLM runs read back (ratios, breakdowns).
- `runner`: the one driver of the GPU benchmarks (benchmarks/vllm_*.py, seed_scale_validation.py): their command
  line (`Benchmark`: --tag, --commit, --plan, --budget-s; `host` prints a GPU command's host call), `log`, the raw
  files rewritten after every point, the budget, and `finish_run` (`results.write_run`). Standard library only.
- `corpus_runs`, `step_cost`, `seed_scale`: what the corpus, step-cost and seed-scale benchmarks plan and how
  their returned rows become a run's tables; `serve.returned_run`, `vllm.finish_tables` the same for serving and
  vllm_gpu.py. `gpu_timing`: the CUDA timers of the probes in experiments/.
- `results`: the committed results, one folder a run (data/results/<study>/<run>/) and their index: `load`,
  `run_info`, `write_run` (what every benchmark's `finish` puts a run in place with).
- `claims`: what the docs say of a committed run, as data beside it (claims.json), and the checker.
- `faults`, `soak`: what clients do to a served config (#60): the fault-and-feature suite (its loopback client, cases
  and rows against `none`), and the soak (a bounded load at 64 in flight with disconnects, sampled over time).
- `lossless`: is an output identical to the reference, or a near-tie flip; chi-square checks for sampling.
- `divergence`: where two greedy answers part, read by a model teacher-forced over their shared prefix (near tie or
  mismatch): the check of engines that left no margins of their own (the corpus runs' divergences.parquet).

The names below load their module on first use, so importing `hqlab.bench.vllm_runs` on a GPU host does not import
the harness (polars).
"""

from __future__ import annotations

import importlib
from typing import Any

_FROM = {
    "harness": ["EXTERNAL", "HFPLDConfig", "HFPlainConfig", "RunConfig", "check_specs", "check_workload",
                "encode_prompts", "known", "parse_configs", "part_path", "prompt_rows", "run_batch_bench",
                "run_bench", "run_meta", "with_provenance", "write_results"],
    "report": ["CORE_FIGURE_KINDS", "acceptance_by_position", "core_figure_names", "core_figures",
               "fusion_figure_names", "summarize"],
    "suites": ["run_suites"],
}
_MODULE_OF = {name: module for module, names in _FROM.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'hqlab.bench' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"hqlab.bench.{module}"), name)
    globals()[name] = value
    return value
