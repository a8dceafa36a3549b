"""``loss.backward()`` without PyTorch's autograd engine: the graph's nodes called from Python, in the
engine's order.

Why: on a machine with the CUDA build of torch and no GPU, a step on fake CUDA tensors runs its forward,
but the C++ engine stops before the first node (``GraphTask::stash_current_streams`` asks for the
primary context of a device that is not there). The nodes themselves run on fake tensors; only the
scheduling needs a device. This module is that scheduling, as ``torch/csrc/autograd/engine.cpp`` does it
for one graph task on one thread with ``retain_graph=False``:

- the root gradient is ``ones_like(loss)`` (``torch.autograd.backward``'s ``_make_grads``);
- a node is ready once every edge into it (from the nodes reachable from the root) has delivered;
  gradients for one input are summed as they arrive, ``old + new`` (the engine adds in place only into
  a plain tensor it holds the last reference to, never into a fake tensor);
- of the ready nodes, the one with the largest sequence number runs first (``AccumulateGrad``'s is the
  largest there is); the heap is ``std::priority_queue``'s, and ``heapq`` breaks ties the same way;
- each output is fitted to the next node's input metadata before it is passed on
  (``validate_outputs``: ``sum_to`` a broadcast shape, ``to`` the dtype or device);
- after a node runs, its saved tensors are released where the engine's ``release_variables`` releases
  them: the step's saved-tensor hooks file each under its node (``Saved``) and empty them, and the node
  itself is dropped (with what other hooks saved for it: activation checkpointing's recomputation);
- code run by a node that asks the engine (``_current_autograd_node``, ``_current_graph_task_id``) is
  answered as inside it.

It runs no hooks that the engine would run around a node (``Tensor.register_hook``, module backward
hooks): a step that registers one while the Python engine is to run it is refused (``refusing_hooks``).
``AccumulateGrad``'s post-accumulate-grad hooks run, as they run inside the node. The engine is checked
against PyTorch's on CPU fake tensors, op for op and storage lifetime for lifetime
(``tests/test_engine.py``).
"""

from __future__ import annotations

import contextlib
import heapq
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from symacct.errors import SymacctError
from symacct.trace import versions

_ACCUMULATE = 2**64 - 1  # AccumulateGrad's sequence number (UINT64_MAX)


@contextlib.contextmanager
def refusing_hooks() -> Iterator[None]:
    """While a step the Python engine will run is traced: registering a gradient hook on a tensor, or a
    module's backward hook, is refused (the engine would not run it)."""
    from torch.utils.hooks import BackwardHook

    def refuse(what: str) -> Callable[..., Any]:
        def refused(*args: Any, **kwargs: Any) -> Any:
            raise SymacctError(
                f"the step registers {what}, which symacct's Python autograd engine (CUDA without a GPU) does not run",
                hint="derive on a machine with a GPU, or with device='cpu'",
            )

        return refused

    saved = (torch.Tensor.register_hook, BackwardHook.setup_input_hook, BackwardHook.setup_output_hook)
    torch.Tensor.register_hook = refuse("a gradient hook (Tensor.register_hook)")  # type: ignore[method-assign]
    BackwardHook.setup_input_hook = refuse("a module backward hook")  # type: ignore[method-assign]
    BackwardHook.setup_output_hook = refuse("a module backward hook")  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.register_hook, BackwardHook.setup_input_hook, BackwardHook.setup_output_hook = saved


class SavedBox:
    """What the step's pack hook keeps for a saved tensor: the tensor and the version it was saved at, until
    the node that saved it has run (``Saved.release``)."""

    __slots__ = ("tensor", "version", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = versions.alias(tensor)  # no reference cycle through its grad_fn
        self.version = versions.version(tensor)

    def unpack(self) -> torch.Tensor:
        if self.tensor is None:
            raise SymacctError(
                "a saved tensor was read after its node ran",
                hint="backward twice through one graph needs retain_graph=True, which the step does not use",
            )
        versions.check(self.tensor, self.version)  # PyTorch's in-place check, which hooks switch off
        return self.tensor


class Saved:
    """The saved-tensor hooks of a step the Python engine runs: each tensor packed in a ``SavedBox``, filed
    under the sequence number of the node that saves it (made just before its saved variables are packed:
    ``_get_sequence_nr() - 1``), so that ``release`` empties a node's boxes when it has run, as the
    engine's ``release_variables`` does. ``note(t)`` is called on each tensor packed (the recorder counts
    its storage), ``same(kept, t)`` on what its box keeps (``versions.alias``: the recorder reads it as ``t``)."""

    def __init__(
        self,
        note: Callable[[torch.Tensor], object] | None = None,
        same: Callable[[torch.Tensor, torch.Tensor], object] | None = None,
    ) -> None:
        self.note = note
        self.same = same
        self.boxes: dict[int, list[weakref.ref[SavedBox]]] = {}

    def pack(self, t: torch.Tensor) -> SavedBox:
        if self.note is not None:
            self.note(t)
        box = SavedBox(t)
        if self.same is not None:
            self.same(box.tensor, t)  # type: ignore[arg-type]
        self.boxes.setdefault(torch.autograd._get_sequence_nr() - 1, []).append(weakref.ref(box))
        return box

    @staticmethod
    def unpack(box: SavedBox) -> torch.Tensor:
        return box.unpack()

    def release(self, seq: int) -> None:
        for ref in self.boxes.pop(seq, ()):
            box = ref()
            if box is not None:
                box.tensor = None


def _key(node: Any) -> Any:
    seq = node._sequence_nr()
    if seq == _ACCUMULATE:
        return ("accumulate", id(node.variable))
    return seq


class _Ran:
    """A node that has run, as ``_current_autograd_node`` answers for it while its outputs are passed on:
    its name, sequence number and (``AccumulateGrad``) variable, not its saved tensors."""

    __slots__ = ("_name", "_seq", "variable")

    def __init__(self, node: Any) -> None:
        self._name, self._seq = node.name(), node._sequence_nr()
        self.variable = getattr(node, "variable", None)

    def name(self) -> str:
        return self._name

    def _sequence_nr(self) -> int:
        return self._seq


class _Task:
    """A ready node in the heap: ordered by sequence number only, largest first."""

    __slots__ = ("seq", "node", "inputs")

    def __init__(self, node: Any, inputs: list[Any]) -> None:
        self.seq = node._sequence_nr()
        self.node = node
        self.inputs = inputs

    def __lt__(self, other: _Task) -> bool:
        return self.seq > other.seq


def _dependencies(root: Any) -> dict[Any, int]:
    """Edges into each node reachable from ``root`` (keys only: no node is kept alive here)."""
    deps: dict[Any, int] = {}
    seen = {_key(root)}
    stack = [root]
    while stack:
        fn = stack.pop()
        for nxt, _ in fn.next_functions:
            if nxt is None:
                continue
            k = _key(nxt)
            deps[k] = deps.get(k, 0) + 1
            if k not in seen:
                seen.add(k)
                stack.append(nxt)
        del fn
    return deps


def _fit(grads: list[Any], i: int, meta: Any) -> None:
    """``validate_outputs`` for gradient ``i``, replaced in place: ``sum_to`` (a sum over the broadcast
    dimensions, the gradient it was moved from freed right after it, then a view when leading dimensions
    go) to the input's shape, then ``to`` its dtype and device."""
    if grads[i] is None:
        return
    shape = tuple(meta.shape)
    if tuple(grads[i].shape) != shape:
        g, grads[i] = grads[i], None
        lead = g.dim() - len(shape)
        dims = [*range(lead), *(lead + d for d, n in enumerate(shape) if n == 1 and g.shape[lead + d] != 1)]
        if dims:
            g = g.sum(dims, keepdim=True)
        grads[i] = g.view(shape) if lead > 0 else g
        del g
    if grads[i].dtype != meta.dtype:
        grads[i] = grads[i].to(meta.dtype)
    if grads[i].device != meta.device:
        grads[i] = grads[i].to(meta.device)


def _call(node: Any, inputs: list[Any]) -> tuple[Any, ...]:
    if node._sequence_nr() == _ACCUMULATE:
        _accumulate(node.variable, inputs.pop())
        return ()
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        if any(g is None for g in inputs):  # its materialize_grads (zeros for them, by default) is not readable
            raise SymacctError(
                f"{node.name()} got no gradient for one of its outputs, which it materializes as zeros unless "
                "its forward said otherwise",
                hint="the Python engine does not know a custom Function's output shapes; derive on a machine "
                "where PyTorch's own engine runs (a GPU, or device='cpu')",
            )
        out = node.apply(*inputs)
        node.maybe_clear_saved_tensors()
        return _per_edge(node, out if isinstance(out, tuple) else (out,))
    out = node(*inputs)
    return out if isinstance(out, tuple) else (out,)


def _per_edge(node: Any, out: tuple[Any, ...]) -> tuple[Any, ...]:
    """A custom Function's backward returns one gradient per forward input, None for one that is not a tensor
    (``checkpoint``'s function and flag); its node has one edge per tensor input, valid where the input requires
    grad, as ``needs_input_grad`` says: ``PyNode::apply`` keeps the tensor inputs' gradients, and the engine
    drops those of invalid edges."""
    grads = iter(g for g, need in zip(out, node.needs_input_grad) if need)
    return tuple(None if nxt is None else next(grads) for nxt, _ in node.next_functions)


def _accumulate(var: torch.Tensor, grad: Any) -> None:
    """``AccumulateGrad::apply`` with grad mode off (``accumulate_grad.h``): the first gradient is stolen
    (``detach``) when its strides obey the parameter's layout, else copied into the parameter's layout;
    a later one is added in place; then the post-accumulate-grad hooks."""
    if grad is None:
        return
    if var.grad is None:
        if _obeys_layout(grad, var):
            var.grad = grad.detach()
        elif _dense(var):
            var.grad = grad.new_empty_strided(var.shape, var.stride()).copy_(grad)
        else:
            var.grad = grad.clone(memory_format=torch.contiguous_format)
    else:
        var.grad += grad
    for hook in (getattr(var, "_post_accumulate_grad_hooks", None) or {}).values():
        hook(var)


def _dense(t: torch.Tensor) -> bool:
    """``is_non_overlapping_and_dense``: the dimensions longer than 1, by stride, pack memory without gaps."""
    expected = 1
    for stride, n in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= n
    return True


def _obeys_layout(grad: torch.Tensor, var: torch.Tensor) -> bool:
    """``utils::obeys_layout_contract``: the strides of every dimension longer than 1 are the parameter's."""
    if grad.is_sparse:
        return False
    if _dense(var):
        return all(n == 1 or g == v for n, g, v in zip(grad.shape, grad.stride(), var.stride()))
    return grad.is_contiguous()


@contextlib.contextmanager
def _inside(running: list[Any]) -> Iterator[None]:
    """What code run by a node asks of the engine: the node running (``_current_autograd_node``) and a graph
    task id (``_current_graph_task_id``, -1 outside the engine; activation checkpointing keys its
    recomputation by it). A backward started by a node is refused (``_nested``)."""
    node_fn, task_fn = torch._C._current_autograd_node, torch._C._current_graph_task_id
    backward_fn = torch.autograd.backward
    torch._C._current_autograd_node = lambda: running[0]
    torch._C._current_graph_task_id = lambda: _TASK_ID
    torch.autograd.backward = _nested
    try:
        yield
    finally:
        torch._C._current_autograd_node, torch._C._current_graph_task_id = node_fn, task_fn
        torch.autograd.backward = backward_fn


def _nested(*args: Any, **kwargs: Any) -> None:
    """``torch.autograd.backward`` called by a node (reentrant checkpointing's, over the block it ran again):
    PyTorch's engine frees what that backward's nodes saved as each runs (``release_variables``, which Python
    cannot call; they save without the step's hooks, which run in the forward only), so this engine would hold
    it to the end of the node: refused rather than a peak too high."""
    raise SymacctError(
        "a node of the backward runs a backward of its own (reentrant activation checkpointing: "
        "checkpoint(..., use_reentrant=True)), which symacct's Python autograd engine (CUDA without a GPU) "
        "cannot run as PyTorch's does",
        hint="use checkpoint(..., use_reentrant=False), PyTorch's recommended default (transformers': "
        "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})), or derive on a "
        "machine with a GPU, or with device='cpu'",
    )


_TASK_ID = 1 << 40  # a graph task id no engine run has


def backward(
    loss: torch.Tensor,
    saved: Saved | None = None,
    after: Callable[[Any, list[Any], tuple[Any, ...]], tuple[Any, ...]] | None = None,
) -> None:
    """``loss.backward()`` for a scalar ``loss``, node by node from Python (module docstring).

    ``saved``: the step's saved-tensor hooks (``Saved``), emptied node by node. The caller must hold no other
    reference to the graph (``loss`` is detached here; hold the outputs' storages, not the tensors).
    ``after(node, inputs, outputs)``: a node's outputs replaced, as a post-hook replaces them in PyTorch's engine
    (``symacct.trace.views``).
    """
    root = loss.grad_fn
    if root is None:
        raise SymacctError("the loss has no grad_fn", hint="the loss must require grad")
    # torch.autograd.backward holds the root gradient until the engine returns
    grad = torch.ones_like(loss, memory_format=torch.preserve_format)
    loss.detach_()
    deps = _dependencies(root)
    heap: list[_Task] = [_Task(root, [grad])]
    del root
    waiting: dict[Any, _Task] = {}
    running: list[Any] = [None]
    with torch.no_grad(), _inside(running):
        while heap:
            task = heapq.heappop(heap)
            node, inputs = task.node, task.inputs
            del task
            running[0] = node
            outs = list(_call(node, inputs))
            if after is not None:
                outs = list(after(node, inputs, tuple(outs)))
            edges = node.next_functions
            for i, (nxt, nr) in enumerate(edges):
                if nxt is not None and i < len(outs):
                    _fit(outs, i, nxt._input_metadata[nr])
            del inputs  # call_function's inputs, alive through validate_outputs
            if saved is not None:  # release_variables
                saved.release(node._sequence_nr())
            # the node dies here, and with it what other hooks saved for it (activation checkpointing's
            # recomputation); the gradients it hands on are summed in its name
            running[0] = _Ran(node)
            del node
            for i, (nxt, nr) in enumerate(edges):
                if nxt is None or i >= len(outs):
                    continue
                k = _key(nxt)
                deps[k] -= 1
                pending = waiting.get(k)
                if pending is None:
                    pending = _Task(nxt, [None] * len(nxt._input_metadata))
                g, outs[i] = outs[i], None  # moved into the buffer
                if g is not None:
                    old = pending.inputs[nr]
                    pending.inputs[nr] = g if old is None else old + g
                    del old, g
                if deps[k] == 0:
                    del deps[k]
                    waiting.pop(k, None)
                    heapq.heappush(heap, pending)
                else:
                    waiting[k] = pending
                del pending, nxt
            del outs, edges
            running[0] = None
    del grad
    if waiting:
        raise SymacctError(f"{len(waiting)} autograd node(s) never got all their gradients", hint="a defect")
