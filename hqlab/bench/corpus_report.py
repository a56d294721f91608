"""Reading the vLLM corpus runs (benchmarks/vllm_corpus.py `finish`: under data/results/corpus/<run>/ the rows, one
per point, and the requests, one row per request): the corpus's speedup over the same lookup without it, per
workload and load, against issue #42's bar; and how often greedy outputs differ from `none`'s. The corpus notebook
plots these, docs/corpus.md quotes them, and each run's claims.json states what they give on that run.

Every ratio is taken inside one repeat (the configs of a workload and load run seconds apart), then summarised over
the repeats: their median and range.
"""

from __future__ import annotations

from typing import Any, Sequence

import polars as pl

from hqlab.config import parse_spec

# Issue #42's acceptance: the corpus config's decode tok/s over the same config without the corpus, at one request
# and at 8 in flight. The agent workload has no bar.
BAR = {"multiturn": 1.3, "template": 1.3, "prose": 0.97}
# workloads held to another's bar in `speedups` (not in the replay sweep, which never ran them): the batch job is the
# template's instruction over the whole handbook, the records job another instruction of its kind
BAR_AS = {"batch": "template", "records": "template"}


def has_corpus(config: str) -> bool:
    return config != "none" and any(k.startswith("corpus") for k in parse_spec(config)[1])


def without_corpus(config: str, labels: set[str] | list[str]) -> str | None:
    """The label among `labels` that is `config` without its corpus keys (None: no corpus, or no such label)."""
    if not has_corpus(config):
        return None
    name, values = parse_spec(config)
    want = (name, {k: v for k, v in values.items() if not k.startswith("corpus")})
    return next((x for x in sorted(labels) if x != "none" and parse_spec(x) == want), None)


def corpus_pairs(configs: list[str]) -> dict[str, str]:
    """Each config with a corpus among `configs` -> the same config without it, where that one is among them too."""
    return {c: b for c in configs if (b := without_corpus(c, configs)) is not None}


def label(config: str) -> str:
    """A `gpu-lookup` config in a few words for a legend, its settings as the speculator reads them (defaults
    included): "k=15, corpus 32768 longest, prompts", or "k=15" without a corpus."""
    from hqlab.engines.vllm.gpu_lookup import lookup_config

    c = lookup_config(config)
    if not c.corpus:
        return f"k={c.k}"
    return f"k={c.k}, corpus {c.corpus} {c.corpus_policy}, {'prompts' if c.corpus_prompts else 'outputs only'}"


def speedups(points: pl.DataFrame) -> pl.DataFrame:
    """One row per (run, config with a corpus, workload, load): medians over repeats of the decode tok/s of `none`,
    of the config without its corpus (`base_tok_s`) and with it (`tok_s`); the ratio with / without per repeat,
    as median, min and max (`vs_no_corpus`, `_lo`, `_hi`); `vs_none` (median); tokens per step without and with;
    the share of steps the corpus drafted; `replay_exact` (the replay predicted every step of both configs at every
    repeat); the number of repeats; the issue's `bar` and whether the median `meets` it (null: no bar)."""
    pairs = corpus_pairs(points["config"].unique().to_list())
    key = ["run", "workload", "load", "repeat"]
    corpus = points.filter(pl.col("config").is_in(list(pairs))).with_columns(
        pl.col("config").replace_strict(pairs).alias("base_config"))
    base = points.select(*key, pl.col("config").alias("base_config"), pl.col("decode_tok_s").alias("base_tok_s"),
                         pl.col("tokens_per_step").alias("base_tokens_per_step"),
                         pl.col("replay_exact").alias("base_exact"))
    none = points.filter(pl.col("config") == "none").select(*key, pl.col("decode_tok_s").alias("none_tok_s"))
    joined = (corpus.join(base, on=[*key, "base_config"], how="left").join(none, on=key, how="left")
              .with_columns((pl.col("decode_tok_s") / pl.col("base_tok_s")).alias("ratio"),
                            (pl.col("decode_tok_s") / pl.col("none_tok_s")).alias("ratio_none")))
    out = (joined.group_by("run", "config", "base_config", "workload", "load")
           .agg(pl.col("none_tok_s").median(), pl.col("base_tok_s").median(),
                pl.col("decode_tok_s").median().alias("tok_s"),
                pl.col("ratio").median().alias("vs_no_corpus"), pl.col("ratio").min().alias("vs_no_corpus_lo"),
                pl.col("ratio").max().alias("vs_no_corpus_hi"), pl.col("ratio_none").median().alias("vs_none"),
                pl.col("base_tokens_per_step").median(), pl.col("tokens_per_step").median(),
                pl.col("corpus_step_share").median(),
                (pl.col("replay_exact").fill_null(False) & pl.col("base_exact").fill_null(False)).all()
                .alias("replay_exact"),
                pl.len().alias("repeats"))
           .with_columns(pl.col("workload").replace_strict({**BAR, **{w: BAR[t] for w, t in BAR_AS.items()}},
                                                           default=None, return_dtype=pl.Float64).alias("bar")))
    return (out.with_columns((pl.col("vs_no_corpus") >= pl.col("bar")).alias("meets"))
            .sort("run", "config", "workload", "load"))


def greedy_differences(requests: pl.DataFrame) -> pl.DataFrame:
    """How many requests' greedy outputs differ from a reference, per (run, config, workload, load, against):
    a speculating config's against `none`'s same request in the same repeat (`against` = "none"); `none`'s own in
    every later repeat against its first repeat ("none, first repeat"): whether `none` reproduces itself, without
    which equality with `none` tests nothing. Columns `requests` (compared) and `differ`."""
    key = ["run", "workload", "load", "repeat", "order"]
    none = requests.filter(pl.col("config") == "none").select(*key, pl.col("output_ids").alias("reference"))
    spec = (requests.filter(pl.col("config") != "none").select(*key, "config", "output_ids")
            .join(none, on=key, how="inner").with_columns(pl.lit("none").alias("against")))
    first = none.group_by("run", "workload", "load").agg(pl.col("repeat").min().alias("first"))
    none = none.join(first, on=["run", "workload", "load"])
    again = (none.filter(pl.col("repeat") > pl.col("first"))
             .select(*key, pl.lit("none").alias("config"), pl.col("reference").alias("output_ids"),
                     pl.lit("none, first repeat").alias("against"))
             .join(none.filter(pl.col("repeat") == pl.col("first"))
                   .select("run", "workload", "load", "order", "reference"),
                   on=["run", "workload", "load", "order"], how="inner"))
    both = pl.concat([spec.select(*key, "config", "against", "output_ids", "reference"),
                      again.select(*key, "config", "against", "output_ids", "reference")])
    return (both.group_by("run", "config", "workload", "load", "against")
            .agg(pl.len().alias("requests"), (pl.col("output_ids") != pl.col("reference")).sum().alias("differ"))
            .sort("run", "against", "config", "workload", "load"))


def greedy_pairs(requests: pl.DataFrame, load: int, *, configs: list[str] | None = None,
                 reference: pl.DataFrame | None = None, reference_run: str | None = None) -> pl.DataFrame:
    """The greedy answers of one run at `load` that `greedy_differences` compares, as pairs for
    `hqlab.bench.divergence.divergence_table` (a: the reference, b: the answer checked): each of `configs` (default
    every config but `none`) against `none`'s same request in the same repeat (`compared_with` "none"); `none`'s
    later repeats against its first ("repeat <first>"); with `reference` (another run's requests, named
    `reference_run`), `none` against that run's `none`, same request and repeat (`compared_with` = `reference_run`).
    Columns config, request, repeat, compared_with, prompt_ids, a, b."""
    from hqlab.bench.divergence import answer_pairs

    def none_of(frame: pl.DataFrame) -> pl.DataFrame:
        return frame.filter((pl.col("config") == "none") & (pl.col("load") == load))

    at = requests.filter(pl.col("load") == load)
    none = none_of(requests)
    configs = [c for c in (at["config"].unique(maintain_order=True).to_list() if configs is None else configs)
               if c != "none"]
    parts = [answer_pairs(none, at.filter(pl.col("config") == c), carry=["config"], compared_with="none")
             for c in configs]
    first = none["repeat"].min()
    for repeat in sorted(r for r in none["repeat"].unique().to_list() if r != first):
        parts.append(answer_pairs(none.filter(pl.col("repeat") == first), none.filter(pl.col("repeat") == repeat),
                                  key=["request"], carry=["repeat", "config"], compared_with=f"repeat {first}"))
    if reference is not None:
        parts.append(answer_pairs(none_of(reference), none, carry=["config"],
                                  compared_with=reference_run or "reference"))
    return pl.concat([p.select("config", "request", "repeat", "compared_with", "prompt_ids", "a", "b") for p in parts])


def waves(requests: pl.DataFrame) -> pl.DataFrame:
    """The corpus's gain split by when a request was sent. At `load` in flight the first `load` requests of a point
    (`order` < load) start together, before any answer has finished, so the corpus holds no output of theirs' kind
    (only prompts, with `corpus_prompts`); every later request finds the answers finished before it. One row per
    (run, config with a corpus, workload, load, wave in {"first", "later"}): the requests in the wave (per repeat),
    tokens per step without and with the corpus over all repeats (from the step records, timing-free), their ratio,
    and the ratio of per-request decode rates ((tokens - 1) ÷ (last token - first token), summed over the wave's
    requests; median over repeats, `stream_lo`/`_hi` its range). A point's own ratio mixes the two waves by their
    steps; a longer batch job is mostly its later wave."""
    pairs = corpus_pairs(requests["config"].unique().to_list())
    rows = (requests.filter(pl.col("config").is_in([*pairs, *pairs.values()]))
            .with_columns(pl.when(pl.col("order") < pl.col("load")).then(pl.lit("first")).otherwise(pl.lit("later"))
                          .alias("wave"),
                          pl.col("step_emitted").list.sum().alias("tokens"),
                          pl.col("step_emitted").list.len().alias("steps"),
                          (pl.col("output_ids").list.len() - 1).clip(lower_bound=0).alias("decoded"),
                          (pl.col("t_last") - pl.col("ttft_s")).clip(lower_bound=0.0).alias("span")))
    key = ["run", "config", "workload", "load", "wave"]
    per_repeat = (rows.group_by(*key, "repeat")
                  .agg(pl.col("tokens").sum(), pl.col("steps").sum(), pl.len().alias("requests"),
                       (pl.col("decoded").sum() / pl.col("span").sum()).alias("stream_tok_s")))
    base = per_repeat.filter(pl.col("config").is_in(list(pairs.values()))).select(
        "run", "workload", "load", "wave", "repeat", pl.col("config").alias("base_config"),
        pl.col("tokens").alias("base_tokens"), pl.col("steps").alias("base_steps"),
        pl.col("stream_tok_s").alias("base_stream_tok_s"))
    joined = (per_repeat.filter(pl.col("config").is_in(list(pairs)))
              .with_columns(pl.col("config").replace_strict(pairs).alias("base_config"))
              .join(base, on=["run", "workload", "load", "wave", "repeat", "base_config"], how="inner")
              .with_columns((pl.col("stream_tok_s") / pl.col("base_stream_tok_s")).alias("stream")))
    out = (joined.group_by(*key, "base_config")
           .agg(pl.col("requests").median().cast(pl.Int64),
                (pl.col("base_tokens").sum() / pl.col("base_steps").sum()).alias("base_tokens_per_step"),
                (pl.col("tokens").sum() / pl.col("steps").sum()).alias("tokens_per_step"),
                pl.col("stream").median().alias("stream"), pl.col("stream").min().alias("stream_lo"),
                pl.col("stream").max().alias("stream_hi"), pl.len().alias("repeats"))
           .with_columns((pl.col("tokens_per_step") / pl.col("base_tokens_per_step")).alias("tokens_per_step_ratio")))
    return out.sort("run", "config", "workload", "load", "wave")


def slow_steps(points: pl.DataFrame) -> pl.DataFrame:
    """Per (run, workload, load, config) of the points that kept their step intervals (`finish`'s
    `slow_time_share`, `step_ms_median`): the share of the requests' decode time spent in slow steps (over 3x the
    point's median: with many in flight, about one per request admitted) and the median step, each as the median
    over repeats with its range; `who` names the config in a few words ("none", "k=15", "k=15, corpus ...")."""
    if "slow_time_share" not in points.columns:
        return pl.DataFrame()
    kept = points.filter(pl.col("slow_time_share").is_not_null() & pl.col("slow_time_share").is_not_nan())
    return (kept.group_by("run", "workload", "load", "config", maintain_order=True)
            .agg(pl.col("slow_time_share").median().alias("slow"), pl.col("slow_time_share").min().alias("slow_lo"),
                 pl.col("slow_time_share").max().alias("slow_hi"), pl.col("step_ms_median").median().alias("step_ms"),
                 pl.col("step_ms_median").min().alias("step_ms_lo"), pl.col("step_ms_median").max().alias("step_ms_hi"),
                 pl.len().alias("repeats"))
            .with_columns(pl.col("config").map_elements(lambda c: "none" if c == "none" else label(c),
                                                        return_dtype=pl.String).alias("who"))
            .sort("run", "workload", "load", "step_ms"))


def divergences(run: str, *, against: str | None = None, configs: Sequence[str] | None = None, load: int = 8,
               model: str = "qwen2.5-coder-1.5b", dtype: str = "float32", root: Any = None) -> Any:
    """Where a finished corpus run's greedy answers part (`greedy_pairs`: each config against `none`,
    `none`'s repeats, and `none` against `against`'s `none`), read by `model` teacher-forced on this machine; written
    as the run's `divergences` table (`results.write_run`) and returned."""
    import polars as pl

    from hqlab import models
    from hqlab.bench import results
    from hqlab.bench.divergence import divergence_table

    requests = results.load("corpus", run, "requests", root=root)
    reference = results.load("corpus", against, "requests", root=root) if against else None
    pairs = greedy_pairs(requests, load, configs=configs, reference=reference, reference_run=against)
    loaded, _, info = models.load(model, device="cpu", dtype=dtype)
    print(f"{pairs.height} pairs, {pairs.filter(pl.col('a') != pl.col('b')).height} part; {info.name} in {info.dtype}")
    table = divergence_table(loaded, pairs).with_columns(pl.lit(info.dtype).alias("dtype"))
    card = results.run_info("corpus", run, root)["card"]
    results.write_run("corpus", run, card=card, tables={"divergences": table}, root=root)
    return table


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    import polars as pl

    ap = argparse.ArgumentParser(description=divergences.__doc__.split(";")[0])
    ap.add_argument("--run", required=True, help="the finished corpus run")
    ap.add_argument("--against", default=None, help="another finished run whose `none` answers `none` is compared with")
    ap.add_argument("--config", action="append", default=None,
                    help="configs compared with `none` (repeatable; default every config; --config none: none only)")
    ap.add_argument("--load", type=int, default=8, help="the points' requests in flight (default 8)")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="float32", help="the reference model's dtype on the CPU (default float32)")
    ap.add_argument("--results", default=None, help="the results folder (default data/results)")
    args = ap.parse_args(argv)
    table = divergences(args.run, against=args.against, configs=args.config, load=args.load, model=args.model,
                       dtype=args.dtype, root=args.results)
    with pl.Config(tbl_rows=20, tbl_width_chars=200):
        print(table.group_by("config", "compared_with", "verdict").agg(pl.len(), pl.col("margin").abs().max())
              .sort("config", "compared_with", "verdict"))
    return 0


__all__ = ["BAR", "BAR_AS", "has_corpus", "without_corpus", "corpus_pairs", "label", "speedups", "greedy_differences",
           "waves", "slow_steps", "greedy_pairs", "divergences", "main"]


if __name__ == "__main__":
    raise SystemExit(main())
