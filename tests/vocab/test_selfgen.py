"""Self-generation: the prompt plan, resuming and repairing a killed run, and left-padded batches equal to
unbatched greedy decoding."""

from __future__ import annotations

import json

import pytest

from hqlab.workloads import encode_chat


def test_plan_cycles_prompts_with_sample_ids():
    from hqlab.vocab.selfgen import load_prompts, plan

    prompts = load_prompts()
    assert len(prompts) >= 250 and {p.category for p in prompts} == {"chat", "code", "math"}
    jobs = plan(prompts, len(prompts) + 3)
    assert [j.id for j in jobs[:2]] == [prompts[0].id, prompts[1].id]
    assert [j.id for j in jobs[-3:]] == [f"{p.id}#1" for p in prompts[:3]]
    assert len({j.id for j in jobs}) == len(jobs)


@pytest.mark.slow
def test_selfgen_resumes_and_repairs_a_killed_run(tmp_path, engine_05b):
    from hqlab.vocab import selfgen
    from hqlab.config import ConfigError

    model, tok = engine_05b.model, engine_05b.tokenizer
    prompts = selfgen.load_prompts()[:5]
    out = tmp_path / "corpus.jsonl"
    kw = dict(batch_size=2, max_new_tokens=6, model_name="qwen2.5-coder-0.5b", progress=False)
    first = selfgen.run(model, tok, prompts, out, n_records=3, **kw)
    assert (first.written, first.skipped) == (3, 0)
    lines = out.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["id"] for r in records] == [p.id for p in prompts[:3]]
    for r, p in zip(records, prompts):
        assert set(r) == {"id", "src", "prompt_ids", "output_ids", "finish"} and r["src"] == p.category
        assert r["prompt_ids"] == encode_chat(tok, p.messages)
        assert 1 <= len(r["output_ids"]) <= 6 and r["finish"] in ("eos", "length")
        assert (r["finish"] == "eos") == (r["output_ids"][-1] in engine_05b.eos)
    # a run killed while appending leaves a cut line: the next run drops it and regenerates that id
    out.write_text("\n".join(lines[:2]) + "\n" + lines[2][: len(lines[2]) // 2])
    second = selfgen.run(model, tok, prompts, out, n_records=5, **kw)
    assert (second.skipped, second.written) == (2, 3)
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert ids == [p.id for p in prompts[:2]] + [p.id for p in prompts[2:5]]
    assert selfgen.run(model, tok, prompts, out, n_records=5, **kw).written == 0
    meta = json.loads(out.with_name(out.name + ".meta.json").read_text())
    assert meta["sampling"]["source"] and meta["max_new_tokens"] == 6
    with pytest.raises(selfgen.SelfgenError, match="different settings .*max_new_tokens"):
        selfgen.run(model, tok, prompts, out, n_records=5, **(kw | {"max_new_tokens": 7}))
    with pytest.raises(ConfigError, match="must end in .jsonl"):
        selfgen.run(model, tok, prompts, tmp_path / "x.json", n_records=1, **kw)
    # the corpus reader takes the result as is
    from hqlab.vocab.corpus import validate

    assert [r.ids is not None for r in validate([out])] == [True] * 5


@pytest.mark.slow
def test_left_padded_batch_matches_unbatched_greedy(engine_05b_fp32):
    """top_k=1 sampling is greedy: a left-padded batch of prompts of different lengths must reproduce the
    engine's own batch-1 greedy outputs (fp32, so no bf16 near-tie flips from the different shapes)."""
    from hqlab.vocab import selfgen
    from hqlab.config import DecodeConfig

    eng = engine_05b_fp32
    prompts = [p for p in selfgen.load_prompts() if p.category == "math"][:2]
    ids = [encode_chat(eng.tokenizer, p.messages) for p in prompts]
    assert len({len(i) for i in ids}) > 1  # padding really happens
    greedy = selfgen.Sampling(temperature=1.0, top_p=1.0, top_k=1, repetition_penalty=1.0, source="test")
    batch = selfgen.generate_batch(eng.model, ids, pad_id=eng.tokenizer.pad_token_id, eos_ids=sorted(eng.eos),
                                   max_new_tokens=6, sampling=greedy, seed=0)
    for (out, _), p in zip(batch, ids):
        assert out == eng.generate(p, decode=DecodeConfig(max_new_tokens=6)).output_ids
