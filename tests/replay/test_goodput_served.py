"""The goodput decisions record (`hqlab.engines.vllm.goodput_record`) and its check (`hqlab.replay.goodput_served`)
without vLLM: version 2 round-trips through the writer and the reader, event for event; a controller priced online,
driven as the served hook drives it and recording as it records, is re-priced and decided again call for call from
its record alone, and a timed step dropped or altered is caught; version 1 records are still read, and an online one
is refused; `online_prices` is what each call priced, by batch, and `served_widths` the same per server of a run with
the price of the wide widths chosen. tests/engines/vllm/test_vllm_goodput.py checks the
same on records the hook writes under vLLM's own scheduler."""

from __future__ import annotations

import json
import random
from array import array
from dataclasses import asdict

import polars as pl
import pytest

from hqlab.config import ConfigError
from hqlab.engines.vllm import goodput_record as gr
from hqlab.engines.vllm.goodput import record_header
from hqlab.replay.goodput_served import online_prices, record_frame, record_frames, rerun_rule, served_widths
from hqlab.rules.goodput import GoodputConfig, GoodputController, StepCosts, bucket_of
from hqlab.rules.online_costs import OnlineCosts, micros

PRIOR = StepCosts((1, 8), (0, 7, 15), ((3.0, 3.4, 3.6), (3.3, 3.9, 4.2)), source="a test's prior")
# the host the test's steps run on: wide steps far dearer than the prior says
HOST = StepCosts((1, 8), (0, 7, 15), ((3.0, 6.0, 9.0), (3.3, 7.5, 12.0)), source="a test's host")


def test_a_version_2_record_round_trips_through_the_writer_and_the_reader(tmp_path):
    path = tmp_path / "r.bin"
    log = gr.DecisionLog(path, {"widths": [0, 7, 15], "online": True})
    log.decision(0, 7, [("a", 10, (1, 0, 0)), ("b", 12, (2, 1, 0))], [3000, 3500, 3600])
    log.timed(1, 2, 0, 4200, False)  # a step with prompt tokens: handed to the costs, not fitted
    log.outcomes(0, 1, [("a", 7, 3)])
    log.decision(1, 0, [("a", 14, (1, 3, 0)), ("c", 5, (0, 0, 0))], [2900, 3400, 3700])
    log.timed(2, 2, 7, 5100, True)
    log.timed(2, 1, 0, 1 << 40, True)  # past int32: written as the largest word, not raised in the engine
    log.close()
    header, cols = gr.read_record(path)
    assert header == {"widths": [0, 7, 15], "online": True} and cols["version"] == gr.VERSION == 2
    assert cols["request_ids"] == ["a", "b", "c"] and not cols["truncated"]
    assert cols["decision"].tolist() == [0, 0, 1, 1] and cols["width"].tolist() == [7, 7, 0, 0]
    assert cols["request"].tolist() == [0, 1, 0, 2] and cols["tokens"].tolist() == [10, 12, 14, 5]
    assert (cols["match"].tolist(), cols["accept"].tolist()) == ([1, 2, 1, 0], [0, 1, 3, 0])
    assert (cols["drafted"].tolist(), cols["accepted"].tolist(), cols["observed_before"].tolist()) == \
        ([7, -1, -1, -1], [3, -1, -1, -1], [1, -1, -1, -1])
    assert cols["priced"].tolist() == [[3000, 3500, 3600]] * 2 + [[2900, 3400, 3700]] * 2
    timed = cols["timed"]
    assert timed["before"].tolist() == [1, 2, 2] and timed["batch"].tolist() == [2, 2, 1]
    assert timed["width"].tolist() == [0, 7, 0] and timed["us"].tolist() == [4200, 5100, gr.INT32_MAX]
    assert timed["decode_only"].tolist() == [False, True, True]

    header, frame, steps = record_frames(path)
    assert header["version"] == 2 and header["truncated"] is False
    assert frame["priced_us"].to_list() == cols["priced"].tolist()
    assert frame["request_id"].to_list() == ["a", "b", "a", "c"] and frame["drafted"].to_list() == [7, None, None, None]
    assert steps.rows() == [(0, 1, 2, 0, 4200, False), (1, 2, 2, 7, 5100, True), (2, 2, 1, 0, gr.INT32_MAX, True)]
    assert record_frame(path)[1].equals(frame)

    raw = path.read_bytes()
    cut = tmp_path / "cut.bin"  # a server killed inside its last timed step: the events before it are whole
    cut.write_bytes(raw[:-8])
    header, frame, steps = record_frames(cut)
    assert header["truncated"] and frame.height == 4 and steps["step"].to_list() == [0, 1]
    cut.write_bytes(raw[:len(raw) - 4 * (6 + 6 + 2)])  # inside the second call's prices
    header, frame, steps = record_frames(cut)
    assert header["truncated"] and frame["decision"].to_list() == [0, 0, 1, 1]
    assert frame["priced_us"].to_list() == [[3000, 3500, 3600]] * 2 + [None, None] and steps.height == 1


def test_the_reader_refuses_what_the_writer_cannot_have_written(tmp_path):
    path = tmp_path / "r.bin"
    log = gr.DecisionLog(path, {"widths": [0, 7]})
    log.decision(0, 7, [("a", 10, (1, 0, 0))], [3000, 3500])
    log.timed(1, 1, 7, 3300, True)
    log.close()
    raw = path.read_bytes()
    head, words = raw[:12 + array("i", raw[8:12])[0]], array("i", raw[12 + array("i", raw[8:12])[0]:])

    def written(body: list[int], version: int = 2) -> str:
        raw = bytearray(head)
        raw[4:8] = array("i", [version]).tobytes()
        (tmp_path / "bad.bin").write_bytes(bytes(raw) + array("i", body).tobytes())
        return str(tmp_path / "bad.bin")

    assert gr.read_record(written(list(words)))[1]["version"] == 2
    timed_at = len(words) - 6
    with pytest.raises(ValueError, match="says 2 calls decided before it, the record holds 1"):
        gr.read_record(written(list(words[:timed_at + 1]) + [2] + list(words[timed_at + 2:])))
    priced_at = timed_at - 5
    with pytest.raises(ValueError, match="prices of call 3 .* follow no decision of that call"):
        gr.read_record(written(list(words[:priced_at + 1]) + [3] + list(words[priced_at + 2:])))
    with pytest.raises(ValueError, match=r"unknown event tag 6 .*\(version 1\)"):  # a version 1 file has no TIMED
        gr.read_record(written(list(words[:priced_at]) + list(words[timed_at:]), version=1))
    with pytest.raises(ValueError, match=r"record version 3, this reader reads \[1, 2\]"):
        gr.read_record(written(list(words), version=3))


def drive(path, calls: int, seed: int = 0) -> tuple[GoodputController, OnlineCosts]:
    """A controller priced online from `PRIOR`, driven as the served hook drives it and recording as it records:
    per call, a batch of requests (1 to 8) whose cells carry their last outcome's acceptance bucket, the width and
    its prices; then the previous call's step processed: its outcomes, and its time on `HOST` (5 % noise; one step in
    seven with prompt tokens), handed to the costs as integer µs."""
    config = GoodputConfig()
    costs = OnlineCosts(PRIOR)
    controller = GoodputController(config, (0, 7, 15), costs)
    log = gr.DecisionLog(path, record_header("a test", (0, 7, 15), costs, config))
    rng = random.Random(seed)
    last: dict[str, int] = {}
    previous = None
    for call in range(calls):
        batch = 1 + (call // 12) % 8
        ids = [f"r{i}" for i in range(batch)]
        cells = {r: (rng.randrange(3), bucket_of(last.get(r), config.accept_edges), 0) for r in ids}
        width = controller.decide(cells.values())
        log.decision(call, width, [(r, 100 + call, cells[r]) for r in ids], [micros(ms) for ms in controller.priced])
        if previous is not None:
            p_call, p_width, p_cells = previous
            us = micros(HOST.at(len(p_cells), p_width) * rng.uniform(0.95, 1.05))
            decode_only = call % 7 != 0
            costs.observe_us(len(p_cells), p_width, us, decode_only)
            log.timed(call + 1, len(p_cells), p_width, us, decode_only)
            if p_width:
                seen = []
                for r, cell in p_cells.items():
                    accepted = min(p_width, int(rng.expovariate(0.4)))
                    controller.observe(cell, p_width, accepted)
                    last[r] = accepted
                    seen.append((r, p_width, accepted))
                log.outcomes(p_call, call + 1, seen)
        previous = (call, width, cells)
    log.close()
    return controller, costs


def test_an_online_record_is_repriced_and_decided_again_call_for_call(tmp_path):
    controller, costs = drive(tmp_path / "r.bin", 400)
    header, frame, steps = record_frames(tmp_path / "r.bin")
    assert header["online"] and header["online_config"] == asdict(costs.config) and header["version"] == 2
    decode = steps.filter(pl.col("decode_only"))
    assert {(w, b): v["us"].to_list()[-costs.config.window:]  # the intervals as the costs kept them
            for (w, b), v in decode.group_by("width", "batch", maintain_order=True)} == costs.samples
    check = rerun_rule(frame, header, steps)
    assert check.ok and check.online and check.decisions == 400 and check.timed == steps.height == 399, check
    assert check.prices == costs.table() and check.scales == costs.scales() and check.scales[1] > 5
    assert len(check.widths) >= 2 and check.outcomes > 0
    assert rerun_rule(frame, header, steps.clear()).width_mismatches > 0  # the prices turned widths

    wide = decode.filter(pl.col("width") == decode.filter(pl.col("width") > 0)["width"].mode()[0])
    picked = wide.row(costs.config.min_samples + 1, named=True)
    dropped = rerun_rule(frame, header, steps.filter(pl.col("step") != picked["step"]))
    assert not dropped.ok and dropped.first_price_mismatch[0] >= picked["before"]
    # its interval moved across its cell's median (a move on one side of it changes no price, by design)
    cell = wide.filter((pl.col("batch") == picked["batch"]) & (pl.col("step") <= picked["step"]))["us"].to_list()
    cell = cell[-costs.config.window:]
    other = 1 if picked["us"] >= sorted(cell)[(len(cell) - 1) // 2] else 100 * picked["us"]
    altered = steps.with_columns(pl.when(pl.col("step") == picked["step"]).then(other).otherwise(pl.col("us"))
                                 .alias("us"))
    found = rerun_rule(frame, header, altered)
    assert not found.ok and found.price_mismatches > 0 and found.first_price_mismatch[0] >= picked["before"]
    recorded = frame.filter(pl.col("decision") == found.first_price_mismatch[0])["priced_us"][0].to_list()
    assert found.first_price_mismatch[1] == recorded != found.first_price_mismatch[2]
    with pytest.raises(ConfigError, match="go backwards"):
        rerun_rule(frame, header, steps.with_columns(pl.when(pl.col("step") == 3).then(10_000)
                                                     .otherwise(pl.col("before")).alias("before")))
    with pytest.raises(ConfigError, match="give its timed steps"):
        rerun_rule(frame, header)


def test_a_version_1_record_is_read_and_its_online_controller_refused(tmp_path):
    """A version 1 file (no prices, no timed steps), as servers wrote before: a fixed-cost one is decided again, an
    online one is refused with what to do."""
    config = GoodputConfig()
    width = GoodputController(config, (0, 7, 15), PRIOR).decide([(1, 0, 0)])

    def version_1(online: bool) -> str:
        head = json.dumps({"spec": "a test", "widths": [0, 7, 15], "costs": PRIOR.to_dict(),
                           "config": asdict(config), "online": online}).encode()
        head += b" " * (-len(head) % 4)
        body = array("i", [gr.REQUEST, 0, 1]).tobytes() + b"a\0\0\0"
        body += array("i", [gr.DECISION, 0, width, 1, 0, 40, gr.pack_cell((1, 0, 0))]).tobytes()
        path = tmp_path / f"v1_{online}.bin"
        path.write_bytes(gr.MAGIC + array("i", [1, len(head)]).tobytes() + head + body)
        return str(path)

    header, frame, steps = record_frames(version_1(False))
    assert header["version"] == 1 and frame["priced_us"].to_list() == [None] and steps.height == 0
    assert rerun_rule(frame, header).ok
    header, frame, steps = record_frames(version_1(True))
    with pytest.raises(ConfigError, match=r"measured its step costs online .*\(version 1\) holds the prior only"):
        rerun_rule(frame, header, steps)
    with pytest.raises(ConfigError, match="some calls carry no prices"):
        online_prices(frame, header)


def test_online_prices_are_each_calls_prices_and_by_batch_the_widths_chosen(tmp_path):
    path = tmp_path / "r.bin"
    log = gr.DecisionLog(path, {"widths": [0, 7, 15], "online": True, "costs": PRIOR.to_dict()})
    calls = [(1, 15, [3000, 3500, 3600]), (1, 0, [3000, 6000, 9000]), (2, 7, [3100, 4650, 6200]),
             (3, 0, [3200, 4800, 8000]), (5, 15, [3300, 3300, 3300])]
    for call, (batch, width, priced) in enumerate(calls):
        log.decision(call, width, [(f"r{i}", 10, (0, 0, 0)) for i in range(batch)], priced)
    log.close()
    header, frame, _ = record_frames(path)
    per_call, by_batch = online_prices(frame, header)
    assert per_call.columns == ["decision", "batch", "width", "ms_0", "ms_7", "ms_15"]
    assert per_call.rows() == [(i, b, w, *(x / 1000 for x in p)) for i, (b, w, p) in enumerate(calls)]
    rows = {r["batches"]: r for r in by_batch.iter_rows(named=True)}
    assert by_batch["batches"].to_list() == ["1", "2-3", "4-7"] and by_batch["lo"].to_list() == [1, 2, 4]
    assert rows["1"]["decisions"] == 2 and rows["1"]["chose_0"] == rows["1"]["chose_15"] == 0.5
    assert rows["1"]["ms_7"] == pytest.approx(4.75) and rows["1"]["x_15"] == pytest.approx((1.2 + 3.0) / 2)
    assert rows["2-3"]["chose_7"] == 0.5 and rows["2-3"]["x_7"] == pytest.approx((1.5 + 1.5) / 2)
    assert rows["4-7"]["chose_15"] == 1.0 and rows["4-7"]["x_15"] == 1.0
    fixed = {**header, "online": False}  # a fixed-cost server: its table's prices, rounded as a record's
    assert online_prices(frame, fixed)[0]["ms_15"].to_list() == [micros(PRIOR.at(b, 15)) / 1000 for b, _, _ in calls]


def test_served_widths_per_server_price_the_wide_widths_chosen_from_the_record_or_its_table(tmp_path):
    """Three servers of one run with the same calls: priced online (version 2: the recorded prices), the same record
    as version 1 (the prior only) and a fixed table; a bucket where no call went wide has no price."""
    path = tmp_path / "r.bin"
    log = gr.DecisionLog(path, {"widths": [0, 7, 15], "online": True, "costs": PRIOR.to_dict()})
    calls = [(1, 15, [3000, 3500, 3600]), (1, 0, [3000, 6000, 9000]), (2, 7, [3100, 4650, 6200]),
             (3, 0, [3200, 4800, 8000]), (5, 15, [3300, 3300, 3300]), (8, 0, [3300, 9900, 9900])]
    for call, (batch, width, priced) in enumerate(calls):
        log.decision(call, width, [(f"r{i}", 10, (0, 0, 0)) for i in range(batch)], priced)
    log.close()
    header, frame, _ = record_frames(path)

    def server(config: str, head: dict, rows: pl.DataFrame) -> pl.DataFrame:
        return rows.with_columns(pl.lit(config).alias("config"), pl.lit(json.dumps(head)).alias("header"),
                                 pl.lit(False).alias("truncated"))

    unpriced = frame.with_columns(pl.lit(None, dtype=pl.List(pl.Int64)).alias("priced_us"))
    table = served_widths(pl.concat([server("online", header, frame),
                                     server("online v1", {**header, "version": 1}, unpriced),
                                     server("fixed", {**header, "online": False}, frame)]))
    assert dict(table.select("config", "prices").unique(maintain_order=True).rows()) == \
        {"online": "learnt", "online v1": "prior only", "fixed": "fixed"}
    rows = {(r["config"], r["batches"]): r for r in table.iter_rows(named=True)}
    assert [b for c, b in rows if c == "online"] == ["1", "2-3", "4-7", "8-15"]
    assert rows["online", "1"]["wide"] == 0.5 and rows["online", "1"]["priced_x"] == pytest.approx(1.2)
    assert rows["online", "2-3"]["chose_7"] == 0.5 and rows["online", "2-3"]["priced_x"] == pytest.approx(1.5)
    assert rows["online", "4-7"]["priced_x"] == pytest.approx(1.0)
    assert rows["online", "8-15"]["wide"] == 0.0 and rows["online", "8-15"]["priced_x"] is None
    prior = micros(PRIOR.at(2, 7)) / micros(PRIOR.at(2, 0))  # the table's price, not the call's
    for config in ("online v1", "fixed"):
        assert rows[config, "2-3"]["priced_x"] == pytest.approx(prior) != pytest.approx(1.5)
        assert rows[config, "1"]["chose_15"] == 0.5 and rows[config, "8-15"]["decisions"] == 1
