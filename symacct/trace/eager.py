"""Where PyTorch's meta kernels, which the trace runs, answer otherwise than the CPU kernels a real step runs:
the trace takes the CPU's answer (docs/verify.md lists them; each was found by comparing the ops of a real CPU
step with a fake one, and each has a test that fails without it).

- strides: an output laid out as the CPU kernel lays it out (``strides``), where a later reshape copies in one
  and views in the other;
- dtypes: a mixed-precision norm's statistics, a loss of a prediction and a target in two dtypes (``dtypes``),
  where autograd would add a cast the real step does not run;
- storage: a reduced loss that keeps its input-sized buffer (``storage``), EmbeddingBag's index buffers that keep
  an entry more than their sizes (``bag_buffers``);
- refusals: a loss whose CPU kernel refuses two dtypes (``mixed_loss``): the real step fails there.

The dtype, stride and EmbeddingBag corrections are the CPU's (a fake CUDA tensor is left as the meta kernel makes
it); the loss storage one holds for CUDA too (the kernels share the code that resizes).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._prims_common import suggest_memory_format
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten


# Ops whose meta (fake) kernel keeps a non-contiguous input's strides where the CPU kernel
# returns the input's suggested memory format (contiguous, or channels-last for a channels-last image); a later
# view/reshape then copies in eager but not in the trace.
# Found by the fuzzer (symacct/measure/fuzz.py): BatchNorm1d on a transposed input.
_CPU_CONTIGUOUS_OUT = {
    aten.native_batch_norm.default,
    aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit.no_stats,
    aten._native_batch_norm_legit_functional.default,
}


# Backward kernels whose meta kernel gives the input's gradient the incoming gradient's strides, where the CPU
# kernel allocates it by a rule of its own: contiguous, the input's memory format (batch and group norm take
# a channels-last input's), or the incoming gradient's layout (dropout, whose meta kernel makes it contiguous).
# A non-contiguous incoming gradient (a pooler's transpose, cross entropy over transposed logits) then left a
# later reshape a copy in the trace that the real step does not run (transformers' Swin). The output's position
# and where its layout comes from: None contiguous, an int the argument whose memory format (or, for the
# gradient, whose strides) it takes.
_CPU_GRAD_LAYOUT: dict[Any, tuple[int, int | None]] = {
    aten.native_layer_norm_backward.default: (0, None),
    aten._log_softmax_backward_data.default: (-1, None),
    aten.native_batch_norm_backward.default: (0, 1),
    aten.native_group_norm_backward.default: (0, 1),
    aten.native_dropout_backward.default: (-1, 0),
}


def strides(func: Any, args: tuple[Any, ...], out: Any) -> Any:
    """Give a fake output the strides the eager CPU kernel gives it, where the two differ."""
    if func in _CPU_GRAD_LAYOUT:
        return _grad_layout(func, args, out)
    if func not in _CPU_CONTIGUOUS_OUT or not isinstance(out, tuple) or out[0].device.type != "cpu":
        return out
    fmt = suggest_memory_format(args[0])  # a channels-last image stays channels-last
    if out[0].is_contiguous(memory_format=fmt):
        return out
    return (out[0].contiguous(memory_format=fmt), *out[1:])


def _grad_layout(func: Any, args: tuple[Any, ...], out: Any) -> Any:
    """``_CPU_GRAD_LAYOUT``: the input's gradient laid out as the CPU kernel lays it out (a new empty tensor of
    those strides: the values are fake either way)."""
    at, like = _CPU_GRAD_LAYOUT[func]
    grad = out if at < 0 else out[at]
    if not isinstance(grad, torch.Tensor) or grad.device.type != "cpu":
        return out
    if like is None:
        new = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
    elif func is aten.native_dropout_backward.default:
        new = torch.empty_like(args[like], dtype=grad.dtype)  # the incoming gradient's layout
    else:
        fmt = suggest_memory_format(args[like])
        new = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device, memory_format=fmt)
    if new.stride() == grad.stride():
        return out
    return new if at < 0 else (*out[:at], new, *out[at + 1 :])


# Norm kernels -> the positions of their parameter and statistics arguments. On the CPU, a reduced-precision
# input with float32 ones (batch norm under autocast, which leaves it out of its casts; norms kept in float32)
# runs the mixed kernel, which returns its mean and inverse deviation in float32. The meta kernels return
# them in the input's dtype. (Measured on the CPU, tests/test_precision.py; CUDA is not changed here.)
_CPU_MIXED_NORMS = {
    aten.native_batch_norm.default: (1, 2, 3, 4),
    aten._native_batch_norm_legit.default: (1, 2, 3, 4),
    aten._native_batch_norm_legit.no_stats: (1, 2),
    aten._native_batch_norm_legit_functional.default: (1, 2, 3, 4),
    aten._native_batch_norm_legit_no_training.default: (1, 2, 3, 4),
    aten.native_layer_norm.default: (2, 3),
    aten.native_group_norm.default: (1, 2),
}
_REDUCED = (torch.bfloat16, torch.float16)


# Loss kernels whose CPU output takes the dtype of the prediction (the argument at this position) when the
# target has another: the meta kernels promote both to the wider dtype.
_CPU_PREDICTION_DTYPE = {
    aten.huber_loss.default: 0,
    aten.soft_margin_loss.default: 0,
    aten.mse_loss_backward.default: 1,
    aten.smooth_l1_loss_backward.default: 1,
    aten.soft_margin_loss_backward.default: 1,
}
# Loss kernels the CPU refuses with a prediction and a target of two dtypes (the positions of the two); the meta
# kernels promote and run.
_CPU_ONE_DTYPE = {
    aten.binary_cross_entropy.default: (0, 1),
    aten.binary_cross_entropy_backward.default: (1, 2),
    aten.huber_loss_backward.default: (1, 2),
}


def mixed_loss(func: Any, args: tuple[Any, ...]) -> str | None:
    """Why the CPU kernel of a loss refuses its prediction and target in two dtypes (``_CPU_ONE_DTYPE``), else
    None: the real step fails there, so no figure may come of it."""
    pair = _CPU_ONE_DTYPE.get(func)
    if pair is None:
        return None
    a, b = (args[i] for i in pair)
    if a.device.type != "cpu" or a.dtype == b.dtype:
        return None
    return (
        f"{func.overloadpacket.__name__} gets a {str(a.dtype)[6:]} prediction and a {str(b.dtype)[6:]} target: "
        "PyTorch's CPU kernel refuses two dtypes ('Found dtype ... but expected ...'), so the real step fails"
    )


def dtypes(func: Any, args: tuple[Any, ...], out: Any) -> Any:
    """Give an output the dtype the CPU kernel gives it where the meta kernel differs: a mixed-precision norm's
    statistics (outputs 1 and 2) float32 (``_CPU_MIXED_NORMS``); group norm's input gradient the input's dtype
    (its meta kernel follows the float32 statistics); a loss of a prediction and a target in two dtypes the
    prediction's (``_CPU_PREDICTION_DTYPE``). Autograd then adds no cast the real step does not run."""
    if func in _CPU_PREDICTION_DTYPE and isinstance(out, torch.Tensor) and out.device.type == "cpu":
        want = args[_CPU_PREDICTION_DTYPE[func]].dtype
        return out if out.dtype == want else torch.empty_like(out, dtype=want)
    if func is aten.native_group_norm_backward.default and isinstance(out, tuple) and out[0] is not None:
        want = args[1].dtype
        if out[0].device.type == "cpu" and out[0].dtype != want:
            return (torch.empty_like(out[0], dtype=want), *out[1:])
        return out
    where = _CPU_MIXED_NORMS.get(func)
    if where is None or not isinstance(out, tuple) or out[0].device.type != "cpu" or args[0].dtype not in _REDUCED:
        return out
    params = [args[i] for i in where if i < len(args) and isinstance(args[i], torch.Tensor)]
    if not any(p.dtype == torch.float32 for p in params):
        return out
    stats = tuple(torch.empty_like(o, dtype=torch.float32) for o in out[1:3])
    return (out[0], *stats, *out[3:])


# Losses whose kernels write the elementwise loss into the output and then resize it to the reduced scalar
# (``resize_({})`` in the structured meta function of mse_loss and smooth_l1_loss, shared by CPU and CUDA; the
# out= variants soft_margin_loss and the CPU and CUDA binary_cross_entropy run the same way): the 0-dim result
# keeps a storage the size of the input. Their Python meta kernels return a one-element storage.
_WHOLE_STORAGE_LOSSES = {
    aten.mse_loss.default,
    aten.smooth_l1_loss.default,
    aten.soft_margin_loss.default,
    aten.binary_cross_entropy.default,
}


def storage(func: Any, args: tuple[Any, ...], out: Any) -> Any:
    """Give a reduced loss the storage its eager kernel leaves it (``_WHOLE_STORAGE_LOSSES``): an empty tensor of
    the input's size, resized to 0-dim as the kernel resizes its output (not a view: the storage is its own)."""
    if func not in _WHOLE_STORAGE_LOSSES or not isinstance(out, torch.Tensor) or out.dim() != 0:
        return out
    whole = torch.empty(args[0].shape, dtype=out.dtype, device=out.device)
    return whole.resize_(())


# EmbeddingBag's CPU kernels (``make_offset2bag_out``, ``make_bag_size_out``) size two index buffers before they
# resize them, and a resize to fewer elements keeps the storage: offset2bag, where the kernel makes one (the mean
# and max modes, a sum off its fast path), keeps N + 1 indices for its N; bag_size, with ``include_last_offset``,
# keeps one entry per offset, a bag's plus one. The meta kernel allocates both at their sizes. Both are saved for
# the backward.
_CPU_BAG_BUFFERS = {aten._embedding_bag.default, aten._embedding_bag_forward_only.default}


def bag_buffers(func: Any, args: tuple[Any, ...], out: Any) -> Any:
    """Give EmbeddingBag's index buffers the storage the CPU kernel leaves them (``_CPU_BAG_BUFFERS``)."""
    if func not in _CPU_BAG_BUFFERS or not isinstance(out, tuple) or out[0].device.type != "cpu":
        return out
    output, offset2bag, bag_size, *rest = out
    offsets = args[2] if len(args) > 2 else None  # (bags,), or (bags + 1,) with include_last_offset, as the
    if offset2bag.numel() > 0:  # kernel tells the two apart
        offset2bag = _kept(offset2bag, offset2bag.numel() + 1)
    if isinstance(offsets, torch.Tensor) and offsets.dim() == 1 and output.size(0) == offsets.size(0) - 1:
        bag_size = _kept(bag_size, offsets.size(0))
    return (output, offset2bag, bag_size, *rest)


# a tensor made by ``_kept`` -> the elements its storage holds beyond its own (the trace reads its bytes as its
# shape's product plus these: ``StepTrace.bytes_of``)
KEPT: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _kept(t: torch.Tensor, numel: int) -> torch.Tensor:
    """A tensor of ``t``'s shape and dtype over a storage of ``numel`` elements: allocated, then resized down."""
    kept = torch.empty(numel, dtype=t.dtype, device=t.device).resize_(t.shape)
    KEPT[kept] = numel - t.numel()
    return kept


def as_on_the_cpu(func: Any, args: tuple[Any, ...], out: Any) -> Any:
    """``out`` of ``func(*args)`` on fake tensors, with the strides, dtypes and storage the eager kernel gives
    it (the values are fake either way)."""
    if func not in _CORRECTED:  # nearly every op: one lookup
        return out
    return bag_buffers(func, args, storage(func, args, dtypes(func, args, strides(func, args, out))))


_CORRECTED = frozenset(
    [
        *_CPU_CONTIGUOUS_OUT,
        *_CPU_GRAD_LAYOUT,
        *_CPU_MIXED_NORMS,
        *_CPU_PREDICTION_DTYPE,
        *_WHOLE_STORAGE_LOSSES,
        *_CPU_BAG_BUFFERS,
    ]
) | {aten.native_group_norm_backward.default}
