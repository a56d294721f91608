"""The one driver of the GPU benchmarks (`hqlab.bench.runner`): the command line every GPU benchmark shares (no
abbreviated option, --tag/--commit/--plan/--budget-s, a plan filling what the command line leaves out), `host`
printing a GPU command's host call only after checking it here, the raw files rewritten whole, the budget, a bounded
command ended with its whole session, and the GPU side of every benchmark importing no polars (the host has none)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from hqlab.bench import runner

ROOT = Path(__file__).resolve().parents[2]
PLANS = sorted((ROOT / "benchmarks" / "plans").glob("*.json"))
GPU_SIDE = ["hqlab.bench.runner", "hqlab.bench.vllm_runs", "hqlab.bench.serve", "hqlab.bench.corpus_runs",
            "hqlab.bench.step_cost", "hqlab.bench.seed_scale", "hqlab.bench.gpu_timing"]


def toy(budget_s: float | None = 60.0) -> runner.Benchmark:
    """A benchmark with one GPU command (`bench`, a plan of `configs` and `repeats`, two repeats by default) and a
    `finish`; each records the arguments it ran with in `ran`."""
    cli = runner.Benchmark("benchmarks/toy.py", "a toy")
    cli.ran = []
    bench = cli.gpu("bench", cli.ran.append, "GPU", plan={"configs": "config", "repeats": "repeats"},
                    lists=("configs",), budget_s=budget_s, defaults={"repeats": 2},
                    check=lambda args, parser: args.repeats < 1 and parser.error("--repeats must be >= 1"))
    bench.add_argument("--config", action="append", default=None)
    bench.add_argument("--repeats", type=int, default=None)
    bench.add_argument("--out-len", type=int, default=8)
    finish = cli.command("finish", cli.ran.append, "CPU", commit=True)
    finish.add_argument("returned")
    return cli


def test_a_gpu_command_takes_the_shared_options_and_refuses_abbreviations(capsys):
    cli = toy()
    assert cli.main(["bench", "--tag", "t1", "--config", "none"]) == 0
    args = cli.ran[-1]
    assert (args.tag, args.commit, args.config, args.repeats, args.budget_s) == ("t1", "unknown", ["none"], 2, 60.0)
    assert args.budget.seconds == 60.0
    for argv in (["bench", "--tag", "t1", "--out", "3"], ["bench", "--tag", "t1", "--budget", "9"],
                 ["finish", "x", "--result", "r"], ["bench"]):
        with pytest.raises(SystemExit) as refused:
            cli.main(argv)
        assert refused.value.code == 2, argv
    err = capsys.readouterr().err
    assert "unrecognized arguments: --out 3" in err and "the following arguments are required: --tag" in err
    with pytest.raises(SystemExit):
        cli.main(["bench", "--tag", "t1", "--repeats", "0"])  # the command's own check, before it runs
    assert "--repeats must be >= 1" in capsys.readouterr().err and len(cli.ran) == 1


def test_a_plan_fills_what_the_command_line_leaves_out_and_refuses_unknown_keys(tmp_path):
    cli = toy()
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"why": "a note", "configs": {"a": "none", "b": "lookup:k=7"}, "repeats": 5}))
    cli.main(["bench", "--tag", "t", "--plan", str(plan)])
    assert (cli.ran[-1].config, cli.ran[-1].repeats) == (["none", "lookup:k=7"], 5)
    cli.main(["bench", "--tag", "t", "--plan", str(plan), "--repeats", "3", "--config", "none"])
    assert (cli.ran[-1].config, cli.ran[-1].repeats) == (["none"], 3)  # the command line wins
    plan.write_text(json.dumps({"configs": ["none"], "repeat": 5}))
    with pytest.raises(SystemExit, match="no option repeat"):  # a misspelt key would run the default on the GPU
        cli.main(["bench", "--tag", "t", "--plan", str(plan)])
    plan.write_text(json.dumps({"configs": "none"}))
    with pytest.raises(SystemExit, match="configs must be a list"):
        cli.main(["bench", "--tag", "t", "--plan", str(plan)])
    plan.write_text("[1, 2]")
    with pytest.raises(SystemExit, match="expected a JSON object"):
        cli.main(["bench", "--tag", "t", "--plan", str(plan)])
    with pytest.raises(SystemExit, match="no_such.json"):
        cli.main(["bench", "--tag", "t", "--plan", str(tmp_path / "no_such.json")])


def test_a_list_default_is_never_grown_by_one_call_for_the_next(tmp_path):
    cli = runner.Benchmark("benchmarks/toy.py", "a toy")
    ran = []

    def grow(args, plan):
        args.config += plan["configs"]

    bench = cli.gpu("bench", ran.append, "GPU", plan=grow, plan_keys=("configs",))
    bench.add_argument("--config", action="append", default=[])
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"configs": ["none", "lookup:k=7", "lookup:k=15"]}))
    cli.main(["bench", "--tag", "t", "--plan", str(plan)])
    cli.main(["bench", "--tag", "t"])
    assert len(ran[0].config) == 3 and ran[1].config == []


def test_host_prints_the_call_of_a_checked_gpu_command_with_its_commit_and_log():
    cli = toy()
    call = cli.host_call(["bench", "--tag", "s9", "--config", "none"], commit="abc1234")
    assert shlex.split(call) == ["python3", "tools/gpu_host/vllm_host.py", "run", "--log", "toy_s9.log", "--",
                                 "python3", "benchmarks/toy.py", "bench", "--tag", "s9", "--config", "none",
                                 "--commit", "abc1234"]
    assert "--commit def" in cli.host_call(["bench", "--tag", "s9", "--commit", "def"], commit="abc1234")
    assert "--log mine.log" in cli.host_call(["bench", "--tag", "s9"], log_name="mine.log", commit="abc1234")
    with pytest.raises(SystemExit, match="name a GPU command"):
        cli.host_call(["finish", "x"])
    with pytest.raises(SystemExit):  # checked as the host would parse it: no call is printed for a bad one
        cli.host_call(["bench", "--tag", "s9", "--repeats", "0"], commit="abc1234")
    assert not cli.ran  # nothing ran


@pytest.mark.parametrize("path", [p for p in PLANS if "command" in json.loads(p.read_text())], ids=lambda p: p.stem)
def test_every_plan_states_the_host_call_its_benchmark_prints(path):
    """A plan's `command` is the call `host` prints for it (less the commit it adds): the plan parses, and every
    option of the call is one its benchmark takes today."""
    stated = shlex.split(json.loads(path.read_text())["command"])
    script = stated[stated.index("--") + 2]
    module = __import__(f"benchmarks.{Path(script).stem}", fromlist=["CLI"])
    call = stated[stated.index(script) + 1:]
    assert shlex.split(module.CLI.host_call(call, commit="abc1234")) == stated + ["--commit", "abc1234"]


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def monotonic(self) -> float:
        return self.t


def test_the_budget_counts_from_its_start(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(runner, "time", types.SimpleNamespace(monotonic=clock.monotonic, strftime=time.strftime))
    budget = runner.Budget(30)
    clock.t += 20
    assert (budget.spent(), budget.left(), budget.over()) == (20, 10, False)
    assert budget.fits(10) and not budget.fits(10.5)
    clock.t += 11
    assert budget.over() and budget.left() == -1


def test_raw_files_are_rewritten_whole_and_lines_appended(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    out = runner.out_dir()
    assert out == tmp_path / "out" and out.is_dir()
    runner.save_table(out / "raw.parquet", [{"a": 1, "b": "x"}])
    runner.save_table(out / "raw.parquet", pa.table({"a": [1, 2]}))  # a later point's whole table replaces it
    assert pq.read_table(out / "raw.parquet").to_pylist() == [{"a": 1}, {"a": 2}]
    runner.save_json(out / "meta.json", {"k": [1, 2]}, indent=1)
    assert json.loads((out / "meta.json").read_text()) == {"k": [1, 2]}
    runner.append_jsonl(tmp_path / "rows.jsonl", {"i": 1})
    runner.append_jsonl(tmp_path / "rows.jsonl", {"i": 2})
    runner.copy_out([tmp_path / "rows.jsonl", tmp_path / "missing.jsonl"], out)
    assert (out / "rows.jsonl").read_text() == '{"i": 1}\n{"i": 2}\n'
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "raw.parquet", "rows.jsonl"]  # no .tmp left


def test_a_bounded_command_past_its_time_is_ended_with_its_whole_session(tmp_path):
    """An engine core outlives the benchmark process that started it unless its whole session is ended: a child
    started by the command (here a `sleep`) must be gone after the timeout."""
    pid_file = tmp_path / "child.pid"
    assert runner.run_bounded(["sh", "-c", f"sleep 30 & echo $! > {pid_file}; wait"], 1.0) == "timeout"
    child = int(pid_file.read_text())

    def alive() -> bool:
        try:
            state = open(f"/proc/{child}/status").read()
        except FileNotFoundError:
            return False
        return "\nState:\tZ" not in state  # a zombie waiting for its reaper has ended

    deadline = time.monotonic() + 5
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive()
    assert runner.run_bounded(["sh", "-c", "exit 3"], 5.0) == 3


def test_the_model_runners_of_a_run_are_listed_once_in_upper_case():
    assert runner.vllm_runners(["v1", None, "V2", "v1", ""]) == ["V1", "V2"]
    assert runner.vllm_runners([None, ""]) is None


BLOCK_POLARS = ("import sys\nclass Block:\n    def find_spec(self, name, path=None, target=None):\n"
                "        if name == 'polars' or name.startswith('polars.'):\n"
                "            raise ImportError('no polars on the GPU host')\n"
                "sys.meta_path.insert(0, Block())\n")


@pytest.mark.parametrize("module", GPU_SIDE)
def test_the_gpu_side_modules_import_without_polars(module):
    probe = BLOCK_POLARS + f"import {module}\nprint(sorted(m for m in sys.modules if m.startswith('polars')))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("argv", [
    ["benchmarks/vllm_gpu.py", "bench", "--help"], ["benchmarks/vllm_serve.py", "together", "--help"],
    ["benchmarks/vllm_serve.py", "bench", "--help"], ["benchmarks/vllm_step_cost.py", "run", "--help"],
    ["benchmarks/vllm_corpus.py", "bench", "--tag", "c3", "--plan", "benchmarks/plans/corpus_c3.json", "--dry-run"],
    ["benchmarks/seed_scale_validation.py", "plan", "--none-grid"]], ids=lambda a: " ".join(a[:2]))
def test_each_gpu_benchmark_parses_and_plans_without_polars(argv):
    """What a GPU call runs before its first engine (the script's imports, its options, a corpus plan's points, the
    validation's items) runs where polars cannot be imported."""
    probe = BLOCK_POLARS + f"import runpy\nsys.argv = {argv!r}\nrunpy.run_path({argv[0]!r}, run_name='__main__')"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "usage:" in out.stdout or "point 17:" in out.stdout or "decode qwen2.5-coder-1.5b" in out.stdout
