"""Interactive explorer: one request's output, token by token, coloured by who supplied each token.

Every token of a speculative decode comes from one of: the proposal (a lookup match or a model drafter) that the
target then accepted, or the target itself, as the *correction* where it rejected a proposed token or as the
*bonus* after a fully accepted proposal (or the plain next token when nothing was proposed). `render_stream` turns
a recorded output and its step records into HTML that shows exactly that, with a boundary and the block length
at every verify step; it is a pure function (the tests pin it down). `Explorer` puts it in a JupyterLab widget
with controls for every field of the chosen proposer's config, re-running the exact replay on each change.
"""

from __future__ import annotations

import dataclasses
import html
import typing
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from hqlab.trace import Source, StepRecord, tokens_per_step

# Who supplied a token, and how it is drawn. "target" = the target's own token on a step with no proposal.
KINDS = {
    "prefill": ("#e0e0e0", "first token (prefill)"),
    "lookup": ("#9fd8a4", "lookup, accepted"),
    "drafter": ("#9cc3ee", "drafter, accepted"),
    "proposed": ("#d9c2ee", "other proposer, accepted"),
    "correction": ("#f4a09a", "target: correction of a rejected token"),
    "bonus": ("#f7d48a", "target: bonus after a fully accepted proposal"),
    "target": ("#ffffff", "target: no proposal this step"),
}
_SOURCE_KIND = {int(Source.LOOKUP): "lookup", int(Source.DRAFT): "drafter"}


@dataclass(frozen=True)
class Token:
    index: int  # position in the output
    step: int  # verify step that emitted it; -1 for the prefill token
    kind: str  # a key of KINDS


def classify(output_len: int, records: Sequence[StepRecord]) -> list[Token]:
    """Source of every output token, from the step records that produced the output.

    Step i emits `emitted` tokens: the first `accepted` are proposed tokens the target accepted (their source is
    the proposal's per-position tag), then the target's own token. Raises ValueError when the records do not
    account for exactly `output_len` tokens.
    """
    if output_len == 0:
        if records:
            raise ValueError("records given for an empty output")
        return []
    tokens = [Token(0, -1, "prefill")]
    for r in records:
        for j in range(r.emitted):
            if j < r.accepted:
                kind = _SOURCE_KIND.get(int(r.sources[j]), "proposed") if j < len(r.sources) else "proposed"
            elif not r.proposed:
                kind = "target"
            else:
                kind = "bonus" if r.accepted >= len(r.proposed) else "correction"
            tokens.append(Token(len(tokens), r.step, kind))
    if len(tokens) != output_len:
        raise ValueError(f"step records emit {len(tokens)} tokens (prefill included) but the output has "
                         f"{output_len}: records and output are from different runs")
    return tokens


def summary(records: Sequence[StepRecord], output_len: int) -> dict[str, Any]:
    """Headline numbers for one request: steps, tokens/step (bonus included), tokens per source."""
    kinds = [t.kind for t in classify(output_len, records)]
    counts = {k: kinds.count(k) for k in KINDS if kinds.count(k)}
    steps = len(records)
    return {"steps": steps, "tokens": output_len,
            "tokens_per_step": tokens_per_step(list(records)),
            "proposed": sum(len(r.proposed) for r in records), "accepted": sum(r.accepted for r in records),
            "by_source": counts}


def _visible(text: str) -> str:
    """Escaped token text; line breaks and tabs are marked so that whitespace-only tokens can be seen."""
    out = html.escape(text, quote=False).replace("\t", "→\t")
    return out.replace("\n", '<span style="color:#999">↵</span>\n')


def render_stream(texts: Sequence[str], records: Sequence[StepRecord], *, title: str = "") -> str:
    """HTML of one request's output (`texts`: the text of each output token) coloured by source.

    Each verify step is one box whose left edge is the step boundary and whose small grey number is the block
    length the step was allowed (`record.block`, the verify budget); hovering a step or token tells the step,
    proposed/accepted counts and the lookup match length. Pure: the result depends only on the arguments.
    """
    tokens = classify(len(texts), records)
    by_step = {r.step: r for r in records}
    legend = " ".join(
        f'<span style="background:{color};border:1px solid #bbb;padding:0 4px;margin-right:6px">{label}</span>'
        for kind, (color, label) in KINDS.items() if kind != "prefill")
    parts = [f'<div class="hq-stream" style="font:13px/1.9 ui-monospace,\'DejaVu Sans Mono\',monospace">']
    if title:
        parts.append(f'<div style="font-weight:bold;margin-bottom:4px">{html.escape(title)}</div>')
    parts.append(f'<div style="font-size:11px;margin-bottom:6px">{legend}</div>')
    parts.append('<div style="white-space:pre-wrap;word-break:break-all">')
    current = None
    for tok in tokens:
        if tok.step != current:
            if current is not None:
                parts.append("</span>")
            current = tok.step
            r = by_step.get(tok.step)
            if r is None:
                parts.append('<span class="hq-step" data-step="-1" title="prefill">')
            else:
                tip = (f"step {r.step}: block {r.block}, proposed {len(r.proposed)}, accepted {r.accepted}, "
                       f"emitted {r.emitted}, match length {r.match_len}")
                parts.append(f'<span class="hq-step" data-step="{r.step}" data-block="{r.block}" title="{tip}" '
                             'style="border-left:2px solid #555;margin-left:1px">'
                             f'<sub class="hq-block" style="color:#777;font-size:9px">{r.block}</sub>')
        color = KINDS[tok.kind][0]
        parts.append(f'<span class="hq-tok hq-{tok.kind}" style="background:{color}">'
                     f"{_visible(texts[tok.index])}</span>")
    if current is not None:
        parts.append("</span>")
    parts.append("</div></div>")
    return "".join(parts)


# ------------------------------------------------------------------------------------------------------------
# the widget

# Slider ranges for known integer fields (any other int field gets 0..max(16, 2 * default)).
RANGES: dict[str, tuple[int, int]] = {"nmin": (1, 32), "nmax": (1, 64), "k": (1, 32), "search": (0, 8192),
                                      "n": (1, 8), "sticky": (0, 8), "draft_block": (1, 16)}
CHOICES: dict[str, list[str]] = {"policy": ["recent", "earliest"]}


def config_fields(config_cls: type) -> list[tuple[str, type, Any]]:
    """(name, type, default) of the fields a control can set: int, float, bool and str fields with defaults."""
    hints = typing.get_type_hints(config_cls)
    out = []
    for f in dataclasses.fields(config_cls):
        typ = hints.get(f.name)
        if f.init and typ in (int, float, bool, str) and f.default is not dataclasses.MISSING:
            out.append((f.name, typ, f.default))
    return out


def spec_of(name: str, values: dict[str, Any]) -> str:
    """`name:key=value,...` in the spec syntax every hqlab entry point takes."""
    items = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items())
    return f"{name}:{items}" if items else name


class Explorer:
    """A JupyterLab widget over recorded traces (`hqlab.replay.traces.Trace`s): pick a request and a proposer, move the
    sliders, and the replay re-runs and redraws the coloured stream.

    `token_text(id) -> str` renders one token (e.g. `lambda t: tokenizer.decode([t])`). `proposers` limits the
    proposer menu (default: every registered proposer but `none`); `start` is the initial spec.
    """

    def __init__(self, traces: Sequence[Any], token_text: Callable[[int], str], *,
                 proposers: Sequence[str] | None = None, start: str = "lookup") -> None:
        import ipywidgets as w

        from hqlab.config import parse_spec
        from hqlab.proposers import REGISTRY

        if not traces:
            raise ValueError("Explorer needs at least one recorded trace")
        self.traces = {t.prompt_id: t for t in traces}
        self._texts = {t.prompt_id: [token_text(int(i)) for i in t.output_ids] for t in traces}
        names = list(proposers or [n for n in REGISTRY if n != "none"])
        start_name, start_values = parse_spec(start)
        if start_name not in names:
            raise ValueError(f"start proposer {start_name!r} is not among {names}")
        self.request = w.Dropdown(options=list(self.traces), description="request")
        self.proposer = w.Dropdown(options=names, value=start_name, description="proposer")
        self.controls = w.HBox(layout=w.Layout(flex_flow="row wrap"))
        self.summary = w.HTML()
        self.stream = w.HTML()
        self.widget = w.VBox([w.HBox([self.request, self.proposer]), self.controls, self.summary, self.stream])
        self._fields: dict[str, Any] = {}
        self._defaults: dict[str, Any] = {}
        self._build_controls(start_values)
        self.request.observe(lambda _: self.update(), names="value")
        self.proposer.observe(lambda _: (self._build_controls({}), self.update()), names="value")
        self.update()

    def _build_controls(self, values: dict[str, str]) -> None:
        import ipywidgets as w

        from hqlab.config import resolve_spec
        from hqlab.proposers import REGISTRY

        config_cls = REGISTRY[self.proposer.value].Config
        initial = dataclasses.asdict(resolve_spec(spec_of(self.proposer.value, values), REGISTRY)[1])
        self._fields = {}
        self._defaults = {name: default for name, _, default in config_fields(config_cls)}
        style = {"description_width": "initial"}
        for name, typ, _ in config_fields(config_cls):
            value = initial[name]
            if typ is bool:
                control = w.Checkbox(value=value, description=name, style=style)
            elif typ is int:
                lo, hi = RANGES.get(name, (0, max(16, 2 * value)))
                control = w.IntSlider(value=value, min=min(lo, value), max=max(hi, value), description=name,
                                      continuous_update=False, style=style)
            elif typ is float:
                control = w.FloatSlider(value=value, min=0.0, max=max(1.0, 2 * value), step=0.05,
                                        description=name, continuous_update=False, style=style)
            elif name in CHOICES:
                control = w.Dropdown(options=CHOICES[name], value=value, description=name, style=style)
            else:
                control = w.Text(value=value, description=name, continuous_update=False, style=style)
            control.observe(lambda _: self.update(), names="value")
            self._fields[name] = control
        self.controls.children = list(self._fields.values())

    @property
    def spec(self) -> str:
        """The controls as a spec; fields left at their defaults (and empty strings) are not spelled out."""
        return spec_of(self.proposer.value, {k: c.value for k, c in self._fields.items()
                                             if c.value != self._defaults[k] and c.value != ""})

    def set(self, **values: Any) -> None:
        """Set controls by field name (as moving them by hand would), e.g. `explorer.set(k=8, nmin=2)`."""
        for k, v in values.items():
            if k not in self._fields:
                raise KeyError(f"no control {k!r}; have {', '.join(self._fields)}")
            self._fields[k].value = v

    def update(self) -> None:
        from hqlab.config import ConfigError
        from hqlab.proposers import make_proposer
        from hqlab.replay import replay

        trace = self.traces[self.request.value]
        try:
            proposer = make_proposer(self.spec)
            records = replay(trace.prompt_ids, trace.output_ids, proposer, max_new_tokens=trace.max_new_tokens,
                             request=trace.prompt_id)
        except ConfigError as e:
            self.summary.value = f'<b style="color:#b00">{html.escape(str(e))}</b>'
            return
        except Exception as e:  # noqa: BLE001 - a proposer that cannot run here (missing package, model) is shown
            self.summary.value = (f'<b style="color:#b00">{html.escape(self.spec)} failed: '
                                  f"{html.escape(type(e).__name__)}: {html.escape(str(e))}</b>")
            return
        s = summary(records, len(trace.output_ids))
        self.records = records
        self.summary.value = (f"<code>{html.escape(self.spec)}</code> on <b>{html.escape(trace.prompt_id)}</b> "
                              f"({html.escape(trace.category)}): {s['tokens']} tokens in {s['steps']} verify steps, "
                              f"<b>{s['tokens_per_step']:.2f} tokens/step</b>, {s['accepted']} of {s['proposed']} "
                              "proposed tokens accepted")
        self.stream.value = render_stream(self._texts[trace.prompt_id], records)
