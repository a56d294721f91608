"""Does the host's CPU run at one speed? A fixed piece of Python timed over and over, no GPU, no vLLM.

vLLM's decode step with a small model is host-bound, and on the lent H200 its cost falls into two levels about
1.45x apart that persist for seconds (docs/vllm.md, "Host speed"). If a fixed pure-Python workload on an otherwise
idle machine shows the same two levels, the cause is below the Python of vLLM and hqlab: the machine's CPU.

Phases: `alone` runs one worker on one CPU; `all` runs one worker on every CPU at once (if two of the machine's
CPUs are hardware threads of one core, their workers slow each other there, whatever the topology the VM reports).

    python3 experiments/host_two_speeds/host_speed.py --seconds 30 --out $OUT/host_speed.parquet
writes one row per timed unit: phase, cpu, t (s since the phase began), unit_ms.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from affinity import python_unit  # noqa: E402  (the fixed workload beside this file; imports no vLLM)


def worker(cpu: int, seconds: float, start: float, out: mp.Queue) -> None:
    os.sched_setaffinity(0, {cpu})
    rows = []
    while time.perf_counter() < start:
        pass
    t0 = time.perf_counter()
    while (now := time.perf_counter()) - t0 < seconds:
        python_unit()
        rows.append((now - t0, (time.perf_counter() - now) * 1e3))
    out.put((cpu, rows))


def phase(cpus: list[int], seconds: float) -> list[tuple[int, float, float]]:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    start = time.perf_counter() + 0.5
    procs = [ctx.Process(target=worker, args=(c, seconds, start, out)) for c in cpus]
    for p in procs:
        p.start()
    got = [out.get() for _ in procs]
    for p in procs:
        p.join()
    return [(cpu, t, ms) for cpu, rows in got for t, ms in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="per phase")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "host_speed.parquet"))
    args = ap.parse_args(argv)
    if args.seconds <= 0:
        raise SystemExit(f"--seconds must be > 0 (got {args.seconds})")
    import pyarrow as pa
    import pyarrow.parquet as pq

    cpus = sorted(os.sched_getaffinity(0))
    rows: list[dict] = []
    for name, chosen in (("alone", [cpus[-1]]), ("all", cpus)):
        got = phase(chosen, args.seconds)
        rows += [{"phase": name, "cpu": cpu, "t": t, "unit_ms": ms} for cpu, t, ms in got]
        ms = sorted(r[2] for r in got)
        print(f"{name}: {len(chosen)} CPUs, {len(got)} units, p10 {ms[len(ms) // 10]:.3f} ms, "
              f"median {ms[len(ms) // 2]:.3f} ms, p90 {ms[9 * len(ms) // 10]:.3f} ms", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), args.out + ".tmp")
        os.replace(args.out + ".tmp", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
