"""The embedded engine: speculative decoding with a transformers causal LM, on CPU or CUDA (batch size 1).

Each verify step feeds the pending token (emitted, not yet in the KV cache) plus the proposal, scores all of them
in one forward pass, lets `hqlab.rules.verify` decide, and crops the KV cache back to what was accepted. The
same loop with an empty proposal is plain autoregressive decoding, so "no speculation" is the engine's own
reference output, not some other implementation's.
"""

from __future__ import annotations

import inspect
import time
from typing import Any, Sequence

import numpy as np
import torch

from hqlab.config import DecodeConfig
from hqlab.proposers.base import Proposal, Proposer, Source
from hqlab.proposers.none import NoProposer
from hqlab.rules.verify import greedy_verify, sample_verify, target_probs
from hqlab.trace import Generation, StepRecord


class PromptTooLongError(ValueError):
    pass


class TokenHistory:
    """prompt + emitted tokens in a preallocated int64 buffer, so proposers get a view, not a fresh copy."""

    def __init__(self, prompt_ids: Sequence[int], capacity: int) -> None:
        self.buf = np.zeros(max(capacity, len(prompt_ids) + 1), dtype=np.int64)
        self.n = len(prompt_ids)
        self.buf[: self.n] = prompt_ids

    def extend(self, tokens: Sequence[int]) -> None:
        m = len(tokens)
        if self.n + m > self.buf.shape[0]:
            self.buf = np.concatenate([self.buf, np.zeros(max(m, self.buf.shape[0]), dtype=np.int64)])
        self.buf[self.n : self.n + m] = tokens
        self.n += m

    def view(self) -> np.ndarray:
        return self.buf[: self.n]


def _new_cache(model: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _crop_to(cache: Any, length: int) -> None:
    """Drop rejected positions. A negative count means "remove that many" in every transformers 5.x release
    (older ones also took an absolute length, 5.24 refuses that)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


class HFEngine:
    name = "hf"

    def __init__(self, model: Any, tokenizer: Any, *, eos_token_ids: Sequence[int] | None = None,
                 max_context: int | None = None, info: Any = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.info = info
        self.device = next(model.parameters()).device
        if eos_token_ids is None:
            eos_token_ids = getattr(info, "eos_token_ids", None) or [tokenizer.eos_token_id]
        self.eos = frozenset(int(x) for x in eos_token_ids if x is not None)
        self.max_context = max_context or getattr(info, "max_context", None) or model.config.max_position_embeddings
        # transformers renamed the forward's `past_key_values` argument to `cache` (5.24); accept both releases.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @classmethod
    def load(cls, name: str | None = None, *, device: str = "auto", dtype: str = "auto") -> "HFEngine":
        from hqlab import models

        model, tokenizer, info = models.load(name or models.DEFAULT_MODEL, device=device, dtype=dtype)
        return cls(model, tokenizer, info=info)

    # ------------------------------------------------------------------------------------------------------------
    # prompts

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def check_fits(self, prompt_len: int, max_new_tokens: int, what: str = "prompt") -> None:
        if prompt_len + max_new_tokens > self.max_context:
            raise PromptTooLongError(
                f"{what} has {prompt_len} tokens; with max_new_tokens={max_new_tokens} that exceeds the model's "
                f"context of {self.max_context} tokens. Shorten the prompt (e.g. a smaller doc_tokens) or lower "
                f"max_new_tokens.")

    # ------------------------------------------------------------------------------------------------------------
    # decoding

    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int], proposer: Proposer | None = None,
                 decode: DecodeConfig = DecodeConfig(), request: str = "0") -> Generation:
        proposer = proposer or NoProposer()
        self.check_fits(len(prompt_ids), decode.max_new_tokens, f"request {request!r}")
        generator = None
        if not decode.greedy:
            generator = torch.Generator(device=self.device).manual_seed(decode.seed)
        history = TokenHistory(prompt_ids, len(prompt_ids) + decode.max_new_tokens + 1)
        cache = _new_cache(self.model)
        records: list[StepRecord] = []

        t0 = time.perf_counter()
        ids = torch.tensor([list(prompt_ids)], device=self.device)
        logits = self._forward(ids, cache, logits_to_keep=1)
        first, margins = self._choose(logits, Proposal.empty(), decode, generator)
        out: list[int] = first.emitted
        history.extend(out)
        ttft = t_last = time.perf_counter() - t0
        finish = "eos" if out[0] in self.eos else None

        while finish is None and len(out) < decode.max_new_tokens:
            ts = time.perf_counter()
            budget = decode.max_new_tokens - len(out) - 1  # more accepted tokens could not be emitted anyway
            proposal = proposer.propose([history.view()], [budget])[0].truncated(budget) if budget > 0 \
                else Proposal.empty()
            propose_s = time.perf_counter() - ts

            ctx = cache.get_seq_length()
            ids = torch.tensor([[out[-1], *proposal.tokens.tolist()]], device=self.device)
            logits = self._forward(ids, cache)
            verdict, step_margins = self._choose(logits, proposal, decode, generator)
            _crop_to(cache, ctx + 1 + verdict.accepted)

            kept: list[int] = []
            for tok in verdict.emitted:
                kept.append(tok)
                if tok in self.eos:
                    finish = "eos"
                    break
                if len(out) + len(kept) == decode.max_new_tokens:
                    break
            out.extend(kept)
            history.extend(kept)
            margins.extend(step_margins[: len(kept)])
            t_last = time.perf_counter() - t0
            records.append(StepRecord(
                request=request, step=len(records), context_len=ctx, verify_len=int(ids.shape[1]),
                proposed=proposal.tokens.tolist(), sources=proposal.sources.tolist(), match_len=proposal.match_len,
                accepted=min(verdict.accepted, len(kept) - 1), emitted=len(kept), step_s=time.perf_counter() - ts,
                propose_s=propose_s, t_end=t_last, block=proposer.k))

        total = time.perf_counter() - t0
        return Generation(request=request, prompt_len=len(prompt_ids), output_ids=out, finish=finish or "length",
                          ttft_s=ttft, total_s=total, t_last=t_last, records=records, margins=margins)

    def _forward(self, ids: torch.Tensor, cache: Any, **kwargs: Any) -> torch.Tensor:
        kwargs[self._cache_kw] = cache
        return self.model(input_ids=ids, use_cache=True, **kwargs).logits[0]

    def _choose(self, logits: torch.Tensor, proposal: Proposal, decode: DecodeConfig,
                generator: torch.Generator | None):
        """Verify `proposal` against `logits` [n + 1, V]; returns the verdict and greedy margins per row."""
        if decode.greedy:
            top = torch.topk(logits.float(), 2, dim=-1)
            argmax = top.indices[:, 0].tolist()
            margins = (top.values[:, 0] - top.values[:, 1]).tolist()
            return greedy_verify(proposal.tokens, argmax), margins
        p = target_probs(logits, decode.temperature, decode.top_k, decode.top_p)
        point_mass = proposal.sources != Source.DRAFT
        return sample_verify(proposal.tokens, p, generator, q=proposal.q, point_mass=point_mass), []

    # ------------------------------------------------------------------------------------------------------------
    # transformers' own generate, timed by the same harness

    @torch.inference_mode()
    def generate_hf(self, prompt_ids: Sequence[int], decode: DecodeConfig = DecodeConfig(), request: str = "0",
                    prompt_lookup_num_tokens: int | None = None) -> Generation:
        """`model.generate` (optionally with its prompt lookup), with a forward hook recording each verify step.

        The hook sees where each forward starts in the cache; the difference between consecutive starts is
        1 + the tokens accepted by the earlier step, so tokens/step is measured, not guessed.
        """
        if not decode.greedy:
            raise ValueError("generate_hf is used as a greedy baseline only")
        self.check_fits(len(prompt_ids), decode.max_new_tokens, f"request {request!r}")
        events: list[tuple[float, float, int, int]] = []  # (t_start, t_end, start_pos, n_inputs)
        pending: dict[str, Any] = {}

        def pre_hook(_module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            pkv = kwargs.get("cache", kwargs.get("past_key_values"))
            pending["start"] = pkv.get_seq_length() if pkv is not None else 0
            pending["n"] = int(ids.shape[1])
            pending["t"] = time.perf_counter()

        def post_hook(_module, _args, _kwargs, _output):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            events.append((pending["t"], time.perf_counter(), pending["start"], pending["n"]))

        h1 = self.model.register_forward_pre_hook(pre_hook, with_kwargs=True)
        h2 = self.model.register_forward_hook(post_hook, with_kwargs=True)
        try:
            t0 = time.perf_counter()
            ids = torch.tensor([list(prompt_ids)], device=self.device)
            kwargs: dict[str, Any] = dict(max_new_tokens=decode.max_new_tokens, do_sample=False,
                                          eos_token_id=sorted(self.eos), attention_mask=torch.ones_like(ids),
                                          pad_token_id=self.tokenizer.pad_token_id or sorted(self.eos)[0])
            if prompt_lookup_num_tokens:
                kwargs["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
            seq = self.model.generate(ids, **kwargs)[0].tolist()
            total = time.perf_counter() - t0
        finally:
            h1.remove()
            h2.remove()
        out = seq[len(prompt_ids):]
        finish = "eos" if out and out[-1] in self.eos else "length"
        starts = [e[2] for e in events[1:]] + [len(prompt_ids) + len(out) - 1]
        records = []
        emitted_so_far = 1
        for j, (ts, te, start, n) in enumerate(events[1:]):
            accepted = starts[j + 1] - start - 1
            emitted = min(accepted + 1, len(out) - emitted_so_far)
            emitted_so_far += emitted
            prev_end = events[j][1]
            records.append(StepRecord(
                request=request, step=j, context_len=start, verify_len=n, proposed=[], sources=[], match_len=0,
                accepted=accepted, emitted=emitted, step_s=te - prev_end, propose_s=ts - prev_end,
                t_end=te - t0, block=prompt_lookup_num_tokens or 0))
        ttft = events[0][1] - t0 if events else total
        t_last = records[-1].t_end if records else ttft
        return Generation(request=request, prompt_len=len(prompt_ids), output_ids=out, finish=finish,
                          ttft_s=ttft, total_s=total, t_last=t_last, records=records)
