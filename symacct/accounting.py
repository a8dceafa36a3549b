"""The result of ``derive``: formulas per phase, module and component.

Every quantity is a sympy expression in the model's symbols, stored expanded
(printing collects by monomials). ``acct.at(B=8, S=1024)`` returns the same
structure with integers, every config symbol defaulting to the model's own
value; ``acct.sweep("flops.total", B=array, ...)`` evaluates one formula over
numpy arrays.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import networkx as nx
import numpy as np
import sympy

from symacct.cost.graph import FUSED_ATTENTION, Node, component, records
from symacct.cost.layers import generic_path
from symacct.cost.rules import Cost
from symacct.errors import SymacctError
from symacct.formula import overview_latex, overview_md
from symacct.memory.liveness import Liveness
from symacct.memory.reserved import Reserved, Timeline, replay_steps
from symacct.memory.static import Memory
from symacct.symbols import Terms, sort_key, sym
from symacct.time.hardware import get as get_hardware
from symacct.time.model import train_time
from symacct.trace.constraints import Constraint
from symacct.trace.constraints import check as check_constraints
from symacct.trace.probe import Probe
from symacct.trace.record import StepTrace

if TYPE_CHECKING:
    import torch.fx

Expr = Any  # sympy.Expr, or int once evaluated

_MATMUL_OPS = ("aten.bmm.", "aten.mm.", "aten.baddbmm.", "aten.addmm.")


@dataclass
class Flops:
    """FLOPs of one step. Matmul family (2 per multiply-add, as flop_counter) by phase; the rest in ``other``."""

    forward: Expr = 0
    backward: Expr = 0  # model FLOPs of the backward: without what kernels recompute
    optimizer: Expr = 0
    total: Expr = 0  # forward + backward + optimizer, matmul family: model FLOPs (PaLM's; MFU uses these)
    # matmul FLOPs run again: forward ops of activation checkpointing, and what fused kernels recompute
    # in backward (flash attention's Q K^T); in hardware, not in model FLOPs
    recompute: Expr = 0
    hardware: Expr = 0  # total + recompute: what the kernels execute (HFU uses these)
    embedding: Expr = 0  # part of forward/backward/total from embedding_flops="matmul" (0 with "lookup")
    other: Expr = 0  # every non-matmul FLOP of the step (elementwise, reductions, norms, softmax)
    other_forward: Expr = 0
    other_backward: Expr = 0
    other_optimizer: Expr = 0
    other_recompute: Expr = 0


@dataclass
class Bytes:
    """Bytes moved by the step's ops (views move 0)."""

    read: Expr = 0
    written: Expr = 0
    read_forward: Expr = 0
    written_forward: Expr = 0
    read_backward: Expr = 0
    written_backward: Expr = 0


def size_one_note(ones: list[str]) -> str:
    """The note ``at`` adds where sizes (or products of them) are 1: the convention the figures keep there."""
    return (
        f"{', '.join(ones)} = 1: byte figures are derived for sizes >= 2; at size 1 PyTorch may take a view instead "
        "of a copy (or the reverse), or skip a reduction over the size of 1 (a gradient summed over a broadcast "
        "batch), so bytes and the other FLOPs can differ (the matmuls' FLOPs do not at B = 1 or at a length of 1: "
        "pass 4 compares them there)"
    )


@dataclass
class Accounting:
    """Formulas derived from one traced step; see the module docstring."""

    graph: nx.DiGraph
    flops: Flops
    bytes: Bytes
    params: Expr  # parameter count N (tied weights once)
    params_embedding: Expr  # parameters of nn.Embedding tables
    modules: dict[str, dict[str, Expr]]  # module path ('blocks.*.attn') -> metric -> formula
    components: dict[str, dict[str, Expr]]  # embedding / attention / mlp / norm / head / loss / other
    per_layer: dict[str, dict[str, Expr]]  # stack path -> metric -> formula of one repeated block
    symbols: dict[str, int]  # letter -> the model's own value (B and S have none)
    fields: dict[str, str]  # letter -> config field
    unaccounted: list[str] = field(default_factory=list)  # ops without a rule (strict=False)
    notes: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    values: dict[str, int] | None = None  # set on an evaluated copy
    minimum: dict[str, int] = field(default_factory=dict)  # least value for which the formulas hold
    memory: Memory = field(default_factory=Memory)  # bytes: static, activations, phase points, peak
    liveness: Liveness | None = field(default=None, repr=False)  # for exact peaks in at()
    constraints: list[Constraint] = field(default_factory=list)  # sizes the model can run (symacct.trace.constraints)
    # sizes that are no symbol in this derivation: letter -> the letter it follows (H_kv = H) or its kept value
    tied: dict[str, str | int] = field(default_factory=dict)
    # mixture-of-experts layers: routed (token, expert) pairs and their split over the experts (symacct.cost.experts)
    experts: list[Any] = field(default_factory=list)
    # input sizes besides B and S, with the size each takes when at() is not given it (S_dec -> S)
    input_sizes: dict[str, str | None] = field(default_factory=dict)
    # the probe trace the graph was costed from: its ops' arguments, for acct.fx
    step: StepTrace | None = field(default=None, repr=False)
    # blocks -> the step's storage timeline with that many blocks (symacct.memory.reserved), for reserved()
    timelines: Callable[[int | None], Timeline] | None = field(default=None, repr=False)

    @property
    def fx(self) -> torch.fx.GraphModule:
        """The traced step as a ``torch.fx.GraphModule`` of aten ops (forward, backward, optimizer), each
        node's ``meta["symacct"]`` the graph's record of it (``symacct.cost.fx.graph_module``); on an
        evaluated copy the records hold numbers."""
        from symacct.cost.fx import graph_module

        if self.step is None:
            raise SymacctError("this accounting keeps no trace", hint="take acct.fx from a derive() result")
        return graph_module(self.step, self.graph)

    @property
    def saved_bytes(self) -> Expr:
        """Bytes of the activations saved for backward (``memory.activations``)."""
        return self.memory.activations

    # ---- notebooks ---------------------------------------------------------------
    def _repr_markdown_(self) -> str:
        """Jupyter: the main formulas as a Markdown table (values on an evaluated copy)."""
        return overview_md(self)

    def _repr_latex_(self) -> str:
        """Jupyter: the main formulas as one LaTeX ``aligned`` block."""
        return overview_latex(self)

    # ---- evaluation -------------------------------------------------------------
    def free_symbols(self) -> list[str]:
        """Letters that appear in the formulas, in the fixed print order."""
        names: set[str] = set()
        for e in self._flat().values():
            if isinstance(e, sympy.Basic):
                names |= {s.name for s in e.free_symbols}
        return sorted(names, key=sort_key)

    def _exact_peaks(self, full: Mapping[str, Any]) -> np.ndarray:
        """The peak at every point of broadcast size arrays, each by ``Liveness.evaluate``."""
        names = list(full)
        grids = np.broadcast_arrays(*(np.asarray(full[n]) for n in names))
        shape = grids[0].shape
        flat = [g.reshape(-1).tolist() for g in grids]
        peaks = []
        for point in zip(*flat):
            values = self._with_tied({n: int(v) for n, v in zip(names, point)})
            peaks.append(self.liveness.evaluate(values)[0])
        return _as_array(peaks, shape)

    def _with_tied(self, values: dict[str, int]) -> dict[str, int]:
        """``values`` with the sizes that are no symbol here (tied to another, or kept) at the value they have."""
        for k, target in self.tied.items():
            value = values.get(target, self.symbols.get(target)) if isinstance(target, str) else target
            if value is not None:
                values.setdefault(k, value)
        return values

    def _subs(self, values: Mapping[str, Any]) -> dict[sympy.Symbol, int]:
        full = self._validate(values)
        return {sym(k): int(v) for k, v in full.items()}

    def with_defaults(self, **values: int) -> dict[str, int]:
        """``values`` with the model's own sizes for the other symbols and the input sizes that follow another
        (S_dec = S) filled in: no check (``at`` checks)."""
        out = {**self.symbols, **values}
        for k, like in self.input_sizes.items():
            if k not in out and like in out:
                out[k] = out[like]
        return out

    def _untie(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """Drop the sizes that are no symbol here (``tied``) when given at the value they have: H_kv equal to
        H when it follows H, a kept size at its value; another value is refused (the derivation does not
        cover it)."""
        out = dict(values)
        for k, target in self.tied.items():
            if k not in out:
                continue
            v = out.pop(k)
            want = out.get(target, self.symbols.get(target)) if isinstance(target, str) else target
            if want is not None and not np.all(np.asarray(v) == np.asarray(want)):
                raise SymacctError(
                    f"{k}={v} is not a size of this derivation: {k} "
                    + (f"follows {target} (= {want})" if isinstance(target, str) else f"is kept at {target}"),
                    hint=f"derive a model whose {self.fields.get(k, k)} is {v} for figures at that size",
                )
        return out

    def _validate(self, values: Mapping[str, Any], *, arrays: bool = False) -> dict[str, Any]:
        """Every size checked, as ``at`` and ``sweep`` both need: names, positive integers, minimums, constraints.

        With ``arrays`` the values may be numpy arrays (broadcast together);
        the result maps every free symbol to an int64 array (or an int).
        """
        values = self._untie(values)
        for k, like in self.input_sizes.items():  # a decoder as long as the encoder unless told
            if k not in values and like is not None and like in values:
                values[k] = values[like]
        if "S" in values and self.options.get("step") == "decode":
            raise SymacctError(
                "a decode step runs one new token a sequence: S is 1, no symbol",
                hint="give the context as C (positions in the KV cache before the step): acct.at(B=..., C=...)",
            )
        unknown = [k for k in values if k not in self.symbols and k not in ("B", "S", *self.input_sizes)]
        if unknown:
            by_field = {f: letter for letter, f in self.fields.items()}
            named = [f"{k} is the config field of {by_field[k]}: pass {by_field[k]}=" for k in unknown if k in by_field]
            raise SymacctError(
                f"unknown symbol(s) {', '.join(unknown)}",
                hint="; ".join(named) if named else "symbols of this model: " + ", ".join(self.free_symbols()),
            )
        full: dict[str, Any] = {**self.symbols, **values}
        for k in [*values, *(k for k in full if k not in values)]:  # the caller's values first
            full[k] = _sizes(k, full[k], arrays)
            low = self.minimum.get(k, 1)
            if np.any(np.asarray(full[k]) < low):
                bad = _first(full[k], lambda a, low=low: a < low)
                raise SymacctError(
                    f"{k}={bad} is below {low}, the least value for which these formulas hold",
                    hint="the first and last blocks differ from the others; derive the model at that size instead",
                )
        missing = [n for n in self.free_symbols() if n not in full]
        if missing:
            raise SymacctError(
                f"no value for {', '.join(missing)}",
                hint="pass them to at(), e.g. acct.at(" + ", ".join(f"{m}=..." for m in missing) + ")",
            )
        if arrays:
            try:
                np.broadcast_shapes(*(np.shape(v) for v in full.values()))
            except ValueError as e:
                shapes = ", ".join(f"{k}: {np.shape(v)}" for k, v in full.items() if np.shape(v))
                raise SymacctError(
                    f"the size arrays do not broadcast together ({shapes})",
                    hint="pass arrays of one length, or shapes numpy broadcasts (e.g. B[:, None] and S[None, :])",
                ) from e
        broken = check_constraints(self.constraints, full)
        if broken is not None:
            c, at = broken
            vals = ", ".join(f"{k}={v}" for k, v in sorted(at.items(), key=lambda kv: sort_key(kv[0])))
            fields = ", ".join(f"{self.fields[s]} ({s})" for s in sorted(c.symbols(), key=sort_key) if s in self.fields)
            if c.path:
                what = (
                    f"the formulas hold on one side only: {vals} breaks {c.describe()} (from {c.where}); the model "
                    "takes another path there than the one derived"
                )
                hint = (
                    "choose sizes on the side derived, the side the probe's sizes fell on: the other side is "
                    "another path, which this derivation did not trace (a sliding window: docs/serving.md)"
                )
            elif c.rounds:
                what = (
                    f"the formulas hold where {c.describe()}: at {vals} {c.where} rounds a size down, which the "
                    "derived formulas do not follow"
                )
                hint = f"choose sizes where {c.describe()}"
            else:
                what = f"the model cannot run these sizes: {vals} breaks {c.describe()} (from {c.where})"
                hint = "choose sizes the model runs" + (
                    f", or change the config fields they come from: {fields}" if fields else ""
                )
            raise SymacctError(what, hint=hint)
        return full

    def values_at(self, **values: int) -> dict[str, int]:
        """The sizes ``at`` would evaluate at, checked as ``at`` checks them (defaults, tied sizes filled in),
        without evaluating anything: for callers that evaluate a few formulas themselves."""
        return self._with_tied({s.name: v for s, v in self._subs(values).items()})

    def at(self, **values: int) -> Accounting:
        """The same accounting with every formula evaluated (config symbols default to the model's values)."""
        subs = self._subs(values)

        def ev(x: Any) -> Any:
            if isinstance(x, sympy.Basic):
                r = sympy.sympify(x.xreplace(subs))
                return int(r) if r.is_Integer else r
            if isinstance(x, dict):
                return {k: ev(v) for k, v in x.items()}
            if dataclasses.is_dataclass(x) and not isinstance(x, type):
                return type(x)(**{f.name: ev(getattr(x, f.name)) for f in dataclasses.fields(x)})
            return x

        g = nx.DiGraph()
        for n, node in records(self.graph):
            g.add_node(n, node=node.evaluated(ev))
        g.add_edges_from(self.graph.edges)
        kw = {
            f.name: ev(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name not in ("graph", "liveness")
        }
        kw["values"] = self._with_tied({s.name: v for s, v in subs.items()})
        kw["liveness"] = self.liveness
        if self.liveness is not None:
            # the exact peak at these sizes (every op of the step), not the sampled envelope
            peak, t = self.liveness.evaluate(kw["values"])
            _, op, module, phase = self.liveness.labels[t]
            kw["memory"] = dataclasses.replace(kw["memory"], peak=peak, peak_at=[f"#{t} {op} in '{module}' ({phase})"])
        ones = self._unit_sizes(subs)
        if ones:
            kw["notes"] = [*kw["notes"], size_one_note(ones)]
        return Accounting(graph=g, **kw)

    def peak(self, **values: int) -> int:
        """The exact peak bytes at these sizes (the liveness pass only: fast, for searches)."""
        if self.liveness is None:
            raise SymacctError("no liveness for this accounting", hint="see acct.notes")
        full = {s.name: v for s, v in self._subs(values).items()}
        return self.liveness.evaluate(full)[0]

    def peak_every_step(self, **values: int) -> int:
        """The exact peak a run of many steps holds at these sizes: the larger of the first step's (``peak``)
        and a later step's (``steady``: the optimizer's states alive from its start). What must fit for a
        training run to get past its first step; for a step without an optimizer, a later step carries the
        last one's gradients in (they accumulate: ``Liveness.later``)."""
        if self.liveness is None:
            raise SymacctError("no liveness for this accounting", hint="see acct.notes")
        full = {s.name: v for s, v in self._subs(values).items()}
        first = self.liveness.evaluate(full)[0]
        if self.options.get("step", "train") != "train":  # inference: no optimizer, every step is the first
            return first
        cached = self.__dict__.get("_steady_liveness")
        if cached is None or cached[0] is not self.liveness:  # lifted once per liveness (searches call this often)
            cached = self.__dict__["_steady_liveness"] = (self.liveness, self.liveness.later())
        return max(first, cached[1].evaluate(full)[0])

    def steady(self, **values: int) -> dict[str, int]:
        """Memory of every step after the first (optimizer states live from the start; without an optimizer,
        the last step's gradients, into which the new ones accumulate: ``Liveness.later``), exactly.

        Keys: ``after_forward``, ``after_backward``, ``after_optimizer``, ``peak``
        (bytes). The first step, which creates the states, is ``at(...).memory``.
        """
        if self.liveness is None:
            raise SymacctError("no liveness for this accounting", hint="see acct.notes")
        full = {s.name: v for s, v in self._subs(values).items()}
        live = self.liveness.later()
        out = {m: live.mark_value(m, full) for m in ("after_forward", "after_backward", "after_optimizer")}
        out["peak"] = live.evaluate(full)[0]
        return out

    def reserved(self, *, steps: int = 1, warmup: bool = False, hardware: Any = None, **values: int) -> Reserved:
        """What PyTorch's CUDA caching allocator reserves for ``steps`` training steps at these sizes:
        ``torch.cuda.max_memory_reserved()``, with ``max_memory_allocated()`` as the allocator counts it
        (blocks rounded to 512 bytes, unsplit remainders), by replaying the step's storage timeline through
        a model of the allocator (``symacct.memory.reserved``). ``hardware`` adds its cuBLAS workspace, and
        its CUDA context as ``Reserved.context`` (outside the allocator: ``device_peak`` adds it);
        ``warmup`` first runs one forward and backward, as ``symacct verify`` does on a GPU.

        The timeline of a model with L blocks is traced once per L (on fake tensors, at the probe's sizes).
        """
        if self.timelines is None or self.liveness is None:
            raise SymacctError("this accounting keeps no storage timeline", hint="call reserved() on a derive() result")
        if steps < 1:
            raise SymacctError(f"steps={steps}: at least one step", hint="pass steps=1 or more")
        workspace = context = 0
        if hardware is not None:
            hw = get_hardware(hardware)
            if hw.cublas_workspace is None:
                raise SymacctError(
                    f"{hw.name} has no cuBLAS workspace figure in the catalog",
                    hint="reserved() models the CUDA caching allocator; give a CUDA GPU, or none",
                )
            workspace, context = hw.cublas_workspace, hw.cuda_context or 0
        full = self.values_at(**values)
        layers = full["L"] if "L" in self.free_symbols() else None
        tl = self.timelines(layers)
        return replay_steps(tl, full, steps=steps, warmup=warmup, workspace=workspace, context=context)

    def time(self, *, hardware: Any, tokens: float, gpus: int = 1, mfu: float = 0.5, **sizes: int) -> Any:
        """Training time for ``tokens`` with this step's derived FLOPs (``symacct.time.model.train_time``)."""
        return train_time(self, hardware=hardware, tokens=tokens, gpus=gpus, mfu=mfu, **sizes)

    def bytes_per_param(self) -> sympy.Expr | None:
        """Bytes per parameter **between steps**: (params + grads + optimizer states) / N, read off the leading terms.

        The ratio of the coefficients of the highest-degree monomials of N (the
        weight matrices); per-tensor extras such as AdamW's ``step`` counters
        are lower order. None when the leading terms are not proportional.
        The optimizer step itself holds more (its temporaries, the mixed
        recipe's fp32 gradient copies): see :meth:`bytes_per_param_peak`.
        """
        return self._per_param(self.memory.params + self.memory.grads + self.memory.optimizer)

    def bytes_per_param_peak(self) -> sympy.Expr | None:
        """Bytes per parameter **at the peak of the optimizer step** (every step after the first), leading terms.

        The live bytes at the optimizer-phase op that holds the most (found at
        the model's sizes with B = S = 1, states live from the start), read off
        the leading terms of N as :meth:`bytes_per_param` does. None without an
        optimizer (or a liveness pass), or when not proportional.
        """
        if self.liveness is None or not any(lab[3] == "optimizer" for lab in self.liveness.labels):
            return None
        live = self.liveness.steady()
        values = self.with_defaults(B=1, S=1)
        _, t = live.evaluate(values, phases=("optimizer",))
        return self._per_param(live.at_point(t))

    def _per_param(self, expr: Any) -> sympy.Expr | None:
        static = sympy.expand(expr)
        n = sympy.expand(self.params)
        terms_n = sympy.Add.make_args(n)
        terms_s = dict(_split_term(t) for t in sympy.Add.make_args(static))

        def degree(mono: sympy.Expr) -> int:
            return sum(int(e) for e in mono.as_powers_dict().values()) if mono != 1 else 0

        split_n = [_split_term(t) for t in terms_n]
        top = max(degree(m) for m, _ in split_n)
        ratios = {terms_s.get(m, 0) / c for m, c in split_n if degree(m) == top}
        return ratios.pop() if len(ratios) == 1 else None

    def crossover(self) -> float | None:
        """S at which one layer's S^2 matmul FLOPs equal its other matmul FLOPs (None without a layer stack):
        below it the projections dominate a layer, above it the attention scores."""
        if not self.per_layer:
            return None
        S = sym("S")
        block = next(iter(self.per_layer.values()))
        mm = sympy.expand(sum((v for k, v in block.items() if k in ("flops_forward", "flops_backward")), 0))
        fixed = {sym(k): v for k, v in self.symbols.items()} | {sym("B"): 1}
        poly = sympy.Poly(mm.xreplace(fixed), S)
        quad = poly.coeff_monomial(S**2)
        lin = poly.coeff_monomial(S)
        if not quad or not lin:
            return None
        return float(lin / quad)

    def _unit_sizes(self, subs: Mapping[sympy.Symbol, int]) -> list[str]:
        """Tensor dimensions (symbols or products such as H/H_kv) that are 1 at these values."""
        dims: set[sympy.Expr] = set()
        for _, node in records(self.graph):
            for shape in node.shapes:
                dims.update(d for d in shape if isinstance(d, sympy.Basic) and d.free_symbols)
        ones = {d for d in dims if d.xreplace(subs) == 1}
        return sorted((str(d) for d in ones), key=lambda t: (len(t), t))

    def _flat(self) -> dict[str, Any]:
        out: dict[str, Any] = {"params": self.params, "params_embedding": self.params_embedding}
        out["saved_bytes"] = self.saved_bytes
        for name in ("flops", "bytes", "memory"):
            obj = getattr(self, name)
            for f in dataclasses.fields(obj):
                v = getattr(obj, f.name)
                if isinstance(v, (int, sympy.Basic)):
                    out[f"{name}.{f.name}"] = v
        return out

    def formula(self, name: str) -> sympy.Expr:
        """A formula by dotted name: 'flops.total', 'params', 'bytes.read', ..."""
        flat = self._flat()
        if name not in flat:
            raise SymacctError(f"no formula called {name!r}", hint="one of: " + ", ".join(sorted(flat)))
        return sympy.sympify(flat[name])

    def sweep(self, name: str, **arrays: Any) -> np.ndarray:
        """Evaluate one formula over arrays of sizes (numpy broadcasting, via lambdify).

        Exact int64 results while every value stays below 2**53; above that
        the result is float64 (relative error below 1e-15), never a wrapped
        integer.

        ``memory.peak`` is evaluated op by op at every point of the arrays
        (the live bytes of every op, as ``at`` does), not from its formula:
        the formula is the envelope of the points largest somewhere in a
        sample of sizes, and can lie below the peak elsewhere.
        """
        full = self._validate(arrays, arrays=True)
        if name == "memory.peak" and self.liveness is not None:
            return self._exact_peaks(full)
        expr = self.formula(name)
        names = self.free_symbols()
        fn = _lambdified(expr, tuple(names))
        args = [np.asarray(full[n]) for n in names]
        approx = np.asarray(fn(*(a.astype(np.float64) for a in args)), dtype=np.float64)
        if np.all(np.abs(approx) < 2.0**53):
            return np.asarray(fn(*(a.astype(np.int64) for a in args))).astype(np.int64)
        return approx


def _as_array(values: list[int], shape: tuple[int, ...]) -> np.ndarray:
    """Python integers as int64 where they fit (below 2**53 as ``sweep`` promises), float64 otherwise."""
    if all(abs(v) < 2**53 for v in values):
        return np.array(values, dtype=np.int64).reshape(shape)
    return np.array([float(v) for v in values], dtype=np.float64).reshape(shape)


def _sizes(name: str, value: Any, arrays: bool) -> Any:
    """A size (with ``arrays``: an array of sizes) as int / int64; refused unless every entry is a positive integer."""
    if isinstance(value, (bool, np.bool_)) or (not arrays and not isinstance(value, (int, np.integer))):
        raise SymacctError(f"{name}={value!r} is not a positive integer", hint="sizes are positive integers")
    if not arrays:  # a Python integer of any size: the formulas are evaluated in Python integers
        if value <= 0:
            raise SymacctError(f"{name}={value!r} is not a positive integer", hint="sizes are positive")
        return int(value)
    a = np.asarray(value)
    if a.dtype == object or a.dtype.kind not in "iuf" or a.size == 0:
        raise SymacctError(f"{name}={value!r} is not a positive integer", hint="sizes are positive integers")
    if a.dtype.kind == "f":
        if not np.all(np.isfinite(a)) or not np.all(a == np.floor(a)):
            bad = _first(a, lambda x: ~np.isfinite(x) | (x != np.floor(np.where(np.isfinite(x), x, 0))))
            raise SymacctError(
                f"{name}={bad!r} is not a positive integer", hint="sizes are positive integers (no fractions)"
            )
    if np.any(a <= 0):
        bad = _first(a, lambda x: x <= 0)
        raise SymacctError(f"{name}={bad!r} is not a positive integer", hint="sizes are positive")
    if a.dtype.kind == "f" and np.any(np.abs(a) >= 2.0**62):
        raise SymacctError(f"{name} is too large for exact integers", hint="pass sizes below 2**62")
    return int(value) if not arrays else a.astype(np.int64)


def _first(a: Any, pred: Any) -> Any:
    """The first entry of ``a`` where ``pred`` holds, as a Python number (for messages)."""
    arr = np.atleast_1d(np.asarray(a))
    hit = np.flatnonzero(pred(arr))
    return arr.flat[hit[0]].item() if hit.size else arr.flat[0].item()


def _split_term(term: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr]:
    """(monomial, coefficient) of one term of an expanded polynomial."""
    coeff, mono = term.as_coeff_Mul()
    return mono, coeff


_LAMBDA_CACHE: dict[tuple[sympy.Expr, tuple[str, ...]], Any] = {}


def _lambdified(expr: sympy.Expr, names: tuple[str, ...]) -> Any:
    key = (expr, names)
    if key not in _LAMBDA_CACHE:
        _LAMBDA_CACHE[key] = sympy.lambdify([sym(n) for n in names], expr, modules="numpy")
    return _LAMBDA_CACHE[key]


# ---- aggregation (called by derive) -----------------------------------------------


def _fused_attention(node: Node) -> bool:
    """One of SDPA's fused kernels, forward or backward."""
    return any(a in node.op for a in FUSED_ATTENTION)


def _is_attention(node: Node) -> bool:
    if _fused_attention(node):
        return True
    if not node.op.startswith(_MATMUL_OPS):
        return False
    S = sym("S")
    for shape in (*node.shapes, *node.in_shapes):
        if len(shape) >= 2 and shape[-1] == S and shape[-2] == S:
            return True
    return False


def _model_cost(node: Node, causal_discount: bool) -> Cost:
    """A node's cost per call under the options: attention-score matmuls halved under Megatron's causal
    discount."""
    c = node.cost
    if causal_discount and (c.flops or c.flops_recompute) and _is_attention(node):
        return dataclasses.replace(c, flops=c.flops / 2, flops_recompute=c.flops_recompute / 2)
    return c


_SOFTMAX = ("aten._softmax.", "aten._safe_softmax.", "aten.softmax.")
_WALK = 24  # nodes followed from attention scores towards their softmax


def _unmasked_scores(graph: nx.DiGraph, key: Any) -> bool | None:
    """For a forward matmul making attention scores (S x S): True when they reach a softmax through ops of one
    tensor input only (a scale, a view: no mask enters), False when an op of two tensor inputs comes first (a
    mask added or filled in), None when no softmax is reached."""
    frontier, seen, reached = [key], {key}, False
    while frontier and len(seen) < _WALK:
        for nxt in graph.successors(frontier.pop()):
            if nxt in seen:
                continue
            seen.add(nxt)
            node = graph.nodes[nxt]["node"]
            if node.phase != "forward" or node.op.startswith(_MATMUL_OPS):
                continue
            if node.op.startswith(_SOFTMAX):
                reached = True
            elif len(node.in_shapes) > 1:
                return False
            else:
                frontier.append(nxt)
    return True if reached else None


def bidirectional_modules(graph: nx.DiGraph) -> set[str]:
    """The attention modules (generic paths) whose every forward attention runs neither causal nor masked:
    a fused kernel with ``Node.causal`` False, or scores that reach their softmax with no mask entering
    (``_unmasked_scores``). Megatron's causal discount halves the score matmuls of causal attention, which
    computes half of them; these compute all. Attention with a mask counts as causal (what a mask hides is in
    its values)."""
    plain: set[str] = set()
    masked: set[str] = set()
    S = sym("S")
    for key, node in records(graph):
        if node.phase != "forward":
            continue
        if _fused_attention(node):
            (plain if node.causal is False else masked).add(node.generic)
        elif node.op.startswith(_MATMUL_OPS) and any(len(t) >= 2 and t[-2:] == (S, S) for t in node.shapes):
            unmasked = _unmasked_scores(graph, key)
            if unmasked is not None:
                (plain if unmasked else masked).add(node.generic)
    return plain - masked


def _add_to(target: dict[str, Terms], phase: str, cost: Cost) -> None:
    """A bucket's running sums (module, component, layer): matmul FLOPs per phase, the rest over phases."""
    target["flops_" + phase] += cost.flops
    if cost.flops_recompute != 0:
        target["flops_recompute"] += cost.flops_recompute
    target["flops_other"] += cost.flops_other
    target["bytes_read"] += cost.bytes_read
    target["bytes_written"] += cost.bytes_written


def aggregate(
    graph: nx.DiGraph,
    trace: StepTrace,
    probe: Probe,
    param_counts: dict[str, Any],
    stacks: list[str],
    *,
    defaults: dict[str, int],
    fields: dict[str, str],
    notes: list[str],
    causal_discount: bool,
    options: dict[str, Any],
    minimum: dict[str, int],
) -> Accounting:
    """Totals of the step graph: per phase ``Cost.total(cost * count)``, and per module, component and layer."""
    per_phase: dict[str, list[Cost]] = defaultdict(list)
    embedding: list[Any] = []
    modules: dict[str, dict[str, Terms]] = defaultdict(lambda: defaultdict(Terms))
    comps: dict[str, dict[str, Terms]] = defaultdict(lambda: defaultdict(Terms))
    per_layer: dict[str, dict[str, Terms]] = {}
    unaccounted: list[str] = []
    bidirectional = bidirectional_modules(graph) if causal_discount else set()  # left in full by the discount
    L = sym("L")
    for key, node in records(graph):
        if node.phase == "input" or node.count == 0:
            continue
        cost = _model_cost(node, causal_discount and node.generic not in bidirectional)
        scaled = cost * node.count
        ph = node.phase
        per_phase[ph].append(scaled)
        if node.op.startswith(("aten.embedding.", "aten.embedding_dense_backward.")):
            embedding.append(scaled.flops)
        _add_to(modules[node.generic], ph, scaled)
        _add_to(comps[node.component], ph, scaled)
        if node.generic != node.module and node.count.has(L):
            stack = next(p for p in stacks if node.module.startswith(p + "."))
            _add_to(per_layer.setdefault(stack, defaultdict(Terms)), ph, cost)
        if not node.ruled:
            unaccounted.append(f"#{key} {node.op} in '{node.module}' ({ph})")
    if bidirectional:
        notes.append(
            "causal_discount: the attention in "
            + ", ".join(sorted(bidirectional))
            + " runs neither causal nor masked (every query sees every key): its score matmuls counted in full"
        )
    # parameters
    params = Terms()
    params_emb = Terms()
    for ph in trace.placeholders:
        if ph.kind != "param":
            continue
        numel = sympy.Integer(1)
        for s in ph.meta.shape:  # a size in no symbols as the number it is (``StepTrace.bytes_of``)
            read = probe.to_expr(s)
            numel *= sympy.Integer(s) if read is None else read
        n = numel * param_counts[ph.name]
        params += n
        mod = ph.name.rpartition(".")[0]
        if "Embedding" in trace.module_types.get(mod, ""):
            params_emb += n
        modules[generic_path(mod, stacks)]["params"] += n
        comps[component(mod, stacks, trace.module_types, "forward")]["params"] += n
        b = next((p for p in stacks if mod.startswith(p + ".")), None)
        if b is not None and param_counts[ph.name].has(L):
            per_layer.setdefault(b, defaultdict(Terms))["params"] += numel
    total = {ph: Cost.total(cs) for ph, cs in per_phase.items()}
    zero = sympy.Integer(0)

    def of(field: str, *phases: str) -> sympy.Expr:
        return sympy.expand(sympy.Add(*(getattr(total[ph], field) for ph in phases if ph in total)))

    every = sorted(total)
    # recomputation: checkpointing's forward run again (phase 'recompute') and what kernels recompute
    recompute = sympy.expand(of("flops", "recompute") + of("flops_recompute", *every))
    fl = Flops(
        forward=of("flops", "forward"),
        backward=of("flops", "backward"),
        optimizer=of("flops", "optimizer"),
        total=of("flops", "forward", "backward", "optimizer"),
        recompute=recompute,
        hardware=sympy.expand(of("flops", "forward", "backward", "optimizer") + recompute),
        embedding=sympy.expand(sympy.Add(*embedding)) if embedding else zero,
        other=of("flops_other", "forward", "backward", "optimizer", "recompute"),
        other_recompute=of("flops_other", "recompute"),
        other_forward=of("flops_other", "forward"),
        other_backward=of("flops_other", "backward"),
        other_optimizer=of("flops_other", "optimizer"),
    )
    by = Bytes(
        read=of("bytes_read", *every),
        written=of("bytes_written", *every),
        read_forward=of("bytes_read", "forward"),
        written_forward=of("bytes_written", "forward"),
        read_backward=of("bytes_read", "backward"),
        written_backward=of("bytes_written", "backward"),
    )

    def finish(d: dict[str, dict[str, Terms]]) -> dict[str, dict[str, Any]]:
        return {k: {m: sympy.expand(v.sum()) for m, v in sorted(inner.items())} for k, inner in sorted(d.items())}

    return Accounting(
        graph=graph,
        flops=fl,
        bytes=by,
        params=sympy.expand(params.sum()),
        params_embedding=sympy.expand(params_emb.sum()),
        modules=finish(modules),
        components=finish(comps),
        per_layer=finish(per_layer),
        symbols=defaults,
        fields=fields,
        unaccounted=unaccounted,
        notes=notes,
        options=options,
        minimum=minimum,
    )
