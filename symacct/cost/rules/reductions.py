"""Reductions and fused normalisation / softmax / loss kernels.

Convention: a reduction costs 1 FLOP per element it reads; so does a scan
(``cumsum``: one add per element, the position ids of a padding mask), and so
does a selection (``topk``, ``sort``, ``histc``: a mixture of experts' routing
compares, it does no arithmetic; the comparisons of a sort are not counted).
A fused kernel
costs the FLOPs of its decomposition per element of its largest operand,
as listed in ``FUSED`` (docs/conventions.md prints the table).
"""

from __future__ import annotations

from typing import Any

import torch

from symacct.cost.rules.registry import Call, Cost, numel, rule

aten = torch.ops.aten


@rule(tag=torch.Tag.reduction)
def reduction(call: Call) -> Cost:
    return Cost(flops_other=numel(call.inputs[0].shape) if call.inputs else 0)


@rule(
    aten.amax,
    aten.amin,
    aten.var,
    aten.var_mean,
    aten.linalg_vector_norm,
    aten.logsumexp,
    aten.cumsum,
    aten.cumprod,
    aten.cummax,
    aten.cummin,
    aten.topk,
    aten.sort,
    aten.histc,
)
def reduction_untagged(call: Call) -> Cost:
    return reduction(call)


# FLOPs per element of the op's first tensor argument.
FUSED: dict[str, int] = {
    "_softmax": 5,  # max, sub, exp, sum, div
    "_safe_softmax": 5,
    "_softmax_backward_data": 4,  # grad * y, sum, sub, mul
    "_log_softmax": 5,  # max, sub, exp, sum, sub (log per row not counted)
    "_log_softmax_backward_data": 4,  # exp(y), sum(grad), mul, sub
    "native_layer_norm": 7,  # mean, sub, square, mean, mul rstd, * weight, + bias
    "native_layer_norm_backward": 13,  # xhat (2), g*w, sums (3), combine (4), dw (2), db (1)
    "native_group_norm": 7,
    "native_group_norm_backward": 13,
    "native_batch_norm": 7,
    "native_batch_norm_backward": 13,
    "_native_batch_norm_legit": 7,
    "_native_batch_norm_legit_functional": 7,
    "_native_batch_norm_legit_no_training": 4,
    "_fused_rms_norm": 5,  # square, mean, rsqrt-mul, * weight
    "_fused_rms_norm_backward": 9,
    "native_dropout": 3,  # mask draw, mul mask, mul scale
    "log_sigmoid_forward": 5,  # min(x, 0) - log1p(exp(-|x|)): abs, exp, log1p, min, sub (the CPU keeps exp in a buffer)
    "log_sigmoid_backward": 4,  # grad * sigmoid(-x): exp, add, div, mul
    "log_sigmoid": 5,  # as log_sigmoid_forward: the whole op, as the ring attention's merge calls it in dispatch
    "_weight_norm_interface": 3,  # per element of v: square, sum (the norm); v * (g / norm)
    "_weight_norm_interface_backward": 5,  # per element of grad_w: grad_w * v, sum (grad_g); mul, sub, mul (grad_v)
    "glu": 1,  # per input element: half are gates, sigmoid each; half are values, times the gate
    "glu_backward": 6,  # per gradient element: s = sigmoid(b), grad * s (value); grad * a * s * (1 - s) (gate)
    "logcumsumexp": 6,  # a running log-add-exp: d = acc - x, |d|, exp(-|d|), log1p, max(acc, x), add
}


@rule(*(getattr(aten, n) for n in FUSED if hasattr(aten, n)))
def fused(call: Call) -> Cost:
    first = call.inputs[0]
    return Cost(flops_other=FUSED[call.op.overloadpacket.__name__] * numel(first.shape))


# Elementwise losses: FLOPs per element of the prediction (``self``), from the definition's arithmetic; a
# forward that reduces (mean or sum, the default) adds 1 per element, as any reduction.
LOSSES: dict[str, int] = {
    "mse_loss": 2,  # (x - y)^2: sub, mul
    "mse_loss_backward": 3,  # (x - y) * (2 / N) * grad: sub, mul, mul
    "smooth_l1_loss": 5,  # d = |x - y|; d < beta ? 0.5 d^2 / beta : d - beta / 2: sub, abs, compare, mul, mul
    "smooth_l1_loss_backward": 5,  # (|d| < beta ? d / beta : sign d) * grad: sub, abs, compare, div, mul
    "huber_loss": 5,  # d = |x - y|; d < delta ? 0.5 d^2 : delta (d - delta / 2): sub, abs, compare, mul, mul
    "huber_loss_backward": 5,  # clamp(x - y, -delta, delta) * grad: sub, abs, compare, mul, mul
    "binary_cross_entropy": 8,  # -(y log x + (1 - y) log(1 - x)): 2 log, 2 sub, 2 mul, add, neg
    "binary_cross_entropy_backward": 6,  # grad * (x - y) / max((1 - x) x, eps): 2 sub, mul, max, div, mul
    # (1 - y) x + m + log(exp(-m) + exp(-x - m)), m = max(-x, 0): PyTorch's stable form (its backward is
    # pointwise ops, costed one by one)
    "binary_cross_entropy_with_logits": 12,
    "soft_margin_loss": 5,  # log(1 + exp(-y x)): mul, neg, exp, add, log
    "soft_margin_loss_backward": 6,  # -y e / (1 + e) * grad, e = exp(-y x): mul, exp, add, div, mul, mul
}
_REDUCTION_NONE = 0  # torch.nn's Reduction enum: none 0, mean 1, sum 2


def _reduction(call: Call, index: int) -> int:
    """The ``reduction`` argument of a loss op (positional at ``index``), mean when left out."""
    if len(call.args) > index and isinstance(call.args[index], int):
        return call.args[index]
    return int(call.kwargs.get("reduction", 1))


@rule(*(getattr(aten, n) for n in LOSSES if hasattr(aten, n)))
def loss(call: Call) -> Cost:
    """``LOSSES`` per element of the prediction (the first tensor of a forward, the second of a backward,
    after the incoming gradient), plus 1 per element where a forward reduces."""
    name = call.op.overloadpacket.__name__
    backward = name.endswith("_backward")
    n = numel(call.inputs[1 if backward else 0].shape)
    # the reduction follows the tensors: self, target (and weight, pos_weight where the op takes them)
    at = {"binary_cross_entropy": 3, "binary_cross_entropy_with_logits": 4}.get(name, 2)
    reduced = not backward and _reduction(call, at) != _REDUCTION_NONE
    return Cost(flops_other=(LOSSES[name] + int(reduced)) * n)


# Interpolation by taps (bilinear: 4 neighbours): a weighted sum per output element, taps multiplies and
# taps - 1 adds; its backward adds each gradient element, weighted, into every tap: 2 * taps per element.
# (Antialiased resizing reads a window that grows with the scale: no rule, refused.)
TAPS: dict[str, int] = {
    "upsample_linear1d": 2,
    "upsample_bilinear2d": 4,
    "upsample_trilinear3d": 8,
    "upsample_bicubic2d": 16,
}


@rule(*(getattr(aten, n) for n in TAPS))
def interpolate(call: Call) -> Cost:
    """(2 * taps - 1) FLOPs per output element (``TAPS``); the weights, per row and column, not counted."""
    return Cost(flops_other=(2 * TAPS[call.op.overloadpacket.__name__] - 1) * numel(call.outputs[0].shape))


@rule(*(getattr(aten, f"{n}_backward") for n in TAPS))
def interpolate_backward(call: Call) -> Cost:
    """2 * taps FLOPs per gradient element read (``TAPS``): a weighted add into each tap."""
    return Cost(
        flops_other=2 * TAPS[call.op.overloadpacket.__name__.removesuffix("_backward")] * numel(call.inputs[0].shape)
    )


@rule(aten.nll_loss_forward, aten.nll_loss2d_forward)
def nll_loss(call: Call) -> Cost:
    """Gathers one logit per target and sums: N FLOPs, reads N logits and N targets."""
    logp, target = call.inputs[0], call.inputs[1]
    n = numel(target.shape)
    return Cost(flops_other=n, bytes_read=n * (logp.itemsize + target.itemsize))


@rule(aten.nll_loss_backward, aten.nll_loss2d_backward)
def nll_loss_backward(call: Call) -> Cost:
    """Writes the whole (N, V) gradient: zeros plus one scaled value per target."""
    grad_out, target = call.inputs[0], call.inputs[2]
    n = numel(target.shape)
    return Cost(flops_other=n, bytes_read=n * target.itemsize + numel(grad_out.shape) * grad_out.itemsize)


def _window(call: Call) -> Any:
    """The kernel area of a pooling call (its kernel_size argument, an int or a per-dimension list)."""
    k = call.args[1] if len(call.args) > 1 else call.kwargs.get("kernel_size", 1)
    k = k if isinstance(k, (list, tuple)) else [k]
    area = 1
    for x in k:
        area *= x
    return area


@rule(aten.max_pool2d_with_indices, aten.max_pool3d_with_indices, aten.avg_pool2d, aten.avg_pool3d)
def pool(call: Call) -> Cost:
    """One comparison (max) or add (average) per input element of each window: output elements x kernel area."""
    return Cost(flops_other=numel(call.outputs[0].shape) * _window(call))


@rule(
    aten.max_pool2d_with_indices_backward,
    aten.max_pool3d_with_indices_backward,
    aten.avg_pool2d_backward,
    aten.avg_pool3d_backward,
)
def pool_backward(call: Call) -> Cost:
    """Each output gradient is added into its window's input: one add per element of the gradient read,
    times the window for an average (spread over the window)."""
    grad = call.inputs[0]
    if "max_pool" in call.op.overloadpacket.__name__:
        return Cost(flops_other=numel(grad.shape))
    k = call.args[2] if len(call.args) > 2 else call.kwargs.get("kernel_size", 1)  # (grad, self, kernel_size, ...)
    area = 1
    for x in k if isinstance(k, (list, tuple)) else [k]:
        area *= x
    return Cost(flops_other=numel(grad.shape) * area)


@rule(
    aten.upsample_nearest1d_backward,
    aten.upsample_nearest2d_backward,
    aten.upsample_nearest3d_backward,
    aten._upsample_nearest_exact1d_backward,
    aten._upsample_nearest_exact2d_backward,
    aten._upsample_nearest_exact3d_backward,
)
def upsample_nearest_backward(call: Call) -> Cost:
    """Each output gradient is added into the input element it was copied from: one add per element of the
    gradient read (as a max pool's backward)."""
    return Cost(flops_other=numel(call.inputs[0].shape))


@rule(*(getattr(aten, f"{k}_pad{d}d_backward") for k in ("reflection", "replication") for d in (1, 2, 3)))
def pad_backward(call: Call) -> Cost:
    """Reflection or replication padding's backward: each gradient element is added into the input element it
    was copied from (the border ones receive several): one add per element of the gradient read."""
    return Cost(flops_other=numel(call.inputs[0].shape))


@rule(aten.unfold_backward)
def unfold_backward(call: Call) -> Cost:
    """``Tensor.unfold``'s backward: each window's gradient added into the elements it was taken from
    (overlapping windows share them): one add per element of the gradient read."""
    return Cost(flops_other=numel(call.inputs[0].shape))


@rule(aten._adaptive_avg_pool2d, aten._adaptive_avg_pool3d, aten.adaptive_max_pool2d)
def adaptive_pool(call: Call) -> Cost:
    """One add (or comparison) per input element (global pooling reads each once)."""
    return Cost(flops_other=numel(call.inputs[0].shape))


@rule(aten._adaptive_avg_pool2d_backward, aten._adaptive_avg_pool3d_backward, aten.adaptive_max_pool2d_backward)
def adaptive_pool_backward(call: Call) -> Cost:
    """The gradient spread back over the input: one op per input element."""
    return Cost(flops_other=numel(call.outputs[0].shape))
