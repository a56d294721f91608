"""Draft vocabulary lists: counting with the hold-out, ranking, coverage, artifacts (ids, head rows, maps) and
loading them back, the generic comparison corpus, latency measurement."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hqlab import vocab
from hqlab.vocab import VocabError
from hqlab.vocab.corpus import CorpusError, CorpusRecord
from hqlab.vocab.publish import read_index

REPO = Path(__file__).resolve().parents[2]
SELFGEN = REPO / "data" / "selfgen" / "qwen2.5-coder-0.5b.jsonl"


def rec(i: int, ids, src="chat") -> CorpusRecord:
    return CorpusRecord("f.jsonl", i + 1, i, src, ids=tuple(ids))


def test_count_holds_out_every_tenth_record():
    records = [rec(i, [i % 7, 100]) for i in range(25)]
    c = vocab.count(records, None, 128, progress=False)
    assert c.records_held == 3 and c.records_counted == 22  # j = 0, 10, 20
    assert c.held[0] == 1 and c.held[3] == 1 and c.held[6] == 1 and c.held[100] == 3  # 0 % 7, 10 % 7, 20 % 7
    assert c.counted[100] == 22 and c.tokens_counted == 44
    assert set(c.held_by_src) == {"chat"}
    everything = vocab.count(records, None, 128, holdout=False, progress=False)
    assert everything.records_held == 0 and everything.tokens_counted == 50


def test_count_rejects_ids_outside_the_vocabulary_and_an_empty_split():
    with pytest.raises(CorpusError, match=r"f.jsonl:2: token id 500 is outside the model's vocabulary of 128"):
        vocab.count([rec(0, [1]), rec(1, [500])], None, 128, progress=False)
    with pytest.raises(VocabError, match="no records left to count after the hold-out"):
        vocab.count([rec(0, [1])], None, 128, progress=False)


def test_rank_specials_first_then_count_then_id():
    counted = np.zeros(10, np.int64)
    counted[[7, 2, 5]] = [5, 9, 5]
    order = vocab.rank(counted, special=[9, 8])
    assert order.tolist() == [8, 9, 2, 5, 7, 0, 1, 3, 4, 6]
    ids = vocab.top_n(order, 4)
    assert ids.tolist() == [2, 5, 8, 9] and ids.dtype == np.int64
    with pytest.raises(VocabError, match="size must be in"):
        vocab.top_n(order, 11)


def test_coverage_curve_is_monotone_and_complete():
    records = [rec(i, np.random.default_rng(i).zipf(1.3, 50) % 64, src="code" if i % 3 else "chat")
               for i in range(60)]
    c = vocab.count(records, None, 64, progress=False)
    order = vocab.rank(c.counted, [63])
    rows = vocab.coverage_curve(order, c, [1, 4, 16, 64], label="own")
    curve = [r["coverage"] for r in rows if r["src"] == "all"]
    assert curve == sorted(curve) and curve[-1] == 1.0
    assert {r["src"] for r in rows} == {"all", "chat", "code"}
    assert vocab.coverage(vocab.top_n(order, 16), c.held) == curve[2]
    assert curve[2] == pytest.approx(c.held[order[:16]].sum() / c.held.sum())


def test_default_sizes_scale_hyperqwen_steps():
    sizes = vocab.default_sizes(151_936)
    assert sizes == sorted(sizes) and sizes[0] == 1024 and sizes[-1] < 151_936
    assert {10240, 20480, 29696, 39936} <= set(sizes)  # 16k/32k/48k/64k of 248k, scaled


def test_load_draft_vocab_from_json(tmp_path):
    plain = tmp_path / "ids.json"
    plain.write_text(json.dumps([30, 4, 4, 17]))
    ids = vocab.load_draft_vocab(plain)
    assert ids.dtype == torch.int64 and ids.dim() == 1 and ids.tolist() == [4, 17, 30]
    plain.write_text(json.dumps({"ids": [3, 1]}))
    assert vocab.load_draft_vocab(plain).tolist() == [1, 3]
    for bad in ("[1, -1]", "[]", '{"ids": "1,2"}', "[1.5]", "{oops"):
        plain.write_text(bad)
        with pytest.raises(VocabError, match=str(plain)):
            vocab.load_draft_vocab(plain)
    with pytest.raises(VocabError, match="nothing published here"):
        vocab.load_draft_vocab(tmp_path)
    with pytest.raises(VocabError, match="no such draft vocabulary"):
        vocab.load_draft_vocab(tmp_path / "nope")


def test_id_list_and_heldout_prompts(tmp_path):
    path = vocab.write_id_list(tmp_path / "ids.json", np.array([9, 2, 5]))
    assert vocab.load_draft_vocab(path).tolist() == [2, 5, 9]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"p{j % 12}" + ("#1" if j >= 12 else ""), "src": "chat",
                                          "output_ids": [j]}) + "\n" for j in range(24)))
    assert vocab.heldout_prompt_ids(corpus) == ["p0", "p10", "p8"]  # records 0, 10, 20


def _publish_vocab(folder: Path, ids: np.ndarray, vocab_size: int, *, old_names: bool = False,
                   tamper: bool = False) -> Path:
    """A vocabulary folder as `hqlab vocab build` publishes it (random head rows: no model needed); `old_names`
    writes the maps under the names folders had before the rename (`d2t`/`t2d`, the same absolute ids)."""
    from safetensors.torch import load, save

    from hqlab.vocab.publish import publish

    files = vocab.artifact_bytes(ids, torch.randn(ids.size, 8), vocab_size, [int(ids[0])])
    maps = load(files["mapping.safetensors"])
    if tamper:
        maps["draft_to_target"] = maps["draft_to_target"].roll(1)
    if old_names:
        maps = {"d2t": maps["draft_to_target"], "t2d": maps["target_to_draft"]}
    files["mapping.safetensors"] = save(maps)
    publish(folder, files, {"size": int(ids.size)})
    return folder


def test_mapping_names_say_absolute_ids_and_old_folders_still_read(tmp_path):
    ids = np.array([0, 3, 4, 9, 17, 40], dtype=np.int64)
    d2t, t2d = vocab.load_mapping(_publish_vocab(tmp_path / "new", ids, 64))
    assert d2t.tolist() == ids.tolist()  # draft row i stands for target token ids[i] (absolute)
    assert t2d.numel() == 64 and t2d[ids].tolist() == list(range(6)) and int((t2d >= 0).sum()) == 6
    old_d2t, old_t2d = vocab.load_mapping(_publish_vocab(tmp_path / "old", ids, 64, old_names=True))
    assert torch.equal(old_d2t, d2t) and torch.equal(old_t2d, t2d)
    with pytest.raises(VocabError, match="disagrees with ids.json.*rebuild"):
        vocab.load_mapping(_publish_vocab(tmp_path / "bad", ids, 64, tamper=True))
    # vLLM's EAGLE-3 convention: offsets, target = draft + d2t[draft]
    offsets = vocab.eagle3_d2t(d2t)
    assert offsets.tolist() == [0, 2, 2, 6, 13, 35]
    assert [i + int(offsets[i]) for i in range(6)] == ids.tolist()


def test_generic_corpus_is_deterministic_prose_and_code():
    a, b = vocab.generic_records(), vocab.generic_records()
    assert a == b
    kinds = {k: sum(len(r["text"]) for r in a if r["src"] == k) for k in ("prose", "code")}
    assert kinds["prose"] > 500_000 and kinds["code"] >= kinds["prose"]
    assert all(r["origin"].startswith(("pkg/", "pydoc/", "stdlib/")) for r in a)


# ----------------------------------------------------------------------------------------------------------------
# On the real model


@pytest.mark.slow
def test_build_artifacts_match_the_model(tmp_path, engine_05b):
    result = vocab.build("qwen2.5-coder-0.5b", [SELFGEN], 3000, tmp_path / "v", progress=False)
    ids = vocab.load_draft_vocab(tmp_path / "v")
    assert ids.dtype == torch.int64 and ids.dim() == 1 and ids.numel() == 3000
    assert torch.all(ids[1:] > ids[:-1])
    assert set(vocab.special_token_ids(engine_05b.tokenizer)) <= set(ids.tolist())
    assert ids.tolist() == result.ids.tolist()
    # the rows are the model's own lm_head rows (the checkpoint holds fp32; the engine may run bf16)
    _, rows = vocab.load_draft_head(tmp_path / "v")
    head = engine_05b.model.get_output_embeddings().weight
    assert torch.equal(rows.to(head.dtype), head[ids])
    from safetensors.torch import load_file

    from hqlab.vocab.publish import path_of

    mapping = load_file(path_of(tmp_path / "v", "mapping.safetensors"))
    assert set(mapping) == {"draft_to_target", "target_to_draft"}
    assert torch.equal(mapping["draft_to_target"], ids)
    assert torch.equal(mapping["target_to_draft"][ids], torch.arange(3000))
    assert int((mapping["target_to_draft"] >= 0).sum()) == 3000 and mapping["target_to_draft"].numel() == 151_936
    meta = read_index(tmp_path / "v")["meta"]
    assert meta["records_held_out"] >= 1 and 0 < meta["heldout_coverage"]["all"] <= 1
    # coverage is measured on held-out records only: recompute it from the corpus
    records = [json.loads(line) for line in SELFGEN.read_text().splitlines() if line.strip()]
    held = [t for j, r in enumerate(records) if j % 10 == 0 for t in r["output_ids"]]
    assert meta["heldout_coverage"]["all"] == pytest.approx(np.isin(held, ids.numpy()).mean())
    # the draft proposer takes the published folder and only ever proposes listed tokens
    from hqlab.proposers.draft import DraftConfig, DraftProposer

    drafter = DraftProposer(DraftConfig(k=6, vocab=str(tmp_path / "v")), model=engine_05b.model)
    assert torch.equal(drafter.draft_to_target, ids)
    history = np.asarray(records[1]["prompt_ids"] + records[1]["output_ids"][:20], dtype=np.int64)
    proposed = drafter.propose([history], [6])[0].tokens
    assert proposed.size == 6 and np.isin(proposed, ids.numpy()).all()


@pytest.mark.slow
def test_draft_latency_rows(engine_05b):
    rows = vocab.measure_draft_latency(engine_05b.model, [1024, 16384], context=64, repeats=3, warmup=1)
    assert [r["n"] for r in rows] == [1024, 16384, 151_936] and rows[-1]["full"]
    assert all(r["step_ms"] > 0 and r["head_ms"] > 0 for r in rows)
    # scoring 150k rows costs more than scoring 1k (a 148x larger matmul; robust even on a busy machine)
    assert rows[-1]["head_ms"] > rows[0]["head_ms"]


# ----------------------------------------------------------------------------------------------------------------
# Self-generation (the corpus the lists are counted from)


