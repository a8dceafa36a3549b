"""A loop over a size, seen while it runs: the probe refuses it at once instead of after its traces.

A forward that walks a dimension index by index (``for t in range(S): h = cell(x[:, t], h)``, a recurrent
scan such as transformers' Mamba on the CPU, PyTorch's own ``nn.RNN`` and ``nn.GRU``, whose CPU kernels
step through time op by op) runs its body once per element, so its op count grows with the
size and the step cannot be factored: the comparison of the two probe traces refuses it as size-dependent
control flow. At probe sizes (primes in the hundreds) and four blocks, those two traces can take many
minutes before that refusal.

The walk shows in the indexing: a ``select`` (``x[:, t]``) or a one-wide ``slice`` (``x[:, t:t + 1]``) of
the same tensor along the same dimension at every index of it, or every piece of an ``unbind`` (``for x_t
in x.unbind(1)``, ``for row in x``) or of a split into one-wide pieces, taken by ops one at a time. When
the dimension's size holds a prime of the probe's symbols (a constant dimension, three colour channels or
a fixed window, holds none) and every index of it has been read, the op count depends on a size whatever
the rest of the step does: the probe stops there, naming the dimension and the symbols of its size.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import sympy
import torch
from torch.utils.weak import WeakIdKeyDictionary

from symacct.errors import SymacctError

aten = torch.ops.aten
INDEXING = frozenset({aten.select.int, aten.slice.Tensor})  # the ops a walk over a dimension reads it with
SPLITTING = frozenset({aten.unbind.int, aten.split.Tensor})  # the ops that cut a dimension into pieces


@dataclasses.dataclass(frozen=True)
class Walk:
    """A dimension read index by index: the tensor's shape, the dimension, the symbols its size holds."""

    shape: tuple[int, ...]
    dim: int
    names: tuple[str, ...]


def walk_refusal(walk: Walk, *, node: str, module: str, op: str) -> SymacctError:
    """The refusal of a loop over a size, naming the sizes it walks (``SymacctError.sizes``)."""
    names = ", ".join(walk.names)
    return SymacctError(
        f"the step reads a dimension of {names} index by index, every index in turn: a loop over a size "
        "(size-dependent control flow), whose op count grows with it",
        node=node,
        module=module,
        op=op,
        shapes=[walk.shape],
        hint=f"the loop walks dimension {walk.dim} ({walk.shape[walk.dim]} at probe sizes); symacct factors a "
        "step by its layers only, so a loop must run the same number of times at every size: write it as "
        "tensor ops over the whole dimension (a scan as cumsum or cumprod), or make its count a fixed field of "
        "the config. PyTorch's own nn.RNN and nn.GRU step through time this way on the CPU",
        sizes=walk.names,
    )


class SizeLoops:
    """Indices read one by one from each tensor's dimensions, in the forward of a probe trace.

    ``primes``: the probe's own primes, each with its symbol's name (a size that holds one depends on that
    symbol). ``index`` sees a ``select`` or a one-wide ``slice``; ``split`` sees an ``unbind`` (what
    iterating over a tensor runs) or a split into one-wide pieces, whose pieces ``use`` then sees taken one
    op at a time (a list of them handed to one op, ``torch.stack``, is not a walk). Each returns the walk
    this op completes, else None.
    """

    def __init__(self, primes: dict[int, str]) -> None:
        self.primes = primes
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> {dim: indices read}
        # piece -> (a weak reference to its source, dim, index): nothing here keeps a tensor alive
        self._pieces: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._sized: dict[int, bool] = {}  # size -> whether it holds a probe prime

    @property
    def watching(self) -> bool:
        """Whether pieces of a split are waiting to be used."""
        return len(self._pieces) > 0

    def _symbolic(self, size: int) -> bool:
        known = self._sized.get(size)
        if known is None:
            known = self._sized[size] = size > 1 and any(p in self.primes for p in sympy.factorint(size))
        return known

    def _read(self, t: torch.Tensor, dim: int, index: int) -> Walk | None:
        size = int(t.shape[dim])
        per_dim = self._seen.get(t)
        if per_dim is None:
            per_dim = self._seen[t] = {}
        read = per_dim.setdefault(dim, set())
        read.add(index % size)
        if len(read) < size:
            return None
        names = tuple(sorted({self.primes[p] for p in sympy.factorint(size) if p in self.primes}))
        return Walk(tuple(int(d) for d in t.shape), dim, names)

    def _dim(self, t: Any, dim: Any) -> int | None:
        """``dim`` of ``t`` made non-negative, where ``t`` is a tensor and that dimension's size is symbolic."""
        if not isinstance(t, torch.Tensor) or not isinstance(dim, int) or t.dim() == 0:
            return None
        dim %= t.dim()
        return dim if self._symbolic(int(t.shape[dim])) else None

    def index(self, func: Any, args: tuple[Any, ...]) -> Walk | None:
        if func is aten.select.int and len(args) == 3:
            t, dim, index = args
        elif func is aten.slice.Tensor and len(args) in (4, 5) and (len(args) == 4 or args[4] == 1):
            t, dim, start, end = args[:4]
            if not (isinstance(start, int) and isinstance(end, int) and end - start == 1):
                return None
            index = start
        else:
            return None
        d = self._dim(t, dim)
        return self._read(t, d, index) if d is not None and isinstance(index, int) else None

    def split(self, func: Any, args: tuple[Any, ...], out: Any) -> None:
        if func is aten.unbind.int:
            t, dim = args[0], args[1] if len(args) > 1 else 0
        elif func is aten.split.Tensor and len(args) > 1 and args[1] == 1:
            t, dim = args[0], args[2] if len(args) > 2 else 0
        else:
            return
        d = self._dim(t, dim)
        if d is not None and isinstance(out, (list, tuple)):
            source = weakref.ref(t)
            for i, piece in enumerate(out):
                self._pieces[piece] = (source, d, i)

    def use(self, args: tuple[Any, ...]) -> Walk | None:
        for a in args:
            if isinstance(a, torch.Tensor):
                piece = self._pieces.get(a)
                source = piece[0]() if piece is not None else None
                if source is not None:
                    walk = self._read(source, piece[1], piece[2])
                    if walk is not None:
                        return walk
        return None
