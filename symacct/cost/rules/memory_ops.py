"""Ops that move or make memory but do no arithmetic: views, copies,
creation, random draws, gathers and scatters (0 FLOPs each).

Views cost nothing (the registry already gives them 0 bytes): they are
listed so that an unknown op is never mistaken for one. ``empty*`` only
allocates: 0 bytes written.
"""

from __future__ import annotations

import torch

from symacct.cost.rules.registry import Call, Cost, distinct, nbytes, numel, rule

aten = torch.ops.aten


@rule(
    aten.view,
    aten._unsafe_view,
    aten.reshape,
    aten.t,
    aten.transpose,
    aten.permute,
    aten.expand,
    aten.slice,
    aten.select,
    aten.squeeze,
    aten.unsqueeze,
    aten.split,
    aten.split_with_sizes,
    aten.unbind,
    aten.chunk,
    aten.narrow,
    aten.as_strided,
    aten.alias,
    aten.detach,
    aten.lift_fresh,
    aten.view_as_real,
    aten.view_as_complex,
    aten._conj,
    aten._neg_view,
    aten.unfold,
    aten.diagonal,
    aten.expand_as,
    aten._reshape_alias,
    aten.unflatten,
    aten.flatten,
    aten.movedim,
    aten.view_as,
)
def view(call: Call) -> Cost:
    return Cost()


@rule(
    aten._assert_tensor_metadata,
    aten._assert_scalar,
    aten._functional_assert_scalar,
    aten.sym_constrain_range,
    aten.sym_constrain_range_for_size,
    aten._functional_sym_constrain_range,
    aten._functional_sym_constrain_range_for_size,
)
def size_check(call: Call) -> Cost:
    """Checks on sizes, dtypes and devices that torch.export writes into a program (eager PyTorch runs
    none): they read no tensor data."""
    return Cost(bytes_read=0, bytes_written=0)


@rule(aten._assert_async, aten._functional_assert_async)
def value_check(call: Call) -> Cost:
    """An assertion on a tensor's value: it reads that tensor (one element, usually), writes nothing but
    the functional variant's dependency token."""
    return Cost(bytes_written=0) if call.op.overloadpacket is aten._assert_async else Cost()


@rule(aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided)
def allocate(call: Call) -> Cost:
    return Cost(bytes_read=0, bytes_written=0)


@rule(
    aten.zeros,
    aten.ones,
    aten.full,
    aten.zeros_like,
    aten.ones_like,
    aten.full_like,
    aten.new_zeros,
    aten.new_ones,
    aten.new_full,
    aten.arange,
    aten.scalar_tensor,
    aten.fill_,
    aten.zero_,
    aten.fill,
    aten.rand,
    aten.randn,
    aten.randint,
    aten.rand_like,
    aten.randn_like,
    aten.randint_like,
    aten.bernoulli_,
    aten.bernoulli,
    aten.normal_,
    aten.uniform_,
    aten.exponential_,
    aten.geometric_,
    aten.log_normal_,
    aten.cauchy_,
    aten.random_,
    aten.randperm,
    aten.eye,
    aten.linspace,
    aten.tril,
    aten.triu,
)
def create(call: Call) -> Cost:
    """Writes its output; reads only a tensor it masks (tril, triu)."""
    read = sum((nbytes(t) for t in call.inputs if t not in call.mutated), 0)
    return Cost(bytes_read=read)


@rule(
    aten.clone,
    aten.copy_,
    aten._to_copy,
    aten.copy,
    aten.cat,
    aten.stack,
    aten.contiguous,
    aten.slice_backward,
    aten.select_backward,
    aten.diagonal_backward,
    aten.diagonal_scatter,
    aten.diag_embed,
    aten.repeat,
    aten.index_select,
    aten.gather,
    aten.index,
    aten.constant_pad_nd,
    aten.roll,
    aten.flip,
    aten.slice_scatter,
    aten.select_scatter,
    aten.masked_select,
    aten.index_put_,
    aten.index_put,
    aten.scatter,
    aten.unsafe_split,
    aten.lift_fresh_copy,
    aten._foreach_copy_,
    aten.upsample_nearest1d,
    aten.upsample_nearest2d,
    aten.upsample_nearest3d,
    aten._upsample_nearest_exact1d,
    aten._upsample_nearest_exact2d,
    aten._upsample_nearest_exact3d,
    aten.pixel_shuffle,
    aten.pixel_unshuffle,
    aten.reflection_pad1d,
    aten.reflection_pad2d,
    aten.reflection_pad3d,
    aten.replication_pad1d,
    aten.replication_pad2d,
    aten.replication_pad3d,
    aten.im2col,
)
def copy(call: Call) -> Cost:
    """A copy reads its source and writes its result: 0 FLOPs (nearest upsampling is one: a gather; so are a
    pixel shuffle, a permutation of elements, reflection or replication padding, and ``im2col``, nn.Unfold's
    patches: ConvBERT's span-based convolution).

    ``cat`` / ``stack`` of distinct tensors of the output's dtype read what they write: counted as the
    output's bytes, a formula whatever the list's length (DTensor gathers a tensor split on its last dim
    as ``cat`` of tp chunks: tp pieces of 1/tp each)."""
    if call.op.overloadpacket in (aten.copy_, aten._foreach_copy_):
        src = call.inputs[len(call.mutated) :]
        return Cost(bytes_read=sum((nbytes(t) for t in src), 0))
    if call.op.overloadpacket in (aten.cat, aten.stack) and call.outputs:
        out = call.outputs[0]
        if len(distinct(call.inputs)) == len(call.inputs) and all(t.dtype == out.dtype for t in call.inputs):
            return Cost(bytes_read=nbytes(out))
    return Cost()


@rule(aten.to)
def to(call: Call) -> Cost:
    """``Tensor.to`` reaching the trace whole (ops called inside a ``__torch_dispatch__`` handler, such as
    context parallelism's ring, are not decomposed): the tensor itself when nothing changes (its output is
    its input's storage: nothing moves), else a copy as ``_to_copy``."""
    if call.inputs and call.outputs and call.outputs[0].storage == call.inputs[0].storage:
        return Cost(bytes_read=0, bytes_written=0)
    return Cost()


@rule(aten._foreach_zero_)
def foreach_zero(call: Call) -> Cost:
    return Cost(bytes_read=0)


def _as_matmul(call: Call) -> bool:
    """``derive(embedding_flops="matmul")``: count a lookup as the one-hot matmul it stands for."""
    return call.options.get("embedding_flops") == "matmul"


@rule(aten.embedding)
def embedding(call: Call) -> Cost:
    """A lookup: reads the indices and the gathered rows, no FLOPs.

    With ``embedding_flops="matmul"`` (Chinchilla's appendix): the one-hot
    (tokens, V) @ (V, D) product, 2*tokens*V*D matmul FLOPs, for every table
    looked up (a learned position table too: V is then its S_max rows).
    """
    weight, idx = call.inputs[0], call.inputs[1]  # weight: [V, D], idx: [...] (tokens)
    out = call.outputs[0]
    if _as_matmul(call):
        rows, width = weight.shape
        return Cost(flops=2 * numel(idx.shape) * rows * width, bytes_read=nbytes(idx) + nbytes(out))
    return Cost(bytes_read=nbytes(idx) + nbytes(out))


@rule(aten.embedding_dense_backward)
def embedding_backward(call: Call) -> Cost:
    """Scatter-adds every gradient row into a zeroed (V, D) table: 1 FLOP per grad element.

    With ``embedding_flops="matmul"``: twice the forward's one-hot matmul,
    4*tokens*V*D (the convention's backward = 2 x forward), and no scatter-add.
    """
    grad, idx = call.inputs[0], call.inputs[1]  # grad: [..., D], idx: [...] (tokens)
    if _as_matmul(call):
        rows, width = call.outputs[0].shape  # the weight's gradient: [V, D]
        return Cost(flops=4 * numel(idx.shape) * rows * width)
    return Cost(flops_other=numel(grad.shape))


@rule(aten.col2im)
def col2im(call: Call) -> Cost:
    """nn.Fold, and im2col's backward: every element of the columns is added into its place in the image
    (overlapping patches sum): 1 FLOP each, as a scatter-add."""
    return Cost(flops_other=numel(call.inputs[0].shape))


@rule(aten._local_scalar_dense, aten.item)
def read_scalar(call: Call) -> Cost:
    """``tensor.item()`` on a one-element tensor: reads its bytes, writes none."""
    return Cost(bytes_written=0)


@rule(aten._embedding_bag, aten._embedding_bag_forward_only)
def embedding_bag(call: Call) -> Cost:
    """nn.EmbeddingBag: n looked-up rows reduced into their bags. Reads the indices, offsets, per-sample weights
    and the gathered rows, not the table; writes the bags and the index buffers the kernel returns. 1 FLOP per
    element looked up (an add into its bag, or a max's comparison), 1 more with per-sample weights (the
    product) and 1 per output element for a mean (the division)."""
    args = call.args
    mode = args[4] if len(args) > 4 else call.kwargs.get("mode", 0)
    psw = args[6] if len(args) > 6 else call.kwargs.get("per_sample_weights")
    weight, idx, out = call.inputs[0], call.inputs[1], call.outputs[0]  # [V, D], [n] (the bags' indices), [bags, D]
    n, width = numel(idx.shape), weight.shape[1]
    flops = n * width * (2 if psw is not None else 1) + (numel(out.shape) if mode == 1 else 0)
    read = sum((nbytes(t) for t in distinct(call.inputs[1:])), 0) + n * width * weight.itemsize
    return Cost(flops_other=flops, bytes_read=read)


@rule(aten._embedding_bag_backward)
def embedding_bag_backward(call: Call) -> Cost:
    """EmbeddingBag's table gradient: each bag's gradient row scatter-added into a zeroed (V, D) table once per
    index in the bag (1 FLOP per element), scaled first by the per-sample weight or the mean's 1/size (1 more);
    a max adds only the winning entries, one per output element. Bytes as read and written (the whole table
    written, as ``embedding_dense_backward``)."""
    grad, idx = call.inputs[0], call.inputs[1]  # grad: [bags, D], idx: [n]
    args = call.args
    mode = args[8] if len(args) > 8 else call.kwargs.get("mode", 0)
    psw = args[10] if len(args) > 10 else call.kwargs.get("per_sample_weights")
    width = grad.shape[1]
    if mode == 2:
        return Cost(flops_other=numel(grad.shape))
    scaled = mode == 1 or psw is not None
    return Cost(flops_other=numel(idx.shape) * width * (2 if scaled else 1))


@rule(aten._embedding_bag_per_sample_weights_backward)
def embedding_bag_weights_backward(call: Call) -> Cost:
    """The per-sample weights' gradient: for each of the n entries, the dot product of its bag's gradient row
    with its table row (2 FLOPs per element of the row). Reads those rows, not the table."""
    weight, idx = call.inputs[1], call.inputs[2]  # the table [V, D], the indices [n] (the gradient [bags, D] first)
    n, width = numel(idx.shape), weight.shape[1]
    others = [t for t in distinct(call.inputs) if t.vid != weight.vid]
    read = sum((nbytes(t) for t in others), 0) + n * width * weight.itemsize
    return Cost(flops_other=2 * n * width, bytes_read=read)


@rule(aten.embedding_renorm_)
def embedding_renorm(call: Call) -> Cost:
    """``nn.Embedding(max_norm=...)``: each looked-up row's norm taken and the row scaled in place where it
    exceeds the bound, before the lookup. Counted for every index (the kernel renormalises each distinct row
    once, a number that depends on the values: an upper bound, as the lookup's own bytes count duplicates):
    3 FLOPs per element (square, add, scale); reads the indices and the rows, writes the rows."""
    weight, idx = call.inputs[0], call.inputs[1]  # weight: [V, D], idx: [...] (tokens)
    rows = numel(idx.shape) * weight.shape[1] * weight.itemsize
    return Cost(flops_other=3 * numel(idx.shape) * weight.shape[1], bytes_read=nbytes(idx) + rows, bytes_written=rows)


# the rules of ops that view, copy or allocate and do no arithmetic: at a size of 1 PyTorch may run one where it
# otherwise runs another (a (1, H, S, Dh) tensor is viewable as (H, S, Dh); a gradient whose strides a size of 1
# leaves ambiguous is copied into a new tensor of its parameter's strides), which changes bytes and never FLOPs
MOVES = (view, copy, to, allocate)
