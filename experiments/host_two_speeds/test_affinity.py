"""Host-thread sampling and pinning (`affinity.py` beside this file): real threads of this process, the real sysfs."""

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from hqlab.config import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parent))

import affinity  # noqa: E402  (the probe's module, beside this file)


def test_cpu_lists_parse_as_the_kernel_writes_them():
    assert affinity.parse_cpu_list("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert affinity.parse_cpu_list("5") == (5,)
    with pytest.raises(ConfigError, match="not a CPU list"):
        affinity.parse_cpu_list("0-a")


def test_cores_cover_every_allowed_cpu_once(tmp_path):
    found = affinity.cores()
    cpus = [c for core in found for c in core]
    assert sorted(cpus) == sorted(os.sched_getaffinity(0))
    # a fake sysfs with two-way SMT: siblings are grouped, CPUs outside `allowed` dropped
    for cpu, sib in {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}.items():
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(sib + "\n")
    assert affinity.cores(tmp_path, allowed={0, 1, 2, 3}) == [(0, 2), (1, 3)]
    assert affinity.cores(tmp_path, allowed={0, 1, 3}) == [(0,), (1, 3)]


def test_plan_gives_each_busy_thread_a_whole_core():
    smt = [(0, 8), (1, 9), (2, 10), (3, 11)]
    plan = affinity.pin_plan([101, 102], [200, 201], smt)
    assert plan[101] == (2,) and plan[102] == (3,)  # the last cores, CPU 0's core left to the others
    assert plan[200] == plan[201] == (0, 8, 1, 9)  # nobody else on 2, 3 or their siblings 10, 11
    assert affinity.pin_plan([], [5], smt) == {5: (0, 8, 1, 9, 2, 10, 3, 11)}
    with pytest.raises(ConfigError, match="need 5 cores"):
        affinity.pin_plan([1, 2, 3, 4], [], smt)
    with pytest.raises(ConfigError, match="twice"):
        affinity.pin_plan([1], [1], smt)


def test_sampler_finds_a_spinning_thread_and_pinning_moves_it():
    stop = threading.Event()
    tid: list[int] = []

    def spin() -> None:
        tid.append(threading.get_native_id())
        while not stop.is_set():
            pass

    worker = threading.Thread(target=spin, name="spinner", daemon=True)
    worker.start()
    try:
        with affinity.ThreadSampler([os.getpid()], interval_s=0.005) as s:
            time.sleep(0.4)
        busy = s.busy(0.25)
        assert tid[0] in [u.thread.tid for u in busy]
        use = next(u for u in busy if u.thread.tid == tid[0])
        assert use.share(s.wall_s) > 0.25 and sum(use.cpus.values()) > 10
        target = sorted(os.sched_getaffinity(0))[-1]
        assert affinity.apply_pins({tid[0]: (target,)}) == {}
        assert os.sched_getaffinity(tid[0]) == {target}
        assert "ProcessLookupError" in affinity.apply_pins({2**22 + 12345: (target,)})[2**22 + 12345]
    finally:
        stop.set()
        worker.join()


def test_children_lists_a_started_process():
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        assert child.pid in affinity.children(os.getpid())
        assert any(t.pid == child.pid for t in affinity.threads([child.pid]))
    finally:
        child.kill()
        child.wait()


def test_speed_probe_times_python_on_its_own_cpu():
    cpu = sorted(os.sched_getaffinity(0))[-1]
    probe = affinity.CpuSpeedProbe(cpu)
    try:
        probe.measure(1)  # the process pins itself before it answers
        assert os.sched_getaffinity(probe._proc.pid) == {cpu}
        t = time.perf_counter()
        affinity.python_unit()
        here = (time.perf_counter() - t) * 1e3
        got = [probe.measure(3) for _ in range(3)]
        assert all(0 < ms < 50 * here + 50 for ms in got)  # the same unit, on a CPU of the same machine
        with pytest.raises(ConfigError, match="units must be >= 1"):
            probe.measure(0)
    finally:
        probe.close()
    assert not probe._proc.is_alive()
    with pytest.raises(ConfigError, match="is not one this process may use"):
        affinity.CpuSpeedProbe(10_000)
