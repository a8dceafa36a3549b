"""The comparison most exactness tests make: derive's figures against a real CPU step of the same model."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

import symacct
from symacct.measure.run import measure_memory, measure_step

POINTS = ((2, 7), (3, 11))


def exact_against_a_real_step(
    model: nn.Module,
    acct: symacct.Accounting,
    points: Iterable[tuple[int, int]] = POINTS,
    autocast: torch.dtype | None = None,
) -> None:
    """FLOPs (FlopCounterMode with the CPU flash kernel, which it counts as 0), saved bytes, and the memory
    after the forward and at the peak of a real step with AdamW (``autocast``: the forward under it), at each
    (B, S) of ``points``; the model's ``example_inputs(B, S)`` makes the inputs."""
    for B, S in points:
        at = acct.at(B=B, S=S)
        args = model.example_inputs(B, S)
        counted = measure_step(model, args, autocast=autocast)
        model.zero_grad(set_to_none=True)
        assert at.flops.hardware == counted.flops_total + counted.flash_forward + counted.flash_backward
        assert at.memory.activations == counted.saved_bytes
        real = measure_memory(model, args, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), autocast=autocast)
        model.zero_grad(set_to_none=True)
        assert (at.memory.after_forward, at.memory.peak) == (real.after_forward, real.peak)
