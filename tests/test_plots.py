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
