"""Values a fake tensor is known to hold because of how the step made it: all ones, and the scalars read
from such a tensor.

Fake tensors have no values, so a step that reads one (``bool(t)``, ``t.item()``) cannot be traced, and
symacct refuses it. One read is common and its answer is known without values: transformers' encoder-decoders
(BART, mBART, Marian, ...) build their decoder's padding mask with ``torch.ones`` and then ask whether it
holds any padding (``fast_all(mask)``, ``mask.all()``) to choose between SDPA's ``is_causal`` and a
materialised (B, 1, S, S) mask. An eager run finds no padding and builds no mask; on fake tensors
transformers cannot ask and builds it (``symacct.models.hf.eager_paths`` lets it ask where the answer is
known here).

The rules are few and exact: a tensor made by ``ones``, ``new_ones``, ``ones_like`` or ``full`` with 1 is
all ones; a copy, a dtype conversion, a view or an index of an all-ones tensor is all ones;
``all`` and ``any`` of one are True (``any``: when it has elements), ``sum`` its element count, ``eq`` and
``ne`` of a known scalar with a number the comparison's result. A value is kept with the tensor's version
counter, so any in-place write to the tensor or to a view of its storage forgets it (an in-place op makes
nothing known: the counter moves after the op returns). Anything else is unknown, and reading it stays a
refusal.

A tensor made from constants alone also keeps its recipe: the factory (``full``, ``zeros``, ``ones``,
``arange``) with its constant arguments and the dtype and device it made, then each op of ``_PURE`` (copies,
views, ``triu``, ``tril``, comparisons, ``masked_fill``, ``where``) applied to such tensors and constants.
Two tensors of one recipe hold the same values, so ``eq`` of them is all ones (no NaN can be in them: no
constant NaN is kept, and no op of ``_PURE`` makes one). PyTorch's
``nn.TransformerEncoder`` asks that of a mask it is given: it builds the causal mask itself and compares
(``_detect_is_causal_mask``), and a mask made by ``nn.Transformer.generate_square_subsequent_mask`` is one
of the same recipe.
"""

from __future__ import annotations

import math
from typing import Any

import torch

aten = torch.ops.aten


class _Ones:
    """The value of a tensor whose every element is 1 (True for bool)."""

    def __repr__(self) -> str:
        return "ONES"


ONES = _Ones()
_ATTR = "_symacct_known"

_MADE_ONES = {aten.ones.default, aten.ones_like.default, aten.new_ones.default}
_FILLED = {aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2}
# ops whose output holds only values of their first tensor argument (copies, conversions, views, gathers)
_KEEPS = {
    aten._to_copy.default,
    aten.clone.default,
    aten.alias.default,
    aten.detach.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.expand.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.unsqueeze.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.index.Tensor,
    aten.index_select.default,
    aten.repeat.default,
    aten.lift_fresh.default,
}


# factories whose values follow from their arguments, and ops whose values follow from their tensor arguments'
# values and their other arguments (deterministic: no random op, no uninitialised memory), none of which makes
# a NaN from values that hold none (no arithmetic: inf - inf, 0 * inf and 0 / 0 are NaN, and NaN != NaN)
_FACTORIES = {
    aten.full.default,
    aten.zeros.default,
    aten.ones.default,
    aten.arange.default,
    aten.arange.start,
    aten.arange.start_step,
}
_PURE = _KEEPS | {
    aten.triu.default,
    aten.tril.default,
    aten.neg.default,
    aten.eq.Scalar,
    aten.ne.Scalar,
    aten.lt.Scalar,
    aten.gt.Scalar,
    aten.le.Scalar,
    aten.ge.Scalar,
    aten.masked_fill.Scalar,
    aten.where.self,
    aten.logical_not.default,
}
_RECIPE = "_symacct_recipe"
_CONSTANTS = (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format, type(None))


def recipe(t: Any) -> Any:
    """How ``t`` was made from constants alone (module docstring), or None; kept with its version counter."""
    if not isinstance(t, torch.Tensor):
        return None
    entry = t.__dict__.get(_RECIPE)
    if entry is None or entry[0] != _version(t):
        return None
    return entry[1]


def _constant(x: Any) -> Any:
    """``x`` as a hashable constant, its tensors as their recipes; None where any part is neither (or a NaN)."""
    if isinstance(x, torch.Tensor):
        return recipe(x)
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, _CONSTANTS):
        return ("c", type(x).__name__, x)
    if isinstance(x, (tuple, list)):
        parts = tuple(_constant(v) for v in x)
        return None if any(v is None for v in parts) else ("s", parts)
    return None


# keyword arguments a recipe takes from the tensor made instead (a default and an explicit dtype are one)
_MADE_AS = ("dtype", "layout", "device", "pin_memory")


# ops whose output holds its input's values at its shape and dtype: the input's recipe
_SAME = {aten.clone.default, aten.alias.default, aten.detach.default, aten.lift_fresh.default}


def _make_recipe(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor) -> Any:
    if func in _SAME:
        return recipe(args[0]) if args else None
    if func not in _FACTORIES and (func not in _PURE or not any(recipe(a) is not None for a in args)):
        return None
    given = _constant((list(args), sorted((k, v) for k, v in kwargs.items() if k not in _MADE_AS)))
    if given is None:
        return None
    return (str(func), given, str(out.dtype), str(out.device), tuple(out.shape))


def known(t: Any) -> Any:
    """What ``t`` is known to hold: ``ONES``, a Python scalar (a 0-d tensor), or None (unknown)."""
    if not isinstance(t, torch.Tensor):
        return None
    entry = t.__dict__.get(_ATTR)
    if entry is None or entry[0] != _version(t):  # written since
        return None
    return entry[1]


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference-mode tensor keeps no version counter: nothing is known of it
        return None


def _mark(t: Any, value: Any) -> None:
    if isinstance(t, torch.Tensor) and value is not None and _version(t) is not None:
        t.__dict__[_ATTR] = (_version(t), value)


def read(func: Any, args: tuple[Any, ...]) -> tuple[bool, Any]:
    """A value read (``_local_scalar_dense``) answered without running it: (True, value) when the tensor's
    value is known, else (False, None); and ``torch.equal`` of two tensors of one recipe (True)."""
    if func is aten.equal.default and len(args) > 1:
        made = recipe(args[0])
        if made is not None and made == recipe(args[1]):
            return True, True
    if func is aten._local_scalar_dense.default and args:
        t, value = args[0], known(args[0])
        if value is ONES and t.numel() == 1:
            value = 1
        if value is not None and value is not ONES:  # as .item() gives it: by the tensor's dtype
            return True, bool(value) if t.dtype == torch.bool else float(value) if t.is_floating_point() else int(value)
    return False, None


def propagate(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    """Mark ``out`` with the value it is known to hold after ``func`` ran (module docstring)."""
    if not isinstance(out, torch.Tensor):
        return
    if func in _FACTORIES or func in _PURE:
        made = _make_recipe(func, args, kwargs, out)
        if made is not None and _version(out) is not None:
            out.__dict__[_RECIPE] = (_version(out), made)
    if func is aten.eq.Tensor and len(args) > 1:
        made = recipe(args[0])
        if made is not None and made == recipe(args[1]):
            _mark(out, ONES)  # two tensors of one recipe: equal element by element
        return
    if func in _MADE_ONES:
        _mark(out, ONES)
        return
    if func in _FILLED:
        at = _FILLED[func]
        fill = args[at] if len(args) > at else kwargs.get("fill_value", kwargs.get("value"))
        if isinstance(fill, (bool, int, float)) and fill == 1:
            _mark(out, ONES)
        return
    first = args[0] if args else None
    value = known(first)
    if value is None:
        if func is aten.cat.default and args and all(known(t) is ONES for t in args[0]):
            _mark(out, ONES)
        return
    if value is ONES:
        if func in _KEEPS:
            _mark(out, ONES)
        elif func is aten.all.default:
            _mark(out, True)
        elif func is aten.any.default:
            _mark(out, first.numel() > 0)
        elif func is aten.sum.default:
            _mark(out, first.numel())
        elif func in (aten.eq.Scalar, aten.ne.Scalar) and len(args) > 1:
            hit = 1 == args[1]
            _mark(out, ONES if hit == (func is aten.eq.Scalar) else None)
        return
    # a known scalar (a 0-d tensor)
    if func in (aten.eq.Scalar, aten.ne.Scalar) and len(args) > 1 and isinstance(args[1], (bool, int, float)):
        same = value == args[1] if not isinstance(args[1], float) else math.isclose(value, args[1])
        _mark(out, same if func is aten.eq.Scalar else not same)
    elif func in _KEEPS:
        _mark(out, value)
