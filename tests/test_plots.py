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
