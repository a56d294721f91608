"""Other systems' proposers behind hqlab's `Proposer` protocol, so the replay runs them on the same traces.

Optional extras, imported when a proposer is built (never at import time; a missing one is a clear error):
vLLM installs on a CPU machine with `pip install --no-deps vllm==0.26.0` plus its light import-time packages
(docs/replay-and-cost.md lists them); Arctic Inference is built from source by `make arctic`.

- `vllm-ngram` (vLLM's `NgramProposer`, v1 spec decode): Numba KMP over the reversed context every step; the
  longest n-gram in [nmin, nmax] ending the history, earliest occurrence; up to k following tokens. Built with a
  stand-in config carrying only the fields it reads, so no engine (and no GPU) is needed.
- `arctic-suffix` (Arctic Inference's `SuffixDecodingCache`): a suffix tree per request over prompt and output,
  updated incrementally; the continuation is chosen by estimated frequency (tokens with probability below
  `min_prob` are cut, and at most `factor` × match length + `offset` tokens are proposed). `cached` > 0 also keeps
  finished requests' outputs in a global tree shared by later requests (Arctic's cross-request cache; off by
  default so every request is judged on its own context, like the other proposers here).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import numpy as np

from hqlab.config import ConfigError
from hqlab.proposers.base import Proposal, Source


def _extra(module: str, what: str, how: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{what} needs an optional extra that is not installed ({e}); {how}") from None


@dataclass(frozen=True)
class VllmNgramConfig:
    nmin: int = 5
    nmax: int = 5
    k: int = 5
    max_model_len: int = 32768  # vLLM proposes nothing past the model's context

    def __post_init__(self) -> None:
        if not 1 <= self.nmin <= self.nmax:
            raise ConfigError(f"vllm-ngram: need 1 <= nmin <= nmax (got nmin={self.nmin}, nmax={self.nmax})")
        if self.k < 1:
            raise ConfigError(f"vllm-ngram: k must be >= 1 (got {self.k})")
        if self.max_model_len < 2:
            raise ConfigError(f"vllm-ngram: max_model_len must be >= 2 (got {self.max_model_len})")


class VllmNgramProposer:
    name: ClassVar[str] = "vllm-ngram"
    Config = VllmNgramConfig
    BATCH = 64  # rows of vLLM's preallocated draft buffers; larger batches are proposed in chunks

    def __init__(self, config: VllmNgramConfig | None = None) -> None:
        self.config = config or VllmNgramConfig()
        self.k = self.config.k
        module = _extra("vllm.v1.spec_decode.ngram_proposer", "the vllm-ngram proposer",
                        "install vllm==0.26.0 with --no-deps and its light packages (docs/replay-and-cost.md)")
        c = self.config
        ns = types.SimpleNamespace
        stand_in = ns(speculative_config=ns(prompt_lookup_min=c.nmin, prompt_lookup_max=c.nmax,
                                            num_speculative_tokens=c.k),
                      model_config=ns(max_model_len=c.max_model_len),
                      scheduler_config=ns(max_num_seqs=self.BATCH), parallel_config=ns(tensor_parallel_size=1))
        self.impl = module.NgramProposer(stand_in)  # compiles its Numba kernel (about a second, once per process)

    def propose(self, histories: Sequence[np.ndarray], budgets: Sequence[int],
                keys: Sequence[str] | None = None) -> list[Proposal]:
        out: list[Proposal] = []
        for at in range(0, len(histories), self.BATCH):
            out += self._propose_chunk(histories[at : at + self.BATCH], budgets[at : at + self.BATCH])
        return out

    def _propose_chunk(self, histories: Sequence[np.ndarray], budgets: Sequence[int]) -> list[Proposal]:
        lens = np.array([len(h) for h in histories], dtype=np.int32)
        tokens = np.zeros((len(histories), max(int(lens.max(initial=0)), 1)), dtype=np.int32)
        for i, h in enumerate(histories):
            tokens[i, : lens[i]] = np.asarray(h)
        # vLLM proposes for requests that sampled a token last step; the engine asks only for those.
        sampled = [[int(h[-1])] if len(h) else [] for h in histories]
        drafts = self.impl.propose(self.k, sampled, lens, tokens)
        out = []
        for draft, budget in zip(drafts, budgets):
            n = max(0, min(len(draft), int(budget)))
            out.append(Proposal(np.asarray(draft[:n], dtype=np.int64), np.full(n, Source.LOOKUP, dtype=np.int8)))
        return out


@dataclass(frozen=True)
class ArcticSuffixConfig:
    k: int = 16  # most tokens proposed per step
    depth: int = 24  # suffix tree depth: the longest context match and continuation considered (vLLM's default)
    factor: float = 1.0  # at most factor × match length + offset tokens
    offset: float = 0.0
    min_prob: float = 0.1  # cut the continuation where a token's estimated probability falls below this
    cached: int = 0  # finished requests kept in the global tree (0 = none, -1 = unlimited)

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ConfigError(f"arctic-suffix: k must be >= 1 (got {self.k})")
        if self.depth < 1:
            raise ConfigError(f"arctic-suffix: depth must be >= 1 (got {self.depth})")
        if not 0.0 <= self.min_prob <= 1.0:
            raise ConfigError(f"arctic-suffix: min_prob must be in [0, 1] (got {self.min_prob})")
        if self.factor < 0 or self.offset < 0:
            raise ConfigError("arctic-suffix: factor and offset must be >= 0")
        if self.cached < -1:
            raise ConfigError(f"arctic-suffix: cached must be >= -1 (got {self.cached})")


class ArcticSuffixProposer:
    """Keeps one Arctic request per key: the tree is started from the first history seen (all but its last
    token as the prompt, the last as the first output token: the engine's first step comes after prefill) and
    extended by the tokens each later history adds. A key whose history does not extend the last one seen is
    restarted; keys absent from a call are finished requests (the protocol's rule) and are stopped."""

    name: ClassVar[str] = "arctic-suffix"
    Config = ArcticSuffixConfig

    def __init__(self, config: ArcticSuffixConfig | None = None) -> None:
        self.config = config or ArcticSuffixConfig()
        self.k = self.config.k
        module = _extra("arctic_inference.suffix_decoding", "the arctic-suffix proposer", "build it with `make arctic`")
        self.cache = module.SuffixDecodingCache(max_tree_depth=self.config.depth,
                                                max_cached_requests=self.config.cached)
        self._seen: dict[str, tuple[int, int]] = {}  # key -> (tokens in the tree, last of them)

    def propose(self, histories: Sequence[np.ndarray], budgets: Sequence[int],
                keys: Sequence[str] | None = None) -> list[Proposal]:
        keys = [str(i) for i in range(len(histories))] if keys is None else [str(k) for k in keys]
        for gone in set(self._seen) - set(keys):
            self._stop(gone)
        c = self.config
        out = []
        for key, history, budget in zip(keys, histories, budgets):
            h = np.asarray(history, dtype=np.int32)
            self._sync(key, h)
            n = min(c.k, int(budget))
            if n <= 0 or h.size == 0:
                out.append(Proposal.empty())
                continue
            draft = self.cache.speculate(key, h[-c.depth :], max_spec_tokens=n, max_spec_factor=c.factor,
                                         max_spec_offset=c.offset, min_token_prob=c.min_prob, use_tree_spec=False)
            tokens = np.asarray(draft.token_ids[:n], dtype=np.int64)
            out.append(Proposal(tokens, np.full(tokens.size, Source.LOOKUP, dtype=np.int8), int(draft.match_len),
                                extra={"score": float(draft.score)}))
        return out

    def _sync(self, key: str, h: np.ndarray) -> None:
        seen = self._seen.get(key)
        if seen is not None and (h.size < seen[0] or seen[0] == 0 or int(h[seen[0] - 1]) != seen[1]):
            self._stop(key)
            seen = None
        if seen is None:
            self.cache.start_request(key, h[:-1])
            if h.size:
                self.cache.add_active_response(key, h[-1:])
        elif h.size > seen[0]:
            self.cache.add_active_response(key, h[seen[0] :])
        self._seen[key] = (int(h.size), int(h[-1]) if h.size else -1)

    def _stop(self, key: str) -> None:
        self._seen.pop(key, None)
        if key in self.cache.active_requests:
            self.cache.stop_request(key)
