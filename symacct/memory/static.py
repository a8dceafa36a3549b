"""Static bytes and saved activations: parameters, gradients, optimizer states, what autograd saves.

Conventions (docs/conventions.md, "Memory"): bytes of distinct storages; a saved activation is a storage
that autograd packs through ``saved_tensors_hooks`` in forward, parameters and the step's inputs excluded,
counted once per layer for an op in the layer stack; optimizer states are the storages the optimizer keeps
in ``state`` after its first step; the checkpoint is what ``torch.save`` of the model's and the
optimizer's state dicts holds.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import sympy

from symacct.cost.layers import block_of, differing_ends, generic_path, op_blocks, stage_share
from symacct.symbols import sym
from symacct.trace.probe import Probe
from symacct.trace.record import StepTrace

Expr = Any


@dataclass
class Memory:
    """Bytes of one step, as formulas (see the module docstring for what lives when)."""

    params: Expr = 0
    grads: Expr = 0
    optimizer: Expr = 0  # optimizer states (m, v, step, momentum ...)
    activations: Expr = 0  # saved for backward: distinct storages, params and inputs excluded
    after_forward: Expr = 0
    after_backward: Expr = 0
    after_optimizer: Expr = 0  # after the step and zero_grad(set_to_none=True)
    peak: Expr = 0
    peak_at: list[str] = field(default_factory=list)  # where the candidate peaks occur
    activations_by_module: dict[str, Expr] = field(default_factory=dict)
    activations_per_layer: dict[str, Expr] = field(default_factory=dict)
    optimizer_by_state: dict[str, Expr] = field(default_factory=dict)
    autocast_copies: dict[str, Expr] = field(default_factory=dict)  # module -> bytes of autocast's weight casts
    checkpoint: Expr = 0  # tensor bytes of torch.save({model, optimizer state dicts}): params, saved buffers, states
    kv_cache: Expr = 0  # serving: bytes of the KV cache after the step (prefill: S positions; decode: C + S)
    tensors: list[ParamRow] = field(default_factory=list)  # each parameter: shape, count, grad, states, place
    # saved activations outside the layer stack, by where their op runs: 'before' / 'after' the stack
    activations_outside: dict[str, Expr] = field(default_factory=dict)
    # the stack's saved activations beyond L times a block's: 'first' on the pipeline stage holding block 0,
    # 'last' on the one holding block L - 1 (a first or last block that differs: cost.layers.stage_share)
    activations_ends: dict[str, Expr] = field(default_factory=dict)
    buffers: Expr = 0  # every module buffer, persistent or not (DDP broadcasts them at each forward)
    boundary: Expr = 0  # bytes one block hands the next in forward (a pipeline stage's send per micro-batch)
    inputs: Expr = 0  # the step's input tensors (distinct storages)
    loss: Expr = 0  # the training step's loss tensor

    def copy(self) -> Memory:
        """A copy whose lists and dicts are its own (formulas are immutable, shared)."""
        return dataclasses.replace(
            self,
            **{
                f.name: type(v)(v)
                for f in dataclasses.fields(self)
                if isinstance(v := getattr(self, f.name), (list, dict))
            },
        )


@dataclass(frozen=True)
class ParamRow:
    """One parameter (a stack's blocks as one row, ``blocks.*.attn.c_attn.weight``) as formulas.

    ``shape`` is read dimension by dimension, so sharding code can split dim 0 as FSDP2 does; ``count``
    is how many the model holds (L for a block's); ``states`` the optimizer's per-parameter storages
    ``(key, shape, itemsize)``; ``places`` where forward ops read it: 'before' the layer stack, in the
    'stack', 'after' it (a tied embedding and head: before and after)."""

    name: str
    module: str
    shape: tuple[Expr, ...]
    itemsize: int
    count: Expr
    grad: bool  # a gradient was made for it in the step
    grad_itemsize: int
    states: tuple[tuple[str, tuple[Expr, ...], int], ...]
    places: frozenset[str]
    grad_shape: tuple[Expr, ...] | None = None  # the gradient's, where it is not ``shape`` (see _grad_shape)

    @property
    def numel(self) -> Expr:
        return sympy.Mul(*self.shape) if self.shape else sympy.Integer(1)


def _last_block_twins(trace: StepTrace, blocks: list[Any]) -> dict[int, int]:
    """Each storage an op of a block makes -> what the same op of its stack's last block makes (blocks are
    alike op for op: the layer stack's factoring checked it)."""
    by_block: dict[Any, list[int]] = defaultdict(list)
    for i, b in enumerate(blocks):
        if b is not None:
            by_block[b].append(i)
    last: dict[str, int] = {}
    for stack, i in by_block:
        last[stack] = max(last.get(stack, i), i)
    twins: dict[int, int] = {}
    for (stack, i), ops in by_block.items():
        final = by_block[(stack, last[stack])]
        if i == last[stack] or len(final) != len(ops):
            continue
        for p, q in zip(ops, final):
            for a, b in zip(trace.ops[p].outputs, trace.ops[q].outputs):
                twins.setdefault(a.storage, b.storage)
    return twins


def _counted(counts: list[Any], trace: StepTrace, storage: int) -> bool:
    """Whether the op making ``storage`` counts for the layer stack (a count in L)."""
    producer = trace.storage_producer.get(storage)
    return producer is not None and sympy.sympify(counts[producer]).has(sym("L"))


def _given_counts(trace: StepTrace, counts: list[Any], blocks: list[tuple[str, int] | None]) -> dict[int, Any]:
    """Storages the step was given (its inputs) that are a layer each: a KV cache of one layer's keys and values
    a block. Each is counted as the op that first uses it is (the probe's blocks are counted so that they sum
    to L), where every op that uses it lies in one block and such storages lie in two blocks of the stack or
    more. The rest are counted once, as the default: one outside the stack (token ids; the last layer's cache
    where its ops follow the stack's last module, counted once as they are), one used by several blocks (a
    mask every block reads), and one in a block where no other block has any (the stack's own input, which
    the first block reads: its ops are counted 0 where another block counts for them)."""
    given = {ph.meta.storage for ph in trace.placeholders if ph.kind == "input"}
    first: dict[int, tuple[tuple[str, int] | None, int]] = {}
    shared: set[int] = set()
    for rec in trace.ops:
        for m in (*rec.inputs, *rec.mutated):
            st = m.storage
            if st not in given or st in shared:
                continue
            seen = first.setdefault(st, (blocks[rec.index], rec.index))
            if seen[0] != blocks[rec.index]:
                shared.add(st)
    alone = {st: (b, i) for st, (b, i) in first.items() if st not in shared}
    spans: dict[str, set[int]] = defaultdict(set)
    for b, _ in alone.values():
        if b is not None:
            spans[b[0]].add(b[1])
    return {st: counts[i] for st, (b, i) in alone.items() if b is not None and len(spans[b[0]]) >= 2}


def _counted_by_others(trace: StepTrace, counts: list[Any], storage: int) -> bool:
    """Whether the op making ``storage`` has no count of its own (its block is counted by another's)."""
    producer = trace.storage_producer.get(storage)
    return producer is not None and counts[producer] == 0


def static_and_activations(
    trace: StepTrace,
    probe: Probe,
    counts: list[Any],
    param_counts: dict[str, Any],
    stacks: list[str],
    generic: Any,
) -> Memory:
    """Parameters, gradients, optimizer states and saved activations, with multiplicities."""
    L = sym("L")
    nb = probe.to_expr
    names_count = param_counts
    mem = Memory()
    params = sympy.Integer(0)
    for ph in trace.placeholders:
        if ph.kind == "param":
            params += trace.bytes_of(ph.meta.storage, nb) * names_count[ph.name]
    grads = sum((trace.bytes_of(st, nb) * names_count[n] for st, n in trace.grad_storages.items()), sympy.Integer(0))
    by_state: dict[str, Any] = defaultdict(lambda: sympy.Integer(0))
    for st, (n, key) in trace.state_storages.items():
        by_state[key] += trace.bytes_of(st, nb) * names_count[n]
    acts = sympy.Integer(0)
    by_module: dict[str, Any] = defaultdict(lambda: sympy.Integer(0))
    per_layer: dict[str, Any] = defaultdict(lambda: sympy.Integer(0))
    blocks = op_blocks(trace.ops, stacks)
    last_twin = _last_block_twins(trace, blocks)
    unsaved_twin = {b for a, b in last_twin.items() if a not in trace.saved_storages and _counted(counts, trace, a)}
    last_less = sympy.Integer(0)
    ends = differing_ends(blocks, counts)
    end_bytes = {"first": sympy.Integer(0), "last": sympy.Integer(0)}
    for st, nbytes in trace.saved_storages.items():
        producer = trace.storage_producer.get(st)
        if producer is None:
            continue
        c = counts[producer]
        if c == 0 and st in unsaved_twin:
            # the last block's, saved by what follows the stack (a head on a post-norm block's output), where
            # the block counted for it saves none (its successor saves a copy): once, on the side after it
            b = trace.bytes_of(st, nb, nbytes)
            acts += b
            by_module[generic(trace.ops[producer].module)] += b
            last_less -= b
            continue
        if c == 0:
            continue
        b = trace.bytes_of(st, nb, nbytes)
        if blocks[producer] is not None:  # a stage's share beyond its L / pp blocks' (cost.layers.stage_share)
            for end, first, last in (("first", True, False), ("last", False, True)):
                share = stage_share(blocks[producer][1], c, first, last, ends)
                end_bytes[end] += b * (share - (sympy.diff(c, L) * L / sym("pp") if c.has(L) else 0))
        twin = last_twin.get(st)
        if (
            c.has(L)
            and twin is not None
            and twin not in trace.saved_storages
            and _counted_by_others(trace, counts, twin)
        ):
            # saved by the next block (a block's output its successor saves): the last block's has no
            # successor, and what follows the stack does not save it; where the last block is counted
            # with the others (it has no count of its own), one less, on the side after the stack
            c = c - 1
            last_less += b
        module = trace.ops[producer].module
        acts += b * c
        by_module[generic(module)] += b * c
        if c.has(L):
            per_layer[blocks[producer][0]] += b
    buffers = sympy.Integer(0)
    all_buffers = sympy.Integer(0)
    for ph in trace.placeholders:
        if ph.kind == "buffer":
            b = trace.bytes_of(ph.meta.storage, nb) * names_count.get(ph.name, 1)
            all_buffers += b
            if ph.meta.storage in trace.persistent_buffers:
                buffers += b
    mem.buffers = sympy.expand(all_buffers)
    mem.checkpoint = sympy.expand(params + buffers + sum(by_state.values(), sympy.Integer(0)))
    # the KV cache after a serving step: each storage a layer made, counted as its layer is; one the step was
    # given (a cache allocated ahead for every position, written in place), as the one block that uses it
    given = _given_counts(trace, counts, blocks)
    cache = sympy.Integer(0)
    for st in trace.cache_storages:
        producer = trace.storage_producer.get(st)
        c = counts[producer] if producer is not None else given.get(st, 1)
        cache += trace.bytes_of(st, nb) * c
    mem.kv_cache = sympy.expand(cache)
    # autocast's low-precision copies of the weights: casts whose input is a parameter
    copies: dict[str, Any] = defaultdict(lambda: sympy.Integer(0))
    param_storages = {ph.meta.storage for ph in trace.placeholders if ph.kind == "param"}
    for rec in trace.ops:
        if rec.phase == "forward" and rec.op.overloadpacket.__name__ == "_to_copy" and counts[rec.index] != 0:
            if any(m.storage in param_storages for m in rec.inputs):
                for m in rec.outputs:
                    copies[generic(rec.module)] += trace.bytes_of(m.storage, nb) * counts[rec.index]
    mem.autocast_copies = {k: sympy.expand(v) for k, v in sorted(copies.items())}
    mem.params = sympy.expand(params)
    mem.grads = sympy.expand(grads)
    mem.optimizer = sympy.expand(sum(by_state.values(), sympy.Integer(0)))
    mem.optimizer_by_state = {k: sympy.expand(v) for k, v in sorted(by_state.items())}
    mem.activations = sympy.expand(acts)
    mem.activations_by_module = {k: sympy.expand(v) for k, v in sorted(by_module.items())}
    mem.activations_per_layer = {k: sympy.expand(v) for k, v in sorted(per_layer.items())}
    mem.tensors = param_rows(trace, nb, names_count, stacks, blocks)
    outside: dict[str, Any] = {"before": sympy.Integer(0), "after": -last_less}
    first = _first_stack_op(trace, blocks)
    for st, nbytes in trace.saved_storages.items():
        producer = trace.storage_producer.get(st)
        if producer is None or counts[producer] == 0 or blocks[producer] is not None:
            continue
        where = "before" if first is None or producer < first else "after"
        outside[where] += trace.bytes_of(st, nb, nbytes) * counts[producer]
    mem.activations_outside = {k: sympy.expand(v) for k, v in outside.items()}
    mem.activations_ends = {k: sympy.expand(v) for k, v in end_bytes.items()}
    mem.boundary = _boundary(trace, nb, blocks)
    inputs = {ph.meta.storage for ph in trace.placeholders if ph.kind == "input"}
    mem.inputs = sympy.expand(
        sum((trace.bytes_of(st, nb) * given.get(st, 1) for st in sorted(inputs)), sympy.Integer(0))
    )
    if trace.loss_storage is not None:
        mem.loss = trace.bytes_of(trace.loss_storage, nb)
    return mem


def _boundary(trace: StepTrace, read: Any, blocks: list[Any]) -> Any:
    """Bytes of the storages block 1 reads in forward that block 0 made: what crosses a stage boundary."""
    seen: set[int] = set()
    total = sympy.Integer(0)
    for i, rec in enumerate(trace.ops):
        b = blocks[i]
        if rec.phase != "forward" or b is None or b[1] != 1:
            continue
        for m in rec.inputs:
            p = trace.storage_producer.get(m.storage)
            if m.storage in seen or p is None or blocks[p] != (b[0], 0):
                continue
            seen.add(m.storage)
            total += trace.bytes_of(m.storage, read)
    return sympy.expand(total)


def _first_stack_op(trace: StepTrace, blocks: list[Any]) -> int | None:
    return next((i for i, b in enumerate(blocks) if b is not None and trace.ops[i].phase == "forward"), None)


def _grad_shape(trace: StepTrace, g: int | None, read: Any, shape: tuple[int, ...]) -> tuple[Any, ...] | None:
    """The gradient storage's shape where it is not the parameter's (a tensor-parallel rank's
    vocabulary-parallel embedding: DTensor makes its gradient whole, replicated), else None."""
    got = trace.storage_shape.get(g) if g is not None else None
    if got is None or tuple(got[0]) == tuple(shape):
        return None
    return tuple(read(d) for d in got[0])


def param_rows(
    trace: StepTrace, read: Any, names_count: dict[str, Any], stacks: list[str], blocks: list[Any]
) -> list[ParamRow]:
    """The parameter table (``ParamRow``): a stack's blocks summed into one row per generic name."""
    first = _first_stack_op(trace, blocks)
    places: dict[int, set[str]] = defaultdict(set)
    for i, rec in enumerate(trace.ops):
        if rec.phase != "forward":
            continue
        where = "stack" if blocks[i] is not None else ("before" if first is None or i < first else "after")
        for m in rec.inputs:
            places[m.storage].add(where)
    states: dict[str, list[tuple[str, tuple[Any, ...], int]]] = defaultdict(list)
    for st, (n, key) in trace.state_storages.items():
        shape, itemsize = trace.storage_shape.get(st, ((trace.storage_nbytes[st],), 1))
        states[n].append((key, tuple(read(d) for d in shape), itemsize))
    grads = {n: st for st, n in trace.grad_storages.items()}
    rows: dict[str, ParamRow] = {}
    for ph in trace.placeholders:
        if ph.kind != "param":
            continue
        module = ph.name.rpartition(".")[0]
        name = generic_path(ph.name, stacks) if block_of(module, stacks) else ph.name
        count = names_count[ph.name]
        if name in rows:
            rows[name] = dataclasses.replace(rows[name], count=rows[name].count + count)
            continue
        g = grads.get(ph.name)
        rows[name] = ParamRow(
            name=name,
            module=generic_path(module, stacks) if block_of(module, stacks) else module,
            shape=tuple(read(d) for d in ph.meta.shape),
            itemsize=ph.meta.itemsize,
            count=count,
            grad=g is not None,
            grad_itemsize=trace.storage_shape[g][1] if g is not None and g in trace.storage_shape else ph.meta.itemsize,
            states=tuple(sorted(states.get(ph.name, []))),
            places=frozenset(places.get(ph.meta.storage, {"before"})),
            grad_shape=_grad_shape(trace, g, read, ph.meta.shape),
        )
    return [dataclasses.replace(r, count=sympy.expand(r.count)) for r in rows.values() if r.count != 0]
