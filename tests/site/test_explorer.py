"""The explorer's coloured token stream (a pure function of an output and its step records) and its widget.

Records come from the exact replay of the real lookup proposer over token sequences built so that the expected
sources are known by construction.
"""

from __future__ import annotations

import html
import re

import pytest

from hqlab.site.explorer import KINDS, Explorer, classify, render_stream, spec_of, summary
from hqlab.proposers import make_proposer
from hqlab.proposers.base import Source
from hqlab.replay import replay
from hqlab.replay.traces import Trace
from hqlab.trace import StepRecord, tokens_per_step

# A prompt with a 40-token passage; the output copies the passage's first 30 tokens, then says something new.
PASSAGE = list(range(100, 140))
PROMPT = [1, 2, 3] + PASSAGE + [4, 5]
OUTPUT = PASSAGE[:30] + [900, 901, 902, 903, 904, 905]
TEXTS = [f"w{t} " for t in OUTPUT]


def _records(spec: str = "lookup:nmin=2,nmax=8,k=8", output=OUTPUT, max_new=64) -> list[StepRecord]:
    return replay(PROMPT, output, make_proposer(spec), max_new_tokens=max_new)


def _plain(rendered: str) -> str:
    """The text a reader sees: tags removed, entities decoded, the step-block badges dropped."""
    no_badges = re.sub(r'<sub class="hq-block"[^>]*>\d+</sub>', "", rendered)
    body = no_badges.split('<div style="white-space:pre-wrap', 1)[1]
    return html.unescape(re.sub(r"<[^>]+>", "", body.split(">", 1)[1]))


def test_classify_assigns_every_token_one_source():
    records = _records()
    tokens = classify(len(OUTPUT), records)
    assert [t.index for t in tokens] == list(range(len(OUTPUT)))
    assert tokens[0].kind == "prefill"
    kinds = [t.kind for t in tokens]
    # every accepted proposed token came from the lookup, one target token closes every step
    assert kinds.count("lookup") == sum(r.accepted for r in records)
    assert sum(kinds.count(k) for k in ("bonus", "correction", "target")) == len(records)
    # the copy is proposed by lookup; the novel tail is the target's own
    # (k = 8: eight accepted lookup tokens, then the target's bonus token, over and over)
    assert set(kinds[2:30]) == {"lookup", "bonus"} and kinds[2:30].count("lookup") >= 24
    assert kinds[30] == "correction" and set(kinds[31:]) <= {"correction", "target"}


def test_bonus_vs_correction_vs_no_proposal():
    # a fully accepted proposal ends with a bonus token, a partly rejected one with a correction
    full = StepRecord("r", 0, 10, 4, [7, 8, 9], [1, 1, 1], 5, 3, 4, 0.0, 0.0, 0.0, block=3)
    part = StepRecord("r", 1, 14, 4, [7, 8, 9], [2, 2, 2], 0, 1, 2, 0.0, 0.0, 0.0, block=3)
    none = StepRecord("r", 2, 16, 1, [], [], 0, 0, 1, 0.0, 0.0, 0.0, block=3)
    kinds = [t.kind for t in classify(8, [full, part, none])]
    assert kinds == ["prefill", "lookup", "lookup", "lookup", "bonus", "drafter", "correction", "target"]
    assert [t.step for t in classify(8, [full, part, none])] == [-1, 0, 0, 0, 0, 1, 1, 2]


def test_classify_rejects_records_from_another_run():
    with pytest.raises(ValueError, match="different runs"):
        classify(len(OUTPUT) + 3, _records())


def test_render_stream_shows_text_steps_blocks_and_colors():
    records = _records()
    out = render_stream(TEXTS, records, title="copy")
    assert _plain(out) == "".join(TEXTS)
    # one box per verify step (plus the prefill token), each with its block length visible
    assert len(re.findall(r'class="hq-step" data-step="\d+"', out)) == len(records)
    assert re.findall(r'<sub class="hq-block"[^>]*>(\d+)</sub>', out) == [str(r.block) for r in records]
    assert all(r.block == 8 for r in records)
    kinds = [t.kind for t in classify(len(OUTPUT), records)]
    for kind in set(kinds):
        assert out.count(f'class="hq-tok hq-{kind}" style="background:{KINDS[kind][0]}"') == kinds.count(kind)


def test_render_stream_is_pure_and_escapes():
    texts = ["<b>", "&", "\n", "x"]
    records = [StepRecord("r", 0, 5, 3, [11, 12], [int(Source.LOOKUP)] * 2, 3, 2, 3, 0.0, 0.0, 0.0, block=2)]
    a = render_stream(texts, records)
    assert a == render_stream(list(texts), list(records))
    assert "&lt;b&gt;" in a and "&amp;" in a and "↵" in a
    assert records[0].accepted == 2 and texts == ["<b>", "&", "\n", "x"]  # inputs untouched


def test_summary_matches_trace_metrics():
    records = _records()
    s = summary(records, len(OUTPUT))
    assert s["steps"] == len(records)
    assert s["tokens_per_step"] == pytest.approx(tokens_per_step(records))
    assert sum(s["by_source"].values()) == len(OUTPUT)


def test_spec_of_round_trips():
    assert spec_of("lookup", {"nmin": 2, "full": True, "policy": "recent"}) == "lookup:nmin=2,full=true,policy=recent"
    assert spec_of("none", {}) == "none"


def test_explorer_widget_reruns_replay_on_slider_change():
    trace = Trace("copy-1", "copy", PROMPT, OUTPUT, 64)
    ex = Explorer([trace], lambda t: f"w{t} ", proposers=["lookup", "pld"], start="lookup:nmin=2,nmax=8,k=8")
    assert set(ex._fields) >= {"nmin", "nmax", "k", "policy", "search", "full"}
    first = ex.stream.value
    assert first == render_stream(TEXTS, _records("lookup:nmin=2,nmax=8,k=8"))
    ex.set(k=3)
    assert ex.spec.startswith("lookup:nmin=2,nmax=8,k=3")
    assert ex.stream.value == render_stream(TEXTS, _records(ex.spec)) != first
    assert f"{tokens_per_step(_records(ex.spec)):.2f} tokens/step" in ex.summary.value
    # an invalid combination is reported, not raised, and leaves the last stream in place
    shown = ex.stream.value
    ex.set(nmin=12)
    assert "nmin must be &lt;= nmax" in ex.summary.value and ex.stream.value == shown
    # switching proposer rebuilds the controls from its config
    ex.proposer.value = "pld"
    assert set(ex._fields) == {"n", "k", "full"} and ex.spec == "pld"
    ex.set(n=2, full=False)
    assert ex.spec == "pld:n=2,full=false"
    assert "tokens/step" in ex.summary.value


def test_explorer_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        Explorer([], str)
    with pytest.raises(ValueError, match="not among"):
        Explorer([Trace("a", "c", PROMPT, OUTPUT, 64)], str, proposers=["pld"], start="lookup")
