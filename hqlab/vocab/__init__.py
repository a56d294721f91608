"""Draft vocabulary (SPEC §2.7): the N token ids a drafter may propose, counted from the model's own outputs.

- `corpus`: the corpus reader (JSONL of self-generated answers or text, plain text and code, parquet).
- `selfgen`: the target answers a prompt set (resumable), giving the corpus its list is counted from.
- `lists`: counting, ranking and coverage; `build(...)` publishes the artifacts of one list.
- `publish`: crash-safe publication of a folder of artifacts behind one committed index.
- `runtime`: what a drafter needs to draft with a list (`load_draft_vocab`, `load_mapping`, `sliced_lm_head`).

The names of `lists` and `runtime` are importable from here; they load on first use, so the corpus reader and
the publisher load without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LISTS = ("ARTIFACTS", "special_token_ids", "Counts", "count", "count_corpus", "rank", "top_n", "coverage",
          "coverage_curve", "curves", "compare_lists", "coverage_study", "default_sizes", "artifact_bytes",
          "model_files", "BuildResult", "build", "heldout_prompt_ids", "generic_records", "generic_corpus_file",
          "measure_draft_latency")
_RUNTIME = ("VocabError", "read_head_rows", "sliced_lm_head", "expand_logits", "MAP_NAMES", "load_mapping",
            "eagle3_d2t", "write_id_list", "load_draft_vocab", "load_draft_head")


def __getattr__(name: str) -> Any:
    for module, names in (("lists", _LISTS), ("runtime", _RUNTIME)):
        if name in names:
            return getattr(importlib.import_module(f"hqlab.vocab.{module}"), name)
    raise AttributeError(f"module 'hqlab.vocab' has no attribute {name!r}")


__all__ = [*_LISTS, *_RUNTIME]
