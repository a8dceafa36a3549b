"""Elementwise ops: FLOPs per output element, bytes read and written.

Convention: an elementwise op costs ``k`` FLOPs per element it writes, where
``k`` counts the arithmetic of its definition (a transcendental such as exp,
erf, tanh or rsqrt counts 1). ``k = 1`` unless ``PER_ELEMENT`` says
otherwise; the table is the convention, printed in docs/conventions.md.
Foreach ops (the optimizers' ``_foreach_*``) apply the same ``k`` to every
tensor of their list.
"""

from __future__ import annotations

import torch

from symacct.cost.rules.registry import Call, Cost, distinct, numel, rule
from symacct.trace.record import TMeta

aten = torch.ops.aten

# FLOPs per written element; ops not listed cost 1.
PER_ELEMENT: dict[str, int] = {
    "addcmul": 2,  # self + value * t1 * t2 (value == 1 folded)
    "addcdiv": 2,
    "lerp": 2,  # self + w * (end - self)
    "gelu": 5,  # x * 0.5 * (1 + erf(x / sqrt 2))
    "gelu_backward": 10,  # cdf (3) + pdf (4) + x * pdf, + cdf, * grad (3)
    "silu": 2,  # x * sigmoid(x)
    "silu_backward": 6,  # grad * s * (1 + x * (1 - s))
    "native_dropout_backward": 2,  # grad * mask * scale
    "threshold_backward": 1,
    "sigmoid_backward": 3,
    "tanh_backward": 3,
    # activations PyTorch does not tag pointwise (the rule below): their definitions' arithmetic
    "hardswish": 4,  # x * min(max(x + 3, 0), 6) / 6
    "_prelu_kernel": 2,  # x where x > 0, else w * x (compare, mul)
    "_prelu_kernel_backward": 2,  # per output (grad of x, elementwise grad of w): compare, mul
    "rrelu_with_noise": 3,  # training: a uniform slope drawn into noise, compare, mul
    "rrelu_with_noise_backward": 2,  # grad * noise where x <= 0
    "softplus_backward": 5,  # grad * z / (z + 1), z = exp(beta * x)
    "elu_backward": 3,  # grad * (out + alpha) where out <= 0 (compare, add, mul)
    "leaky_relu_backward": 2,  # grad * slope where x <= 0 (compare, mul)
    "hardtanh_backward": 1,  # grad where min < x < max
    "hardsigmoid_backward": 2,  # grad / 6 where -3 < x < 3
    "hardswish_backward": 3,  # grad * (2 x + 3) / 6 where -3 < x < 3
    "mish_backward": 9,  # grad * (t + x * s * (1 - t^2)), t = tanh(softplus x), s = sigmoid x
    "softshrink_backward": 1,
    "hardshrink_backward": 1,
}


# FLOPs per written complex element: the real arithmetic (a complex product is 4 multiplies and 2 adds, as a
# rotary embedding written with complex numbers runs it); ops not listed cost twice their real k.
COMPLEX_PER_ELEMENT: dict[str, int] = {
    "mul": 6,
    "add": 2,
    "sub": 2,
    "polar": 4,  # abs * cos(angle) + i * abs * sin(angle): cos, sin, two multiplies (Llama 4's rotary table)
}


def _per_element(call: Call, written: list[TMeta]) -> int:
    name = call.op.overloadpacket.__name__.removeprefix("_foreach_").rstrip("_")
    if any(t.dtype.is_complex for t in written):
        return COMPLEX_PER_ELEMENT.get(name, 2 * PER_ELEMENT.get(name, 1))
    return PER_ELEMENT.get(name, 1)


@rule(tag=torch.Tag.pointwise)
def pointwise(call: Call) -> Cost:
    written = distinct(call.outputs or call.mutated)
    return Cost(flops_other=_per_element(call, written) * sum((numel(t.shape) for t in written), 0))


# activations and backward kernels without the pointwise tag (each output element from the same element of
# its inputs), costed like any elementwise op by PER_ELEMENT
rule(
    aten.hardswish,
    aten._prelu_kernel,
    aten._prelu_kernel_backward,
    aten.rrelu_with_noise,
    aten.rrelu_with_noise_backward,
    aten.softplus_backward,
    aten.elu_backward,
    aten.leaky_relu_backward,
    aten.hardtanh_backward,
    aten.hardsigmoid_backward,
    aten.hardswish_backward,
    aten.mish_backward,
    aten.softshrink_backward,
    aten.hardshrink_backward,
)(pointwise)


# Python's operators on bool tensors (``a | b``: DTensor's vocabulary-parallel embedding masks the ids
# out of its shard's range): aliases of bitwise_or / and / xor that carry no pointwise tag
rule(aten.__or__, aten.__and__, aten.__xor__)(pointwise)

# a complex tensor from magnitudes and angles (``torch.polar``, Llama 4's rotary table): elementwise, untagged
rule(aten.polar)(pointwise)


def _foreach_packets() -> tuple[torch._ops.OpOverloadPacket, ...]:
    """Every ``aten._foreach_*`` op registered with the dispatcher (``dir(aten)`` lists only the packets some
    code has touched already, so what it gives depends on what was imported first), copy and zero excepted
    (memory_ops has their rules)."""
    names = sorted({n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                    if n.startswith("aten::_foreach_")})  # fmt: skip
    return tuple(getattr(aten, n) for n in names if not n.startswith(("_foreach_copy", "_foreach_zero")))


_FOREACH = _foreach_packets()


@rule(*_FOREACH)
def foreach(call: Call) -> Cost:
    """Elementwise over a list: k FLOPs per element of every written tensor."""
    written = distinct(call.outputs or call.mutated)
    if call.op.overloadpacket.__name__.startswith(("_foreach_norm", "_foreach_max")):
        return Cost(flops_other=sum((numel(t.shape) for t in distinct(call.inputs)), 0))
    return Cost(flops_other=_per_element(call, written) * sum((numel(t.shape) for t in written), 0))


@rule(aten.floor_divide)
def pointwise_untagged(call: Call) -> Cost:
    """Elementwise ops PyTorch does not tag ``pointwise`` (``floor_divide``: a routed row's token, perm // k)."""
    return pointwise(call)


@rule(aten.scatter_add, aten.scatter_add_, aten.index_add, aten.index_add_)
def scatter_add(call: Call) -> Cost:
    """``self`` with ``src`` added at ``index`` along a dimension (``index_add``: whole slices at the indices,
    times ``alpha``, not counted): one add per element of ``src`` (its last tensor input); bytes as any op's."""
    return Cost(flops_other=numel(call.inputs[-1].shape))
