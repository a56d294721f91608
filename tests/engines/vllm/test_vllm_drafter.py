"""The fused speculator's drafter (`hqlab.engines.vllm.drafter.StaticQwen2`) against transformers, on the CPU with the
real Qwen2.5-Coder-0.5B weights in float32 on both sides (logits agree to ~1e-6 of their scale, so only genuine ties
could flip a greedy token):

- one prefill `extend` gives transformers' logits and greedy token at the prompt's last position;
- prefix + chunks of 1, 3 and 16 tokens + single-token greedy decode reproduce transformers' greedy `generate`;
- a batch of rows for different slots, starts, `last` indices and padded query columns (whose K/V lands past a
  request's end and is overwritten by the next call) gives what each slot gives alone, and what transformers gives;
- speculative tokens fed and then rewritten from their first position leave no trace;
- an attention length larger than needed changes nothing;
- a folder that is missing or holds no Qwen2 model, and slots or max_len below 1, are refused with a clear message.

The real prompt is the `chat-blog` chat prompt (151 tokens; its greedy continuation has top-2 logit margins >= 0.49)
and the second text the first 120 tokens of the frozen document. Where a prompt position is a near tie, the checks
accept any token whose reference logit is within the tolerance of the best one.
"""

from __future__ import annotations

import dataclasses
import gc
import json
from pathlib import Path

import pytest
import torch

from hqlab import models
from hqlab.config import ConfigError
from hqlab.engines.vllm.drafter import StaticQwen2
from hqlab.workloads import encode_chat, load_workload, read_document

MODEL = "qwen2.5-coder-0.5b"
CHAT_ID = "chat-blog"
DOC_TOKENS = 120
DECODE = 10  # greedy steps after the prompt's own next token
SLOTS, MAX_LEN = 4, 256
VOCAB = 151_936
REL_TOL = 1e-4  # max |drafter - transformers| logit difference, relative to the row's largest |logit| (seen: 1e-6)
SAME_TOL = 2e-5  # the same computation in another batch shape or attention length (seen: 0 to 1e-6)


# --------------------------------------------------------------------------------------------------------------
# Reference side: transformers, float32
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Reference:
    chat: list[int]  # prompt + greedy continuation (DECODE + 1 tokens)
    prompt_len: int
    chat_logits: torch.Tensor  # [len(chat), vocab]: logits after each position of `chat`
    doc: list[int]
    doc_logits: torch.Tensor

    @property
    def generated(self) -> list[int]:
        return self.chat[self.prompt_len:]


@pytest.fixture(scope="module")
def folder() -> str:
    return models.prepare(MODEL)


@pytest.fixture(scope="module")
def reference(folder) -> Reference:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = next(p for p in load_workload("chat") if p.id == CHAT_ID)
    ids = encode_chat(tokenizer, prompt.messages)
    doc = tokenizer.encode(read_document(), add_special_tokens=False)[:DOC_TOKENS]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=DECODE + 1, do_sample=False)
        chat = out[0].tolist()
        chat_logits = model(torch.tensor([chat])).logits[0].float().clone()
        doc_logits = model(torch.tensor([doc])).logits[0].float().clone()
    del model
    gc.collect()
    assert len(chat) == len(ids) + DECODE + 1, "the greedy continuation stopped early: pick another prompt"
    assert len(chat) <= MAX_LEN and len(doc) == DOC_TOKENS
    # The continuation is no near tie: an exact greedy comparison with the drafter is meaningful.
    top2 = chat_logits[len(ids) - 1:-1].topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 0.1
    assert chat_logits[len(ids) - 1:-1].argmax(-1).tolist() == chat[len(ids):]
    return Reference(chat=chat, prompt_len=len(ids), chat_logits=chat_logits, doc=doc, doc_logits=doc_logits)


@pytest.fixture(scope="module")
def drafter(folder) -> StaticQwen2:
    return StaticQwen2.load(folder, slots=SLOTS, max_len=MAX_LEN, device="cpu", dtype=torch.float32)


# --------------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------------

_garbage = torch.Generator().manual_seed(7)


def feed(drafter: StaticQwen2, rows: list[tuple[int, list[int], int, int]], *, width: int, attn_len: int,
         what: str = "logits") -> torch.Tensor:
    """One call for rows (slot, real tokens, start, last): each row padded to `width` query columns with random
    tokens, as a caller with a fixed query length does."""
    tokens = torch.randint(0, VOCAB - 300, (len(rows), width), generator=_garbage, dtype=torch.int64)
    for r, (_, real, _, _) in enumerate(rows):
        assert len(real) <= width
        tokens[r, :len(real)] = torch.tensor(real, dtype=torch.int64)
    slots = torch.tensor([row[0] for row in rows], dtype=torch.int64)
    start = torch.tensor([row[2] for row in rows], dtype=torch.int64)
    last = torch.tensor([row[3] for row in rows], dtype=torch.int64)
    out = getattr(drafter, what)(slots, tokens, start, last, attn_len)
    if what == "logits":
        assert out.shape == (len(rows), VOCAB) and out.dtype == torch.float32
    else:
        assert out.shape == (len(rows),) and out.dtype == torch.int64
    return out


def assert_close_to(got: torch.Tensor, want: torch.Tensor, where: str, rel: float = REL_TOL) -> None:
    """Logits [vocab] within rel * (largest |logit|) of the reference everywhere."""
    diff = (got.float() - want).abs().max().item()
    scale = want.abs().max().item()
    assert diff <= rel * scale, f"{where}: max |logit diff| {diff:.3g} > {rel:g} * {scale:.3g}"


def assert_choice(token: int, want: torch.Tensor, where: str) -> None:
    """The greedy token is the reference's argmax, or (at a genuine near tie only) a token as good within tolerance."""
    best = int(want.argmax())
    tol = REL_TOL * want.abs().max().item()
    assert token == best or want[token] >= want[best] - tol, \
        f"{where}: drafter picks {token} (ref logit {want[token].item():.4f}), transformers {best} " \
        f"(ref logit {want[best].item():.4f})"


# --------------------------------------------------------------------------------------------------------------
# Real model
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_prefill_matches_transformers(drafter, reference):
    assert (drafter.slots, drafter.max_len) == (SLOTS, MAX_LEN)
    L = reference.prompt_len
    got = feed(drafter, [(0, reference.chat[:L], 0, L - 1)], width=L, attn_len=L)
    assert_close_to(got[0], reference.chat_logits[L - 1], "prompt's last position")
    assert int(got[0].argmax()) == reference.generated[0]
    # extend is the argmax of the same logits (the last token fed again: it rewrites identical K/V)
    token = feed(drafter, [(0, reference.chat[L - 1:L], L - 1, 0)], width=1, attn_len=L, what="extend")
    assert token.tolist() == [reference.generated[0]]


@pytest.mark.slow
def test_chunked_prefill_and_greedy_decode_equal_transformers_generate(drafter, reference):
    slot, L = 3, reference.prompt_len
    seq = reference.chat
    pos = L - 40
    first = feed(drafter, [(slot, seq[:pos], 0, pos - 1)], width=pos, attn_len=pos, what="extend")
    assert_choice(int(first[0]), reference.chat_logits[pos - 1], f"prefix of {pos}")
    sizes = [1, 3, 16]
    i = 0
    while pos < L:
        q = min(sizes[i % len(sizes)], L - pos)
        # attention length exactly what is needed, then the whole cache, alternately
        attn = pos + q if i % 2 == 0 else MAX_LEN
        token = feed(drafter, [(slot, seq[pos:pos + q], pos, q - 1)], width=q, attn_len=attn, what="extend")
        assert_choice(int(token[0]), reference.chat_logits[pos + q - 1], f"chunk of {q} at {pos}")
        pos += q
        i += 1
    assert int(token[0]) == reference.generated[0]
    drafted = [int(token[0])]
    for step in range(DECODE):
        token = feed(drafter, [(slot, [drafted[-1]], L + step, 0)], width=1, attn_len=L + step + 1, what="extend")
        drafted.append(int(token[0]))
    assert drafted == reference.generated


@pytest.mark.slow
def test_batched_slots_with_padding_equal_each_slot_alone(drafter, reference):
    """Rows in non-slot order, different starts, lengths and `last`; pad columns write K/V past each row's end,
    which the next call overwrites from the true length."""
    x, y = reference.chat, reference.doc
    xl, yl = reference.chat_logits, reference.doc_logits

    def check(got, expected):
        for r, (logits_ref, p, name) in enumerate(expected):
            assert_close_to(got[r], logits_ref[p], f"row {r} ({name} at position {p})")
            assert_choice(int(got[r].argmax()), logits_ref[p], f"row {r} ({name} at position {p})")

    # 1: prefills, two of them padded (slot 0: 30 real tokens of 48; slot 1: 10 of 48)
    got = feed(drafter, [(2, x[:48], 0, 47), (0, y[:30], 0, 29), (1, x[:10], 0, 9)], width=48, attn_len=48)
    check(got, [(xl, 47, "chat"), (yl, 29, "doc"), (xl, 9, "chat")])
    # 2: slot 0 continues over its padding; slot 1 feeds 5 real tokens + 11 pads; slot 2 asks for an inner index
    got = feed(drafter, [(0, y[30:46], 30, 15), (1, x[10:15], 10, 4), (2, x[48:51], 48, 0)], width=16, attn_len=64)
    check(got, [(yl, 45, "doc"), (xl, 14, "chat"), (xl, 48, "chat")])
    # 3: every slot resumes from its true length; the cache past it still holds pad K/V
    rows = [(1, x[15:18], 15, 2), (2, x[49:52], 49, 1), (0, y[46:49], 46, 2)]
    batched = feed(drafter, rows, width=3, attn_len=MAX_LEN)
    check(batched, [(xl, 17, "chat"), (xl, 50, "chat"), (yl, 48, "doc")])
    # each row alone (rewriting the same K/V) gives what the batch gave
    for r, row in enumerate(rows):
        alone = feed(drafter, [row], width=3, attn_len=MAX_LEN)
        assert_close_to(alone[0], batched[r], f"row {r} alone", rel=SAME_TOL)


@pytest.mark.slow
def test_rewritten_speculation_leaves_no_trace(drafter, reference):
    x, xl = reference.chat, reference.chat_logits
    p = 24
    wrong = [x[p], x[p + 1], 11, 22, 33, 44]  # two right, then four wrong drafts
    feed(drafter, [(1, x[:p], 0, p - 1), (2, x[:p], 0, p - 1)], width=p, attn_len=p, what="extend")
    # slot 1 sees speculative tokens at p..p+5 first; slot 2 never does
    feed(drafter, [(1, wrong, p, 5)], width=6, attn_len=p + 6, what="extend")
    spec = feed(drafter, [(1, x[p:p + 4], p, 3)], width=4, attn_len=p + 6)
    clean = feed(drafter, [(2, x[p:p + 4], p, 3)], width=4, attn_len=p + 6)
    assert_close_to(spec[0], clean[0], "rewritten from p vs never speculated", rel=SAME_TOL)
    assert_close_to(spec[0], xl[p + 3], "rewritten from p vs transformers")
    # accept the first four, speculate past them again, reject all of it
    feed(drafter, [(1, [x[p + 4], 55, 66, 77, 88, 99], p + 4, 5)], width=6, attn_len=p + 10, what="extend")
    spec = feed(drafter, [(1, x[p + 4:p + 5], p + 4, 0)], width=1, attn_len=p + 10)
    clean = feed(drafter, [(2, x[p + 4:p + 5], p + 4, 0)], width=1, attn_len=p + 10)
    assert_close_to(spec[0], clean[0], "second rewrite vs never speculated", rel=SAME_TOL)
    assert_close_to(spec[0], xl[p + 4], "second rewrite vs transformers")


@pytest.mark.slow
def test_larger_attention_length_changes_nothing(drafter, reference):
    y, yl = reference.doc, reference.doc_logits
    exact = feed(drafter, [(0, y[:24], 0, 23)], width=24, attn_len=24)
    wide = feed(drafter, [(3, y[:24], 0, 23)], width=24, attn_len=MAX_LEN)
    assert_close_to(wide[0], exact[0], "prefill, attn_len max_len vs exact", rel=SAME_TOL)
    exact = feed(drafter, [(0, y[24:28], 24, 3)], width=4, attn_len=28)
    wide = feed(drafter, [(3, y[24:28], 24, 3)], width=4, attn_len=100)
    assert_close_to(wide[0], exact[0], "extend, attn_len 100 vs exact", rel=SAME_TOL)
    assert_close_to(exact[0], yl[27], "extend vs transformers")


# --------------------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------------------

REFUSED = (ValueError, RuntimeError, OSError)  # ConfigError, ModelError, FileNotFoundError...: not KeyError & co.


def test_load_refuses_a_missing_or_empty_folder(tmp_path):
    for target in (tmp_path / "absent", tmp_path):
        with pytest.raises(REFUSED) as err:
            StaticQwen2.load(target, slots=2, max_len=16)
        assert str(target) in str(err.value)


def _config(folder: Path, model_type: str, architecture: str) -> None:
    """A config.json with the 0.5B's shape under the given model type."""
    config = {"architectures": [architecture], "model_type": model_type, "hidden_size": 896, "intermediate_size": 4864,
              "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "vocab_size": VOCAB,
              "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))


def test_load_refuses_other_architectures(tmp_path):
    _config(tmp_path, "llama", "LlamaForCausalLM")
    with pytest.raises(REFUSED) as err:
        StaticQwen2.load(tmp_path, slots=2, max_len=16)
    message = str(err.value)
    assert "qwen2" in message.lower() and "llama" in message.lower(), message


def test_load_refuses_a_folder_without_weights(tmp_path):
    _config(tmp_path, "qwen2", "Qwen2ForCausalLM")
    with pytest.raises(REFUSED) as err:
        StaticQwen2.load(tmp_path, slots=2, max_len=16)
    assert str(tmp_path) in str(err.value) and "safetensors" in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize("slots, max_len, named", [(0, 16, "slots"), (-1, 16, "slots"), (2, 0, "max_len")])
def test_slots_and_max_len_below_one_are_refused(folder, slots, max_len, named):
    with pytest.raises((ValueError, ConfigError), match=named):
        StaticQwen2.load(folder, slots=slots, max_len=max_len, dtype=torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's FlashAttention needs a CUDA device")
def test_flash_attention_path_equals_the_masked_sdpa_path_on_the_gpu(folder, reference):
    """The paged FlashAttention path (the GPU default) against the masked-sdpa path, both bf16 on the GPU: the same
    greedy continuation and close logits over prefill, chunks, padded batch rows and decode."""
    flash = StaticQwen2.load(folder, slots=SLOTS, max_len=MAX_LEN, device="cuda", attention="flash")
    sdpa = StaticQwen2.load(folder, slots=SLOTS, max_len=MAX_LEN, device="cuda", attention="sdpa")
    chat = torch.tensor(reference.chat, device="cuda")
    p = reference.prompt_len
    for d in (flash, sdpa):  # the prompt in two chunks, into slot 2 (slot 0 gets a padded row alongside)
        d.extend(torch.tensor([2], device="cuda"), chat[None, :p - 7], torch.tensor([0], device="cuda"),
                 torch.tensor([p - 8], device="cuda"), MAX_LEN)
    rows = torch.tensor([2, 0], device="cuda")
    tokens = torch.stack([chat[p - 7:p + 9], chat[:16]])
    starts = torch.tensor([p - 7, 0], device="cuda")
    last = torch.tensor([6, 15], device="cuda")
    a = flash.logits(rows, tokens, starts, last, MAX_LEN)
    b = sdpa.logits(rows, tokens, starts, last, MAX_LEN)
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert (a.float() - b.float()).abs().max() < 0.05 * b.float().abs().max()
    got = []
    t = a.argmax(-1)[:1]
    for j in range(DECODE):  # greedy decode of slot 2 from the prompt's end
        t = flash.extend(rows[:1], t[:, None], torch.tensor([p + j], device="cuda"), torch.zeros(1, dtype=torch.long,
                                                                                                   device="cuda"),
                         MAX_LEN)
        got.append(int(t))
    want = []
    t = b.argmax(-1)[:1]
    for j in range(DECODE):
        t = sdpa.extend(rows[:1], t[:, None], torch.tensor([p + j], device="cuda"), torch.zeros(1, dtype=torch.long,
                                                                                                  device="cuda"),
                        MAX_LEN)
        want.append(int(t))
    assert got == want
