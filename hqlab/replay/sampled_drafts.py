"""What a drafter's token is worth under sampling, from the target's and the drafter's logits at the same positions.

At a position where the target samples from p = softmax(target / T):

- a greedy draft (the drafter's argmax x*, verified as a point mass, what `gpu-fused` proposes by default) is
  accepted with probability p(x*);
- a sampled draft (x drawn from q = softmax(drafter / T), verified against q: `gpu-fused`'s
  `draft_sample=probabilistic`) is accepted with probability sum_x min(p(x), q(x)) = 1 - TV(p, q)
  (Leviathan et al., 2023);
- under greedy decoding (T = 0) the draft is accepted iff argmax p = argmax q.

A drafter drawn at another temperature than the request's (q' = softmax(drafter / T'), verified against q') is
accepted with 1 - TV(p, q'): `draft_temperature` measures whether tempering the drafter brings it closer to the
target (on the 1.5B/0.5B pair it does not, by more than a few thousandths: docs/serving.md).

Over the target's own sampled output (what a lossless engine emits), the mean of each is the acceptance of the
drafter's first head token at a step, the whole of what a one-token head (`draft_block=1`) adds to a step where the
lookup proposes nothing. `experiments/drawn_draft_heads/draft_sampling_cpu.py` measures it with the real models.
"""

from __future__ import annotations

import numpy as np
import torch

COLUMNS = ("greedy_draft", "sampled_draft", "argmax_agree", "target_top")


def acceptance(target_logits: torch.Tensor, draft_logits: torch.Tensor, temperature: float,
               draft_temperature: float | None = None) -> dict[str, np.ndarray]:
    """Per position (rows of [n, V] logits; the vocabularies are cut to the shorter one): the acceptance of a greedy
    draft, of a sampled draft, whether the argmaxes agree, and the target's top probability, at `temperature` > 0.
    The sampled draft is drawn at `draft_temperature` (default: `temperature`, what `gpu-fused` does)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (got {temperature}); at 0 only argmax_agree is defined")
    draft_temperature = temperature if draft_temperature is None else draft_temperature
    if draft_temperature <= 0:
        raise ValueError(f"draft_temperature must be > 0 (got {draft_temperature}): a drafter at 0 is the greedy draft")
    if target_logits.shape[0] != draft_logits.shape[0]:
        raise ValueError(f"target and draft logits need the same positions, got {target_logits.shape[0]} and "
                         f"{draft_logits.shape[0]}")
    v = min(target_logits.shape[-1], draft_logits.shape[-1])
    t, d = target_logits[:, :v].double(), draft_logits[:, :v].double()
    p, q = torch.softmax(t / temperature, -1), torch.softmax(d / draft_temperature, -1)
    top = d.argmax(-1)
    return {"greedy_draft": p.gather(1, top[:, None])[:, 0].numpy(),
            "sampled_draft": torch.minimum(p, q).sum(-1).numpy(),
            "argmax_agree": (t.argmax(-1) == top).numpy(),
            "target_top": p.max(-1).values.numpy()}


def draft_temperature_summary(rows: "pl.DataFrame") -> "pl.DataFrame":
    """Rows of the benchmark's `--draft-scales` file -> one row per (dataset, temperature, draft_scale): the mean
    acceptance of a draft drawn at temperature x draft_scale, and its gain over draft_scale 1 (the default)."""
    import polars as pl

    if not (rows["draft_scale"] == 1.0).any():
        raise ValueError("the rows need draft_scale 1.0 (the default the others are compared with)")
    means = rows.group_by("dataset", "temperature", "draft_scale").agg(acceptance=pl.col("sampled_draft").mean(),
                                                                       positions=pl.len())
    base = means.filter(pl.col("draft_scale") == 1.0).select("dataset", "temperature", base=pl.col("acceptance"))
    return means.join(base, on=["dataset", "temperature"]).with_columns(
        gain=pl.col("acceptance") - pl.col("base")).drop("base").sort("dataset", "temperature", "draft_scale")


def head_summary(rows: "pl.DataFrame", *, resamples: int = 2000, seed: int = 0) -> "pl.DataFrame":
    """Rows of `experiments/drawn_draft_heads/drawn_heads_cpu.py` (one per config, prompt and verify step; `head`,
    `draft` greedy or drawn, `prompt`, `accepted`) -> one row per head: tokens a step (accepted + 1, over all steps) of
    the greedy and the drawn drafts, their ratio, and its 95 % range by resampling prompts (both drafts' steps of a
    drawn prompt together: they decoded the same prompts)."""
    import polars as pl

    missing = {"head", "draft", "prompt", "accepted"} - set(rows.columns)
    if missing:
        raise ValueError(f"rows lack the columns {sorted(missing)} (experiments/drawn_draft_heads/drawn_heads_cpu.py "
                         "writes them)")
    per = rows.group_by("head", "draft", "prompt").agg(tokens=(pl.col("accepted") + 1).sum(), steps=pl.len())
    rng = np.random.default_rng(seed)
    out = []
    for head in sorted(per["head"].unique().to_list()):
        sums = {}
        for draft in ("greedy", "drawn"):
            d = per.filter((pl.col("head") == head) & (pl.col("draft") == draft))
            sums[draft] = dict(zip(d["prompt"].to_list(), zip(d["tokens"].to_list(), d["steps"].to_list())))
        prompts = sorted(set(sums["greedy"]) & set(sums["drawn"]))
        if not prompts:
            raise ValueError(f"head {head}: no prompt decoded with both greedy and drawn drafts")
        arr = {k: np.array([sums[k][p] for p in prompts], dtype=float) for k in sums}  # [prompts, (tokens, steps)]

        def tps(a: np.ndarray, idx: np.ndarray | slice) -> np.ndarray:
            return a[idx, 0].sum(-1) / a[idx, 1].sum(-1)

        idx = rng.integers(0, len(prompts), size=(resamples, len(prompts)))
        ratios = tps(arr["drawn"], idx) / tps(arr["greedy"], idx)
        greedy, drawn = float(tps(arr["greedy"], slice(None))), float(tps(arr["drawn"], slice(None)))
        out.append({"head": head, "greedy": greedy, "drawn": drawn, "ratio": drawn / greedy,
                    "ratio_lo": float(np.percentile(ratios, 2.5)), "ratio_hi": float(np.percentile(ratios, 97.5)),
                    "prompts": len(prompts)})
    return pl.DataFrame(out)


def project_heads(heads: "pl.DataFrame", b1_speedup: float, head_speed: dict[int, float]) -> "pl.DataFrame":
    """`head_summary` rows -> the drawn heads' projected speedup over `none`: a measured greedy one-token head's
    speedup, times what a greedy head of that length ran against the one-token head (`head_speed`, measured on the
    GPU; 1 for head 1), times the drawn/greedy tokens-a-step ratio (the same step, more tokens). Columns projected,
    projected_lo, projected_hi."""
    import polars as pl

    if missing := sorted(set(heads["head"].to_list()) - set(head_speed)):
        raise ValueError(f"no measured speed for heads {missing} (head_speed has {sorted(head_speed)})")
    scale = pl.col("head").replace_strict(head_speed, return_dtype=pl.Float64) * b1_speedup
    return heads.with_columns(projected=scale * pl.col("ratio"), projected_lo=scale * pl.col("ratio_lo"),
                              projected_hi=scale * pl.col("ratio_hi"))


def head_speeds(serve_rows: "pl.DataFrame", run: str, *, dataset: str = "prose",
                temperature: float = 0.7) -> dict[int, float]:
    """From a serving run's rows (data/results/serve/<run>/rows.parquet), one request at a time on `dataset` at
    `temperature`: each greedy-draft `gpu-fused` head length's output throughput over the one-token head's (medians
    over repeats), keyed by head length (`draft_block`; a config that names none has the default's)."""
    import polars as pl

    from hqlab.config import parse_spec
    from hqlab.proposers.fused import FusedConfig

    rows = serve_rows.filter((pl.col("run") == run) & (pl.col("dataset") == dataset)
                             & (pl.col("temperature") == temperature) & (pl.col("max_concurrency") == 1))
    speed: dict[int, list[float]] = {}
    for config, tput in zip(rows["config"].to_list(), rows["output_throughput"].to_list()):
        name, values = parse_spec(config)
        if name != "gpu-fused" or values.get("draft_sample", "greedy") != "greedy":
            continue
        speed.setdefault(int(values.get("draft_block", FusedConfig.draft_block)), []).append(tput)
    if 1 not in speed:
        raise ValueError(f"run {run!r} has no greedy-draft gpu-fused with a one-token head on {dataset} at "
                         f"T={temperature}, one request at a time")
    base = float(np.median(speed[1]))
    return {head: float(np.median(v)) / base for head, v in sorted(speed.items())}


def summary(rows: "pl.DataFrame") -> "pl.DataFrame":
    """Rows of `experiments/drawn_draft_heads/draft_sampling_cpu.py` -> one row per (dataset, temperature, draft): the
    mean acceptance over answer positions ("draft" is "greedy" or "sampled"), the lowest and highest prompt mean, and
    the prompts."""
    import polars as pl

    per_prompt = rows.group_by("dataset", "temperature", "prompt").agg(
        greedy=pl.col("greedy_draft").mean(), sampled=pl.col("sampled_draft").mean(), positions=pl.len())
    long = per_prompt.unpivot(["greedy", "sampled"], index=["dataset", "temperature", "prompt", "positions"],
                              variable_name="draft", value_name="acceptance")
    means = rows.unpivot(["greedy_draft", "sampled_draft"], index=["dataset", "temperature"],
                         variable_name="draft", value_name="acceptance").with_columns(
        pl.col("draft").str.replace("_draft", "")).group_by("dataset", "temperature", "draft").agg(
        acceptance=pl.col("acceptance").mean())
    spread = long.group_by("dataset", "temperature", "draft").agg(
        lowest=pl.col("acceptance").min(), highest=pl.col("acceptance").max(), prompts=pl.len())
    return means.join(spread, on=["dataset", "temperature", "draft"]).sort("dataset", "temperature", "draft")


def projected_speedup(speedup: float, tokens_per_step: float, gain: float) -> float:
    """A measured speedup ÷ `none` at `tokens_per_step`, with each step emitting `gain` more tokens at the same step
    cost (a one-token head: the sampled draft's acceptance minus the greedy one's)."""
    if tokens_per_step <= 0:
        raise ValueError(f"tokens_per_step must be > 0 (got {tokens_per_step})")
    return speedup * (tokens_per_step + gain) / tokens_per_step


__all__ = ["COLUMNS", "acceptance", "draft_temperature_summary", "head_speeds", "head_summary", "project_heads",
           "summary", "projected_speedup"]
