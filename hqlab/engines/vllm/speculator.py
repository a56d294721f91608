"""What hqlab's speculators inside vLLM share: the `additional_config` keys that carry a spec and its options, reading
the spec and the pad token from vLLM's config, recognising a `custom_class` config, the checks every GPU speculator
makes when vLLM builds it, binding vLLM's request histories, and the ring of per-step records kept on the GPU.

Used by the host-side `custom_class` adapter (`adapter`), the GPU lookup (`gpu_lookup`) and the fused drafter
(`gpu_fused`); it imports none of them. Nothing here imports vLLM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from hqlab.config import ConfigError, parse_spec

SPEC_KEY = "hqlab_proposer"  # additional_config key holding the hqlab spec (adapter and GPU speculators alike)
RECORD_KEY = "hqlab_record"  # additional_config key: keep per-step records for `take_records`
PAD_KEY = "hqlab_pad_token"  # additional_config key: override the pad token id
ENV_VAR = "HQLAB_VLLM_PROPOSER"  # the spec when additional_config has none


def proposer_spec(vllm_config: Any) -> str:
    """The hqlab spec for this vLLM config: additional_config first, then the environment."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    spec = extra.get(SPEC_KEY) if isinstance(extra, dict) else None
    if spec is None:
        spec = os.environ.get(ENV_VAR)
    if not spec or not str(spec).strip():
        raise ConfigError(f"no hqlab proposer given to vLLM's custom_class hook: pass "
                          f"additional_config={{'{SPEC_KEY}': 'lookup:nmin=6,nmax=12,k=15'}} to vllm.LLM, or set "
                          f"{ENV_VAR}")
    return str(spec).strip()


def recording(vllm_config: Any) -> bool:
    """Whether the config asks for step records (`additional_config[RECORD_KEY]`)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    return bool(extra.get(RECORD_KEY, False)) if isinstance(extra, dict) else False


def is_custom_class(speculative_config: Any, class_path: str) -> bool:
    """True for a vLLM SpeculativeConfig (or dict) whose `custom_class` is `class_path`."""
    if speculative_config is None:
        return False
    get = speculative_config.get if isinstance(speculative_config, dict) else (
        lambda key: getattr(speculative_config, key, None))
    return get("method") == "custom_class" and get("model") == class_path


def custom_class_config(class_path: str, k: int, widths: str = "", *, plain_steps: bool = False) -> dict[str, Any]:
    """vLLM's `speculative_config` for an hqlab GPU speculator: vLLM's `custom_class` method naming its class, k
    draft positions verified every step, or with a `batch_k` value (`widths`) as many as vLLM's scheduler looks up
    for the step's batch size; `plain_steps` adds a width-0 range for the speculation gate (`batch_k`)."""
    from hqlab.engines.vllm import batch_k

    return batch_k.with_schedule({"method": "custom_class", "model": class_path, "num_speculative_tokens": k},
                                 widths, k, plain_steps=plain_steps)


def pad_token(vllm_config: Any) -> int:
    """The token id written where nothing is proposed: `additional_config[PAD_KEY]`, else the last vocabulary row."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    vocab = int(vllm_config.model_config.get_vocab_size())
    pad = int(extra.get(PAD_KEY, vocab - 1))
    if not 0 <= pad < vocab:
        raise ConfigError(f"{PAD_KEY} must be a token id in [0, {vocab}) (got {pad})")
    return pad


@dataclass(frozen=True)
class Retired:
    """A spec key a speculator no longer takes: why it went and what to use instead. `keeps`: the one value that
    names what runs now, still accepted (and dropped) so that a spec naming it parses; "" where none does."""

    why: str
    instead: str
    keeps: str = ""


def refuse_retired(spec: str, retired: dict[str, Retired], name: str) -> str:
    """`spec` without the retired keys it names at their `keeps` value; ConfigError, saying why the key went and what
    to use instead, for a retired key at any other value."""
    head, values = parse_spec(spec)
    for key, value in values.items():
        gone = retired.get(key)
        if gone is not None and value.lower() != gone.keeps:
            raise ConfigError(f"{name}: '{key}' was retired ({gone.why}); {gone.instead} (docs/journal/ has the "
                              f"measurements, git history the code)")
    kept = [f"{k}={v}" for k, v in values.items() if k not in retired]
    return f"{head}:{','.join(kept)}" if kept else head


def gpu_spec(vllm_config: Any, device: Any, class_path: str, parse: Callable[[str], Any]) -> tuple[str, Any]:
    """(spec, its config) for a GPU speculator vLLM is building. Refuses a build by vLLM's V1 runner (which passes no
    device: the plugin is not active) and a config whose k is not vLLM's num_speculative_tokens."""
    if device is None:  # vLLM's V1 runner builds custom_class proposers with the config alone
        raise ConfigError(
            f"{class_path} runs inside vLLM's model runner V2, but vLLM built it as a V1 custom_class proposer: "
            "the hqlab vLLM plugin is not active (install hqlab with its vllm extra in the environment vLLM runs "
            "in, leave VLLM_PLUGINS unset or include 'hqlab', and do not set VLLM_USE_V2_MODEL_RUNNER=0), or "
            "this vLLM version is not the one the plugin was built for (see hqlab.engines.vllm.plugin)")
    spec = proposer_spec(vllm_config)
    config = parse(spec)
    slots = int(vllm_config.speculative_config.num_speculative_tokens)
    if config.k != slots:
        raise ConfigError(f"{spec!r} verifies k={config.k} positions but vLLM's num_speculative_tokens is {slots}; "
                          f"make them equal ({class_path.rpartition('.')[0]}.speculative_config does)")
    return spec, config


@dataclass
class RequestState:
    """The slices of vLLM's request state a GPU speculator reads (bound by the plugin when vLLM loads the model)."""

    all_token_ids: torch.Tensor  # [max_num_reqs, max_model_len] int32, prompt + output per request slot
    total_len: torch.Tensor  # [max_num_reqs] int32, tokens in each slot's history


def bind_histories(all_token_ids: torch.Tensor, total_len: torch.Tensor, max_num_reqs: int,
                   device: torch.device) -> tuple[RequestState, torch.Tensor]:
    """vLLM's histories checked, and each slot's offset into them flattened (what the suffix-match kernel takes)."""
    if all_token_ids.dtype != torch.int32 or all_token_ids.dim() != 2 or not all_token_ids.is_contiguous():
        raise TypeError(f"all_token_ids must be a contiguous 2-D int32 tensor, got {all_token_ids.dtype} "
                        f"{tuple(all_token_ids.shape)}")
    if all_token_ids.shape[0] < max_num_reqs or total_len.shape[0] < max_num_reqs:
        raise ValueError(f"vLLM's request state holds {all_token_ids.shape[0]} slots, fewer than max_num_seqs "
                         f"{max_num_reqs}")
    width = all_token_ids.shape[1]
    offsets = torch.arange(all_token_ids.shape[0], dtype=torch.int64, device=device) * width
    return RequestState(all_token_ids, total_len), offsets


class RecordRing:
    """The bookkeeping of per-step records kept on the GPU (no host read while decoding), read back in one copy.

    A subclass's `write` runs on the device only and takes its ring slot from `next_slot` (a device counter, so it
    can be captured in a CUDA graph); `note` keeps the host half of the same step (request ids, host time). Every
    `write` is followed by one `note`, so the n-th noted step sits in slot n mod capacity."""

    def __init__(self, capacity: int, device: torch.device | str) -> None:
        self.capacity = int(capacity)
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)  # steps written, on the device
        self.steps: list[tuple[int, list[str], float]] = []  # (ring slot, request ids, host seconds)
        self.count = 0  # steps noted, on the host

    def next_slot(self) -> torch.Tensor:
        """This write's ring slot (a device tensor); advances the device counter."""
        slot = self.counter.remainder(self.capacity)
        self.counter += 1
        return slot

    def note(self, req_ids: list[str], host_s: float) -> None:
        self.steps.append((self.count % self.capacity, list(req_ids), host_s))
        self.count += 1

    def restart(self) -> None:
        """Forget everything (after warm-up and graph capture, which write without a step to note)."""
        self.counter.zero_()
        self.steps, self.count = [], 0

    def drain(self) -> list[tuple[int, list[str], float]]:
        """The steps noted since the last call (clears them); refuses if the ring overwrote some of them."""
        steps, self.steps = self.steps, []
        if len(steps) > self.capacity:
            raise RuntimeError(f"{len(steps)} steps were drafted since the records were last taken but only "
                               f"{self.capacity} fit: take them more often (after each request)")
        return steps


__all__ = ["SPEC_KEY", "RECORD_KEY", "PAD_KEY", "ENV_VAR", "proposer_spec", "recording", "is_custom_class",
           "pad_token", "Retired", "refuse_retired", "gpu_spec", "RequestState", "bind_histories", "RecordRing"]


class V2Speculator:
    """vLLM 0.26's V2 runner calls `propose` with a dozen arguments (hidden states, attention metadata, sampling
    state) that EAGLE-style speculators need; hqlab's read vLLM's histories instead, so they implement the narrow
    `draft(input_batch, num_sampled, dummy_run)` and this class takes vLLM's call."""

    k: int
    k_table: list[int] | None  # the width forecast by batch size (`batch_k`); None: always k
    # The width vLLM's scheduler fixed for the step that verifies this step's drafts (the scheduler output's
    # `num_spec_tokens_to_schedule`), handed over by the plugin before each step; None where no scheduler runs.
    scheduled_width: int | None = None

    def next_width(self, batch: int) -> int:
        """How many of this step's drafts the next step verifies: the scheduler's own width where the plugin handed
        it over (exact, whoever chose it: `batch_k`, the gate, goodput), else the forecast from the width table by
        this step's batch size (exact for `batch_k`, whose width vLLM looks up by the same batch size)."""
        if self.scheduled_width is not None:
            return self.scheduled_width
        from hqlab.engines.vllm import batch_k

        return batch_k.next_k(self.k_table, batch, self.k)

    def propose(self, input_batch: Any, attn_metadata: Any = None, slot_mappings: Any = None,
                last_hidden_states: Any = None, aux_hidden_states: Any = None, num_sampled: Any = None,
                num_rejected: Any = None, last_sampled: Any = None, next_prefill_tokens: Any = None,
                temperature: Any = None, seeds: Any = None, num_tokens_across_dp: Any = None, dummy_run: bool = False,
                skip_attn_for_dummy_run: bool = False, mm_inputs: Any = None, is_profile: bool = False) -> torch.Tensor:
        return self.draft(input_batch, num_sampled, dummy_run)

    def draft(self, input_batch: Any, num_sampled: Any, dummy_run: bool) -> torch.Tensor:
        """[num_reqs, k] int64 draft tokens on the device for the step vLLM just sampled (`num_sampled` per request:
        accepted drafts + 1); a dummy run (warm-up, profiling) needs only the shape."""
        raise NotImplementedError

    def release(self, freed: list[tuple[str, int]]) -> None:
        """vLLM's runner freed these (request id, slot) pairs at the start of a step, before it admits the step's new
        requests (`plugin._patch_finish_requests`): finished, aborted and preempted requests alike (a preempted one
        comes back as a new request, its tokens prefilled again). A speculator drops what it keeps for them here;
        the lookup keeps nothing per request slot on the host."""

