"""Validated configuration dataclasses, the `NAME[:key=value,...]` spec syntax, and the one resolver of specs.

Every knob in hqlab is a frozen dataclass that checks itself in `__post_init__`, so a bad value fails at the
moment it is written, with a message that says what to change. `parse_spec` splits the CLI/notebook string form
into a name and raw values; `resolve_spec` turns a spec into the name and the validated config of what runs it,
given the table of what can (the proposer registry, the benchmark's engine baselines, vLLM's own methods).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Mapping


class ConfigError(ValueError):
    """A configuration value or spec string is invalid; the message says what to fix."""


def require(cond: bool, msg: str) -> None:
    """Raise ConfigError(msg) unless `cond`: the validation step of every config dataclass."""
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class LookupConfig:
    """Context-lookup (suffix-match) drafting, SPEC §2.1.

    nmin:   shortest suffix that counts as a match (cheap-reject length).
    nmax:   match length cap; longer matches tie with each other at nmax.
    k:      most tokens proposed per step.
    search: only candidate ends within the last `search` tokens are considered (0 = whole history).
    policy: "recent" (longest, then most recent: HyperQwen, llama.cpp) or "earliest" (longest, then earliest:
            vLLM ngram, transformers prompt lookup).
    full:   only accept candidates whose continuation has all k tokens (Spec-Bench PLD).
    """

    nmin: int = 6
    nmax: int = 12
    k: int = 15
    search: int = 0
    policy: str = "recent"
    full: bool = False

    def __post_init__(self) -> None:
        require(self.nmin >= 1, f"nmin must be >= 1 (got {self.nmin})")
        require(self.nmax >= self.nmin, f"nmin must be <= nmax (got nmin={self.nmin}, nmax={self.nmax})")
        require(self.k >= 1, f"k must be >= 1 (got {self.k})")
        require(self.search >= 0, f"search must be >= 0, 0 meaning the whole history (got {self.search})")
        require(self.policy in ("recent", "earliest"),
                 f"policy must be 'recent' or 'earliest' (got {self.policy!r})")


@dataclass(frozen=True)
class DecodeConfig:
    """How the target turns logits into tokens. temperature 0 means greedy."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        require(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1 (got {self.max_new_tokens})")
        require(self.temperature >= 0.0, f"temperature must be >= 0 (got {self.temperature})")
        require(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1] (got {self.top_p})")
        require(self.top_k >= 0, f"top_k must be >= 0, 0 meaning off (got {self.top_k})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# ----------------------------------------------------------------------------------------------------------------
# Spec strings


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Split `NAME[:key=value,...]` into the name and raw string values.

    >>> parse_spec("lookup:nmin=6,k=15")
    ('lookup', {'nmin': '6', 'k': '15'})
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("empty proposer spec; expected NAME[:key=value,...], e.g. lookup:nmin=6,k=15")
    name, _, rest = spec.strip().partition(":")
    name = name.strip()
    if not name:
        raise ConfigError(f"spec {spec!r} has no name before ':'")
    values: dict[str, str] = {}
    if rest.strip():
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not eq or not key or not value:
                raise ConfigError(f"spec {spec!r}: {item!r} is not key=value")
            if key in values:
                raise ConfigError(f"spec {spec!r}: key {key!r} given twice")
            values[key] = value
    return name, values


def _coerce(value: str, typ: Any, where: str) -> Any:
    if typ is bool:
        low = value.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where} must be a boolean (true/false), got {value!r}")
    if typ is int:
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{where} must be an integer, got {value!r}") from None
    if typ is float:
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{where} must be a number, got {value!r}") from None
    return value


def build_config(cls: type, values: dict[str, str], *, context: str) -> Any:
    """Instantiate dataclass `cls` from raw string values, rejecting unknown keys by name."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(f"{context}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(fields))}")
    kwargs = {k: _coerce(v, hints[k], f"{context}: {k}") for k, v in values.items()}
    return cls(**kwargs)


UNKNOWN = "unknown proposer {name!r} in {spec!r}; known: {known}"


def resolve_spec(spec: str, known: Mapping[str, Any], *, unknown: str = UNKNOWN,
                 context: str | None = None) -> tuple[str, Any]:
    """The one resolver from a spec to what runs it: (name, validated config), every error a ConfigError.

    `known` maps names to what runs them: a class with a `Config` dataclass (a proposer) or a config dataclass
    itself. An unknown name raises `unknown` formatted with the name, the spec and the known names; keys and values
    are checked by `build_config` (`context` names the spec's owner in its messages, default `proposer 'NAME'`).
    """
    name, values = parse_spec(spec)
    if name not in known:
        raise ConfigError(unknown.format(name=name, spec=spec, known=", ".join(sorted(known))))
    entry = known[name]
    config = build_config(getattr(entry, "Config", entry), values, context=context or f"proposer {name!r}")
    return name, config
