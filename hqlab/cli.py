"""hqlab command line: bench, sweep, figures, vocab, site, the committed results and listings.

Every command validates all its inputs (specs, grids, suites and workload files, models, devices and dtypes,
parameter files, notebook names, output paths) before it loads a model or writes anything, and a bad input ends
the command with one line on stderr naming the problem and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from hqlab import io
from hqlab.config import ConfigError, DecodeConfig


class Parser(argparse.ArgumentParser):
    """argparse with errors on one line (usage is in --help), exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ----------------------------------------------------------------------------------------------------------------
# Input checks: cheap, and nothing is loaded or written


def _out_path(value: str) -> Path:
    path = Path(value)
    if path.suffix != ".parquet":
        raise argparse.ArgumentTypeError(f"--out must end in .parquet (got {value!r})")
    if path.exists() and path.is_dir():
        raise argparse.ArgumentTypeError(f"--out {value!r} is a directory")
    return path


def check_writable(path: Path, option: str, *, folder: bool = False) -> None:
    """`hqlab.io.check_writable` for a command-line option: a ConfigError (exit 2) where `path` cannot be written."""
    io.check_writable(path, option, ConfigError, folder=folder)


def check_figure(path: Path | None) -> None:
    if path is None:
        return
    if path.suffix != ".svg":
        raise ConfigError(f"--figure must end in .svg (got {str(path)!r}); a .png is written beside it")
    check_writable(path, "--figure")


def check_model(name: str | None, option: str = "--model") -> str:
    """The model name (default: the registry's default), after checking it names an offline model, an existing
    folder or .gguf file, or a hub id. Nothing is downloaded or converted."""
    from hqlab import models

    name = name or models.DEFAULT_MODEL
    source, key = models.resolve(name)
    if source == "path" and Path(key).is_file() and not key.endswith(".gguf"):
        raise ConfigError(f"{option} {name!r} is a file but not a .gguf; give a model folder, a .gguf file or a "
                          f"hub id")
    if source == "path" and Path(key).is_dir() and not (Path(key) / "config.json").is_file():
        raise ConfigError(f"{option} {name!r} is a folder without config.json, not a model folder "
                          f"from_pretrained can load")
    return name


def check_device_dtype(device: str, dtype: str) -> None:
    from hqlab import models

    models.resolve_dtype(dtype)
    models.resolve_device(device)


def check_counts(**values: int) -> None:
    """`limit`-like options must be >= 0, `repeats`-like >= 1 (named by the keyword)."""
    for name, value in values.items():
        least = 0 if name == "limit" else 1
        if value < least:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {least} (got {value})")


# ----------------------------------------------------------------------------------------------------------------
# Commands


def cmd_bench(args: argparse.Namespace) -> int:
    from hqlab import bench

    decode = DecodeConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)
    if args.engine not in ("hf", "vllm"):
        raise ConfigError(f"unknown engine {args.engine!r}; available: hf, vllm")
    check_counts(repeats=args.repeats, limit=args.limit)
    check_writable(args.out, "--out")
    check_figure(args.figure)
    model = check_model(args.model)
    check_device_dtype(args.device, args.dtype)
    bench.check_workload(args.suite, args.doc_tokens)
    if args.engine == "hf":
        bench.check_specs(args.proposer)
    else:
        from hqlab.engines.vllm import settings_for

        settings_for(args.proposer)

    import polars as pl

    from hqlab import plots

    # vllm: one vLLM engine per config (CUDA); hf: the proposers are built (a drafter loads) before the target
    results, steps = bench.run_suites(args.engine, {args.suite: args.max_new_tokens}, args.proposer, model=model,
                                      decode=decode, doc_tokens=args.doc_tokens, limit=args.limit,
                                      repeats=args.repeats, device=args.device, dtype=args.dtype,
                                      concurrency=args.concurrency, tensor_parallel_size=args.tensor_parallel_size,
                                      pipeline_parallel_size=args.pipeline_parallel_size)
    bench.write_results(args.out, results, steps)
    with pl.Config(tbl_rows=200, tbl_cols=20, tbl_width_chars=200):
        print(bench.summarize(results))
    print(f"machine: {results['machine'][0]}; commit {results['git_commit'][0]}; wrote {args.out} and "
          f"{bench.part_path(args.out)}")
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
    from hqlab.site.notebooks import plan, run_all

    plan(params_file=args.params, only=args.only, out_dir=args.out_dir)  # every input, before anything runs
    return run_all(params_file=args.params, only=args.only, out_dir=args.out_dir)


def cmd_site(args: argparse.Namespace) -> int:
    from hqlab.site import SiteError, build_site, site_pages

    check_writable(args.out, "--out", folder=True)
    if not args.notebooks_dir.is_dir():
        raise ConfigError(f"--notebooks-dir {str(args.notebooks_dir)!r}: no such folder (run hqlab figures first)")
    try:
        pages = build_site(args.out, args.notebooks_dir)
    except SiteError as e:
        raise ConfigError(str(e)) from None
    for p in pages:
        print(f"{p.stem}: {p.status}")
    print(f"wrote {args.out / 'index.html'}")
    if not args.check:
        return 0
    from hqlab.site.check import BrowserMissing, check_page, ensure_chromium

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


def _parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"--sizes must be comma-separated integers (got {text!r})") from None
    if any(n < 1 for n in sizes):
        raise ConfigError(f"--sizes must all be >= 1 (got {text!r})")
    return sizes


def _check_vocab_out(folder: Path) -> None:
    """A vocabulary folder can be published into: new, empty, or published before by hqlab."""
    from hqlab.vocab.publish import INDEX

    check_writable(folder, "--out", folder=True)
    if folder.is_dir() and any(folder.iterdir()) and not (folder / INDEX).is_file():
        raise ConfigError(f"--out {str(folder)!r} is not empty and not a published vocabulary folder; give a new "
                          f"folder or one hqlab vocab build wrote")


def cmd_vocab(args: argparse.Namespace) -> int:
    """`vocab build` (artifacts of one list) and `vocab coverage` (held-out curves vs reference lists)."""
    from hqlab.vocab.corpus import CorpusError, expand

    try:
        model = check_model(args.model)
        expand(args.corpus)
        if args.vocab_command == "build":
            if args.size < 1:
                raise ConfigError(f"--size must be >= 1 (got {args.size})")
            _check_vocab_out(args.out)
        else:
            references = [r for r in args.reference if r != "generic"]
            if references:
                expand(references)
            sizes = _parse_sizes(args.sizes) if args.sizes else None
            check_writable(args.out, "--out")
            check_figure(args.figure)
    except CorpusError as e:
        raise ConfigError(str(e)) from None

    from hqlab import vocab
    from hqlab.vocab.publish import PublishError

    try:
        if args.vocab_command == "build":
            r = vocab.build(model, args.corpus, args.size, args.out, holdout=not args.no_holdout)
            print(f"{r.folder}: {r.ids.size} ids from {r.summary['tokens_counted']} tokens of "
                  f"{r.summary['records_counted']} records; held-out coverage "
                  + ", ".join(f"{k} {v:.2%}" for k, v in r.coverage.items()))
            return 0
        return _vocab_coverage(args, vocab, model, sizes)
    except (CorpusError, vocab.VocabError, PublishError) as e:
        raise ConfigError(str(e)) from None


def _vocab_coverage(args: argparse.Namespace, vocab: Any, model: str, sizes: list[int] | None) -> int:
    import polars as pl

    from hqlab import plots
    from hqlab.io import write_atomic

    _, tokenizer, vocab_size = vocab.model_files(model)
    sizes = sizes or vocab.default_sizes(vocab_size)
    too_big = [n for n in sizes if n > vocab_size]
    if too_big:
        raise ConfigError(f"--sizes {too_big} exceed the model's vocabulary of {vocab_size}")
    refs = {("generic" if r == "generic" else Path(r).stem): [r] for r in args.reference}
    frame = pl.DataFrame(vocab.compare_lists(tokenizer, vocab_size, args.corpus, refs, sizes))
    frame = frame.with_columns(pl.lit(str(model)).alias("model"))
    write_atomic(args.out, lambda tmp: frame.write_parquet(tmp))
    with pl.Config(tbl_rows=100):
        print(frame.filter(pl.col("src") == "all").pivot(on="list", index="n", values="coverage"))
    if args.figure:
        plots.save(plots.lines(frame, "n", "coverage", "list", facet="src", x_title="draft vocabulary size N",
                               y_title="held-out coverage", log_x=True), args.figure)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    """`hqlab sweep`: validate everything, get traces (cache first), replay the grid, write parquet."""
    import time

    from hqlab import bench
    from hqlab.replay import sweep, traces as trace_sets
    from hqlab.replay.costmodel import CostModel

    check_writable(args.out, "--out")
    if args.cost is not None and args.measure_cost:
        raise ConfigError("give --cost or --measure-cost, not both")
    check_counts(limit=args.limit, max_new_tokens=args.max_new_tokens)
    specs = [s for g in args.grid for s in sweep.parse_grid(g)]
    bench.check_specs(args.proposer)
    specs = list(dict.fromkeys(specs + [s.strip() for s in args.proposer]))
    if not specs:
        raise ConfigError("nothing to sweep: give --grid and/or --proposer")
    cost = None
    if args.cost is not None:
        cost = _read_cost(args.cost)
    if args.traces is not None:
        traces = trace_sets.load_traces(args.traces)  # validates the whole file
        traces = traces[: args.limit] if args.limit else traces
        if not traces:
            raise ConfigError(f"--traces {str(args.traces)!r} holds no traces")
    else:
        traces = None
        bench.check_workload(args.suite, args.doc_tokens)
    model = check_model(args.model) if (traces is None or args.measure_cost) else None
    check_device_dtype(args.device, args.dtype)

    # inputs are valid: load what is needed
    engine = None
    if args.measure_cost:
        from hqlab.engines.hf import HFEngine

        engine = HFEngine.load(model, device=args.device, dtype=args.dtype)
    if traces is None:
        found = trace_sets.cached_traces(model, args.suite, args.max_new_tokens, dtype=args.dtype, device=args.device,
                                    doc_tokens=args.doc_tokens, limit=args.limit, engine=engine,
                                    record=not args.cached_only)
        traces = found.traces
        print(f"{len(traces)} traces of {found.origin.describe()}: {len(traces) - found.recorded} from the cache, "
              f"{found.recorded} recorded now")
    if args.measure_cost:
        from hqlab.replay.costmodel import measure_step_times

        longest = max(len(t.prompt_ids) + len(t.output_ids) for t in traces)
        contexts = sorted({128, 512, *range(1024, longest + 1024, 1024)})
        cost = CostModel.fit(measure_step_times(engine, contexts, [1, 2, 4, 8, 12, 16]))
        print(cost.describe())
    print(f"{len(specs)} configurations × {len(traces)} traces ({sum(len(t.output_ids) for t in traces)} tokens)")
    t0 = time.perf_counter()
    frame = sweep.sweep(traces, specs, cost=cost)
    print(f"replayed in {time.perf_counter() - t0:.1f}s")
    import polars as pl

    from hqlab.io import write_atomic

    prov = trace_sets.traces_provenance(traces)
    frame = frame.with_columns(*(pl.lit(v, dtype=pl.String).alias(k) for k, v in prov.items()))
    write_atomic(args.out, lambda tmp: frame.write_parquet(tmp))
    table = sweep.by_category(frame)
    cols = ["config", "category", "tokens_per_step", *(["speedup_pred"] if cost is not None else [])]
    with pl.Config(tbl_rows=40, tbl_width_chars=160, fmt_str_lengths=60):
        print(table.sort("tokens_per_step", descending=True).select(cols).head(40))
    print(f"wrote {args.out}")
    return 0


def _read_cost(path: Path) -> Any:
    from hqlab.io import read_table
    from hqlab.replay.costmodel import CostModel

    grid = read_table(path, {"context_len", "verify_len", "step_ms"}, f"--cost {str(path)!r}", ConfigError)
    try:
        return CostModel.fit(grid)
    except (ValueError, ArithmeticError) as e:
        raise ConfigError(f"--cost {str(path)!r}: cannot fit a cost model ({e})") from None


def cmd_list(args: argparse.Namespace) -> int:
    from hqlab import models
    from hqlab.bench import EXTERNAL
    from hqlab.proposers import REGISTRY
    from hqlab.workloads import suite_names

    print("models (offline registry):", ", ".join(models.offline_names()), f"(default {models.DEFAULT_MODEL})")
    for name in models.offline_names():
        entry = models.offline_entry(name)
        print(f"  {name:22s} {entry.size / 1e6:8.1f} MB  {entry.description}")
    print("proposers:", ", ".join(sorted(REGISTRY)), "| engine baselines:", ", ".join(sorted(EXTERNAL)))
    print("suites:", ", ".join(suite_names()), "| or a JSONL file")
    return 0


def cmd_results(args: argparse.Namespace) -> int:
    """The committed results (data/results, `hqlab.bench.results`): list the runs, rebuild the index, or check the
    claims committed beside the runs (exit 1 where one does not hold)."""
    from hqlab.bench import claims, results

    if args.results_command == "index":
        path = results.write_index(args.root)
        print(f"{len(results.index(args.root))} runs -> {path}")
        return 0
    if args.study is not None:  # an unknown study or run is named with those there are
        results.runs(args.study, root=args.root)
        if getattr(args, "run", None) is not None:
            results.run_info(args.study, args.run, args.root)
    chosen = [r for r in results.index(args.root) if args.study in (None, r["study"])
              and getattr(args, "run", None) in (None, r["run"])]
    if args.results_command == "list":
        for r in chosen:
            print(f"{r['study']}/{r['run']}  {r['card']}  {r['date']}  {r['commit'] or '-'}  {', '.join(r['files'])}")
        return 0
    failed = 0
    for r in chosen:
        for verdict in claims.check_run(r["study"], r["run"], args.root):
            failed += not verdict.held
            if args.verbose or not verdict.held:
                print(f"{r['study']}/{r['run']} {verdict.describe()}")
    print(f"{sum(len(claims.claims_of(r['study'], r['run'], args.root)) for r in chosen)} claims of {len(chosen)} "
          f"runs checked, {failed} do not hold")
    return 1 if failed else 0


def cmd_serve_command(args: argparse.Namespace) -> int:
    """Print the `vllm serve` command line for a config (docs/serving.md)."""
    from hqlab.engines.vllm.serving import serve_command, serve_env, shell_line

    print(shell_line(serve_command(args.model, args.spec, max_num_seqs=args.max_num_seqs, port=args.port),
                     serve_env(args.spec)))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    """Convert a GGUF into a safetensors folder in this process: the child `hqlab.models.gguf.convert` starts (a
    process that loaded a GGUF decodes slower afterwards, so the parent never does)."""
    from hqlab.models.gguf import convert_in_this_process

    convert_in_this_process(args.gguf, args.out, args.expect_name)
    return 0


def _add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="offline short name, local path or hub id (default: the 0.5B)")
    p.add_argument("--suite", default="all", help="labd, chat, all, a task name, or a JSONL file")
    p.add_argument("--grid", action="append", default=[], metavar="GRID",
                   help="NAME:key=v1|v2,key2=...: every combination, repeatable; e.g. lookup:nmin=1|2|6,nmax=8|12")
    p.add_argument("--proposer", action="append", default=[], metavar="SPEC", help="single specs, repeatable")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--doc-tokens", type=int, default=1500, help="document length for the labd tasks")
    p.add_argument("--limit", type=int, default=0, help="only the first N prompts")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--cost", type=Path, default=None,
                   help="step-cost grid (.parquet with context_len, verify_len, step_ms) to predict speed from")
    p.add_argument("--measure-cost", action="store_true",
                   help="measure the step-cost grid on this machine first (loads the model)")
    p.add_argument("--cached-only", action="store_true", help="fail instead of recording missing traces")
    p.add_argument("--traces", type=Path, default=None,
                   help="a saved trace set (.parquet from save_traces) instead of --suite/--model's cached traces")
    p.add_argument("--out", required=True, type=_out_path, help="results .parquet, one row per (config, prompt)")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="hqlab", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True,
                           metavar="{bench,figures,site,vocab,sweep,list,results,serve-command}")

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
    b.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm engine: GPUs per model (tensor)")
    b.add_argument("--pipeline-parallel-size", type=int, default=1, help="vllm engine: pipeline stages")
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
    _add_sweep_arguments(sw)
    sw.set_defaults(func=cmd_sweep)

    ls = sub.add_parser("list", help="models, proposers and suites")
    ls.set_defaults(func=cmd_list)

    rs = sub.add_parser("results", help="the committed results: list the runs, rebuild the index, check the claims")
    rsub = rs.add_subparsers(dest="results_command", required=True)
    for name, help_ in (("list", "the runs (study/run, card, date, commit, files)"),
                        ("check", "evaluate the claims committed beside the runs"),
                        ("index", "rebuild data/results/index.json from the run folders")):
        r = rsub.add_parser(name, help=help_)
        r.add_argument("--root", type=Path, default=None, help="the results folder (default data/results)")
        if name != "index":
            r.add_argument("study", nargs="?", default=None)
        if name == "check":
            r.add_argument("run", nargs="?", default=None)
            r.add_argument("--verbose", action="store_true", help="print the claims that hold too")
    rs.set_defaults(func=cmd_results)

    sc = sub.add_parser("serve-command", help="print the `vllm serve` command for none, gpu-lookup:..., "
                                              "gpu-fused:... or vLLM's own vllm-ngram-gpu:..., vllm-draft:... and "
                                              "arctic-suffix:...,cached=N (docs/serving.md)")
    sc.add_argument("model", help="the model vLLM serves (a hub id or a folder)")
    sc.add_argument("spec", help='e.g. "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest,batch_k=1:15/4:7/0"')
    sc.add_argument("--max-num-seqs", type=int, default=32, help="requests in flight at most (sizes CUDA graphs)")
    sc.add_argument("--port", type=int, default=8000)
    sc.set_defaults(func=cmd_serve_command)

    # internal: the GGUF conversion's child process (hqlab.models.gguf.convert runs it)
    cv = sub.add_parser("_convert")
    cv.add_argument("gguf", type=Path)
    cv.add_argument("out", type=Path)
    cv.add_argument("--expect-name", default=None)
    cv.set_defaults(func=cmd_convert)
    return p


def _input_errors() -> tuple[type, ...]:
    """Exception classes that mean bad input (exit 2, one line), from the modules this run has imported (an
    error of a module that was never imported cannot have been raised; importing torch to catch it costs
    seconds)."""
    classes: list[type] = [ConfigError]
    for module, name in (("hqlab.workloads", "WorkloadError"), ("hqlab.models", "ModelError"),
                         ("hqlab.engines.hf", "PromptTooLongError"), ("hqlab.bench.results", "MissingRun"),
                         ("hqlab.bench.claims", "ClaimError")):
        if module in sys.modules:
            classes.append(getattr(sys.modules[module], name))
    return tuple(classes)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    name = args.command + (f" {args.vocab_command}" if args.command == "vocab" else "") + (
        f" {args.results_command}" if args.command == "results" else "")
    try:
        return args.func(args)
    except Exception as e:
        if not isinstance(e, _input_errors()):
            raise
        print(f"hqlab {name}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
