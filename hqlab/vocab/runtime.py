"""The runtime half of a draft vocabulary (SPEC §2.7), what a drafter needs to draft with one: the id list
(`load_draft_vocab`), the id maps of a published folder (`load_mapping`), the head cut to those rows
(`sliced_lm_head`, `read_head_rows`, `load_draft_head`) and full-size logits from it (`expand_logits`).

The maps hold absolute ids, not offsets. vLLM's EAGLE-3 `d2t` holds offsets (`target_id = draft_id +
d2t[draft_id]`); `eagle3_d2t(draft_to_target)` converts. Folders published before the maps were renamed call them
`d2t`/`t2d` with the same absolute contents; `load_mapping` reads them too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from hqlab.io import write_atomic
from hqlab.vocab.publish import PublishError, path_of, read_index


class VocabError(ValueError):
    """A draft vocabulary cannot be built or loaded; the message says what to fix."""


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise VocabError(f"{folder}: no .safetensors weights")
    return files


_ST_DTYPES = {"F32": (np.float32, torch.float32), "BF16": (np.uint16, torch.bfloat16),
              "F16": (np.float16, torch.float16)}


def read_head_rows(folder: str | Path, ids: np.ndarray) -> torch.Tensor:
    """Rows `ids` of the output layer read straight from a checkpoint folder (memory-mapped: only those rows are
    read). Tied models have no `lm_head.weight`; their embedding matrix is the head."""
    folder = Path(folder)
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        for path in _safetensors_files(folder):
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            if name not in header:
                continue
            entry = header[name]
            if entry["dtype"] not in _ST_DTYPES:
                raise VocabError(f"{path}: {name} has dtype {entry['dtype']}; supported: {', '.join(_ST_DTYPES)}")
            np_dtype, torch_dtype = _ST_DTYPES[entry["dtype"]]
            start, _ = entry["data_offsets"]
            mm = np.memmap(path, dtype=np_dtype, mode="r", offset=8 + n + start, shape=tuple(entry["shape"]))
            rows = torch.from_numpy(np.ascontiguousarray(mm[np.asarray(ids, dtype=np.int64)]))
            return rows.view(torch_dtype) if np_dtype is np.uint16 else rows
    raise VocabError(f"{folder}: the checkpoint has neither lm_head.weight nor model.embed_tokens.weight")


def sliced_lm_head(model: Any, ids: torch.Tensor | Sequence[int]) -> torch.nn.Linear:
    """A Linear scoring only the `ids` rows of `model`'s output layer (same device and dtype). Its output index i
    stands for token `ids[i]`: map with `ids[logits.argmax(-1)]`, or `expand_logits` for a full-size view."""
    head = model.get_output_embeddings()
    ids = torch.as_tensor(ids, dtype=torch.long, device=head.weight.device)
    sliced = torch.nn.Linear(head.weight.shape[1], ids.numel(), bias=head.bias is not None,
                             device=head.weight.device, dtype=head.weight.dtype)
    with torch.no_grad():
        sliced.weight.copy_(head.weight.index_select(0, ids))
        if head.bias is not None:
            sliced.bias.copy_(head.bias.index_select(0, ids))
    sliced.requires_grad_(False)
    return sliced


def expand_logits(sliced_logits: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full-vocabulary logits with -inf outside the list (a drafter's q is then exactly zero there)."""
    full = sliced_logits.new_full((*sliced_logits.shape[:-1], vocab_size), float("-inf"))
    full[..., ids.to(sliced_logits.device)] = sliced_logits
    return full


# Names of the maps in `mapping.safetensors`, now and in folders published before they were renamed (the same
# absolute contents: draft row -> target id, target id -> draft row).
MAP_NAMES = ("draft_to_target", "target_to_draft")


_OLD_MAP_NAMES = ("d2t", "t2d")


def load_mapping(folder: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(`draft_to_target` [N], `target_to_draft` [V]) of a published vocabulary folder, both absolute ids;
    checked against the folder's id list. Folders from before the rename (`d2t`/`t2d`) read the same."""
    from safetensors.torch import load_file

    try:
        index = read_index(folder)
        tensors = load_file(path_of(folder, "mapping.safetensors", index))
    except PublishError as e:
        raise VocabError(str(e)) from None
    names = MAP_NAMES if set(MAP_NAMES) <= set(tensors) else _OLD_MAP_NAMES
    if not set(names) <= set(tensors):
        raise VocabError(f"{folder}: mapping.safetensors holds {', '.join(sorted(tensors))}, not "
                         f"{' and '.join(MAP_NAMES)}; rebuild the folder with `hqlab vocab build`")
    draft_to_target, target_to_draft = (tensors[n].long() for n in names)
    ids = load_draft_vocab(folder)
    if not torch.equal(draft_to_target, ids) or not torch.equal(target_to_draft[ids], torch.arange(ids.numel())):
        raise VocabError(f"{folder}: mapping.safetensors disagrees with ids.json (absolute ids expected); "
                         f"rebuild the folder with `hqlab vocab build`")
    return draft_to_target, target_to_draft


def eagle3_d2t(draft_to_target: torch.Tensor) -> torch.Tensor:
    """vLLM's EAGLE-3 `d2t` (offsets: `target_id = draft_id + d2t[draft_id]`) from hqlab's absolute map."""
    draft_to_target = torch.as_tensor(draft_to_target, dtype=torch.long)
    return draft_to_target - torch.arange(draft_to_target.numel(), device=draft_to_target.device)


def _ids_from_json(path: Path) -> list[int]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise VocabError(f"{path}: not a JSON id list ({e})") from None
    ids = data.get("ids") if isinstance(data, dict) else data
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                        for i in ids):
        raise VocabError(f"{path}: expected a non-empty list of non-negative integer token ids "
                         f"(or an object with one under 'ids')")
    return ids


def write_id_list(path: str | Path, ids: np.ndarray) -> Path:
    """A bare sorted id list (`{"ids": [...]}`), the lightest draft vocabulary `load_draft_vocab` accepts."""
    ids = np.sort(np.asarray(ids, dtype=np.int64))
    return write_atomic(path, lambda tmp: tmp.write_text(json.dumps({"ids": ids.tolist()}) + "\n"))


def load_draft_vocab(path: str | Path) -> torch.Tensor:
    """The draft vocabulary as a sorted 1-D int64 tensor of unique token ids.

    `path` is a published vocabulary folder (its committed index is checked), or a JSON file holding a list of
    ids (or `{"ids": [...]}`), e.g. a hand-made list; a plain list is sorted and deduplicated."""
    path = Path(path)
    if path.is_dir():
        try:
            ids = _ids_from_json(path_of(path, "ids.json"))
        except PublishError as e:
            raise VocabError(str(e)) from None
    elif path.is_file():
        ids = _ids_from_json(path)
    else:
        raise VocabError(f"{path}: no such draft vocabulary (a folder from `hqlab vocab build` or a JSON id list)")
    return torch.unique(torch.tensor(ids, dtype=torch.long))  # sorted


def load_draft_head(folder: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, lm_head rows [N, hidden]) of a published vocabulary folder."""
    from safetensors.torch import load_file

    index = read_index(folder)
    ids = load_draft_vocab(folder)
    weight = load_file(path_of(folder, "lm_head.safetensors", index))["weight"]
    if weight.shape[0] != ids.numel():
        raise VocabError(f"{folder}: lm_head has {weight.shape[0]} rows for {ids.numel()} ids")
    return ids, weight
