"""What sizes the model can run: constraints learned from the traced step.

A formula derived at probe sizes evaluates at any sizes, including sizes the
model itself cannot run. Three kinds of constraint are read off the first
trace (with the probe's shapes mapped to symbols) and carried with the
accounting, so that ``at``, ``sweep``, ``peak`` and ``fit`` refuse a size
that breaks one:

- **integer**: a traced dimension with a symbol in its denominator (a head
  width ``D/H``, a group size ``H/H_kv``) must be a whole number: the model
  views a tensor to that size, which fails in eager PyTorch otherwise. Where
  an op makes it by rounding down (a strided convolution's or a pooling's
  output side, ``rounds``), the model runs there, with sizes the formulas do
  not follow: refused as such.
- **slice within the tensor**: ``x[:S]`` of a dimension of size ``S_max``
  (a causal mask, a rotary table) needs ``S <= S_max``; beyond it PyTorch
  clamps the slice and the shapes no longer match.
- **grouped-query attention**: SDPA with fewer key/value heads than query
  heads (``enable_gqa=True``) needs the key/value heads to divide the
  query heads, which no traced shape shows.
- **a shifted size stays a size**: a dimension such as ``S - 1`` (a shifted
  causal-LM loss) must be at least 1.
- **index within the table**: an embedding (or ``index_select`` / ``index``)
  whose indices come from ``arange(n)`` (position ids) needs ``n`` at most the
  table's rows; beyond it the real step raises ``IndexError``.

Each constraint keeps where it was seen (op and module), so a refusal names
it. Constraints that hold for every positive size (``D/2 <= D``) are dropped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import sympy

from symacct.symbols import sym
from symacct.trace.record import StepTrace, TMeta


@dataclass(frozen=True)
class Constraint:
    """``lhs <= rhs`` (kind ``"le"``) or ``lhs`` is an integer (kind ``"integer"``)."""

    kind: str
    lhs: sympy.Expr
    rhs: sympy.Expr | None
    where: str  # the op and module it was read from
    # True: the model runs beyond it, but takes another path there than the one derived (a sliding window)
    path: bool = False
    # True: an integer size an op makes by rounding down (a strided convolution's or a pooling's output side):
    # the model runs where it is not whole, with sizes the formulas do not follow
    rounds: bool = False

    def describe(self) -> str:
        if self.kind == "integer":
            num, den = sympy.fraction(sympy.factor(self.lhs))
            return f"{den} divides {num}"
        return f"{self.lhs} <= {self.rhs}"

    def violated(self, values: Mapping[str, np.ndarray]) -> np.ndarray:
        """Boolean array (broadcast over ``values``): where the constraint fails (exact integer arithmetic)."""
        names, fn = self._test
        args = [np.asarray(values[n], dtype=object) for n in names]
        return np.asarray(np.vectorize(fn, otypes=[bool])(*args), dtype=bool)

    @functools.cached_property
    def _test(self) -> tuple[list[str], Callable[..., bool]]:
        names = sorted(self.symbols())
        args = [sym(n) for n in names]
        if self.kind == "integer":
            num, den = sympy.fraction(sympy.factor(self.lhs))
            parts = sympy.lambdify(args, [num, den], modules=[{}, "math"])
            return names, lambda *a: _not_whole(*parts(*a))
        diff = sympy.lambdify(args, sympy.expand(self.lhs - self.rhs), modules=[{}, "math"])
        return names, lambda *a: diff(*a) > 0

    def symbols(self) -> set[str]:
        return {s.name for s in self._exprs_symbols()}

    def _exprs_symbols(self) -> set[sympy.Symbol]:
        out = set(self.lhs.free_symbols)
        if self.rhs is not None:
            out |= self.rhs.free_symbols
        return out


def _not_whole(num: Any, den: Any) -> bool:
    return int(num) % int(den) != 0


def _always_le(lhs: sympy.Expr, rhs: sympy.Expr) -> bool:
    """True when ``lhs <= rhs`` for every positive size (a polynomial with nonnegative coefficients)."""
    d = sympy.expand(rhs - lhs)
    if d == 0:
        return True
    if d.is_number:
        return bool(d >= 0)
    num, den = sympy.fraction(sympy.together(d))
    return all(t.as_coeff_Mul()[0] >= 0 for t in sympy.Add.make_args(sympy.expand(num))) and all(
        t.as_coeff_Mul()[0] >= 0 for t in sympy.Add.make_args(sympy.expand(den))
    )


# ops whose output sides PyTorch rounds down where the input's do not divide (strides, pooling windows): a
# size such an op makes whole at the probe's sizes is not whole at every size the model runs
_ROUNDING = ("convolution", "max_pool", "avg_pool", "im2col", "col2im", "upsample", "_upsample")

_VALUE_KEEPING = ("_to_copy", "clone", "contiguous", "expand", "unsqueeze", "view", "reshape", "repeat", "detach")


def learn(trace: StepTrace, to_expr: Callable[[int], Any]) -> list[Constraint]:
    """The constraints of the step (see the module docstring), in the order first seen."""
    out: dict[tuple[Any, ...], Constraint] = {}
    whole: set[Any] = set()  # dimensions already known to need nothing

    def add(kind: str, lhs: Any, rhs: Any, where: str, rounds: bool = False) -> None:
        if lhs is None or (kind == "le" and rhs is None):
            return
        lhs = sympy.sympify(lhs)
        if kind == "integer":
            if (kind, lhs, None) in out or lhs in whole:
                return
            if not lhs.free_symbols or sympy.fraction(sympy.factor(lhs))[1] == 1:
                whole.add(lhs)
                return
        else:
            rhs = sympy.sympify(rhs)
            if _always_le(lhs, rhs):
                return
        key = (kind, lhs, rhs)
        out.setdefault(key, Constraint(kind, lhs, rhs if kind == "le" else None, where, rounds=rounds))

    bound: dict[int, Any] = {}  # value id -> exclusive upper bound of its values (arange provenance)
    for rec in trace.ops:
        where = f"{rec.op} in '{rec.module or '<root>'}'"
        name = rec.op.overloadpacket.__name__
        rounding = name.startswith(_ROUNDING)
        for i, t in enumerate((*rec.inputs, *rec.outputs)):
            for s in t.shape:
                e = to_expr(s)
                if e is not None:
                    add("integer", e, None, where, rounds=rounding and i >= len(rec.inputs))
                    if isinstance(e, sympy.Add):  # a shifted size (S - 1) must stay a size
                        add("le", sympy.Integer(1), e, where)
        if name == "arange" and rec.outputs:
            ints = [a for a in rec.args if isinstance(a, int) and not isinstance(a, bool)]
            if ints:
                bound[rec.outputs[0].vid] = to_expr(ints[1] if len(ints) >= 2 else ints[0])
        elif name == "slice" and isinstance(rec.args[0], TMeta):
            args = list(rec.args) + [None] * 5
            x, dim, start, end = args[0], args[1] or 0, args[2], args[3]
            size = x.shape[dim]
            if isinstance(end, int) and 0 < end < size:
                add("le", to_expr(end), to_expr(size), where)
            if isinstance(start, int) and 0 < start < size:
                add("le", to_expr(start), to_expr(size), where)
        elif "scaled_dot_product" in name and not name.endswith("_backward") and len(rec.inputs) >= 3:
            q, k = rec.inputs[0], rec.inputs[1]  # q: [b, h, s, d], k: [b, h_kv, s, d] (GQA: h_kv | h)
            if len(q.shape) == 4 and len(k.shape) == 4 and q.shape[1] != k.shape[1]:
                hq, hkv = to_expr(q.shape[1]), to_expr(k.shape[1])
                if hq is not None and hkv is not None:
                    add("integer", hq / hkv, None, where)
        elif name in ("embedding", "index_select", "index") and len(rec.inputs) >= 2:
            table = rec.inputs[0]
            dim = rec.args[1] if name == "index_select" else 0
            idx = rec.inputs[-1] if name == "index_select" else rec.inputs[1]
            if idx.vid in bound and bound[idx.vid] is not None:
                add("le", bound[idx.vid], to_expr(table.shape[dim]), where)
        elif name in ("add", "sub") and rec.inputs and rec.inputs[0].vid in bound and len(rec.args) > 1:
            shift = rec.args[1]  # positions + 2 (OPT's offset), + C (a decode step's cached positions)
            if isinstance(shift, int) and not isinstance(shift, bool) and bound[rec.inputs[0].vid] is not None:
                by = to_expr(shift)  # a size read from a shape is a symbol's value: read back as its symbol
                for t in rec.outputs:
                    bound[t.vid] = None if by is None else bound[rec.inputs[0].vid] + (by if name == "add" else -by)
        elif name in _VALUE_KEEPING or rec.is_view:
            src = next((bound[t.vid] for t in rec.inputs if t.vid in bound), None)
            if src is not None:
                for t in rec.outputs:
                    bound[t.vid] = src
    return list(out.values())


def check(constraints: list[Constraint], values: Mapping[str, np.ndarray]) -> tuple[Constraint, dict[str, Any]] | None:
    """The first constraint broken at ``values`` (arrays broadcast together) and the sizes where it is."""
    for c in constraints:
        names = c.symbols()
        if not names <= set(values):
            continue
        bad = c.violated({n: values[n] for n in names})
        if bad.any():
            arrays = np.broadcast_arrays(*(np.asarray(values[n]) for n in sorted(names)))
            idx = tuple(np.argwhere(bad)[0]) if bad.ndim else ()
            return c, {n: int(a[idx]) for n, a in zip(sorted(names), arrays)}
    return None
