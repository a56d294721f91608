"""Charts: what the shared chart builders put in the Vega-Lite spec."""

from __future__ import annotations

import polars as pl

from hqlab import plots


def _color_scale(chart) -> dict:
    spec = chart.to_dict()
    return spec["layer"][0]["encoding"]["color"].get("scale", {})


def test_grouped_bars_keep_series_apart_beyond_ten_colours():
    def frame(series: int) -> pl.DataFrame:
        return pl.DataFrame({"run": ["a"] * series, "config": [f"c{i}" for i in range(series)],
                             "ratio": [1.0 + i for i in range(series)]})

    assert _color_scale(plots.grouped_bars(frame(3), "run", "ratio", "config")) == {}  # the default ten colours
    many = _color_scale(plots.grouped_bars(frame(11), "run", "ratio", "config"))
    assert many == {"scheme": "tableau20"}  # eleven series: the default scheme would give two of them one colour


def test_points_jitter_is_the_same_on_every_draw():
    frame = pl.DataFrame({"config": ["a", "a", "b"], "ms": [2.0, 3.4, 2.1], "run": ["l", "m", "l"]})
    first, second = plots.points(frame, "config", "ms", "run"), plots.points(frame, "config", "ms", "run")
    assert first.to_dict() == second.to_dict()
    values = first.to_dict()["datasets"]
    jitter = [row["_jitter"] for rows in values.values() for row in rows]
    assert len(jitter) == 3 and len(set(jitter)) == 3 and all(0 <= j < 1 for j in jitter)


def test_bar_panels_stack_one_panel_per_measure_with_log_where_asked():
    frame = pl.DataFrame({"category": ["copy", "copy", "chat", "chat"], "config": ["none", "fused"] * 2,
                          "tok_s": [440.0, 280.0, 490.0, 330.0], "tokens_per_step": [1.0, 15.0, 1.0, 7.8]})
    spec = plots.bar_panels(frame, "category", "config", {"tok_s": "decode tok/s", "tokens_per_step": "tokens/step"},
                            log=("tok_s",)).to_dict()
    top, bottom = spec["vconcat"]
    assert [p["encoding"]["y"]["title"] for p in (top, bottom)] == ["decode tok/s", "tokens/step"]
    assert top["encoding"]["y"]["scale"] == {"type": "log"} and "type" not in bottom["encoding"]["y"].get("scale", {})
    assert top["encoding"]["y"]["stack"] is None  # stacked, a log panel's bars would start at 0 and not be drawn
    assert [p["encoding"]["x"]["axis"]["labels"] for p in (top, bottom)] == [False, True]  # labels once, at the bottom
    assert len(spec["datasets"]) == 1  # the panels share one copy of the rows


def test_panel_lines_keep_the_panel_order_given_and_the_data_range():
    frame = pl.DataFrame({"width": [1, 32, 1, 32], "ms": [2.0, 3.0, 20.0, 30.0], "shape": ["a", "a", "b", "b"],
                          "panel": ["context 32k", "context 32k", "context 8k", "context 8k"]})
    spec = plots.panel_lines(frame, "width", "ms", "shape", panel="panel", order=["context 8k", "context 32k"],
                             log_x=True).to_dict()
    assert spec["facet"]["sort"] == ["context 8k", "context 32k"]  # not alphabetical: 32k would come first
    assert spec["spec"]["encoding"]["x"]["scale"]["domain"] == [1.0, 32.0]


def test_predicted_vs_measured_draws_the_tolerance_band():
    frame = pl.DataFrame({"measured": [100.0, 1000.0], "predicted": [105.0, 800.0], "config": ["a", "b"]})
    spec = plots.predicted_vs_measured(frame, "measured", "predicted", "config", tolerance=0.1).to_dict()
    guides = next(rows for rows in spec["datasets"].values() if "guide" in rows[0])
    top = max(r["m"] for r in guides)
    assert {r["guide"]: r["p"] / r["m"] for r in guides if r["m"] == top} == {"exact": 1.0, "above": 1.1,
                                                                            "below": 0.9}
    assert min(r["m"] for r in guides) < 100.0 and top > 1000.0  # the band spans every dot


def test_lines_with_mark_put_the_reference_point_in_every_panel():
    frame = pl.DataFrame({"size": [7.0, 32.0] * 2, "speedup": [1.5, 2.0, 3.0, 4.0], "class": ["chat"] * 2 + ["qa"] * 2,
                          "panel": ["x, batch 8"] * 2 + ["x, batch 1"] * 2})
    spec = plots.lines_with_mark(frame, "size", "speedup", "class", panel="panel", mark=(27.0, 2.4, "seeds")).to_dict()
    assert spec["facet"]["sort"] == ["x, batch 8", "x, batch 1"]  # panels that have rows, in their order
    layers = spec["spec"]["layer"]
    assert len(layers) == 4  # the lines, the rule, the point, its label
    assert layers[2]["encoding"]["x"] == {"datum": 27.0} and layers[2]["encoding"]["y"] == {"datum": 2.4}


def test_time_panels_give_each_measure_its_own_y_scale_in_the_order_given():
    frame = pl.DataFrame({"minutes": [0.1, 0.2, 0.1, 0.2], "value": [9000.0, 9100.0, 5200.0, 5210.0],
                          "measure": ["tok/s", "tok/s", "MiB", "MiB"], "server": ["lookup (k1a)"] * 4})
    spec = plots.time_panels(frame, "minutes", "value", "server", panel="measure").to_dict()
    assert spec["facet"]["sort"] == ["tok/s", "MiB"] and spec["resolve"]["scale"]["y"] == "independent"
    assert spec["spec"]["mark"]["type"] == "line" and spec["spec"]["encoding"]["y"]["scale"]["zero"] is False


def test_stacked_bars_take_another_measure_and_keep_the_parts_in_order():
    frame = pl.DataFrame({"bucket": ["1", "2-3"], "width 0": [0.5, 0.0], "width 7": [0.25, 0.4],
                          "width 15": [0.25, 0.6]})
    parts = ["width 0", "width 7", "width 15"]
    plain = plots.stacked_time(frame, "bucket", parts).to_dict()["encoding"]
    assert plain["y"]["field"] == "ms" and "sort" not in plain["color"] and "title" not in plain["color"]
    shares = plots.stacked_time(frame, "bucket", parts, value="share", part_title="width", in_order=True)
    spec = shares.to_dict()
    assert spec["encoding"]["y"]["field"] == "share" and spec["encoding"]["color"]["sort"] == parts
    assert spec["encoding"]["color"]["title"] == "width"
    rows = next(iter(spec["datasets"].values()))
    assert {(r["bucket"], r["part"]): r["share"] for r in rows}[("2-3", "width 15")] == 0.6
