"""The settings of `gpu-fused` (`GpuFusedConfig`, every knob documented once in its docstring), the spec parser
that refuses retired keys saying why (`fused_config`), and vLLM's `speculative_config` for a spec. The speculator
itself is `gpu_fused.GpuFusedSpeculator`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hqlab.config import ConfigError, parse_spec, resolve_spec
from hqlab.engines.vllm import batch_k
from hqlab.engines.vllm.goodput import check_knob, plain_steps
from hqlab.engines.vllm.speculator import Retired, custom_class_config, is_custom_class, refuse_retired
from hqlab.proposers.fused import FusedConfig

NAME = "gpu-fused"
CLASS_PATH = "hqlab.engines.vllm.gpu_fused.GpuFusedSpeculator"
PREFILL_CHUNK = 1024  # prompt tokens the drafter reads per eager call by default (`prefill_chunk`)
DRAFT_SAMPLES = ("greedy", "probabilistic")  # how the drafter's head token is drawn under sampling

_SKIP = Retired("the host-proven skip chose drafter-free graphs from late copies of the device's skip marks, which "
                "cost the host 0.2-0.3 ms a step", "use device_skip=true (with draft_block=1): the device decides at "
                                                  "the step itself", keeps="0")
_SPLITS = Retired("FlashAttention's key-length split was no faster (equal at 512 tokens of history, up to 46 % slower "
                  "at 3,900), and the drafting passes now run the Triton attention", "drop it")
# Keys gpu-fused no longer takes (`speculator.refuse_retired`); those whose `keeps` value names what always runs now
# are accepted at that value, so that the served spec, which names some of them, still parses.
RETIRED = {
    "skip": _SKIP, "skip_on": Retired(_SKIP.why, _SKIP.instead),
    "nmin_alone": Retired("it took the lookup's head on steps the host-proven skip spared the drafter, which no "
                          "longer exist", "drop it", keeps="0"),
    "catch_up": Retired("the bounded catch-up ran a wide drafter pass after seven skipped steps whether or not its "
                        "token was needed", "drop it: the drafter reads what it missed at the next step that needs "
                                            "its token", keeps="lazy"),
    "graphs": Retired("the drafting step is captured whenever vLLM captures its own", "to run it eagerly, run vLLM "
                                                                                     "eagerly (enforce_eager)",
                      keeps="true"),
    "layers": Retired("the drafter's torch layers are kept for prompt chunks and as the tests' reference", "drop it: "
                      "the drafting passes run the Triton layers (hqlab_kernels.drafter_layers)", keeps="triton"),
    "attention": Retired("FlashAttention and sdpa are kept for prompt chunks and as the tests' reference", "drop it: "
                         "the drafting passes run the Triton attention (hqlab_kernels.drafter_attention)",
                         keeps="triton"),
    "splits": _SPLITS, "plan_once": Retired("one FlashAttention scheduling call a pass instead of one a layer saved "
                                            "about 1 % of a pass, within the spread", _SPLITS.instead),
    "compile_mode": Retired("torch.compile's max-autotune-no-cudagraphs made a drafting step 32-111 % slower",
                            "use compile=true (torch.compile's default mode)"),
}


@dataclass(frozen=True)
class GpuFusedConfig(FusedConfig):
    """Every key of the lab's `fused` proposer (`FusedConfig`: k the long block, draft_block the drafter's head and
    the short block, model the drafter, the lookup's, the fusion rule's and the scheduler's keys), and:

    compile: torch.compile the drafter's torch layers (they read the prompt chunks; the drafting passes are Triton).
    compile_rule: torch.compile the fusion and schedule rule, the drafter flags and the record columns (~100 small
        operations a step into a few kernels).
    device_skip: skip the drafter where the lookup alone decides every sampling row's block (`drafter_flags`); exact
        only with draft_block=1 and the threshold rule, so refused otherwise; decision for decision as without it.
    batch_k: the width vLLM verifies by batch size (`batch_k`, e.g. 1:15/4:7/0); at width 0 no drafting step runs,
        and the drafter reads the prompts and tokens it missed at the next step that drafts.
    goodput: each step's width among batch_k's widths and 0 (k and 0 without batch_k), chosen by vLLM's scheduler
        for expected tokens per ms (`hqlab.engines.vllm.goodput`, as for gpu-lookup): "default" (gpu-lookup's step
        costs: no drafter pass priced in), a StepCosts JSON file, or online / online:PATH.json (measured by the server
        from that prior on); "" = off. A step at width 0 runs no drafter work, as at batch_k's width 0, whatever the
        batch size.
    prefill_chunk: prompt tokens the drafter reads per eager call (bounds its activation memory).
    prefill_graph: a prompt with at most this many unread tokens is read in 64-position passes replayed from one
        captured CUDA graph instead (0: always eager; about 1.4 ms a pass against 12-36 ms for an eager prompt on an
        H100, docs/serving.md).
    draft_sample: under sampling, "greedy" proposes the drafter's argmax as a point mass; "probabilistic" draws its
        token from its own distribution at the request's temperature and hands vLLM's rejection sampler that
        distribution (`draft_sampling`; needs rule=threshold and agree=0).

    Inside vLLM the drafter drafts greedily (temperature 0), with the whole vocabulary, in the target's dtype and on
    its device, so `temperature`, `vocab`, `dtype` and `device` keep their defaults. Retired keys (`RETIRED`) fail
    saying why; `skip=0`, `nmin_alone=0`, `catch_up=lazy`, `graphs=true`, `layers=triton` and `attention=triton`
    name what always runs now and are accepted."""

    compile: bool = False
    compile_rule: bool = False
    device_skip: bool = False
    batch_k: str = ""
    goodput: str = ""
    prefill_chunk: int = PREFILL_CHUNK
    prefill_graph: int = 0
    draft_sample: str = "greedy"

    def __post_init__(self) -> None:
        super().__post_init__()
        for key, kept in (("skip", 0), ("nmin_alone", 0)):
            if getattr(self, key) != kept:
                raise ConfigError(f"{NAME}: '{key}' was retired ({RETIRED[key].why}); {RETIRED[key].instead}")
        if self.batch_k:
            batch_k.parse(self.batch_k, self.k)
        check_knob(self.goodput)
        if self.device_skip and (self.draft_block != 1 or self.rule != "threshold"):
            # exact only where the drafter's tokens cannot change the block: one head token, which the lookup
            # replaces at a strong match under the threshold rule
            raise ConfigError(f"{NAME}: device_skip needs draft_block=1 (one drafter token a step, which a strong "
                              f"match replaces) and the threshold fusion rule (rule=threshold); got "
                              f"draft_block={self.draft_block}, rule={self.rule}")
        if self.prefill_chunk < 1:
            raise ConfigError(f"{NAME}: prefill_chunk must be >= 1 prompt token per drafter call "
                              f"(got {self.prefill_chunk})")
        if self.prefill_graph < 0:
            raise ConfigError(f"{NAME}: prefill_graph is the longest unread prompt fed through the captured prefill "
                              f"pass, >= 0 (0: always eager; got {self.prefill_graph})")
        for key, fixed, why in (("temperature", 0.0, "the drafter drafts greedily inside vLLM"),
                                ("vocab", "", "a reduced draft vocabulary is not supported inside vLLM"),
                                ("dtype", "auto", "the drafter runs in the target's dtype"),
                                ("device", "auto", "the drafter runs on the target's device")):
            if getattr(self, key) != fixed:
                raise ConfigError(f"{NAME}: {why}; drop {key} (got {key}={getattr(self, key)!r})")
        if self.draft_sample not in DRAFT_SAMPLES:
            raise ConfigError(f"{NAME}: draft_sample must be one of {', '.join(DRAFT_SAMPLES)} (got "
                              f"{self.draft_sample!r})")
        if self.draft_sample == "probabilistic" and (self.rule != "threshold" or self.agree != 0):
            # q may stand for a position only if whether the drafter's token is proposed there does not depend on
            # that token (draft_sampling's module docstring): a head decision by match length alone
            raise ConfigError(f"{NAME}: draft_sample=probabilistic needs rule=threshold and agree=0, where the "
                              f"fusion rule's choice of a position's source never depends on the drafter's "
                              f"sampled token (got rule={self.rule}, agree={self.agree})")


def fused_config(spec: str) -> GpuFusedConfig:
    """The settings of a `gpu-fused:...` spec, validated (a retired key is an error that says why)."""
    spec = refuse_retired(spec, RETIRED, NAME)
    unknown = f"{{spec!r}} is not a {NAME} spec (expected '{NAME}:k=15,draft_block=7,model=..,nmax=..')"
    return resolve_spec(spec, {NAME: GpuFusedConfig}, unknown=unknown, context=f"proposer {NAME!r}")[1]


def recorded_rules(spec: str) -> FusedConfig:
    """The lab `fused` proposer's settings in a gpu-fused spec, a recorded run's included: its rule, lookup and drafter
    keys, whatever GPU-only or retired keys it also names (those changed where the work ran, not what was proposed;
    `skip` is a rule of the lab proposer too)."""
    _, values = parse_spec(spec)
    rules = ",".join(f"{key}={value}" for key, value in values.items() if key in FusedConfig.__dataclass_fields__)
    return resolve_spec(f"fused:{rules}" if rules else "fused", {"fused": FusedConfig},
                        context=f"proposer {NAME!r}")[1]


def speculative_config(spec: str) -> dict[str, Any]:
    """vLLM's `speculative_config` for a `gpu-fused` spec (`speculator.custom_class_config`)."""
    config = fused_config(spec)  # goodput's steps that verify nothing need their CUDA graphs at every batch size
    return custom_class_config(CLASS_PATH, config.k, config.batch_k, plain_steps=plain_steps(config))


def is_gpu_fused(speculative_config: Any) -> bool:
    """True for a vLLM SpeculativeConfig (or dict) that asks for this speculator."""
    return is_custom_class(speculative_config, CLASS_PATH)


__all__ = ["NAME", "CLASS_PATH", "PREFILL_CHUNK", "DRAFT_SAMPLES", "RETIRED", "GpuFusedConfig", "fused_config",
           "recorded_rules", "speculative_config", "is_gpu_fused"]
