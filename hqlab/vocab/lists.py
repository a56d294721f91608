"""Draft vocabulary lists (SPEC §2.7): the N token ids a drafter may propose, counted from the model's own outputs.

Pipeline: read a corpus (`hqlab.vocab.corpus`) → hold out every 10th record per file (`j % 10 == 0`) → count
token ids of the rest (self-generated records by their output ids, text tokenized without special tokens) → rank
the ids (the tokenizer's added tokens first: chat markers and tool tags are always in; then by count; ties,
including ids never seen, by ascending id, which for a BPE vocabulary is merge order, roughly how frequent a token
was in the tokenizer's own training text) → keep the top N, sorted. Coverage is the share of the held-out records'
output tokens that the list contains; `coverage_curve` reports it over N, overall and per kind of record.

Artifacts (published crash-safely by `hqlab.vocab.publish` into one folder; `hqlab.vocab.runtime` reads them):
- `ids.json`             `{"ids": [sorted ids], "vocab_size": V, "special": [...]}`
- `lm_head.safetensors`  `weight` [N, hidden]: the lm_head rows of those ids (the checkpoint's dtype)
- `mapping.safetensors`  `draft_to_target` [N] (draft row -> target token id, absolute: the sorted ids) and
                         `target_to_draft` [V] (target token id -> draft row, -1 if absent)
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from hqlab.io import REPO, sha256_bytes, write_atomic
from hqlab.vocab.corpus import CorpusError, CorpusRecord, read_corpus
from hqlab.vocab.publish import publish
from hqlab.vocab.runtime import VocabError, read_head_rows, sliced_lm_head

ARTIFACTS = ("ids.json", "lm_head.safetensors", "mapping.safetensors")


# ----------------------------------------------------------------------------------------------------------------
# Counting


def special_token_ids(tokenizer: Any) -> list[int]:
    """Ids the list always contains: every added token (chat markers, end-of-text, tool and FIM tags)."""
    ids = set(int(i) for i in getattr(tokenizer, "all_special_ids", []))
    ids |= {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
    return sorted(ids)


@dataclass
class Counts:
    """Token counts of a corpus split by the hold-out rule."""

    vocab_size: int
    counted: np.ndarray  # int64 [V]: records used to build the list
    held: np.ndarray  # int64 [V]: held-out records
    held_by_src: dict[str, np.ndarray] = field(default_factory=dict)
    records_counted: int = 0
    records_held: int = 0
    sources: list[str] = field(default_factory=list)

    @property
    def tokens_counted(self) -> int:
        return int(self.counted.sum())

    @property
    def tokens_held(self) -> int:
        return int(self.held.sum())

    def summary(self) -> dict[str, Any]:
        return dict(records_counted=self.records_counted, records_held_out=self.records_held,
                    tokens_counted=self.tokens_counted, tokens_held_out=self.tokens_held,
                    distinct_counted=int((self.counted > 0).sum()), sources=self.sources)


def _record_ids(rec: CorpusRecord, tokenizer: Any) -> list[int]:
    if rec.ids is not None:
        return list(rec.ids)
    if tokenizer is None:
        raise VocabError(f"{rec.where}: a text record needs a tokenizer to be counted")
    out: list[int] = []
    for text in rec.texts:
        out += tokenizer.encode(text, add_special_tokens=False)
    return out


def count(records: Iterable[CorpusRecord], tokenizer: Any, vocab_size: int, *, holdout: bool = True,
          progress: bool = True, sources: Sequence[str] = ()) -> Counts:
    """Count token ids of `records` (validated first, by the reader) into counted / held-out arrays."""
    from tqdm.auto import tqdm

    counts = Counts(vocab_size, np.zeros(vocab_size, np.int64), np.zeros(vocab_size, np.int64),
                    sources=[str(s) for s in sources])
    for rec in tqdm(records, desc="counting tokens", unit="rec", disable=not progress, mininterval=1.0):
        ids = np.asarray(_record_ids(rec, tokenizer), dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise CorpusError(f"{rec.where}: token id {int(ids.max())} is outside the model's vocabulary of "
                              f"{vocab_size}; was this corpus generated with another tokenizer?")
        binned = np.bincount(ids, minlength=vocab_size)
        if holdout and rec.held_out:
            counts.held += binned
            counts.held_by_src.setdefault(rec.src, np.zeros(vocab_size, np.int64))
            counts.held_by_src[rec.src] += binned
            counts.records_held += 1
        else:
            counts.counted += binned
            counts.records_counted += 1
    if counts.records_counted == 0:
        raise VocabError("no records left to count after the hold-out (every 10th record, j % 10 == 0, per file; "
                         "a .txt/.py file is one record): give more records or files")
    return counts


def count_corpus(paths: Sequence[str | Path], tokenizer: Any, vocab_size: int, *, holdout: bool = True,
                 progress: bool = True) -> Counts:
    """Validate every record of the corpus, then count it (a bad file fails before any counting)."""
    records = list(read_corpus(paths))
    return count(records, tokenizer, vocab_size, holdout=holdout, progress=progress, sources=paths)


# ----------------------------------------------------------------------------------------------------------------
# Ranking, top-N, coverage


def rank(counted: np.ndarray, special: Sequence[int]) -> np.ndarray:
    """All ids, best first: specials, then by count (descending), ties by ascending id (BPE merge order)."""
    key = counted.astype(np.float64)
    key[np.asarray(special, dtype=np.int64)] = np.inf
    return np.lexsort((np.arange(key.size), -key)).astype(np.int64)


def top_n(order: np.ndarray, n: int) -> np.ndarray:
    if not 1 <= n <= order.size:
        raise VocabError(f"draft vocabulary size must be in [1, {order.size}] (got {n})")
    return np.sort(order[:n])


def coverage(ids: np.ndarray, held: np.ndarray) -> float:
    total = held.sum()
    return float(held[ids].sum() / total) if total else float("nan")


def coverage_curve(order: np.ndarray, counts: Counts, sizes: Sequence[int], *, label: str = "") -> list[dict]:
    """Held-out coverage of the top-N list for each N, overall ("all") and per kind of held-out record."""
    rows = []
    parts = {"all": counts.held, **dict(sorted(counts.held_by_src.items()))}
    for part, held in parts.items():
        cum = np.cumsum(held[order])
        total = held.sum()
        for n in sizes:
            if not 1 <= n <= order.size:
                raise VocabError(f"size {n} is outside [1, {order.size}]")
            rows.append(dict(list=label, src=part, n=int(n), coverage=float(cum[n - 1] / total) if total else math.nan,
                             heldout_tokens=int(total)))
    return rows


def curves(held: Counts, lists: dict[str, Counts], special: Sequence[int], sizes: Sequence[int]) -> list[dict]:
    """Coverage of `held`'s held-out records by the list counted from each of `lists` (ranked the same way)."""
    rows = []
    for label, counts in lists.items():
        for row in coverage_curve(rank(counts.counted, special), held, sizes, label=label):
            rows.append(row | dict(list_tokens=counts.tokens_counted, list_records=counts.records_counted,
                                   list_distinct=int((counts.counted > 0).sum())))
    return rows


def _resolve(paths: Sequence) -> list:
    return [generic_corpus_file() if str(p) == "generic" else p for p in paths]


def compare_lists(tokenizer: Any, vocab_size: int, own: Sequence[str | Path], references: dict[str, Sequence],
                  sizes: Sequence[int], *, progress: bool = True) -> list[dict]:
    """Held-out coverage curves of the model's own outputs (`own`), for the list counted from the rest of `own`
    ("own outputs") and for lists counted from each reference corpus the same way (hold-out included);
    a reference given as "generic" is `generic_corpus_file()`."""
    own_counts = count_corpus(own, tokenizer, vocab_size, progress=progress)
    lists = {"own outputs": own_counts} | {label: count_corpus(_resolve(paths), tokenizer, vocab_size,
                                                               progress=progress)
                                           for label, paths in references.items()}
    return curves(own_counts, lists, special_token_ids(tokenizer), sizes)


def coverage_study(tokenizer: Any, vocab_size: int, targets: dict[str, Sequence], references: dict[str, Sequence],
                   sizes: Sequence[int], *, progress: bool = True) -> list[dict]:
    """`compare_lists` for several targets' outputs at once (each corpus counted once): for every target, its own
    list, each reference list and the lists from the other targets' outputs, on its held-out records."""
    counted = {t: count_corpus(p, tokenizer, vocab_size, progress=progress) for t, p in targets.items()}
    refs = {label: count_corpus(_resolve(p), tokenizer, vocab_size, progress=progress)
            for label, p in references.items()}
    special = special_token_ids(tokenizer)
    rows = []
    for target, own in counted.items():
        lists = {"own outputs": own} | refs | {f"{other} outputs": c for other, c in counted.items() if other != target}
        rows += [r | {"target": target, "target_heldout_records": own.records_held} for r in
                 curves(own, lists, special, sizes)]
    return rows


def default_sizes(vocab_size: int) -> list[int]:
    """Sizes for the curve: powers of two from 1k and HyperQwen's 16k-64k steps scaled to this vocabulary."""
    sizes = {1 << k for k in range(10, 18)} | {round(vocab_size * f / 248_000 / 1024) * 1024
                                               for f in (16_384, 32_768, 49_152, 65_536)}
    return sorted(s for s in sizes if 0 < s < vocab_size)


# ----------------------------------------------------------------------------------------------------------------
# lm_head rows and the truncated head


# ----------------------------------------------------------------------------------------------------------------
# Artifacts


def artifact_bytes(ids: np.ndarray, head_rows: torch.Tensor, vocab_size: int, special: Sequence[int]) -> dict[str, bytes]:
    from safetensors.torch import save

    ids = np.asarray(ids, dtype=np.int64)
    if ids.ndim != 1 or ids.size == 0 or np.any(np.diff(ids) <= 0):
        raise VocabError("draft ids must be a non-empty, strictly increasing 1-D list")
    if head_rows.shape[0] != ids.size:
        raise VocabError(f"{head_rows.shape[0]} lm_head rows for {ids.size} ids")
    target_to_draft = torch.full((vocab_size,), -1, dtype=torch.long)
    draft_to_target = torch.from_numpy(ids.copy())
    target_to_draft[draft_to_target] = torch.arange(ids.size)
    ids_json = json.dumps({"ids": ids.tolist(), "vocab_size": int(vocab_size),
                           "special": [int(s) for s in special]}, separators=(",", ":")) + "\n"
    return {
        "ids.json": ids_json.encode(),
        "lm_head.safetensors": save({"weight": head_rows.contiguous()}),
        "mapping.safetensors": save({"draft_to_target": draft_to_target, "target_to_draft": target_to_draft}),
    }


# ----------------------------------------------------------------------------------------------------------------
# Build


@functools.lru_cache(maxsize=4)
def _folder_tokenizer(folder: Path) -> tuple[Any, int]:
    from transformers import AutoConfig, AutoTokenizer

    return AutoTokenizer.from_pretrained(folder), int(AutoConfig.from_pretrained(folder).vocab_size)


def model_files(model: str) -> tuple[Path, Any, int]:
    """(checkpoint folder, tokenizer, vocab size) for a model name, without loading the weights. The tokenizer
    is cached per folder (loading it takes seconds; repeated builds in one process reuse it)."""
    from hqlab import models

    target = Path(models.prepare(model))
    if not target.is_dir():
        raise VocabError(f"{model}: vocab build needs a local checkpoint folder (got {target}); download it first")
    return target, *_folder_tokenizer(target)


@dataclass
class BuildResult:
    folder: Path
    ids: np.ndarray
    coverage: dict[str, float]
    summary: dict[str, Any]
    write_points: list[str]


def _relative(p: str | Path) -> str:
    p = Path(p).resolve()
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return p.name


def build(model: str, corpus: Sequence[str | Path], size: int, out: str | Path, *, holdout: bool = True,
          progress: bool = True) -> BuildResult:
    """Count `corpus`, keep the top `size` ids, slice the lm_head rows and publish the artifacts to `out`.
    Everything is validated and computed before the first byte is published."""
    records = list(read_corpus(corpus))  # a malformed corpus fails here, before anything is written
    folder, tokenizer, vocab_size = model_files(model)
    if not 1 <= size <= vocab_size:
        raise VocabError(f"--size must be in [1, {vocab_size}] (got {size})")
    counts = count(records, tokenizer, vocab_size, holdout=holdout, progress=progress,
                   sources=[_relative(c) for c in corpus])
    special = special_token_ids(tokenizer)
    if len(special) > size:
        raise VocabError(f"--size {size} is smaller than the {len(special)} special tokens it must contain")
    order = rank(counts.counted, special)
    ids = top_n(order, size)
    cov = {"all": coverage(ids, counts.held)} | {s: coverage(ids, h) for s, h in sorted(counts.held_by_src.items())}
    rows = read_head_rows(folder, ids)
    files = artifact_bytes(ids, rows, vocab_size, special)
    meta = dict(model=str(model), size=int(size), vocab_size=vocab_size, holdout=holdout, dtype=str(rows.dtype).removeprefix("torch."),
                heldout_coverage=cov, n_special=len(special), ties="ascending id (BPE merge order)",
                **counts.summary())
    result = publish(out, files, meta)
    return BuildResult(Path(out), ids, cov, meta, result.write_points)


def heldout_prompt_ids(corpus: str | Path) -> list[str]:
    """Prompt ids whose answers a self-generated corpus holds out (record j % 10 == 0): evaluating a list on
    these prompts measures it on answers it was not counted from. Sample suffixes (`#n`) are dropped."""
    path = Path(corpus)
    records = read_corpus([path])  # validates the file
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    ids = [json.loads(lines[r.index]).get("id") for r in records if r.held_out]
    return list(dict.fromkeys(i.split("#")[0] for i in ids if isinstance(i, str)))


# ----------------------------------------------------------------------------------------------------------------
# The generic comparison corpus


def _stdlib_sources() -> list[tuple[str, Path]]:
    import sysconfig

    std = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "encodings", "lib2to3", "__pycache__", "pydoc_data"}
    return [(f"stdlib/{p.relative_to(std)}", p) for p in sorted(std.rglob("*.py"))
            if not skip & set(p.relative_to(std).parts)]


def _key(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()


def _pinned_distributions() -> list[Any]:
    """Installed distributions pinned in the repository's requirements.txt at exactly the pinned version: the
    same set on every clean install, whatever else an environment holds."""
    import importlib.metadata as md
    import re

    req = REPO / "requirements.txt"
    pins = dict(re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)", req.read_text(), re.M)) if req.exists() else {}
    found = []
    for name, version in sorted(pins.items(), key=lambda kv: kv[0].lower()):
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        if dist.version == version:
            found.append(dist)
    return found


def generic_records() -> list[dict[str, str]]:
    """The generic (not model-written) comparison corpus, from what a Python install has offline:
    prose = the long descriptions (READMEs: English prose with code snippets) of the pinned requirements and
    Python's own documentation topics (`pydoc_data`); code = the standard library's sources. Sampled by a hash of
    the name (deterministic), code capped at the size of the prose so both halves weigh alike."""
    prose: list[dict[str, str]] = []
    for dist in _pinned_distributions():
        body = (dist.metadata.get_payload() or dist.metadata.get("Description") or "").strip()
        if len(body) > 200:
            prose.append(dict(origin=f"pkg/{dist.metadata['Name']}=={dist.version}", src="prose", text=body))
    from pydoc_data.topics import topics

    for name in sorted(topics):
        if len(topics[name].strip()) > 200:
            prose.append(dict(origin=f"pydoc/{name}", src="prose", text=topics[name]))
    budget = sum(len(r["text"]) for r in prose)
    code: list[dict[str, str]] = []
    for origin, path in sorted(_stdlib_sources(), key=lambda x: _key(x[0])):
        text = path.read_text(encoding="utf-8", errors="replace")
        if budget <= 0:
            break
        if len(text.strip()) < 200:
            continue
        code.append(dict(origin=origin, src="code", text=text))
        budget -= len(text)
    return sorted(prose + code, key=lambda r: _key(r["origin"]))


def generic_corpus_file(cache_dir: str | Path | None = None) -> Path:
    """Write the generic corpus as JSONL once (keyed by Python version and content) and return its path; it is
    then read by the same corpus reader and counted the same way as the model's outputs."""
    from hqlab import models

    records = generic_records()
    payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    digest = sha256_bytes(payload.encode())[:12]
    folder = Path(cache_dir) if cache_dir else models.cache_root() / "corpora"
    path = folder / f"generic-py{sys.version_info.major}.{sys.version_info.minor}-{digest}.jsonl"
    if not path.exists():
        write_atomic(path, lambda tmp: tmp.write_text(payload, encoding="utf-8"))
    return path


# ----------------------------------------------------------------------------------------------------------------
# Draft latency vs N


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure_draft_latency(model: Any, sizes: Sequence[int], *, context: int = 512, repeats: int = 20,
                          warmup: int = 3, seed: int = 0) -> list[dict[str, Any]]:
    """Median time of one draft step (the body's forward of one token over a KV cache of `context` tokens, the
    head over N rows, argmax) and of the head alone, for each N in `sizes` plus the full vocabulary.

    Every round times each N once, in a new random order, so a slow spell of a shared machine spreads over all
    sizes instead of looking like a property of one."""
    import inspect
    import random

    from transformers import DynamicCache

    head = model.get_output_embeddings()
    device = head.weight.device
    vocab_size = head.weight.shape[0]
    body = model.get_decoder()
    cache_kw = "cache" if "cache" in inspect.signature(body.forward).parameters else "past_key_values"
    ns = sorted({*(int(s) for s in sizes), vocab_size})
    bad = [n for n in ns if not 1 <= n <= vocab_size]
    if bad:
        raise VocabError(f"latency sizes {bad} are outside [1, {vocab_size}]")
    heads = {n: sliced_lm_head(model, torch.arange(n)) if n < vocab_size else head for n in ns}
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab_size - 1000, (1, context), generator=gen).to(device)
    cache = DynamicCache(config=model.config)
    body(input_ids=prompt, use_cache=True, **{cache_kw: cache})
    token = prompt[:, -1:]
    step: dict[int, list[float]] = {n: [] for n in ns}
    head_only: dict[int, list[float]] = {n: [] for n in ns}
    rng = random.Random(seed)
    for i in range(warmup + repeats):
        for n in rng.sample(ns, len(ns)):
            _sync(device)
            t0 = time.perf_counter()
            hidden = body(input_ids=token, use_cache=True, **{cache_kw: cache}).last_hidden_state[:, -1]
            heads[n](hidden).argmax(-1)
            _sync(device)
            t1 = time.perf_counter()
            heads[n](hidden).argmax(-1)
            _sync(device)
            t2 = time.perf_counter()
            cache.crop(-(cache.get_seq_length() - context))  # negative: "remove that many" in every 5.x release
            if i >= warmup:
                step[n].append(t1 - t0)
                head_only[n].append(t2 - t1)
    dtype = str(head.weight.dtype).removeprefix("torch.")
    return [dict(n=n, full=n == vocab_size, context=context, repeats=repeats, dtype=dtype,
                 step_ms=1e3 * float(np.median(step[n])), head_ms=1e3 * float(np.median(head_only[n])))
            for n in ns]
