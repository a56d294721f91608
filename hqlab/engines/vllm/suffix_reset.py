"""Emptying vLLM's own `suffix` method's global tree between benchmark points (the worker extension's corpus reset).

It imports nothing, so that it can be checked against Arctic Inference's real `SuffixDecodingCache` where that
builds (CPython 3.12, tools/gpu_host/build_arctic_cp312.py), without torch, vLLM or the rest of hqlab.
"""

from __future__ import annotations

from typing import Any


def reset_suffix_cache(drafter: Any) -> bool:
    """Give vLLM's `SuffixDecodingProposer` (the V1 runner's `drafter`: model runner V2 does not run `suffix`) a new,
    empty `SuffixDecodingCache` of the same depth and size; False for any other drafter, and for one whose global tree
    is off (max_cached_requests 0: nothing crosses requests). A new cache rather than evicting each cached response:
    the requests of the point just ended stay active in the old cache until the next proposal (the proposer stops
    them only when a later batch lacks them), and the new one forgets those prompts' trees as well."""
    cache = getattr(drafter, "suffix_cache", None)
    if cache is None or not hasattr(cache, "cached_requests"):
        return False
    if cache.max_cached_requests == 0:
        return False
    drafter.suffix_cache = type(cache)(max_tree_depth=cache.max_tree_depth,
                                       max_cached_requests=cache.max_cached_requests)
    return True
