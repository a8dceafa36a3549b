"""Saved-tensor hooks a model sets itself, seen by the hooks symacct counts saved tensors with.

symacct counts what autograd saves for backward through ``saved_tensors_hooks``: on every step it traces
(``symacct.trace.record``) and measures (``symacct.measure.run``). A model can set hooks of its own around
part of its forward (``torch.autograd.graph.save_on_cpu``; a pair that keeps a compressed copy); autograd
then packs through the innermost pair only, so what those hooks keep was never counted: the saved bytes came
out short (3,700 where 19,828 are saved, in a model whose blocks run under ``save_on_cpu`` on the CPU),
silently, on both sides of the comparison.

``composing(see)`` wraps each pair the step sets while it is active: the model's pack hook runs, then ``see``
is given every tensor in what it returned (what autograd holds for backward now: the tensor itself, a copy on
another device, a compressed copy); the model's unpack hook is kept. The hooks of PyTorch's activation
checkpointing (``torch.utils.checkpoint``) are left as they are: they keep nothing, the recomputation makes it
again, which is what the step is counted as. symacct's own hooks are left as they are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

_LEFT_AS_THEY_ARE = ("symacct", "torch.utils.checkpoint")  # the modules whose pack hooks are not wrapped


def _left(pack_hook: Callable[..., Any]) -> bool:
    module = getattr(pack_hook, "__module__", None) or ""
    return any(module == m or module.startswith(m + ".") for m in _LEFT_AS_THEY_ARE)


@contextlib.contextmanager
def composing(see: Callable[[torch.Tensor], object]) -> Iterator[None]:
    """While active, each saved-tensor hook pair pushed (``saved_tensors_hooks.__enter__``) other than
    checkpointing's and symacct's has its pack hook followed by ``see`` on every tensor it returned (module
    docstring). ``see`` may raise, to refuse."""
    push = torch._C._autograd._push_saved_tensors_default_hooks

    def push_seen(pack_hook: Callable[..., Any], unpack_hook: Callable[..., Any]) -> None:
        if _left(pack_hook):
            return push(pack_hook, unpack_hook)

        def pack(t: torch.Tensor) -> Any:
            packed = pack_hook(t)
            for x in tree_flatten(packed)[0]:
                if isinstance(x, torch.Tensor):
                    see(x)
            return packed

        return push(pack, unpack_hook)

    torch._C._autograd._push_saved_tensors_default_hooks = push_seen
    try:
        yield
    finally:
        torch._C._autograd._push_saved_tensors_default_hooks = push


@contextlib.contextmanager
def noting_disabled() -> Iterator[set[str]]:
    """While active, the message of every ``torch.autograd.graph.disable_saved_tensors_hooks`` entered is added
    to the set yielded. ``torch.func.grad``, ``vjp``, ``jacrev`` and ``hessian`` enter one: with symacct's hooks
    set, the code inside then fails with that message, and the failure can be named for what it is."""
    disable = torch._C._autograd._saved_tensors_hooks_disable
    messages: set[str] = set()

    def noted(message: str) -> None:
        messages.add(message)
        return disable(message)

    torch._C._autograd._saved_tensors_hooks_disable = noted
    try:
        yield messages
    finally:
        torch._C._autograd._saved_tensors_hooks_disable = disable
