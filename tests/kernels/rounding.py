"""What the kernel tests share: comparing a kernel's output with its reference within a per-element rounding bound."""

from __future__ import annotations

import torch


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str = "") -> None:
    """|got - want| <= bound at every element (NaN nowhere)."""
    err = (got.double() - want.double()).abs()
    over = ~(err <= bound)
    if over.any():
        worst = int((err - bound).argmax())
        raise AssertionError(f"{what}{int(over.sum())} of {err.numel()} elements beyond the rounding bound; worst: "
                             f"|got - want| {err.flatten()[worst]:.3g} > bound {bound.flatten()[worst]:.3g}")
