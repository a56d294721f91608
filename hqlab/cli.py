"""hqlab command line: bench, figures, and listings. Every input is validated before any model is loaded."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hqlab.config import ConfigError, DecodeConfig


def _out_path(value: str) -> Path:
    path = Path(value)
    if path.suffix != ".parquet":
        raise argparse.ArgumentTypeError(f"--out must end in .parquet (got {value!r})")
    if path.exists() and path.is_dir():
        raise argparse.ArgumentTypeError(f"--out {value!r} is a directory")
    return path


def cmd_bench(args: argparse.Namespace) -> int:
    import polars as pl

    from hqlab import bench, plots
    from hqlab.engines.hf import HFEngine
    from hqlab.workloads import load_workload

    decode = DecodeConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)
    if args.engine not in ("hf", "vllm"):
        raise ConfigError(f"unknown engine {args.engine!r}; available: hf, vllm")
    if args.engine == "hf":
        bench.parse_configs(args.proposer)  # fail on a bad spec before loading anything
    if args.suite not in ("labd", "all") and not Path(args.suite).exists():
        load_workload(args.suite)  # validates a file / name early (document suites need the tokenizer)

    if args.engine == "vllm":  # one vLLM engine per config (CUDA); specs are checked before the model loads
        from hqlab.engines.vllm import bench_suite

        results, steps = bench_suite(args.model, args.suite, args.proposer, decode, doc_tokens=args.doc_tokens,
                                     limit=args.limit, repeats=args.repeats, dtype=args.dtype,
                                     concurrency=args.concurrency, tensor_parallel_size=args.tensor_parallel_size)
    else:
        engine = HFEngine.load(args.model, device=args.device, dtype=args.dtype)
        prompts = load_workload(args.suite, doc_tokens=args.doc_tokens, tokenizer=engine.tokenizer)
        if args.limit:
            prompts = prompts[: args.limit]
        results, steps = bench.run_bench(engine, prompts, args.proposer, decode, repeats=args.repeats,
                                         meta={"suite": args.suite, "doc_tokens": args.doc_tokens})
    from hqlab.io import write_atomic

    steps_path = args.out.with_name(args.out.stem + ".steps.parquet")
    if steps.height:
        write_atomic(steps_path, lambda tmp: steps.write_parquet(tmp))
    write_atomic(args.out, lambda tmp: results.write_parquet(tmp))
    with pl.Config(tbl_rows=200, tbl_cols=20, tbl_width_chars=200):
        print(bench.summarize(results))
    print(f"machine: {results['machine'][0]}; wrote {args.out} and {steps_path}")
    if args.figure:
        chart = plots.grouped_bars(results.group_by(["category", "config"], maintain_order=True)
                                   .agg(pl.col("speedup_e2e").median()),
                                   "category", "speedup_e2e", "config", y_title="speedup over no speculation",
                                   rule_at=1.0)
        plots.save(chart, args.figure)
        print(f"wrote {args.figure}")
    bad = results.filter(pl.col("divergence") == "mismatch")
    if bad.height:
        print(f"LOSSLESS CHECK FAILED for {bad.height} run(s): {bad.select('config', 'prompt_id').rows()}",
              file=sys.stderr)
        return 3
    return 0


def cmd_figures(args: argparse.Namespace) -> int:
    from hqlab.notebooks import run_all

    return run_all(params_file=args.params, only=args.only, out_dir=args.out_dir)


def cmd_site(args: argparse.Namespace) -> int:
    from hqlab.site import SiteError, build_site, site_pages

    try:
        pages = build_site(args.out, args.notebooks_dir)
    except SiteError as e:
        raise ConfigError(str(e)) from None
    for p in pages:
        print(f"{p.stem}: {p.status}")
    print(f"wrote {args.out / 'index.html'}")
    if not args.check:
        return 0
    from hqlab.sitecheck import BrowserMissing, check_page, ensure_chromium

    try:
        chromium = ensure_chromium(install=False)
    except BrowserMissing as e:
        raise ConfigError(str(e)) from None
    problems = []
    for page in site_pages(args.out):
        report = check_page(page, chromium)
        problems += report.problems()
        print(f"{page.relative_to(args.out)}: {len(report.charts)} charts, {len(report.widgets)} widget views")
    for line in problems:
        print("NOT VISIBLE:", line, file=sys.stderr)
    return 4 if problems else 0


def cmd_vocab(args: argparse.Namespace) -> int:
    """`vocab build` (artifacts of one list) and `vocab coverage` (held-out curves vs reference lists)."""
    from hqlab import vocab
    from hqlab.corpus import CorpusError
    from hqlab.publish import PublishError

    try:
        if args.vocab_command == "build":
            r = vocab.build(args.model, args.corpus, args.size, args.out, holdout=not args.no_holdout)
            print(f"{r.folder}: {r.ids.size} ids from {r.summary['tokens_counted']} tokens of "
                  f"{r.summary['records_counted']} records; held-out coverage "
                  + ", ".join(f"{k} {v:.2%}" for k, v in r.coverage.items()))
            return 0
        return _vocab_coverage(args, vocab)
    except (CorpusError, vocab.VocabError, PublishError) as e:
        print(f"hqlab vocab {args.vocab_command}: error: {e}", file=sys.stderr)
        return 2


def _vocab_coverage(args: argparse.Namespace, vocab) -> int:
    import polars as pl

    from hqlab import plots
    from hqlab.corpus import expand
    from hqlab.io import write_atomic

    expand(args.corpus + [r for r in args.reference if r != "generic"])  # fail on bad paths before loading
    _, tokenizer, vocab_size = vocab.model_files(args.model)
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else vocab.default_sizes(vocab_size)
    refs = {("generic" if r == "generic" else Path(r).stem): [r] for r in args.reference}
    frame = pl.DataFrame(vocab.compare_lists(tokenizer, vocab_size, args.corpus, refs, sizes))
    frame = frame.with_columns(pl.lit(str(args.model)).alias("model"))
    write_atomic(args.out, lambda tmp: frame.write_parquet(tmp))
    with pl.Config(tbl_rows=100):
        print(frame.filter(pl.col("src") == "all").pivot(on="list", index="n", values="coverage"))
    if args.figure:
        plots.save(plots.lines(frame, "n", "coverage", "list", facet="src", x_title="draft vocabulary size N",
                               y_title="held-out coverage", log_x=True), args.figure)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from hqlab import sweep

    return sweep.cli(args)


def cmd_list(args: argparse.Namespace) -> int:
    from hqlab import models
    from hqlab.bench import EXTERNAL
    from hqlab.proposers import REGISTRY
    from hqlab.workloads import suite_names

    print("models (offline registry):", ", ".join(models.offline_names()), f"(default {models.DEFAULT_MODEL})")
    print("proposers:", ", ".join(sorted(REGISTRY)), "| engine baselines:", ", ".join(sorted(EXTERNAL)))
    print("suites:", ", ".join(suite_names()), "| or a JSONL file")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hqlab", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("bench", help="run proposer configs over a workload and write results parquet")
    b.add_argument("--model", default=None, help="offline short name, local path or hub id (default: the 0.5B)")
    b.add_argument("--engine", default="hf", help="engine: hf (transformers) or vllm (vLLM 0.26 on CUDA, docs/vllm.md)")
    b.add_argument("--suite", default="labd", help="labd, chat, all, a task name, or a JSONL file")
    b.add_argument("--proposer", action="append", default=[], metavar="SPEC",
                   help="NAME[:key=value,...], repeatable; e.g. lookup:nmin=6,nmax=12,k=15, pld:n=3,k=10, hf-pld:k=10")
    b.add_argument("--max-new-tokens", type=int, default=256)
    b.add_argument("--doc-tokens", type=int, default=1500, help="document length for the labd tasks")
    b.add_argument("--repeats", type=int, default=1, help="runs per (config, prompt); timings are medians")
    b.add_argument("--limit", type=int, default=0, help="only the first N prompts")
    b.add_argument("--concurrency", type=int, default=0,
                   help="vllm engine: also run the first N prompts submitted together (total throughput)")
    b.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm engine: GPUs per model")
    b.add_argument("--device", default="auto")
    b.add_argument("--dtype", default="auto")
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--top-k", type=int, default=0)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--out", type=_out_path, required=True, help="results .parquet (steps go next to it)")
    b.add_argument("--figure", type=Path, default=None, help="also write a speedup figure (.svg + .png)")
    b.set_defaults(func=cmd_bench)

    f = sub.add_parser("figures", help="run every notebook with papermill, regenerating figures/")
    f.add_argument("--params", type=Path, default=None, help="YAML: per-notebook parameter overrides")
    f.add_argument("--only", action="append", default=None, help="run only these notebooks (by stem)")
    f.add_argument("--out-dir", type=Path, default=Path("notebooks/out"), help="executed notebooks go here")
    f.set_defaults(func=cmd_figures)

    s = sub.add_parser("site", help="render the executed notebooks and docs as an offline HTML site")
    s.add_argument("--out", type=Path, default=Path("site"), help="site folder (replaced whole)")
    s.add_argument("--notebooks-dir", type=Path, default=Path("notebooks/out"), help="executed notebooks")
    s.add_argument("--check", action="store_true", help="then screenshot every page in headless Chromium and "
                   "fail (exit 4) if a chart or widget view is not visible")
    s.set_defaults(func=cmd_site)

    v = sub.add_parser("vocab", help="draft vocabulary: build artifacts, coverage curves")
    vsub = v.add_subparsers(dest="vocab_command", required=True)
    vb = vsub.add_parser("build", help="count a corpus, keep the top N ids, publish ids/lm_head/mapping")
    vc = vsub.add_parser("coverage", help="held-out coverage vs N of the own-output list and reference lists")
    for x in (vb, vc):
        x.add_argument("--model", default="qwen2.5-coder-0.5b", help="offline short name or checkpoint folder")
        x.add_argument("--corpus", action="append", required=True, metavar="PATH",
                       help="repeatable: .jsonl/.txt/.py/.parquet file or folder (e.g. a self-generated corpus)")
    vb.add_argument("--size", type=int, default=16384, help="draft vocabulary size N")
    vb.add_argument("--out", type=Path, required=True, help="artifact folder (published atomically)")
    vb.add_argument("--no-holdout", action="store_true", help="count every record (no coverage report)")
    vc.add_argument("--reference", action="append", default=[], metavar="PATH",
                    help="repeatable: a corpus to build a comparison list from; 'generic' = stdlib + package docs")
    vc.add_argument("--sizes", default="", help="comma-separated N values (default: 1k..128k)")
    vc.add_argument("--out", type=_out_path, required=True, help="curves .parquet")
    vc.add_argument("--figure", type=Path, default=None, help="also write the curves (.svg + .png)")
    v.set_defaults(func=cmd_vocab)

    sw = sub.add_parser("sweep", help="replay a grid of proposer configs over cached traces, results to parquet")
    from hqlab.sweep import add_cli_arguments

    add_cli_arguments(sw)
    sw.set_defaults(func=cmd_sweep)

    ls = sub.add_parser("list", help="models, proposers and suites")
    ls.set_defaults(func=cmd_list)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from hqlab.workloads import WorkloadError

    try:
        from hqlab.engines.hf import PromptTooLongError
        from hqlab.models import ModelError
    except ImportError:  # pragma: no cover - models is always present in a full checkout
        ModelError = PromptTooLongError = RuntimeError  # type: ignore[misc,assignment]
    try:
        return args.func(args)
    except (ConfigError, WorkloadError, ModelError, PromptTooLongError) as e:
        print(f"hqlab {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
