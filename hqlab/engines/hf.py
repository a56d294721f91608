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
from hqlab.models.kv import RaggedCache
from hqlab.proposers.base import Proposal, Proposer
from hqlab.proposers.none import NoProposer
from hqlab.rules.verify import greedy_verify, sample_verify, target_probs
from hqlab.trace import Generation, StepRecord, budget, step_record
from hqlab.workloads import encode_chat


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


class _Request:
    """One request's running state inside `generate_batch`."""

    def __init__(self, index: int, name: str, prompt_ids: Sequence[int], decode: DecodeConfig,
                 device: torch.device) -> None:
        self.index, self.name, self.prompt_len = index, name, len(prompt_ids)
        self.t0 = time.perf_counter()
        self.generator = None
        if not decode.greedy:  # one stream per request, so its samples do not depend on its neighbours
            self.generator = torch.Generator(device=device).manual_seed(decode.seed + index)
        self.history = TokenHistory(prompt_ids, len(prompt_ids) + decode.max_new_tokens + 1)
        self.out: list[int] = []
        self.margins: list[float] = []
        self.records: list[StepRecord] = []
        self.finish: str | None = None
        self.ttft = self.t_last = 0.0

    def emit(self, tokens: Sequence[int], margins: Sequence[float], eos: frozenset, limit: int) -> int:
        """Append the verdict's tokens up to an EOS or the length limit; returns how many were kept."""
        kept: list[int] = []
        for tok in tokens:
            kept.append(tok)
            if tok in eos:
                self.finish = "eos"
                break
            if len(self.out) + len(kept) == limit:
                self.finish = "length"
                break
        self.out.extend(kept)
        self.history.extend(kept)
        self.margins.extend(margins[: len(kept)])
        return len(kept)

    def result(self) -> Generation:
        return Generation(request=self.name, prompt_len=self.prompt_len, output_ids=self.out,
                          finish=self.finish or "length", ttft_s=self.ttft, total_s=time.perf_counter() - self.t0,
                          t_last=self.t_last, records=self.records, margins=self.margins)


class HFEngine:
    """The transformers engine (an `hqlab.engines.Engine`)."""

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
        self._calls = 0

    @classmethod
    def load(cls, name: str | None = None, *, device: str = "auto", dtype: str = "auto") -> "HFEngine":
        from hqlab import models

        model, tokenizer, info = models.load(name or models.DEFAULT_MODEL, device=device, dtype=dtype)
        return cls(model, tokenizer, info=info)

    # ------------------------------------------------------------------------------------------------------------
    # prompts

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """`hqlab.workloads.encode_chat` with this engine's tokenizer."""
        return encode_chat(self.tokenizer, messages)

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
        """One request alone (batch size 1): `generate_batch` with a single prompt."""
        return self.generate_batch([prompt_ids], proposer, decode, requests=[request], max_batch=1)[0]

    @torch.inference_mode()
    def generate_batch(self, prompts: Sequence[Sequence[int]], proposer: Proposer | None = None,
                       decode: DecodeConfig = DecodeConfig(), *, requests: Sequence[str] | None = None,
                       max_batch: int = 4) -> list[Generation]:
        """Decode several requests concurrently (up to `max_batch` at a time, the rest wait for a free slot).

        Every request keeps its own verify length each step: the proposer (and its scheduler) decides per request
        from that request's history alone, and a shorter block is padded and masked, never lengthened. So a
        request's tokens do not depend on which other requests share the batch (up to floating-point rounding of
        the batched matmuls, which the lossless checks report as near-tie flips).
        """
        proposer = proposer or NoProposer()
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 (got {max_batch})")
        requests = [str(i) for i in range(len(prompts))] if requests is None else [str(r) for r in requests]
        if len(requests) != len(prompts) or len(set(requests)) != len(requests):
            raise ValueError("requests must name every prompt once, with distinct names")
        for ids, name in zip(prompts, requests):
            self.check_fits(len(ids), decode.max_new_tokens, f"request {name!r}")

        self._calls += 1
        kv = RaggedCache(self.model, self._cache_kw)
        waiting = list(range(len(prompts)))
        active: list[_Request] = []
        done: dict[int, Generation] = {}

        def retire() -> None:  # finished requests leave the batch at once, so their time stops counting
            nonlocal active
            finished = [j for j, r in enumerate(active) if r.finish is not None]
            if finished:
                for j in finished:
                    done[active[j].index] = active[j].result()
                kv.keep_rows([j for j in range(len(active)) if j not in finished])
                active = [r for r in active if r.finish is None]

        while waiting or active:
            while waiting and len(active) < max_batch:  # admit: prefill alone, then join the batch
                i = waiting.pop(0)
                r = _Request(i, requests[i], prompts[i], decode, self.device)
                r.key = f"{self._calls}:{r.name}"  # a fresh key per call: no proposer state leaks between runs
                first, margins = self._choose(kv.add(list(prompts[i])), Proposal.empty(), decode, r.generator)
                r.emit(first.emitted, margins, self.eos, decode.max_new_tokens)
                r.ttft = r.t_last = time.perf_counter() - r.t0
                active.append(r)
                retire()
            if not active:
                continue

            ts = time.perf_counter()
            budgets = [budget(decode.max_new_tokens, len(r.out)) for r in active]  # more could not be emitted
            proposals = proposer.propose([r.history.view() for r in active], budgets, keys=[r.key for r in active])
            proposals = [p.truncated(b) for p, b in zip(proposals, budgets)]
            propose_s = time.perf_counter() - ts

            contexts = list(kv.lengths)
            blocks = [[r.out[-1], *p.tokens.tolist()] for r, p in zip(active, proposals)]
            logits = kv.forward(blocks)
            verdicts = [self._choose(logits[b, : len(blocks[b])], p, decode, r.generator)
                        for b, (r, p) in enumerate(zip(active, proposals))]
            kv.keep([1 + v.accepted for v, _ in verdicts])
            t_end = time.perf_counter()
            for b, (r, p, (verdict, margins)) in enumerate(zip(active, proposals, verdicts)):
                kept = r.emit(verdict.emitted, margins, self.eos, decode.max_new_tokens)
                r.t_last = t_end - r.t0
                r.records.append(step_record(
                    r.name, len(r.records), context_len=contexts[b], proposal=p, block=proposer.k,
                    verify_len=len(blocks[b]), accepted=min(verdict.accepted, kept - 1), emitted=kept,
                    step_s=t_end - ts, propose_s=propose_s, t_end=r.t_last, batch=len(active)))
            retire()
        return [done[i] for i in range(len(prompts))]

    def _choose(self, logits: torch.Tensor, proposal: Proposal, decode: DecodeConfig,
                generator: torch.Generator | None):
        """Verify `proposal` against `logits` [n + 1, V]; returns the verdict and greedy margins per row."""
        if decode.greedy:
            top = torch.topk(logits.float(), 2, dim=-1)
            argmax = top.indices[:, 0].tolist()
            margins = (top.values[:, 0] - top.values[:, 1]).tolist()
            return greedy_verify(proposal.tokens, argmax), margins
        p = target_probs(logits, decode.temperature, decode.top_k, decode.top_p)
        point_mass = proposal.point_mass()
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
            records.append(step_record(
                request, j, context_len=start, verify_len=n, accepted=accepted, emitted=emitted,
                step_s=te - prev_end, propose_s=ts - prev_end, t_end=te - t0, block=prompt_lookup_num_tokens or 0))
        ttft = events[0][1] - t0 if events else total
        t_last = records[-1].t_end if records else ttft
        return Generation(request=request, prompt_len=len(prompt_ids), output_ids=out, finish=finish,
                          ttft_s=ttft, total_s=total, t_last=t_last, records=records)
