"""torch.fx in and out: the traced step as an fx graph, and costs for a user's own fx program.

Out: :func:`graph_module` turns a recorded step (the probe trace ``derive`` costed) into a
``torch.fx.GraphModule`` of aten ops in execution order (forward, backward, optimizer), as ``make_fx``
would record the same step without functionalization: one ``placeholder`` per parameter, buffer and input,
one ``call_function`` node per recorded op (its target the ``OpOverload``, its arguments the nodes that
made them), ``operator.getitem`` for the parts of a tuple result, an in-place op's result standing for
the value it wrote from there on, and the loss as the output. ``node.meta["symacct"]`` is the very
:class:`~symacct.cost.graph.Node` record of the networkx graph (one source of truth: cost per call,
``count``, module path, phase, saved, allocated, saved_bytes); ``node.meta["symacct_key"]`` its key
there. The graph is the probe's, with its blocks: one block stands for the stack (``count`` L; or the
first and last count 1 and a middle one L - 2 where they differ), the other probe blocks count 0, so
``sum(cost * count)`` over its nodes is derive's totals.

In: :func:`annotate` costs a graph the user already has (``torch.export.export``, ``make_fx``, an fx pass
pipeline). Each ``call_function`` node is run once on its own ``meta["val"]`` (fake tensors, with
symbolic sizes where the program has them) under a dispatch mode that records the aten ops it reaches,
which are the ops ``FlopCounterMode`` counts (a composite op such as ``aten.linear`` decomposes there as
in eager PyTorch); each is costed by the same rules as ``derive``. Sizes stay symbolic: a torch.export
dynamic dimension becomes the symbol of its ``Dim``'s name (``Dim("B")`` -> B), or the letter ``dims``
gives it (by ``Dim`` name, shape-environment symbol such as ``s0``, or source such as
``L['x'].size()[0]``); static sizes are numbers. Conventions are derive's (docs/conventions.md): matmul
FLOPs as flop_counter counts them, other FLOPs per element, bytes of every distinct tensor read and
written, views free.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import sympy
import torch
import torch.fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from symacct.cost.graph import Node, component, cost_ops
from symacct.cost.rules import Cost
from symacct.errors import SymacctError
from symacct.formula import text
from symacct.symbols import sort_key, sym
from symacct.trace.record import OpRecord, StepTrace, TMeta, op_record

# ---- out: the recorded step as a GraphModule ----------------------------------------------------------


def _ident(name: str) -> str:
    """A Python identifier for a placeholder (``wte.weight`` -> ``wte_weight``)."""
    out = "".join(c if c.isalnum() else "_" for c in name)
    return out if out and not out[0].isdigit() else "_" + out


def graph_module(trace: StepTrace, graph: nx.DiGraph) -> torch.fx.GraphModule:
    """The recorded step as a GraphModule (see the module docstring); node records from ``graph``."""
    if not trace.ops or (trace.ops[0].inputs == [] and trace.ops[0].outputs == [] and trace.ops[0].args == ()):
        raise SymacctError(
            "this step was recorded without its tensors (ops only): there is no data flow to write as fx",
            hint="take acct.fx from a derive() result",
        )
    g = torch.fx.Graph()
    env: dict[int, torch.fx.Node] = {}  # value id -> the node that holds it now

    def placeholder(name: str, key: Any) -> torch.fx.Node:
        node = g.placeholder(_ident(name))
        if key in graph:
            node.meta["symacct"] = graph.nodes[key]["node"]
            node.meta["symacct_key"] = key
        return node

    for ph in trace.placeholders:
        env[ph.meta.vid] = placeholder(f"{ph.kind}_{ph.name}", f"{ph.kind}:{ph.name}")

    inputs_end: list[torch.fx.Node] = list(g.nodes)[-1:]  # the last placeholder so far

    def arg(x: Any) -> Any:
        if isinstance(x, TMeta):
            if x.vid not in env:
                # a tensor made from Python data (torch.tensor(0.0), AdamW's step counters): no op made it, and
                # aten.lift_fresh lifts it in; make_fx keeps its value as a constant attribute, the graph
                # here an input (its value is fake), after the others
                where = g.inserting_after(inputs_end[0]) if inputs_end else g.inserting_before(next(iter(g.nodes)))
                with where:
                    node = placeholder(f"constant_{x.vid}", None)
                inputs_end[:] = [node]
                node.meta["symacct_constant"] = (x.shape, x.dtype)
                env[x.vid] = node
            return env[x.vid]
        if isinstance(x, (list, tuple)):
            return type(x)(arg(v) for v in x)
        if isinstance(x, dict):
            return {k: arg(v) for k, v in x.items()}
        return x

    def bind(out: Any, node: torch.fx.Node) -> None:
        if isinstance(out, TMeta):
            env[out.vid] = node
        elif isinstance(out, (list, tuple)):
            for i, part in enumerate(out):
                if isinstance(part, (TMeta, list, tuple)):
                    bind(part, g.call_function(operator.getitem, (node, i)))

    for rec in trace.ops:
        node = g.call_function(rec.op, arg(rec.args), arg(rec.kwargs))
        node.meta["symacct"] = graph.nodes[rec.index]["node"]
        node.meta["symacct_key"] = rec.index
        bind(rec.out, node)
    forward = [r for r in trace.ops if r.phase == "forward" and r.outputs]
    loss = env.get(forward[-1].outputs[0].vid) if forward else None
    g.output(loss)
    g.lint()
    return torch.fx.GraphModule(torch.nn.Module(), g, class_name="SymacctStep")


# ---- in: costs for a user's fx program ----------------------------------------------------------------


@dataclass
class Annotated:
    """The costs :func:`annotate` wrote into a program's nodes, and their totals.

    ``nodes``: fx node name -> :class:`~symacct.cost.graph.Node` (also in ``node.meta["symacct"]``);
    ``ops``: fx node name -> the aten ops it ran, each ``(op, Cost)``; ``symbols``: symbol -> where it came
    from (the Dim name or shape-environment source); ``cost``: the total :class:`Cost`.
    """

    graph_module: torch.fx.GraphModule
    nodes: dict[str, Node]
    ops: dict[str, list[tuple[str, Cost]]]
    symbols: dict[str, str]
    cost: Cost
    phase: str
    notes: list[str] = field(default_factory=list)

    @property
    def flops(self) -> Any:
        """Matmul-family FLOPs (flop_counter's count: 2 per multiply-add)."""
        return self.cost.flops

    def at(self, **values: int) -> Cost:
        """The total cost at sizes (``B=8, S=1024``), as integers."""
        names = {str(s) for f in ("flops", "flops_other", "bytes_read", "bytes_written") for s in _free(self.cost, f)}
        missing = sorted(names - set(values), key=sort_key)
        if missing:
            raise SymacctError(
                f"no value for {', '.join(missing)}", hint=f"pass {', '.join(m + '=...' for m in missing)}"
            )
        subs = {sym(k): v for k, v in values.items()}
        return self.cost.map(lambda e: int(sympy.sympify(e).xreplace(subs)))

    def by_module(self) -> dict[str, Cost]:
        """Total cost per module path (the innermost module a node ran in, '' for the root)."""
        groups: dict[str, list[Cost]] = {}
        for node in self.nodes.values():
            groups.setdefault(node.module, []).append(node.cost)
        return {k: Cost.total(v) for k, v in sorted(groups.items())}

    def by_op(self) -> dict[str, Cost]:
        """Total cost per aten op packet the nodes ran (``aten.mm``, ``aten.addmm`` ...)."""
        groups: dict[str, list[Cost]] = {}
        for parts in self.ops.values():
            for op, cost in parts:
                groups.setdefault(op.rsplit(".", 1)[0], []).append(cost)
        return {k: Cost.total(v) for k, v in sorted(groups.items())}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the symbols, the totals, the cost per module and per op (formulas as text)."""

        def fields(c: Cost) -> dict[str, str]:
            return {f: text(getattr(c, f)) for f in ("flops", "flops_other", "bytes_read", "bytes_written")}

        return {
            "symbols": dict(self.symbols),
            "phase": self.phase,
            "nodes": len(self.nodes),
            "totals": fields(self.cost),
            "by_module": {k: fields(c) for k, c in self.by_module().items()},
            "by_op": {k: fields(c) for k, c in self.by_op().items()},
            "notes": list(self.notes),
        }

    def sheet(self) -> str:
        """A Markdown sheet: the symbols, the totals, the cost per module and per op."""
        lines = ["# Costs of an fx program", ""]
        if self.symbols:
            lines += ["| symbol | from |", "|---|---|"]
            lines += [f"| {k} | `{v}` |" for k, v in sorted(self.symbols.items(), key=lambda kv: sort_key(kv[0]))]
            lines.append("")
        lines += [f"Phase: {self.phase}. {len(self.nodes)} nodes costed.", ""]
        lines += ["| total | formula |", "|---|---|"]
        for name, value in (
            ("matmul FLOPs", self.cost.flops),
            ("other FLOPs", self.cost.flops_other),
            ("bytes read", self.cost.bytes_read),
            ("bytes written", self.cost.bytes_written),
        ):
            lines.append(f"| {name} | `{text(value)}` |")
        for title, table in (("module", self.by_module()), ("op", self.by_op())):
            lines += [
                "",
                f"| {title} | matmul FLOPs | other FLOPs | bytes read | bytes written |",
                "|---|---|---|---|---|",
            ]
            for k, c in table.items():
                cells = " | ".join(f"`{text(v)}`" for v in (c.flops, c.flops_other, c.bytes_read, c.bytes_written))
                lines.append(f"| `{k or '(root)'}` | {cells} |")
        for note in self.notes:
            lines += ["", f"Note: {note}"]
        return "\n".join(lines) + "\n"


def _free(cost: Cost, f: str) -> set[sympy.Symbol]:
    v = getattr(cost, f)
    return set(v.free_symbols) if isinstance(v, sympy.Basic) else set()


class _Ops(TorchDispatchMode):
    """Records the aten ops one fx node reaches, its tensors' sizes read through ``dim``."""

    def __init__(self, dim: Callable[[Any], Any]) -> None:
        super().__init__()
        self.dim = dim
        self.ops: list[OpRecord] = []
        self._vids: dict[int, int] = {}
        self._storages: dict[int, int] = {}
        self._alive: list[torch.Tensor] = []  # ids stay unique while the node runs

    def meta(self, t: torch.Tensor) -> TMeta:
        vid = self._vids.setdefault(id(t), len(self._vids))
        st = self._storages.setdefault(t.untyped_storage()._cdata, len(self._storages))
        self._alive.append(t)
        return TMeta(tuple(self.dim(s) for s in t.shape), t.dtype, vid, st)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "prim" or func in (torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default):
            return out
        self.ops.append(op_record(len(self.ops), func, "", "", args, kwargs, out, self.meta))
        return out


def _program(program: Any) -> tuple[torch.fx.GraphModule, str]:
    if isinstance(program, torch.export.ExportedProgram):
        return program.graph_module, "forward"
    if isinstance(program, torch.fx.GraphModule):
        return program, "graph"
    raise SymacctError(
        f"annotate takes a torch.fx.GraphModule or a torch.export.ExportedProgram, got {type(program).__name__}",
        hint="export the model (torch.export.export) or trace it to aten ops (make_fx) first",
    )


def _sources(vals: Iterable[Any]) -> dict[sympy.Symbol, list[str]]:
    """Shape-environment symbol -> its source names and debug (Dim) name, from any symbolic size in ``vals``."""
    for v in vals:
        if isinstance(v, torch.Tensor):
            for s in v.shape:
                if isinstance(s, torch.SymInt):
                    env = s.node.shape_env
                    debug = getattr(env, "source_name_to_debug_name", {})
                    out: dict[sympy.Symbol, list[str]] = {}
                    for var, srcs in getattr(env, "var_to_sources", {}).items():
                        names = [_source_name(src) for src in srcs]
                        out[var] = [debug[n] for n in names if n in debug] + names
                    return out
    return {}


def _source_name(src: Any) -> str:
    """``L['x'].size()[0]``: a shape-environment source's name (a property in some torch versions, a method
    in others)."""
    name = getattr(src, "name", None)
    if callable(name):
        name = name()
    return name if isinstance(name, str) else str(src)


def _module_of(node: torch.fx.Node) -> tuple[str, dict[str, str]]:
    """(innermost module path, path -> class name) from the node's ``nn_module_stack``."""
    stack = node.meta.get("nn_module_stack") or {}
    types: dict[str, str] = {}
    path = ""
    for value in stack.values():
        if isinstance(value, tuple) and len(value) == 2:
            p, cls = value
            if str(p).startswith("_empty_nn_module_stack"):  # export's placeholder for "no module": the root
                continue
            path = str(p)
            types[path] = str(getattr(cls, "__name__", cls)).rsplit(".", 1)[-1]
    return path, types


def _shape_str(shape: tuple[Any, ...]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def annotate(program: Any, dims: Mapping[str, str] | None = None) -> Annotated:
    """Costs for every ``call_function`` node of ``program`` (a GraphModule or an ExportedProgram), written
    into ``node.meta["symacct"]``; see the module docstring. ``dims`` renames symbolic sizes to symacct's
    letters: ``{"batch": "B", "s1": "S", "idx.1": "S"}`` (keys: a Dim name, a symbol, a source name, or a
    placeholder's dimension as ``name.index``: a program loaded by torch.export.load keeps only that)."""
    gm, phase = _program(program)
    dims = dict(dims or {})
    for letter in dims.values():
        try:
            sym(letter)
        except ValueError:
            raise SymacctError(f"dims: {letter!r} is not a symbol name", hint="use letters such as B, S, D") from None
    nodes = [n for n in gm.graph.nodes]
    vals = [n.meta.get("val") for n in nodes]
    flat = [v for val in vals for v in tree_flatten(val)[0]]
    sources = _sources(flat)
    for n in nodes:  # a placeholder's symbolic dims by position, "idx.0" (a program loaded from a file keeps
        # its symbols but not their Dim names or sources)
        val = n.meta.get("val")
        if n.op == "placeholder" and isinstance(val, torch.Tensor):
            for i, d in enumerate(val.shape):
                if isinstance(d, torch.SymInt) and isinstance(d.node.expr, sympy.Symbol):
                    sources.setdefault(d.node.expr, []).append(f"{n.name}.{i}")
    names: dict[sympy.Symbol, sympy.Symbol] = {}
    origin: dict[str, str] = {}
    for var, srcs in sources.items():
        keys = [str(var), *srcs]
        letter = next((dims[k] for k in keys if k in dims), None)
        if letter is None:
            letter = next((k for k in srcs[:1] if _is_name(k)), str(var))
        names[var] = sym(letter)
        plain = [x for x in srcs if not _is_name(x)] or [str(var)]  # sources, not the Dim's own name
        known = [x for x in origin.get(letter, "").split(", ") if x]
        origin[letter] = ", ".join(dict.fromkeys([*known, *plain]))
    unused = set(dims) - {k for var, srcs in sources.items() for k in (str(var), *srcs)}
    if unused:
        raise SymacctError(
            f"dims names {sorted(unused)}, which the program has no symbolic size for",
            hint="the program's symbolic sizes: "
            + (", ".join(f"{v} ({', '.join(s)})" for v, s in sources.items()) or "none (static shapes)"),
        )

    def dim(s: Any) -> Any:
        if isinstance(s, torch.SymInt):
            expr = s.node.shape_env.simplify(s.node.expr)  # sizes the program pinned (s1 == 16) are numbers
            if not isinstance(expr, sympy.Basic):
                return int(expr)
            free = [v for v in expr.free_symbols if v not in names]
            if free:
                raise SymacctError(
                    f"a size that depends on the data: {expr} ({', '.join(sorted(map(str, free)))} is unbacked: "
                    "nonzero, masked_select, item and the like)",
                    **current,
                    hint="a data-dependent size has no formula; keep such ops out of the program, or give them "
                    "fixed sizes",
                )
            return sympy.expand(expr.xreplace(names))
        return int(s)

    fake = _fake_mode(flat)
    current: dict[str, str] = {}  # the node being costed, for refusals raised while reading a size
    values: dict[torch.fx.Node, Any] = {}  # each node's value, made once (a value read twice is one tensor)
    ran: dict[Any, list[tuple[str, Cost]]] = {}  # the ops a call runs, by its signature (a block's twins)
    out_nodes: dict[str, Node] = {}
    out_ops: dict[str, list[tuple[str, Cost]]] = {}
    for node in nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        module, types = _module_of(node)
        where = {"node": node.name, "module": module, "op": str(node.target)}
        current.update(where)
        if node.op == "call_module":
            raise SymacctError(
                "a call_module node: the graph holds modules, not aten ops (torch.fx.symbolic_trace)",
                **where,
                hint="trace it to aten ops first: torch.export.export(model, args) or make_fx(model)(*args)",
            )
        if node.op == "call_method" or not callable(node.target):
            raise SymacctError(
                f"a {node.op} node: not an aten op", **where, hint="export or make_fx the program to aten ops"
            )
        target = node.target
        if isinstance(target, torch._ops.HigherOrderOperator):
            raise SymacctError(
                f"a higher-order op ({target.name()}): control flow or a wrapped sub-graph, whose cost depends on "
                "which branch runs or how often",
                **where,
                hint="export without torch.cond / while_loop, or annotate each branch's graph on its own",
            )

        def value(n: torch.fx.Node, where: dict[str, str] = where) -> Any:
            if n not in values:
                values[n] = _val(n, gm, fake, where)
            return values[n]

        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), value)
        if target is operator.getitem or not isinstance(target, torch._ops.OpOverload):
            if not any(isinstance(a, torch.Tensor) for a in tree_flatten((args, kwargs))[0]):
                continue  # size arithmetic (operator.mul on SymInts, sym_size): no tensor work
            if target is operator.getitem:
                continue  # a part of a tuple result: made by the node that returned it
            raise SymacctError(
                f"a call to {getattr(target, '__name__', target)!r}, not an aten op",
                **where,
                hint="export or make_fx the program to aten ops",
            )
        key = _signature(target, args, kwargs, dim)
        if key not in ran:
            ran[key] = _run(target, args, kwargs, fake, dim, where)
        parts = ran[key]
        cost = Cost.total(c for _, c in parts)
        outputs = _tensor_metas(node.meta.get("val"), dim)
        inputs = [m for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor) for m in [_meta(a, dim)]]
        # bytes of the storages it makes: outputs that share no storage with an input
        held = {_storage(a) for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        fresh: dict[int, TMeta] = {}
        for t in tree_flatten(node.meta.get("val"))[0]:
            if isinstance(t, torch.Tensor) and _storage(t) not in held:
                fresh.setdefault(_storage(t), _meta(t, dim))
        record = Node(
            op=str(target),
            module=module,
            generic=module,
            component=component(module, [], types, phase),
            phase=phase,
            shapes=tuple(m.shape for m in outputs),
            in_shapes=tuple(m.shape for m in inputs),
            dtypes=tuple(str(m.dtype) for m in outputs),
            cost=cost,
            count=1,
            saved=False,
            allocated=sympy.expand(sum((_nbytes(m) for m in fresh.values()), sympy.Integer(0))),
        )
        node.meta["symacct"] = record
        out_nodes[node.name] = record
        out_ops[node.name] = list(parts)
    total = Cost.total(n.cost for n in out_nodes.values()).map(sympy.expand)
    used = {str(v) for f in ("flops", "flops_other", "bytes_read", "bytes_written") for v in _free(total, f)}
    origin = {k: v for k, v in origin.items() if k in used}
    notes = []
    if phase == "graph":
        notes.append("phase 'graph': a GraphModule does not say which of its nodes are forward or backward")
    return Annotated(gm, out_nodes, out_ops, origin, total, phase, notes)


def _run(
    target: Any, args: Any, kwargs: Any, fake: Any, dim: Callable[[Any], Any], where: dict[str, str]
) -> list[tuple[str, Cost]]:
    """The aten ops one call runs on fake values, each with its cost by derive's rules."""
    rec = _Ops(dim)
    try:
        with fake, rec:
            target(*args, **kwargs)
    except SymacctError:
        raise
    except Exception as e:
        shapes = [_shape_str(tuple(a.shape)) for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        raise SymacctError(
            f"could not run the node on its meta['val'] sizes: {type(e).__name__}: {' '.join(str(e).split())}",
            **where,
            shapes=shapes,
            hint="a data-dependent size (nonzero, item) has no formula; keep such ops out of the program",
        ) from e
    costed = cost_ops(StepTrace(ops=rec.ops), lambda s: s, strict=False)
    bad = [c for c in costed if not c.ruled]
    if bad:
        c = bad[0]
        raise SymacctError(
            f"no cost rule for {c.rec.op}" + (f" (which {target} runs)" if c.rec.op != target else ""),
            **where,
            shapes=[_shape_str(t.shape) for t in c.call.inputs],
            hint="add one with @symacct.cost.rules.rule(torch.ops.aten.<op>)",
        )
    return [(str(c.rec.op), c.cost) for c in costed]


def _signature(target: Any, args: Any, kwargs: Any, dim: Callable[[Any], Any]) -> Any:
    """What a call's cost depends on: the op, each tensor's sizes, strides, offset and dtype (as formulas),
    which arguments are one tensor or share a storage, and every other argument."""
    seen: dict[int, int] = {}
    stores: dict[int, int] = {}

    def key(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return (
                "T",
                tuple(dim(d) for d in x.shape),
                tuple(dim(d) for d in x.stride()),
                dim(x.storage_offset()),
                x.dtype,
                x.device.type,
                x.requires_grad,
                seen.setdefault(id(x), len(seen)),
                stores.setdefault(_storage(x), len(stores)),
            )
        if isinstance(x, (list, tuple)):
            return (type(x).__name__, tuple(key(v) for v in x))
        if isinstance(x, dict):
            return ("dict", tuple((k, key(v)) for k, v in sorted(x.items())))
        if isinstance(x, torch.SymInt):
            return ("I", dim(x))
        if isinstance(x, (torch.SymFloat, torch.SymBool)):
            return ("S", str(x.node.expr))
        return ("V", type(x).__name__, repr(x))

    return (target, key(args), key(kwargs))


def _is_name(s: str) -> bool:
    try:
        sym(s)
    except ValueError:
        return False
    return True


def _val(n: torch.fx.Node, gm: torch.fx.GraphModule, fake: Any, where: dict[str, str]) -> Any:
    """The fake value a node's users read: its ``meta["val"]``; a real tensor there (a constant make_fx keeps
    as an attribute) or a ``get_attr`` without one is made fake with static sizes."""
    from torch._subclasses.fake_tensor import FakeTensor

    if "val" in n.meta:
        value = n.meta["val"]
    elif n.op == "get_attr":
        value = operator.attrgetter(str(n.target))(gm)
    else:
        raise SymacctError(
            f"node {n.name} has no meta['val'] (the fake value its sizes are read from)",
            **where,
            hint="propagate fake values first: torch.fx.passes.fake_tensor_prop.FakeTensorProp(gm).propagate(*args)"
            ", or take the graph from torch.export / make_fx",
        )
    if isinstance(value, FakeTensor) and value.fake_mode is not fake:  # make_fx in real mode: a mode per value
        with fake:
            return torch.empty_strided(
                tuple(int(d) for d in value.shape), value.stride(), dtype=value.dtype, device=value.device
            )
    if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
        value = fake.from_tensor(value, static_shapes=True)
    return value


def _fake_mode(flat: list[Any]) -> Any:
    """The program's own fake mode (its symbolic sizes live in its shape environment), or a fresh one for a
    graph whose values are real tensors (make_fx in real mode): those are made fake with static sizes."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        mode = detect_fake_mode(flat)
    except AssertionError:  # values from several modes (make_fx in real mode): static sizes, one fresh mode
        mode = None
    return mode if mode is not None else FakeTensorMode()


def _meta(t: torch.Tensor, dim: Callable[[Any], Any]) -> TMeta:
    return TMeta(tuple(dim(s) for s in t.shape), t.dtype, 0, 0)


def _tensor_metas(val: Any, dim: Callable[[Any], Any]) -> list[TMeta]:
    return [_meta(t, dim) for t in tree_flatten(val)[0] if isinstance(t, torch.Tensor)]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _nbytes(m: TMeta) -> Any:
    n: Any = m.itemsize
    for s in m.shape:
        n = n * s
    return n
