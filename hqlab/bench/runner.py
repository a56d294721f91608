"""The one driver of the GPU benchmarks: plan -> host -> raw -> finish.

A GPU benchmark (benchmarks/vllm_*.py, benchmarks/seed_scale_validation.py) is a `Benchmark`: its GPU commands run on
an offline host through `tools/gpu_host/vllm_host.py run`, write raw files into $OUT and rewrite them after every
point (a call cut at its limit still returns every point it finished); its `finish` turns what came back into a run of
the results folder (`finish_run`, which calls `hqlab.bench.results.write_run`). What this module owns, so that no
benchmark does it again:

- the command line: subcommands that refuse abbreviated options (a guessed `--out` once ran as `--output-len`), and
  on every GPU command `--tag` (the run's name), `--commit` (the code that runs: the host's copy has no history),
  `--plan` (a committed JSON file filling the options the command line leaves out) and `--budget-s`;
- `host`: the host call of a GPU command, its arguments and plan checked here first, its commit filled in, its log
  named as `finish` looks for it (`<script>_<tag>.log`);
- `log`, `out_dir`, the raw writers (`save_table`, `save_json`, `append_jsonl`, `copy_out`), `Budget` and
  `run_bounded` (a command in a session of its own, ended whole when its time is spent).

Standard library only at import (pyarrow inside `save_table`): the GPU host has no polars.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from hqlab.io import REPO, write_atomic

HOST = "tools/gpu_host/vllm_host.py"
PLAN_NOTES = ("why", "command", "finish")  # keys of a plan that are notes for the reader, not options
REQUIRED = object()  # `tag=REQUIRED`: the GPU command has no default tag


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def out_dir(default: str | Path = "out") -> Path:
    """The folder a GPU call returns ($OUT on the host; `default` elsewhere), created."""
    out = Path(os.environ.get("OUT") or default)
    out.mkdir(parents=True, exist_ok=True)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Raw files, rewritten whole after every point


def save_table(path: str | Path, rows: Any) -> Path:
    """A parquet file of `rows` (a pyarrow Table, or a list of dicts), written atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(list(rows))
    return write_atomic(path, lambda tmp: pq.write_table(table, str(tmp)))


def save_json(path: str | Path, obj: Any, *, indent: int | None = None) -> Path:
    body = json.dumps(obj, indent=indent) + "\n"
    return write_atomic(path, lambda tmp: tmp.write_text(body))


def append_jsonl(path: str | Path, row: Mapping[str, Any]) -> None:
    """One line more, on disk before this returns (a call killed at its limit keeps every line it wrote)."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def copy_out(paths: Iterable[str | Path], out: str | Path) -> None:
    """Copy the files of `paths` that exist into `out` (files kept in a work folder that outlives one call)."""
    for path in map(Path, paths):
        if path.exists():
            shutil.copy(path, Path(out) / path.name)


# ---------------------------------------------------------------------------------------------------------------
# Time


class Budget:
    """A call's seconds, counted from its start: what is spent, what is left, and whether more work still fits."""

    def __init__(self, seconds: float) -> None:
        self.seconds = float(seconds)
        self.started = time.monotonic()

    def spent(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float:
        return self.seconds - self.spent()

    def over(self) -> bool:
        return self.spent() > self.seconds

    def fits(self, more_s: float) -> bool:
        """Whether work expected to take `more_s` seconds would end within the budget."""
        return self.spent() + more_s <= self.seconds


def run_bounded(cmd: Sequence[str], timeout_s: float, **kwargs: Any) -> int | str:
    """Run `cmd` in a session of its own and wait at most `timeout_s`: on timeout every process of that session is
    killed (a vLLM engine core or worker started by the command must not outlive it holding GPU memory) and
    "timeout" is returned, else the exit status."""
    proc = subprocess.Popen(list(cmd), start_new_session=True, **kwargs)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
        try:  # the session's other processes (engine cores) may outlive its leader
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return "timeout"


# ---------------------------------------------------------------------------------------------------------------
# Plans


def load_plan(path: str | Path, options: Iterable[str] | None = None) -> dict[str, Any]:
    """A committed plan: a JSON object (a path relative to the checkout, or absolute). With `options`, a key that is
    neither one of them nor a note (PLAN_NOTES) is refused, naming it: a misspelt key would silently run the
    defaults on the GPU."""
    where = Path(path) if Path(path).is_absolute() or Path(path).exists() else REPO / path
    try:
        plan = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"--plan {path}: {e}") from None
    if not isinstance(plan, dict):
        raise SystemExit(f"--plan {path}: expected a JSON object")
    if options is not None:
        unknown = sorted(set(plan) - set(options) - set(PLAN_NOTES))
        if unknown:
            raise SystemExit(f"--plan {path}: no option {', '.join(unknown)} (its keys: "
                             f"{', '.join(sorted(options))}; notes: {', '.join(PLAN_NOTES)})")
    return plan


def fill_from_plan(args: argparse.Namespace, plan: Mapping[str, Any], keys: Mapping[str, str],
                   lists: Iterable[str] = ()) -> None:
    """Set each option the command line left unset (None) from the plan key that names it (`keys`: plan key ->
    option); keys in `lists` must hold lists, and a dict there gives its values (configs by name)."""
    for key, dest in keys.items():
        if key not in plan or getattr(args, dest) is not None:
            continue
        value = plan[key]
        if key in lists:
            if isinstance(value, dict):
                value = list(value.values())
            if not isinstance(value, list):
                raise SystemExit(f"--plan {args.plan}: {key} must be a list")
        setattr(args, dest, value)


# ---------------------------------------------------------------------------------------------------------------
# The command line


class Benchmark:
    """A GPU benchmark's command line. `gpu` adds a command that runs on the host, `command` any other (its
    `finish`), and `main` parses, applies a plan and the defaults, starts the budget (`args.budget`) and runs the
    command; `host GPU_COMMAND ARGS...` prints that command's host call instead."""

    def __init__(self, script: str, doc: str) -> None:
        self.script = script  # relative to the checkout: "benchmarks/vllm_serve.py"
        self.parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
                                              allow_abbrev=False)
        self.commands = self.parser.add_subparsers(dest="cmd", required=True)
        self.run: dict[str, Callable[[argparse.Namespace], int | None]] = {}
        self.gpu_commands: dict[str, dict[str, Any]] = {}
        self.parsers: dict[str, argparse.ArgumentParser] = {}
        host = self.commands.add_parser("host", allow_abbrev=False, help="print the host call of a GPU command "
                                        "(its arguments and plan checked here, its commit filled in)")
        host.add_argument("--log", default=None, help="the log's name under $OUT (default <script>_<tag>.log)")
        host.add_argument("call", nargs=argparse.REMAINDER, help="the GPU command and its arguments")

    def _command(self, name: str, run: Callable, help: str) -> argparse.ArgumentParser:
        parser = self.commands.add_parser(name, help=help, allow_abbrev=False)
        self.run[name], self.parsers[name] = run, parser
        return parser

    def gpu(self, name: str, run: Callable[[argparse.Namespace], int | None], help: str, *, tag: Any = REQUIRED,
            commit: bool = True, plan: Mapping[str, str] | Callable | None = None, plan_keys: Iterable[str] = (),
            lists: Iterable[str] = (), budget_s: float | None | bool = False,
            defaults: Mapping[str, Any] | None = None,
            check: Callable[[argparse.Namespace, argparse.ArgumentParser], None] | None = None
            ) -> argparse.ArgumentParser:
        """A command for the GPU host. `plan`: the plan keys and the options they fill (`fill_from_plan`, `lists`
        the keys holding lists), or a function (args, plan) that applies a plan of `plan_keys` its own way;
        `budget_s`: the default of --budget-s (False: no such option); `defaults`: values for options still None
        after the plan; `check(args, parser)`: refuses arguments that parse but cannot run (`parser.error`), here
        and in `host`, before anything starts on the host."""
        parser = self._command(name, run, help)
        parser.add_argument("--tag", required=tag is REQUIRED, default=None if tag is REQUIRED else tag,
                            help="the run's name: the files it returns carry it, and finish names the run after it")
        if commit:
            parser.add_argument("--commit", default="unknown",
                                help="the commit whose code runs (the host's copy has no git history; `host` fills it)")
        if plan is not None:
            parser.add_argument("--plan", default=None, help="a committed JSON plan (benchmarks/plans/): it fills "
                                "the options the command line leaves out")
        if budget_s is not False:
            parser.add_argument("--budget-s", type=float, default=budget_s,
                                help="the call's seconds: no work starts that would end past them")
        keys = tuple(plan_keys) if callable(plan) else tuple(plan or ())
        self.gpu_commands[name] = {"plan": plan, "keys": keys, "lists": tuple(lists), "defaults": dict(defaults or {}),
                                   "check": check, "commit": commit}
        return parser

    def command(self, name: str, run: Callable[[argparse.Namespace], int | None], help: str, *, results: bool = True,
                commit: bool = False) -> argparse.ArgumentParser:
        """Any other command (`finish` and the CPU's helpers); `results` adds --results (where finish puts runs),
        `commit` --commit (the commit a finished run names)."""
        parser = self._command(name, run, help)
        if results:
            parser.add_argument("--results", default=None, help="the results folder (default data/results)")
        if commit:
            parser.add_argument("--commit", default=None,
                                help="the commit whose code ran on the host (default: what the run recorded, else "
                                     "this checkout's)")
        return parser

    def parse(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        """The arguments of a command, with its plan and defaults applied and, on a GPU command with a budget, the
        budget started (`args.budget`)."""
        args = self.parser.parse_args(argv)
        for key, value in vars(args).items():  # a list default is one object for every parse: never grow it
            if isinstance(value, list):
                setattr(args, key, list(value))
        spec = self.gpu_commands.get(args.cmd)
        if spec is None:
            return args
        plan = spec["plan"]
        if plan is not None and args.plan:
            loaded = load_plan(args.plan, spec["keys"])
            if callable(plan):
                plan(args, loaded)
            else:
                fill_from_plan(args, loaded, plan, spec["lists"])
        for dest, value in spec["defaults"].items():
            if getattr(args, dest) is None:
                setattr(args, dest, value)
        if spec["check"] is not None:
            spec["check"](args, self.parsers[args.cmd])
        if getattr(args, "budget_s", None) is not None:
            args.budget = Budget(args.budget_s)
        return args

    def main(self, argv: Sequence[str] | None = None) -> int:
        args = self.parse(argv)
        if args.cmd == "host":
            print(self.host_call(args.call, log_name=args.log))
            return 0
        return self.run[args.cmd](args) or 0

    def host_call(self, call: Sequence[str], *, log_name: str | None = None, commit: str | None = None) -> str:
        """The host call of GPU command `call` (its name and arguments), after parsing them here as the host would
        (an unknown option, a bad value or plan fails now, not after the host's start-up); `--commit` is added where
        the call lacks it (default: this checkout's HEAD, short)."""
        call = list(call[1:] if call[:1] == ["--"] else call)
        if not call or call[0] not in self.gpu_commands:
            raise SystemExit(f"host: name a GPU command of {self.script} first ({', '.join(self.gpu_commands)})")
        args = self.parse(call)  # exits with argparse's message on a bad argument or plan
        if self.gpu_commands[call[0]]["commit"] and not any(a == "--commit" or a.startswith("--commit=") for a in call):
            call += ["--commit", commit or short_commit()]
        name = log_name or f"{Path(self.script).stem}_{args.tag}.log"
        return shlex.join(["python3", HOST, "run", "--log", name, "--", "python3", self.script, *call])


def short_commit() -> str:
    """This checkout's HEAD, short, with "+dirty" where tracked files differ from it (then the host runs code the
    commit does not describe: commit first)."""
    from hqlab.provenance import git_commit

    full = git_commit()
    if full == "unknown":
        return full
    sha, dirty = full.partition("+")[::2]
    if dirty:
        print("warning: tracked files differ from HEAD; the host runs them, the commit does not describe them",
              file=sys.stderr)
    return sha[:7] + ("+" + dirty if dirty else "")


def commit_of(given: str | None, recorded: str | None) -> str:
    """The commit a finished run names: the one given at finish, else the one the GPU call recorded, else this
    checkout's."""
    if given:
        return given
    if recorded and recorded != "unknown":
        return recorded
    from hqlab.provenance import git_commit

    return git_commit()


# ---------------------------------------------------------------------------------------------------------------
# Finish


def finish_run(study: str, run: str, *, card: str, script: str, tables: Mapping[str, Any],
               files: Mapping[str, str | Path] | None = None, logs: Iterable[str | Path] = (),
               info: Mapping[str, Any] | None = None, log_of: str | None = None, root: str | Path | None = None
               ) -> Path:
    """Put a finished run in place (`hqlab.bench.results.write_run`): its tables, its `files` as they came back,
    and the logs the host returned with it: the one whose command runs `log_of` (default `script`) as run.log,
    giving run.json its command and date, the others under their names. run.json's `benchmark` is `script`; `info`
    (commit, plan, vllm_runner) wins over what the log says. Returns the run's folder."""
    from hqlab.bench import results

    found, said = results.run_logs(logs, log_of or script)
    meta = said | {"benchmark": script} | dict(info or {})
    return results.write_run(study, run, card=card, tables=tables, files={**(files or {}), **found}, info=meta,
                             root=root)


def vllm_runners(values: Iterable[Any]) -> list[str] | None:
    """The model runners a run's engines used, as run.json lists them: upper case, sorted, each once; None where no
    engine said."""
    return sorted({str(v).upper() for v in values if v is not None and str(v)}) or None


def returned_logs(folder: str | Path, tag: str) -> list[Path]:
    """The logs a GPU call returned for the call `tag` (`<anything>_<tag>.log[.gz]`: the name `host` gives them)."""
    from hqlab.bench import results

    return results.logs_of(folder, tag)


def plan_path(stem: str, run: str) -> str | None:
    """The committed plan of a run, `benchmarks/plans/<stem>_<run>.json`, relative to the checkout; None if none."""
    path = REPO / "benchmarks" / "plans" / f"{stem}_{run}.json"
    return str(path.relative_to(REPO)) if path.exists() else None


__all__ = ["Benchmark", "Budget", "PLAN_NOTES", "REQUIRED", "append_jsonl", "commit_of", "copy_out", "fill_from_plan",
           "finish_run", "load_plan", "log", "out_dir", "plan_path", "returned_logs", "run_bounded", "save_json",
           "save_table", "short_commit", "vllm_runners"]
