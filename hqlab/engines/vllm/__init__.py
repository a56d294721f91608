"""hqlab and vLLM: the engine wrapper (`engine`, `startup` for engines started together), the host-side
`custom_class` adapter (`adapter`), the plugin that puts hqlab's speculators inside vLLM's GPU step (`plugin`,
`gpu_lookup`, `gpu_fused` with its config `gpu_fused_config`, `drafter`, `drafter_prompts`, `drafter_flags`,
`fused_step` and `fused_records`), what the speculators share (`speculator`) and what hqlab adds to vLLM's worker
(`worker`). Benchmark runs on these engines are `hqlab.bench.vllm_runs`. docs/vllm.md says which is which.

Importing this package does not import vLLM: the engine and the plugin import it when they run.
"""

from hqlab.engines.vllm.engine import *  # noqa: F401,F403  (the engine's public names: VLLMEngine, settings_for, ...)
from hqlab.engines.vllm.engine import __all__  # noqa: F401
