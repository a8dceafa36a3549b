"""Fused optimizer kernels, costed by derivation from the same optimizer's single-tensor path.

``torch._fused_adamw_`` and friends do in one kernel what the optimizer's
single-tensor path (``foreach=False``) does op by op. Rather than a typed
table of FLOPs per element (which drifts from the other paths and ignores
the hyperparameters: no weight decay, amsgrad, momentum, nesterov), the rule
runs that path once on fake tensors with the kernel's own hyperparameters,
counts it with the pointwise rules, and takes the FLOPs per parameter
element: the slope between two sizes, so per-tensor scalar work (bias
corrections on the step count) is not counted, as the kernel does it per
tensor. The step counters are incremented outside the kernel and recorded
as ops of their own. So one optimizer has one answer, whichever path runs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from symacct.cost.rules.registry import Call, Cost, lookup, numel, rule
from symacct.trace.record import TMeta, _mutated_args

aten = torch.ops.aten

# fused op -> (optimizer class, the kernel's keyword arguments that change the per-element work)
_FUSED: dict[str, tuple[type[torch.optim.Optimizer], tuple[str, ...]]] = {
    "_fused_adam_": (torch.optim.Adam, ("weight_decay", "amsgrad", "maximize")),
    "_fused_adamw_": (torch.optim.AdamW, ("weight_decay", "amsgrad", "maximize")),
    "_fused_sgd_": (
        torch.optim.SGD,
        ("weight_decay", "momentum", "dampening", "nesterov", "maximize", "is_first_step"),
    ),
    "_fused_adagrad_": (torch.optim.Adagrad, ("weight_decay", "lr_decay", "maximize")),
}


class _Count(TorchDispatchMode):
    """Sums the ``flops_other`` the rules give every op it sees (integer shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        fn = lookup(func)
        if fn is None:
            return out

        def metas(x: Any) -> list[TMeta]:
            return [TMeta(tuple(int(s) for s in t.shape), t.dtype, id(t), 0) for t in tree_flatten(x)[0]
                    if isinstance(t, torch.Tensor)]  # fmt: skip

        mutated = _mutated_args(func)
        call = Call(
            op=func,
            args=args,
            kwargs=kwargs,
            out=out,
            inputs=metas((args, kwargs)),
            outputs=metas(out),
            mutated=[
                m
                for i in mutated
                for m in metas(args[i] if i < len(args) else kwargs.get(func._schema.arguments[i].name))
            ],
            is_view=False,
        )
        self.flops += int(fn(call).flops_other)
        return out


@functools.cache
def per_element(name: str, flags: tuple[tuple[str, Any], ...]) -> int:
    """FLOPs per parameter element of one step of ``name``'s single-tensor path with these hyperparameters."""
    cls, _ = _FUSED[name]
    options = dict(flags)
    first = options.pop("is_first_step", True)
    if cls is torch.optim.Adam or cls is torch.optim.AdamW:
        options["betas"] = (0.9, 0.999)
    counts = []
    for n in (7, 11):
        with FakeTensorMode():
            p = torch.nn.Parameter(torch.zeros(n))
            p.grad = torch.zeros(n)
            opt = cls([p], lr=1e-3, foreach=False, **options)
            if not first:  # a later step: the first makes the states
                opt.step()
            counter = _Count()
            with counter:
                opt.step()
        counts.append(counter.flops)
    return (counts[1] - counts[0]) // (11 - 7)


@rule(*(getattr(aten, n) for n in _FUSED if hasattr(aten, n)))
def fused_optimizer(call: Call) -> Cost:
    """k FLOPs per element of every parameter, k derived from the single-tensor path (module docstring)."""
    name = call.op.overloadpacket.__name__
    _, keys = _FUSED[name]
    flags = tuple(sorted((k, _flag(call.kwargs.get(k))) for k in keys if k in call.kwargs))
    params = call.args[0]  # the parameter list
    return Cost(flops_other=per_element(name, flags) * sum((numel(t.shape) for t in params), 0))


def _flag(v: Any) -> Any:
    """A hyperparameter reduced to what changes the op sequence: zero or not, a bool as is."""
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)):
        return 0.0 if v == 0 else 0.5
    return v
