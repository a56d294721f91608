"""The benchmark harness: workloads × configs × engine → one results row per (config, prompt) and the step
records, written together (`write_results`: `<out>.parquet` and `<out>.steps.parquet`), with provenance.

- `harness`: `run_bench` and `run_batch_bench` (one engine, interleaved configs, lossless checks), spec and
  workload checks, `write_results`.
- `vllm`: the same on vLLM, one engine per config, and raw GPU runs turned into results.
- `suites`: `run_suites` (suites through the transformers engine or vLLM) and the project's benchmarks (core,
  fusion, draft-vocabulary acceptance) as library calls.
- `report`: summaries and the benchmarks' figures; `vllm_report`: vLLM runs read back (ratios, breakdowns).
- `lossless`: is an output identical to the reference, or a near-tie flip; chi-square checks for sampling.
"""

from hqlab.bench.harness import (EXTERNAL, HFPLDConfig, HFPlainConfig, RunConfig, check_specs, check_workload,
                                 encode_prompts, known, parse_configs, part_path, prompt_rows, run_batch_bench,
                                 run_bench, run_meta, with_provenance, write_results)
from hqlab.bench.report import (CORE_FIGURE_KINDS, acceptance_by_position, core_figure_names, core_figures,
                                fusion_figure_names, summarize)
from hqlab.bench.suites import run_suites

__all__ = ["EXTERNAL", "known", "HFPLDConfig", "HFPlainConfig", "RunConfig", "check_specs", "check_workload",
           "encode_prompts", "parse_configs", "part_path", "prompt_rows", "run_batch_bench", "run_bench", "run_meta",
           "run_suites", "with_provenance", "write_results", "CORE_FIGURE_KINDS", "acceptance_by_position",
           "core_figure_names", "core_figures", "fusion_figure_names", "summarize"]
