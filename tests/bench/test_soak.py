"""The soak's client (`hqlab.bench.soak`) against a small HTTP server on 127.0.0.1 that answers in vLLM's reply format
(whole and streamed completions a token every few milliseconds, /metrics with its running requests and generated
tokens): the load's bounds (a count, a time, requests in flight, a request that never ends cut as a hang, a bounded
drain), its accounting (every request served, errored, disconnected or hung, the server seeing each disconnect), its
time series, and `finish` on the raw files a real load wrote. The server it is for is vLLM's, on the GPU host
(benchmarks/vllm_faults.py soak); this one stands in for nothing of vLLM's behaviour, only for its reply format."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from hqlab.bench import faults, results, soak
from hqlab.config import ConfigError

SLOW, BROKEN = 900, 901  # prompt tokens that make the server never answer in time, or answer 500
PLAN = Path(__file__).resolve().parents[2] / "benchmarks" / "plans" / "soak_k1.json"


class Server(BaseHTTPRequestHandler):
    """Completions of max_tokens tokens (the prompt's last + 1, + 2, ...), one every `token_s`, n choices; streamed
    one token a chunk. Counts requests in flight (and their peak), tokens generated, and streams the client left."""

    token_s = 0.002
    lock = threading.Lock()
    in_flight = peak = generated = closed_early = stuck = 0

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, data: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path != "/metrics":
            return self._send(404, b"{}")
        c = type(self)
        text = (f'vllm:num_requests_running{{engine="0"}} {c.in_flight + c.stuck}\n'
                'vllm:num_requests_waiting{engine="0"} 0.0\nvllm:kv_cache_usage_perc{engine="0"} 0.1\n'
                'vllm:num_preemptions_total{engine="0"} 0.0\n'
                f'vllm:generation_tokens_total{{engine="0"}} {float(c.generated)}\n'
                'vllm:generation_tokens_created{engine="0"} 1.7e9\n')
        self._send(200, text.encode(), "text/plain")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["prompt"]
        if BROKEN in prompt:
            return self._send(500, b'{"error": "broken"}')
        c = type(self)
        with c.lock:
            c.in_flight += 1
            c.peak = max(c.peak, c.in_flight)
        try:
            if SLOW in prompt:
                time.sleep(2.0)
            tokens = [prompt[-1] + i + 1 for i in range(body["max_tokens"])]
            if body.get("stream"):
                return self._stream(tokens)
            time.sleep(self.token_s * len(tokens))
            self._count(len(tokens) * body.get("n", 1))
            choices = [{"index": j, "text": "x" * len(tokens), "token_ids": tokens, "finish_reason": "length"}
                       for j in range(body.get("n", 1))]
            try:
                self._send(200, json.dumps({"choices": choices}).encode())
            except (BrokenPipeError, ConnectionResetError):  # the client closed a whole reply's connection
                with c.lock:
                    c.closed_early += 1
        finally:
            with c.lock:
                c.in_flight -= 1

    def _count(self, tokens: int) -> None:
        c = type(self)
        with c.lock:
            c.generated += tokens

    def _stream(self, tokens: list[int]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            for i, t in enumerate(tokens):
                time.sleep(self.token_s)
                self._count(1)
                event = {"choices": [{"index": 0, "text": "x", "token_ids": [t],
                                      "finish_reason": "length" if i == len(tokens) - 1 else None}]}
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            with type(self).lock:
                type(self).closed_early += 1


@pytest.fixture
def port():
    """A server of its own (its counts a class of their own: requests of an earlier test may still end)."""
    global Served
    Served = type("Served", (Server,), {"lock": threading.Lock()})
    server = ThreadingHTTPServer((faults.LOOPBACK, 0), Served)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


Served = Server  # the running test's server class (`port`)


PROMPTS = {"chat": [[1, 2, 3], [4, 5]], "prose": [[6, 7, 8, 9]], "labd": [list(range(10, 60))]}
MIX = soak.Mix(max_tokens=(4, 8, 16), disconnect=0.3, n2=0.1, logprobs=0.1, stream=0.2, cut_s=(0.005, 0.02))


def load(port: int, bounds: soak.Bounds, prompts: dict = PROMPTS, mix: soak.Mix = MIX, writer=None):
    """Run the soak's load against the server on `port`; (end, samples, requests)."""
    client = faults.Client(port, "target", bounds.limits())
    samples, requests = [], []
    end = soak.run_load(client, lambda i: soak.planned_call(i, prompts, mix, seed=1), bounds,
                        probe=soak.server_probe(client, os.getpid()),
                        on_sample=writer.sample if writer else samples.append,
                        on_requests=writer.requests if writer else requests.extend, log=lambda msg: None,
                        progress=False)
    return end, samples, requests


def test_bounds_and_mix_refuse_what_cannot_run_and_the_client_talks_to_this_host_only():
    with pytest.raises(ConfigError, match="at least one request in flight"):
        soak.Bounds(in_flight=0)
    with pytest.raises(ConfigError, match="positive"):
        soak.Bounds(duration_s=0)
    with pytest.raises(ConfigError, match=r"disconnect \+ n2 \+ logprobs \+ stream = 1.10 > 1"):
        soak.Mix(disconnect=0.5, n2=0.3, logprobs=0.1, stream=0.2)
    with pytest.raises(ConfigError, match=r"shares must lie in \[0, 1\]"):
        soak.Mix(sampled=1.5)
    with pytest.raises(ConfigError, match="cut_s"):
        soak.Mix(cut_s=(0.0, 1.0))
    with pytest.raises(ConfigError, match="labd, which have no prompts"):
        soak.planned_call(0, {"chat": [[1]], "prose": [[2]]}, soak.Mix())
    with pytest.raises(ConfigError, match="this host only"):
        faults.Client(8000, "target", soak.Bounds().limits(), host="192.168.1.5")


def test_each_request_is_drawn_by_its_index_and_the_mix_keeps_its_shares():
    mix = soak.Mix()
    draws = [soak.planned_call(i, PROMPTS, mix, seed=0) for i in range(4000)]
    assert draws[:50] == [soak.planned_call(i, PROMPTS, mix, seed=0) for i in range(50)]  # the same for every run
    assert draws[:50] != [soak.planned_call(i, PROMPTS, mix, seed=1) for i in range(50)]
    kinds = Counter(p.kind for p in draws)
    for kind, share in {"n2": 0.1, "logprobs": 0.1, "stream": 0.2, "whole": 0.5}.items():
        assert abs(kinds[kind] / 4000 - share) < 0.03, (kind, kinds)
    assert abs((kinds["cut_stream"] + kinds["cut_whole"]) / 4000 - 0.1) < 0.02 and min(kinds.values()) > 100
    assert set(Counter(p.dataset for p in draws)) == {"chat", "prose", "labd"}
    assert {p.call.body["max_tokens"] for p in draws} == set(mix.max_tokens)
    for p in draws:
        call = p.call
        assert (call.body.get("n", 1) == 2) == (p.kind == "n2") and (call.body.get("logprobs") == 5) == \
            (p.kind == "logprobs")
        assert call.stream == (p.kind in ("stream", "cut_stream")) and (call.cut_chunks is not None) == \
            (p.kind == "cut_stream") and (call.cut_s is not None) == (p.kind == "cut_whole")
        if call.cut_chunks is not None:
            assert 1 <= call.cut_chunks <= call.body["max_tokens"]
    assert 0.45 < sum(p.call.body["temperature"] > 0 for p in draws if p.kind != "n2") / 3600 < 0.55


def test_a_count_bounded_load_sends_that_many_and_accounts_for_every_one(port):
    end, samples, requests = load(port, soak.Bounds(in_flight=6, duration_s=30.0, max_requests=120, request_s=2.0,
                                                    drain_s=1.0, sample_s=0.1))
    counts = end["counts"]
    assert counts["sent"] == 120 and len(requests) == 120 and sorted(r["index"] for r in requests) == list(range(120))
    assert counts["done"] + counts["error"] + counts["disconnected"] + counts["hung"] == 120
    assert counts["error"] == counts["hung"] == 0 and counts["in_flight"] == 0
    assert counts["disconnected"] == sum(r["status"] == "disconnected" for r in requests) > 10
    assert all(r["kind"] in ("cut_stream", "cut_whole") for r in requests if r["status"] == "disconnected")
    assert Served.closed_early >= 1  # the server saw a client leave mid-stream
    assert end["load_s"] < 20 and end["left_on_server"] == 0 and end["stuck_clients"] == 0
    # the clients kept their six slots busy and never more (the server may hold more: it finishes what a client left)
    assert max(s["in_flight"] for s in samples) == 6 <= Served.peak
    assert counts["tokens"] == sum(r["tokens"] for r in requests) > 0


def test_a_time_bounded_load_stops_sending_and_samples_the_way(port):
    start = time.monotonic()
    end, samples, requests = load(port, soak.Bounds(in_flight=4, duration_s=1.0, request_s=2.0, drain_s=1.0,
                                                    sample_s=0.2))
    assert time.monotonic() - start < 1.0 + 0.5 + 1.5  # the load, its last requests, the drain
    assert [s["phase"] for s in samples][0] == "start" and [s["phase"] for s in samples][-2:] == ["end", "drain"]
    load_samples = [s for s in samples if s["phase"] == "load"]
    assert len(load_samples) >= 3 and all(s["in_flight"] <= 4 for s in samples)
    times = [s["t_s"] for s in samples]
    assert times == sorted(times) and times[-2] >= 1.0
    for key in ("sent", "done", "disconnected", "tokens"):  # cumulative counts never go back
        assert [s[key] for s in samples] == sorted(s[key] for s in samples)
    assert samples[-1]["generation_tokens"] == Served.generated > 0 and samples[-1]["running"] == 0
    assert all(s["rss_mib"] > 10 for s in samples) and end["counts"]["sent"] == len(requests) > 20
    assert max(r["start_s"] for r in requests) < 1.0 + 0.2  # nothing was sent after the time was spent


def test_a_request_that_never_ends_is_a_hang_an_error_reply_is_an_error_and_the_drain_is_bounded(port):
    prompts = {"chat": [[SLOW]], "prose": [[BROKEN]], "labd": [[1, 2]]}
    mix = soak.Mix(max_tokens=(2,), disconnect=0.0, n2=0.0, logprobs=0.0, stream=0.0)
    Served.stuck = 1  # a request the server never lets go of
    start = time.monotonic()
    end, samples, requests = load(port, soak.Bounds(in_flight=3, duration_s=0.5, request_s=0.5, drain_s=0.6,
                                                    sample_s=0.1), prompts, mix)
    assert time.monotonic() - start < 0.5 + 0.5 + 0.6 + 1.5
    status = Counter((r["dataset"], r["status"]) for r in requests)
    assert set(status) == {("chat", "hung"), ("prose", "error"), ("labd", "done")}, status
    assert all("HTTP 500" in r["error"] for r in requests if r["status"] == "error")
    assert end["counts"]["hung"] == status["chat", "hung"] and end["left_on_server"] >= 1


def returned_soak(tmp_path: Path, port: int, **bounds: Any) -> Path:
    """A returned folder as the GPU call leaves it, from a real load against the server on `port`."""
    out = tmp_path / "returned"
    out.mkdir()
    writer = soak.RawWriter(out, "t1")
    plan = json.loads(PLAN.read_text())
    bounded = soak.Bounds(**{"in_flight": 4, "duration_s": 1.6, "request_s": 2.0, "drain_s": 1.0, "sample_s": 0.1,
                             **bounds})
    meta = {"config": "lookup", "spec": plan["configs"]["lookup"], "machine": "NVIDIA H100 80GB HBM3, torch 2.11",
            "commit": "abc1234", "bounds": asdict(bounded), "plan": "benchmarks/plans/soak_k1.json",
            "criteria": plan["criteria"]}
    writer.meta(meta)
    end, _, _ = load(port, bounded, writer=writer)
    writer.meta({**meta, "end": end})
    (out / "vllm_faults_t1.log").write_text("== python3 benchmarks/vllm_faults.py soak --tag t1  2027-01-05 10:00:00\n")
    (out / "soak_lookup_t1.log").write_text("INFO vllm serve\n")
    return out


def test_finish_turns_a_real_load_into_series_requests_a_row_and_the_criteria_that_held(tmp_path, port):
    returned, store = returned_soak(tmp_path, port), tmp_path / "results"
    folder, verdicts = soak.finish(returned, script="benchmarks/vllm_faults.py", root=store, settle_s=0.4)
    info = results.run_info("soak", "t1", root=store)
    assert info["card"] == "h100" and info["plan"] == "benchmarks/plans/soak_k1.json" and info["commit"] == "abc1234"
    assert {"rows.parquet", "series.parquet", "requests.parquet", "claims.json", "raw_series.jsonl", "run.log",
            "soak_lookup_t1.log"} <= set(info["files"])
    row = results.load("soak", "t1", root=store).row(0, named=True)
    series = results.load("soak", "t1", "series", root=store)
    requests = results.load("soak", "t1", "requests", root=store)
    assert series.drop("run").columns == soak.SERIES_COLUMNS and requests.drop("run").columns == soak.REQUEST_COLUMNS
    assert row["requests"] == requests.height == row["served"] + row["errors"] + row["disconnects"] + row["hangs"]
    assert row["errors"] == row["hangs"] == row["left_on_server"] == 0 and row["disconnects"] > 0
    # tokens the server generated between the samples before and after the load (it may finish a request a client
    # closed after that: this server, unlike vLLM, does not abort them)
    generated = series.filter(pl.col("phase").is_in(["start", "end"]))["generation_tokens"].to_list()
    assert row["output_tokens"] == generated[1] - generated[0] > 0 and generated[1] <= Served.generated
    assert row["tokens_per_s"] == pytest.approx(row["output_tokens"] / row["duration_s"])
    assert row["in_flight_median"] == 4 and abs(row["rss_growth"]) < 0.05 and row["rss_mib_1min"] > 10
    load_rates = series.filter(pl.col("phase") == "load")["tokens_per_s"].drop_nulls()
    assert load_rates.len() >= 5 and load_rates.min() >= 0 and load_rates.mean() > 0
    # this load is 1.6 s at 4 in flight on a machine with no GPU: the plan's duration, in-flight and GPU criteria fail
    failed = {v.claim.what for v in verdicts if not v.held}
    assert failed == {"at least five minutes of load", "64 requests in flight (the median over the samples after "
                      "the first minute)", "the GPU memory in use at the end of the load within 5 % of after its "
                      "first minute"} or failed == {"at least five minutes of load", "64 requests in flight (the "
                                                    "median over the samples after the first minute)"}
    assert sorted(row["failed_criteria"]) == sorted(failed)
    claims = json.loads((folder / "claims.json").read_text())
    assert {c["what"] for c in claims} == {c["what"] for c in json.loads(PLAN.read_text())["criteria"]} - failed
    from hqlab.bench import claims as checker

    assert all(v.held for v in checker.check_run("soak", "t1", store))  # what claims.json says holds on the run
    assert soak.report(folder, verdicts, log=lambda msg: None) == 3


def test_finish_refuses_a_folder_without_one_soak(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="one soak's returned files at a time"):
        soak.finish(empty, script="x")
    (empty / "soak_a.json").write_text(json.dumps({"config": "lookup"}))
    with pytest.raises(ValueError, match="no soak_a_series.jsonl"):
        soak.finish(empty, script="x")
    (empty / "soak_a_series.jsonl").write_text("not json\n")
    (empty / "soak_a_requests.jsonl").write_text("")
    with pytest.raises(ValueError, match="not one JSON object a line"):
        soak.finish(empty, script="x")
    (empty / "soak_b.json").write_text("{}")
    with pytest.raises(ValueError, match=r"found \['soak_a.json', 'soak_b.json'\]"):
        soak.finish(empty, script="x")
    assert not (tmp_path / "results").exists()


def test_the_driver_finishes_a_soak_and_checks_a_soak_call_before_the_host_runs_it(tmp_path, port, capsys):
    from benchmarks.vllm_faults import CLI, main

    returned, store = returned_soak(tmp_path, port, duration_s=0.8), tmp_path / "results"
    assert main(["finish", str(returned), "--results", str(store)]) == 3  # short: the plan's criteria fail
    assert "FAILED: at least five minutes of load" in capsys.readouterr().out
    assert results.runs("soak", root=store) == ["t1"]
    call = CLI.host_call(["soak", "--plan", str(PLAN), "--config", "fused", "--tag", "k1b"], commit="abc1234")
    assert call.startswith("python3 tools/gpu_host/vllm_host.py run --log vllm_faults_k1b.log -- python3 "
                           "benchmarks/vllm_faults.py soak") and call.endswith("--commit abc1234")
    with pytest.raises(SystemExit):
        CLI.host_call(["soak", "--plan", str(PLAN), "--config", "none", "--tag", "k1b"])
    assert "config 'none': the plan's configs are lookup, fused, lookup-quote" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["soak", "--config", "lookup", "--tag", "x"])
    assert "soak needs --plan" in capsys.readouterr().err


def test_the_plan_serves_runnable_configs_at_64_in_flight_for_five_minutes_within_a_call():
    from hqlab.bench.claims import Claim
    from hqlab.engines.vllm.gpu_fused import fused_config
    from hqlab.engines.vllm.gpu_lookup import lookup_config

    plan = json.loads(PLAN.read_text())
    bounds, mix = soak.check_plan(plan, "lookup")
    assert bounds.in_flight == 64 and bounds.duration_s >= 300 and plan["server"]["max_num_seqs"] >= 64
    faults_plan = json.loads((PLAN.parent / "faults_f1.json").read_text())
    readme = "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest,batch_k=1:15/4:7/0"
    assert plan["configs"]["lookup"] == readme and plan["configs"]["fused"] == faults_plan["configs"]["fused"]
    for spec in plan["configs"].values():
        (fused_config if spec.startswith("gpu-fused") else lookup_config)(spec)
    # the server's start (up to its timeout's share), the load, the tail: inside the call's 560 s
    assert 200 + bounds.duration_s + 45 <= 560 and bounds.request_s + bounds.drain_s <= 90
    assert mix.disconnect >= 0.05 and {"chat", "prose", "labd"} == set(mix.datasets)
    # every criterion reads the run's row: a soak that passes holds them all, each fault fails its own
    passing = {"errors": 0, "hangs": 0, "left_on_server": 0, "duration_s": 312.0, "in_flight_median": 64.0,
               "disconnect_share": 0.1, "rss_growth": 0.01, "gpu_growth": -0.002}
    assert set(passing) <= set(soak.SOAK_COLUMNS)
    assert all(v.held for v in soak.criteria_verdicts(plan["criteria"], pl.DataFrame([passing])))
    for fault in ({"errors": 1}, {"hangs": 2}, {"left_on_server": 1}, {"left_on_server": None}, {"duration_s": 250.0},
                  {"in_flight_median": 32.0}, {"disconnect_share": 0.0}, {"rss_growth": 0.08}, {"gpu_growth": -0.06},
                  {"gpu_growth": float("nan")}):
        verdicts = soak.criteria_verdicts(plan["criteria"], pl.DataFrame([{**passing, **fault}],
                                                                         schema_overrides={"left_on_server": pl.Int64}))
        assert sum(not v.held for v in verdicts) == 1, fault
    assert all(Claim.of(c, "plan").view == "rows" for c in plan["criteria"])


def test_the_figure_draws_throughput_and_memory_over_time_per_config_and_skips_without_a_run(tmp_path, port,
                                                                                            capsys):
    empty = tmp_path / "none"
    empty.mkdir()
    assert soak.figure(root=empty) is None and "no soak run committed yet" in capsys.readouterr().out
    store = tmp_path / "results"
    results.write_run("other", "r1", card="cpu", root=store, tables={"rows": pl.DataFrame({"x": [1]})})
    assert soak.figure(root=store) is None and "no soak run committed yet" in capsys.readouterr().out
    soak.finish(returned_soak(tmp_path, port), script="x", root=store, settle_s=0.4)
    data = soak.over_time(results.load("soak", kind="series", root=store))
    assert set(data["measure"]) == {"output tok/s (server)", "resident memory, server processes (MiB)"}  # no GPU
    assert set(data["server"]) == {"lookup (t1)"} and data["minutes"].max() < 0.1
    spec = soak.figure(root=store).to_dict()
    assert spec["facet"]["field"] == "measure" and spec["resolve"]["scale"]["y"] == "independent"
    assert spec["spec"]["encoding"]["x"]["field"] == "minutes" and spec["spec"]["encoding"]["color"]["field"] == \
        "server"


def test_the_host_side_serves_one_config_loads_it_within_the_budget_and_stops_it(tmp_path, port, monkeypatch):
    """`run_soak` with the loopback server in the place of `vllm serve` (no GPU here): one server for the config
    asked, its prompts, the load cut to what the budget leaves after the tail, the raw files, the server stopped."""
    from hqlab import models, provenance
    from hqlab.bench import runner

    started, stopped = [], []

    class Started:
        def __init__(self, configs):
            self.port, self.ready_s, self.proc = port, 1.5, type("Proc", (), {"pid": os.getpid()})()
            started.append(configs)

        def wait(self):
            return self

        def stop(self):
            stopped.append(True)

    monkeypatch.setattr(faults, "start_servers", lambda plan, setting, tag, out, *, port, start_timeout, configs,
                        prefix: [(next(iter(configs)), Started(configs))])
    monkeypatch.setattr(soak, "soak_prompts", lambda client, datasets, model: {d: PROMPTS[d] for d in datasets})
    monkeypatch.setattr(models, "prepare", lambda name: str(tmp_path / name))
    monkeypatch.setattr(provenance, "machine_description", lambda vllm=False: "NVIDIA H200, torch 2.11")
    plan = json.loads(PLAN.read_text())
    plan["bounds"] = {**plan["bounds"], "in_flight": 3, "request_s": 1.0, "drain_s": 0.5, "sample_s": 0.2}
    plan["mix"] = {**plan["mix"], "max_tokens": [4, 8]}
    out = tmp_path / "out"
    out.mkdir()
    start = time.monotonic()
    assert soak.run_soak(plan, "fused", "k9", out, port=port, start_timeout=5, budget=runner.Budget(3.0),
                         commit="abc1234", plan_path="benchmarks/plans/soak_k1.json", tail_s=2.0) == 0
    assert time.monotonic() - start < 1.0 + 1.0 + 0.5 + 1.0  # about a second of load (3 s less the tail)
    assert started == [{"fused": plan["configs"]["fused"]}] and stopped == [True]
    meta = json.loads((out / "soak_k9.json").read_text())
    assert meta["duration_s"] < 1.0 and meta["spec"] == plan["configs"]["fused"] and meta["ready_s"] == 1.5
    assert meta["end"]["left_on_server"] == 0 and meta["end"]["counts"]["sent"] > 0
    assert meta["criteria"] == plan["criteria"] and meta["prompts"] == {"chat": 2, "prose": 1, "labd": 1}
    folder, _ = soak.finish(out, script="benchmarks/vllm_faults.py", root=tmp_path / "results")
    assert results.run_info("soak", "k9", root=tmp_path / "results")["card"] == "h200"
    with pytest.raises(FileExistsError, match="one soak a tag and a folder"):
        soak.run_soak(plan, "fused", "k9", out, port=port, start_timeout=5, budget=runner.Budget(3.0),
                      commit="abc1234", plan_path=None, tail_s=2.0)
