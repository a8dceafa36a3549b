"""Static bytes and saved activations: parameters, gradients, optimizer states, what autograd saves.

Conventions (docs/conventions.md, "Memory"): bytes of distinct storages; a saved activation is a storage
that autograd packs through ``saved_tensors_hooks`` in forward, parameters and the step's inputs excluded,
counted once per layer for an op in the layer stack; optimizer states are the storages the optimizer keeps
in ``state`` after its first step; the checkpoint is what ``torch.save`` of the model's and the
optimizer's state dicts holds.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import sympy

from symacct.cost.layers import op_blocks
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
    for st, nbytes in trace.saved_storages.items():
        producer = trace.storage_producer.get(st)
        if producer is None:
            continue
        c = counts[producer]
        if c == 0:
            continue
        b = trace.bytes_of(st, nb, nbytes)
        module = trace.ops[producer].module
        acts += b * c
        by_module[generic(module)] += b * c
        if c.has(L):
            per_layer[blocks[producer][0]] += b
    buffers = sympy.Integer(0)
    for ph in trace.placeholders:
        if ph.kind == "buffer" and ph.meta.storage in trace.persistent_buffers:
            buffers += trace.bytes_of(ph.meta.storage, nb) * names_count.get(ph.name, 1)
    mem.checkpoint = sympy.expand(params + buffers + sum(by_state.values(), sympy.Integer(0)))
    # the KV cache after a serving step: each storage a layer made, counted as its layer is
    cache = sympy.Integer(0)
    for st in trace.cache_storages:
        producer = trace.storage_producer.get(st)
        c = counts[producer] if producer is not None else 1
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
    return mem
