"""Serving under load and sampling (`hqlab.bench.serve`, benchmarks/vllm_serve.py): the sampling test on synthetic
samples (it accepts one distribution, rejects a shifted one), the readers of a serving run's rows, samples, greedy
texts and server logs on committed runs, and `finish` putting a returned run in place. What each committed run
measured is stated in its claims.json (data/results/serve/<run>/, checked by tests/bench/test_run_claims.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest

from hqlab.bench import results, serve
from hqlab.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]


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


LOOKUP = "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest,batch_k=1:15/4:7/0"


def test_step_costs_at_one_request_are_time_per_token_times_tokens_a_step():
    """A committed run of sampled prose at one request: none's time per token is a plain step; the lookup's time per
    token × its acceptance length is a speculative step; rows of several (dataset, temperature) or none at one
    request are refused."""
    rows = results.load("serve", "s3").filter(pl.col("config").is_in(["none", LOOKUP]))
    plain, spec = serve.step_costs(rows, LOOKUP)
    one = rows.filter(pl.col("max_concurrency") == 1)
    assert plain == one.filter(pl.col("config") == "none")["median_tpot_ms"].median()
    row = one.filter(pl.col("config") == LOOKUP)
    assert spec == pytest.approx((row["median_tpot_ms"] * row["acceptance_length"]).median(), rel=1e-12)
    with pytest.raises(ValueError, match="no rows at one request"):
        serve.step_costs(rows, "gpu-lookup:k=3")
    with pytest.raises(ValueError, match="one \\(dataset, temperature\\)"):
        serve.step_costs(results.load("serve", "s1"), LOOKUP)


def test_short_config_names_the_gate():
    assert serve.short_config("gpu-lookup:nmin=1,k=15,batch_k=1:15/4:7/0,gate=2") == "gpu-lookup 1:15/4:7/0 gate=2"
    assert serve.short_config("gpu-lookup:nmin=1,k=15,gate=1") == "gpu-lookup k=15 gate=1"
    assert serve.short_config("gpu-lookup:nmin=1,k=15,batch_k=1:15/4:7/0") == "gpu-lookup 1:15/4:7/0"
    # the served fused configs with greedy and drawn drafts stay apart in plots and tables
    assert serve.short_config("gpu-fused:k=15,draft_block=1,batch_k=1:15/4:7/0,draft_sample=probabilistic") == \
        "gpu-fused 1:15/4:7/0 sampled drafts"
    assert serve.short_config("gpu-fused:k=15,draft_block=2,batch_k=1:15/4:7,draft_sample=probabilistic") == \
        "gpu-fused block=2 1:15/4:7 sampled drafts"
    assert serve.short_config("gpu-lookup:nmin=1,k=15,corpus=32768,corpus_policy=longest") == "gpu-lookup k=15 corpus"
    # two fused servers that differ only in how the drafter reads a prompt stay apart
    assert serve.short_config("gpu-fused:k=15,draft_block=1,batch_k=1:15/4:7/0,prefill_graph=1024") == \
        "gpu-fused 1:15/4:7/0 prefill graph"
    assert serve.short_config("gpu-fused:k=15,draft_block=1,batch_k=1:15/4:7/0,prefill_graph=0") == \
        "gpu-fused 1:15/4:7/0"
    # vLLM's own suffix method, by the size of its global tree
    assert serve.short_config("arctic-suffix:k=24,depth=24,min_prob=0.1,cached=90") == "arctic-suffix k=24 cached=90"
    # and its ngram_gpu and draft_model, by their match lengths and drafter
    assert serve.short_config("vllm-ngram-gpu:nmin=2,nmax=5,k=7") == "vllm-ngram-gpu k=7 nmin=2 nmax=5"
    assert serve.short_config("vllm-draft:model=qwen2.5-coder-0.5b,k=7") == "vllm-draft k=7 drafter=qwen2.5-coder-0.5b"


# the GPU test logs of the drawn drafts before and after the fix of their CUDA graph capture
EAGER, CAPTURED = (results.run_file("gpu_tests", run, "run.log")
                   for run in ("draft_sampling_s5", "draft_sampling_s5b"))


def test_a_drafting_step_that_ran_eagerly_is_found_in_the_log():
    """The committed serving runs' server logs (the archived ones) captured every drafting step; the GPU test log of
    the drawn drafts before their fix shows gpu-fused's warning that capture failed, the log after the fix does not."""
    import tarfile

    served = []
    for run in results.runs("serve"):
        if "server_logs.tar.gz" in results.run_info("serve", run)["files"]:
            with tarfile.open(results.run_file("serve", run, "server_logs.tar.gz")) as tar:
                served += [tar.extractfile(m).read().decode(errors="replace") for m in tar.getmembers() if m.isfile()]
    facts = [serve.server_log_facts(text) for text in served]
    assert len(facts) >= 15 and any(f["config"].startswith("gpu-fused") for f in facts)
    assert not any(f["drafting_eager"] for f in facts)
    assert serve.server_log_facts(EAGER.read_text())["drafting_eager"]
    assert not serve.server_log_facts(CAPTURED.read_text())["drafting_eager"]


def test_a_servers_scheduling_mode_is_read_from_its_log():
    """`none`'s log says vLLM's own line; an hqlab server's says "disabled" from vLLM, then the plugin's line turns it
    on; the committed servers' logs predate that line, so theirs is unknown, not guessed from vLLM's "disabled"."""
    import tarfile

    from hqlab.engines.vllm.plugin import ASYNC_ON

    with tarfile.open(results.run_file("serve", "s8a", "server_logs.tar.gz")) as tar:
        facts = [serve.server_log_facts(tar.extractfile(m).read().decode()) for m in tar.getmembers() if m.isfile()]
    assert sorted((f["config"] == "none", f["async_scheduling"]) for f in facts) == [(False, None)] * 3 + [(True, True)]
    hqlab_log = "'hqlab_proposer': 'gpu-lookup:k=7'\nINFO Asynchronous scheduling is disabled.\nINFO " + ASYNC_ON
    assert serve.server_log_facts(hqlab_log)["async_scheduling"] is True
    assert serve.server_log_facts("INFO Asynchronous scheduling is disabled.")["async_scheduling"] is False


def test_the_benchmark_skips_the_load_points_of_a_server_that_drafts_eagerly(capsys, tmp_path):
    from benchmarks import vllm_serve

    assert vllm_serve.warn_if_eager("gpu-fused:...", EAGER, allow=False)
    assert "its load points are skipped" in capsys.readouterr().out
    assert vllm_serve.warn_if_eager("gpu-fused:...", EAGER, allow=True)
    assert "measured anyway (--allow-eager)" in capsys.readouterr().out
    assert not vllm_serve.warn_if_eager("gpu-fused:...", CAPTURED, allow=False)
    assert not vllm_serve.warn_if_eager("gpu-fused:...", tmp_path / "no_such.log", allow=False)


def test_served_heads_give_each_head_its_ratio_tokens_a_step_and_step_cost():
    """A committed run of greedy and drawn heads at one request: one row per head config, greedy first, then the
    drawn heads by length; each head's step is its time per token × tokens a step, over none's time per token; a
    run without `none` or without gpu-fused rows is refused by name."""
    rows = results.load("serve", "s5a")
    table = serve.served_heads(rows, "s5a")
    assert table.select("draft", "head").rows() == [("greedy", 1), ("drawn", 1), ("drawn", 2), ("drawn", 3)]
    assert ((table["step_ms"] / table["plain_step_ms"]) - table["step_ratio"]).abs().max() < 1e-12
    with pytest.raises(ValueError, match="no `none` rows"):
        serve.served_heads(rows.filter(pl.col("config") != "none"), "s5a")
    with pytest.raises(ValueError, match="no gpu-fused rows"):
        serve.served_heads(rows.filter(~pl.col("config").str.starts_with("gpu-fused")), "s5a")


def test_sampling_verdicts_test_every_server_against_nones_samples():
    """One row per sampled server of the committed samples against the planted-fault run's `none`: every server of
    every run, a planted fault's bracket kept in the server's name; no servers, no rows."""
    frame = results.load("serve", kind="samples")
    planted_run = frame.filter(pl.col("config").str.contains("planted"))["run"][0]
    ref = frame.filter((pl.col("run") == planted_run) & (pl.col("config") == "none"))["token_ids"][0].to_list()
    servers = frame.filter(pl.col("config") != "none")
    table = serve.sampling_verdicts(ref, servers, positions=24)
    assert table.height == servers.height and table["run"].to_list() == servers["run"].to_list()
    planted = table.filter(pl.col("config").str.contains("planted"))
    assert planted["config"].to_list() == ["gpu-lookup 1:15/4:7/0 [planted accept_first_draft]"]
    assert not planted["same distribution"][0]
    empty = serve.sampling_verdicts(ref, frame.filter(pl.col("run") == "nothing"), positions=24)
    assert empty.is_empty() and empty.columns == ["run", "config", "samples", "min p", "same distribution"]


def _returned(run: str, into: Path) -> Path:
    """A committed serving run's files as the GPU host returned them (their names before `finish`)."""
    into.mkdir()
    names = {"raw.jsonl": f"vllm_serve_{run}.jsonl", "samples.jsonl": f"serve_samples_{run}.jsonl",
             "greedy.jsonl": f"serve_greedy_{run}.jsonl", "server_logs.tar.gz": f"serve_{run}_logs.tar.gz",
             "run.log": f"vllm_serve_{run}.log"}
    for name, returned in names.items():
        (into / returned).write_bytes(results.run_file("serve", run, name).read_bytes())
    return into


def test_finish_puts_a_returned_run_in_place_as_it_is_committed(tmp_path):
    """benchmarks/vllm_serve.py finish on a committed run's returned files writes the same rows, samples and greedy
    texts, keeps what came back under its run's names, and says in run.json where and what ran (card, commit, plan,
    model runner, the command of its log); the index lists the run. Finishing it again replaces it."""
    from polars.testing import assert_frame_equal

    from benchmarks import vllm_serve

    returned = _returned("s6", tmp_path / "returned")
    root = tmp_path / "results"
    assert vllm_serve.main(["finish", str(returned), "--results", str(root)]) == 0
    for kind in ("rows", "samples", "greedy"):
        assert_frame_equal(results.load("serve", "s6", kind, root=root), results.load("serve", "s6", kind),
                           check_column_order=False, check_dtypes=False)
    entry, committed = results.run_info("serve", "s6", root), results.run_info("serve", "s6")
    for key in ("card", "commit", "plan", "vllm_runner", "command", "date", "benchmark"):
        assert entry[key] == committed[key], key
    assert entry["card"] == "h100" and entry["plan"] == "benchmarks/plans/serve_s6.json"
    assert set(entry["files"]) == set(committed["files"]) - {"claims.json"}
    assert vllm_serve.main(["finish", str(returned), "--results", str(root)]) == 0
    assert [r["run"] for r in results.index(root)] == ["s6"]


def test_finish_refuses_the_rows_of_two_runs_in_one_folder(tmp_path):
    returned = _returned("s6", tmp_path / "returned")
    (returned / "vllm_serve_s7.jsonl").write_text((returned / "vllm_serve_s6.jsonl").read_text())
    from benchmarks import vllm_serve

    with pytest.raises(SystemExit, match=r"rows of 2 runs \(s6, s7\)"):
        vllm_serve.main(["finish", str(returned), "--results", str(tmp_path / "results")])
