"""Where vLLM's host threads run, pinning the busy ones to cores of their own, and how fast a CPU runs (Linux).

A 0.5B model decoding at batch 1 on an H200 is host-bound: a step is ~2 ms of Python in the engine core, and the
GPU waits on it. `ThreadSampler` measures which threads of a set of processes are busy and on which CPUs they ran;
`pin_plan` gives each busy thread a whole core (its SMT siblings left idle) and every other thread the remaining
CPUs; `apply_pins` applies a plan with `os.sched_setaffinity` (per thread id). On the lent H200 pinning did not
remove the step's two speeds: the machine's CPU itself runs Python at two speeds (docs/vllm.md, "The host has two
speeds"), which `CpuSpeedProbe` measures on one CPU between requests.

Only /proc and /sys are read: nothing here imports vLLM, and the plan is a pure function (test_affinity.py beside
this file: `python -m pytest experiments/host_two_speeds`). The probes of this folder import it from here; it was
hqlab.engines.vllm.affinity while the benchmark could pin threads (`bench --pin-threads`, since removed).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hqlab.config import ConfigError

PROC = Path("/proc")
SYS_CPU = Path("/sys/devices/system/cpu")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
START_CPUS = frozenset(os.sched_getaffinity(0))  # what this process could use before anything was pinned


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """'0-3,8,10-11' -> (0, 1, 2, 3, 8, 10, 11) (the kernel's cpu-list format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            cpus += range(int(lo), int(hi or lo) + 1)
        except ValueError:
            raise ConfigError(f"not a CPU list: {text!r} (expected e.g. '0-3,8')") from None
    return tuple(sorted(set(cpus)))


def cores(root: Path = SYS_CPU, allowed: set[int] | None = None) -> list[tuple[int, ...]]:
    """The machine's cores as groups of hardware threads (SMT siblings), from sysfs, restricted to `allowed` (by
    default the CPUs this process may run on). A CPU without topology information is a core of its own."""
    allowed = set(os.sched_getaffinity(0)) if allowed is None else set(allowed)
    groups: set[tuple[int, ...]] = set()
    for cpu in sorted(allowed):
        path = root / f"cpu{cpu}" / "topology" / "thread_siblings_list"
        siblings = parse_cpu_list(path.read_text()) if path.exists() else (cpu,)
        groups.add(tuple(c for c in siblings if c in allowed) or (cpu,))
    return sorted(groups)


@dataclass(frozen=True)
class ThreadId:
    pid: int
    tid: int
    name: str


def children(pid: int) -> list[int]:
    """Every descendant process of `pid` (from /proc's parent links)."""
    parent: dict[int, int] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        frontier = [c for c, p in parent.items() if p in frontier]
        found += frontier
    return sorted(found)


def threads(pids: list[int]) -> list[ThreadId]:
    out = []
    for pid in pids:
        try:
            for task in (PROC / str(pid) / "task").iterdir():
                try:
                    name = (task / "comm").read_text().strip()
                except OSError:
                    continue
                out.append(ThreadId(pid, int(task.name), name))
        except OSError:
            continue
    return out


def _stat(t: ThreadId) -> tuple[float, int] | None:
    """(CPU seconds used, CPU it last ran on) of one thread, or None if it is gone."""
    try:
        fields = (PROC / str(t.pid) / "task" / str(t.tid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # after the command name: field 3 is fields[0]; utime 14, stime 15, processor 39
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS, int(fields[36])


@dataclass
class ThreadUse:
    thread: ThreadId
    cpu_s: float = 0.0
    cpus: dict[int, int] = field(default_factory=dict)  # CPU -> samples seen running there

    def share(self, wall_s: float) -> float:
        return self.cpu_s / wall_s if wall_s > 0 else 0.0


def _sample_into(pids: list[int], use: dict[int, ThreadUse], start: dict[int, float], skip: int) -> None:
    for t in threads(pids):
        if t.pid == skip:
            continue
        got = _stat(t)
        if got is None:
            continue
        cpu_s, cpu = got
        u = use.setdefault(t.tid, ThreadUse(t))
        start.setdefault(t.tid, cpu_s)
        u.cpu_s = cpu_s - start[t.tid]
        u.cpus[cpu] = u.cpus.get(cpu, 0) + 1


def _sampler_process(pids: list[int], interval_s: float, stop: Any, conn: Any) -> None:
    use: dict[int, ThreadUse] = {}
    start: dict[int, float] = {}
    me = os.getpid()
    _sample_into(pids, use, start, me)
    while not stop.wait(interval_s):
        _sample_into(pids, use, start, me)
    _sample_into(pids, use, start, me)
    conn.send(use)
    conn.close()


class ThreadSampler:
    """Samples every thread of `pids` every `interval_s` while open: CPU time used and the CPU each last ran on.
    The sampling runs in a forked process of its own, so it takes no GIL from the threads it watches.

        with ThreadSampler([os.getpid(), *children(os.getpid())]) as s:
            ...  # the work
        busy = s.busy(0.25)  # threads that used at least a quarter of a CPU
    """

    def __init__(self, pids: list[int], interval_s: float = 0.01) -> None:
        if interval_s <= 0:
            raise ConfigError(f"interval_s must be > 0 (got {interval_s})")
        self.pids, self.interval_s = list(pids), interval_s
        self.use: dict[int, ThreadUse] = {}
        self.wall_s = 0.0

    def __enter__(self) -> "ThreadSampler":
        import multiprocessing as mp

        ctx = mp.get_context("fork")  # the child only reads /proc: no CUDA, no imports
        self._stop = ctx.Event()
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_sampler_process, args=(self.pids, self.interval_s, self._stop, send),
                                 daemon=True)
        self._proc.start()
        send.close()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self._t0
        self._stop.set()
        try:
            self.use = self._recv.recv() if self._recv.poll(30) else {}
        finally:
            self._proc.join(10)

    def busy(self, min_share: float = 0.25) -> list[ThreadUse]:
        """Threads that used at least `min_share` of one CPU over the sampled time, busiest first."""
        return sorted((u for u in self.use.values() if u.share(self.wall_s) >= min_share),
                      key=lambda u: -u.cpu_s)


def python_unit() -> int:
    """About a millisecond of interpreter work (on a 2020s server core), like a slice of a host-bound decode step:
    the fixed workload whose time tells how fast a CPU runs Python right now
    (experiments/host_two_speeds/host_speed.py)."""
    total = 0
    for i in range(20_000):
        total += i * i % 7
    return total


def _probe_process(cpu: int, conn: Any) -> None:
    os.sched_setaffinity(0, {cpu})
    while True:
        units = conn.recv()
        if units is None:
            break
        times = []
        for _ in range(units):
            t = time.perf_counter()
            python_unit()
            times.append((time.perf_counter() - t) * 1e3)
        times.sort()
        conn.send(times[len(times) // 2])
    conn.close()


class CpuSpeedProbe:
    """A process pinned to one CPU that, when asked, times `python_unit` there and answers the median in ms.

    Asked between two requests, when the engine-core thread pinned to that CPU is idle, it tells the speed that
    CPU runs Python at that moment: on a VM whose CPU changes speed in episodes of seconds (docs/vllm.md, "The host
    has two speeds"), a covariate for the requests around it. It waits on a pipe otherwise (no CPU)."""

    def __init__(self, cpu: int) -> None:
        import multiprocessing as mp

        if cpu not in START_CPUS:
            raise ConfigError(f"CPU {cpu} is not one this process may use ({sorted(START_CPUS)})")
        self.cpu = cpu
        ctx = mp.get_context("fork")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_probe_process, args=(cpu, child), daemon=True)
        self._proc.start()
        child.close()

    def measure(self, units: int = 5) -> float:
        if units < 1:
            raise ConfigError(f"units must be >= 1 (got {units})")
        self._conn.send(units)
        if not self._conn.poll(30):
            raise RuntimeError(f"the speed probe on CPU {self.cpu} did not answer in 30 s")
        return float(self._conn.recv())

    def close(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._proc.join(5)


def pin_plan(busy: list[int], others: list[int], machine_cores: list[tuple[int, ...]]
             ) -> dict[int, tuple[int, ...]]:
    """Thread id -> CPUs. Each busy thread (busiest first) gets the first hardware thread of a core of its own,
    whose siblings nobody else may use; every other thread gets the CPUs of the cores left over. Refuses a machine
    with fewer than len(busy) + 1 cores (the others need somewhere to run)."""
    if len(set(busy)) != len(busy) or set(busy) & set(others):
        raise ConfigError("pin_plan: a thread is listed twice (busy and others must be disjoint, without repeats)")
    if len(machine_cores) < len(busy) + 1:
        raise ConfigError(f"pin_plan: {len(busy)} busy threads need {len(busy) + 1} cores, the machine offers "
                          f"{len(machine_cores)}: pin fewer threads")
    # the last cores for the busy threads: CPU 0's core keeps the kernel's and the others' work
    mine = machine_cores[-len(busy):] if busy else []
    rest = tuple(c for core in machine_cores[: len(machine_cores) - len(busy)] for c in core)
    plan = {tid: (core[0],) for tid, core in zip(busy, mine)}
    plan.update({tid: rest for tid in others})
    return plan


def apply_pins(plan: dict[int, tuple[int, ...]]) -> dict[int, str]:
    """Sets each thread's CPUs; returns thread id -> error for threads that could not be pinned (gone, or not
    permitted), so that a caller can say what was left unpinned."""
    failed = {}
    for tid, cpus in plan.items():
        try:
            os.sched_setaffinity(tid, set(cpus))
        except OSError as e:
            failed[tid] = f"{type(e).__name__}: {e}"
    return failed


def unpin(tid: int = 0) -> None:
    """Gives a thread (default: the calling one) back every CPU the process started with. Call it before starting
    new processes from a pinned thread: they would inherit its single CPU."""
    os.sched_setaffinity(tid, START_CPUS)


def pin_busy(pids: list[int], sampled: ThreadSampler, *, min_share: float = 0.25) -> dict[str, object]:
    """Pins the threads of `pids` that were busy while `sampled` ran (`ThreadSampler.busy`) to cores of their own
    and every other thread of `pids` to the rest. Returns what was done, for the run's description."""
    busy = [u.thread.tid for u in sampled.busy(min_share)]
    everyone = threads(pids)
    others = [t.tid for t in everyone if t.tid not in busy]
    machine_cores = cores()
    plan = pin_plan(busy, others, machine_cores)
    failed = apply_pins(plan)
    names = {t.tid: f"{t.pid}/{t.name}" for t in everyone}
    return {"cores": [list(c) for c in machine_cores],
            "busy": {names.get(tid, str(tid)): list(plan[tid]) for tid in busy},
            "others": len(others), "failed": {names.get(t, str(t)): e for t, e in failed.items()}}


__all__ = ["parse_cpu_list", "cores", "ThreadId", "children", "threads", "ThreadUse", "ThreadSampler", "pin_plan",
           "apply_pins", "unpin", "pin_busy", "python_unit", "CpuSpeedProbe"]
