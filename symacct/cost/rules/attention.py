"""Fused attention kernels.

The CUDA kernels (flash, efficient, cudnn) are in flop_counter's registry and
counted by its formulas. The CPU kernel ``_scaled_dot_product_flash_attention_for_cpu``
is not: FlopCounterMode counts it as 0. symacct counts it with the same
formulas (flop_counter's ``sdpa_flop_count`` / ``sdpa_backward_flop_count``):
forward = two batched matmuls, 4*B*H*S_q*S_k*Dh; backward = five,
10*B*H*S_q*S_k*Dh. One of those five products recomputes the scores Q K^T
that the forward did not keep: it is hardware work, not model work, so the
rules put it in ``flops_recompute`` (2*B*H*S_q*S_k*Dh) and the remaining four
(dV, dP, dQ, dK: twice the forward) in ``flops``. The causal mask is not
discounted here (see docs/conventions.md for the option that does).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import bmm_flop, flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from symacct.cost.rules.registry import Call, Cost, rule, shapes_of

aten = torch.ops.aten

_CUDA_SDPA = (
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_cudnn_attention,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_cudnn_attention_backward,
)


def _as_mha(shapes: list, q: int) -> list:
    """Key and value shapes with the query's head count (GQA, ``enable_gqa=True``).

    flop_counter's SDPA formulas count every product with the query's heads
    (key/value heads are broadcast); they only compare the head counts, which
    symbolic shapes cannot do (H < H_kv has no truth value). Giving key and
    value the query's heads leaves the count unchanged and the check trivial.
    """
    out = list(shapes)
    h = out[q][1]
    for i in (q + 1, q + 2):
        out[i] = (out[i][0], h, *out[i][2:])
    return out


def _scores(q: tuple, k: tuple) -> object:
    """FLOPs of Q K^T for q: [b, h, s_q, d], k: [b, h, s_k, d] (what a backward kernel recomputes)."""
    b, h, s_q, d = q
    s_k = k[-2]
    return bmm_flop((b * h, s_q, d), (b * h, d, s_k))


def _backward(total: object, q: tuple, k: tuple) -> Cost:
    again = _scores(q, k)
    return Cost(flops=total - again, flops_recompute=again)


@rule(*_CUDA_SDPA)
def sdpa_cuda(call: Call) -> Cost:
    formula = flop_registry[call.op.overloadpacket]
    backward = call.op.overloadpacket.__name__.endswith("_backward")
    args = _as_mha(list(shapes_of(call.args)), 1 if backward else 0)  # grad_out first in backward
    total = formula(*args, **shapes_of(call.kwargs), out_val=shapes_of(call.out))
    if backward:
        return _backward(total, args[1], args[2])
    return Cost(flops=total)


@rule(aten._scaled_dot_product_flash_attention_for_cpu)
def sdpa_cpu(call: Call) -> Cost:
    # q: [b, h, s_q, d], k: [b, h_kv, s_k, d], v: [b, h_kv, s_k, d_v]
    q, k, v = _as_mha([shapes_of(a) for a in call.args[:3]], 0)
    return Cost(flops=sdpa_flop_count(q, k, v))


@rule(aten._scaled_dot_product_flash_attention_for_cpu_backward)
def sdpa_cpu_backward(call: Call) -> Cost:
    # grad_out: [b, h, s_q, d_v], then q, k, v as in the forward
    grad_out, q, k, v = _as_mha([shapes_of(a) for a in call.args[:4]], 1)
    return _backward(sdpa_backward_flop_count(grad_out, q, k, v), q, k)
