"""benchmarks/vllm_serve.py's GPU commands with the servers stood in for (no vLLM, no GPU): what `together` and
`bench` start, in which order they measure, what they write into $OUT after every point, where the budget stops a
call, and that `finish` takes what they return. The stand-ins answer as `hqlab.bench.serve`'s functions do; the
servers' own behaviour is vLLM's, checked on the GPU host."""

from __future__ import annotations

import json
import sys
import tarfile
import time
import types
from pathlib import Path

import pytest

from hqlab import models, provenance
from hqlab.bench import results, runner, serve

MACHINE = "NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, vllm 0.26.0"
LOOKUP = "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest"
PLAN = {"why": "a test", "configs": {"none": "none", "lookup": LOOKUP,
                                     "alone": "gpu-lookup:nmin=1,nmax=32,k=7,policy=earliest"},
        "batch1": ["alone"], "sample": ["lookup"], "points": ["prose:0.7:1:10:2", "chat:0:8:80"]}


class Clock:
    """A monotonic clock that each load point advances by `point_s` seconds."""

    def __init__(self, point_s: float) -> None:
        self.t, self.point_s = 0.0, point_s

    def monotonic(self) -> float:
        return self.t


@pytest.fixture
def host(tmp_path, monkeypatch):
    """The GPU host stood in for: vLLM importable, models and tokenizer at hand, servers that answer at once, load
    points that return a fixed result and advance the clock; `loads` lists (server port, point file) in order."""
    from benchmarks import vllm_serve

    clock = Clock(point_s=10.0)
    loads: list[tuple[int, str]] = []
    started: list[list[str]] = []
    envs: list[dict] = []

    class Server:
        def __init__(self, argv, log_path, *, port, env=None, timeout_s=900.0):
            self.argv, self.log_path, self.port, self.ready_s = argv, Path(log_path), port, 1.0
            envs.append(env)
            self.base_url = f"http://127.0.0.1:{port}"

        def start(self):
            started.append(self.argv)
            self.log_path.write_text(f"non-default args: {{'port': {self.port}}}\n")
            return self

        def wait(self):
            return self

        __enter__ = start

        def __exit__(self, *exc):
            self.stop()

        def stop(self):
            pass

    def run_load(args):
        port = int(args[args.index("--base-url") + 1].rsplit(":", 1)[1])
        loads.append((port, args[args.index("--result-filename") + 1]))
        clock.t += clock.point_s
        return {"output_throughput": 100.0 + len(loads), "median_tpot_ms": 2.0, "median_ttft_ms": 20.0,
                "spec_decode_acceptance_length": 2.0, "completed": int(args[args.index("--num-prompts") + 1])}

    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setattr(models, "prepare", lambda name: str(tmp_path / "models" / name))
    import transformers

    monkeypatch.setattr(transformers, "AutoTokenizer", types.SimpleNamespace(from_pretrained=lambda path: object()))
    monkeypatch.setattr(vllm_serve, "dataset_prompts", lambda name, tokenizer: [f"{name} {i}" for i in range(90)])
    monkeypatch.setattr(provenance, "machine_description", lambda vllm=False: MACHINE)
    monkeypatch.setattr(provenance, "package_version", lambda name: "0.26.0")
    monkeypatch.setattr(serve, "Server", Server)
    monkeypatch.setattr(serve, "run_load", run_load)
    monkeypatch.setattr(serve, "greedy_tokens", lambda url, model, prompts, max_tokens: [
        {"text": f"greedy {url}", "token_ids": [1, 2], "margins": [3.0, 4.0]} for _ in prompts])
    monkeypatch.setattr(serve, "chat_texts", lambda url, model, prompts, max_tokens: [f"text {url}" for _ in prompts])
    monkeypatch.setattr(serve, "sample_token_ids", lambda url, model, prompt, samples, max_tokens, temperature,
                        concurrency: [[5, 6]] * samples)
    monkeypatch.setattr(runner, "time", types.SimpleNamespace(monotonic=clock.monotonic, strftime=time.strftime))
    out = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLAN))
    return types.SimpleNamespace(script=vllm_serve, out=out, loads=loads, started=started, clock=clock, plan=plan,
                                 work=tmp_path / "work", envs=envs)


def rows(out: Path, tag: str) -> list[dict]:
    return [json.loads(line) for line in (out / f"vllm_serve_{tag}.jsonl").read_text().splitlines()]


def test_together_measures_each_point_server_by_server_and_returns_every_file(host, tmp_path):
    assert host.script.main(["together", "--plan", str(host.plan), "--tag", "t1", "--commit", "abc",
                             "--work", str(host.work)]) == 0
    assert [argv[argv.index("--port") + 1] for argv in host.started] == ["8321", "8322", "8323"]  # all at once
    none, lookup, alone = (8321, 8322, 8323)
    # the prose point's two repeats on every server in turn, then the chat point at 8 without the batch-1 config
    assert host.loads == [(none, "0_prose_t0.7_c1_r0.json"), (lookup, "1_prose_t0.7_c1_r0.json"),
                          (alone, "2_prose_t0.7_c1_r0.json"), (none, "0_prose_t0.7_c1_r1.json"),
                          (lookup, "1_prose_t0.7_c1_r1.json"), (alone, "2_prose_t0.7_c1_r1.json"),
                          (none, "0_chat_t0_c8_r0.json"), (lookup, "1_chat_t0_c8_r0.json")]
    got = rows(host.out, "t1")
    assert [(r["config"][:14], r["max_concurrency"], r["repeat"]) for r in got][:3] == [
        ("none", 1, 0), ("gpu-lookup:nmi", 1, 0), ("gpu-lookup:nmi", 1, 0)]
    assert {(r["run"], r["git_commit"], r["machine"]) for r in got} == {("t1", "abc", MACHINE)}
    greedy = [json.loads(line) for line in (host.out / "serve_greedy_t1.jsonl").read_text().splitlines()]
    assert [g["config"] for g in greedy] == list(PLAN["configs"].values())
    samples = [json.loads(line) for line in (host.out / "serve_samples_t1.jsonl").read_text().splitlines()]
    assert [s["config"] for s in samples] == [PLAN["configs"]["lookup"]] and len(samples[0]["token_ids"]) == 600
    with tarfile.open(host.out / "serve_t1_logs.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["serve_t1_0.log", "serve_t1_1.log", "serve_t1_2.log"]
    (host.out / "vllm_serve_t1.log").write_text(
        "== python3 benchmarks/vllm_serve.py together --tag t1  2026-12-08 10:00:00\n")
    assert host.script.main(["finish", str(host.out), "--results", str(tmp_path / "results")]) == 0
    finished = results.load("serve", "t1", root=tmp_path / "results")
    assert finished.height == 8 and results.run_info("serve", "t1", tmp_path / "results")["commit"] == "abc"


def test_a_plans_sampling_variants_and_decision_records(host, tmp_path):
    """`sample_prefix_off` and `planted` add samples-only servers of a config (no greedy texts, no load points),
    labelled by a bracket; `decisions` sets the record's variable for the goodput config's servers alone."""
    from hqlab.engines.vllm.goodput_record import RECORD_ENV

    goodput = f"{LOOKUP},batch_k=1:15/4:7/0,goodput=default"
    plan = {"why": "a test", "configs": {"none": "none", "goodput": goodput}, "sample": ["goodput"],
            "decisions": ["goodput"], "sample_prefix_off": ["goodput"], "planted": ["goodput"],
            "points": ["chat:0:1:10"]}
    host.plan.write_text(json.dumps(plan))
    assert host.script.main(["together", "--plan", str(host.plan), "--tag", "t5", "--work", str(host.work)]) == 0
    assert len(host.started) == 4 and [port for port, _ in host.loads] == [8321, 8322]  # variants: no points
    assert "--no-enable-prefix-caching" in host.started[2] and "--no-enable-prefix-caching" not in host.started[1]
    assert "hqlab_fault" in " ".join(host.started[3]) and "hqlab_fault" not in " ".join(host.started[1])
    assert [RECORD_ENV in env for env in host.envs] == [False, True, True, False]
    assert len({env[RECORD_ENV] for env in host.envs if RECORD_ENV in env}) == 2  # one file a server
    samples = [json.loads(line)["config"] for line in (host.out / "serve_samples_t5.jsonl").read_text().splitlines()]
    assert samples == [goodput, f"{goodput} [prefix caching off]", f"{goodput} [planted accept_first_draft]"]
    greedy = [json.loads(line)["config"] for line in (host.out / "serve_greedy_t5.jsonl").read_text().splitlines()]
    assert greedy == ["none", goodput]
    bad = {**plan, "decisions": ["none"]}
    host.plan.write_text(json.dumps(bad))
    with pytest.raises(Exception, match="only a goodput config records decisions"):
        host.script.main(["together", "--plan", str(host.plan), "--tag", "t6", "--work", str(host.work)])
    host.plan.write_text(json.dumps({**plan, "planted": ["nothing"]}))
    with pytest.raises(Exception, match="not among its configs"):
        host.script.main(["together", "--plan", str(host.plan), "--tag", "t7", "--work", str(host.work)])


def test_together_starts_no_point_past_its_budget(host, capsys):
    host.script.main(["together", "--plan", str(host.plan), "--tag", "t2", "--budget-s", "25", "--work",
                      str(host.work)])
    assert len(host.loads) == 3  # 0, 10, 20 s: each started within 25 s; the fourth would start at 30
    assert len(rows(host.out, "t2")) == 3
    assert "budget of 25 s spent: prose_t0.7_c1 repeat 1 and later not run" in capsys.readouterr().out


def test_together_refuses_a_short_point_before_anything_starts(host, capsys):
    with pytest.raises(SystemExit) as refused:
        host.script.main(["together", "--config", "none", "--point", "chat:0:8:16", "--tag", "t3"])
    assert refused.value.code == 2 and "2.0 waves" in capsys.readouterr().err
    assert not host.started and not host.loads


def test_bench_serves_one_config_after_another_and_skips_what_an_earlier_call_did(host):
    argv = ["bench", "--tag", "t4", "--config", "none", "--planted-fault", LOOKUP, "--dataset", "chat",
            "--temperature", "0", "--concurrency", "1", "--work", str(host.work), "--samples", "5"]
    assert host.script.main(argv) == 0
    assert len(host.started) == 2 and "accept_first_draft" in " ".join(host.started[1])
    assert [r["config"] for r in rows(host.out, "t4")] == ["none"]  # the planted server gives samples only
    samples = [json.loads(line)["config"] for line in (host.out / "serve_samples_t4.jsonl").read_text().splitlines()]
    assert samples == ["none", f"{LOOKUP} [planted accept_first_draft]"]
    assert host.script.main(argv) == 0  # a later call with the same tag: both done, nothing started again
    assert len(host.started) == 2 and len(rows(host.out, "t4")) == 1
