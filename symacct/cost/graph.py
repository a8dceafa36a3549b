"""Recorded step -> networkx graph with a typed, symbolic cost record on every node.

Nodes are the op indices of the step (ints) plus one node per tensor that
enters from outside (``"param:wte.weight"``, ``"buffer:..."``,
``"input:input0"``). Edges run from the op (or placeholder) that last
wrote a value to every op that reads it. Each node's data is one
:class:`Node` under the key ``"node"`` (``graph.nodes[n]["node"]``, or
``records(graph)``): what the op is, where it runs, its cost per call
(:class:`symacct.cost.rules.Cost`) and how many times it stands in the real model
(``count``). Records are frozen: nothing downstream changes a node; totals
are ``Cost.total(node.cost * node.count ...)`` over the nodes chosen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import networkx as nx
import sympy

from symacct.cost.layers import generic_path
from symacct.cost.rules import Call, Cost, default_bytes, lookup
from symacct.errors import SymacctError
from symacct.trace.record import OpRecord, StepTrace, TMeta

ShapeMap = Callable[[int], Any]


@dataclass(frozen=True)
class Node:
    """One node of the step graph (see the module docstring).

    ``op``: the aten op (``aten.mm.default``), or the placeholder's kind
    (``param``, ``buffer``, ``input``); ``module``: the module path it runs
    in, layer index kept (``blocks.3.attn``); ``generic``: the same with a
    factored stack's index as ``*``; ``component``: attention, mlp, norm,
    embedding, head, loss, optimizer or other; ``phase``: forward, backward,
    recompute, optimizer, or input for a placeholder; ``shapes`` and
    ``dtypes`` of the outputs, ``in_shapes`` of the tensor inputs (sympy);
    ``cost``: per call (FLOPs by kind, bytes read and written); ``count``:
    ``L`` (or ``L - 1``, ...) for a block standing for the stack, 0 for the
    other probe blocks, 1 elsewhere; ``saved``: an output storage is saved
    for backward; ``allocated``: bytes of the storages it makes; ``saved_bytes``:
    the part of those that autograd saves for backward, per call; ``ruled``:
    False for an op without a rule (``strict=False``), counted as 0;
    ``causal``: for a fused attention kernel (SDPA's flash, memory-efficient,
    cuDNN), True when it runs causal (``is_causal``), False when it runs
    neither causal nor with a mask (every query sees every key), None with a
    mask (what it masks is in its values) and for every other op.
    """

    op: str
    module: str
    generic: str
    component: str
    phase: str
    shapes: tuple[tuple[Any, ...], ...]
    in_shapes: tuple[tuple[Any, ...], ...]
    dtypes: tuple[str, ...]
    cost: Cost
    count: Any = 1
    saved: bool = False
    allocated: Any = 0
    ruled: bool = True
    saved_bytes: Any = 0
    causal: bool | None = None

    def evaluated(self, ev: Callable[[Any], Any]) -> Node:
        """The record with every formula passed through ``ev`` (``Accounting.at``)."""
        return replace(
            self,
            shapes=tuple(tuple(ev(d) for d in shape) for shape in self.shapes),
            in_shapes=tuple(tuple(ev(d) for d in shape) for shape in self.in_shapes),
            cost=self.cost.map(ev),
            count=ev(self.count),
            allocated=ev(self.allocated),
            saved_bytes=ev(self.saved_bytes),
        )


def records(graph: nx.DiGraph) -> Iterator[tuple[Any, Node]]:
    """(key, record) of every node of a step graph."""
    for key, data in graph.nodes(data=True):
        yield key, data["node"]


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
                    hint="add one with @symacct.cost.rules.rule(torch.ops.aten.<op>), or pass strict=False "
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


# SDPA's fused kernels, forward and backward (``aten._scaled_dot_product_flash_attention_for_cpu_backward`` ...)
FUSED_ATTENTION = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_cudnn_attention",
)


def causal(call: Call) -> bool | None:
    """``Node.causal`` of an op: read from a fused attention kernel's ``is_causal`` and mask arguments (by name,
    from the op's schema), None for any other op."""
    name = call.op.overloadpacket.__name__
    if not name.startswith(FUSED_ATTENTION):
        return None
    given = {
        a.name: call.args[i] if i < len(call.args) else call.kwargs.get(a.name, a.default_value)
        for i, a in enumerate(call.op._schema.arguments)
    }
    if given.get("is_causal"):
        return True
    masked = any(isinstance(given.get(k), TMeta) for k in ("attn_mask", "attn_bias"))
    return None if masked else False


def build_graph(
    trace: StepTrace,
    costed: list[CostedOp],
    counts: list[sympy.Expr],
    dim: ShapeMap,
    stacks: list[str],
) -> nx.DiGraph:
    """The networkx graph of the step (see the module docstring)."""
    g = nx.DiGraph()
    types = trace.module_types
    writer: dict[int, Any] = {}
    nothing = Cost(bytes_read=0, bytes_written=0)
    for ph in trace.placeholders:
        key = f"{ph.kind}:{ph.name}"
        module = ph.name.rpartition(".")[0]
        node = Node(
            op=ph.kind,
            module=module,
            generic=generic_path(module, stacks),
            component=component(module, stacks, types, "input"),
            phase="input",
            shapes=(tuple(dim(s) for s in ph.meta.shape),),
            in_shapes=(),
            dtypes=(str(ph.meta.dtype),),
            cost=nothing,
        )
        g.add_node(key, node=node)
        writer[ph.meta.vid] = key
    saved = trace.saved_storages  # storage -> bytes autograd packed
    for c, n in zip(costed, counts):
        rec = c.rec
        made = {t.storage for t in rec.outputs if trace.storage_producer.get(t.storage) == rec.index}
        node = Node(
            op=str(rec.op),
            module=rec.module,
            generic=generic_path(rec.module, stacks),
            component=component(rec.module, stacks, types, rec.phase),
            phase=rec.phase,
            shapes=tuple(t.shape for t in c.call.outputs),
            in_shapes=tuple(t.shape for t in c.call.inputs),
            dtypes=tuple(str(t.dtype) for t in c.call.outputs),
            cost=c.cost,
            count=n,
            saved=any(t.storage in saved and trace.storage_producer.get(t.storage) == rec.index for t in rec.outputs),
            allocated=sum((trace.bytes_of(st, dim) for st in sorted(made)), 0),
            ruled=c.ruled,
            saved_bytes=sum((trace.bytes_of(st, dim, saved[st]) for st in sorted(made) if st in saved), 0),
            causal=causal(c.call),
        )
        g.add_node(rec.index, node=node)
        for t in rec.inputs:
            src = writer.get(t.vid)
            if src is not None and src != rec.index:
                g.add_edge(src, rec.index)
        for t in rec.outputs:
            writer[t.vid] = rec.index
        for t in rec.mutated:
            writer[t.vid] = rec.index
    return g


def component(module: str, stacks: list[str], types: Mapping[str, str], phase: str) -> str:
    """Coarse component of a module path: embedding, attention, mlp, norm, head, loss, optimizer, other."""
    if phase == "optimizer":
        return "optimizer"
    parts = module.split(".") if module else []
    kinds = [types.get(".".join(parts[: i + 1]), "") for i in range(len(parts))]
    if any("Norm" in k for k in kinds):
        return "norm"
    if any("Embedding" in k for k in kinds):
        return "embedding"
    low = module.lower()
    if "att" in low:
        return "attention"
    if any(w in low for w in ("mlp", "ffn", "feed_forward", "feedforward", "moe", "expert")):
        return "mlp"
    if any("MLP" in k or "FeedForward" in k or k.endswith("FF") for k in kinds):  # T5LayerFF
        return "mlp"
    # in a block: a stack factored by L, or a numbered block of one kept at its depth (T5's encoder.block.0)
    in_stack = generic_path(module, stacks) != module or any(p.isdigit() for p in parts)
    if not module:
        return "loss"
    if not in_stack and kinds and kinds[-1] == "Linear":
        return "head"
    if not in_stack and any(w in low for w in ("drop",)):
        return "embedding"
    return "other"
