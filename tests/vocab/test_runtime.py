"""The runtime half of a draft vocabulary on the real 0.5B: the truncated head never proposes an out-of-list token,
keeps the full head's argmax whenever that is in the list, and decodes greedily with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hqlab import vocab

REPO = Path(__file__).resolve().parents[2]


def _hidden_states(engine, text: str) -> torch.Tensor:
    ids = torch.tensor([engine.tokenizer.encode(text)])
    with torch.inference_mode():
        return engine.model.get_decoder()(input_ids=ids).last_hidden_state[0]


@pytest.mark.slow
@torch.inference_mode()
def test_sliced_head_never_leaves_the_list_and_keeps_in_list_argmax(engine_05b):
    model = engine_05b.model
    text = (REPO / "data" / "documents" / "handbook.md").read_text()[:1500]
    hidden = _hidden_states(engine_05b, text)  # [T, H] real hidden states
    full = model.get_output_embeddings()(hidden).float()
    full_argmax = full.argmax(-1)
    # a list that holds about half of the full head's choices: every other one of them, plus frequent ids
    chosen = torch.unique(full_argmax)
    ids = torch.unique(torch.cat([chosen[::2], torch.arange(0, 4000), torch.tensor([151643, 151644, 151645])]))
    head = vocab.sliced_lm_head(model, ids)
    assert head.weight.shape == (ids.numel(), model.config.hidden_size) and head.weight.dtype == model.dtype
    sliced = head(hidden).float()
    drafted = ids[sliced.argmax(-1)]
    assert torch.isin(drafted, ids).all()
    inside = torch.isin(full_argmax, ids)
    assert 0 < inside.sum() < inside.numel()  # both cases occur
    same = drafted[inside] == full_argmax[inside]
    # equal up to exact ties (same logit): the sliced rows are the same rows, scored by a differently shaped matmul
    tie = full[inside].gather(1, drafted[inside, None])[:, 0] == full[inside].max(-1).values
    assert (same | tie).all()
    assert same.float().mean() > 0.99
    # the expanded logits put -inf outside the list, so a drafter's q is zero there
    q = torch.softmax(vocab.expand_logits(sliced[:4], ids, full.shape[-1]), -1)
    assert q.shape == full[:4].shape and float(q[:, ~torch.isin(torch.arange(full.shape[-1]), ids)].sum()) == 0.0


@pytest.mark.slow
def test_greedy_decoding_with_the_sliced_head(engine_05b):
    """A drafter decoding with the truncated head emits only listed tokens, and follows the full head's greedy
    output exactly until the first step where the full head's choice is not in the list."""
    from transformers import DynamicCache

    model, tok = engine_05b.model, engine_05b.tokenizer
    prompt = engine_05b.encode_chat([{"role": "user", "content": "Write a Python function that adds two numbers."}])

    def decode(head, ids, steps=20):
        body, cache, out = model.get_decoder(), DynamicCache(config=model.config), []
        x = torch.tensor([prompt])
        with torch.inference_mode():
            for _ in range(steps):
                h = body(input_ids=x, use_cache=True, **{engine_05b._cache_kw: cache}).last_hidden_state[:, -1]
                t = int(ids[head(h).argmax(-1)]) if ids is not None else int(head(h).argmax(-1))
                out.append(t)
                x = torch.tensor([[t]])
        return out

    reference = decode(model.get_output_embeddings(), None)
    # drop one token the full head emits at step 10 from an otherwise generous list
    listed = torch.tensor(sorted(set(range(60000)) | set(reference) | {151643, 151645}))
    listed = listed[listed != reference[10]]
    drafted = decode(vocab.sliced_lm_head(model, listed), listed)
    assert set(drafted) <= set(listed.tolist())
    first_out = next(i for i, t in enumerate(reference) if t not in set(listed.tolist()))
    assert drafted[:first_out] == reference[:first_out]
    assert drafted[first_out] != reference[first_out]
