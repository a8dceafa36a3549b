"""Recorded step -> networkx graph with a sympy cost on every node.

Nodes are the op indices of the step (ints) plus one node per tensor that
enters from outside (``"param:wte.weight"``, ``"buffer:..."``,
``"input:input0"``). Edges run from the op (or placeholder) that last
wrote a value to every op that reads it. Node attributes:

``op`` (str), ``module`` (path, layer index kept), ``phase``
(forward / backward / optimizer), ``shapes`` (output shapes, sympy),
``dtypes``, ``flops`` (matmul family, model FLOPs), ``flops_recompute``
(matmul FLOPs the kernel runs again, e.g. flash attention's backward
recomputing Q K^T: hardware FLOPs only), ``flops_other``, ``bytes_read``,
``bytes_written``, ``saved`` (an output storage is saved for backward),
``allocated`` (bytes of the new storages it makes), ``count`` (how many
times the node stands in the real model: ``L`` for a representative block,
0 for the other probe blocks, 1 elsewhere).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import networkx as nx
import sympy

from symacct.errors import SymacctError
from symacct.rules import Call, Cost, default_bytes, lookup
from symacct.trace import OpRecord, StepTrace, TMeta

ShapeMap = Callable[[int], Any]


@dataclass
class CostedOp:
    rec: OpRecord
    call: Call
    cost: Cost
    ruled: bool  # False: no rule, counted in ``unaccounted``


def _map_meta(x: Any, f: Callable[[TMeta], TMeta]) -> Any:
    if isinstance(x, TMeta):
        return f(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map_meta(i, f) for i in x)
    if isinstance(x, dict):
        return {k: _map_meta(v, f) for k, v in x.items()}
    return x


def _shape_str(shape: tuple[Any, ...]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def cost_ops(
    trace: StepTrace, dim: ShapeMap, *, strict: bool = True, options: dict[str, Any] | None = None
) -> list[CostedOp]:
    """Apply the rules to every op, with each traced size mapped through ``dim``."""
    cache: dict[TMeta, TMeta] = {}

    def conv(rec: OpRecord) -> Callable[[TMeta], TMeta]:
        def f(t: TMeta) -> TMeta:
            if t in cache:
                return cache[t]
            shape = []
            for s in t.shape:
                e = dim(s)
                if e is None:
                    raise SymacctError(
                        f"dimension {s} of a {t.dtype} tensor of shape {_shape_str(t.shape)} is not a "
                        "product of the model's symbols (a rounded or padded size, or a constant "
                        "computed in __init__)",
                        node=f"#{rec.index}",
                        module=rec.module,
                        op=str(rec.op),
                        shapes=[_shape_str(i.shape) for i in rec.inputs],
                        hint="make the size a config field of its own (it then gets a symbol), or keep the "
                        "fields it depends on at their values with derive(..., fixed=[...])",
                    )
                shape.append(e)
            m = replace(t, shape=tuple(shape))
            cache[t] = m
            return m

        return f

    out: list[CostedOp] = []
    for rec in trace.ops:
        f = conv(rec)
        call = Call(
            op=rec.op,
            args=_map_meta(rec.args, f),
            kwargs=_map_meta(rec.kwargs, f),
            out=_map_meta(rec.out, f),
            inputs=[f(t) for t in rec.inputs],
            outputs=[f(t) for t in rec.outputs],
            mutated=[f(t) for t in rec.mutated],
            is_view=rec.is_view,
            options=options or {},
        )
        fn = lookup(rec.op)
        if fn is None:
            if strict:
                raise SymacctError(
                    f"no cost rule for {rec.op}",
                    node=f"#{rec.index}",
                    module=rec.module,
                    op=str(rec.op),
                    shapes=[_shape_str(i.shape) for i in call.inputs],
                    hint="add one with @symacct.rules.rule(torch.ops.aten.<op>), or pass strict=False "
                    "to list it in acct.unaccounted instead",
                )
            cost, ruled = Cost(bytes_read=0, bytes_written=0), False
        else:
            try:
                cost, ruled = fn(call), True
            except SymacctError:
                raise
            except Exception as e:
                raise SymacctError(
                    f"the cost rule failed: {type(e).__name__}: {e}",
                    node=f"#{rec.index}",
                    module=rec.module,
                    op=str(rec.op),
                    shapes=[_shape_str(i.shape) for i in call.inputs],
                    hint="this is a defect of symacct's rule for this op, not of the model: please report it",
                    internal=True,
                ) from e
        if cost.bytes_read is None or cost.bytes_written is None:
            r, w = default_bytes(call)
            cost = replace(
                cost,
                bytes_read=r if cost.bytes_read is None else cost.bytes_read,
                bytes_written=w if cost.bytes_written is None else cost.bytes_written,
            )
        out.append(CostedOp(rec, call, cost, ruled))
    return out


def build_graph(trace: StepTrace, costed: list[CostedOp], counts: list[sympy.Expr], dim: ShapeMap) -> nx.DiGraph:
    """The networkx graph of the step (see the module docstring for attributes)."""
    g = nx.DiGraph()
    writer: dict[int, Any] = {}
    for ph in trace.placeholders:
        key = f"{ph.kind}:{ph.name}"
        g.add_node(
            key,
            op=ph.kind,
            module=ph.name.rpartition(".")[0],
            phase="input",
            shapes=[tuple(dim(s) for s in ph.meta.shape)],
            in_shapes=[],
            dtypes=[str(ph.meta.dtype)],
            flops=0,
            flops_recompute=0,
            flops_other=0,
            bytes_read=0,
            bytes_written=0,
            saved=False,
            allocated=0,
            count=1,
        )
        writer[ph.meta.vid] = key
    saved = set(trace.saved_storages)
    for c, n in zip(costed, counts):
        rec = c.rec
        g.add_node(
            rec.index,
            op=str(rec.op),
            module=rec.module,
            phase=rec.phase,
            shapes=[t.shape for t in c.call.outputs],
            in_shapes=[t.shape for t in c.call.inputs],
            dtypes=[str(t.dtype) for t in c.call.outputs],
            flops=c.cost.flops,
            flops_recompute=c.cost.flops_recompute,
            flops_other=c.cost.flops_other,
            bytes_read=c.cost.bytes_read,
            bytes_written=c.cost.bytes_written,
            saved=any(t.storage in saved and trace.storage_producer.get(t.storage) == rec.index for t in rec.outputs),
            allocated=sum(
                (
                    trace.bytes_of(st, dim)
                    for st in {t.storage for t in rec.outputs}
                    if trace.storage_producer.get(st) == rec.index
                ),
                0,
            ),  # fmt: skip
            count=n,
            ruled=c.ruled,
        )
        for t in rec.inputs:
            src = writer.get(t.vid)
            if src is not None and src != rec.index:
                g.add_edge(src, rec.index)
        for t in rec.outputs:
            writer[t.vid] = rec.index
        for t in rec.mutated:
            writer[t.vid] = rec.index
    return g
