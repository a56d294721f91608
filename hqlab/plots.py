"""One function per chart kind (altair). Notebooks and docs use the same functions; `save` writes SVG + PNG."""

from __future__ import annotations

from pathlib import Path

import altair as alt
import polars as pl

from hqlab.io import write_atomic

WIDTH = 150
# Vega's default categorical colours, in order
TABLEAU10 = ["#4c78a8", "#f58518", "#e45756", "#72b7b2", "#54a24b", "#eeca3b", "#b279a2", "#ff9da6", "#9d755d",
             "#bab0ac"]


def save(chart: alt.TopLevelMixin, path: str | Path, *, png: bool = True) -> list[Path]:
    """Write `path` (.svg) and, by default, a .png next to it, each atomically. Offline: no CDN, no browser."""
    path = Path(path)
    if path.suffix != ".svg":
        raise ValueError(f"figure path must end in .svg (got {path.name}); a .png is written beside it")
    written = [write_atomic(path, lambda tmp: chart.save(str(tmp), format="svg"))]
    if png:
        written.append(write_atomic(path.with_suffix(".png"),
                                    lambda tmp: chart.save(str(tmp), format="png", scale_factor=2)))
    return written


def grouped_bars(data: pl.DataFrame, x: str, y: str, color: str, *, facet: str | None = None,
                 y_title: str | None = None, rule_at: float | None = None, width: int = WIDTH * 3,
                 independent_y: bool = False, legend_limit: int | None = None) -> alt.TopLevelMixin:
    """Grouped bars (one group per `x`, one bar per `color`), optional facet rows and a horizontal reference line.
    More than ten series take a twenty-colour scheme: the default one repeats its colours after ten.
    `independent_y` gives each facet row its own y scale (rows whose values are ten times apart);
    `legend_limit` widens the legend's labels (pixels) where series names are long."""
    scale = alt.Scale(scheme="tableau20") if data[color].n_unique() > 10 else alt.Undefined
    legend = alt.Legend(labelLimit=legend_limit) if legend_limit else alt.Undefined
    bars = alt.Chart().mark_bar().encode(
        x=alt.X(f"{x}:N", title=None, sort=None),
        y=alt.Y(f"{y}:Q", title=y_title or y),
        color=alt.Color(f"{color}:N", sort=None, scale=scale, legend=legend),
        xOffset=alt.XOffset(f"{color}:N", sort=None),
        tooltip=[x, color, alt.Tooltip(f"{y}:Q", format=".3g")],
    )
    layers: list[alt.Chart] = [bars]
    if rule_at is not None:
        layers.append(alt.Chart().mark_rule(strokeDash=[4, 3], color="#444").encode(y=alt.datum(rule_at)))
    chart = alt.layer(*layers, data=data).properties(width=width, height=180)
    if not facet:
        return chart
    faceted = chart.facet(row=alt.Row(f"{facet}:N", title=None))
    return faceted.resolve_scale(y="independent") if independent_y else faceted


def bar_panels(data: pl.DataFrame, x: str, color: str, panels: dict[str, str], *, log: tuple[str, ...] = (),
               width: int = WIDTH * 3, height: int = 120) -> alt.VConcatChart:
    """Grouped bars of several measures of the same rows, one panel per measure (`panels`: column -> axis title),
    stacked over one set of `x` groups and `color` series (group labels under the last panel only): e.g. decode
    tok/s, tokens per step and ms per step of each config per task class. Columns in `log` get a log scale, for
    series ten times apart (and there a ratio of two panels reads as a difference)."""
    charts = []
    for i, (column, title) in enumerate(panels.items()):
        last = i == len(panels) - 1
        charts.append(alt.Chart().mark_bar().encode(
            x=alt.X(f"{x}:N", title=None, sort=None, axis=alt.Axis(labels=last, ticks=last)),
            y=alt.Y(f"{column}:Q", title=title, scale=alt.Scale(type="log") if column in log else alt.Scale(),
                    stack=None),  # bars side by side; a stack would start log bars at 0
            color=alt.Color(f"{color}:N", sort=None, legend=alt.Legend(labelLimit=400)),
            xOffset=alt.XOffset(f"{color}:N", sort=None),
            tooltip=[x, color, alt.Tooltip(f"{column}:Q", format=".3g")],
        ).properties(width=width, height=height))
    return alt.vconcat(*charts, data=data)


def points(data: pl.DataFrame, x: str, y: str, color: str, *, facet: str | None = None,
           y_title: str | None = None, tooltip: list[str] | None = None) -> alt.TopLevelMixin:
    """One dot per row, jittered sideways within its `x` group (e.g. every request's median step time per config):
    shows a distribution's clusters, which a bar or a median hides. The jitter is a fixed sequence (the golden
    ratio's multiples), so the same data draws the same picture."""
    data = data.with_columns(((pl.int_range(pl.len()) * 0.6180339887) % 1.0).alias("_jitter"))
    base = (alt.Chart() if facet else alt.Chart(data)).mark_circle(size=28, opacity=0.75).encode(
        x=alt.X(f"{x}:N", title=None, sort=None),
        xOffset=alt.XOffset("_jitter:Q", title=None),
        y=alt.Y(f"{y}:Q", title=y_title or y),
        color=alt.Color(f"{color}:N", sort=None),
        tooltip=tooltip or [x, color, alt.Tooltip(f"{y}:Q", format=".3g")],
    ).properties(width=WIDTH * 3, height=180)
    return base.facet(row=alt.Row(f"{facet}:N", title=None), data=data) if facet else base


def heatmap(data: pl.DataFrame, x: str, y: str, value: str, *, facet: str | None = None,
            title: str | None = None, fmt: str = ".2f") -> alt.TopLevelMixin:
    """Annotated heatmap (e.g. nmin × nmax → tokens/step), optionally faceted by task category."""
    # Faceted charts take their data at the top level only: inner layers with their own data would not be split.
    base = (alt.Chart() if facet else alt.Chart(data)).encode(x=alt.X(f"{x}:O"), y=alt.Y(f"{y}:O", sort="descending"))
    rect = base.mark_rect().encode(color=alt.Color(f"{value}:Q", title=title or value,
                                                   scale=alt.Scale(scheme="viridis")))
    text = base.mark_text(fontSize=9).encode(
        text=alt.Text(f"{value}:Q", format=fmt),
        color=alt.condition(alt.datum[value] > data[value].median(), alt.value("black"), alt.value("white")))
    chart = alt.layer(rect, text).properties(width=WIDTH, height=WIDTH)
    return chart.facet(alt.Facet(f"{facet}:N", title=None), columns=3, data=data) if facet else chart


def lines(data: pl.DataFrame, x: str, y: str, color: str, *, facet: str | None = None, x_title: str | None = None,
          y_title: str | None = None, log_x: bool = False) -> alt.TopLevelMixin:
    base = (alt.Chart() if facet else alt.Chart(data)).mark_line(point=True).encode(
        x=alt.X(f"{x}:Q", title=x_title or x, scale=alt.Scale(type="log") if log_x else alt.Scale()),
        y=alt.Y(f"{y}:Q", title=y_title or y),
        color=alt.Color(f"{color}:N", sort=None),
        tooltip=[x, color, alt.Tooltip(f"{y}:Q", format=".3g")],
    ).properties(width=WIDTH * 1.4, height=160)
    return base.facet(alt.Facet(f"{facet}:N", title=None), columns=3, data=data) if facet else base


def stacked_time(data: pl.DataFrame, x: str, parts: list[str], *, facet: str | None = None,
                 y_title: str = "ms per step", value: str = "ms", part_title: str | None = None,
                 in_order: bool = False) -> alt.TopLevelMixin:
    """Stacked bars splitting a step's time into parts (e.g. propose vs verify), or any whole into its `parts`
    (`value`: what a part measures, e.g. "share" of calls; `part_title`: the legend's title, default "part";
    `in_order`: colour the parts in the order of `parts`, not by name, e.g. widths 0, 7, 15)."""
    long = data.unpivot(index=[c for c in data.columns if c not in parts], on=parts, variable_name="part",
                        value_name=value)
    chart = (alt.Chart() if facet else alt.Chart(long)).mark_bar().encode(
        x=alt.X(f"{x}:N", title=None, sort=None),
        y=alt.Y(f"{value}:Q", title=y_title, stack=True),
        color=alt.Color("part:N", **({"title": part_title} if part_title else {}),
                        **({"sort": parts} if in_order else {})),
        tooltip=[x, "part", alt.Tooltip(f"{value}:Q", format=".3g")],
    ).properties(width=WIDTH * 1.2, height=180)
    return chart.facet(alt.Facet(f"{facet}:N", title=None), columns=4, data=long) if facet else chart


def kernel_latency(frame: pl.DataFrame, *, title: str) -> alt.TopLevelMixin:
    """Latency per step vs context (log-log), one line per method, one panel per batch size. Methods named
    "floor: ..." (measured launch and bandwidth floors) are dashed; the legend lists methods fastest first."""
    frame = frame.select("method", "batch", "context", "median_us").with_columns(
        pl.format("batch {}", pl.col("batch")).alias("panel"))
    methods = frame.group_by("method").agg(pl.col("median_us").median()).sort("median_us")["method"].to_list()
    dashed = [m for m in methods if m.startswith("floor")]
    panels = [f"batch {b}" for b in sorted(set(frame["batch"]))]
    return (
        alt.Chart(frame)
        .mark_line(point=True)
        .encode(
            x=alt.X("context:Q", scale=alt.Scale(type="log", base=2), title="context (tokens per request)",
                    axis=alt.Axis(values=[4096, 32768, 131072, 1048576], labelExpr="datum.value >= 1048576 ? "
                                  "'1M' : format(datum.value / 1024, 'd') + 'k'")),
            y=alt.Y("median_us:Q", scale=alt.Scale(type="log"), title="latency per step (µs, median)"),
            color=alt.Color("method:N", sort=methods, title=None),
            strokeDash=alt.condition(alt.FieldOneOfPredicate("method", dashed), alt.value([4, 3]),
                                     alt.value([1, 0])),
            tooltip=["method", "batch", "context", alt.Tooltip("median_us:Q", format=",.1f")],
        )
        .properties(width=230, height=260)
        .facet(column=alt.Column("panel:N", sort=panels, title=None))
        .properties(title=title)
        .configure_legend(orient="bottom", columns=4)
    )


def acceptance_histogram_data(steps: pl.DataFrame) -> pl.DataFrame:
    """Per (category, config, accepted): the share of verify steps that accepted that many proposed tokens.
    Configs that never accepted anything (no speculation) are left out: their histogram is one bar at 0."""
    speculating = steps.group_by("config").agg(pl.col("accepted").max()).filter(pl.col("accepted") > 0)["config"]
    counts = (steps.filter(pl.col("config").is_in(speculating.implode()))
              .group_by(["category", "config", "accepted"], maintain_order=True).agg(pl.len().alias("steps")))
    return (counts.with_columns((pl.col("steps") / pl.col("steps").sum().over(["category", "config"])).alias("share"))
            .sort(["category", "config", "accepted"]))


def histograms(data: pl.DataFrame, x: str, y: str, color: str, *, facet: str | None = None,
               x_title: str | None = None, y_title: str | None = None) -> alt.TopLevelMixin:
    """Side-by-side histogram bars (one bar per `color` at each integer `x`), one panel per `facet` value."""
    chart = (alt.Chart() if facet else alt.Chart(data)).mark_bar().encode(
        x=alt.X(f"{x}:O", title=x_title or x),
        y=alt.Y(f"{y}:Q", title=y_title or y),
        color=alt.Color(f"{color}:N", sort=None, legend=alt.Legend(orient="bottom", columns=2, labelLimit=400)),
        xOffset=alt.XOffset(f"{color}:N", sort=None),
        tooltip=[x, color, alt.Tooltip(f"{y}:Q", format=".3g")],
    ).properties(width=WIDTH * 2, height=140)
    return chart.facet(alt.Facet(f"{facet}:N", title=None), columns=2, data=data) if facet else chart


def step_timeline(steps: pl.DataFrame, *, row: str = "config", title: str | None = None) -> alt.TopLevelMixin:
    """Tokens emitted by each verify step against the output position where the step started, one panel per
    `row` value: long bars are where speculation pays, flat stretches at 1 are where it does not."""
    data = steps.with_columns((pl.col("emitted").cum_sum().over(row) - pl.col("emitted") + 1).alias("position"))
    chart = alt.Chart().mark_bar(width=1.5).encode(
        x=alt.X("position:Q", title="output position (tokens)"),
        y=alt.Y("emitted:Q", title="tokens/step"),
        color=alt.Color(f"{row}:N", legend=None),
        tooltip=["position", "emitted", "accepted", alt.Tooltip("block:Q", title="block")],
    ).properties(width=WIDTH * 4, height=70)
    out = chart.facet(row=alt.Row(f"{row}:N", title=None, header=alt.Header(labelAngle=0, labelAlign="left")),
                      data=data)
    return out.properties(title=title) if title else out


def predicted_vs_measured(data: pl.DataFrame, x: str, y: str, color: str, *, tolerance: float = 0.1,
                          x_title: str | None = None, y_title: str | None = None,
                          tooltip: list[str] | None = None) -> alt.TopLevelMixin:
    """One dot per row, predicted (`y`) against measured (`x`) on log axes, with the diagonal (exact) and dashed
    lines at ± `tolerance` around it: the dots between the dashed lines are within the tolerance."""
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be in (0, 1) (got {tolerance})")
    lo, hi = float(min(data[x].min(), data[y].min())) * 0.8, float(max(data[x].max(), data[y].max())) * 1.25
    line = pl.DataFrame({"m": [lo, hi]}).with_columns(pl.col("m").alias("exact"),
                                                      (pl.col("m") * (1 + tolerance)).alias("above"),
                                                      (pl.col("m") * (1 - tolerance)).alias("below"))
    guides = line.unpivot(index="m", on=["exact", "above", "below"], variable_name="guide", value_name="p")
    axis_x = alt.X(f"{x}:Q", title=x_title or x, scale=alt.Scale(type="log", domain=[lo, hi]))
    axis_y = alt.Y(f"{y}:Q", title=y_title or y, scale=alt.Scale(type="log", domain=[lo, hi]))
    rules = alt.Chart(guides).mark_line(color="#888").encode(
        x=alt.X("m:Q", scale=alt.Scale(type="log", domain=[lo, hi])), y=alt.Y("p:Q"), detail="guide:N",
        strokeDash=alt.condition(alt.datum.guide == "exact", alt.value([1, 0]), alt.value([4, 3])))
    dots = alt.Chart(data).mark_circle(size=45, opacity=0.8).encode(
        x=axis_x, y=axis_y, color=alt.Color(f"{color}:N", sort=None, legend=alt.Legend(labelLimit=400)),
        tooltip=tooltip or [color, alt.Tooltip(f"{x}:Q", format=".4g"), alt.Tooltip(f"{y}:Q", format=".4g")])
    return alt.layer(rules, dots).properties(width=WIDTH * 2.4, height=WIDTH * 2.4)


def lines_with_mark(data: pl.DataFrame, x: str, y: str, color: str, *, panel: str, columns: int = 3,
                    mark: tuple[float, float, str] | None = None, x_title: str | None = None,
                    y_title: str | None = None, log_x: bool = True, log_y: bool = True) -> alt.TopLevelMixin:
    """Lines of `y` against `x` per `color`, one panel per `panel` value that has rows (in order of appearance),
    and in every panel one reference point `mark` = (x, y, label) (e.g. a published claim to compare against) with
    a dashed rule at its y."""
    def domain(column: str, values: list[float], log: bool) -> alt.Scale:
        lo, hi = min(values), max(values)  # the data's range (and the mark's), not a padded one
        pad = (hi / lo) ** 0.05 if log and lo > 0 else 1.0
        return alt.Scale(type="log" if log else "linear", domain=[lo / pad, hi * pad], nice=False)

    marked = [mark[0]] if mark else []
    scale_x = domain(x, data[x].to_list() + marked, log_x)
    scale_y = domain(y, data[y].to_list() + ([mark[1]] if mark else []), log_y)
    layers: list[alt.Chart] = [alt.Chart().mark_line(point=True).encode(
        x=alt.X(f"{x}:Q", title=x_title or x, scale=scale_x), y=alt.Y(f"{y}:Q", title=y_title or y, scale=scale_y),
        color=alt.Color(f"{color}:N", sort=None),
        tooltip=[x, color, alt.Tooltip(f"{y}:Q", format=".3g")])]
    if mark is not None:
        mx, my, label = mark
        layers += [alt.Chart().mark_rule(strokeDash=[4, 3], color="#444").encode(y=alt.datum(my)),
                   alt.Chart().mark_point(shape="diamond", size=90, filled=True, color="black").encode(
                       x=alt.datum(mx), y=alt.datum(my)),
                   alt.Chart().mark_text(align="left", dx=6, dy=-8, fontSize=9).encode(
                       x=alt.datum(mx), y=alt.datum(my), text=alt.datum(label))]
    chart = alt.layer(*layers).properties(width=WIDTH * 1.3, height=150)
    order = list(dict.fromkeys(data[panel].to_list()))
    return chart.facet(alt.Facet(f"{panel}:N", title=None, sort=order, header=alt.Header(labelLimit=400)),
                       columns=columns, data=data)


def panel_lines(data: pl.DataFrame, x: str, y: str, color: str, *, panel: str, order: list[str] | None = None,
                x_title: str | None = None, y_title: str | None = None, log_x: bool = False,
                columns: int = 3) -> alt.TopLevelMixin:
    """Lines of `y` against `x` per `color`, one panel per `panel` value in the given `order` (default: as they
    first appear), the x axis spanning the data only (e.g. ms per step against the verify width, per batch and
    context)."""
    lo, hi = float(data[x].min()), float(data[x].max())
    chart = alt.Chart().mark_line(point=True).encode(
        x=alt.X(f"{x}:Q", title=x_title or x,
                scale=alt.Scale(type="log" if log_x else "linear", domain=[lo, hi], nice=False),
                axis=alt.Axis(values=sorted(set(data[x].to_list()))) if log_x else alt.Axis()),
        y=alt.Y(f"{y}:Q", title=y_title or y),
        color=alt.Color(f"{color}:N", sort=None),
        tooltip=[x, color, panel, alt.Tooltip(f"{y}:Q", format=".3g")],
    ).properties(width=WIDTH * 1.4, height=160)
    sort = order or list(dict.fromkeys(data[panel].to_list()))
    return chart.facet(alt.Facet(f"{panel}:N", title=None, sort=sort), columns=columns, data=data)


def time_panels(data: pl.DataFrame, x: str, y: str, color: str, *, panel: str, x_title: str | None = None,
                columns: int = 1) -> alt.TopLevelMixin:
    """Lines of `y` against time `x` per `color`, one panel per `panel` value (in order of appearance), each panel
    with its own y scale from the data's range (measures of different units over one time axis, e.g. a server's
    throughput and its memory over a soak); no points, for series of hundreds of samples."""
    chart = alt.Chart().mark_line(strokeWidth=1.5).encode(
        x=alt.X(f"{x}:Q", title=x_title or x),
        y=alt.Y(f"{y}:Q", title=None, scale=alt.Scale(zero=False)),
        color=alt.Color(f"{color}:N", sort=None, legend=alt.Legend(orient="bottom", columns=2, labelLimit=400)),
        tooltip=[color, panel, alt.Tooltip(f"{x}:Q", format=".3g"), alt.Tooltip(f"{y}:Q", format=".4g")],
    ).properties(width=WIDTH * 3, height=140)
    order = list(dict.fromkeys(data[panel].to_list()))
    return chart.facet(alt.Facet(f"{panel}:N", title=None, sort=order, header=alt.Header(labelLimit=400)),
                       columns=columns, data=data).resolve_scale(y="independent")


def ranges(data: pl.DataFrame, x: str, y: str, lo: str, hi: str, color: str, *, facet: str | None = None,
           rules: dict[str, float] | None = None, y_title: str | None = None,
           width: int = WIDTH * 2) -> alt.TopLevelMixin:
    """A dot at `y` with a bar from `lo` to `hi` per row (e.g. the median of repeats and their range), side by side
    per `color` within each `x` group, one panel per `facet` value; dashed lines at `rules` (label -> y, e.g. an
    acceptance bar), labelled at the panel's left edge. The y axis spans the data and the rules, not from 0."""
    rules = rules or {}
    values = data[lo].to_list() + data[hi].to_list() + data[y].to_list() + list(rules.values())
    low, high = min(values), max(values)
    pad = (high - low) * 0.08 or 0.05
    scale = alt.Scale(domain=[low - pad, high + pad], nice=False, zero=False)
    group = {"x": alt.X(f"{x}:N", title=None, sort=None, axis=alt.Axis(labelAngle=0)),
             "xOffset": alt.XOffset(f"{color}:N", sort=None),
             "color": alt.Color(f"{color}:N", sort=None, legend=alt.Legend(orient="bottom", columns=1, labelLimit=400))}
    layers: list[alt.Chart] = [
        alt.Chart().mark_rule(strokeWidth=2).encode(**group, y=alt.Y(f"{lo}:Q", scale=scale, title=y_title or y),
                                                    y2=f"{hi}:Q"),
        alt.Chart().mark_point(filled=True, size=55, opacity=1).encode(
            **group, y=alt.Y(f"{y}:Q", scale=scale),
            tooltip=[x, color, *([facet] if facet else []), alt.Tooltip(f"{y}:Q", format=".3g"),
                     alt.Tooltip(f"{lo}:Q", format=".3g"), alt.Tooltip(f"{hi}:Q", format=".3g")])]
    for label, value in rules.items():  # the aggregate leaves one row, so each is drawn once (not once per row)
        layers += [alt.Chart().transform_aggregate(n="count()").mark_rule(strokeDash=[4, 3], color="#444")
                   .encode(y=alt.datum(value)),
                   alt.Chart().transform_aggregate(n="count()").mark_text(align="left", dy=-5, fontSize=9,
                                                                          color="#444")
                   .encode(x=alt.value(3), y=alt.datum(value), text=alt.datum(label))]
    if not facet:
        return alt.layer(*layers, data=data).properties(width=width, height=200)
    order = list(dict.fromkeys(data[facet].to_list()))
    return alt.layer(*layers).properties(width=width, height=200).facet(
        alt.Facet(f"{facet}:N", title=None, sort=order), columns=2, data=data)


def line_grid(data: pl.DataFrame, x: str, y: str, color: str, *, row: str, column: str, x_title: str | None = None,
              y_title: str | None = None, log_x: bool = True, x_ticks: list[float] | None = None,
              colors: list[str] | None = None, dash: str | None = None) -> alt.TopLevelMixin:
    """Lines of `y` against `x` per `color` in a grid of panels, one row per `row` value and one column per `column`
    value (each in order of appearance), every row with its own x and y scales (e.g. a measure against one bound
    per row, a workload per column); the row's value is its title. `x_ticks`: the x axis's ticks (labelled 1k,
    1M, ...); `colors`: every `color` value in the order their colours are assigned (so several figures colour
    the same series alike); `dash`: a boolean column drawn dashed where true (e.g. measured beside replayed)."""
    axis = alt.Axis(values=x_ticks, format="~s") if x_ticks else alt.Axis()
    scale = alt.Scale()
    if colors:  # each series keeps its place in `colors` (and so its colour) whichever of them this figure draws
        present = set(data[color].to_list())
        scale = alt.Scale(domain=[c for c in colors if c in present],
                          range=[TABLEAU10[i % len(TABLEAU10)] for i, c in enumerate(colors) if c in present])
    encode = dict(
        x=alt.X(f"{x}:Q", title=x if x_title is None else x_title, axis=axis,
                scale=alt.Scale(type="log" if log_x else "linear", nice=False)),
        y=alt.Y(f"{y}:Q", title=y if y_title is None else y_title, scale=alt.Scale(zero=False)),
        color=alt.Color(f"{color}:N", sort=None, scale=scale,
                        legend=alt.Legend(orient="bottom", columns=2, labelLimit=400, title=None)),
        tooltip=[x, color, row, column, alt.Tooltip(f"{y}:Q", format=".3g")])
    if dash:
        encode["strokeDash"] = alt.StrokeDash(f"{dash}:N", legend=None)
    chart = alt.Chart().mark_line(point=True).encode(**encode).properties(width=WIDTH, height=110)
    rows, columns = (list(dict.fromkeys(data[c].to_list())) for c in (row, column))
    return (chart.facet(row=alt.Row(f"{row}:N", title=None, sort=rows,
                                    header=alt.Header(labelAngle=0, labelAlign="left", labelLimit=260)),
                        column=alt.Column(f"{column}:N", title=None, sort=columns), data=data)
            .resolve_scale(x="independent", y="independent"))
