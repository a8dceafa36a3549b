"""The one registry of per-op cost rules.

A rule is a pure function of a :class:`Call` (symbolic shapes and dtypes,
never tensor values) returning a :class:`Cost`. It is registered with the
:func:`rule` decorator for one or more op packets (``aten.mm``) or for a
``torch.Tag`` (a family such as ``pointwise``). Explicit op registrations
win over tag registrations. Registering an op twice raises.

Bytes default to "read every distinct tensor argument, write every output"
(views move nothing); a rule may override either field when the kernel
touches less (an embedding lookup reads only the gathered rows).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Union

import sympy
import torch

from symacct.trace.record import TMeta

Num = Union[int, sympy.Expr]


@dataclass(frozen=True)
class Cost:
    """What one op costs; every field is an int or a sympy expression."""

    flops: Num = 0  # matmul family (mm, bmm, conv, attention): 2 per multiply-add, as flop_counter; model FLOPs
    flops_other: Num = 0  # everything else, per docs/conventions.md
    bytes_read: Num | None = None  # None: every distinct tensor argument, once
    bytes_written: Num | None = None  # None: every output (or what is written in place)
    # matmul FLOPs the kernel runs again to recompute forward values (flash attention's backward
    # recomputes Q K^T): hardware FLOPs, left out of model FLOPs (PaLM's convention)
    flops_recompute: Num = 0

    def _fields(self) -> tuple[Num, ...]:
        values = tuple(getattr(self, f) for f in COST_FIELDS)
        if any(v is None for v in values):
            raise ValueError(
                "a Cost with bytes left to the default (None) has no total: fill them first (graph.cost_ops does)"
            )
        return values

    def map(self, fn: Callable[[Num], Num]) -> Cost:
        """Every field passed through ``fn`` (None kept)."""
        return Cost(**{f: (None if getattr(self, f) is None else fn(getattr(self, f))) for f in COST_FIELDS})

    def __add__(self, other: Cost) -> Cost:
        return Cost(**{f: a + b for f, a, b in zip(COST_FIELDS, self._fields(), other._fields())})

    def __mul__(self, n: Num) -> Cost:
        """The cost of ``n`` calls (a node's ``count``)."""
        return Cost(**{f: a * n for f, a in zip(COST_FIELDS, self._fields())})

    __rmul__ = __mul__

    @staticmethod
    def total(costs: Iterable[Cost]) -> Cost:
        """The field-wise sum, each field's terms added by sympy at once (``+`` in a loop re-flattens the
        growing sum every time)."""
        terms: list[list[Num]] = [[] for _ in COST_FIELDS]
        for c in costs:
            for bucket, v in zip(terms, c._fields()):
                if v != 0:
                    bucket.append(v)
        return Cost(**{f: sympy.Add(*t) if t else 0 for f, t in zip(COST_FIELDS, terms)})


COST_FIELDS = ("flops", "flops_other", "bytes_read", "bytes_written", "flops_recompute")


@dataclass
class Call:
    """An op call as a rule sees it: arguments with :class:`TMeta` for tensors."""

    op: torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: Any
    inputs: list[TMeta]
    outputs: list[TMeta]
    mutated: list[TMeta]
    is_view: bool
    options: dict[str, Any] = field(default_factory=dict)


RuleFn = Callable[[Call], Cost]

_BY_OP: dict[torch._ops.OpOverloadPacket, RuleFn] = {}
_BY_TAG: dict[torch.Tag, RuleFn] = {}


def rule(*ops: torch._ops.OpOverloadPacket, tag: torch.Tag | None = None) -> Callable[[RuleFn], RuleFn]:
    """Register ``fn`` as the cost rule of ``ops`` (or of every op carrying ``tag``)."""

    def register(fn: RuleFn) -> RuleFn:
        for op in ops:
            if not isinstance(op, torch._ops.OpOverloadPacket):
                raise TypeError(f"rule(): expected an op packet such as aten.mm, got {op!r}")
            if op in _BY_OP:
                raise RuntimeError(f"duplicate rule for {op}")
            _BY_OP[op] = fn
        if tag is not None:
            if tag in _BY_TAG:
                raise RuntimeError(f"duplicate rule for tag {tag}")
            _BY_TAG[tag] = fn
        return fn

    return register


def lookup(op: torch._ops.OpOverload) -> RuleFn | None:
    """The rule for ``op``: its own, else its family's (by tag), else None."""
    fn = _BY_OP.get(op.overloadpacket)
    if fn is not None:
        return fn
    for t in op.tags:
        if t in _BY_TAG:
            return _BY_TAG[t]
    name = op.overloadpacket.__name__
    if name.endswith("_") and not name.startswith("_"):  # an in-place variant (masked_fill_) as its out-of-place op
        packet = getattr(torch.ops.aten, name[:-1], None)
        overload = getattr(packet, op._overloadname, None) if packet is not None else None
        if overload is not None and overload is not op:
            return lookup(overload)
    return None


def generation() -> tuple[Any, ...]:
    """The rules now registered, by identity (``symacct.memo``'s key: a rule added or replaced is another)."""
    return (*_BY_OP.items(), *_BY_TAG.items())


def registered_ops() -> list[str]:
    """Names of the ops with a rule of their own, sorted."""
    return sorted(str(op) for op in _BY_OP)


def numel(shape: Iterable[Num]) -> Num:
    n: Num = 1
    for s in shape:
        n = n * s
    return n


def nbytes(t: TMeta) -> Num:
    return numel(t.shape) * t.itemsize


def distinct(ts: Iterable[TMeta]) -> list[TMeta]:
    seen: set[int] = set()
    out = []
    for t in ts:
        if t.vid not in seen:
            seen.add(t.vid)
            out.append(t)
    return out


def default_bytes(call: Call) -> tuple[Num, Num]:
    """(read, written) when the rule does not say: views move nothing."""
    if call.is_view:
        return 0, 0
    read = sum((nbytes(t) for t in distinct(call.inputs)), 0)
    written_ts = call.outputs if call.outputs else call.mutated
    written = sum((nbytes(t) for t in distinct(written_ts)), 0)
    return read, written


def shapes_of(x: Any) -> Any:
    """Replace every TMeta in a structure by its shape (what flop_counter formulas take)."""
    if isinstance(x, TMeta):
        return tuple(x.shape)
    if isinstance(x, (list, tuple)):
        return type(x)(shapes_of(i) for i in x)
    if isinstance(x, dict):
        return {k: shapes_of(v) for k, v in x.items()}
    return x
