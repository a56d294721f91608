"""The corpus reset of a served `arctic-suffix` (vLLM's `suffix` method) against Arctic Inference's real
`SuffixDecodingCache`, which builds only for CPython 3.12 here (tools/gpu_host/build_arctic_cp312.py): the check runs
in that script's venv (the wheel and numpy, no torch), loading hqlab's reset function from its file."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK_PYTHON = ROOT / ".vllm-dist" / "arctic" / "venv-check" / "bin" / "python"

SCRIPT = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("suffix_reset", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
from arctic_inference.suffix_decoding import SuffixDecodingCache

class Drafter:  # the attribute vLLM's SuffixDecodingProposer keeps its cache in
    def __init__(self, cached):
        self.suffix_cache = SuffixDecodingCache(max_tree_depth=24, max_cached_requests=cached)

def draft(cache):
    cache.start_request("b", [9, 1, 2, 3])
    cache.add_active_response("b", [4])
    out = list(cache.speculate("b", [1, 2, 3, 4], max_spec_tokens=8, max_spec_factor=4.0,
                               min_token_prob=0.1).token_ids)
    cache.stop_request("b")
    cache.evict_cached_response("b") if "b" in cache.cached_requests else None
    return out

d = Drafter(16)
d.suffix_cache.start_request("a", [1, 2, 3])
d.suffix_cache.add_active_response("a", [4, 5, 6, 7, 8])  # left active: a point's last request, not yet stopped
assert draft(d.suffix_cache) == [5, 6, 7, 8]
old = d.suffix_cache
assert module.reset_suffix_cache(d) is True
new = d.suffix_cache
assert new is not old and type(new) is type(old)
assert (new.max_tree_depth, new.max_cached_requests) == (24, 16)
assert not list(new.cached_requests) and not list(new.active_requests)
assert draft(new) == [], "the reset cache still drafts from the earlier request"
off = Drafter(0)
assert module.reset_suffix_cache(off) is False  # no global tree: nothing crosses requests
assert module.reset_suffix_cache(object()) is False and module.reset_suffix_cache(None) is False
print("ok")
"""


@pytest.mark.skipif(not CHECK_PYTHON.exists(), reason="build the wheel first: tools/gpu_host/build_arctic_cp312.py")
def test_the_reset_empties_arctics_real_suffix_cache():
    out = subprocess.run([str(CHECK_PYTHON), "-c", SCRIPT, str(ROOT / "hqlab/engines/vllm/suffix_reset.py")],
                         capture_output=True, text=True, cwd="/")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
