"""An in-place op on a view, and the backward node autograd makes for the view afterwards.

When an op changes a view of a tensor that requires grad in place (``F.leaky_relu(norm(x), inplace=True)``
where the norm returns a view, ``v = y.view(...); v.relu_()``), autograd gives the base a ``CopySlices`` node
and makes the view a new grad_fn over it. For a plain tensor that node is ``AsStridedBackward0``; for a
tensor subclass with Python dispatch, which fake tensors are, autograd replays the view instead
(``ViewBackward0``, ``TransposeBackward0``, ``SliceBackward0``, ...). Both give the same gradient, but
``as_strided_backward`` makes it in a zeroed buffer the size of the base's storage (``new_zeros``, an
``as_strided`` view of it, ``copy_`` of the incoming gradient, an ``as_strided`` view of the base's shape),
where a replayed ``view`` or ``transpose`` makes nothing. The trace had one buffer less than the real step
during the backward: an instance-norm block with an in-place LeakyReLU had its peak short by one activation
map (262,144 bytes at B=2, 64x64 images), silently.

``Replays`` notes each in-place op on a view during the forward and, at the next op, the base's
``CopySlices`` node (read from the base, which is no view: reading the view's node inside dispatch would make
its replay there). In the backward, a view op's node over one of those ``CopySlices``, of the changed view's
sizes, has its result replaced, once it has run, by what ``AsStridedBackward0`` makes on a real tensor
(``torch/csrc/autograd/FunctionsManual.cpp``, ``as_strided_backward``, for views that do not overlap, as
every view op's do): a post-hook on PyTorch's engine, ``after_node`` on symacct's Python engine.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten

Geometry = tuple[tuple[int, ...], tuple[int, ...], int]  # sizes, strides, storage offset


def _geometry(t: torch.Tensor) -> Geometry:
    return tuple(int(d) for d in t.shape), tuple(int(s) for s in t.stride()), int(t.storage_offset())


def _min_storage(g: Geometry) -> int:
    """``_min_storage_size``: the elements a geometry reaches from offset 0."""
    sizes, strides, offset = g
    if any(n == 0 for n in sizes):
        return 0
    return offset + 1 + sum((n - 1) * s for n, s in zip(sizes, strides))


_WRITES: dict[Any, bool] = {}  # op -> whether it writes its first argument (read once per op: every op asks)


def _writes_first_argument(func: Any) -> bool:
    writes = _WRITES.get(func)
    if writes is None:
        args = func._schema.arguments
        writes = _WRITES[func] = bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write
    return writes


class Replays:
    """The views changed in place during the forward, found again in the backward by their node."""

    def __init__(self) -> None:
        self.pending: list[tuple[weakref.ref[torch.Tensor], Geometry, Geometry]] = []
        self.copies: dict[int, list[tuple[Geometry, Geometry]]] = {}  # CopySlices' sequence number -> views
        self.post: dict[int, Callable[..., tuple[Any, ...]] | None] = {}  # node's sequence number -> its replacement

    def after_op(self, func: Any, args: tuple[Any, ...]) -> None:
        """In the forward, after ``func`` ran: an in-place op on a view is noted (its base's new node is read
        at the next op, once autograd has made it)."""
        if not args or not _writes_first_argument(func) or not isinstance(args[0], torch.Tensor):
            return
        t = args[0]
        if t._is_view() and t._base is not None and torch.is_grad_enabled():
            self.pending.append((weakref.ref(t._base), _geometry(t), _geometry(t._base)))

    def resolve(self) -> None:
        """Before an op of the forward: the base of each view noted has its ``CopySlices`` node by now (read
        from the base, which is no view: reading a view's node would make its replay here, in dispatch)."""
        pending, self.pending = self.pending, []
        for ref, view, base in pending:
            b = ref()
            node = b.grad_fn if b is not None else None
            if node is not None and node.name().endswith("CopySlices"):
                self.copies.setdefault(node._sequence_nr(), []).append((view, base))
            del b, node

    def backward_op(self, func: Any, args: tuple[Any, ...]) -> None:
        """In the backward, before the running node's first op: when the node is a changed view's replay over
        its ``CopySlices`` (a view op's node, of the view's sizes), its result is replaced, once it has run,
        by what ``as_strided_backward`` makes on a real tensor (``replace``): a post-hook on the node for
        PyTorch's engine, ``after_node`` for symacct's Python engine. The node's own op still runs (a view of
        the incoming gradient, or a slice's zeroed buffer) and is dropped with the result it made; done here,
        in its place, autograd's view tracking would make the replacement a view of the incoming gradient and
        hold that gradient as long as the next node holds the replacement."""
        node = torch._C._current_autograd_node()
        if node is None or not args or not isinstance(args[0], torch.Tensor):
            return
        seq = node._sequence_nr()
        if seq in self.post:
            return
        edges = getattr(node, "next_functions", ())
        after = edges[0][0] if len(edges) == 1 else None
        if after is None or node.name() == "AsStridedBackward0" or not after.name().endswith("CopySlices"):
            return
        sizes = tuple(int(d) for d in node._input_metadata[0].shape)
        views = [vb for vb in self.copies.get(after._sequence_nr(), ()) if vb[0][0] == sizes]
        if not views:
            return
        view, base = views[0]
        held = [args[0]]  # the incoming gradient, until the replacement ran (a hook set now is given none)

        def replace(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> tuple[Any, ...]:
            grad = held.pop()
            shared = min(view[2], base[2])
            v, b = (view[0], view[1], view[2] - shared), (base[0], base[1], base[2] - shared)
            zeros = grad.new_zeros([max(_min_storage(v), _min_storage(b))])
            zeros.as_strided(*v).copy_(grad)
            del grad
            return (zeros.as_strided(*b), *grad_inputs[1:])

        self.post[seq] = replace
        node.register_hook(replace)  # run by PyTorch's engine; symacct's runs no node hooks and calls after_node

    def after_node(self, node: Any, grad_outputs: list[Any], grad_inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        """For symacct's Python engine, which runs no node hooks: the replacement ``backward_op`` set."""
        seq = node._sequence_nr()
        replace = self.post.get(seq)
        if replace is None:
            return grad_inputs
        self.post[seq] = None  # run once; the key stays, so that the node's later ops (fits, sums) set none
        return replace(grad_inputs, tuple(grad_outputs))
