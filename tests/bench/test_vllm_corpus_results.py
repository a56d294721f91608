"""The committed vLLM corpus run (#42, run c1: data/results/vllm_corpus_h200.parquet and its .requests.parquet, from
benchmarks/vllm_corpus.py finish) says what docs/corpus.md says of it, read through `hqlab.bench.corpus_report`;
and the reader's own rules on small frames. No vLLM, no GPU."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from hqlab import plots
from hqlab.bench import corpus_report as cr

ROOT = Path(__file__).resolve().parents[2]
POINTS = ROOT / "data" / "results" / "vllm_corpus_h200.parquet"
REQUESTS = ROOT / "data" / "results" / "vllm_corpus_h200.requests.parquet"
RUN = "c1"
BASE = "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest"
CORPUS = f"{BASE},corpus=32768,corpus_policy=longest,corpus_prompts=1"
WORKLOADS = {"agent", "multiturn", "prose", "template"}


@pytest.fixture(scope="module")
def points() -> pl.DataFrame:
    return pl.read_parquet(POINTS).filter(pl.col("run") == RUN)


@pytest.fixture(scope="module")
def requests() -> pl.DataFrame:
    return pl.read_parquet(REQUESTS).filter(pl.col("run") == RUN)


@pytest.fixture(scope="module")
def speedups(points) -> dict[tuple[str, int], dict]:
    return {(r["workload"], r["load"]): r for r in cr.speedups(points).iter_rows(named=True)}


# the committed run


def test_the_run_is_the_one_the_docs_describe(points, requests):
    assert points.height == 48 and requests.height == 600
    assert set(points["config"]) == {"none", BASE, CORPUS}
    assert set(points["device"]) == {"cuda (NVIDIA H100 80GB HBM3)"}  # an H100, whatever the file's name says
    assert set(points["vllm"]) == {"0.26.0"} and set(points["model"]) == {"qwen2.5-coder-1.5b"}
    # every engine ran vLLM's model runner V2 with asynchronous scheduling, as its own config said
    assert set(points["vllm_runner"]) == {"V2"} and points["async_scheduling"].all()
    assert set(points["git_commit"]) == {"4b1214b"}
    grid = points.group_by("workload", "load", "repeat").agg(pl.col("config").sort())
    assert grid.height == 16 and set(grid["workload"]) == WORKLOADS and set(grid["load"]) == {1, 8}
    assert all(sorted(c) == sorted(["none", BASE, CORPUS]) for c in grid["config"])  # none beside every point
    per_point = requests.group_by("config", "workload", "load", "repeat").len()
    assert per_point.join(points.select("config", "workload", "load", "repeat", "requests"),
                          on=["config", "workload", "load", "repeat"]).filter(
        pl.col("len") != pl.col("requests")).height == 0


def test_the_replay_predicts_every_step_vllm_took(points):
    speculating = points.filter(pl.col("config") != "none")
    assert speculating.height == 32
    assert speculating["replay_exact"].to_list() == [True] * 32
    assert (speculating["replay_steps"] > 0).all()
    assert (speculating["replay_exact_steps"] == speculating["replay_steps"]).all()
    assert (speculating["replay_tokens_per_step"] == speculating["vllm_tokens_per_step"]).all()
    assert (points.filter(pl.col("config") == CORPUS)["replay_corpus_steps"] > 0).all()  # the corpus was asked


def test_one_request_at_a_time_every_output_equals_none(requests):
    diff = cr.greedy_differences(requests).filter(pl.col("load") == 1)
    assert diff.height == 12  # 2 speculating configs x 4 workloads, and none against itself x 4
    assert diff["differ"].sum() == 0
    assert diff.filter(pl.col("against") == "none")["requests"].sum() == 2 * (3 * 10 + 6) * 2


def test_with_8_in_flight_none_does_not_reproduce_itself(requests):
    """The reason equality with `none` at 8 in flight tests nothing: vLLM's `none` differs from itself between two
    repeats, and between one request at a time and 8 in flight (bf16 rounding depends on the batch)."""
    diff = cr.greedy_differences(requests).filter(pl.col("load") == 8)
    again = diff.filter(pl.col("against") == "none, first repeat")
    assert again["requests"].sum() == 64 and again["differ"].sum() == 16
    assert dict(zip(again["workload"], again["differ"])) == {"agent": 2, "multiturn": 4, "prose": 9, "template": 1}
    vs_none = diff.filter(pl.col("against") == "none")
    assert {(c, w): d for c, w, d in vs_none.select("config", "workload", "differ").iter_rows()} == {
        (BASE, "agent"): 4, (BASE, "multiturn"): 12, (BASE, "prose"): 26, (BASE, "template"): 9,
        (CORPUS, "agent"): 4, (CORPUS, "multiturn"): 11, (CORPUS, "prose"): 25, (CORPUS, "template"): 12}
    key = ["workload", "repeat", "order"]
    none = requests.filter(pl.col("config") == "none")
    one = none.filter(pl.col("load") == 1).select(*key, "output_ids")
    eight = none.filter(pl.col("load") == 8).select(*key, pl.col("output_ids").alias("at_8"))
    both = one.join(eight, on=key)
    assert both.height == 72 and (both["output_ids"] != both["at_8"]).sum() == 26


def test_speedups_are_finish_s_ratios_and_the_docs_numbers(points, speedups):
    for row in points.filter(pl.col("config") == CORPUS).iter_rows(named=True):
        s = speedups[(row["workload"], row["load"])]
        assert s["vs_no_corpus_lo"] - 1e-12 <= row["vs_no_corpus"] <= s["vs_no_corpus_hi"] + 1e-12
    assert len(speedups) == 8 and all(s["repeats"] == 2 and s["replay_exact"] for s in speedups.values())
    docs = {("template", 1): (840, 1191, 1.42), ("template", 8): (3139, 3793, 1.21),
            ("multiturn", 1): (929, 986, 1.06), ("multiturn", 8): (2725, 3215, 1.18),
            ("agent", 1): (873, 983, 1.13), ("agent", 8): (1231, 1363, 1.12),
            ("prose", 1): (555, 578, 1.04), ("prose", 8): (2855, 3023, 1.06)}
    for key, (base, tok_s, ratio) in docs.items():
        s = speedups[key]
        assert (round(s["base_tok_s"]), round(s["tok_s"]), round(s["vs_no_corpus"], 2)) == (base, tok_s, ratio), key


def test_against_the_issue_s_bar(speedups):
    """Met: the template one request at a time (both repeats), prose at both loads (both repeats). Not met: the
    template with 8 in flight, multi-turn at both loads."""
    template = speedups[("template", 1)]
    assert template["vs_no_corpus_lo"] >= 1.3 and template["meets"]
    for load in (1, 8):
        assert speedups[("prose", load)]["vs_no_corpus_lo"] >= 0.97 and speedups[("prose", load)]["meets"]
    assert not speedups[("template", 8)]["meets"] and speedups[("template", 8)]["vs_no_corpus_hi"] < 1.3
    assert not any(speedups[("multiturn", load)]["meets"] for load in (1, 8))
    assert speedups[("agent", 1)]["meets"] is None and speedups[("agent", 8)]["bar"] is None


def test_the_corpus_lifts_tokens_per_step_everywhere(speedups):
    for key, s in speedups.items():
        assert s["tokens_per_step"] > s["base_tokens_per_step"], key
        assert s["vs_none"] > 1.0, key


# the reader on small frames


def _point(config, workload, load, repeat, tok_s, tps=1.0, exact=True):
    return {"run": "t", "config": config, "workload": workload, "load": load, "repeat": repeat,
            "decode_tok_s": tok_s, "tokens_per_step": tps, "corpus_step_share": 0.0,
            "replay_exact": None if config == "none" else exact}


def test_speedups_take_each_ratio_inside_its_repeat():
    base, corpus = "gpu-lookup:k=4", "gpu-lookup:k=4,corpus=64"
    rows = [_point("none", "template", 1, 0, 100.0), _point(base, "template", 1, 0, 200.0, 2.0),
            _point(corpus, "template", 1, 0, 300.0, 3.0),
            _point("none", "template", 1, 1, 50.0), _point(base, "template", 1, 1, 100.0, 2.0),
            _point(corpus, "template", 1, 1, 120.0, 3.0, exact=False),
            _point("none", "agent", 8, 0, 10.0), _point(base, "agent", 8, 0, 20.0), _point(corpus, "agent", 8, 0, 19.0),
            _point("none", "batch", 8, 0, 10.0), _point(base, "batch", 8, 0, 20.0), _point(corpus, "batch", 8, 0, 25.0)]
    out = {(r["workload"], r["load"]): r for r in cr.speedups(pl.DataFrame(rows)).iter_rows(named=True)}
    assert out[("batch", 8)]["bar"] == 1.3 and out[("batch", 8)]["vs_no_corpus"] == pytest.approx(1.25)  # the template's
    t = out[("template", 1)]
    assert t["config"] == corpus and t["base_config"] == base and t["repeats"] == 2
    assert (t["vs_no_corpus_lo"], t["vs_no_corpus_hi"]) == pytest.approx((1.2, 1.5))
    assert t["vs_no_corpus"] == pytest.approx(1.35)  # the median of 1.5 and 1.2, not 210 / 150 = 1.4
    assert t["vs_none"] == pytest.approx((3.0 + 2.4) / 2)
    assert not t["replay_exact"]  # one repeat's replay missed
    assert t["bar"] == 1.3 and t["meets"]
    a = out[("agent", 8)]
    assert a["vs_no_corpus"] == pytest.approx(0.95) and a["bar"] is None and a["meets"] is None and a["replay_exact"]


def test_without_corpus_finds_the_same_keys_in_any_order():
    labels = ["none", "gpu-lookup:k=15,nmin=1", "gpu-lookup:nmin=2,k=15"]
    assert cr.without_corpus("gpu-lookup:nmin=1,corpus=8,k=15,corpus_prompts=1", labels) == "gpu-lookup:k=15,nmin=1"
    assert cr.without_corpus("gpu-lookup:nmin=3,k=15,corpus=8", labels) is None
    assert cr.without_corpus("gpu-lookup:nmin=1,k=15", labels) is None and cr.without_corpus("none", labels) is None


def test_greedy_differences_compare_within_a_repeat_and_none_with_its_first_repeat():
    def req(config, repeat, order, ids):
        return {"run": "t", "config": config, "workload": "w", "load": 8, "repeat": repeat, "order": order,
                "output_ids": ids}

    rows = [req("none", 0, 0, [1, 2]), req("none", 0, 1, [3, 4]), req("none", 1, 0, [1, 2]), req("none", 1, 1, [3, 5]),
            req("s", 0, 0, [1, 2]), req("s", 0, 1, [3, 4]), req("s", 1, 0, [1, 2]), req("s", 1, 1, [3, 5])]
    out = {(r["config"], r["against"]): (r["requests"], r["differ"])
           for r in cr.greedy_differences(pl.DataFrame(rows)).iter_rows(named=True)}
    # `s` equals `none` of its own repeat everywhere, though repeat 1 differs from repeat 0
    assert out == {("s", "none"): (4, 0), ("none", "none, first repeat"): (2, 1)}


def test_ranges_chart_draws_each_rule_once_per_panel():
    frame = pl.DataFrame({"workload": ["a", "a", "b"], "panel": ["1", "8", "1"], "source": ["m", "m", "r"],
                          "y": [1.2, 1.1, 1.0], "lo": [1.1, 1.0, 1.0], "hi": [1.3, 1.2, 1.0]})
    spec = plots.ranges(frame, "workload", "y", "lo", "hi", "source", facet="panel",
                        rules={"1.3x": 1.3, "0.97x": 0.97}).to_dict()
    layers = spec["spec"]["layer"]
    assert [layer["mark"]["type"] if isinstance(layer["mark"], dict) else layer["mark"] for layer in layers] == \
           ["rule", "point", "rule", "text", "rule", "text"]
    assert all(layer.get("transform") for layer in layers[2:])  # aggregated to one row: not one line per data row
    scale = layers[0]["encoding"]["y"]["scale"]
    assert scale["domain"][0] < 0.97 and scale["zero"] is False  # the rules inside the axis, which does not start at 0


# run c2: every multi-turn request, and k = 31 with corpus_policy=own over outputs only

K31 = "gpu-lookup:nmin=1,nmax=32,k=31,policy=earliest"
K31_OWN = f"{K31},corpus=32768,corpus_policy=own,corpus_prompts=0"


@pytest.fixture(scope="module")
def c2() -> tuple[pl.DataFrame, pl.DataFrame]:
    return (pl.read_parquet(POINTS).filter(pl.col("run") == "c2"),
            pl.read_parquet(REQUESTS).filter(pl.col("run") == "c2"))


def test_run_c2_is_the_one_docs_corpus_describes(c2):
    points, requests = c2
    assert set(points["config"]) == {"none", BASE, CORPUS, K31, K31_OWN}
    assert set(points["device"]) == {"cuda (NVIDIA H100 80GB HBM3)"} and set(points["git_commit"]) == {"f3020d6"}
    assert set(points["repeat"]) == {0, 1, 2} and points.height == 3 * 3 * 2 * 5  # workloads x loads x configs
    multiturn = points.filter(pl.col("workload") == "multiturn")
    assert set(multiturn["requests"]) == {24}  # all of them, the third turns included, at both loads
    speculating = points.filter(pl.col("config") != "none")
    assert speculating["replay_exact"].all() and int(speculating["replay_steps"].sum()) == 91_387


def test_run_c2_against_the_bar_and_the_docs_numbers(c2):
    points, _ = c2
    got = {(cr.label(r["config"]), r["workload"], r["load"]): r for r in cr.speedups(points).iter_rows(named=True)}
    c1_config, own = cr.label(CORPUS), cr.label(K31_OWN)
    assert (c1_config, own) == ("k=15, corpus 32768 longest, prompts", "k=31, corpus 32768 own, outputs only")
    # multi-turn stays below 1.3x: ~1.18x one at a time, no gain with 8 in flight
    assert 1.1 < got[(c1_config, "multiturn", 1)]["vs_no_corpus"] < 1.3
    assert 1.1 < got[(own, "multiturn", 1)]["vs_no_corpus"] < 1.3
    assert got[(c1_config, "multiturn", 8)]["vs_no_corpus_hi"] < 1.0
    # the template one at a time clears it; with 8 in flight it does not
    assert got[(c1_config, "template", 1)]["vs_no_corpus_lo"] > 1.5
    assert got[(own, "template", 1)]["vs_no_corpus"] > 1.5
    assert got[(c1_config, "template", 8)]["vs_no_corpus"] < 1.3 and got[(own, "template", 8)]["vs_no_corpus"] < 1.3
    # prose: c1's config sits on the 0.97x line one at a time
    assert got[(c1_config, "prose", 1)]["vs_no_corpus"] == pytest.approx(0.972, abs=0.001)


def test_run_c2_k31_differs_from_none_where_its_base_does_at_one_request(c2):
    """At one request both k = 15 configs equal `none`; both k = 31 configs, with and without the corpus, differ
    from it in the same requests and equal each other everywhere: the corpus changes what is drafted, not what is
    accepted (the 32-wide verify rounds differently at a few near-ties)."""
    _, requests = c2
    alone = requests.filter(pl.col("load") == 1)
    diff = {(r["config"], r["workload"]): r["differ"] for r in cr.greedy_differences(alone)
            .filter(pl.col("against") == "none").iter_rows(named=True)}
    assert all(diff[(c, w)] == 0 for c in (BASE, CORPUS) for w in ("multiturn", "prose", "template"))
    assert {w: diff[(K31, w)] for w in ("multiturn", "prose", "template")} == {"multiturn": 3, "prose": 0,
                                                                               "template": 6}
    key = ["workload", "repeat", "order"]
    pair = (alone.filter(pl.col("config") == K31).select(*key, pl.col("output_ids").alias("a"))
            .join(alone.filter(pl.col("config") == K31_OWN).select(*key, pl.col("output_ids").alias("b")), on=key))
    assert pair.height == 3 * (24 + 6 + 10) and pair.filter(pl.col("a") != pl.col("b")).is_empty()


def test_run_c2_the_template_at_8_in_flight_misses_the_bar_in_its_first_wave_only(c2):
    """docs/corpus.md: of c2's 16 template requests at 8 in flight, the first 8 start before any answer is finished
    and the corpus hardly moves their tokens per step (2.08 against 2.00); the 8 after them carry 1.57x the tokens a
    step and decode 1.32-1.38x faster per request, over the 1.3x bar in every repeat. One at a time the first
    request alone is cold. Multi-turn's later requests stay below the bar (what they reuse is in their prompt)."""
    _, requests = c2
    got = {(cr.label(r["config"]), r["workload"], r["load"], r["wave"]): r
           for r in cr.waves(requests).iter_rows(named=True)}
    c1_config = cr.label(CORPUS)
    first, later = got[(c1_config, "template", 8, "first")], got[(c1_config, "template", 8, "later")]
    assert (first["requests"], later["requests"]) == (8, 8) and first["repeats"] == later["repeats"] == 3
    assert first["base_tokens_per_step"] == pytest.approx(2.00, abs=0.01)
    assert first["tokens_per_step"] == pytest.approx(2.08, abs=0.01)
    assert later["tokens_per_step_ratio"] == pytest.approx(1.57, abs=0.01)
    assert later["stream_lo"] > 1.3 and later["stream"] == pytest.approx(1.35, abs=0.01)
    assert first["stream"] < 1.1
    assert got[(c1_config, "template", 1, "first")]["requests"] == 1
    assert got[(c1_config, "multiturn", 8, "later")]["stream_hi"] < 1.3
    assert got[(c1_config, "multiturn", 1, "later")]["stream_hi"] < 1.3



# run c3: a batch job of 153 requests over the template


@pytest.fixture(scope="module")
def c3() -> tuple[pl.DataFrame, pl.DataFrame]:
    return (pl.read_parquet(POINTS).filter(pl.col("run") == "c3"),
            pl.read_parquet(REQUESTS).filter(pl.col("run") == "c3"))


def test_run_c3_the_batch_job_clears_the_bar_one_at_a_time_not_with_8_in_flight(c3):
    """docs/corpus.md, run c3 (plan corpus_c3.json, one H100): 24 requests one at a time and all 153 with 8 in
    flight, three repeats. The corpus config runs 1.44x the lookup alone one at a time; with 8 in flight 1.04x,
    although past the first wave it still carries 1.67x the tokens a step, so the steps themselves got longer. The
    replay is exact everywhere and one at a time every greedy output equals `none`'s."""
    points, requests = c3
    assert set(points["config"]) == {"none", BASE, CORPUS} and set(points["workload"]) == {"batch"}
    assert set(points["device"]) == {"cuda (NVIDIA H100 80GB HBM3)"} and set(points["git_commit"]) == {
        "03fca68fc33a7147755289e7542b6976d9e6b122+dirty"}  # "dirty": its results parked off the travelling tree
    assert {(r["load"], r["requests"]) for r in points.iter_rows(named=True)} == {(1, 24), (8, 153)}
    speculating = points.filter(pl.col("config") != "none")
    assert speculating["replay_exact"].all()
    assert points.filter(pl.col("load") == 1)["greedy_equal_none"].all()
    got = {r["load"]: r for r in cr.speedups(points).iter_rows(named=True)}
    assert got[1]["vs_no_corpus"] == pytest.approx(1.44, abs=0.01) and got[1]["vs_no_corpus_lo"] > 1.3
    assert got[8]["vs_no_corpus"] == pytest.approx(1.04, abs=0.01) and got[8]["vs_no_corpus_hi"] < 1.3
    waves = {(r["load"], r["wave"]): r for r in cr.waves(requests).iter_rows(named=True)}
    later = waves[(8, "later")]
    assert later["requests"] == 145 and later["tokens_per_step_ratio"] == pytest.approx(1.67, abs=0.01)
    assert later["stream_hi"] < 1.2  # 1.67x the tokens a step, at most 1.2x the decode rate



def test_run_c3_with_8_in_flight_slow_steps_take_half_the_time(c3):
    """docs/corpus.md, run c3, from the front end's clock: one at a time a request's steps are even (under 1 % of
    them over 3x the median); with 8 in flight the slow ones, about one per request admitted, take a third of
    `none`'s decode time and about half of the speculating configs' (45 % without the corpus, 56 % with it), whose
    requests finish in fewer steps while every admission costs as much. The median step is longer with the corpus
    (~4.2 against ~3.4 ms): more tokens a step."""
    points, _ = c3
    by = {(r["config"], r["load"], r["repeat"]): r for r in points.iter_rows(named=True)}
    assert all(r["slow_step_share"] < 0.01 for (_, load, _), r in by.items() if load == 1)
    for repeat in range(3):
        none, lookup, corpus = (by[(c, 8, repeat)] for c in ("none", BASE, CORPUS))
        assert 0.3 < none["slow_time_share"] < 0.36
        assert 0.42 < lookup["slow_time_share"] < 0.47 and 0.55 < corpus["slow_time_share"] < 0.58
        assert lookup["step_ms_median"] < corpus["step_ms_median"]
        assert 4.0 < corpus["step_ms_median"] < 4.4 and 3.2 < lookup["step_ms_median"] < 3.6
    # the notebook's figure (corpus_admissions.svg) reads the same through `slow_steps`: medians and ranges over repeats
    got = {(r["load"], r["who"]): r for r in cr.slow_steps(points).iter_rows(named=True)}
    assert {who for _, who in got} == {"none", "k=15", cr.label(CORPUS)} and {r["repeats"] for r in got.values()} == {3}
    assert got[(8, "none")]["slow"] < got[(8, "k=15")]["slow"] < got[(8, cr.label(CORPUS))]["slow"]
    assert got[(8, "k=15")]["slow_lo"] > 0.42 and got[(8, cr.label(CORPUS))]["slow_hi"] < 0.58
    assert cr.slow_steps(pl.read_parquet(POINTS).filter(pl.col("run") == "c1")).height == 0  # c1 kept no intervals


def test_run_c3_the_first_token_is_a_fixed_cost(c3):
    """docs/corpus.md: one at a time the first token takes 29-35 ms at the median whatever the prompt's length
    (149-435 tokens): its correlation with the length is within +-0.11 for every config (72 requests each)."""
    _, requests = c3
    alone = requests.filter(pl.col("load") == 1).group_by("config").agg(
        pl.corr(pl.col("prompt_ids").list.len(), "ttft_s").alias("r"), (pl.col("ttft_s").median() * 1e3).alias("ms"),
        pl.col("prompt_ids").list.len().min().alias("shortest"), pl.col("prompt_ids").list.len().max().alias("longest"),
        pl.len().alias("n"))
    for row in alone.iter_rows(named=True):
        assert row["n"] == 72 and abs(row["r"]) < 0.11 and 29 < row["ms"] < 35
        assert row["longest"] > 2.5 * row["shortest"]


def test_waves_split_at_the_load_and_pair_each_corpus_config_with_its_base():
    """Two requests at 2 in flight, then two more: the first two are the first wave; tokens per step pool the steps
    of all repeats, the stream rate is decoded tokens over decode time per repeat."""
    def rows(config, emitted, spans):
        return [{"run": "t", "config": config, "workload": "w", "load": 2, "repeat": 0, "order": i,
                 "step_emitted": e, "output_ids": list(range(sum(e))), "ttft_s": 0.0, "t_last": span}
                for i, (e, span) in enumerate(zip(emitted, spans))]
    base = rows(BASE, [[1, 1], [2], [1, 1, 1], [3]], [1.0, 1.0, 2.0, 2.0])
    corpus = rows(CORPUS, [[1, 1], [2], [3], [3]], [1.0, 1.0, 1.0, 0.5])
    got = {r["wave"]: r for r in cr.waves(pl.DataFrame(base + corpus)).iter_rows(named=True)}
    assert set(got) == {"first", "later"} and got["first"]["base_config"] == BASE
    assert got["first"]["tokens_per_step_ratio"] == pytest.approx(1.0) and got["first"]["stream"] == pytest.approx(1.0)
    assert got["later"]["base_tokens_per_step"] == pytest.approx(6 / 4)
    assert got["later"]["tokens_per_step"] == pytest.approx(3.0)
    assert got["later"]["stream"] == pytest.approx((4 / 1.5) / (4 / 4.0))


def test_label_names_a_corpus_config_in_a_few_words():
    assert cr.label(BASE) == "k=15"
    assert cr.label(CORPUS) == "k=15, corpus 32768 longest, prompts"
    assert cr.label("gpu-lookup:k=7,corpus=1024") == "k=7, corpus 1024 own, outputs only"
