"""hqlab and vLLM: the engine wrapper (`engine`), the host-side `custom_class` adapter (`adapter`), and the plugin
that puts hqlab's speculators inside vLLM's GPU step (`plugin`, `gpu_lookup`, `gpu_fused` with `drafter` and
`fused_step`). docs/vllm.md says which is which.

Importing this package does not import vLLM: the engine and the plugin import it when they run.
"""

from hqlab.engines.vllm.engine import *  # noqa: F401,F403  (the engine's public names: VLLMEngine, settings_for, ...)
from hqlab.engines.vllm.engine import __all__  # noqa: F401
