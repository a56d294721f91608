"""The fault suite's client (`hqlab.bench.faults`) against a tiny HTTP stub on 127.0.0.1: its own parsing (vLLM's
completion replies, streams, prompt log-probabilities, /metrics), its bounds (a request that never ends is a hang cut
at its limit, a case ends by its deadline, the drain wait is bounded), its aborts and disconnects (the stub sees the
connection close), and the rows it makes from records. The server it is for is vLLM's, on the GPU host
(benchmarks/vllm_faults.py); the stub stands in for nothing of vLLM's behaviour, only for its reply format."""

from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from hqlab.bench import faults
from hqlab.config import ConfigError

SLOW, BROKEN, NO_DONE = 900, 901, 902  # prompt tokens that make the stub hang, answer 500, or end a stream early


class Stub(BaseHTTPRequestHandler):
    """vLLM's reply format for the calls the client makes: a completion emits the prompt's last token + 1, + 2, ...
    (log-probability -0.1 each, margin 1.5), prompt log-probabilities -0.5 per prompt token; streams one token a
    chunk; /metrics reports the requests in flight (plus `stuck`)."""

    in_flight = 0
    stuck = 0
    closed_early = 0
    lock = threading.Lock()

    def log_message(self, *args: Any) -> None:
        pass

    def _json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/metrics":
            text = ("# HELP vllm:num_requests_running x\n"
                    f'vllm:num_requests_running{{model_name="target",engine="0"}} {Stub.in_flight + Stub.stuck}\n'
                    'vllm:num_requests_waiting{model_name="target",engine="0"} 0.0\n'
                    'vllm:num_preemptions_total{model_name="target",engine="0"} 3.0\n'
                    "process_resident_memory_bytes 1.0e+06\n")
            data = text.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self._json(404, {"error": "no such path"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            text = body.get("prompt") or body["messages"][0]["content"]
            return self._json(200, {"count": len(text), "max_model_len": 64, "tokens": [ord(c) for c in text]})
        prompt = body["prompt"]
        if BROKEN in prompt:
            return self._json(500, {"error": "broken"})
        with Stub.lock:
            Stub.in_flight += 1
        try:
            if SLOW in prompt:
                time.sleep(3.0)
            tokens = [prompt[-1] + i + 1 for i in range(body["max_tokens"])]
            if body.get("stream"):
                return self._stream(body, tokens, stop_early=NO_DONE in prompt)
            choices = [self._choice(j, body, tokens) for j in range(body.get("n", 1))]
            self._json(200, {"choices": choices})
        finally:
            with Stub.lock:
                Stub.in_flight -= 1

    def _choice(self, index: int, body: dict[str, Any], tokens: list[int]) -> dict[str, Any]:
        choice = {"index": index, "text": "".join(chr(97 + t % 26) for t in tokens), "finish_reason": "length",
                  "token_ids": tokens, "prompt_token_ids": body["prompt"],
                  "logprobs": {"token_logprobs": [-0.1] * len(tokens),
                               "top_logprobs": [{f"token_id:{t}": -0.1, "token_id:0": -1.6} for t in tokens]}}
        if body.get("prompt_logprobs"):
            choice["prompt_logprobs"] = [None] + [{str(t): {"logprob": -0.5, "rank": 1}} for t in body["prompt"][1:]]
        return choice

    def _stream(self, body: dict[str, Any], tokens: list[int], stop_early: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            for i, t in enumerate(tokens):
                last = i == len(tokens) - 1
                event = {"choices": [{"index": 0, "text": "x", "token_ids": [t],
                                      "finish_reason": "length" if last else None}]}
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.02)
            if not stop_early:
                self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            with Stub.lock:
                Stub.closed_early += 1


@pytest.fixture
def stub():
    Stub.in_flight = Stub.stuck = Stub.closed_early = 0
    server = ThreadingHTTPServer((faults.LOOPBACK, 0), Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def client(port: int, **limits: Any) -> faults.Client:
    return faults.Client(port, "target", faults.Limits(**{"request_s": 2.0, "case_s": 10.0, "drain_s": 1.0,
                                                         "concurrency": 4, **limits}))


def test_the_client_talks_to_this_host_only_and_its_limits_are_checked():
    with pytest.raises(ConfigError, match="this host only"):
        faults.Client(8000, "target", host="10.0.0.1")
    with pytest.raises(ConfigError, match="port"):
        faults.Client(0, "target")
    with pytest.raises(ConfigError, match="positive"):
        faults.Limits(request_s=0)


def test_a_whole_reply_gives_token_ids_logprobs_margins_and_prompt_logprobs(stub):
    c = client(stub)
    assert c.chat_tokens("hi") == [104, 105] and c.text_tokens("ab") == ([97, 98], 64)
    reply = c.call(faults.Call({"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0.0, "logprobs": 2,
                                "prompt_logprobs": 2}), time.monotonic() + 5)
    assert reply.error is None and not reply.hung and not reply.cut
    (choice,) = reply.choices
    assert choice.token_ids == [8, 9, 10] and choice.finish_reason == "length"
    assert choice.logprobs == [-0.1] * 3 and choice.margins == pytest.approx([1.5] * 3)
    assert choice.prompt_logprobs == [None, -0.5, -0.5]
    four = c.call(faults.Call({"prompt": [1], "max_tokens": 2, "n": 4}, greedy=False), time.monotonic() + 5)
    assert len(four.choices) == 4


def test_a_stream_is_read_to_its_end_or_cut_where_the_client_goes_away(stub):
    c = client(stub)
    whole = c.call(faults.Call({"prompt": [1], "max_tokens": 6}, stream=True), time.monotonic() + 5)
    assert whole.choices[0].token_ids == [2, 3, 4, 5, 6, 7] and whole.choices[0].finish_reason == "length"
    cut = c.call(faults.Call({"prompt": [1], "max_tokens": 20}, stream=True, cut_chunks=3), time.monotonic() + 5)
    assert cut.cut and not cut.hung and cut.error is None and cut.choices[0].token_ids == [2, 3, 4]
    deadline = time.monotonic() + 3
    while Stub.closed_early == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert Stub.closed_early == 1  # the server saw the connection close mid-stream
    early = c.call(faults.Call({"prompt": [NO_DONE], "max_tokens": 3}, stream=True), time.monotonic() + 5)
    assert early.error and "without [DONE]" in early.error and not early.hung


def test_an_abort_closes_the_request_and_is_no_hang_but_no_reply_in_time_is(stub):
    c = client(stub)
    aborted = c.call(faults.Call({"prompt": [SLOW], "max_tokens": 2}, cut_s=0.2), time.monotonic() + 5)
    assert aborted.cut and not aborted.hung and aborted.error is None and aborted.seconds < 1.5
    hung = c.call(faults.Call({"prompt": [SLOW], "max_tokens": 2}), time.monotonic() + 5)
    assert hung.hung and "no reply within 2 s" in hung.error and hung.seconds < 2.9
    broken = c.call(faults.Call({"prompt": [BROKEN], "max_tokens": 2}), time.monotonic() + 5)
    assert "HTTP 500" in broken.error and not broken.hung


def test_a_case_ends_by_its_deadline_and_the_drain_wait_is_bounded(stub):
    c = client(stub, request_s=5.0, case_s=1.0, concurrency=2)
    calls = [faults.Call({"prompt": [SLOW], "max_tokens": 2})] * 6
    start = time.monotonic()
    run = faults.run_case(c, calls)
    assert time.monotonic() - start < 1.0 + 3.0 + 2.0  # the case's deadline, the slowest reply, the drain
    replies = run["replies"]
    assert all(r["hung"] for r in replies) and sum(r["seconds"] < 0.05 for r in replies) >= 2  # never started
    Stub.stuck = 1  # a request the server never lets go of
    start = time.monotonic()
    state = c.drain()
    assert state["running"] >= 1 and 0.9 < time.monotonic() - start < 2.0


def test_a_server_that_stops_answering_is_an_error_not_a_crash_of_the_suite(stub):
    c = client(stub)
    assert c.state()["running"] == 0
    dead = client(free_port())
    assert dead.state() == {"unreachable": 1.0} and dead.drain() == {"unreachable": 1.0}
    run = faults.run_case(dead, [faults.Call({"prompt": [1], "max_tokens": 2})])
    assert run["replies"][0]["error"] and not run["replies"][0]["hung"]
    rec = faults.case_record("lookup", "prefix-on", "max_tokens_2", [faults.Call({"prompt": [1], "max_tokens": 2})],
                             run)
    assert faults.row(rec, None)["errors"] == 2 and "did not answer" in faults.row(rec, None)["error_detail"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((faults.LOOPBACK, 0))
        return s.getsockname()[1]


def test_metrics_are_summed_over_label_sets():
    text = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 2.0\n'
            'vllm:num_requests_running{engine="1"} 1.0\nvllm:kv_cache_usage_perc{engine="0"} 0.25\n'
            "other_metric 7\n")
    assert faults.parse_metrics(text, {"vllm:num_requests_running": "running",
                                       "vllm:kv_cache_usage_perc": "kv"}) == {"running": 3.0, "kv": 0.25}


def test_the_schema_check_and_the_process_tree():
    assert faults.fits_schema('{"name": "Ada", "age": 36, "languages": ["C"]}')
    for bad in ('{"name": "Ada", "age": "36", "languages": []}', '{"name": "Ada", "age": 36}', "not json",
                '{"name": "Ada", "age": true, "languages": []}', '{"name": "A", "age": 1, "languages": [], "x": 1}'):
        assert not faults.fits_schema(bad), bad
    assert os.getpid() in faults.process_tree(os.getpid()) and faults.process_tree_rss(os.getpid()) > 1 << 20


def test_every_case_asks_the_same_of_every_config_and_refuses_what_it_cannot_run():
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    for case in faults.CASES:
        a = faults.case_calls(case, prompts, long_prompts=[[1] * 60], json_prompt=[3], seed=1)
        assert a == faults.case_calls(case, prompts, long_prompts=[[1] * 60], json_prompt=[3], seed=1) and a
    disconnect = faults.case_calls("disconnect", prompts * 10)
    assert any(c.cut_chunks for c in disconnect) and any(c.cut_chunks is None for c in disconnect)
    assert all(not c.greedy and c.body["n"] == 4 for c in faults.case_calls("n4", prompts))
    with pytest.raises(ConfigError, match="unknown case"):
        faults.case_calls("soak", prompts)
    with pytest.raises(ConfigError, match="json_prompt"):
        faults.case_calls("json_schema", prompts)


def record(config: str, case: str, tokens: list[list[int]], margins: tuple[float, ...] = (2.0, 0.25, 2.0),
           lp: float = -0.1, greedy: bool = True, **reply: Any) -> dict[str, Any]:
    """A case's record as `case_record` writes it: one call per token list, its reply those tokens with
    log-probability `lp` each and the top-two `margins` by position."""
    calls = [faults.Call({"prompt": [i], "max_tokens": 4}, greedy=greedy) for i in range(len(tokens))]
    replies = [faults.Reply([faults.Choice(t, "", "length", [lp] * len(t), list(margins[:len(t)]), [None, -0.5])],
                            **reply) for t in tokens]
    run = {"replies": [asdict(r) for r in replies], "wall_s": 1.0,
           "state_before": {"preemptions": 2.0}, "state_after": {"preemptions": 5.0, "running": 0.0}}
    return faults.case_record(config, "prefix-on", case, calls, run)


def test_rows_compare_each_config_with_the_reference_on_the_same_requests():
    ref = record("none", "logprobs", [[1, 2, 3], [4, 5, 6], [7, 8, 9]])  # a near tie at each second token
    near = record("lookup", "logprobs", [[1, 2, 3], [4, 0, 6], [7, 8, 9]], lp=-0.15)
    clear = record("fused", "logprobs", [[1, 2, 3], [4, 5, 0], [7, 8, 9]])
    rows = {r["config"]: r for r in faults.rows([ref, near, clear])}
    assert set(rows["none"]) == set(faults.FAULT_COLUMNS) and rows["none"]["greedy_compared"] == 0
    assert (rows["lookup"]["greedy_equal"], rows["lookup"]["near_ties"], rows["lookup"]["mismatches"]) == (2, 1, 0)
    assert (rows["fused"]["greedy_equal"], rows["fused"]["near_ties"], rows["fused"]["mismatches"]) == (2, 0, 1)
    assert json.loads(rows["fused"]["partings"]) == [[1, 2, 2.0]] and json.loads(rows["lookup"]["partings"]) == \
        [[1, 1, 0.25]]
    assert rows["lookup"]["logprob_max_diff"] == pytest.approx(0.05) and rows["lookup"]["preemptions"] == 3.0
    assert rows["lookup"]["prompt_logprob_max_diff"] == 0.0 and math.isnan(rows["lookup"]["sampling_p"])
    hung = record("lookup", "logprobs", [[1, 2, 3]] * 3, hung=True)
    assert faults.row(hung, ref)["hangs"] == 3 and faults.row(hung, ref)["greedy_compared"] == 0
    other = record("lookup", "logprobs", [[1], [2]])
    with pytest.raises(ValueError, match="not the reference's"):
        faults.row(other, ref)


def test_sampled_replies_get_the_sampling_test_and_errors_are_counted():
    import numpy as np

    rng = np.random.default_rng(0)
    same, other = ([rng.integers(0, 4, 8).tolist() for _ in range(400)] for _ in range(2))
    shifted = [[0] * 8 for _ in range(400)]
    ref = record("none", "n4", same, greedy=False)
    assert faults.row(record("lookup", "n4", other, greedy=False), ref)["sampling_p"] > 0.01
    assert faults.row(record("planted", "n4", shifted, greedy=False), ref)["sampling_p"] < 1e-6
    errored = record("lookup", "json_schema", [[1, 2]], error="HTTP 500: broken")
    assert faults.row(errored, None)["errors"] == 1 and "HTTP 500" in faults.row(errored, None)["error_detail"]
    unfit = record("lookup", "json_schema", [[1, 2]])
    assert faults.row(unfit, None)["errors"] == 1  # its text is not JSON of the schema


def test_the_plan_names_runnable_configs_cases_and_bounded_limits():
    from hqlab.engines.vllm.gpu_fused import fused_config
    from hqlab.engines.vllm.gpu_lookup import lookup_config

    plan = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "plans" / "faults_f1.json").read_text())
    assert plan["why"] and plan["configs"]["none"] == "none"
    for spec in plan["configs"].values():
        if spec != "none":
            (fused_config if spec.startswith("gpu-fused") else lookup_config)(spec)
    assert set(plan["cases"]) == set(faults.CASES)
    assert {s["prefix_caching"] for s in plan["settings"].values()} == {True, False}
    faults.Limits(**plan["limits"])


def test_the_driver_turns_returned_records_into_one_row_per_config_and_case(tmp_path):
    import polars as pl

    from benchmarks.vllm_faults import main

    from hqlab.bench import results

    records = [record("none", "logprobs", [[1, 2, 3]] * 3), record("lookup", "logprobs", [[1, 2, 3]] * 3),
               record("lookup", "json_schema", [[1, 2]])]
    returned, store = tmp_path / "returned", tmp_path / "results"
    returned.mkdir()
    (returned / "faults_x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (returned / "faults_x.json").write_text(json.dumps({"machine": "NVIDIA H100 80GB HBM3", "setting": "prefix-on",
                                                         "commit": "abc1234"}))
    assert main(["finish", str(returned), "--results", str(store)]) == 0
    table = results.load("faults", "x", root=store)
    assert results.run_info("faults", "x", root=store)["card"] == "h100"
    assert table.drop("run").columns == faults.FAULT_COLUMNS and table.height == 3
    assert table.filter(pl.col("config") == "lookup", pl.col("case") == "logprobs")["greedy_equal"].item() == 3
    with pytest.raises(SystemExit):
        main(["run", "--plan", "benchmarks/plans/faults_f1.json", "--setting", "prefix-on", "--tag", "x",
              "--budget", "5"])  # an abbreviated option is refused, not guessed
