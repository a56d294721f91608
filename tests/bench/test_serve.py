"""Serving under load and sampling (`hqlab.bench.serve`, benchmarks/vllm_serve.py): the sampling test on synthetic
samples (it accepts one distribution, rejects a shifted one) and on the committed samples of run s1 (real
`vllm serve` processes on the H200: gpu-lookup and gpu-fused keep `none`'s distribution, the planted verification
bug does not); the committed load results meet the serving issue's points where the run shows them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest

from hqlab.bench import serve
from hqlab.config import ConfigError

RESULTS = Path(__file__).resolve().parents[2] / "data" / "results"
LOADS = RESULTS / "vllm_serve_h200.parquet"
SAMPLES = RESULTS / "vllm_serve_h200.samples.parquet"
GREEDY = RESULTS / "vllm_serve_h200.greedy.parquet"


def draws(probs: list[float], n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.choice(len(probs), size=(n, length), p=probs).tolist()


def test_the_distribution_test_accepts_one_distribution_and_rejects_another():
    p = [0.5, 0.2, 0.15, 0.1, 0.05]
    same = serve.distribution_test(draws(p, 600, 8, 1), draws(p, 600, 8, 2), positions=8)
    assert serve.same_distribution(same)
    shifted = [0.4, 0.3, 0.15, 0.1, 0.05]  # ten points of mass moved between two tokens
    other = serve.distribution_test(draws(p, 600, 8, 1), draws(shifted, 600, 8, 3), positions=8)
    assert not serve.same_distribution(other)
    assert all(r["dof"] == 4 for r in same)


def test_lengths_count_and_rare_tokens_pool():
    a = [[1, 2, 3]] * 300 + [[1, 2]] * 300  # half end after two tokens
    b = [[1, 2, 3]] * 600
    r = serve.distribution_test(a, b, positions=3)
    assert r[0]["p"] == 1.0 and r[1]["p"] == 1.0 and r[2]["p"] < 1e-10
    rare = [[t] for t in range(600)]  # every token once: all pooled, too rare even pooled -> no test
    assert serve.distribution_test(rare, rare, positions=1)[0]["dof"] == 0
    with pytest.raises(ValueError):
        serve.distribution_test([], b, positions=1)


def test_load_points_run_ten_waves_and_shorter_points_are_refused():
    points = serve.load_points(["chat"], [0.0, 0.7], [1, 32])
    assert [(p.temperature, p.max_concurrency, p.num_prompts) for p in points] == [(0.0, 1, 12), (0.0, 32, 320),
                                                                                  (0.7, 1, 12), (0.7, 32, 320)]
    assert all(p.require_waves() is p for p in points)
    with pytest.raises(ConfigError, match="never reaches"):
        serve.LoadPoint("chat", 0.0, 32, 8)
    with pytest.raises(ConfigError, match=r"2\.0 waves.*>= 10 waves \(320 prompts\)"):
        serve.LoadPoint("chat", 0.0, 32, 64).require_waves()


def fixed_rate_load(slots: int, requests: int, tokens: int, step_s: float) -> dict[str, list]:
    """What `vllm bench serve --save-detailed` returns for an engine whose every step takes `step_s` and emits one
    token per running request, with `slots` requests in flight: each slot runs its requests back to back."""
    start, ttft, itl, lens = [], [], [], []
    for r in range(requests):
        start.append((r // slots) * tokens * step_s)
        ttft.append(step_s)
        itl.append([step_s] * (tokens - 1))
        lens.append(tokens)
    return {"start_times": start, "ttfts": ttft, "itls": itl, "output_lens": lens}


def test_steady_state_measures_the_held_load_and_leaves_ramp_and_drain_out():
    # 8 slots, one token each per 2 ms step: 4,000 tok/s while the load holds
    load = fixed_rate_load(slots=8, requests=80, tokens=50, step_s=0.002)
    steady = serve.steady_state(**load)
    assert steady["throughput"] == pytest.approx(8 / 0.002, rel=0.03)
    assert steady["window_s"] == pytest.approx(8 * 50 * 0.002, rel=0.01)  # ten waves, less the first and the last
    # a drain tail (the last wave's two slowest requests running on alone) lowers the whole-run rate, not the window's
    tail = fixed_rate_load(slots=8, requests=80, tokens=50, step_s=0.002)
    for r in (78, 79):
        tail["itls"][r] = [0.002] * 48 + [0.5]  # the last token half a second late
    steady_tail = serve.steady_state(**tail)
    assert steady_tail["throughput"] == pytest.approx(steady["throughput"], rel=0.01)
    with pytest.raises(ValueError, match="one start time"):
        serve.steady_state([0.0], [0.1], [], [3])
    assert np.isnan(serve.steady_state(**fixed_rate_load(slots=8, requests=8, tokens=5, step_s=0.01))["window_s"])


@pytest.fixture(scope="module")
def loads() -> pl.DataFrame:
    return pl.read_parquet(LOADS)


def test_run_s1_has_every_group_the_issue_asks_for(loads):
    s1 = loads.filter(pl.col("run") == "s1")
    assert set(s1.columns) >= {"config", "dataset", "temperature", "max_concurrency", "output_throughput",
                               "median_tpot_ms", "p99_tpot_ms", "median_ttft_ms", "machine", "git_commit"}
    assert set(s1["temperature"]) >= {0.0, 0.7} and {1, 32} <= set(s1["max_concurrency"])
    groups = s1.group_by("dataset", "temperature", "max_concurrency").agg(pl.col("config"))
    assert all("none" in c for c in groups["config"])  # `none` in every (dataset, temperature, load) group
    assert (s1["completed"] == s1["num_prompts"]).all()  # no request failed
    assert s1["machine"].str.contains("H200").all()
    # every server ran vLLM's model runner V2, as its own log says (the plugin moves hqlab's configs there)
    assert (s1["vllm_runner"] == "V2").all()
    logs = [serve.server_log_facts(f.read_text(errors="replace"))
            for f in sorted((RESULTS / "serve_s1").glob("serve_s1_[0-9]*.log"))]
    assert {f["config"] for f in logs if not f["planted"]} == set(s1["config"])
    assert [f["planted"] for f in logs].count(True) == 1


def test_run_s1_the_best_hqlab_config_is_never_slower_than_none(loads):
    best = serve.best_ratio(serve.speedup_table(loads.filter(pl.col("run") == "s1")))
    assert best.height == 12
    assert (best["ratio"] >= 0.95).all(), best.filter(pl.col("ratio") < 0.95)


def test_run_s1_under_sampling_at_batch_1_on_prose(loads):
    """The issue asks >= 1.3x `none` here; run s1 measured the best config (gpu-fused) at 1.17x: recorded as not met
    (docs/serving.md), and this test fails if a rerun changes the committed number without the docs."""
    table = serve.speedup_table(loads.filter(pl.col("run") == "s1"))
    prose = serve.best_ratio(table).filter((pl.col("dataset") == "prose") & (pl.col("temperature") == 0.7)
                                           & (pl.col("max_concurrency") == 1))
    assert prose["config"][0].startswith("gpu-fused") and 1.1 < prose["ratio"][0] < 1.3


@pytest.fixture(scope="module")
def samples() -> dict[str, list[list[int]]]:
    frame = pl.read_parquet(SAMPLES).filter(pl.col("run") == "s1")
    return dict(zip(frame["config"], frame["token_ids"].to_list()))


def test_run_s1_sampled_outputs_keep_nones_distribution(samples):
    ref = samples["none"]
    speculators = [c for c in samples if c != "none" and "planted" not in c]
    assert {c.split(":")[0] for c in speculators} == {"gpu-lookup", "gpu-fused"}
    for config in speculators:
        assert len(samples[config]) == len(ref) == 600
        assert serve.same_distribution(serve.distribution_test(ref, samples[config], positions=24)), config


def test_run_s1_the_planted_verification_bug_fails_the_sampling_test(samples):
    planted = [c for c in samples if "planted accept_first_draft" in c]
    assert len(planted) == 1
    per_position = serve.distribution_test(samples["none"], samples[planted[0]], positions=24)
    assert not serve.same_distribution(per_position)
    assert min(r["p"] for r in per_position) < 1e-100


def test_run_s1_greedy_texts_through_the_openai_client(samples):
    """The greedy chat texts every server returned through the `openai` package: recorded, with where they part
    from `none`'s (bf16 near ties: a verify step's shape changes the rounding)."""
    frame = pl.read_parquet(GREEDY).filter(pl.col("run") == "s1")
    texts = dict(zip(frame["config"], frame["texts"].to_list()))
    assert len(texts["none"]) == 3
    for config, got in texts.items():
        assert len(got) == 3 and all(t for t in got)
        assert got[1] == texts["none"][1], config  # the prompt every config agreed on


def test_greedy_partings_name_the_server_prompt_position_and_margin():
    rows = pl.DataFrame({"config": ["none", "a", "b"],
                         "token_ids": [[[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]], [[1, 9, 3], [4, 5]]],
                         "margins": [[[0.5, 0.1, 2.0], [1.0, 3.0]], None, None]})
    assert serve.greedy_partings(rows) == [("a", 1, 1, 3.0), ("b", 0, 1, 0.1)]
    with pytest.raises(ValueError, match="one 'none' row"):
        serve.greedy_partings(rows.filter(pl.col("config") != "none"))


def test_first_divergence_names_where_two_greedy_outputs_part():
    from hqlab.bench.serve import first_divergence

    assert first_divergence([5, 6, 7], [5, 6, 7]) is None
    assert first_divergence([5, 6, 7], [5, 9, 7]) == 1
    assert first_divergence([5, 6, 7], [5, 6]) == 2  # a shorter output parts where it ends


def test_speedup_table_divides_each_repeat_by_nones_same_repeat():
    """Repeat r of a config is divided by `none`'s repeat r, and the table reports the median ratio and its range;
    a repeat `none` lacks (cut by the budget) is left out."""
    key = {"run": "x", "dataset": "prose", "temperature": 0.7, "max_concurrency": 1}
    rows = pl.DataFrame([
        {**key, "config": "none", "repeat": 0, "output_throughput": 100.0},
        {**key, "config": "none", "repeat": 1, "output_throughput": 200.0},
        {**key, "config": "none", "repeat": 2, "output_throughput": 100.0},
        {**key, "config": "a", "repeat": 0, "output_throughput": 150.0},   # 1.5
        {**key, "config": "a", "repeat": 1, "output_throughput": 200.0},   # 1.0
        {**key, "config": "a", "repeat": 2, "output_throughput": 120.0},   # 1.2
        {**key, "config": "a", "repeat": 3, "output_throughput": 900.0},   # no `none` repeat 3
    ])
    a = serve.speedup_table(rows).filter(pl.col("config") == "a").row(0, named=True)
    assert (a["ratio"], a["ratio_min"], a["ratio_max"], a["repeats"]) == (pytest.approx(1.2), 1.0, 1.5, 3)
    assert a["output_throughput"] == 150.0  # the median of the three repeats that have a reference


def test_run_s3_longer_drafter_heads_keep_nones_distribution():
    """Run s3 sampled only the longer drafter heads; `none`'s reference is run s1's (same model and vLLM)."""
    frame = pl.read_parquet(SAMPLES)
    ref = frame.filter((pl.col("run") == "s1") & (pl.col("config") == "none"))["token_ids"][0].to_list()
    s3 = frame.filter(pl.col("run") == "s3")
    assert sorted(c.split("draft_block=")[1][0] for c in s3["config"]) == ["2", "3"]
    for config, samples in zip(s3["config"], s3["token_ids"].to_list()):
        assert len(samples) == 600
        assert serve.same_distribution(serve.distribution_test(ref, samples, positions=24)), config


def test_run_s3_greedy_texts_part_from_nones_only_at_near_ties():
    """Every speculating server of run s3 returns `none`'s greedy tokens up to a position where `none`'s own top two
    logits were within a quarter of a logit (a bf16 near-tie a verify step's shape can flip)."""
    greedy = pl.read_parquet(GREEDY).filter(pl.col("run") == "s3")
    assert greedy.filter(pl.col("config") != "none").height == 5
    parted = serve.greedy_partings(greedy)
    assert all(margin < 0.25 for *_, margin in parted), parted
    assert parted  # the run has near-ties; a test of none would prove nothing


def test_run_s3_sampled_prose_at_one_request(loads):
    """docs/serving.md's run s3 table: the longer drafter heads raise the acceptance length and not the speed, and
    the lookup alone stays below 0.95x `none` on sampled prose at one request (the issue's target, not met)."""
    table = serve.speedup_table(loads.filter(pl.col("run") == "s3"))
    assert set(table["dataset"]) == {"prose"} and set(table["max_concurrency"]) == {1}
    assert table["machine"].str.contains("H100").all()
    fused = (table.filter(pl.col("config").str.starts_with("gpu-fused"))
             .with_columns(pl.col("config").str.extract(r"draft_block=(\d)").cast(pl.Int64).alias("block"))
             .sort("block"))
    assert fused["block"].to_list() == [1, 2, 3]
    assert fused["acceptance_length"].is_sorted() and fused["acceptance_length"][-1] > 1.3 * fused[
        "acceptance_length"][0]
    assert fused["ratio"].max() - fused["ratio"].min() < 0.05 and 1.0 < fused["ratio"].max() < 1.3
    lookup = table.filter(pl.col("config").str.starts_with("gpu-lookup"))
    assert lookup.height == 2 and (lookup["ratio"] < 0.95).all()


def test_step_costs_at_one_request_are_time_per_token_times_tokens_a_step():
    """Run s3 (sampled prose, one request): none's time per token is a plain step; the lookup's time per token × its
    acceptance length is a speculative step, about 1.5x a plain one on that card."""
    lookup = "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest,batch_k=1:15/4:7/0"
    rows = pl.read_parquet(LOADS).filter((pl.col("run") == "s3") & pl.col("config").is_in(["none", lookup]))
    plain, spec = serve.step_costs(rows, lookup)
    one = rows.filter(pl.col("max_concurrency") == 1)
    assert plain == one.filter(pl.col("config") == "none")["median_tpot_ms"].median()
    row = one.filter(pl.col("config") == lookup)
    assert spec == pytest.approx((row["median_tpot_ms"] * row["acceptance_length"]).median(), rel=1e-12)
    assert 1.3 < spec / plain < 1.7
    with pytest.raises(ValueError, match="no rows at one request"):
        serve.step_costs(rows, "gpu-lookup:k=3")
    with pytest.raises(ValueError, match="one \\(dataset, temperature\\)"):
        serve.step_costs(pl.read_parquet(LOADS).filter(pl.col("run") == "s1"), lookup)


def test_short_config_names_the_gate():
    assert serve.short_config("gpu-lookup:nmin=1,k=15,batch_k=1:15/4:7/0,gate=2") == "gpu-lookup 1:15/4:7/0 gate=2"
    assert serve.short_config("gpu-lookup:nmin=1,k=15,gate=1") == "gpu-lookup k=15 gate=1"
    assert serve.short_config("gpu-lookup:nmin=1,k=15,batch_k=1:15/4:7/0") == "gpu-lookup 1:15/4:7/0"
    # the served plan s5's fused configs stay apart in plots and tables
    assert serve.short_config("gpu-fused:k=15,draft_block=1,batch_k=1:15/4:7/0,draft_sample=probabilistic") == \
        "gpu-fused 1:15/4:7/0 sampled drafts"
    assert serve.short_config("gpu-fused:k=15,draft_block=2,batch_k=1:15/4:7,draft_sample=probabilistic") == \
        "gpu-fused block=2 1:15/4:7 sampled drafts"
    assert serve.short_config("gpu-lookup:nmin=1,k=15,corpus=32768,corpus_policy=longest") == "gpu-lookup k=15 corpus"
    # run s6's two fused servers differ only in how the drafter reads a prompt
    assert serve.short_config("gpu-fused:k=15,draft_block=1,batch_k=1:15/4:7/0,prefill_graph=1024") == \
        "gpu-fused 1:15/4:7/0 prefill graph"
    assert serve.short_config("gpu-fused:k=15,draft_block=1,batch_k=1:15/4:7/0,prefill_graph=0") == \
        "gpu-fused 1:15/4:7/0"


S4 = ("s4", "s4b")
GATE = {0: "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest,batch_k=1:15/4:7/0"}
GATE.update({g: f"{GATE[0]},gate={g}" for g in (1, 2)})


def test_runs_s4_measure_the_gate_beside_none_in_every_group(loads):
    """Runs s4 and s4b (one H100, plan benchmarks/plans/serve_s4.json and the points its budget left, s4b.json):
    every group holds `none`, the ungated and both gated lookups and gpu-fused, and no request failed."""
    rows = loads.filter(pl.col("run").is_in(S4))
    assert rows["machine"].str.contains("H100").all() and (rows["completed"] == rows["num_prompts"]).all()
    groups = rows.group_by("run", "dataset", "temperature", "max_concurrency").agg(pl.col("config").unique())
    assert groups.height == 4
    for configs in groups["config"]:
        assert set(configs) >= {"none", *GATE.values()} and any(c.startswith("gpu-fused") for c in configs)


def test_runs_s4_the_best_hqlab_config_is_never_slower_than_none(loads):
    best = serve.best_ratio(serve.speedup_table(loads.filter(pl.col("run").is_in(S4))))
    assert best.height == 4 and (best["ratio"] >= 0.95).all(), best


def test_runs_s4_what_docs_serving_says_of_the_gate(loads):
    """docs/serving.md's table of runs s4/s4b: on sampled prose at one request every lookup is >= 0.95x `none`
    (medians of three repeats) and the best config, gpu-fused, stays below the issue's 1.3x; the gate raises the
    tokens a speculative step verifies on prose and chat, and on labd it runs the ungated lookup's steps (110 and 110
    verify steps) yet measured slower (one repeat)."""
    table = serve.speedup_table(loads.filter(pl.col("run").is_in(S4)))

    def cell(dataset: str, load: int, config: str) -> dict:
        return table.filter((pl.col("dataset") == dataset) & (pl.col("max_concurrency") == load)
                            & (pl.col("config") == config)).row(0, named=True)

    prose = {g: cell("prose", 1, c) for g, c in GATE.items()}
    assert all(r["repeats"] == 3 and r["ratio"] >= 0.95 for r in prose.values())
    assert prose[0]["acceptance_length"] < prose[1]["acceptance_length"] < prose[2]["acceptance_length"]
    best = serve.best_ratio(table).filter((pl.col("dataset") == "prose") & (pl.col("max_concurrency") == 1))
    assert best["config"][0].startswith("gpu-fused") and 1.1 < best["ratio"][0] < 1.3
    chat = {g: cell("chat", 1, c) for g, c in GATE.items()}
    assert chat[0]["acceptance_length"] < chat[1]["acceptance_length"] < chat[2]["acceptance_length"]
    labd = {g: cell("labd", 1, c) for g, c in GATE.items()}
    assert labd[1]["ratio"] < 0.9 * labd[0]["ratio"] and labd[2]["ratio"] < labd[1]["ratio"]
    # 32 in flight: batch_k turns speculation off above four requests, with or without the gate
    assert np.isnan(cell("prose", 32, GATE[2])["acceptance_length"])  # vLLM counted no drafts at all


def test_runs_s4_the_host_sets_what_a_speculative_step_costs(loads):
    """The same card kind (H100), two hosts: a speculative step of the lookup at one request on sampled prose cost
    1.49x a plain one in run s3 and 1.22x in run s4, which is what the gate can save."""
    ratios = {}
    for run in ("s3", "s4"):
        rows = loads.filter((pl.col("run") == run) & pl.col("config").is_in(["none", GATE[0]])
                            & (pl.col("dataset") == "prose"))
        plain, spec = serve.step_costs(rows, GATE[0])
        ratios[run] = spec / plain
    assert 1.4 < ratios["s3"] < 1.6 and 1.1 < ratios["s4"] < 1.3


def test_run_s4_the_gated_lookup_keeps_nones_distribution():
    frame = pl.read_parquet(SAMPLES)
    ref = frame.filter((pl.col("run") == "s1") & (pl.col("config") == "none"))["token_ids"][0].to_list()
    s4 = frame.filter(pl.col("run") == "s4")
    assert s4["config"].to_list() == [GATE[2]]
    got = s4["token_ids"][0].to_list()
    assert len(got) == 600 and serve.same_distribution(serve.distribution_test(ref, got, positions=24))


def test_runs_s4_greedy_texts_part_from_nones_only_at_near_ties():
    greedy = pl.read_parquet(GREEDY).filter(pl.col("run").is_in(S4))
    for run in S4:
        rows = greedy.filter(pl.col("run") == run)
        assert rows.filter(pl.col("config") != "none").height == 4
        assert all(margin < 0.25 for *_, margin in serve.greedy_partings(rows)), run


def test_a_drafting_step_that_ran_eagerly_is_found_in_the_log():
    """The committed servers' logs (runs s3, s4, s4b) captured every drafting step; the GPU test log of the drawn
    drafts before their fix shows gpu-fused's warning that capture failed, the log after the fix does not."""
    import tarfile

    served = []
    for run in ("s3", "s4", "s4b"):
        with tarfile.open(RESULTS / f"serve_{run}" / f"serve_{run}_logs.tar.gz") as tar:
            served += [tar.extractfile(m).read().decode(errors="replace") for m in tar.getmembers() if m.isfile()]
    facts = [serve.server_log_facts(text) for text in served]
    assert len(facts) >= 15 and any(f["config"].startswith("gpu-fused") for f in facts)
    assert not any(f["drafting_eager"] for f in facts)
    before, after = (RESULTS / "serve_s5" / f"draft_sampling_gpu_tests_{n}.log" for n in ("s5", "s5b"))
    assert serve.server_log_facts(before.read_text())["drafting_eager"]
    assert not serve.server_log_facts(after.read_text())["drafting_eager"]


def test_the_benchmark_skips_the_load_points_of_a_server_that_drafts_eagerly(capsys):
    from benchmarks import vllm_serve

    before, after = (RESULTS / "serve_s5" / f"draft_sampling_gpu_tests_{n}.log" for n in ("s5", "s5b"))
    assert vllm_serve.warn_if_eager("gpu-fused:...", before, allow=False)
    assert "its load points are skipped" in capsys.readouterr().out
    assert vllm_serve.warn_if_eager("gpu-fused:...", before, allow=True)
    assert "measured anyway (--allow-eager)" in capsys.readouterr().out
    assert not vllm_serve.warn_if_eager("gpu-fused:...", after, allow=False)
    assert not vllm_serve.warn_if_eager("gpu-fused:...", RESULTS / "no_such.log", allow=False)


def test_served_heads_of_run_s5a_as_docs_serving_reports_them():
    """Run s5a (one H100, sampled prose at one request, 24 prompts × 3 repeats): drawn heads raise the tokens a
    step as the CPU measured, but every extra head token costs about half a plain step, so no head reaches the
    issue's 1.3× `none`: greedy one-token head 1.23×, drawn heads of one, two and three tokens 1.19×, 1.18×,
    1.08×."""
    rows = pl.read_parquet(RESULTS / "vllm_serve_h200.parquet")
    table = serve.served_heads(rows, "s5a")
    assert table.select("draft", "head").rows() == [("greedy", 1), ("drawn", 1), ("drawn", 2), ("drawn", 3)]
    assert (table["repeats"] == 3).all() and table["machine"].str.contains("H100").all()
    assert [round(x, 2) for x in table["ratio"]] == [1.23, 1.19, 1.18, 1.08]
    assert (table["ratio"] < 1.3).all()
    drawn = table.filter(pl.col("draft") == "drawn")
    assert drawn["tokens_a_step"].is_sorted() and drawn["step_ratio"].is_sorted()
    # each extra head token: +0.3-0.6 tokens a step for +0.4-0.55 of a plain step
    d_tokens, d_cost = drawn["tokens_a_step"].diff().drop_nulls(), drawn["step_ratio"].diff().drop_nulls()
    assert d_tokens.is_between(0.3, 0.6).all() and d_cost.is_between(0.4, 0.55).all()
    # throughput ÷ none is tokens a step ÷ the step's cost, less the first token's extra time (a few per cent)
    implied = table["tokens_a_step"] / table["step_ratio"]
    assert ((table["ratio"] / implied).is_between(0.9, 1.0)).all()
    with pytest.raises(ValueError, match="no `none` rows"):
        serve.served_heads(rows.filter(pl.col("config") != "none"), "s5a")
    with pytest.raises(ValueError, match="no gpu-fused rows"):
        serve.served_heads(rows.filter(~pl.col("config").str.starts_with("gpu-fused")), "s5a")


def test_run_s5a_drawn_heads_keep_nones_distribution_and_greedy_text():
    """Run s5a sampled the drawn one- and three-token heads (600 samples each, against run s1's `none`: same model
    and vLLM), and its greedy texts part from `none`'s only where `none`'s own top two logits were near a tie."""
    frame = pl.read_parquet(SAMPLES)
    ref = frame.filter((pl.col("run") == "s1") & (pl.col("config") == "none"))["token_ids"][0].to_list()
    s5a = frame.filter(pl.col("run") == "s5a")
    assert sorted(c.split("draft_block=")[1][0] for c in s5a["config"]) == ["1", "3"]
    assert all("draft_sample=probabilistic" in c for c in s5a["config"])
    for config, samples in zip(s5a["config"], s5a["token_ids"].to_list()):
        assert len(samples) == 600
        assert serve.same_distribution(serve.distribution_test(ref, samples, positions=24)), config
    greedy = pl.read_parquet(GREEDY).filter(pl.col("run") == "s5a")
    assert greedy.filter(pl.col("config") != "none").height == 4
    parted = serve.greedy_partings(greedy)
    assert parted and all(margin < 0.25 for *_, margin in parted), parted


def test_run_s5c_the_corpus_config_keeps_nones_distribution_and_greedy_text():
    """Run s5c sampled the served corpus config (600 samples, each answer joining the corpus the later ones draft
    from) against run s1's `none`; its greedy texts, and the lookup's, part from `none`'s only at near-ties."""
    frame = pl.read_parquet(SAMPLES)
    ref = frame.filter((pl.col("run") == "s1") & (pl.col("config") == "none"))["token_ids"][0].to_list()
    s5c = frame.filter(pl.col("run") == "s5c")
    assert s5c.height == 1 and "corpus=32768" in s5c["config"][0] and "batch_k=1:15/4:7/0" in s5c["config"][0]
    samples = s5c["token_ids"][0].to_list()
    assert len(samples) == 600
    assert serve.same_distribution(serve.distribution_test(ref, samples, positions=24))
    greedy = pl.read_parquet(GREEDY).filter(pl.col("run") == "s5c")
    assert greedy.filter(pl.col("config") != "none").height == 2
    parted = serve.greedy_partings(greedy)
    assert parted and all(margin < 0.25 for *_, margin in parted), parted
    assert {config for config, *_ in parted} == set(greedy["config"]) - {"none"}


def test_run_s5c_every_group_has_a_config_at_least_095_none(loads):
    """docs/serving.md's run s5c table: sampled chat at one request and sampled prose at 32 in flight, two repeats
    each; the best config of each group is >= 0.95x `none` (the issue's 'never slower'), on an H100."""
    table = serve.speedup_table(loads.filter(pl.col("run") == "s5c"))
    assert table["machine"].str.contains("H100").all()
    assert set(zip(table["dataset"], table["max_concurrency"])) == {("chat", 1), ("prose", 32)}
    assert (table["repeats"] == 2).all()
    best = serve.best_ratio(table).sort("dataset")
    assert best["ratio"].min() >= 0.95
    assert best["config"][0].endswith("corpus_prompts=1") and best["config"][1].endswith("batch_k=1:15/4:7/0")


def test_sampling_verdicts_test_every_server_against_nones_samples():
    """One row per sampled server of the committed samples against run s1's `none`: every later run's server keeps
    the distribution, s1's planted fault does not and keeps its bracket in the server's name; no servers, no rows."""
    frame = pl.read_parquet(SAMPLES)
    ref = frame.filter((pl.col("run") == "s1") & (pl.col("config") == "none"))["token_ids"][0].to_list()
    table = serve.sampling_verdicts(ref, frame.filter(pl.col("run") != "s1"), positions=24)
    assert table.height == frame.filter(pl.col("run") != "s1").height and table["same distribution"].all()
    s1 = serve.sampling_verdicts(ref, frame.filter((pl.col("run") == "s1") & (pl.col("config") != "none")),
                                 positions=24)
    planted = s1.filter(pl.col("config").str.contains("planted"))
    assert planted["config"].to_list() == ["gpu-lookup 1:15/4:7/0 [planted accept_first_draft]"]
    assert not planted["same distribution"][0] and s1.filter(~pl.col("config").str.contains("planted"))[
        "same distribution"].all()
    empty = serve.sampling_verdicts(ref, frame.filter(pl.col("run") == "nothing"), positions=24)
    assert empty.is_empty() and empty.columns == ["run", "config", "samples", "min p", "same distribution"]


S6_FUSED = ("gpu-fused:k=15,draft_block=1,nmax=32,policy=earliest,compile=true,schedule=long,nmin_tail=1,"
            "compile_rule=true,device_skip=true,layers=triton,attention=triton,batch_k=1:15/4:7/0")


def test_run_s6_the_served_fused_config_reaches_13x_none_on_sampled_prose(loads):
    """docs/serving.md's run s6 (one H100, sampled prose at T = 0.7, one request, 24 prompts × 3 repeats): the served
    gpu-fused with `prefill_graph=1024` runs >= 1.3x `none` in every repeat (median 1.31x; the issue's last
    point) and answers its first token within a few ms of `none`'s, where the eager prefill adds ~15 ms; the same
    config without it ran 1.28-1.41x on this host (s5a: 1.23x on another)."""
    table = serve.speedup_table(loads.filter(pl.col("run") == "s6"))
    assert table["machine"].str.contains("H100").all() and (table["repeats"] == 3).all()
    assert set(zip(table["dataset"], table["temperature"], table["max_concurrency"])) == {("prose", 0.7, 1)}
    by = {c: r for c, r in zip(table["config"], table.iter_rows(named=True))}
    assert set(by) == {"none", S6_FUSED, S6_FUSED + ",prefill_graph=1024"}
    graph, eager, none = by[S6_FUSED + ",prefill_graph=1024"], by[S6_FUSED], by["none"]
    assert graph["ratio_min"] >= 1.3 and round(graph["ratio"], 2) == 1.31
    assert graph["median_ttft_ms"] < none["median_ttft_ms"] + 5 < eager["median_ttft_ms"]
    assert 1.28 <= eager["ratio_min"] and round(eager["ratio"], 2) == 1.33


def test_run_s6_the_prefill_graph_keeps_nones_distribution_and_greedy_text():
    """Run s6 sampled the config with `prefill_graph=1024` (600 samples against run s1's `none`); its greedy texts
    part from `none`'s where the served config's do, at the same two near-ties."""
    frame = pl.read_parquet(SAMPLES)
    ref = frame.filter((pl.col("run") == "s1") & (pl.col("config") == "none"))["token_ids"][0].to_list()
    s6 = frame.filter(pl.col("run") == "s6")
    assert s6["config"].to_list() == [S6_FUSED + ",prefill_graph=1024"]
    samples = s6["token_ids"][0].to_list()
    assert len(samples) == 600
    assert serve.same_distribution(serve.distribution_test(ref, samples, positions=24))
    parted = serve.greedy_partings(pl.read_parquet(GREEDY).filter(pl.col("run") == "s6"))
    by_config: dict[str, list] = {}
    for config, prompt, position, margin in parted:
        by_config.setdefault(config, []).append((prompt, position, margin))
    assert by_config[S6_FUSED] == by_config[S6_FUSED + ",prefill_graph=1024"]
    assert all(margin < 0.25 for *_, margin in parted)
