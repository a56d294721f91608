"""Benchmark results as tables and figures: per-class summaries, per-position acceptance, and the core and fusion
benchmarks' figures (their names too, so the docs check can tell which notebook writes which figure)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import polars as pl

from hqlab.trace import acceptance_curve


def summarize(results: pl.DataFrame) -> pl.DataFrame:
    """Per (category, config): medians over prompts of tokens/step, decode tok/s and speedup; lossless count."""
    return (results.group_by(["category", "config"], maintain_order=True)
            .agg(pl.len().alias("prompts"),
                 pl.col("tokens_per_step").median().round(2),
                 pl.col("decode_tok_s").median().round(2),
                 pl.col("speedup_e2e").median().round(2),
                 pl.col("propose_ms_per_step").median().round(3),
                 pl.col("verify_ms_per_step").median().round(1),
                 (pl.col("divergence") == "identical").sum().alias("identical"),
                 (pl.col("divergence") == "near-tie").sum().alias("near_ties"),
                 (pl.col("divergence") == "mismatch").sum().alias("mismatches")))


def acceptance_by_position(steps: pl.DataFrame) -> pl.DataFrame:
    """Per (category, config, position): share of drafts that accepted more than `position` tokens."""
    out = []
    for (category, config), group in steps.group_by(["category", "config"], maintain_order=True):
        drafts = group.filter(pl.col("proposed").list.len() > 0)
        if drafts.height == 0:
            continue
        curve = acceptance_curve(drafts["accepted"].to_numpy(), int(drafts["proposed"].list.len().max()))
        out.extend({"category": category, "config": config, "position": i + 1, "acceptance": float(a)}
                   for i, a in enumerate(curve))
    # typed even when no config drafted (a plot of it then says so instead of failing on unknown columns)
    return pl.DataFrame(out, schema={"category": pl.String, "config": pl.String, "position": pl.Int64,
                                     "acceptance": pl.Float64})


# The core benchmark's figures by kind: `core_figures` writes the first three, the notebook the rest.
CORE_FIGURE_KINDS = ("speedup", "tokens_per_step", "step_time", "decode_tok_s", "acceptance_by_position",
                     "acceptance_hist")


def core_figure_names(tag: str, kinds: Sequence[str] = CORE_FIGURE_KINDS) -> list[str]:
    """Figures the core benchmark notebook writes for a results tag (all kinds by default)."""
    return [f"core_{tag}_{kind}.svg" for kind in kinds]


def fusion_figure_names(tag: str) -> dict[str, str]:
    """Figures the fusion benchmark notebook writes for a results tag, by kind."""
    return {kind: f"fusion_{tag}_{kind}.svg" for kind in ("tps", "speedup", "time", "batch")}


def core_figures(results: pl.DataFrame, tag: str, fig_dir: Path) -> list[Path]:
    """The core benchmark's three figures: wall-time speedup, tokens/step, and where a step's time goes."""
    from hqlab import plots

    per_cat = results.group_by(["category", "config"], maintain_order=True).agg(
        pl.col("speedup_e2e").median(), pl.col("tokens_per_step").median(),
        pl.col("propose_ms_per_step").median().alias("propose"),
        pl.col("verify_ms_per_step").median().alias("verify"))
    paths = [fig_dir / name for name in core_figure_names(tag, ("speedup", "tokens_per_step", "step_time"))]
    plots.save(plots.grouped_bars(per_cat, "category", "speedup_e2e", "config", rule_at=1.0,
                                  y_title="wall-time speedup over no speculation"), paths[0])
    plots.save(plots.grouped_bars(per_cat, "category", "tokens_per_step", "config", rule_at=1.0,
                                  y_title="tokens per verify step"), paths[1])
    plots.save(plots.stacked_time(per_cat.select("category", "config", "propose", "verify"), "config",
                                  ["propose", "verify"], facet="category"), paths[2])
    return paths
