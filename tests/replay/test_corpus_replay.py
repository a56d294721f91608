"""The corpus replay (hqlab.replay.corpus) on the committed traces of the corpus workloads: without a corpus it is
the plain lookup replay, its corpus search decides as the reference rule, a repeated request is drafted whole from
the corpus, policy own never gives up an own-history match, and Arctic's rule keeps its published limits."""

from __future__ import annotations

import numpy as np
import pytest

from hqlab.bench import results
from hqlab.config import ConfigError
from hqlab.proposers import make_proposer
from hqlab.replay import replay
from hqlab.replay import corpus as rc
from hqlab.replay.traces import load_traces
from hqlab.rules.corpus import Corpus, CorpusConfig
from hqlab.rules.lookup import suffix_match
from hqlab.rules.suffix_decoding import SuffixDecodingConfig, speculate
from hqlab.trace import Source

(TRACES,) = results.trace_files(["0.5b_corpus_128"])
WORKLOADS = ("multiturn", "template", "agent")


@pytest.fixture(scope="module")
def traces():
    return {w: [t for t in load_traces(TRACES) if t.category == w] for w in WORKLOADS}


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("nmin, nmax, tie", [(1, 32, "earliest"), (3, 12, "recent")])
def test_an_empty_corpus_is_the_plain_lookup(traces, workload, nmin, nmax, tie):
    proposer = make_proposer(f"lookup:nmin={nmin},nmax={nmax},k=15,policy={tie}")
    got = rc.replay_corpus(traces[workload], f"corpus:nmin={nmin},nmax={nmax},k=15,tie={tie},tokens=0")
    for trace, records in zip(traces[workload], got, strict=True):
        plain = replay(trace.prompt_ids, trace.output_ids, proposer, max_new_tokens=trace.max_new_tokens,
                       request=trace.prompt_id)
        assert [(list(r.proposed), r.match_len, r.accepted, r.emitted, r.context_len) for r in records] == \
            [(list(r.proposed), r.match_len, r.accepted, r.emitted, r.context_len) for r in plain]


@pytest.mark.parametrize("nmin, nmax, tie", [(1, 32, "earliest"), (2, 8, "recent")])
def test_corpus_view_decides_as_the_reference_rule(traces, nmin, nmax, tie):
    """At every output position of every agent and multi-turn request, over a corpus of the requests before it
    (small enough that eviction happens), the snapshot's match is the rule's, field for field."""
    reqs = traces["multiturn"] + traces["agent"]
    corpus = Corpus(CorpusConfig(tokens=1500, docs=12, prompts=True))
    checked = found = 0
    for i, trace in enumerate(reqs):
        if i:
            corpus.add(rc.document(reqs[i - 1], prompts=True))
        view = rc.CorpusView(corpus)
        h = np.asarray(trace.prompt_ids + trace.output_ids)
        for t in range(len(trace.prompt_ids), h.size, 3):
            want = corpus.match(h[: t + 1], nmin=nmin, nmax=nmax, k=15, policy=tie)
            got = view.match(h[: t + 1], nmin=nmin, nmax=nmax, k=15, policy=tie)
            assert (got.end, got.match_len, got.valid, got.doc, list(got.tokens)) == \
                (want.end, want.match_len, want.valid, want.doc, list(want.tokens)), (trace.prompt_id, t)
            checked += 1
            found += want.match_len > 0
    assert checked > 500 and found > checked // 4  # the check saw real matches, not only misses


def test_a_repeated_request_is_drafted_whole_from_the_corpus(traces):
    """The retried request (multiturn-text-0, turn 2, the same messages as turn 1): with its first copy in the
    corpus as prompt + output, the corpus match spans the whole history, longer than any own match, so every step
    drafts from the corpus and keeps all it proposes."""
    reqs = traces["multiturn"]
    first = next(i for i, t in enumerate(reqs) if t.prompt_id == "multiturn-text-0/1")
    again = next(i for i, t in enumerate(reqs) if t.prompt_id == "multiturn-text-0/2")
    assert reqs[first].prompt_ids == reqs[again].prompt_ids and reqs[first].output_ids == reqs[again].output_ids
    spec = "corpus:nmin=1,nmax=100000,k=15,tokens=65536,choice=longest,prompts=true,inflight=8"
    records = rc.replay_corpus(reqs, spec)[again]
    n = len(reqs[again].output_ids)
    assert all(r.sources and set(r.sources) == {Source.CORPUS} for r in records)
    done = 1
    for r in records:  # everything proposed is kept, except a last token past the output's end (no target there)
        assert r.accepted == min(len(r.proposed), n - done - 1)
        done += r.emitted
    assert done == n
    assert len(records) == -(-(n - 1) // 16)  # 15 proposed + 1 per step after the prefill token
    # without the corpus the same request takes more steps
    assert len(rc.replay_corpus(reqs, spec.replace("tokens=65536", "tokens=0"))[again]) > len(records)


@pytest.mark.parametrize("workload", WORKLOADS)
def test_policy_own_never_gives_up_an_own_match(traces, workload):
    # nmin 3: with nmin 1 own history nearly always has some match, and policy own leaves the corpus nothing
    spec = "corpus:nmin=3,nmax=32,k=15,tokens=8192,choice=own,inflight=1"
    from_corpus = 0
    for trace, records in zip(traces[workload], rc.replay_corpus(traces[workload], spec), strict=True):
        h = np.asarray(trace.prompt_ids + trace.output_ids)
        for r in records:
            kk = min(15, trace.max_new_tokens - (r.context_len - len(trace.prompt_ids) + 1) - 1)
            own = suffix_match(h[: r.context_len + 1], nmin=3, nmax=32, k=kk, policy="earliest")
            if own.match_len:
                assert set(r.sources) <= {Source.LOOKUP} and list(r.proposed) == list(own.tokens)
            elif r.proposed:
                assert set(r.sources) == {Source.CORPUS}
                from_corpus += 1
    # the corpus did draft where own history had nothing (the agent's calls and results are all in its own prompt)
    assert (from_corpus > 0) == (workload != "agent")


def test_the_corpus_adds_where_requests_share_text(traces):
    """Each workload replayed alone, 8 requests in flight: on the multi-turn and template workloads the corpus
    supplies accepted tokens and raises tokens per step; on the agent workload it finds next to nothing."""
    specs = ["corpus:tokens=0,inflight=8", "corpus:tokens=16384,choice=longest,inflight=8"]
    for w in WORKLOADS:
        summary = rc.summarize(rc.rows(traces[w], specs, progress=False), by=("spec",))
        plain, with_corpus = summary.row(0, named=True), summary.row(1, named=True)
        assert plain["corpus_accepted_share"] == 0 and plain["corpus_step_share"] == 0
        if w == "agent":
            assert with_corpus["tokens_per_step"] == pytest.approx(plain["tokens_per_step"], rel=0.02)
        else:
            assert with_corpus["corpus_accepted_share"] > 0.05, w
            assert with_corpus["tokens_per_step"] > 1.03 * plain["tokens_per_step"], w


def test_arctic_rule_keeps_its_limits(traces):
    """Arctic's draft is at most min(k, match × factor + offset) tokens and never runs past the tree's depth; the
    global tree drafts only with tokens > 0."""
    reqs = traces["multiturn"][:12]
    for spec, factor, offset in [("arctic:k=15,depth=24,factor=1,tokens=0", 1.0, 0.0),
                                 ("arctic:k=15,depth=12,factor=0.5,offset=2,tokens=8192", 0.5, 2.0)]:
        config = rc.parse(spec)
        sources = set()
        for records in rc.replay_corpus(reqs, config):
            for r in records:
                if r.proposed:
                    assert len(r.proposed) <= min(15, int(r.match_len * factor + offset + 1e-6))
                    assert r.match_len + len(r.proposed) <= config.depth
                sources |= set(r.sources)
        assert (Source.CORPUS in sources) == (config.tokens > 0)


def test_arctic_rule_scores_by_frequency():
    """Arctic's `_speculate_path` by hand. After "1 2": "3" twice, "4" once, and the context's own occurrence at
    the end counts too, so p(3) = 2/4; "3" -> "5" both times (p stays 0.5); "5" -> "9" or "7", once each: p = 0.25.
    With min_prob 0.3 the draft stops there; "2" alone has the same occurrences and the same score (1.0), and ties go
    to the longer match. With min_prob 0.2 it goes on (ties: the first occurrence, "9") to factor × 2 = 8 tokens."""
    h = np.array([1, 2, 3, 5, 9, 1, 2, 3, 5, 7, 1, 2, 4, 0, 1, 2])
    draft = speculate(h, h.size, None, 15, SuffixDecodingConfig(k=15, depth=16, factor=4, min_prob=0.3))
    assert (list(draft.tokens), draft.match_len, draft.score, draft.from_global) == ([3, 5], 2, 1.0, False)
    draft = speculate(h, h.size, None, 15, SuffixDecodingConfig(k=15, depth=16, factor=4, min_prob=0.2))
    assert (list(draft.tokens), draft.match_len, draft.score) == ([3, 5, 9, 1, 2, 3, 5, 7], 2, 2.5)
    # a global tree whose only output continues "1 2" with "8 8 8" for sure scores higher and wins
    draft = speculate(h, h.size, [np.array([1, 2, 8, 8, 8])], 15,
                      SuffixDecodingConfig(k=15, depth=16, factor=4, min_prob=0.3))
    assert (list(draft.tokens), draft.from_global) == ([8, 8, 8], True)


@pytest.mark.parametrize("spec, message", [
    ("corpus:nmin=4,nmax=2", "need 1 <= nmin <= nmax"),
    ("corpus:tokens=-1", "tokens must be >= 0"),
    ("corpus:choice=corpus", "choice must be one of"),
    ("corpus:inflight=0", "inflight must be >= 1"),
    ("corpus:tokens=10,docs=0", "corpus docs must be an int >= 1"),
    ("corpus:size=3", "unknown key(s) size"),
    ("arctic:min_prob=2", "min_prob must be in [0, 1]"),
    ("arctic:cached=0", "cached must be -1"),
    ("corpus:schedule=fifo", "schedule must be one of"),
    ("suffix:k=3", "unknown corpus replay 'suffix'"),
])
def test_bad_specs_are_clear_errors(spec, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        rc.parse(spec)


def test_arctic_rule_proposer_is_the_replayed_rule(traces):
    """The zoo member `arctic-rule` (the rule behind hqlab's Proposer protocol) takes the replay's steps with no
    global tree, and with `cached` its global tree of finished requests drafts for later ones."""
    from hqlab.replay import zoo

    assert zoo.ZOO["Arctic's rule, reimplemented"].startswith("arctic-rule:") and \
        "Arctic's rule, reimplemented" in zoo.available()[0]
    reqs = traces["template"][:8]
    proposer = make_proposer("arctic-rule:k=15,depth=24")
    for trace, records in zip(reqs, rc.replay_corpus(reqs, "arctic:k=15,depth=24,tokens=0"), strict=True):
        live = replay(trace.prompt_ids, trace.output_ids, proposer, max_new_tokens=trace.max_new_tokens,
                      request=trace.prompt_id, path="step")
        assert [(list(r.proposed), r.match_len, r.accepted) for r in live] == \
            [(list(r.proposed), r.match_len, r.accepted) for r in records]
    steps = zoo.run_zoo(reqs, {"cached": "arctic-rule:k=15,cached=-1"}, repeats=1, progress=False)
    alone = zoo.run_zoo(reqs, {"alone": "arctic-rule:k=15"}, repeats=1, progress=False)
    assert steps["accepted"].sum() > alone["accepted"].sum()  # the template's answers share their structure


@pytest.mark.parametrize("spec", ["corpus:tokens=4096,choice=longest,prompts=true", "arctic:tokens=4096"])
def test_lockstep_with_one_request_in_flight_is_the_admit_schedule(traces, spec):
    reqs = traces["multiturn"]
    admit = rc.replay_corpus(reqs, f"{spec},inflight=1,schedule=admit")
    lockstep = rc.replay_corpus(reqs, f"{spec},inflight=1,schedule=lockstep")
    assert [[(list(r.proposed), r.accepted) for r in a] for a in admit] == \
        [[(list(r.proposed), r.accepted) for r in b] for b in lockstep]


def test_lockstep_sends_a_sessions_next_turn_after_its_answer(traces):
    """8 slots over the 24 multi-turn requests: a session's turn t + 1 starts after its turn t finished, at most 8
    requests decode at once, and documents that finish mid-request reach those still decoding: the corpus is
    seen at least as much as under the admit schedule, where it is frozen at admission."""
    reqs = traces["multiturn"]
    spec = "corpus:tokens=16384,choice=longest,inflight=8"
    runs = rc._replay(reqs, f"{spec},schedule=lockstep")
    by_session: dict[str, list] = {}
    for run in runs:
        by_session.setdefault(rc.session_of(run.trace), []).append(run)
    assert len(by_session) == 8 and all(len(v) == 3 for v in by_session.values())
    for turns in by_session.values():
        for before, after in zip(turns, turns[1:]):
            assert after.admitted > before.left
    last = max(r.left for r in runs)
    assert max(sum(r.admitted <= it <= r.left for r in runs) for it in range(last + 1)) == 8
    admit = rc.summarize(rc.rows(reqs, [f"{spec},schedule=admit", f"{spec},schedule=lockstep"], progress=False),
                         by=("spec",))
    assert admit["corpus_accepted_share"][1] > admit["corpus_accepted_share"][0]
