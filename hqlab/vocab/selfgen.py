"""Self-generation: the target model answers a diverse prompt set, giving the corpus its draft vocabulary is
counted from (SPEC §2.7: a list built from the model's own outputs covers what it emits far better than web text).

The output is a JSONL file with one record per answer, `{id, src, prompt_ids, output_ids, finish}`, appended a
batch at a time (flushed and fsync'd). A run is resumable: ids already in the file are skipped, and a last line
cut short by a killed run is dropped before appending. A sidecar `<out>.meta.json` records the model and the
sampling settings; resuming with different ones is refused, so one file never mixes two models.

Sampling is the model's default: `generation_config.json` (temperature, top_p, top_k, repetition penalty). A GGUF
conversion carries no sampling settings; for Qwen2 models hqlab then uses the values the Qwen2.5-Coder-Instruct
checkpoints publish (`QWEN_INSTRUCT_SAMPLING`) and says so in the metadata. Batches are decoded with
transformers' `generate` over left-padded prompts (the speed that matters on a GPU).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from hqlab.config import ConfigError
from hqlab.io import REPO, write_atomic
from hqlab.workloads import Prompt, encode_chat, read_jsonl

DEFAULT_PROMPTS = REPO / "data" / "prompts" / "selfgen.jsonl"


class SelfgenError(ValueError):
    """A corpus file or its metadata cannot be resumed; the message names the file (and line) and what to do."""


@dataclass(frozen=True)
class Sampling:
    """Sampling settings; `source` says where they came from (kept in the corpus metadata)."""

    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    source: str

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ConfigError(f"sampling temperature must be > 0 (got {self.temperature}); self-generation samples")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, 0 meaning off (got {self.top_k})")
        if not self.repetition_penalty > 0:
            raise ConfigError(f"repetition_penalty must be > 0 (got {self.repetition_penalty})")

    def generate_kwargs(self) -> dict[str, Any]:
        return dict(do_sample=True, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k or None,
                    repetition_penalty=self.repetition_penalty)


# generation_config.json of the Qwen2.5-Coder-Instruct checkpoints; GGUF files do not carry it.
QWEN_INSTRUCT_SAMPLING = dict(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.1)


def model_sampling(model: Any) -> Sampling:
    """The model's default sampling: its generation config when that samples, else the Qwen instruct defaults
    for Qwen2 models (GGUF conversions), else transformers' defaults for sampling (temperature 1, no top-p/k)."""
    gen = getattr(model, "generation_config", None)
    if gen is not None and getattr(gen, "do_sample", False):
        return Sampling(temperature=float(gen.temperature or 1.0), top_p=float(gen.top_p or 1.0),
                        top_k=int(gen.top_k or 0), repetition_penalty=float(gen.repetition_penalty or 1.0),
                        source="generation_config")
    if getattr(model.config, "model_type", "") == "qwen2":
        return Sampling(**QWEN_INSTRUCT_SAMPLING, source="qwen2.5-coder-instruct defaults (not in the model folder)")
    return Sampling(temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0, source="transformers defaults")


@dataclass(frozen=True)
class Job:
    """One record to generate: prompt `prompt` answered for the `sample`-th time."""

    id: str
    prompt: Prompt
    sample: int


def plan(prompts: Sequence[Prompt], n_records: int) -> list[Job]:
    """`n_records` jobs cycling through the prompts: the first pass answers each prompt once (ids are the prompt
    ids), later passes sample again (ids `<prompt id>#<pass>`), so a big corpus can come from a few hundred
    prompts and a small run still covers every category."""
    if n_records < 1:
        raise ConfigError(f"n_records must be >= 1 (got {n_records})")
    if not prompts:
        raise ConfigError("no prompts")
    jobs = []
    for j in range(n_records):
        p, sample = prompts[j % len(prompts)], j // len(prompts)
        jobs.append(Job(p.id if sample == 0 else f"{p.id}#{sample}", p, sample))
    return jobs


# ----------------------------------------------------------------------------------------------------------------
# The corpus file: append-only JSONL, resumable


def read_done(path: Path, *, repair: bool = True) -> dict[str, int]:
    """Ids already in the corpus file, with their line numbers. A last line without its newline (a run killed
    while appending) is cut off when `repair` is set; any other bad line is an error naming file and line."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        if not repair:
            raise SelfgenError(f"{path}: the last line is incomplete (a killed run); resume to repair it")
        with open(path, "rb+") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
        data = data[:end]
    done: dict[str, int] = {}
    for lineno, line in enumerate(data.decode("utf-8", errors="strict").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise SelfgenError(f"{path}:{lineno}: invalid JSON ({e.msg}); not a self-generation corpus?") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("id"), str) or \
                not isinstance(rec.get("output_ids"), list):
            raise SelfgenError(f"{path}:{lineno}: not a self-generation record (needs string 'id' and list "
                               f"'output_ids')")
        if rec["id"] in done:
            raise SelfgenError(f"{path}:{lineno}: id {rec['id']!r} already on line {done[rec['id']]}")
        done[rec["id"]] = lineno
    return done


def _meta_path(out: Path) -> Path:
    return out.with_name(out.name + ".meta.json")


def check_or_write_meta(out: Path, meta: dict[str, Any]) -> None:
    """Refuse to append to a corpus made by another model or with other sampling/length settings."""
    path = _meta_path(out)
    if path.exists():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise SelfgenError(f"{path}: unreadable corpus metadata ({e}); move it away to start a new corpus")
        keys = ("model", "sampling", "max_new_tokens", "seed")
        diff = [k for k in keys if old.get(k) != meta.get(k)]
        if diff:
            raise SelfgenError(
                f"{out} was generated with different settings ({', '.join(f'{k}: {old.get(k)!r} now {meta.get(k)!r}' for k in diff)}); "
                f"write to another output path or pass the same settings")
        return
    if out.exists() and out.stat().st_size:
        raise SelfgenError(f"{out} exists without its metadata file {path.name}; not a corpus this tool wrote")
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8"))


def _append(out: Path, records: list[dict[str, Any]]) -> None:
    with open(out, "a", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        f.flush()
        os.fsync(f.fileno())


# ----------------------------------------------------------------------------------------------------------------
# Generation


def _batch_seed(seed: int, ids: Sequence[str]) -> int:
    h = hashlib.sha256(f"{seed}:{ids[0]}:{len(ids)}".encode()).digest()
    return int.from_bytes(h[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def generate_batch(model: Any, prompt_ids: list[list[int]], *, pad_id: int, eos_ids: Sequence[int],
                   max_new_tokens: int, sampling: Sampling, seed: int) -> list[tuple[list[int], str]]:
    """Sample answers for a batch of prompts (left-padded); returns (output ids, finish) per prompt, the output
    cut after its first EOS ("eos") or at `max_new_tokens` ("length")."""
    import torch

    device = next(model.parameters()).device
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompt_ids):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    torch.manual_seed(seed)
    with torch.inference_mode():
        seq = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                             eos_token_id=list(eos_ids), pad_token_id=pad_id, **sampling.generate_kwargs())
    eos = set(eos_ids)
    results = []
    for row in seq[:, width:].tolist():
        out: list[int] = []
        finish = "length"
        for tok in row:
            out.append(tok)
            if tok in eos:
                finish = "eos"
                break
        results.append((out[:max_new_tokens], finish))
    return results


@dataclass
class SelfgenSummary:
    out: str
    planned: int
    skipped: int  # already in the file
    written: int
    new_tokens: int
    seconds: float

    @property
    def tok_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("nan")


def run(model: Any, tokenizer: Any, prompts: Sequence[Prompt], out: str | Path, *, n_records: int,
        batch_size: int = 8, max_new_tokens: int = 512, sampling: Sampling | None = None, seed: int = 0,
        model_name: str = "", eos_ids: Sequence[int] | None = None, progress: bool = True) -> SelfgenSummary:
    """Generate `n_records` records into `out` (JSONL), skipping ids already there."""
    from tqdm.auto import tqdm

    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1 (got {batch_size})")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
    out = Path(out)
    if out.suffix != ".jsonl":
        raise ConfigError(f"the corpus file must end in .jsonl (got {out.name})")
    out.parent.mkdir(parents=True, exist_ok=True)
    sampling = sampling or model_sampling(model)
    if eos_ids is None:
        eos = getattr(model.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
        eos_ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    meta = dict(model=model_name or getattr(model.config, "_name_or_path", ""), sampling=asdict(sampling),
                max_new_tokens=max_new_tokens, seed=seed)
    check_or_write_meta(out, meta)
    done = read_done(out)
    jobs = plan(prompts, n_records)
    todo = [j for j in jobs if j.id not in done]
    summary = SelfgenSummary(str(out), len(jobs), len(jobs) - len(todo), 0, 0, 0.0)
    t0 = time.perf_counter()
    bar = tqdm(total=len(todo), desc=f"selfgen {out.name}", unit="rec", disable=not progress)
    for start in range(0, len(todo), batch_size):
        batch = todo[start:start + batch_size]
        prompt_ids = [encode_chat(tokenizer, j.prompt.messages) for j in batch]
        answers = generate_batch(model, prompt_ids, pad_id=pad_id, eos_ids=eos_ids, max_new_tokens=max_new_tokens,
                                 sampling=sampling, seed=_batch_seed(seed, [j.id for j in batch]))
        records = [dict(id=j.id, src=j.prompt.category, prompt_ids=p, output_ids=o, finish=f)
                   for j, p, (o, f) in zip(batch, prompt_ids, answers)]
        _append(out, records)
        summary.written += len(records)
        summary.new_tokens += sum(len(r["output_ids"]) for r in records)
        summary.seconds = time.perf_counter() - t0
        bar.update(len(records))
        bar.set_postfix(tok_s=f"{summary.tok_s:.1f}")
    bar.close()
    summary.seconds = time.perf_counter() - t0
    return summary


def load_prompts(path: str | Path | None = None) -> list[Prompt]:
    """The built-in prompt set (chat, code, math; short and long answers) or a JSONL file in the workload format."""
    return read_jsonl(Path(path) if path else DEFAULT_PROMPTS)
