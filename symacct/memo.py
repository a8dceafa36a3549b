"""A memo of derivations by model family: what a derivation traces at probe sizes, reused within a process.

``derive`` traces the model rebuilt at two sets of probe sizes and costs, checks and factors those traces
(``symacct.pipeline``, passes 3, 5 and 6). None of that depends on the user's own sizes: only on the model's
class, the config the probes build (every setting but the sizes, which the probes replace), the probe sizes,
the options and the cost rules. A second derivation of the same family (another size of the model, another
run of the CLI's commands in one process, a sweep) takes those results from here. The user's own model is
still traced and compared with the probe model every time (``symacct.sameness``): a model that runs other ops
than the memo's probe model (a method patched since, a module swapped) is derived afresh, as the first time.

Keys are built by ``fingerprint``: plain values (numbers, strings, dtypes, tuples, lists, dicts, dataclasses
and plain objects of them) by value, functions and classes by identity (held by the key, so an identity is
never reused), a function with the values it captured and the module globals it names. Anything else makes
no key, and that derivation is not memoised.

``clear()`` empties the memo; ``enabled`` switches it off (``SYMACCT_MEMO=0`` in the environment, read at
import).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
import types
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import torch

SIZE = 8  # families kept, the least recently used dropped first: each holds two traces (a few MB)
_DEPTH = 6  # nested objects followed; deeper is no key
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.memory_format)
# by identity: what cannot change its behaviour under one identity that a key could read (a class's methods
# patched are seen by derive's comparison of the user's model with the probe model)
_BY_IDENTITY = (types.BuiltinFunctionType, types.MethodType, types.ModuleType, type, torch._ops.OpOverload)


class _NoKey(Exception):
    """A value ``fingerprint`` cannot name by value or identity."""


def fingerprint(value: Any) -> Hashable | None:
    """A hashable name of ``value`` equal exactly when the values are (see the module doc), or None."""
    try:
        name = _name(value, _DEPTH)
        hash(name)  # an object named by identity that cannot be hashed: no key
        return name
    except (_NoKey, TypeError, RecursionError):
        return None


def _name(x: Any, depth: int) -> Hashable:
    if isinstance(x, _PLAIN) or isinstance(x, enum.Enum):
        return (type(x), x)
    if isinstance(x, types.FunctionType):
        return _function(x, depth)
    if isinstance(x, _BY_IDENTITY) or callable(x) and not hasattr(x, "__dict__"):
        return ("id", x)
    if depth == 0:
        raise _NoKey
    if isinstance(x, (tuple, list, frozenset, set)):
        items = [_name(v, depth - 1) for v in x]
        return (type(x), tuple(sorted(items, key=repr)) if isinstance(x, (set, frozenset)) else tuple(items))
    if isinstance(x, dict):
        return (type(x), tuple((_name(k, depth - 1), _name(v, depth - 1)) for k, v in x.items()))
    if isinstance(x, torch.Tensor) or isinstance(x, torch.nn.Module):
        raise _NoKey  # values the key would have to read, or state that can change under the same identity
    if isinstance(x, functools.partial):
        return ("partial", _name(x.func, depth - 1), _name(x.args, depth - 1), _name(x.keywords, depth - 1))
    if dataclasses.is_dataclass(x) or hasattr(x, "__dict__"):
        if callable(x):
            return ("id", x)  # a callable object (a loss module's __call__ aside): by identity
        return (type(x), _name(vars(x), depth - 1))
    raise _NoKey


def _function(f: types.FunctionType, depth: int) -> Hashable:
    """A function by identity and by what it reads that can change under one identity: the values its closure
    captured, its defaults, and (for a function given as an option, not one it reaches) the module globals
    its code names (``lambda m, B, S: (torch.randn(B, W),)`` with ``W`` reassigned between two derivations is
    another key)."""
    if depth == 0:
        raise _NoKey
    cells = tuple(_cell(c, depth - 1) for c in f.__closure__ or ())
    read: tuple[Hashable, ...] = ()
    if depth >= _DEPTH - 1:
        read = tuple((n, _name(f.__globals__[n], depth - 1)) for n in f.__code__.co_names if n in f.__globals__)
    return ("fn", f, cells, _name(f.__defaults__, depth - 1), _name(f.__kwdefaults__, depth - 1), read)


def _cell(cell: Any, depth: int) -> Hashable:
    try:
        value = cell.cell_contents
    except ValueError:  # a cell not yet filled
        return ("empty",)
    return _name(value, depth)


@dataclasses.dataclass
class Memo:
    """Derivation results by family key, least recently used first. Counted: ``hits`` (found), ``misses`` (not
    found) and ``stale`` (found, then dropped: the user's model ran other ops than the memo's probe model)."""

    size: int = SIZE
    enabled: bool = os.environ.get("SYMACCT_MEMO", "1") != "0"
    hits: int = 0
    misses: int = 0
    stale: int = 0
    _entries: OrderedDict[Hashable, Any] = dataclasses.field(default_factory=OrderedDict)

    def get(self, key: Hashable | None) -> Any:
        if key is None or not self.enabled:
            return None
        got = self._entries.get(key)
        if got is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return got

    def put(self, key: Hashable | None, value: Any) -> None:
        if key is None or not self.enabled:
            return
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def drop(self, key: Hashable | None) -> None:
        if self._entries.pop(key, None) is not None:
            self.stale += 1

    def clear(self) -> None:
        self._entries.clear()
        self.hits = self.misses = self.stale = 0

    def __len__(self) -> int:
        return len(self._entries)


FAMILIES = Memo()


def clear() -> None:
    """Forget every memoised derivation (the next derive of any model traces afresh)."""
    FAMILIES.clear()
