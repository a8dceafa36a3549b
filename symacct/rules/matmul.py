"""Matmul family: PyTorch's own flop_counter formulas, fed with symbolic shapes.

Convention (flop_counter's): 2 FLOPs per multiply-add; an (M, K) @ (K, N)
product costs 2*M*K*N. Bias additions of addmm/baddbmm are not counted.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import flop_registry

from symacct.rules.registry import Call, Cost, rule, shapes_of

aten = torch.ops.aten

_MATMUL = (
    aten.mm,
    aten.addmm,
    aten.bmm,
    aten.baddbmm,
    aten._scaled_mm,
    aten.convolution,
    aten._convolution,
    aten.convolution_backward,
)


@rule(*_MATMUL)
def matmul(call: Call) -> Cost:
    """Whatever torch.utils.flop_counter counts for this op, in symbols."""
    formula = flop_registry[call.op.overloadpacket]
    flops = formula(*shapes_of(call.args), **shapes_of(call.kwargs), out_val=shapes_of(call.out))
    return Cost(flops=flops)
