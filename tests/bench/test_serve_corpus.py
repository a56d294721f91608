"""The corpus workloads through the served benchmark (`hqlab.bench.serve`, CORPUS_DATASETS): their prompts are each
request's whole chat through the model's real chat template in file order, a point sends them pass after pass, vLLM's
load generator is told to keep that order and send nothing before it, and bad points are refused with a message that
names the fault. The batch job's prompts alone outgrow the served corpus bound, which is why its later passes draft
as its first did (serve.py's comment); the records job is long enough that plan c5b's points re-send nothing, and every
corpus prompt fits the served context with its answer."""

from __future__ import annotations

import json

import pytest

from hqlab import models
from hqlab.bench import serve
from hqlab.config import ConfigError
from hqlab.io import REPO
from hqlab.workloads import encode_chat, read_requests

CORPUS_BOUND = 32768  # the served corpus config's corpus= (docs/corpus.md)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models.prepare("qwen2.5-coder-0.5b"))


@pytest.mark.parametrize("name", sorted(serve.CORPUS_DATASETS))
def test_corpus_prompts_are_each_requests_chat_in_file_order(name, tokenizer):
    prompts = serve.dataset_prompts(name, tokenizer)
    requests = read_requests(REPO / "data" / "workloads" / serve.CORPUS_DATASETS[name])
    assert len(prompts) == len(requests) == {"batch": 153, "template": 24, "records": 335}[name]
    for text, request in zip(prompts, requests):
        # the system turn travels, and the text tokenizes to the ids every engine of the project sends
        assert request.messages[0]["content"] in text and request.messages[-1]["content"] in text
        assert tokenizer.encode(text, add_special_tokens=False) == encode_chat(tokenizer, request.messages)


def test_a_resent_batch_request_finds_its_own_answer_gone_up_to_32_in_flight():
    """Between a batch request's answer entering the corpus and the same request's next pass, about n - C other
    documents enter (n = 153 requests, C in flight). With the 1.5B's documents as vLLM served them (run c4c, prompt
    and answer), every such stretch holds more than the served bound at 8-32 in flight; at 64 about half do not."""
    import polars as pl

    rows = pl.read_parquet(REPO / "data" / "results" / "corpus" / "c4c" / "requests.parquet")
    rows = rows.filter((pl.col("config") == "none") & (pl.col("repeat") == 0)).sort("order")
    docs = [len(p) + len(o) for p, o in zip(rows["prompt_ids"], rows["output_ids"])]
    n = len(docs)
    assert n == 153

    def stretches(c):
        return [sum(docs[(i + j) % n] for j in range(1, n - c + 1)) for i in range(n)]

    for c in (8, 16, 32):
        assert min(stretches(c)) > CORPUS_BOUND
    assert 0 < sum(s <= CORPUS_BOUND for s in stretches(64)) < n



def test_the_suffix_servers_cache_holds_as_many_requests_as_the_corpus_and_never_a_resent_one():
    """Plan c5d's vLLM suffix server keeps `cached` requests' answers (first in, first out by the order requests
    start): as many as the corpus's 32,768 tokens hold of the batch job's documents (c4c's, prompt and answer: 84-92,
    whichever request the window ends at), and fewer than the 152 requests that start between a request and its
    re-sending, so a later pass drafts as the first did, as for the corpus (vLLM's default, 10,000, would retry)."""
    import polars as pl

    from hqlab.config import parse_spec

    rows = pl.read_parquet(REPO / "data" / "results" / "corpus" / "c4c" / "requests.parquet")
    rows = rows.filter((pl.col("config") == "none") & (pl.col("repeat") == 0)).sort("order")
    docs = [len(p) + len(o) for p, o in zip(rows["prompt_ids"], rows["output_ids"])]
    n = len(docs)

    def held(i):  # documents the corpus holds once request i's has entered
        k, total = 0, 0
        while k < n and total + docs[(i - k) % n] <= CORPUS_BOUND:
            total, k = total + docs[(i - k) % n], k + 1
        return k

    plan = json.loads((REPO / "benchmarks" / "plans" / "corpus_c5d.json").read_text())
    cached = int(parse_spec(plan["configs"]["suffix"])[1]["cached"])
    reach = [held(i) for i in range(n)]
    assert min(reach) <= cached <= max(reach) and cached < n - 1

def test_the_templates_prompts_fit_the_corpus(tokenizer):
    """The template's 24 prompts take under half the bound, so with their answers its passes beyond the first
    re-send requests whose answers the corpus still holds: retries."""
    prompts = serve.dataset_prompts("template", tokenizer)
    assert sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in prompts) < CORPUS_BOUND / 2


def test_every_corpus_prompt_fits_the_served_context_with_its_answer(tokenizer):
    """benchmarks/vllm_serve.py serves --max-model-len tokens and asks --output-len of every request (its defaults)."""
    import argparse

    from benchmarks.vllm_serve import add_server_options

    parser = argparse.ArgumentParser()
    add_server_options(parser, start_timeout=1)
    served = parser.parse_args([])
    for name in serve.CORPUS_DATASETS:
        prompts = serve.dataset_prompts(name, tokenizer)
        longest = max(len(tokenizer.encode(t, add_special_tokens=False)) for t in prompts)
        assert longest + served.output_len <= served.max_model_len, name


def test_the_reuse_plan_measures_the_templates_kind_of_reuse_without_retries():
    """Plan c5b's points at 8 and 32 in flight are the records job's, one pass of it (no request re-sent, so no
    retry of one whose answer the corpus holds); the template runs one pass, one request at a time."""
    plan = json.loads((REPO / "benchmarks" / "plans" / "corpus_c5b.json").read_text())
    points = [serve.parse_point(p)[0] for p in plan["points"]]
    assert {(p.dataset, p.max_concurrency) for p in points} == {("records", 32), ("records", 8), ("template", 1)}
    for p in points:
        assert p.require_waves() and p.num_prompts <= len(read_requests(REPO / "data" / "workloads" /
                                                                         serve.CORPUS_DATASETS[p.dataset])), p


def test_a_point_sends_the_workload_pass_after_pass(tmp_path):
    lines = [json.dumps({"prompt": f"request {i}"}) for i in range(5)]
    (tmp_path / "template.jsonl").write_text("\n".join(lines) + "\n")
    path = serve.point_dataset(tmp_path, serve.LoadPoint("template", 0.0, 2, 12))
    sent = [json.loads(x)["prompt"] for x in path.read_text().splitlines()]
    assert sent == [f"request {i % 5}" for i in range(12)]
    one = serve.point_dataset(tmp_path, serve.LoadPoint("template", 0.0, 1, 3))
    assert [json.loads(x)["prompt"] for x in one.read_text().splitlines()] == ["request 0", "request 1", "request 2"]
    assert serve.point_dataset(tmp_path, serve.LoadPoint("chat", 0.0, 1, 12)) == tmp_path / "chat.jsonl"
    (tmp_path / "batch.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        serve.point_dataset(tmp_path, serve.LoadPoint("batch", 0.0, 1, 12))


def test_corpus_points_keep_the_order_and_send_nothing_first():
    def flags(dataset):
        return serve.bench_args("http://x:1", "target", "tok", "d.jsonl", serve.LoadPoint(dataset, 0.0, 8, 80),
                                output_len=256, result_dir="r", result_file="f.json")

    batch, chat = flags("batch"), flags("chat")
    for flag in ("--skip-chat-template", "--disable-shuffle", "--no-oversample"):
        assert flag in batch and flag not in chat
    assert batch[batch.index("--num-warmups") + 1] == "0" and chat[chat.index("--num-warmups") + 1] == "2"
    assert batch[batch.index("--ready-check-timeout-sec") + 1] == "0" and "--ready-check-timeout-sec" not in chat


@pytest.mark.parametrize("text, fault", [
    ("batch:0:32", "DATASET:TEMPERATURE"), ("corpus:0:8:80", "dataset must be one of"),
    ("batch:warm:8:80", "temperature 'warm'"), ("batch:0:eight:80", "concurrency 'eight'"),
    ("batch:0:8:80:0", "repeats must be >= 1"), ("template:0:8:-80", "prompts '-80'"),
    ("template:0:32:16", "must be >= max_concurrency"),
])
def test_bad_points_are_refused_naming_the_fault(text, fault):
    with pytest.raises(ConfigError, match=fault):
        serve.parse_point(text)


def test_corpus_points_must_run_ten_waves():
    point, repeats = serve.parse_point("batch:0:32:320:3")
    assert (point.dataset, point.max_concurrency, point.num_prompts, repeats) == ("batch", 32, 320, 3)
    assert point.require_waves() is point
    with pytest.raises(ConfigError, match="4.8 waves"):
        serve.parse_point("batch:0:32:153")[0].require_waves()


def test_greedy_texts_of_corpus_points_part_where_a_request_differs():
    import polars as pl

    def row(config, repeat, texts, dataset="template"):
        return {"run": "r", "dataset": dataset, "repeat": repeat, "config": config, "texts": texts}

    rows = pl.DataFrame([row("none", 0, ["a", "b", "c"]), row("corpus", 0, ["a", "b", "c"]),
                         row("none", 1, ["a", "b", "c"]), row("corpus", 1, ["a", "x", "y"]),
                         row("none", 0, ["p"], "batch"), row("corpus", 0, ["p"], "batch")])
    got = serve.point_text_partings(rows).sort("dataset", "repeat")
    assert got.select("dataset", "repeat", "differ", "first").rows() == [("batch", 0, 0, -1), ("template", 0, 0, -1),
                                                                         ("template", 1, 2, 1)]
    with pytest.raises(ValueError, match="not the same point"):
        serve.point_text_partings(pl.DataFrame([row("none", 0, ["a"]), row("corpus", 0, ["a", "b"])]))
    with pytest.raises(ValueError, match="no 'none' texts"):
        serve.point_text_partings(pl.DataFrame([row("corpus", 0, ["a"])]))


def test_only_greedy_corpus_points_at_one_request_keep_their_texts():
    result = {"generated_texts": ["x", "y"], "completed": 2}
    kw = dict(run="r", config="none", model="m", machine="cpu", vllm_version="0.26.0", git_commit="c")
    assert serve.load_row(result, point=serve.LoadPoint("batch", 0.0, 1, 2), **kw)["texts"] == ["x", "y"]
    for point in (serve.LoadPoint("batch", 0.7, 1, 2), serve.LoadPoint("batch", 0.0, 2, 2),
                  serve.LoadPoint("chat", 0.0, 1, 2)):
        assert "texts" not in serve.load_row(result, point=point, **kw)
