"""Matmul family: PyTorch's own flop_counter formulas, fed with symbolic shapes.

Convention (flop_counter's): 2 FLOPs per multiply-add; an (M, K) @ (K, N)
product costs 2*M*K*N. Bias additions of addmm/baddbmm are not counted.

Grouped matmuls (``aten._grouped_mm``, a mixture of experts' routed tokens)
have no flop_counter formula: each row is multiplied by its group's matrix
once, so the total is 2 * rows * K * N however the rows split into groups
(the offsets are values, never read here). This assumes no row is dropped
(offsets ending at the row count: no expert capacity limit), which is how
transformers calls it.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import flop_registry

from symacct.cost.rules.registry import Call, Cost, numel, rule, shapes_of

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


@rule(aten._grouped_mm)
def grouped_mm(call: Call) -> Cost:
    """2 * M * K * N over all groups: (M, K) rows by their group's (K, N) matrix, or, for two 2-d operands
    split along the contraction (the weight gradient), an (M, K_total) by (K_total, N) product cut in groups."""
    a, b = call.inputs[0].shape, call.inputs[1].shape
    if len(a) == 2 and len(b) == 2:
        return Cost(flops=2 * a[0] * a[1] * b[1])
    out = call.outputs[0].shape
    n = 1
    for d in out:
        n = n * d
    return Cost(flops=2 * n * a[-1])


@rule(aten.mv, aten.addmv, aten.dot, aten.vdot)
def matvec(call: Call) -> Cost:
    """Matrix-vector products ((n, m) @ (m,): ``mv``, ``addmv``, a spectral norm's power iteration) and vector
    products (``dot``, ``vdot``): 2 FLOPs per multiply-add, 2nm and 2n, as the matmul family (the bias of
    ``addmv`` not counted, as ``addmm``'s), in ``flops.other``: torch.utils.flop_counter has no formula for
    them, so FlopCounterMode counts them as 0 and model FLOPs (``flops.total``) leave them out too."""
    first = call.inputs[1] if call.op.overloadpacket is aten.addmv else call.inputs[0]
    return Cost(flops_other=2 * numel(first.shape))
