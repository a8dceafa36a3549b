"""Live bytes over the step, the phase points and the peak.

Conventions (docs/conventions.md, "Memory"):

- a storage lives from the op that makes it until eager PyTorch frees it:
  the trace watches every storage through a weak reference, so Python
  locals, autograd's saved tensors (released as backward consumes them),
  gradients (freed by ``zero_grad(set_to_none=True)`` after the step),
  optimizer states, parameters and what the caller holds (the output and the
  loss) live exactly as long as they do in eager mode;
- "during op t" counts every storage alive at t (inputs and outputs of t);
  the phase points (after forward, after backward, after the optimizer step
  and zero_grad) count what survives between two ops;
- the layer stack: the step is traced with 4 blocks and (the checking
  trace, at other probe sizes) with 5; removing one middle block from the
  second aligns it op for op with the first, and live bytes at a point of
  the real model with L blocks are
  ``live4(t) + (L - 4) * (live5(t') - live4(t))``, each storage of the
  second trace counted by its counterpart's formula in the first
  (``borrowed_intervals``, checked against the bytes it counted; where a
  storage has none, a trace with 5 blocks at the first probe's sizes).

The symbolic peak is ``Max`` over the points that are largest somewhere in a
wide sample of the symbol space, with dominated points pruned (a point is
dominated when its difference to another expands to nonnegative
coefficients only). ``Accounting.at`` does not rely on that envelope: it
evaluates the live bytes of every point exactly at the given sizes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import random
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import numpy as np
import sympy
import torch

from symacct.cost.layers import DROP, align_layers, one_block_less, op_blocks
from symacct.symbols import evaluate, integer_forms, sort_key, sym
from symacct.trace.probe import Probe
from symacct.trace.record import StepTrace

if TYPE_CHECKING:
    from symacct.memory.static import Memory

Expr = Any
Terms = dict[Any, Any]  # monomial -> int or Fraction coefficient: an expanded polynomial, term by term


@dataclass
class Intervals:
    """Lifetimes of the storages of one trace, on op indices (-1: before the step)."""

    n: int  # number of ops
    start: dict[int, float]
    end: dict[int, float]
    nbytes: dict[int, sympy.Expr]

    _layout: tuple[list[sympy.Expr], np.ndarray, np.ndarray, np.ndarray, list[int]] | None = field(
        default=None, repr=False, compare=False
    )
    _forms: Callable[[Mapping[str, int]], list[int]] | None = field(default=None, repr=False, compare=False)

    def layout(self) -> tuple[list[sympy.Expr], np.ndarray, np.ndarray, np.ndarray, list[int]]:
        """The distinct byte formulas, each storage's formula, the slot it starts counting at and the slot it
        stops at (``live``), and how many storages have each formula."""
        if self._layout is None:
            exprs = list(dict.fromkeys(self.nbytes[st] for st in self.start))
            index = {e: i for i, e in enumerate(exprs)}
            group = np.array([index[self.nbytes[st]] for st in self.start], dtype=np.int64)
            lo = np.array([int(s0) + 1 for s0 in self.start.values()], dtype=np.int64)
            hi = np.array([int(min(self.end[st], self.n - 1)) + 2 for st in self.start], dtype=np.int64)
            counts = np.bincount(group, minlength=len(exprs)).tolist()
            self._layout = (exprs, group, lo, hi, counts)
        return self._layout

    def live(self, values: Mapping[str, int]) -> list[int]:
        """Live bytes at the given sizes, exactly: ``out[t + 1]`` during op t (``out[0]`` before the step)."""
        return self.live_array(values).tolist()

    def live_array(self, values: Mapping[str, int]) -> np.ndarray:
        """``live`` as an array: int64 when no total can overflow it, Python integers (dtype object) otherwise.

        Each distinct formula is evaluated once (``integer_forms``); the storages' starts and ends are summed
        in float64 where every partial sum stays below 2**53 (exact there), else in Python integers.
        """
        exprs, group, lo, hi, counts = self.layout()
        if self._forms is None:
            self._forms = integer_forms(tuple(exprs))
        b = self._forms(values)
        total = sum(map(abs, map(operator.mul, b, counts)))
        if total < 2**53:  # every partial sum exact in float64, the result in int64
            per = np.array(b, dtype=np.float64)[group]
            kept = self.__dict__.get("_slots")
            if kept is None or kept[0] is not lo:  # both ends' slots, for this layout
                kept = self.__dict__["_slots"] = (lo, np.concatenate([lo, hi]))
            delta = np.bincount(kept[1], weights=np.concatenate([per, -per]), minlength=self.n + 3)
            return np.cumsum(delta.astype(np.int64))
        big = total >= 2**62
        per = np.array(b, dtype=object if big else np.int64)[group]
        delta = np.zeros(self.n + 3, dtype=object if big else np.int64)
        np.add.at(delta, lo, per)
        np.add.at(delta, hi, -per)
        return np.cumsum(delta)

    def alive_at(self, pos: float) -> list[int]:
        return [s for s in self.start if self.start[s] <= pos <= self.end[s]]

    def symbolic(self, storages: list[int]) -> sympy.Expr:
        return sympy.Add(*(self.nbytes[s] for s in storages))

    def terms(self, storages: list[int]) -> Terms:
        """The expanded sum of the storages' bytes as ``{monomial: coefficient}``."""
        out: dict[sympy.Expr, int | Fraction] = {}
        for e, n in Counter(self.nbytes[s] for s in storages).items():
            for mono, c in _expanded(e):
                out[mono] = out.get(mono, 0) + n * c
        return {m: c for m, c in out.items() if c}


def _lifetimes(trace: StepTrace) -> tuple[dict[int, float], dict[int, float]]:
    """Each storage lives from the op that makes it (or the step's start) to the moment eager frees it."""
    forever = len(trace.ops) + 2.0
    start: dict[int, float] = {st: -1.0 for st in trace.external_storages}
    for rec in trace.ops:
        for m in (*rec.inputs, *rec.outputs, *rec.mutated):
            start.setdefault(m.storage, float(trace.storage_producer.get(m.storage, rec.index)))
    end = {st: trace.storage_end.get(st, forever) for st in start}
    return start, end


def _counted(trace: StepTrace, st: int) -> int:
    nb = trace.storage_nbytes.get(st)
    return _from_ops(trace).get(st, 0) if nb is None else nb


def intervals(trace: StepTrace, probe: Probe) -> Intervals:
    """Lifetimes, and each storage's bytes read as a formula at the probe's sizes."""
    start, end = _lifetimes(trace)
    nbytes = {st: trace.bytes_of(st, probe.to_expr, _counted(trace, st)) for st in start}
    return Intervals(len(trace.ops), start, end, nbytes)


def borrowed_intervals(
    other: StepTrace,
    base: StepTrace,
    base_iv: Intervals,
    align: list[int],
    stacks: list[str],
    values: Mapping[str, int],
) -> Intervals | None:
    """Lifetimes in ``other`` (one block more than ``base``, at other probe sizes ``values``), each storage's
    bytes the formula of its counterpart in ``base``; None where a counterpart is missing or its formula does
    not give the bytes ``other`` counted.

    Counterparts: the tensors of each aligned op pair (``align_layers``); the block ``align_layers`` drops
    (block 2) through block 1 of ``other``, op for op; parameters, buffers and inputs by name, block numbers
    shifted as ``align_layers`` shifts them. Every formula is evaluated at ``values`` and must equal the bytes
    ``other`` counted: the probe sizes are products of distinct primes, so a formula that is not the storage's
    own would not. This spares a trace: the trace that checks the formulas at other sizes also gives the
    liveness of one block more.
    """
    subs = {sym(k): sympy.Integer(v) for k, v in values.items()}
    expr: dict[int, sympy.Expr] = {}

    def pair(o: int, b: int) -> bool:
        e = base_iv.nbytes.get(b)
        if e is None or expr.setdefault(o, e) != e:
            return False
        return True

    base_names = {ph.name: ph.meta.storage for ph in base.placeholders}
    for ph in other.placeholders:
        b = base_names.get(one_block_less(ph.name, stacks))
        if b is None or not pair(ph.meta.storage, b):
            return None
    for t, o in enumerate(align):
        rb, ro = base.ops[t], other.ops[o]
        for mb_list, mo_list in ((rb.inputs, ro.inputs), (rb.outputs, ro.outputs), (rb.mutated, ro.mutated)):
            sb, so = [m.storage for m in mb_list], [m.storage for m in mo_list]
            if len(sb) != len(so):  # a list as long as a size (cat of tp views of one gathered storage)
                sb, so = list(dict.fromkeys(sb)), list(dict.fromkeys(so))
                if len(sb) != len(so):
                    return None
            for b, o in zip(sb, so):
                if not pair(o, b):
                    return None
    blocks = op_blocks(other.ops, stacks)
    by_block: dict[tuple[str, int], list[int]] = defaultdict(list)
    for j, b in enumerate(blocks):
        if b is not None:
            by_block[b].append(j)
    for (stack, i), dropped in by_block.items():
        if i != DROP:
            continue
        twin = by_block.get((stack, 1), [])
        if len(twin) != len(dropped):
            return None
        for j, k in zip(dropped, twin):
            rd, rt = other.ops[j], other.ops[k]
            if str(rd.op) != str(rt.op):
                return None
            for md_list, mt_list in ((rd.inputs, rt.inputs), (rd.outputs, rt.outputs), (rd.mutated, rt.mutated)):
                if len(md_list) != len(mt_list):
                    return None
                for md, mt in zip(md_list, mt_list):
                    e = expr.get(mt.storage)
                    if e is None or expr.setdefault(md.storage, e) != e:
                        return None
    start, end = _lifetimes(other)
    cache: dict[sympy.Expr, int] = {}
    for st in start:
        e = expr.get(st)
        if e is None:
            return None
        if e not in cache:
            cache[e] = int(sympy.sympify(e).xreplace(subs))
        if cache[e] != _counted(other, st):
            return None
    return Intervals(len(other.ops), start, end, {st: expr[st] for st in start})


def _from_ops(trace: StepTrace) -> dict[int, int]:
    """Bytes of each storage as the first op that reads or makes it sees its tensor (for storages the trace did
    not count), worked out once per trace."""
    kept = trace.__dict__.get("_bytes_from_ops")
    if kept is None:
        kept = {}
        for rec in trace.ops:
            for m in (*rec.inputs, *rec.outputs):
                kept.setdefault(m.storage, math.prod(m.shape) * m.itemsize)
        trace.__dict__["_bytes_from_ops"] = kept
    return kept


@dataclass
class Liveness:
    """Live bytes at every op, with the layer stack factored; evaluated exactly by ``evaluate``."""

    base: Intervals  # trace with ``layers`` blocks (or the only trace)
    other: Intervals | None  # trace with ``layers + 1`` blocks, same probe sizes
    align: list[int]  # op index in ``base`` -> op index in ``other``
    layers: int
    labels: list[tuple[int, str, str, str]]  # per op: (index, op, module, phase)
    marks: dict[str, float]  # phase point -> position in ``base``
    other_marks: dict[str, float]
    point_block: list[int | None] = field(default_factory=list)  # probe block of each op (None: outside)
    states: frozenset[int] = frozenset()  # optimizer-state storages of ``base`` (made during the first step)
    other_states: frozenset[int] = frozenset()
    # gradient storages of ``base`` and ``other``: the live bytes of gradients at a point
    grads: frozenset[int] = frozenset()
    other_grads: frozenset[int] = frozenset()
    # parameters, their gradients and states (``StepTrace.owner``), and the activations saved for backward
    # (inputs and buffers left out), of ``base`` and ``other`` (``without``)
    owned: frozenset[int] = frozenset()
    other_owned: frozenset[int] = frozenset()
    saved: frozenset[int] = frozenset()
    other_saved: frozenset[int] = frozenset()
    # per op of ``other``: its probe block (None: outside) and phase (``symacct.parallel.fsdp`` places
    # FSDP2's buffers by them)
    other_point_block: list[int | None] = field(default_factory=list)
    other_phases: list[str] = field(default_factory=list)
    # gradient storage -> the op at which autograd's AccumulateGrad takes it (``grad_ready``), of base and other
    grad_taken: dict[int, int] = field(default_factory=dict)
    other_grad_taken: dict[int, int] = field(default_factory=dict)

    def without(self, drop: Callable[[int, int, bool], bool], brief: bool = False) -> Liveness:
        """The same step without the storages ``drop(storage, op that made it in base, other)`` names (for a
        storage of ``other``, the op of ``base`` aligned with the one that made it; -1: none, or before the
        step); with ``brief``, the gradients kept, each alive from the op that makes it to the one at which
        autograd's AccumulateGrad takes it (``grad_ready``; else the next op): a later micro-batch's gradient is
        added into the one that exists there, and freed."""
        back = {o: b for b, o in enumerate(self.align)}

        def only(iv: Intervals, other: bool) -> Intervals:
            def made(st: int) -> int:
                t = int(iv.start[st])
                return back.get(t, -1) if other else t

            short = (self.other_grads if other else self.grads) if brief else frozenset()
            taken = self.other_grad_taken if other else self.grad_taken
            start = {st: s for st, s in iv.start.items() if st in short or not drop(st, made(st), other)}
            end = {
                st: (_until_taken(e, st, start, taken) if st in short and st in start else e)
                for st, e in iv.end.items()
            }
            return Intervals(iv.n, start, end, iv.nbytes)

        other = only(self.other, True) if self.other is not None else None
        return dataclasses.replace(self, base=only(self.base, False), other=other)

    def steady(self) -> Liveness:
        """The same step once the optimizer's states exist: every step after the first.

        Lazily created states (AdamW's m, v and step, the mixed recipe's
        master weights) are live from the start of the step instead of from
        the op that made them; everything else is the first step's.
        """

        def lift(iv: Intervals, states: frozenset[int]) -> Intervals:
            start = {st: (-1.0 if st in states else s) for st, s in iv.start.items()}
            return Intervals(iv.n, start, iv.end, iv.nbytes)

        other = lift(self.other, self.other_states) if self.other is not None else None
        return dataclasses.replace(self, base=lift(self.base, self.states), other=other)

    def later(self) -> Liveness:
        """Every step after the first (``steady``), with the gradients a step leaves alive at its end (no
        optimizer, so no ``zero_grad``) carried into the next: each is alive from its start, and the new
        gradient lives from the op that makes it to the one at which autograd's AccumulateGrad adds it in
        (``grad_ready``; else the next op), as a later micro-batch's does (``without(brief=True)``). With an
        optimizer, whose ``zero_grad(set_to_none=True)`` frees them, this is ``steady``."""
        steady = self.steady()

        def carry(iv: Intervals, grads: frozenset[int], taken: dict[int, int]) -> tuple[Intervals, frozenset[int]]:
            # alive at the step's end: never freed in it (``_lifetimes``' forever; zero_grad frees at n + 0.25)
            carried = sorted(st for st in grads if st in iv.start and iv.end[st] >= iv.n + 2)
            if not carried:
                return iv, frozenset()
            start, end, nbytes = dict(iv.start), dict(iv.end), dict(iv.nbytes)
            fresh = max(start) + 1
            for k, st in enumerate(carried):  # the last step's gradient, under a storage id of its own
                start[fresh + k], end[fresh + k], nbytes[fresh + k] = -1.0, iv.end[st], iv.nbytes[st]
                end[st] = _until_taken(iv.end[st], st, start, taken)
            return Intervals(iv.n, start, end, nbytes), frozenset(range(fresh, fresh + len(carried)))

        base, held = carry(steady.base, self.grads, self.grad_taken)
        if not held:
            return steady
        other, other_held = (
            carry(steady.other, self.other_grads, self.other_grad_taken)
            if steady.other is not None
            else (None, frozenset())
        )
        return dataclasses.replace(
            steady,
            base=base,
            other=other,
            grads=self.grads | held,
            other_grads=self.other_grads | other_held,
            owned=self.owned | held,
            other_owned=self.other_owned | other_held,
        )

    def mark_value(self, name: str, values: Mapping[str, int]) -> int:
        """Live bytes at a phase point, evaluated exactly."""
        return evaluate(self.at_mark(name), dict(values))

    def _valid(self, L: int) -> np.ndarray:
        """Per op of the probe, whether it stands for a point of a model with L blocks (ops outside the stack
        and in block 0 always; the last block's for L >= 2, a middle block's for L >= 3)."""
        cached = self.__dict__.get("_blocks")
        if cached is None or cached[0] is not self.point_block:
            blocks = np.array([-1 if b is None else b for b in self.point_block], dtype=np.int64)
            cached = self.__dict__["_blocks"] = (self.point_block, blocks, {})
        blocks, masks = cached[1], cached[2]
        if not len(blocks):
            return np.ones(self.base.n, dtype=bool)
        key = min(L, 3)  # the mask is the same for every L >= 3
        if key not in masks:
            last = blocks == self.layers - 1
            masks[key] = (blocks <= 0) | (last & (L >= 2)) | (~last & (L >= 3))
        got: np.ndarray = masks[key]
        return got

    def evaluate(self, values: Mapping[str, int], phases: tuple[str, ...] | None = None) -> tuple[int, int]:
        """(peak bytes, op index) at the given sizes, exactly; over the ops of ``phases`` only, if given."""
        chosen = [t for t in range(self.base.n) if phases is None or self.labels[t][3] in phases]
        if not chosen:
            raise ValueError(f"no op in phases {phases}")
        ops, got = self.during_array(values, chosen)
        best = int(np.argmax(got))
        return int(got[best]), int(ops[best])

    def during(self, values: Mapping[str, int], ops: list[int]) -> dict[int, int]:
        """Live bytes during each of ``ops`` at the given sizes, exactly (the ops a model with L blocks has)."""
        kept, got = self.during_array(values, ops)
        return dict(zip(kept.tolist(), got.tolist()))

    def during_array(self, values: Mapping[str, int], ops: list[int] | range) -> tuple[np.ndarray, np.ndarray]:
        """``during`` as two arrays: the ops a model with L blocks has, in the order given, and their bytes."""
        t = np.arange(ops.start, ops.stop, dtype=np.int64) if isinstance(ops, range) else np.asarray(ops, np.int64)
        live = self.base.live_array(values)
        if self.other is None:
            return t, live[t + 1]
        L = values.get("L", self.layers)
        t = t[self._valid(L)[t]]
        live2 = self.other.live_array(values)
        kept = self.__dict__.get("_align")
        if kept is None or kept[0] is not self.align:
            kept = self.__dict__["_align"] = (self.align, np.asarray(self.align, dtype=np.int64))
        here, there, k = live[t + 1], live2[kept[1][t] + 1], L - self.layers
        wide = live.dtype == object or live2.dtype == object
        if wide or (_magnitude(here) + _magnitude(there)) * (abs(k) + 1) >= 2**62:  # int64 could overflow
            here, there = here.astype(object), there.astype(object)
        return t, here + k * (there - here)

    def point_terms(self, t: int) -> Terms:
        """Live bytes during op t as ``{monomial: coefficient}`` (``at_point`` expanded, term by term)."""
        return self._factored(self.base.alive_at(t), self.other.alive_at(self.align[t]) if self.other else None)

    def at_point(self, t: int) -> sympy.Expr:
        return _expr(self.point_terms(t))

    def grads_at_point(self, t: int) -> sympy.Expr:
        """Live bytes of gradients during op t (as ``at_point``)."""
        base = [s for s in self.base.alive_at(t) if s in self.grads]
        other = None
        if self.other is not None:
            other = [s for s in self.other.alive_at(self.align[t]) if s in self.other_grads]
        return _expr(self._factored(base, other))

    def at_mark(self, name: str) -> sympy.Expr:
        pos = self.marks[name]
        base = [s for s in self.base.start if self.base.start[s] < pos < self.base.end[s]]
        other = None
        if self.other is not None:
            pos2 = self.other_marks[name]
            other = [s for s in self.other.start if self.other.start[s] < pos2 < self.other.end[s]]
        return _expr(self._factored(base, other))

    def _factored(self, base: list[int], other: list[int] | None) -> Terms:
        """The bytes of ``base``'s storages, plus (L - layers) times the difference ``other``'s make: the
        expansion of ``e + (L - layers) (e2 - e)``, term by term."""
        e = self.base.terms(base)
        if other is None or self.other is None:
            return e
        e2 = self.other.terms(other)
        out = dict(e)
        L = sym("L")
        for mono in e.keys() | e2.keys():
            c = e2.get(mono, 0) - e.get(mono, 0)
            if c:
                out[mono] = out.get(mono, 0) - self.layers * c
                out[L * mono] = out.get(L * mono, 0) + c
        return {m: c for m, c in out.items() if c}

    def symbolic_peak(
        self, names: list[str], samples: int = 48, seed: int = 0, ops: list[int] | None = None
    ) -> tuple[Expr, list[int]]:
        """Max over the points largest somewhere in a log-uniform sample of the sizes; dominated ones pruned.
        ``ops``: over these ops only (default all)."""
        rng = random.Random(seed)
        chosen = list(range(self.base.n)) if ops is None else ops
        candidates: set[int] = set()
        for _ in range(samples):
            values = {n: int(2 ** rng.uniform(0, 14)) + 1 for n in names}
            if "L" in values:
                values["L"] = self.layers + int(2 ** rng.uniform(0, 8))
            if "S_max" in values and "S" in values:
                values["S_max"] = max(values["S_max"], values["S"])
            kept, got = self.during_array(values, chosen)
            if len(kept):
                candidates.add(int(kept[int(np.argmax(got))]))
        if not candidates:
            return sympy.Integer(0), []
        terms = {t: self.point_terms(t) for t in sorted(candidates)}
        keep = []
        for t, e in terms.items():
            dominated = any(u != t and (terms[u] != e or u < t) and _covers(terms[u], e) for u in terms)
            if not dominated:
                keep.append(t)
        if len(keep) == 1:
            return _expr(terms[keep[0]]), keep
        return sympy.Max(*(_expr(terms[t]) for t in keep), evaluate=False), keep  # already pruned


def _magnitude(a: np.ndarray) -> int:
    return int(np.abs(a).max()) if len(a) else 0


def _covers(a: Terms, b: Terms) -> bool:
    """True when every coefficient of the expanded ``a - b`` is >= 0 (so a >= b for positive symbols: b is
    dominated)."""
    return all(a.get(m, 0) - c >= 0 for m, c in b.items()) and all(c >= 0 for m, c in a.items() if m not in b)


@functools.lru_cache(maxsize=65536)
def _expanded(expr: sympy.Expr) -> tuple[tuple[sympy.Expr, int | Fraction], ...]:
    """``expr`` expanded, as (monomial, exact coefficient) pairs."""
    out = []
    for mono, c in sympy.expand(expr).as_coefficients_dict().items():
        if c:
            out.append((mono, int(c) if c.is_Integer else Fraction(int(c.p), int(c.q))))
    return tuple(out)


def _expr(terms: Terms) -> sympy.Expr:
    """The sum ``terms`` stands for (what ``sympy.expand`` gives for it)."""
    return sympy.Add(
        *(
            (sympy.Integer(c) if isinstance(c, int) else sympy.Rational(c.numerator, c.denominator)) * m
            for m, c in terms.items()
        )
    )


def _until_taken(end: float, st: int, start: Mapping[int, float], taken: Mapping[int, int]) -> float:
    """A gradient's end where a gradient already exists: the op at which autograd's AccumulateGrad adds it in
    (``grad_ready``; else the op after the one that made it), or its own end if that comes first."""
    return min(end, taken.get(st, start[st] + 1))


def liveness(
    base: StepTrace,
    other: StepTrace | None,
    probe: Probe,
    stacks: list[str],
    layers: int,
    other_values: Mapping[str, int] | None = None,
) -> Liveness | None:
    """Live bytes over the step of ``base``; with ``other`` (one block more), factored by L.

    ``other`` at the same probe sizes has its bytes read by ``probe``; at other sizes (``other_values``, the
    checking trace) they are borrowed from ``base`` (``borrowed_intervals``). None when the two do not align
    (or, at other sizes, a storage's bytes cannot be borrowed).
    """
    iv = intervals(base, probe)
    labels = [(r.index, str(r.op), r.module, r.phase) for r in base.ops]
    marks = _mark_positions(base)
    states = frozenset(base.state_storages)
    grads = frozenset(base.grad_storages)
    owned, saved = frozenset(base.owner), _saved(base)
    if other is None:
        return Liveness(
            iv,
            None,
            [],
            layers,
            labels,
            marks,
            {},
            states=states,
            grads=grads,
            owned=owned,
            saved=saved,
            grad_taken=grad_ready(base),
        )
    align = align_layers(base, other, stacks, layers)
    if align is None:
        return None
    if other_values is None:
        other_iv: Intervals | None = intervals(other, probe)
    else:
        other_iv = borrowed_intervals(other, base, iv, align, stacks, other_values)
        if other_iv is None:
            return None
    blocks = [b[1] if b is not None else None for b in op_blocks(base.ops, stacks)]
    return Liveness(
        iv,
        other_iv,
        align,
        layers,
        labels,
        marks,
        _mark_positions(other),
        blocks,
        states,
        frozenset(other.state_storages),
        grads,
        frozenset(other.grad_storages),
        owned,
        frozenset(other.owner),
        saved,
        _saved(other),
        [b[1] if b is not None else None for b in op_blocks(other.ops, stacks)],
        [r.phase for r in other.ops],
        grad_ready(base),
        grad_ready(other),
    )


def grad_ready(trace: StepTrace) -> dict[int, int]:
    """Each gradient's AccumulateGrad point: the first ``detach`` of its storage after the op that made it.
    In a first backward AccumulateGrad keeps a new gradient by ``new_grad.detach()`` (torch's
    ``accumulate_grad.h``: nothing to add it to yet); with a gradient already there it runs ``grad +=
    new_grad`` at that point instead, and the new one is freed. Autograd runs an AccumulateGrad node as soon
    as the node that made its input finishes, which can be several ops after that input was made (a linear
    layer's bias gradient after its weight's)."""
    grads = set(trace.grad_storages)
    made = {st: trace.storage_producer.get(st, -1) for st in grads}
    out: dict[int, int] = {}
    for rec in trace.ops:
        if rec.phase == "backward" and rec.op is torch.ops.aten.detach.default:
            for m in rec.inputs:
                if m.storage in grads and m.storage not in out and rec.index > made[m.storage]:
                    out[m.storage] = rec.index
    return out


def _saved(trace: StepTrace) -> frozenset[int]:
    """The storages saved for backward, the inputs and buffers among them left out."""
    return frozenset(st for st in trace.saved_storages if st not in trace.external_storages)


def _mark_positions(trace: StepTrace) -> dict[str, float]:
    n = len(trace.ops)
    out = {k: v - 0.5 for k, v in trace.marks.items()}
    if "after_optimizer" in out:
        out["after_optimizer"] = n + 0.5
    return out


def fill_phases(mem: Memory, live: Liveness, names: list[str]) -> None:
    """Phase points and the symbolic peak."""
    for mark in ("after_forward", "after_backward", "after_optimizer"):
        if mark in live.marks:
            setattr(mem, mark, live.at_mark(mark))
    mem.peak, points = live.symbolic_peak(sorted(names, key=sort_key))
    mem.peak_at = [f"#{t} {live.labels[t][1]} in '{live.labels[t][2]}' ({live.labels[t][3]})" for t in points]
