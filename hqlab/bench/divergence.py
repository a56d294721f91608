"""Where two greedy answers to the same prompt part, and whether the model itself calls that place a near tie.

Two engines (or two runs of one) that compute the same model may round differently, and at a near tie of the top
two logits either token is "the argmax". To tell such a flip from a wrong computation, the model is teacher-forced
over the prompt and the answers' shared prefix, and its logits at the first divergent position are read: a flip is
a *near tie* where both tokens lie within `tol` of the top logit there (so each could be the argmax under rounding
of that size), a *mismatch* otherwise. `margin` is the logit of answer a's token minus that of b's.

The reference model is whatever is passed in (the tests use the 0.5B in fp32 on a CPU; a finished corpus run is
checked with the 1.5B in fp32, `python -m hqlab.bench.corpus_report --run NAME [--against RUN]`): a third
computation, independent of both engines' kernels. Answers are lists of token ids without the prompt; a pair whose shorter answer is a prefix of the longer one (one stopped where the other went on, with
no token to compare) is a mismatch, as in `hqlab.bench.lossless.compare`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Sequence

from hqlab.bench.lossless import NEAR_TIE_TOL

TOL = NEAR_TIE_TOL["bfloat16"]  # the engines compared here compute in bf16


@dataclass(frozen=True)
class Divergence:
    verdict: str  # "identical" | "near-tie" | "mismatch"
    position: int | None = None  # index into the answers of their first differing token
    token_a: int | None = None
    token_b: int | None = None
    logit_a: float | None = None
    logit_b: float | None = None
    margin: float | None = None  # logit_a - logit_b
    argmax: int | None = None  # the reference model's argmax there
    top_logit: float | None = None

    @property
    def lossless(self) -> bool:
        return self.verdict != "mismatch"


COLUMNS = tuple(f.name for f in fields(Divergence))


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where the answers differ (the shorter one's length where one is a prefix of the other),
    None where they are the same tokens."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else n


def verdict(logit_a: float, logit_b: float, top_logit: float, tol: float = TOL) -> str:
    """near-tie where both tokens lie within `tol` of the top logit, else mismatch."""
    return "near-tie" if top_logit - min(logit_a, logit_b) <= tol else "mismatch"


def _hosts(contexts: list[tuple[int, ...]]) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Each context -> the longest context it is a prefix of, so that one forward pass reads them all."""
    hosts: list[tuple[int, ...]] = []
    found = {}
    for ctx in sorted(set(contexts), key=len, reverse=True):
        host = next((h for h in hosts if h[: len(ctx)] == ctx), None)
        if host is None:
            hosts.append(ctx)
            host = ctx
        found[ctx] = host
    return found


def divergences(model: Any, pairs: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]],
                tol: float = TOL) -> list[Divergence]:
    """One `Divergence` per (prompt_ids, answer_a, answer_b), in order. `model` is a causal LM of transformers (its
    forward takes `input_ids` and `logits_to_keep`); logits are read in its own dtype, compared in float32. Pairs
    whose contexts (prompt + shared prefix) are prefixes of one another share one forward pass."""
    import torch

    parted = {}
    for i, (prompt, a, b) in enumerate(pairs):
        pos = first_divergence(a, b)
        if pos is not None:
            parted[i] = (tuple(int(t) for t in prompt) + tuple(int(t) for t in a[:pos]), pos)
    if any(not pairs[i][0] for i in parted):
        raise ValueError("a pair with an empty prompt: the first answer token has no logits to read")
    hosts = _hosts([ctx for ctx, _ in parted.values()])
    rows: dict[tuple[int, ...], Any] = {}  # context -> its logits row (float32)
    device = next(model.parameters()).device
    with torch.inference_mode():
        for host in dict.fromkeys(hosts.values()):
            needed = sorted({len(ctx) - 1 for ctx, host_of in hosts.items() if host_of == host})
            out = model(input_ids=torch.tensor([host], device=device),
                        logits_to_keep=torch.tensor(needed, device=device)).logits[0].float().cpu()
            for row, at in zip(out, needed):
                rows[host[: at + 1]] = row
    found = []
    for i, (_, a, b) in enumerate(pairs):
        if i not in parted:
            found.append(Divergence("identical"))
            continue
        ctx, pos = parted[i]
        found.append(_read(rows[ctx], a, b, pos, tol))
    return found


def _read(row: Any, a: Sequence[int], b: Sequence[int], pos: int, tol: float) -> Divergence:
    token_a = int(a[pos]) if pos < len(a) else None
    token_b = int(b[pos]) if pos < len(b) else None
    top = int(row.argmax())
    logit_a = float(row[token_a]) if token_a is not None else None
    logit_b = float(row[token_b]) if token_b is not None else None
    if logit_a is None or logit_b is None:  # one answer stopped where the other went on
        return Divergence("mismatch", pos, token_a, token_b, logit_a, logit_b, None, top, float(row[top]))
    return Divergence(verdict(logit_a, logit_b, float(row[top]), tol), pos, token_a, token_b, logit_a, logit_b,
                      logit_a - logit_b, top, float(row[top]))


def divergence_table(model: Any, pairs: Any, tol: float = TOL) -> Any:
    """`pairs` (a polars frame with `prompt_ids`, `a` and `b`, lists of token ids, and any key columns) -> its key
    columns and one `Divergence` per row (COLUMNS), identical pairs included (their other columns null)."""
    import polars as pl

    found = divergences(model, list(zip(pairs["prompt_ids"].to_list(), pairs["a"].to_list(), pairs["b"].to_list())),
                        tol=tol)
    schema = {"verdict": pl.String, "position": pl.Int64, "token_a": pl.Int64, "token_b": pl.Int64,
              "logit_a": pl.Float64, "logit_b": pl.Float64, "margin": pl.Float64, "argmax": pl.Int64,
              "top_logit": pl.Float64}
    table = pl.DataFrame([asdict(d) for d in found], schema=schema)
    return pl.concat([pairs.drop("prompt_ids", "a", "b"), table], how="horizontal")


def answer_pairs(a: Any, b: Any, key: Sequence[str] = ("request", "repeat"), carry: Sequence[str] = (),
                 **labels: str) -> Any:
    """Requests (polars frames with `prompt_ids`, `output_ids` and the `key` columns) of two runs, configs or repeats
    joined one to one on `key`: the keys, b's `carry` columns, a literal column per `labels` item, then
    `prompt_ids`, `a` and `b` (`divergence_table`'s input). The paired prompts must be the same token ids."""
    import polars as pl

    left = a.select(*key, pl.col("prompt_ids").alias("_prompt_a"), pl.col("output_ids").alias("a"))
    right = b.select(*key, *carry, "prompt_ids", pl.col("output_ids").alias("b"))
    joined = right.join(left, on=list(key), how="inner")
    if joined.height != right.height or joined.height != left.height:
        raise ValueError(f"the two sides do not pair one to one on {list(key)}: {left.height} and {right.height} rows,"
                         f" {joined.height} joined")
    if (joined["prompt_ids"] != joined["_prompt_a"]).any():
        raise ValueError("paired requests with different prompts")
    return joined.select(*key, *carry, *(pl.lit(v).alias(k) for k, v in labels.items()), "prompt_ids", "a", "b")

