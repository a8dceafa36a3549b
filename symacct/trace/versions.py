"""PyTorch's in-place check on saved tensors, kept while saved-tensor hooks are set.

A tensor autograd saves for backward carries the version it had when saved. If an in-place op changes it
before backward reads it (``h = relu(x); h.add_(e)``: relu's backward needs its output), PyTorch's
``SavedVariable::unpack`` refuses the step: "one of the variables needed for gradient computation has been
modified by an inplace operation". With ``saved_tensors_hooks`` set, PyTorch hands the tensor to the pack
hook and leaves that check out. symacct sets hooks on every step it traces (saved bytes) and measures
(``symacct.measure``), so without this module a step that fails in PyTorch would be traced or measured as
if it ran: a figure for a step nobody can run.

``pack`` keeps the version with the tensor; ``unpack`` compares it as PyTorch does (the version counter is
shared by a tensor and its views, so an in-place op on a view counts too) and refuses a change, naming the
backward node that reads the tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from symacct.errors import SymacctError


def version(t: torch.Tensor) -> int:
    """The version ``t`` has now (its counter is shared with its views), as ``SavedVariable`` keeps it."""
    return int(t._version)


def check(t: torch.Tensor, saved_version: int, module: Callable[[], str] | None = None) -> None:
    """Refuse when ``t`` changed in place since it was saved at ``saved_version`` (``module()``: the module
    the reading node belongs to, asked only then)."""
    now = version(t)
    if now == saved_version:
        return
    node = torch._C._current_autograd_node()
    reader = node.name() if node is not None else "a backward node"
    raise SymacctError(
        f"a tensor saved for backward was changed in place before backward read it: the {str(t.dtype)[6:]} "
        f"tensor of shape {tuple(t.shape)} that {reader} reads is at version {now}, saved at version "
        f"{saved_version}; PyTorch refuses this step ('one of the variables needed for gradient computation has "
        "been modified by an inplace operation')",
        op=reader,
        module=module() if module is not None else None,
        shapes=[tuple(t.shape)],
        hint="make the op that changes it out of place (h = h + x, not h.add_(x); inplace=False), or change a "
        "clone; torch.autograd.set_detect_anomaly(True) on a real step names the forward op",
    )


def alias(t: torch.Tensor) -> torch.Tensor:
    """What a pack hook keeps of ``t``: ``t`` without its autograd history (its storage, shape and version
    counter), made outside every dispatch mode so that no trace or counter sees it.

    A pack hook gets the live tensor. Where autograd saves the output of the node that saves it (tanh,
    sigmoid, exp, relu keep their results), keeping ``t`` itself closes a reference cycle: the output's
    ``grad_fn`` owns the saved variable, which owns the output. Part of that cycle is in C++, so no garbage
    collection breaks it: the saved tensor lives until backward releases it, and where backward never reaches
    the node (a branch the loss does not read, such as a pooler's output no head uses), for ever. PyTorch
    keeps saved outputs without their history for this reason, and gives the history back on unpack, so the
    alias loses nothing. A tensor saved as an input of the node (its ``grad_fn`` an earlier node, or none)
    closes no cycle and is kept as it is (a detach is one more dispatch on every fake tensor)."""
    fn = t.grad_fn
    if fn is None or fn._sequence_nr() != torch.autograd._get_sequence_nr() - 1:
        return t
    with torch.utils._python_dispatch._disable_current_modes():
        return t.detach()


def pack(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A saved-tensor pack hook that keeps ``t`` (its ``alias``) with its version (``unpack`` checks it)."""
    return alias(t), version(t)


def unpack(packed: tuple[torch.Tensor, int], module: Callable[[], str] | None = None) -> torch.Tensor:
    """The saved tensor, once its version is checked (``check``)."""
    t, v = packed
    check(t, v, module)
    return t
