"""FSDP2's own buffers placed on the traced step: a rank's live bytes at every op and hook, exactly.

The single-device trace (the compute trace with a ``MixedPrecisionPolicy``) gives the activations, the
temporaries and the gradients as each op makes them; FSDP2's buffers are not ops of that trace, so they are
placed between its ops, at the hooks ``fully_shard`` runs (torch 2.13's ``_fsdp_param_group.py``; each
block sharded, then the root; read off a per-op storage log of real tensors on the fake process group and
checked against it, ``tests/test_fsdp_events.py``). A later step, with ``g`` a group (the root, or block i):

- forward: the root's pre-forward all-gathers into a flat buffer (``AG``: dp padded chunks of each
  parameter, in the gathered dtype) and copies out into the unsharded parameters (``UN``, the same bytes);
  block i's pre-forward allocates its ``AG``, copies out, and only then frees the previous group's ``AG``
  (three buffers at once); its post-forward frees its ``UN`` (``reshard_after_forward``). The last block's
  ``AG`` stays until the end of backward; the root's ``UN`` stays through backward;
- backward: the root's pre-backward prefetches the last block's ``AG``; block i's pre-backward copies it
  out (``UN`` and ``AG`` at once), frees it and prefetches block i-1's ``AG``; its ops make the unsharded
  gradients (the trace's); its post-backward frees ``UN``, frees the previous group's reduce-scatter input
  (``RS``), allocates its own ``RS`` (dp padded chunks of each gradient, in the reduce dtype) while the
  unsharded gradients live, frees them, and keeps the output: the sharded gradients (``SG``). The root
  reduces last, once backward is done; then every ``AG`` and ``RS`` still held is freed. With gradient
  accumulation (m > 1) every micro-batch is reduce-scattered: a later one holds every ``SG`` from its start
  and adds each new output into it (the peak is a later micro-batch's);
- the optimizer step sees the sharded parameters, states and gradients only (its temporaries: the
  rank's share of the single device's, ``symacct.parallel.rank``).

Trace storages of parameters and optimizer states are replaced by the rank's sharded ones; the gradients
stay the trace's, each freed at its group's post-backward. The result is a ``Liveness`` over points (the
forward and backward ops, and the hooks), factored by L as the trace's is, so ``symbolic_peak`` gives the
formula and ``evaluate`` the exact peak at any sizes.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any

from symacct.cost.layers import DROP
from symacct.memory.liveness import Intervals, Liveness

Expr = Any
FOREVER = 10**9
BACKWARD = ("backward", "recompute")  # a checkpointed block's forward runs again inside its backward


@dataclasses.dataclass(frozen=True)
class GroupBytes:
    """Bytes of one FSDP2 group's buffers (formulas): all-gather output (= its unsharded parameters),
    reduce-scatter input and sharded gradients."""

    gathered: Expr
    reduce_input: Expr
    sharded_grads: Expr


@dataclasses.dataclass
class _Trace:
    """One trace's ops as the overlay reads them."""

    iv: Intervals
    blocks: list[int | None]
    phases: list[str]
    drop: frozenset[int]  # the trace's parameter and state storages
    grads: frozenset[int]


def _points(tr: _Trace, n_blocks: int, reshard: bool) -> tuple[list[tuple[str, Any]], dict[Any, int]]:
    """The rank's points in order: ("op", t) for the forward and backward ops of the trace and ("hook",
    (name, block)) for FSDP2's; the index of each op and hook."""
    fwd = [t for t in range(tr.iv.n) if tr.phases[t] == "forward"]
    bwd = [t for t in range(tr.iv.n) if tr.phases[t] in BACKWARD]
    first_f = {b: next(t for t in fwd if tr.blocks[t] == b) for b in range(n_blocks)}
    first_b = {b: next(t for t in bwd if tr.blocks[t] == b) for b in range(n_blocks)}
    before: dict[int, list[Any]] = {}
    before.setdefault(fwd[0], []).append(("fwd.pre", "root"))
    for b in range(n_blocks):
        before.setdefault(first_f[b], []).append(("fwd.pre", b))
        if reshard:
            before.setdefault(first_b[b], []).extend([("bwd.copy", b), ("bwd.prefetch", b)])
    if reshard:
        before.setdefault(bwd[0], []).insert(0, ("bwd.prefetch", "root"))
    last_b = {b: max(t for t in bwd if tr.blocks[t] == b) for b in range(n_blocks)}
    after = {last_b[b]: [("bwd.rs", b), ("bwd.sg", b)] for b in range(n_blocks)}
    after.setdefault(bwd[-1], []).extend([("bwd.rs", "root"), ("bwd.sg", "root")])
    seq: list[tuple[str, Any]] = []
    for t in fwd + bwd:
        seq += [("hook", h) for h in before.get(t, [])]
        seq.append(("op", t))
        seq += [("hook", h) for h in after.get(t, [])]
    return seq, {item: i for i, item in enumerate(seq)}


def _overlay(
    tr: _Trace, n_blocks: int, reshard: bool, root: GroupBytes, block: GroupBytes, static: Expr, accumulating: bool
) -> tuple[Intervals, list[tuple[str, Any]], list[int | None]]:
    """The rank's live storages over its points (see the module docstring), the points and their blocks."""
    seq, at = _points(tr, n_blocks, reshard)
    op_at = {t: i for (kind, t), i in at.items() if kind == "op"}
    n = len(seq)
    last = n - 1
    ops = sorted(op_at)
    start: dict[int, float] = {}
    end: dict[int, float] = {}
    nbytes: dict[int, Expr] = {}

    def place(t: float) -> int:
        """The last rank point at or before op t of the trace (-1: before the step; past the backward: the
        last point)."""
        if t > ops[-1]:
            return last
        i = bisect.bisect_right(ops, t)
        return op_at[ops[i - 1]] if i else -1

    def hook(name: str, g: Any) -> int:
        return at[("hook", (name, g))]

    for st, s0 in tr.iv.start.items():
        if st in tr.drop or (s0 >= 0 and int(s0) not in op_at):  # parameters, states; made by the optimizer
            continue
        s = place(s0)
        if st in tr.grads:  # an unsharded gradient: freed at its group's post-backward, once reduced
            b = tr.blocks[int(s0)] if s0 >= 0 else None
            e = hook("bwd.rs", "root" if b is None else b)
        else:
            e = FOREVER if tr.iv.end[st] >= tr.iv.n else place(tr.iv.end[st])
        if e >= s:
            start[st], end[st], nbytes[st] = float(s), float(e), tr.iv.nbytes[st]
    ids = iter(range(-1, -(10**6), -1))

    def add(first: int, final: int, size: Expr) -> None:
        k = next(ids)
        start[k], end[k], nbytes[k] = float(first), float(final), size

    def sharded_grads(at_hook: int, size: Expr) -> None:
        """A group's reduce-scatter output: its sharded gradients from then on, or (a later micro-batch of
        gradient accumulation) added into the ones held since the step's start, freed once added."""
        add(-1 if accumulating else at_hook, FOREVER, size)
        if accumulating:
            add(at_hook, at_hook, size)

    f_end = max(i for t, i in op_at.items() if tr.phases[t] == "forward")
    add(-1, FOREVER, static)  # sharded parameters and optimizer states
    add(hook("fwd.pre", "root"), hook("fwd.pre", 0) if n_blocks else last, root.gathered)  # AG
    add(hook("fwd.pre", "root"), hook("bwd.rs", "root") - 1, root.gathered)  # UN, kept through backward
    add(hook("bwd.rs", "root"), last, root.reduce_input)
    sharded_grads(hook("bwd.sg", "root"), root.sharded_grads)
    for b in range(n_blocks):
        # the last block's: until the root's post-forward (the forward's last op)
        ag_end = hook("fwd.pre", b + 1) if b + 1 < n_blocks else f_end
        add(hook("fwd.pre", b), ag_end, block.gathered)
        if reshard:
            f_last = max(i for t, i in op_at.items() if tr.phases[t] == "forward" and tr.blocks[t] == b)
            add(hook("fwd.pre", b), f_last, block.gathered)  # UN in forward
            add(hook("bwd.copy", b), hook("bwd.rs", b) - 1, block.gathered)  # UN in backward
            issued = hook("bwd.prefetch", "root" if b == n_blocks - 1 else b + 1)
            add(issued, hook("bwd.copy", b), block.gathered)  # AG in backward
        else:
            add(hook("fwd.pre", b), hook("bwd.rs", b) - 1, block.gathered)
        # the reduce-scatter input lives until the next group's post-backward frees it
        add(hook("bwd.rs", b), hook("bwd.rs", b - 1 if b else "root") - 1, block.reduce_input)
        sharded_grads(hook("bwd.sg", b), block.sharded_grads)
    blocks = [tr.blocks[v] if k == "op" else (v[1] if isinstance(v[1], int) else None) for k, v in seq]
    return Intervals(n, start, end, nbytes), seq, blocks


def fsdp_liveness(
    live: Liveness, root: GroupBytes, block: GroupBytes, static: Expr, reshard: bool = True, accumulating: bool = False
) -> Liveness:
    """The FSDP2 rank's forward and backward, point by point (see the module docstring), from the compute
    trace's steady ``live``; ``static``: the rank's sharded parameters and optimizer states; ``accumulating``:
    a later micro-batch of gradient accumulation (each micro-batch reduce-scattered, its sharded gradients
    added into those held since the first)."""
    if live.other is None or not live.other_point_block:
        raise ValueError("the FSDP2 overlay needs a layer stack traced at two depths")
    n_blocks = live.layers
    phases = [lab[3] for lab in live.labels]
    base = _Trace(live.base, live.point_block, phases, live.owned - live.grads, live.grads)
    other = _Trace(
        live.other, live.other_point_block, live.other_phases, live.other_owned - live.other_grads, live.other_grads
    )
    iv, seq, blocks = _overlay(base, n_blocks, reshard, root, block, static, accumulating)
    iv2, seq2, _ = _overlay(other, n_blocks + 1, reshard, root, block, static, accumulating)
    where = {item: i for i, item in enumerate(seq2)}

    def counterpart(kind: str, v: Any) -> tuple[str, Any]:
        if kind == "op":
            return ("op", live.align[v])
        g = v[1]
        return ("hook", (v[0], g if g == "root" or g < DROP else g + 1))

    align = [where[counterpart(k, v)] for k, v in seq]
    labels = [
        (
            i,
            *(
                live.labels[v][1:]
                if k == "op"
                else (f"FSDP2 {v[0]}", f"group {v[1]}", "backward" if v[0].startswith("bwd") else "forward")
            ),
        )
        for i, (k, v) in enumerate(seq)
    ]
    return dataclasses.replace(
        live,
        base=iv,
        other=iv2,
        align=align,
        labels=labels,
        marks={},
        other_marks={},
        point_block=blocks,
    )
