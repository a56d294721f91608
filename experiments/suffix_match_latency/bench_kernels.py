"""Latency per decode step of the suffix-match lookup: Triton kernels against baselines and the hardware floor.

  python experiments/suffix_match_latency/bench_kernels.py              # a CUDA GPU: measure, write the parquet, plot
  python experiments/suffix_match_latency/bench_kernels.py --plot-only  # anywhere: figure + tables from the parquet
  python experiments/suffix_match_latency/bench_kernels.py --smoke      # CPU dry run of it all in Triton's interpreter
  python experiments/suffix_match_latency/bench_kernels.py --sweep      # a CUDA GPU: split kernels, BLOCK x num_warps

Workload: B requests of L tokens each, ids uniform over a 151,936-token vocabulary (Qwen's), the last 16 tokens
of every request copied from a random earlier span so that each request has a match; nmin 6, nmax 12, k 15,
policy "recent". GPU methods are timed as CUDA-graph replays of 32 consecutive steps, each step on the next of
several input sets (together several times the 60 MB L2, where the shape allows), so a step reads its history
from HBM and pays one kernel-node launch, as inside a captured decode step. CPU methods are timed with a
wall clock on the GPU machine's host CPU. All numbers are medians.

Methods:
  fused split kernel      SuffixMatcher(variant="fused"): split scan, the last program per request extracts
  split kernel            SuffixMatcher(variant="split"): split scan kernel + extract kernel
  single kernel           SuffixMatcher(variant="single"): one program per request
  fused, eager launch     the fused kernel launched from Python each step, no graph
  torch unfold (GPU)      suffix_match_torch: every candidate end at once, [B, L, nmax] comparison
  reference (CPU)         hqlab.rules.lookup.suffix_match looped over the batch (numpy)
  vLLM NgramProposer (CPU) vLLM's own Numba proposer on the same histories (earliest-occurrence policy)
  floor: empty launch     an empty Triton kernel
  floor: read bytes       a Triton kernel that reads every history token once (B * L * 4 bytes)
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

from hqlab.rules.lookup import suffix_match

ROOT = Path(__file__).resolve().parents[2]
# the committed run's tables (data/results/kernels/h200/, hqlab.bench.results): a GPU run rewrites them in place
RESULTS = ROOT / "data" / "results" / "kernels" / "h200" / "rows.parquet"
SWEEP_RESULTS = ROOT / "data" / "results" / "kernels" / "h200" / "sweep.parquet"
FIGURE = ROOT / "figures" / "kernels_latency"

SHAPES = [(b, n) for b in (1, 8, 64) for n in (4_096, 32_768, 131_072)] + [(1, 1_048_576)]
SMOKE_SHAPES = [(1, 2_048), (4, 4_096)]
NMIN, NMAX, K = 6, 12, 15
VOCAB = 151_936
PLANTED = 16
STEPS_PER_GRAPH = 32
L2_BYTES = 60 * 2**20

FUSED, SPLIT, SINGLE = "fused split kernel", "split kernel", "single kernel"
EAGER = "fused, eager launch"
TORCH, REFERENCE, VLLM = "torch unfold (GPU)", "reference (CPU)", "vLLM NgramProposer (CPU)"
EMPTY, READ = "floor: empty launch", "floor: read bytes"
METHOD_ORDER = [FUSED, SPLIT, SINGLE, EAGER, TORCH, REFERENCE, VLLM, EMPTY, READ]


# ----------------------------------------------------------------------------------------------------------------
# Imports that differ between machines
# ----------------------------------------------------------------------------------------------------------------


def load_kernels():
    """`hqlab_kernels.suffix_match`, or the file itself where the package is not installed."""
    try:
        return importlib.import_module("hqlab_kernels.suffix_match")
    except ImportError:
        path = ROOT / "kernels" / "suffix_match.py"
        spec = importlib.util.spec_from_file_location("hqlab_kernels.suffix_match", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module


def load_vllm_ngram(source: Path | None):
    """vLLM's NgramProposer class: from an installed vllm, else from a copy of its ngram_proposer.py (the module
    needs only numpy, torch and numba at run time; `vllm.config` is imported for a type annotation alone, so a
    placeholder stands in for it). Returns (class, description) or (None, why not)."""
    try:
        from vllm.v1.spec_decode.ngram_proposer import NgramProposer  # type: ignore

        import vllm  # type: ignore

        return NgramProposer, f"vllm {vllm.__version__}"
    except Exception:
        pass
    if source is None or not (source / "ngram_proposer.py").exists():
        return None, "vLLM not installed and no ngram_proposer.py given"
    try:
        import numba

        if "vllm" not in sys.modules:
            placeholder = types.ModuleType("vllm")
            config = types.ModuleType("vllm.config")
            config.VllmConfig = object
            placeholder.config = config
            sys.modules["vllm"], sys.modules["vllm.config"] = placeholder, config
        spec = importlib.util.spec_from_file_location("vllm_ngram_proposer", source / "ngram_proposer.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        version = (source / "VERSION").read_text().strip() if (source / "VERSION").exists() else "unknown"
        return module.NgramProposer, f"vllm {version} ngram_proposer.py, numba {numba.__version__}"
    except Exception as exc:  # report, don't hide: the row is then missing and the docs say why
        return None, f"could not load vLLM's ngram_proposer.py: {exc!r}"


def vllm_proposer(cls, batch: int, context: int):
    from types import SimpleNamespace as NS

    config = NS(
        speculative_config=NS(prompt_lookup_min=NMIN, prompt_lookup_max=NMAX, num_speculative_tokens=K),
        model_config=NS(max_model_len=context + K + 1),  # never truncates k
        scheduler_config=NS(max_num_seqs=batch),
        parallel_config=NS(tensor_parallel_size=1),
    )
    return cls(config)


# ----------------------------------------------------------------------------------------------------------------
# Workload
# ----------------------------------------------------------------------------------------------------------------


def make_histories(rng: np.random.Generator, batch: int, context: int) -> np.ndarray:
    """[batch, context] int32 token ids; each row ends with a copy of an earlier 16-token span."""
    h = rng.integers(0, VOCAB, (batch, context), dtype=np.int32)
    for row in h:
        src = int(rng.integers(0, context - 4 * PLANTED))
        row[-PLANTED:] = row[src : src + PLANTED]
    return h


def input_sets(torch, histories_list):
    """Device inputs per set: ragged (tokens, offsets, lengths) and the padded [B, L] view of the same memory."""
    sets = []
    for h in histories_list:
        batch, context = h.shape
        padded = torch.from_numpy(h).cuda()
        offsets = torch.arange(batch, dtype=torch.int64, device="cuda") * context
        lengths = torch.full((batch,), context, dtype=torch.int64, device="cuda")
        sets.append(dict(tokens=padded.view(-1), offsets=offsets, lengths=lengths, padded=padded))
    return sets


def n_input_sets(batch: int, context: int) -> int:
    # Enough sets to cycle through 3x the L2, capped for memory and build time.
    return int(min(16, max(2, -(-3 * L2_BYTES // (batch * context * 4)))))


# ----------------------------------------------------------------------------------------------------------------
# Timers
# ----------------------------------------------------------------------------------------------------------------


def time_graph(torch, steps, budget_s: float = 0.25, max_replays: int = 400) -> list[float]:
    """µs per step: capture STEPS_PER_GRAPH steps (cycling over `steps`) in one CUDA graph, time its replays."""
    calls = [steps[i % len(steps)] for i in range(STEPS_PER_GRAPH)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in steps:  # compile and warm up outside the capture
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    t_end = time.perf_counter() + budget_s
    graph.replay()
    while len(samples) < 5 or (time.perf_counter() < t_end and len(samples) < max_replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / len(calls))
    del graph
    return samples


def time_eager_gpu(torch, steps, budget_s: float = 0.25) -> list[float]:
    """µs per step of Python launches back to back (wall clock between synchronisations, 32 steps a sample)."""
    for call in steps:
        call()
    torch.cuda.synchronize()
    samples = []
    t_end = time.perf_counter() + budget_s
    while len(samples) < 5 or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        for i in range(STEPS_PER_GRAPH):
            steps[i % len(steps)]()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e6 / STEPS_PER_GRAPH)
    return samples


def time_cpu(step, budget_s: float = 0.5, max_samples: int = 50) -> list[float]:
    step()  # warm-up (vLLM: the Numba JIT)
    samples = []
    t_end = time.perf_counter() + budget_s
    while len(samples) < 3 or (time.perf_counter() < t_end and len(samples) < max_samples):
        t0 = time.perf_counter()
        step()
        samples.append((time.perf_counter() - t0) * 1e6)
    return samples


def time_interpreted(step) -> list[float]:
    """--smoke only: the interpreter has no graphs and no events."""
    step()
    t0 = time.perf_counter()
    step()
    return [(time.perf_counter() - t0) * 1e6]


# ----------------------------------------------------------------------------------------------------------------
# Floor kernels
# ----------------------------------------------------------------------------------------------------------------


def floor_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def empty_kernel(x):
        pass

    @triton.jit
    def read_kernel(tokens, n, out, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(tokens + i, mask=i < n, other=0)
        tl.store(out + pid, tl.max(x, axis=0))  # keeps the read alive

    return empty_kernel, read_kernel


# ----------------------------------------------------------------------------------------------------------------
# One shape
# ----------------------------------------------------------------------------------------------------------------


def bench_shape(torch, sm, batch, context, rng, vllm_cls, smoke: bool):
    histories = [make_histories(rng, batch, context) for _ in range(1 if smoke else n_input_sets(batch, context))]
    rows = []

    def add(method, samples, **extra):
        rows.append(dict(method=method, batch=batch, context=context, median_us=statistics.median(samples),
                         p10_us=float(np.percentile(samples, 10)), p90_us=float(np.percentile(samples, 90)),
                         n_samples=len(samples), input_sets=len(histories), **extra))
        print(f"  B={batch:>3} L={context:>8} {method:<28} {rows[-1]['median_us']:>12.1f} µs", flush=True)

    params = dict(nmin=NMIN, nmax=NMAX, k=K)
    if smoke:
        device_sets = [dict(tokens=torch.from_numpy(h).view(-1), padded=torch.from_numpy(h),
                            offsets=torch.arange(batch, dtype=torch.int64) * context,
                            lengths=torch.full((batch,), context, dtype=torch.int64)) for h in histories]
    else:
        device_sets = input_sets(torch, histories)

    # Triton kernels; check them against the reference on the first set while at it.
    reference = [sm_ref(h, params) for h in histories[0]]
    for method, variant in ((FUSED, "fused"), (SPLIT, "split"), (SINGLE, "single")):
        matcher = sm.SuffixMatcher(batch, device="cpu" if smoke else "cuda", variant=variant, max_len=context,
                                   **params)
        steps = [lambda s=s, m=matcher: m(s["tokens"], s["offsets"], s["lengths"]) for s in device_sets]
        out = steps[0]()
        check_against_reference(out, reference, method)
        if smoke:
            add(method, time_interpreted(steps[0]), splits=matcher.splits)
            continue
        add(method, time_graph(torch, steps), splits=matcher.splits)
        if variant == "fused":
            add(EAGER, time_eager_gpu(torch, steps), splits=matcher.splits)

    if not smoke:
        baseline = [lambda s=s: sm.suffix_match_torch(s["padded"], s["lengths"], **params) for s in device_sets]
        check_against_reference(baseline[0](), reference, TORCH)
        add(TORCH, time_graph(torch, baseline))

        empty_kernel, read_kernel = floor_kernels()
        scratch = torch.empty(1, device="cuda")
        add(EMPTY, time_graph(torch, [lambda: empty_kernel[(1,)](scratch)]))
        n = batch * context
        read_block = 4096
        partial = torch.empty(-(-n // read_block), dtype=torch.int32, device="cuda")
        reads = [lambda s=s: read_kernel[(partial.numel(),)](s["tokens"], n, partial, BLOCK=read_block)
                 for s in device_sets]
        add(READ, time_graph(torch, reads), bytes=n * 4)

    # CPU methods on the host CPU, on the first input set.
    h0 = histories[0]
    add(REFERENCE, time_cpu(lambda: [sm_ref(h, params) for h in h0], budget_s=0.5 if not smoke else 0.0))
    if vllm_cls is not None:
        bench_vllm(vllm_cls, h0, smoke, add)
    return rows


def bench_vllm(vllm_cls, h0, smoke, add):
    batch, context = h0.shape
    proposer = vllm_proposer(vllm_cls, batch, context)
    sampled = [[int(row[-1])] for row in h0]
    num_tokens = np.full(batch, context, dtype=np.int32)
    token_ids = np.ascontiguousarray(h0)

    def step():
        return proposer.propose(K, sampled, num_tokens, token_ids)

    drafts = step()
    # vLLM's policy is the earliest occurrence of the longest n-gram: compare with the "earliest" reference.
    earliest = [sm_ref(h, dict(nmin=NMIN, nmax=NMAX, k=K, policy="earliest")) for h in h0]
    agree = sum(d == r.tokens.tolist() for d, r in zip(drafts, earliest))
    add(VLLM, time_cpu(step, budget_s=0.5 if not smoke else 0.0), agree_with_earliest=agree)


def sm_ref(h, params):
    return suffix_match(h, **params)


def check_against_reference(out, reference, method):
    proposals, match_len, valid = (x.cpu().numpy() for x in out)
    for i, ref in enumerate(reference):
        got = (int(match_len[i]), int(valid[i]), proposals[i, : valid[i]].tolist())
        if got != (ref.match_len, ref.valid, ref.tokens.tolist()):
            raise AssertionError(f"{method}: request {i} differs from the reference: {got}")


# ----------------------------------------------------------------------------------------------------------------
# Machine description
# ----------------------------------------------------------------------------------------------------------------


def machine_info(torch, vllm_note: str) -> dict:
    import triton

    info = dict(torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                numpy=np.__version__, vllm=vllm_note, cpu=cpu_name(), cpu_count=os.cpu_count())
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda, driver=driver_version(),
                    sm_count=torch.cuda.get_device_properties(0).multi_processor_count)
    return info


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip() or "unknown"
    except Exception:
        return "unknown"


# ----------------------------------------------------------------------------------------------------------------
# Results: parquet, tables, acceptance, figure
# ----------------------------------------------------------------------------------------------------------------


def write_parquet(rows: list[dict], info: dict, path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = sorted({key for row in rows for key in row})
    table = pa.Table.from_pylist([{**{c: row.get(c) for c in columns}, **info} for row in rows])
    table = table.replace_schema_metadata({"machine": json.dumps(info)})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


def read_rows(path: Path) -> tuple[list[dict], dict]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    info = json.loads(table.schema.metadata[b"machine"])
    return table.to_pylist(), info


def lookup(rows, method, batch, context):
    for row in rows:
        if row["method"] == method and row["batch"] == batch and row["context"] == context:
            return row["median_us"]
    return None


def acceptance(rows, kernel: str = FUSED) -> list[dict]:
    """The issue's targets for one split-scan kernel, each with the measured value and whether it is met."""
    def ratio(a, b):
        return None if a is None or b is None else a / b

    at_1_128k = lookup(rows, kernel, 1, 131_072)
    at_64_32k = lookup(rows, kernel, 64, 32_768)
    floor_64_32k = max(filter(None, [lookup(rows, EMPTY, 64, 32_768), lookup(rows, READ, 64, 32_768)]),
                       default=None)
    targets = [
        ("batch 1 × 128k", at_1_128k, "µs", lambda v: v <= 10, "≤ 10 µs"),
        ("batch 64 × 32k", at_64_32k, "µs", lambda v: v <= 30, "≤ 30 µs"),
        ("speed-up over vLLM's CPU NgramProposer, batch 64 × 32k", ratio(lookup(rows, VLLM, 64, 32_768), at_64_32k),
         "×", lambda v: v >= 20, "≥ 20×"),
        ("speed-up over the single kernel, batch 1 × 128k", ratio(lookup(rows, SINGLE, 1, 131_072), at_1_128k),
         "×", lambda v: v >= 10, "≥ 10×"),
        ("time over the measured floor, batch 64 × 32k", ratio(at_64_32k, floor_64_32k), "×", lambda v: v <= 3,
         "≤ 3×"),
    ]
    return [dict(kernel=kernel, target=name, goal=goal, value=value, unit=unit,
                 met=None if value is None else bool(test(value))) for name, value, unit, test, goal in targets]


def markdown_tables(rows, info) -> str:
    shapes = sorted({(r["batch"], r["context"]) for r in rows})
    methods = [m for m in METHOD_ORDER if any(r["method"] == m for r in rows)]
    head = "| method | " + " | ".join(f"{b} × {c // 1024}k" for b, c in shapes) + " |"
    lines = [head, "|" + " --- |" * (len(shapes) + 1)]
    for m in methods:
        cells = []
        for b, c in shapes:
            v = lookup(rows, m, b, c)
            cells.append("–" if v is None else f"{v:,.1f}" if v < 1e4 else f"{v:,.0f}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    kernels = [m for m in (FUSED, SPLIT) if m in methods]
    lines += ["", "| target | goal | " + " | ".join(kernels) + " |", "| --- | --- |" + " --- |" * len(kernels)]
    per_kernel = [acceptance(rows, m) for m in kernels]
    for i, first in enumerate(per_kernel[0] if per_kernel else []):
        cells = []
        for results in per_kernel:
            a = results[i]
            value = "not measured" if a["value"] is None else f"{a['value']:.1f} {a['unit']}"
            cells.append(value + ("" if a["met"] is None else " (met)" if a["met"] else " (**not met**)"))
        lines.append(f"| {first['target']} | {first['goal']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows, info, figure: Path = FIGURE) -> None:
    import polars as pl

    from hqlab.plots import kernel_latency

    frame = pl.DataFrame([{k: r[k] for k in ("method", "batch", "context", "median_us")} for r in rows])
    chart = kernel_latency(frame, title=f"Suffix-match lookup, nmin {NMIN} / nmax {NMAX} / k {K}: "
                                        f"{info.get('gpu', 'GPU')} and its host CPU")
    figure.parent.mkdir(parents=True, exist_ok=True)
    chart.save(str(figure.with_suffix(".svg")))
    chart.save(str(figure.with_suffix(".png")), scale_factor=2)
    print(f"wrote {shown(figure.with_suffix('.svg'))} and .png")


# ----------------------------------------------------------------------------------------------------------------


SWEEP_SHAPES = [(1, 131_072), (64, 32_768), (64, 131_072), (1, 1_048_576)]
SWEEP_CONFIGS = [(block, warps) for block in (512, 1024, 2048, 4096) for warps in (2, 4, 8)]


def sweep(torch, sm, info, out: Path) -> None:
    """Graph-replayed latency of the split kernels over launch configurations (how the defaults were chosen)."""
    rng = np.random.default_rng(1)
    params = dict(nmin=NMIN, nmax=NMAX, k=K)
    rows = []
    for batch, context in SWEEP_SHAPES:
        histories = [make_histories(rng, batch, context) for _ in range(n_input_sets(batch, context))]
        device_sets = input_sets(torch, histories)
        reference = [sm_ref(h, params) for h in histories[0]]
        for variant in ("fused", "split"):
            for block, warps in SWEEP_CONFIGS:
                matcher = sm.SuffixMatcher(batch, variant=variant, max_len=context, block=block, num_warps=warps,
                                           device="cuda", **params)
                steps = [lambda s=s, m=matcher: m(s["tokens"], s["offsets"], s["lengths"]) for s in device_sets]
                check_against_reference(steps[0](), reference, f"{variant} {block}/{warps}")
                samples = time_graph(torch, steps, budget_s=0.1)
                rows.append(dict(variant=variant, block=block, num_warps=warps, splits=matcher.splits, batch=batch,
                                 context=context, median_us=statistics.median(samples), n_samples=len(samples)))
                print(f"  sweep B={batch:>3} L={context:>8} {variant:<6} block={block:<5} warps={warps} "
                      f"splits={matcher.splits:<4} {rows[-1]['median_us']:8.2f} µs", flush=True)
        del device_sets
        torch.cuda.empty_cache()
    write_parquet(rows, info, out)
    print(f"wrote {shown(out)}")


def shown(path: Path) -> str:
    """A path as printed: relative to the repository where it lies inside it."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return path.name


def run(args) -> None:
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if args.out == RESULTS:  # never overwrite the committed GPU results with a dry run
            args.out = Path(tempfile.gettempdir()) / "kernels_smoke.parquet"
    import torch

    if not args.smoke and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --smoke for a CPU dry run, --plot-only for the figure)")
    sm = load_kernels()
    vllm_cls, vllm_note = load_vllm_ngram(args.vllm_source)
    print(f"vLLM: {vllm_note}", flush=True)
    info = machine_info(torch, vllm_note)
    print(json.dumps(info), flush=True)
    if args.sweep:
        sweep(torch, sm, info, args.sweep_out)
        return
    rng = np.random.default_rng(0)
    rows = []
    for batch, context in SMOKE_SHAPES if args.smoke else SHAPES:
        rows += bench_shape(torch, sm, batch, context, rng, vllm_cls, args.smoke)
        if not args.smoke:
            torch.cuda.empty_cache()
    write_parquet(rows, info, args.out)
    print(f"wrote {shown(args.out)}\n")
    print(markdown_tables(rows, info))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plot-only", action="store_true", help="figure and tables from an existing parquet")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU dry run in the Triton interpreter")
    parser.add_argument("--sweep", action="store_true", help="time the split kernels over launch configurations")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--sweep-out", type=Path, default=SWEEP_RESULTS)
    parser.add_argument("--figure", type=Path, default=FIGURE)
    parser.add_argument("--vllm-source", type=Path, default=None,
                        help="folder holding vLLM's ngram_proposer.py (and VERSION), used when vllm is not installed")
    args = parser.parse_args()
    if args.plot_only:
        rows, info = read_rows(args.out)
        print(markdown_tables(rows, info))
        plot(rows, info, args.figure)
        return
    run(args)


if __name__ == "__main__":
    main()
