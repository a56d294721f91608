"""`vllm serve` with hqlab's speculators: the flags a config needs, and the whole command.

    hqlab serve-command MODEL "gpu-lookup:nmin=1,nmax=32,k=15,policy=earliest,batch_k=4:15/16:3/0"

prints a `vllm serve` command line. hqlab's plugin (installed with `pip install "hqlab[vllm]"`, a
`vllm.general_plugins` entry point) is loaded by vLLM in the API server, the engine core and every worker, so the
server needs nothing else: the speculator is named by `--speculative-config` (vLLM's `custom_class` method with
hqlab's class path) and configured by `--additional-config` (the spec itself). The same dictionaries are what the
offline `LLM(...)` takes (`speculative_config=`, `additional_config=`), so both paths build one engine config.
vLLM's own methods serve beside them as baselines (`NATIVE`, `native_speculative_config`, the one translation the
offline engine uses too): `arctic-suffix:...,cached=N` (`suffix`, needs arctic-inference),
`vllm-ngram-gpu:nmin=..,nmax=..,k=..` (`ngram_gpu`) and `vllm-draft:model=..,k=..` (`draft_model`, the drafter made a
local folder by `hqlab.models.prepare`, as the target is).
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from hqlab.config import ConfigError, parse_spec, resolve_spec
from hqlab.engines.vllm import fault, gpu_fused, gpu_lookup

SUFFIX = "arctic-suffix"  # vLLM's own `suffix` method (Arctic Inference's suffix tree)
NGRAM_GPU = "vllm-ngram-gpu"  # vLLM's own `ngram_gpu` method (prompt lookup on the GPU)
DRAFT = "vllm-draft"  # vLLM's own `draft_model` method (an independent draft model)
NATIVE = {"vllm-ngram": "ngram", NGRAM_GPU: "ngram_gpu", SUFFIX: "suffix", DRAFT: "draft_model"}  # -> vLLM's method
SERVED_NATIVE = (SUFFIX, NGRAM_GPU, DRAFT)  # vLLM's own methods the server path runs, as baselines
SERVED = ("none", gpu_lookup.NAME, gpu_fused.NAME, *SERVED_NATIVE)  # what the server path runs

# A step that admits a request carries its whole prompt (a few hundred tokens) beside the running requests' verify
# blocks. vLLM's default capture size (sized for one position a request) sends such a step through eager kernels,
# which on the corpus's batch job at 8 in flight made an admitting step cost 16-22 ms instead of 9-10 ms
# (docs/corpus.md): speculative configs capture CUDA graphs for steps of up to this many tokens.
ADMIT_CAPTURE = 1024

# ... and replays those steps whole: with cudagraph_mode FULL an admitting step on the batch job at 8 in flight cost
# 1.2x a decode step instead of 2.7-3.7x under vLLM's default FULL_AND_PIECEWISE, whose mixed steps run attention
# eagerly between piecewise graphs, with greedy answers that part from the default mode's only at near ties
# (docs/corpus.md). On vLLM 0.26's model runner V2 FULL is right only with hqlab's capture fix (`full_graph_fix`,
# switched on by FULL_GRAPH_ENV in the server's environment; vLLM's V1 runner, where vLLM's own methods run, captures
# them right itself). vLLM's own draft model and gpu-fused keep vLLM's default mode: their drafters capture CUDA graphs
# of their own, which no run has checked under FULL (the check above ran `none` and gpu-lookup, corpus included).
CUDAGRAPH_MODE = "FULL"
FULL_GRAPH_ENV = {"HQLAB_FULL_GRAPH_QUERY_FIX": "1"}  # full_graph_fix.ENV_VAR (not imported: it needs no vLLM)


def capture_size(max_num_seqs: int, k: int) -> int:
    """Largest step (in tokens) captured in a CUDA graph for a speculative config drafting up to k tokens: room for
    a prompt beside the batch (ADMIT_CAPTURE), and for every request verifying k + 1 positions."""
    return max(ADMIT_CAPTURE, max_num_seqs * (k + 1))


def full_graphs(spec: str) -> bool:
    """Whether a config runs CUDAGRAPH_MODE wherever its graphs are hqlab's choice: every config but those with a
    drafter model, vLLM's own and gpu-fused (served, plain `none` keeps all of vLLM's defaults: `graphs`)."""
    return parse_spec(spec)[0] not in (DRAFT, gpu_fused.NAME)


def none_capture(spec: str) -> int:
    """The capture size a `none` spec asks for: 0 (vLLM's default) for `none`, N for `none:capture=N`, the control
    that gives a plain server the speculative configs' CUDA graphs (so a comparison isolates speculation)."""
    name, values = parse_spec(spec)
    if name != "none":
        raise ConfigError(f"none_capture takes a 'none' spec (got {spec!r})")
    unknown = sorted(set(values) - {"capture"})
    if unknown:
        raise ConfigError(f"'none' takes one key, capture=N (got {', '.join(unknown)} in {spec!r})")
    try:
        capture = int(values.get("capture", "0"))
    except ValueError:
        raise ConfigError(f"none:capture must be a whole number of tokens (got {values['capture']!r})") from None
    if capture < 0 or capture == 0 and "capture" in values:
        raise ConfigError(f"none:capture must be >= 1 token (got {capture}); plain `none` keeps vLLM's default")
    return capture


def suffix_speculative_config(spec: str, *, served: bool = False) -> dict[str, Any]:
    """vLLM's speculative config for `arctic-suffix:k=..,depth=..,factor=..,min_prob=..,cached=N` (vLLM 0.26's key
    names). `served`: `cached` must be given, since the two defaults disagree (hqlab's proposer keeps no global tree,
    vLLM's server 10,000 requests) and a served comparison must say which store it ran."""
    from hqlab.proposers import REGISTRY

    label = spec.strip()
    _, config = resolve_spec(label, {SUFFIX: REGISTRY[SUFFIX]})
    if served and "cached" not in parse_spec(label)[1]:
        raise ConfigError(f"{label!r}: a served arctic-suffix names its global tree's size, cached=N requests "
                          f"(0: none; vLLM's default is 10000)")
    if config.offset != 0 or config.cached < 0:
        raise ConfigError(f"{label!r}: vLLM's suffix decoding has no offset and needs cached >= 0")
    return {"method": "suffix", "num_speculative_tokens": config.k,
            "suffix_decoding_max_tree_depth": config.depth, "suffix_decoding_max_spec_factor": config.factor,
            "suffix_decoding_min_token_prob": config.min_prob, "suffix_decoding_max_cached_requests": config.cached}


def native_speculative_config(spec: str, *, served: bool = False) -> tuple[dict[str, Any], str]:
    """(vLLM's speculative config, the drafter's name) for one of vLLM's own methods (`NATIVE`), vLLM 0.26's key
    names; the drafter's name ('' but for `vllm-draft`) is a registry name, hub id or path that
    `hqlab.models.prepare` makes a folder, which the caller puts under `model`. `served`: as for
    `suffix_speculative_config`."""
    from hqlab.proposers import REGISTRY

    label = spec.strip()
    name, values = parse_spec(label)
    if name == SUFFIX:
        return suffix_speculative_config(label, served=served), ""
    if name not in NATIVE:
        raise ConfigError(f"{label!r}: vLLM's own methods here are {', '.join(sorted(NATIVE))}")
    allowed, why = ((("model", "k"), ": it drafts with the full vocabulary, in the engine's dtype and device, "
                                      "sampling as the request does") if name == DRAFT
                    else (("nmin", "nmax", "k"), ": the engine's max_model_len bounds its matches"
                          if "max_model_len" in values else ""))
    extra = sorted(set(values) - set(allowed))
    if extra:  # hqlab's proposer's other keys have no counterpart in vLLM's method
        raise ConfigError(f"{label!r}: vLLM's {NATIVE[name]} takes only {', '.join(allowed[:-1])} and "
                          f"{allowed[-1]} (got {', '.join(extra)}){why}")
    _, config = resolve_spec(label, {name: REGISTRY["draft" if name == DRAFT else "vllm-ngram"]})
    speculative: dict[str, Any] = {"method": NATIVE[name], "num_speculative_tokens": config.k}
    if name == DRAFT:
        return speculative, config.model
    return {**speculative, "prompt_lookup_min": config.nmin, "prompt_lookup_max": config.nmax}, ""


def engine_configs(spec: str, *, planted_fault: str | None = None) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(speculative_config, additional_config) of vLLM's engine for one served config; `planted_fault` plants a
    verification bug (`fault.py`) in a test server."""
    name, values = parse_spec(spec)
    if name == "none":
        none_capture(spec)  # its one key is vLLM's compilation config, not a speculator's
        if planted_fault:
            raise ConfigError("a planted fault needs a speculator to plant it in")
        return None, {}
    if name == gpu_lookup.NAME:
        speculative = gpu_lookup.speculative_config(spec)
    elif name == gpu_fused.NAME:
        speculative = gpu_fused.speculative_config(spec)
    elif name in SERVED_NATIVE:  # vLLM's own method: no hqlab speculator, so no additional config, nothing to plant
        if planted_fault:
            raise ConfigError(f"a planted fault needs hqlab's speculator; {name} is vLLM's own")
        speculative, drafter = native_speculative_config(spec, served=True)
        if drafter:  # the folder the host loads (converted once, cached), as the served target is
            from hqlab import models

            speculative["model"] = models.prepare(drafter)
        return speculative, {}
    else:
        raise ConfigError(f"{spec!r}: the server path runs none, {gpu_lookup.NAME}, {gpu_fused.NAME} (hqlab inside "
                          f"vLLM's GPU step) and {', '.join(SERVED_NATIVE)} (vLLM's own); for another of vLLM's "
                          f"methods pass vLLM's --speculative-config directly")
    extra: dict[str, Any] = {gpu_lookup.SPEC_KEY: spec.strip()}
    if planted_fault:
        if planted_fault not in fault.FAULTS:
            raise ConfigError(f"planted_fault must be one of {', '.join(fault.FAULTS)} (got {planted_fault!r})")
        extra[fault.KEY] = planted_fault
    return speculative, extra


def graphs(spec: str, *, max_num_seqs: int = 32) -> dict[str, Any]:
    """vLLM's compilation config a served config asks for: CUDA graphs for steps of up to `capture_size` tokens
    (vLLM's default capture size is sized for one position a request), in CUDAGRAPH_MODE where `full_graphs`; {}
    for plain `none` (vLLM's defaults), `none:capture=N` the speculative configs' graphs up to N tokens."""
    name, _ = parse_spec(spec)
    if name == "none":
        capture = none_capture(spec)
        return {"max_cudagraph_capture_size": capture, "cudagraph_mode": CUDAGRAPH_MODE} if capture else {}
    speculative, _ = native_speculative_config(spec, served=True) if name in SERVED_NATIVE else engine_configs(spec)
    config = {"max_cudagraph_capture_size": capture_size(max_num_seqs, int(speculative["num_speculative_tokens"]))}
    return {**config, "cudagraph_mode": CUDAGRAPH_MODE} if full_graphs(spec) else config


def serve_env(spec: str) -> dict[str, str]:
    """What the server's environment must add for a config: FULL_GRAPH_ENV where it runs FULL graphs."""
    return dict(FULL_GRAPH_ENV) if graphs(spec).get("cudagraph_mode") == "FULL" else {}


def vllm_args(spec: str, *, max_num_seqs: int = 32, planted_fault: str | None = None) -> list[str]:
    """The `vllm serve` flags one config adds: its speculative and additional configs, and its CUDA graphs
    (`graphs`)."""
    speculative, extra = engine_configs(spec, planted_fault=planted_fault)
    compact = {"separators": (",", ":")}
    compilation = graphs(spec, max_num_seqs=max_num_seqs)
    return ([*(["--speculative-config", json.dumps(speculative, **compact)] if speculative is not None else []),
             *(["--additional-config", json.dumps(extra, **compact)] if extra else []),
             *(["--compilation-config", json.dumps(compilation, **compact)] if compilation else [])])


def serve_command(model: str, spec: str, *, max_num_seqs: int = 32, port: int = 8000,
                  extra: list[str] | None = None, planted_fault: str | None = None) -> list[str]:
    """`vllm serve MODEL ...` for one config (argv)."""
    if max_num_seqs < 1:
        raise ConfigError(f"max_num_seqs must be >= 1 (got {max_num_seqs})")
    return (["vllm", "serve", model, "--max-num-seqs", str(max_num_seqs), "--port", str(port)]
            + vllm_args(spec, max_num_seqs=max_num_seqs, planted_fault=planted_fault) + list(extra or []))


def shell_line(argv: list[str], env: dict[str, str] | None = None) -> str:
    """argv as one shell line, after the environment assignments `env` (`serve_env`)."""
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()), *(shlex.quote(a) for a in argv)])
