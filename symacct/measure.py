"""What PyTorch itself counts and holds on a real step: the independent side of every check.

These helpers run a real step (on whatever device the model is) and report
PyTorch's own numbers: matmul FLOPs from ``torch.utils.flop_counter``
(forward and backward separately) and the bytes autograd saves for backward
seen through ``saved_tensors_hooks``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode


@dataclass
class Measured:
    flops_forward: int
    flops_backward: int
    saved_bytes: int  # distinct storages saved for backward, params and inputs excluded

    @property
    def flops_total(self) -> int:
        return self.flops_forward + self.flops_backward


def measure_step(
    model: nn.Module, args: tuple[Any, ...], loss: Callable[[Any], torch.Tensor] | None = None
) -> Measured:
    """Run one real training step (forward + backward) and count."""
    model.train()
    external = {p.untyped_storage().data_ptr() for p in model.parameters()}
    external |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    external |= {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in external:
            saved[st.data_ptr()] = st.nbytes()
        return t

    keep: list[torch.Tensor] = []  # saved tensors stay alive until backward, so data_ptr is unique

    def pack_keep(t: torch.Tensor) -> torch.Tensor:
        keep.append(t)
        return pack(t)

    fwd = FlopCounterMode(display=False)
    with fwd, torch.autograd.graph.saved_tensors_hooks(pack_keep, lambda t: t):
        out = model(*args)
        value = loss(out) if loss is not None else out
    bwd = FlopCounterMode(display=False)
    with bwd:
        value.backward()
    keep.clear()
    return Measured(fwd.get_total_flops(), bwd.get_total_flops(), sum(saved.values()))
