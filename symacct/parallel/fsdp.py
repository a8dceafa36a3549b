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
- with a ``MixedPrecisionPolicy``'s ``param_dtype``, an all-gather's input is the local shards cast into one
  flat buffer (``GroupBytes.copy_in``), alive while the all-gather is issued: counted at each backward
  prefetch (at a pre-forward the copy-out's ``UN``, larger, follows it at the same hook);
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
from symacct.parallel.schedule import STAGE_KINDS

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
    # with a MixedPrecisionPolicy's param_dtype: the all-gather's input, each local shard cast into one flat
    # buffer (``_get_param_all_gather_inputs``' foreach copy), alive while the all-gather is issued; none
    # without a cast (the input is then the shards themselves)
    copy_in: Expr = 0


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
            if block.copy_in != 0:  # its input while the prefetch issues it (beside no new UN)
                add(issued, issued, block.copy_in)
        else:
            add(hook("fwd.pre", b), hook("bwd.rs", b) - 1, block.gathered)
        # the reduce-scatter input lives until the next group's post-backward frees it
        add(hook("bwd.rs", b), hook("bwd.rs", b - 1 if b else "root") - 1, block.reduce_input)
        sharded_grads(hook("bwd.sg", b), block.sharded_grads)
    blocks = [tr.blocks[v] if k == "op" else (v[1] if isinstance(v[1], int) else None) for k, v in seq]
    return Intervals(n, start, end, nbytes), seq, blocks


def _aligned(live: Liveness, seq: list[tuple[str, Any]], seq2: list[tuple[str, Any]]) -> list[int]:
    """Each point of an overlay on the probe's trace (``seq``: ops and hooks) in the overlay on the trace with
    one block more (``seq2``): an op by the traces' alignment, a hook by its group (blocks from ``DROP`` on
    one further)."""
    where = {item: i for i, item in enumerate(seq2)}

    def counterpart(kind: str, v: Any) -> tuple[str, Any]:
        if kind == "op":
            return ("op", live.align[v])
        g = v[1]
        return ("hook", (v[0], g if g == "root" or g < DROP else g + 1))

    return [where[counterpart(k, v)] for k, v in seq]


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
    align = _aligned(live, seq, seq2)
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


# ---------------------------------------------------------------------------------------------------------
# FSDP2 inside a pipeline stage (torch 2.13's PipelineStage over a fully_shard'ed stage module)
#
# Every backward runs with ``set_reshard_after_backward(False)`` and ``set_requires_gradient_sync(False)``;
# the schedule's last action (``perform_reduce_grad``) reshards and reduce-scatters every group once. So a
# block's parameters, once gathered for a backward, stay unsharded until the next forward's post-forward
# frees them (``reshard_after_forward``) or to the step's end, its gradients accumulate unsharded over the
# micro-batches, and the root (the stage module) never reshards within the step. Each compute action is one
# of five kinds, by what is unsharded when it starts:
#
# - ``F0``: the step's first forward: the root's pre-forward gathers the root (``AG`` until block 0's copy-
#   out, ``UN`` to the step's end); each block as FSDP2's forward does (``AG`` until the next block's copy-
#   out, the last block's until the root's post-forward: before the loss, which the schedule's ``loss_fn``
#   computes outside the stage module; ``UN`` until the block's post-forward, or kept without
#   ``reshard_after_forward``);
# - ``F``: a later forward that finds the blocks resharded (before any backward; in the interleaved schedule
#   also one after a forward after a backward): the same, the root already unsharded;
# - ``Fw``: a forward that finds every block unsharded (after a backward, or a forward without
#   ``reshard_after_forward``; the interleaved runtime's first, after its UNSHARD): no all-gather, each block
#   freed at its post-forward (``reshard_after_forward``) or kept;
# - ``B``: a backward after a forward (every block resharded): the root's pre-backward (on the last stage,
#   once the loss's backward has made the logits' gradient) prefetches the last block's ``AG``; each block's
#   pre-backward copies it out (``UN``, kept), frees it and prefetches the block before;
# - ``Bw``: a backward after a backward: everything unsharded already, no all-gather.
#
# (``STAGE_KINDS``; ``symacct.parallel.schedule.stage_kinds`` reads them off a stage's order of actions.)
#
# With a ``MixedPrecisionPolicy`` whose reduce_dtype is not param_dtype (bf16 parameters, fp32 reduction:
# torchtitan's default), each group's post-backward (a block's after its last backward op, the root's at the
# backward's end) moves the gradients backward made in param_dtype into unsharded accumulators of reduce_dtype:
# the first backward allocates them (``to_accumulated_grad_if_needed``: the copy beside the gradient it copies),
# each later one adds its new gradients in and frees them (``accumulate_unsharded_grad_if_needed``); the
# accumulators are what ``perform_reduce_grad`` reduce-scatters.


@dataclasses.dataclass(frozen=True)
class Accumulators:
    """FSDP2's reduce_dtype accumulators in a pipeline stage's backward: the root's and one block's bytes, the
    trace's gradient storages (each freed at its group's post-backward), and whether this backward is the
    first (``fresh``: it allocates them; later ones find them held, counted beside)."""

    root: Expr
    block: Expr
    grads: frozenset[int]
    fresh: bool


def _stage_overlay(
    iv: Intervals,
    ops: list[int],
    blocks: list[int | None],
    n_blocks: int,
    kind: str,
    edge: int,
    reshard: bool,
    root: GroupBytes,
    block: GroupBytes,
    accumulators: Accumulators | None = None,
) -> tuple[Intervals, list[tuple[str, Any]]]:
    """One trace's storages over the points of one compute action of ``kind`` (its ``ops`` and FSDP2's hooks
    between them; ``edge``: the root's post-forward's last op (F kinds) or the op before which its pre-backward
    runs (B)), with the unsharded parameters and all-gather outputs as the module comment above says;
    ``accumulators``: a backward's new gradients moved into them at each group's post-backward."""
    if kind not in STAGE_KINDS:
        raise ValueError(f"no FSDP2 stage kind {kind!r}")
    first = {b: next(t for t in ops if blocks[t] == b) for b in range(n_blocks)}
    last = {b: max(t for t in ops if blocks[t] == b) for b in range(n_blocks)}
    moved = accumulators if kind in ("B", "Bw") else None  # a backward's gradients moved at post-backward
    after: dict[int, list[Any]] = {}
    if moved is not None:  # each block's post-backward after its last op; the root's at the backward's end
        for b in range(n_blocks):
            after.setdefault(last[b], []).append(("bwd.post", b))
        after.setdefault(ops[-1], []).append(("bwd.post", "root"))
    before: dict[int, list[Any]] = {}
    if kind in ("F0", "F"):
        if kind == "F0":
            before.setdefault(ops[0], []).append(("fwd.pre", "root"))
        for b in range(n_blocks):
            before.setdefault(first[b], []).append(("fwd.pre", b))
    elif kind == "B":
        before.setdefault(edge, []).append(("bwd.prefetch", "root"))
        for b in reversed(range(n_blocks)):
            before.setdefault(first[b], []).extend([("bwd.copy", b), ("bwd.prefetch", b)])
    seq: list[tuple[str, Any]] = []
    for t in ops:
        seq += [("hook", h) for h in before.get(t, [])]
        seq.append(("op", t))
        seq += [("hook", h) for h in after.get(t, [])]
    at = {item: i for i, item in enumerate(seq)}
    op_at = {t: at[("op", t)] for t in ops}
    n = len(seq)
    start: dict[int, float] = {}
    end: dict[int, float] = {}
    nbytes: dict[int, Expr] = {}

    def place(t: float) -> int:
        """The last point at or before op t (-1: before the action; past it: the last point)."""
        i = bisect.bisect_right(ops, t)
        return op_at[ops[i - 1]] if i else -1

    def hook(name: str, g: Any) -> int:
        return at[("hook", (name, g))]

    for st, s0 in iv.start.items():
        if s0 > ops[-1]:  # made after this action (the next phase, the optimizer)
            continue
        s = place(s0)
        e = FOREVER if iv.end[st] >= iv.n else place(iv.end[st])
        if moved is not None and st in moved.grads and s0 >= 0:
            made_by = blocks[int(s0)]
            e = hook("bwd.post", "root" if made_by is None else made_by)  # added in (or moved), freed
        if e >= s and e >= 0:
            start[st], end[st], nbytes[st] = float(s), float(e), iv.nbytes[st]
    ids = iter(range(-1, -(10**6), -1))

    def add(first_at: int, final: int, size: Expr) -> None:
        if size != 0:
            k = next(ids)
            start[k], end[k], nbytes[k] = float(first_at), float(final), size

    if moved is not None and moved.fresh:  # the first backward makes them
        add(hook("bwd.post", "root"), FOREVER, moved.root)
        for b in range(n_blocks):
            add(hook("bwd.post", b), FOREVER, moved.block)
    if kind == "F0":
        add(hook("fwd.pre", "root"), hook("fwd.pre", 0), root.gathered)  # AG
        add(hook("fwd.pre", "root"), FOREVER, root.gathered)  # UN, to the step's end
    else:
        add(-1, FOREVER, root.gathered)
    for b in range(n_blocks):
        post_forward = op_at[last[b]] if reshard else FOREVER
        if kind in ("F0", "F"):
            ag_end = hook("fwd.pre", b + 1) if b + 1 < n_blocks else op_at[edge]
            add(hook("fwd.pre", b), ag_end, block.gathered)
            add(hook("fwd.pre", b), post_forward, block.gathered)
        elif kind == "Fw":
            add(-1, post_forward, block.gathered)
        elif kind == "B":
            issued = hook("bwd.prefetch", "root" if b == n_blocks - 1 else b + 1)
            add(issued, hook("bwd.copy", b), block.gathered)
            add(issued, issued, block.copy_in)  # the all-gather's input while the prefetch issues it
            add(hook("bwd.copy", b), FOREVER, block.gathered)
        else:
            add(-1, FOREVER, block.gathered)
    return Intervals(n, start, end, nbytes), seq


def stage_fsdp_liveness(
    live: Liveness,
    kind: str,
    ops: list[int],
    edge: int,
    other_ops: list[int],
    other_edge: int,
    root: GroupBytes,
    block: GroupBytes,
    reshard: bool,
    accumulators: tuple[Expr, Expr, bool] | None = None,
) -> Liveness:
    """A pipeline stage's live bytes beside its sharded parameters and states over one compute action of
    ``kind`` (``STAGE_KINDS``): the stage's own liveness (``symacct.parallel.rank._stage_live``) over its
    ``ops`` of that phase, FSDP2's hooks placed between them; ``other_ops``, ``other_edge``: the same in
    the trace with one block more, so that the result is factored by L as the trace's is. ``accumulators``:
    the root's and one block's reduce_dtype accumulators and whether this is the stage's first backward (see
    ``Accumulators``)."""
    if live.other is None or not live.other_point_block:
        raise ValueError("the FSDP2 overlay needs a layer stack traced at two depths")
    n_blocks = live.layers
    acc = acc2 = None
    if accumulators is not None:
        acc = Accumulators(accumulators[0], accumulators[1], live.grads, accumulators[2])
        acc2 = dataclasses.replace(acc, grads=live.other_grads)
    iv, seq = _stage_overlay(live.base, ops, live.point_block, n_blocks, kind, edge, reshard, root, block, acc)
    iv2, seq2 = _stage_overlay(
        live.other, other_ops, live.other_point_block, n_blocks + 1, kind, other_edge, reshard, root, block, acc2
    )
    phase = "forward" if kind.startswith("F") else "backward"
    return dataclasses.replace(
        live,
        base=iv,
        other=iv2,
        align=_aligned(live, seq, seq2),
        labels=[
            (i, *(live.labels[v][1:] if k == "op" else (f"FSDP2 {v[0]}", f"group {v[1]}", phase)))
            for i, (k, v) in enumerate(seq)
        ],
        marks={},
        other_marks={},
        point_block=[live.point_block[v] if k == "op" else (v[1] if isinstance(v[1], int) else None) for k, v in seq],
        other_point_block=[
            live.other_point_block[v] if k == "op" else (v[1] if isinstance(v[1], int) else None) for k, v in seq2
        ],
    )
