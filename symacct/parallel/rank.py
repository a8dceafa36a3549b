"""Per-rank memory and communication of a parallel layout, as formulas in the model's sizes and the degrees.

Everything is read off the single-device derivation (``symacct.derive``; for tensor or context parallelism,
one traced rank's: ``tensor_parallel=``, ``context_parallel=``, whose ring collectives join the rank's): its
parameter table
(``Memory.tensors``: every parameter's shape dimension by dimension, its count, gradient and optimizer
states), its saved activations split into the layer stack and what runs before and after it, the bytes one
block hands the next, and its single-device peak. The sharding rules below are PyTorch's, each checked
against the real code (fake process group and real gloo runs, ``tests/test_parallel.py``):

- FSDP2 (``fully_shard`` of each block, then the root) splits every parameter on dim 0 into ``dp`` chunks
  of ``ceil(d0 / dp)`` rows, padded: each rank stores a padded chunk of every parameter and a padded chunk
  of its gradient (one reduce-scatter output per group); AdamW's ``exp_avg`` and ``exp_avg_sq`` take the
  unpadded local shape, so rank 0 holds the most (``ceil(d0 / dp)`` rows); the ``step`` scalars are not
  sharded. An all-gather's payload is ``dp`` padded chunks; the root is not resharded after forward, so
  backward gathers the blocks only. ZeRO-1 and ZeRO-2 are modelled with the same per-parameter chunks
  (optimizer states; and gradients) over full parameters (Megatron's distributed optimizer and DeepSpeed
  shard flat buffers instead: the same bytes up to the padding).
- DDP keeps every gradient twice (the gradient and its bucket) unless ``gradient_as_bucket_view``; one
  all-reduce of every gradient byte per step (in buckets: the total is what is counted).
- The pipeline: stage s of ``pp`` holds ``L / pp`` blocks; the first also what runs before the stack,
  the last what runs after it; a weight used both before and after (a tied embedding and head) is held by
  both, its gradient all-reduced between them. Saved activations follow PyTorch's schedule
  (``symacct.parallel.schedule``): the most (stage, micro-batch) pairs a rank holds at once.

Peak per rank, of a later step (the optimizer states alive from its start; ``Liveness.steady``). DDP without a
pipeline: the single-device peak plus the reducer's buckets, the buffer broadcast's point, and the gradients
held through a later micro-batch of gradient accumulation (``Parallel.replica_peaks``). FSDP2 and HSDP (one
layer stack, no pipeline): the traced step with FSDP2's own buffers placed at its hooks
(``symacct.parallel.fsdp``), every point evaluated exactly by ``at()`` and the planner, and the optimizer
step. A pipeline with GPipe or 1F1B: every point of the rank's schedule as PyTorch's runtime runs it
(``schedule.runtime_holds``: the stage's micro-batch in flight at every op, the held micro-batches' saved
activations, the runtime's receive buffers, the outputs and input gradients its send ops keep, the last
stage's kept outputs and losses; ``_pipeline_peak``, ``Parallel.pipeline_peaks``), and the optimizer step (the
stage's own parameters' ops); the interleaved schedule likewise, chunk by chunk
(``schedule.interleaved_holds``: every send's work kept to the step's end; ``Parallel._chunks_peak``), with
FSDP2 over its chunks each point's chunk states too (``schedule.interleaved_fsdp_points`` on PyTorch's own
lowering: each UNSHARD's outputs until the chunk's next action, a RESHARD's eviction, each chunk's REDUCE_GRAD
after its last backward; ``Parallel._chunks_fsdp_peak``). Every
other layout: parameters and optimizer states of the rank plus the larger of (held activations + ``working`` —
FSDP2's gathered root and one gathered block where the overlay does not apply — + ``transient``, the single-
device peak's bytes beyond its parameters, states and saved bytes at its forward and backward points, + the
rank's gradients when a backward ran before: 1F1B, gradient accumulation) and (the rank's gradients + the
optimizer step's temporaries scaled by the rank's share of the states, rounded up, + its buffers, inputs and
loss). docs/distributed.md gives how far each was measured off.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import sympy
import torch

from symacct.accounting import size_one_note
from symacct.cost.graph import records
from symacct.cost.layers import DROP, differing_ends, first_block_own, generic_path, op_blocks, stage_share
from symacct.errors import SymacctError
from symacct.memory.liveness import Liveness
from symacct.memory.static import ParamRow
from symacct.options import DTYPES
from symacct.parallel.fsdp import GroupBytes, fsdp_liveness, stage_fsdp_liveness
from symacct.parallel.layout import Layout, check_model
from symacct.parallel.schedule import (
    actions,
    chunk_gathers,
    chunk_unshards,
    in_flight,
    interleaved_fsdp_points,
    interleaved_holds,
    runtime_holds,
    stage_kinds,
)
from symacct.symbols import evaluate, exact_form, sym

if TYPE_CHECKING:
    from symacct.accounting import Accounting

Expr = Any
ZERO = sympy.Integer(0)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One kind of collective on one rank: ``count`` calls per step of ``payload`` bytes each.

    Payload is the whole tensor (an all-gather's output, a reduce-scatter's input, an all-reduce's
    tensor, a send's or receive's tensor); ``wire`` the bytes each rank sends per call on a ring: ``(n-1)/n``
    of the payload for all-gather and reduce-scatter, ``2(n-1)/n`` for all-reduce, the payload for a send,
    a broadcast or an all-to-all (context parallelism's ring permutes: all of it to the next rank), none for
    a receive (its sender counts it)."""

    op: str  # all_gather | reduce_scatter | all_reduce | all_to_all | broadcast | send | recv
    group: str  # dp | dp_shard | dp_replicate | pp | tied | tp | cp | dp_cp | dp_shard_cp
    size: Expr
    payload: Expr
    count: Expr
    phase: str  # forward | backward | optimizer
    what: str

    @property
    def wire(self) -> Expr:
        n = self.size
        factor = {"all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_reduce": 2 * (n - 1) / n}
        return self.payload * factor.get(self.op, 0 if self.op == "recv" else 1)


@dataclasses.dataclass
class Rank:
    """One pipeline rank (data-parallel rank 0: the largest chunks) as formulas."""

    stage: str  # only | first | middle | last
    params: Expr
    grads: Expr
    optimizer: Expr
    activations: Expr
    working: Expr  # FSDP2's gathered root and one block; DDP's bucket copy
    # the additive model's temporaries (0 where the peak is evaluated at every point: FSDP2's buffers on the
    # trace, a GPipe or 1F1B schedule)
    transient: Expr
    flops: Expr  # model FLOPs this rank runs in one step (all its micro-batches)
    collectives: list[Collective]
    # model FLOPs of one micro-batch: through one stage chunk of the stack, and before / after the stack
    chunk: dict[str, Expr] = dataclasses.field(default_factory=dict)
    peak: Expr = 0  # see the module docstring
    runtime: Expr = 0  # a pipeline runtime's receive buffers and the whole batch's inputs, kept through the step

    @property
    def static(self) -> Expr:
        return self.params + self.grads + self.optimizer

    def comm_bytes(self) -> Expr:
        """Payload bytes of every collective of the step."""
        return sum((c.payload * c.count for c in self.collectives), ZERO)

    def wire_bytes(self) -> Expr:
        return sum((c.wire * c.count for c in self.collectives), ZERO)


@dataclasses.dataclass
class Parallel:
    """Per-rank figures of a layout (``ranks``: one per kind of pipeline rank), formulas in the model's
    symbols and ``dp``, ``pp``, ``m`` (and ``dp_shard`` for HSDP); ``values`` once evaluated."""

    layout: Layout
    acct: Accounting
    ranks: list[Rank]
    in_flight: list[int]  # per pipeline rank: (stage-chunk, micro-batch) activations held at most
    notes: list[str]
    values: dict[str, int] | None = None
    held: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)  # stage kind -> k, k_first, k_last
    # set on an evaluated copy, for the step time: the job's model FLOPs of one step (flops.total * m * dp * tp),
    # the single-device optimizer phase's bytes read and written, and its optimizer-state bytes
    job_flops: Any = None
    optimizer_bytes: Any = None
    acct_optimizer: Any = None
    compute: Accounting | None = None  # FSDP2 mixed precision: the trace forward and backward run (derive_parallel)
    # FSDP2 without a pipeline: the rank's live bytes with FSDP2's buffers at every point, and its static bytes
    overlay: tuple[Liveness, Expr] | None = None
    stages: dict[str, StageParts] = dataclasses.field(default_factory=dict)  # a pipeline's, per stage kind

    def degrees(self) -> dict[str, int]:
        lay = self.layout
        out = {"dp": lay.dp, "pp": lay.pp, "m": lay.micro_batches, "v": lay.stages_per_rank}
        if lay.tp > 1:
            out["tp"] = lay.tp
        if lay.cp > 1:
            out["cp"] = lay.cp
        if lay.hsdp_shard:
            out["dp_shard"] = lay.hsdp_shard
        return out

    def at(self, **sizes: int) -> Parallel:
        """Every formula at the model's sizes (as ``Accounting.at``) and the layout's degrees, exactly."""
        tp = {"tp": self.layout.tp} if self.layout.tp > 1 else {}
        values = self.acct.values_at(**sizes, **tp)  # checked; only the formulas needed are evaluated
        base = {**values, **self.degrees()}

        def ev(e: Expr, values: dict[str, int]) -> int:
            try:
                got = exact_form(sympy.sympify(e))(values)
            except KeyError as missing:
                raise SymacctError(f"{e} has a symbol with no value: {missing}", internal=True) from None
            if not isinstance(got, int):
                raise SymacctError(f"{e} is not a whole number at these sizes: {got}", internal=True)
            return got

        ranks = self.evaluated_ranks(base, ev)
        lay = self.layout
        if self.replicated():
            ranks = self.replica_peaks(ranks, values)
        elif self.overlay is not None:
            ranks = self.overlay_peaks(ranks, base)
        elif lay.pp > 1:
            ranks = self.pipeline_peaks(ranks, base)
        ones = self.acct._unit_sizes({sym(k): v for k, v in values.items()})
        notes = self.notes + ([size_one_note(ones)] if ones else [])
        return dataclasses.replace(
            self,
            ranks=ranks,
            notes=notes,
            values=base,
            # the job's model FLOPs (a TP rank's: x tp; a CP rank's, its ring's share: x cp)
            job_flops=evaluate((self.compute or self.acct).flops.total, base)
            * lay.micro_batches
            * lay.dp
            * lay.tp
            * lay.cp,
            optimizer_bytes=evaluate(optimizer_bytes(self.acct), base),
            acct_optimizer=evaluate(self.acct.memory.optimizer, base),
        )

    def replicated(self) -> bool:
        """Replicas of the single-device (or tensor-parallel rank's) step: DDP, or one data-parallel rank."""
        lay = self.layout
        return lay.pp == 1 and (lay.replicas == 1 or lay.dp_mode == "ddp") and self.acct.liveness is not None

    def replica_peaks(self, ranks: list[Rank], values: dict[str, int]) -> list[Rank]:
        """Replicas (``replicated``): the later step's peak exactly, at every op (not the envelope of the points
        sampled for the formula), plus DDP's buckets; with ``gradient_as_bucket_view`` each gradient freed once
        copied into its bucket; with gradient accumulation the gradients an earlier micro-batch left held
        through the next, each new one freed once added in (``_brief_peak``); ``values``: the model's sizes."""
        lay = self.layout
        steady = _steady_live(self.acct).evaluate(values)[0]
        out = []
        for r in ranks:
            peak = steady
            if lay.bucket_view or lay.micro_batches > 1:
                brief = _part(self.acct, "brief_live").evaluate(values)[0]
                peak = max(steady, brief + int(r.grads)) if lay.micro_batches > 1 else brief
            sync = compiled(self.acct, _buffer_broadcast(self.acct, lay))(values) if lay.replicas > 1 else 0
            out.append(dataclasses.replace(r, peak=max(peak, sync) + int(r.working)))
        return out

    def _schedule_points(self) -> bool:
        """A pipeline whose peaks ``pipeline_peaks`` evaluates at the schedule's points (gpipe, 1f1b)."""
        lay = self.layout
        return lay.pp > 1 and lay.schedule in SCHEDULE_RUNTIMES and bool(self.stages)

    def pipeline_peaks(self, ranks: list[Rank], values: dict[str, int]) -> list[Rank]:
        """A pipeline (gpipe, 1f1b, interleaved: ``_chunks_peak``): each evaluated rank's peak exactly, at every op of
        the micro-batch in flight at every point of the schedule (``_pipeline_peak``'s terms; the formula's in-
        flight bytes are the ``Max`` over the ops largest in a sample of the sizes); ``values``: the sizes and the
        degrees. Other layouts: ``ranks`` as they are."""

        lay = self.layout
        if not self._schedule_points():
            return ranks
        run = self.compute or self.acct
        local = {**values, "L": values["L"] // (lay.pp * lay.stages_per_rank)}  # one stage chunk's blocks
        beside = evaluate(_optimizer_beside(self.acct, lay), values)
        out = []
        for r in ranks:
            if lay.stages_per_rank > 1:
                chunks = self._chunks_fsdp_peak if self.stages[r.stage].chunk_fsdp else self._chunks_peak
                out.append(dataclasses.replace(r, peak=chunks(r, values, local, beside)))
                continue
            parts = self.stages[r.stage]
            if parts.fsdp is not None:
                out.append(dataclasses.replace(r, peak=self._fsdp_stage_peak(r, parts, values, local, beside)))
                continue
            held, sent, loss, head, runtime = (
                compiled(run, e)(values) for e in (parts.held, parts.boundary, parts.loss, parts.head, parts.runtime)
            )
            own = _stage_own(run, r.stage, local)
            grads_b, working = int(r.grads), int(r.working)
            best = 0
            index = stage_rank(r.stage, lay.pp)
            for kind, grads, others, refs, losses, outs in _peak_points(
                lay.schedule, lay.pp, lay.micro_batches, index, lay.return_outputs
            ):
                here = 0 if kind == "end" else own[(kind, grads)]
                here += _beside(others, refs, losses, outs, grads, held, sent, loss, head, grads_b, working)
                best = max(best, here)
            kept = lay.micro_batches * head if r.stage == "last" and lay.return_outputs else 0
            if _own_optimizer(run, lay):  # the stage's own optimizer ops, exactly
                opt = own[("O", False)] + kept + _ddp_buckets(lay, working)
            else:
                opt = self._shared_optimizer(r, values, beside) + kept
            peak = int(r.params) + int(r.optimizer) + runtime + max(best, opt)
            out.append(dataclasses.replace(r, peak=peak))
        return out

    def _fsdp_stage_peak(
        self, r: Rank, parts: StageParts, values: dict[str, int], local: dict[str, int], beside: int
    ) -> int:
        """FSDP2 over a pipeline stage: its peak exactly, at every op and hook of each compute action as its
        kind (``stage_kinds``) has FSDP2's buffers, the gradients accumulating unsharded, then at every group's
        reduce-scatter (``_reduce_phase``) and the optimizer step (the share model, on the shards)."""
        lay = self.layout
        run = self.compute or self.acct
        fs = parts.fsdp
        assert fs is not None
        held, sent, loss, head, runtime = (
            compiled(run, e)(values) for e in (parts.held, parts.boundary, parts.loss, parts.head, parts.runtime)
        )
        blocks = local["L"]
        unsharded = compiled(run, fs.root_grads)(values) + blocks * compiled(run, fs.block_grads)(values)
        points = _peak_points(
            lay.schedule, lay.pp, lay.micro_batches, stage_rank(r.stage, lay.pp), lay.return_outputs, fs.reshard
        )
        sizes = {**local, "dp": values["dp"], **({"dp_shard": values["dp_shard"]} if "dp_shard" in values else {})}
        own: dict[tuple[str, bool], int] = {}
        best = 0
        for kind, grads, others, refs, losses, outs in points:
            if kind == "R":  # every unsharded gradient still held: in the reduce phase's own bytes
                here = _reduce_phase(run, fs, values, blocks)
                here += _beside(others, refs, losses, outs, False, held, sent, loss, head, 0, 0)
            elif kind == "end":  # reduced: the sharded gradients
                here = _beside(others, refs, losses, outs, True, held, sent, loss, head, int(r.grads), 0)
            else:
                if (kind, grads) not in own:
                    own[kind, grads] = _fsdp_stage_own(run, r.stage, kind, grads, fs, sizes)
                here = own[kind, grads]
                here += _beside(others, refs, losses, outs, grads, held, sent, loss, head, unsharded, 0)
            best = max(best, here)
        kept = lay.micro_batches * head if r.stage == "last" and lay.return_outputs else 0
        opt = self._shared_optimizer(r, values, beside) + kept
        return int(r.params) + int(r.optimizer) + runtime + max(best, opt)

    def _chunks_peak(self, r: Rank, values: dict[str, int], local: dict[str, int], beside: int) -> int:
        """An interleaved rank's peak exactly: ``_chunk_point`` at every point of ``interleaved_holds``, each
        chunk's micro-batch in flight at every op (``_stage_own`` of its kind, L/(pp v) blocks), and the
        optimizer step (``_chunks_optimizer``)."""
        lay = self.layout
        run = self.compute or self.acct
        kinds = chunk_kinds(lay.pp, lay.stages_per_rank, stage_rank(r.stage, lay.pp))
        parts = self.stages[r.stage]
        num = {k: tuple(compiled(run, e)(values) for e in ex) for k, ex in _chunk_parts(run, lay).items()}
        boundary, loss, head, runtime = (
            compiled(run, e)(values) for e in (parts.boundary, parts.loss, parts.head, parts.runtime)
        )
        own = {k: _stage_own(run, k, local) for k in set(kinds)}
        working = int(r.working)
        best = 0
        index = stage_rank(r.stage, lay.pp)
        for h in _chunk_peak_points(lay.pp, lay.micro_batches, lay.stages_per_rank, index, lay.return_outputs):
            here = 0 if h.kind == "end" else own[kinds[h.chunk]][(h.kind, h.grads[h.chunk])]
            best = max(best, here + _chunk_point(h, kinds, num, boundary, loss, head, working))
        kept = lay.micro_batches * head if "last" in kinds and lay.return_outputs else 0
        if _own_optimizer(run, lay):
            own_opt = {k: own[k][("O", False)] for k in own}
            opt = _chunks_optimizer(kinds, own_opt, num) + kept + _ddp_buckets(lay, working)
        else:
            opt = self._shared_optimizer(r, values, beside) + kept
        return int(r.params) + int(r.optimizer) + runtime + max(best, opt)

    def _chunks_fsdp_peak(self, r: Rank, values: dict[str, int], local: dict[str, int], beside: int) -> int:
        """An interleaved rank with FSDP2 over each stage chunk: its peak exactly, at every point of
        ``interleaved_fsdp_points`` (the chunk in flight at every op and hook of its action's FSDP2 kind, the
        wait on its UNSHARD, its REDUCE_GRAD), the other chunks' parameters and gradients as their state then
        has them (``_chunk_fsdp_beside``), and the optimizer step on the shards (the share model)."""
        lay = self.layout
        run = self.compute or self.acct
        index = stage_rank(r.stage, lay.pp)
        kinds = chunk_kinds(lay.pp, lay.stages_per_rank, index)
        parts = self.stages[r.stage]
        num = {k: tuple(compiled(run, e)(values) for e in ex) for k, ex in _chunk_parts(run, lay).items()}
        boundary, loss, head, runtime = (
            compiled(run, e)(values) for e in (parts.boundary, parts.loss, parts.head, parts.runtime)
        )
        blocks = local["L"]
        groups = {
            k: _chunk_groups(fs, blocks, lambda e: compiled(run, e)(values)) for k, fs in parts.chunk_fsdp.items()
        }
        sizes = {**local, "dp": values["dp"]}
        own: dict[tuple[str, str, bool], int] = {}
        best = 0
        for p in _chunk_fsdp_peak_points(
            lay.pp, lay.micro_batches, lay.stages_per_rank, index, lay.return_outputs, lay.reshard_after_forward
        ):
            h, c = p.held, p.held.chunk
            k = kinds[c] if c >= 0 else ""
            if p.kind == "end":
                here = 0
            elif p.kind == "U":
                here = groups[k].waiting
            elif p.kind == "R":
                here = _reduce_phase(run, parts.chunk_fsdp[k], values, blocks)
            else:
                if (k, p.kind, h.grads[c]) not in own:
                    own[k, p.kind, h.grads[c]] = _fsdp_stage_own(run, k, p.kind, h.grads[c], parts.chunk_fsdp[k], sizes)
                here = own[k, p.kind, h.grads[c]]
            here += _chunk_fsdp_beside(p, kinds, num, groups, boundary, loss, head)
            best = max(best, here)
        kept = lay.micro_batches * head if "last" in kinds and lay.return_outputs else 0
        opt = self._shared_optimizer(r, values, beside) + kept
        return int(r.params) + int(r.optimizer) + runtime + max(best, opt)

    def _shared_optimizer(self, r: Rank, values: dict[str, int], beside: int) -> int:
        """A pipeline rank's optimizer step on the share model (a foreach step, ZeRO-1): its gradients, the
        single device's temporaries scaled by its share of the states, ``beside`` and DDP's buckets."""
        share = _ceil_share(self.acct, int(r.optimizer), values)
        return int(r.grads) + share + beside + _ddp_buckets(self.layout, int(r.working))

    def overlay_peaks(self, ranks: list[Rank], values: dict[str, int]) -> list[Rank]:
        """FSDP2 without a pipeline: each evaluated rank's peak exactly at every point of the step with FSDP2's
        buffers on it (``symacct.parallel.fsdp``), not the envelope of the points sampled for the formula;
        ``values``: the sizes and the degrees."""
        if self.overlay is None:
            return ranks
        ov, static = self.overlay
        steps, held = ov.evaluate(values)[0], evaluate(static, values)
        beside = evaluate(_optimizer_beside(self.acct, self.layout), values)
        out = []
        for r in ranks:
            opt = held + int(r.grads) + _ceil_share(self.acct, int(r.optimizer), values) + beside
            out.append(dataclasses.replace(r, peak=max(steps, opt)))
        return out

    def evaluated_ranks(self, base: dict[str, int], ev: Callable[[Expr, dict[str, int]], Any]) -> list[Rank]:
        """Every rank's formulas through ``ev(formula, values)``, each with its stage's held micro-batches (the
        peak left at 0 where ``pipeline_peaks`` or ``overlay_peaks`` evaluates it)."""
        skip: tuple[str, ...] = ("stage", "collectives", "chunk")
        if self._schedule_points() or self.overlay is not None:  # every point evaluated: pipeline_peaks, overlay_peaks
            skip += ("peak",)
        names = [f.name for f in dataclasses.fields(Rank) if f.name not in skip]
        return [_evaluated(r, {**base, **self.held.get(r.stage, {})}, ev, names) for r in self.ranks]

    def worst(self) -> Rank:
        """The rank with the largest peak (evaluated copies only)."""
        if self.values is None:
            raise SymacctError("worst() compares numbers: call it on parallel.at(B=..., S=...)")
        return max(self.ranks, key=lambda r: r.peak)


def _evaluated(r: Rank, vals: dict[str, int], ev: Callable[[Expr, dict[str, int]], Any], names: list[str]) -> Rank:
    """``r`` with its fields ``names``, its collectives and its chunk FLOPs through ``ev`` at ``vals``; each
    formula once (a rank's collectives share their formulas: sizes, payloads, counts)."""
    seen: dict[int, Any] = {}

    def one(e: Expr) -> Any:
        got = seen.get(id(e))
        if got is None:
            got = seen[id(e)] = ev(e, vals)
        return got

    fields = {name: one(getattr(r, name)) for name in names}
    colls = [
        Collective(c.op, c.group, one(c.size), one(c.payload), one(c.count), c.phase, c.what) for c in r.collectives
    ]
    chunk = {k: one(e) for k, e in r.chunk.items()}
    return Rank(stage=r.stage, collectives=colls, chunk=chunk, **fields)


def optimizer_bytes(acct: Accounting) -> Expr:
    """Bytes the single-device step's optimizer phase reads and writes (all bytes less forward and backward)."""
    b = acct.bytes
    return sympy.expand(b.read + b.written - b.read_forward - b.written_forward - b.read_backward - b.written_backward)


def _chunk(d0: Expr, n: Expr) -> Expr:
    return sympy.ceiling(d0 / n)


def _grad_numel(row: ParamRow) -> Expr:
    """Elements of the gradient backward makes for ``row``: its own shape, or a replicated gradient's (a
    tensor-parallel rank's vocabulary-parallel embedding: ``ParamRow.grad_shape``)."""
    return sympy.Mul(*row.grad_shape) if row.grad_shape else row.numel


def _rows_bytes(
    rows: list[tuple[ParamRow, Expr]], n: Expr, *, shard_params: bool, shard_grads: bool, shard_states: bool
) -> tuple[Expr, Expr, Expr]:
    params = grads = states = ZERO
    for row, copies in rows:
        rest = sympy.Mul(*row.shape[1:]) if len(row.shape) > 1 else sympy.Integer(1)
        d0 = row.shape[0] if row.shape else sympy.Integer(1)
        local = _chunk(d0, n) * rest if row.shape else sympy.Integer(1)
        full = row.numel
        params += copies * row.itemsize * (local if shard_params else full)
        if row.grad:
            grads += copies * row.grad_itemsize * (local if shard_grads else _grad_numel(row))
        for _key, shape, itemsize in row.states:
            same = tuple(shape) == tuple(row.shape) and bool(shape)
            numel = sympy.Mul(*shape) if shape else sympy.Integer(1)
            states += copies * itemsize * (local if (same and shard_states) else numel)
    return params, grads, states


Sizes = dict[str, tuple[int, int]]  # parameter name -> (gathered itemsize, reduce-scatter itemsize)


def _gathered(rows: list[tuple[ParamRow, Expr]], n: Expr, grad: bool = False, sizes: Sizes | None = None) -> Expr:
    """Bytes of one all-gather output (or reduce-scatter input) of these parameters: n padded chunks, each
    element of the dtype ``sizes`` names (FSDP2's mixed precision), else of the parameter's own."""
    total = ZERO
    for row, _copies in rows:
        if grad and not row.grad:
            continue
        rest = sympy.Mul(*row.shape[1:]) if len(row.shape) > 1 else sympy.Integer(1)
        d0 = row.shape[0] if row.shape else sympy.Integer(1)
        own = (row.itemsize, row.grad_itemsize)
        itemsize = (sizes or {}).get(row.name, own)[1 if grad else 0]
        total += n * _chunk(d0, n) * rest * itemsize
    return total


def _gathered_sizes(layout: Layout, run: Accounting) -> Sizes | None:
    """FSDP2's mixed precision: each parameter gathered in the dtype the compute trace holds it in, its
    gradient reduce-scattered in ``reduce_dtype`` (default: the gradient's dtype in that trace); None
    without a policy."""
    if not (layout.param_dtype or layout.reduce_dtype):
        return None
    reduce = DTYPES[layout.reduce_dtype][0].itemsize if layout.reduce_dtype else None
    return {r.name: (r.itemsize, reduce or r.grad_itemsize) for r in run.memory.tensors}


def _sides(acct: Accounting) -> tuple[list[Any], Callable[[int, str], str]]:
    """The step's ops' blocks, and where an op outside the stack runs: 'before' or 'after' it (op index, phase
    forward or backward)."""
    trace, blocks = acct.step, _part(acct, "blocks")
    assert trace is not None
    first = next((i for i, b in enumerate(blocks) if b is not None and trace.ops[i].phase == "forward"), None)
    # backward runs the stack in reverse: 'after' ops (head, loss) come before the stack's first backward op
    first_bwd = next((i for i, b in enumerate(blocks) if b is not None and trace.ops[i].phase == "backward"), None)

    def side(key: int, phase: str) -> str:
        if phase == "forward":
            return "before" if first is None or key < first else "after"
        return "after" if first_bwd is None or key < first_bwd else "before"

    return blocks, side


def _outside_flops(acct: Accounting) -> dict[str, dict[str, Expr]]:
    """Model FLOPs of the ops outside the layer stack, by phase, split 'before' / 'after' it."""
    out = {w: {"forward": ZERO, "backward": ZERO} for w in ("before", "after")}
    if acct.step is None:
        return out
    blocks, side = _sides(acct)
    for key, node in records(acct.graph):
        if node.phase not in ("forward", "backward") or not isinstance(key, int) or blocks[key] is not None:
            continue
        out[side(key, node.phase)][node.phase] += node.cost.flops * node.count
    return {w: {p: sympy.expand(e) for p, e in d.items()} for w, d in out.items()}


def derive_parallel(
    acct: Accounting, layout: Layout, compute: Accounting | None = None, *, peak_formulas: bool = True
) -> Parallel:
    """Per-rank figures of ``layout`` for the model ``acct`` was derived from (see the module docstring).

    The formulas depend on the layout's kind only (data-parallel mode, whether there is a pipeline and a
    middle stage, v): they are derived once per kind and kept on ``acct``; the degrees and the schedule's
    held micro-batches (``k``, ``k_first``, ``k_last``) are symbols set by ``at()``.

    FSDP2's mixed precision (``layout.param_dtype``) needs ``compute``: the same model derived with
    ``params_dtype=`` that dtype (and otherwise the same options), whose trace is what forward and backward
    run on the gathered parameters: its saved activations, temporaries, FLOPs and the gathered parameters'
    and gradients' dtypes; ``acct`` (the model in its own dtype) gives the shards, their gradients, the
    optimizer and its temporaries. ``peak_formulas=False`` (the planner's, which evaluates every peak at
    its sizes): a pipeline rank's peak formula (the ``Max`` over the schedule's points, built per schedule
    and m) and an FSDP2 rank's (over its overlay's points) are not built, ``nan`` in their place; ``at()``
    gives the same figures either way."""
    if acct.values is not None:
        raise SymacctError("derive_parallel needs the formulas: pass the result of derive, not of at()")
    if not acct.memory.tensors:
        raise SymacctError("this derivation has no parameter table", hint="derive the model again")
    stacks = list(acct.per_layer)
    check_model(layout, acct.symbols.get("L") if stacks else None, stacks)
    _check_tensor_parallel(acct, layout)
    _check_compute(acct, layout, compute)
    _check_context_parallel(acct, layout)
    mode = layout.dp_mode if layout.replicas > 1 else "ddp"
    kinds = ("only",) if layout.pp == 1 else (("first", "middle", "last") if layout.pp > 2 else ("first", "last"))
    key = (
        layout.return_outputs,
        mode,
        kinds,
        layout.stages_per_rank,
        layout.reshard_after_forward,
        layout.bucket_view,
        bool(layout.hsdp_shard),
        layout.dp > 1,
        layout.tp > 1,
        layout.cp > 1,
        layout.param_dtype,
        layout.reduce_dtype,
        id(compute),
        # gradient accumulation: FSDP2's overlay accumulating, DDP's gradients held from the second micro-batch
        layout.micro_batches > 1 and mode in ("fsdp", "ddp") and layout.pp == 1,
        # FSDP2 over a pipeline: its all-gathers per step follow the schedule
        layout.schedule if mode == "fsdp" and layout.pp > 1 else None,
    )
    cache = acct.__dict__.setdefault("_parallel_formulas", {})
    if key not in cache:
        overlays: list[Any] = []
        stages: dict[str, StageParts] = {}
        # compute kept: its id stays valid
        cache[key] = (_formulas(acct, layout, mode, kinds, compute, overlays, stages), compute, overlays, stages)
    ranks, _, overlays, stages = cache[key]
    if peak_formulas and overlays:
        if (key, "overlay") not in cache:
            cache[key, "overlay"] = [_overlay_peak(r, overlays, compute or acct) for r in ranks]
        ranks = cache[key, "overlay"]
    if peak_formulas and layout.pp > 1 and layout.schedule in SCHEDULE_RUNTIMES:
        sched_key = (key, layout.schedule, layout.pp, layout.micro_batches)
        if sched_key not in cache:
            run = compute or acct
            cache[sched_key] = [
                dataclasses.replace(r, peak=_pipeline_peak(r, stages[r.stage], acct, layout, run)) for r in ranks
            ]
        ranks = cache[sched_key]
    held: dict[str, dict[str, int]] = {"only": {"g_held": int(layout.micro_batches > 1)}}
    flight = [1]
    if layout.pp == 1 and mode == "ddp":
        notes = [
            "peak per rank (a later step) = the single-device step's traced peak + DDP's buckets (held from step "
            "to step); with gradient_as_bucket_view each gradient freed once copied into its bucket, with "
            "gradient accumulation (no_sync) the gradients held from the second micro-batch on"
        ]
    elif overlays:
        notes = [
            "peak per rank (a later step): the traced step with FSDP2's own buffers placed at its hooks (all-gather "
            "outputs, unsharded parameters, the prefetched block, reduce-scatter inputs, unsharded and sharded "
            "gradients: symacct.parallel.fsdp), the larger of every op's and hook's live bytes and the optimizer "
            "step's; at() evaluates every point exactly, the formula is the Max over the points largest in a "
            "sample of the sizes"
        ]
    elif layout.pp > 1 and layout.schedule in SCHEDULE_RUNTIMES:
        notes = [
            "peak per rank (a later step): every point of the rank's schedule as PyTorch's runtime runs it (the "
            "micro-batch in flight at every op of the stage chunk, each chunk's held ones' saved activations, "
            "the receive buffers, the outputs and input gradients send ops keep, the last stage's kept outputs "
            "and losses, the whole batch's inputs) and the optimizer step (the stage's own parameters' ops); "
            "at() evaluates every op exactly, the formula's micro-batch in flight is the Max over the ops "
            "largest in a sample of the sizes (one stage output high where a stage chunk is one block)"
        ]
        if mode == "fsdp" and layout.replicas > 1 and layout.stages_per_rank > 1:
            notes.append(
                "FSDP2 over each stage chunk (torch 2.13's _PipelineScheduleRuntime and its own lowering: at most "
                "three chunks unsharded; up to v = 3 every chunk's groups all-gathered at the step's start, more "
                "chunks resharded and gathered again within the step, their unsharded gradients kept): each "
                "UNSHARD's outputs held until the chunk's next action waits on them and copies them out; then "
                "each compute action as the blocks' state has it (a "
                "forward that finds them resharded gathers them and, with reshard_after_forward, frees them after; "
                "a backward keeps them), the gradients held unsharded from the chunk's first backward, and its "
                "REDUCE_GRAD right after its last backward reduce-scatters and reshards every group of the chunk; "
                "the optimizer step on the shards (its temporaries the single device's scaled by the share)"
            )
        elif mode == "fsdp" and layout.replicas > 1:
            notes.append(
                "FSDP2 over the pipeline (torch 2.13's PipelineStage): each compute action as its kind has FSDP2's "
                "buffers (the first forward gathers the root; a forward before any backward gathers each block "
                "and frees it after; one after a backward finds every block unsharded; a backward after a forward "
                "gathers each block and keeps it; one after a backward gathers nothing), the gradients held "
                "unsharded from the first backward, one reduce-scatter of each group at perform_reduce_grad, the "
                "optimizer step on the shards (its temporaries the single device's scaled by the share)"
            )
        if mode == "fsdp" and layout.replicas > 1 and _accumulates(layout, compute or acct):
            notes.append(
                f"the policy's reduce_dtype ({layout.reduce_dtype}) is not the gradients' dtype: each group's "
                "post-backward moves its new gradients into unsharded accumulators of reduce_dtype, held to "
                "perform_reduce_grad or REDUCE_GRAD (the first backward copies them in, each later one adds and "
                "frees them)"
            )
    else:
        notes = [
            "peak per rank (a later step) = parameters + states + the larger of held activations + working set "
            "+ the single-device peak's temporaries (+ gradients once a backward ran) and gradients + the "
            "optimizer's temporaries: a model, measured in docs/distributed.md"
        ]
        if mode == "fsdp" and layout.replicas > 1:
            notes.append(
                "FSDP2's peak without one layer stack derive found (a model without a config, several stacks): "
                "the additive model (the root and one block gathered), not FSDP2's buffers placed at its hooks; "
                "0.97-1.06 of a real run measured on a hand-written model without a config (docs/distributed.md)"
            )
    if layout.cp > 1:
        notes.append(
            f"context parallelism over {layout.cp} ranks: the ring's rank 0 traced (the others hold at most its "
            f"peak, measured); gradients reduced over dp x cp = {layout.replicas} ranks"
        )
    if layout.param_dtype or layout.reduce_dtype:
        own = "the model's"
        notes.append(
            f"FSDP2 MixedPrecisionPolicy(param_dtype={layout.param_dtype or own}, "
            f"reduce_dtype={layout.reduce_dtype or layout.param_dtype or own}): forward and backward as traced with "
            "parameters in param_dtype; shards, their gradients and the optimizer in the model's dtype"
        )
    if layout.pp > 1:
        acts = actions(layout.schedule, layout.pp, layout.micro_batches, layout.stages_per_rank)
        flight = in_flight(acts)
        last_chunk = layout.pp * layout.stages_per_rank - 1
        for kind in kinds:
            r = {"first": 0, "middle": 1, "last": layout.pp - 1}[kind]
            held[kind] = {
                "k": flight[r],
                "k_first": _held_micro(acts, r, 0),
                "k_last": _held_micro(acts, r, last_chunk),
                "g_held": _backward_before_forward(acts, r),
            }
            if mode == "fsdp" and layout.stages_per_rank > 1:  # FSDP2's all-gathers of the chunks' blocks
                v, reshard = layout.stages_per_rank, layout.reshard_after_forward
                gf, gb = chunk_gathers(layout.pp, layout.micro_batches, v, r, reshard)
                held[kind] |= {"g_f": gf, "g_b": gb}
        notes.append(
            f"{layout.schedule} with pp={layout.pp}, m={layout.micro_batches}, v={layout.stages_per_rank}: "
            f"(stage chunk, micro-batch) activations held at most per rank {flight} (PyTorch's action lists)"
        )
    overlay = (overlays[0][0], overlays[0][1]) if overlays else None
    return Parallel(
        layout, acct, list(ranks), flight, notes, held=held, compute=compute, overlay=overlay, stages=stages
    )


def derive_compute(model: Any, layout: Layout, **options: Any) -> Accounting | None:
    """``derive_parallel``'s ``compute`` for ``layout``: ``model`` derived with ``options`` (those of the
    derivation it goes with) and its parameters in the layout's ``param_dtype`` as FSDP2's policy runs
    them (``fsdp_policy=True``); None without one."""
    from symacct.pipeline import derive

    if layout.param_dtype is None:
        return None
    return derive(model, **{**options, "params_dtype": layout.param_dtype, "fsdp_policy": True})


def _check_compute(acct: Accounting, layout: Layout, compute: Accounting | None) -> None:
    """``compute`` is ``acct``'s model traced with its parameters in ``layout.param_dtype``, nothing else
    changed (see ``derive_parallel``)."""
    if layout.param_dtype is None:
        if compute is not None:
            raise SymacctError("compute= is the mixed-precision trace: it needs a layout with param_dtype")
        return
    want = str(DTYPES[layout.param_dtype][0])
    if compute is None:
        raise SymacctError(
            f"FSDP2 with param_dtype={layout.param_dtype} needs the step traced with the parameters in that dtype",
            hint=f"derive_parallel(acct, layout, compute=derive(model, params_dtype={layout.param_dtype!r}, ...)) "
            "(the CLI does it for --param-dtype)",
        )
    if compute.values is not None:
        raise SymacctError("compute= needs the formulas: pass the result of derive, not of at()")
    if acct.options.get("params_dtype") or acct.options.get("autocast"):
        raise SymacctError(
            "with FSDP2's param_dtype the first derivation is the model in its own dtype (the shards')",
            hint="derive it without params_dtype= and autocast=",
        )
    if compute.options.get("params_dtype") != want:
        raise SymacctError(
            f"compute= was derived with params_dtype={compute.options.get('params_dtype')}, the layout's "
            f"param_dtype is {want}",
            hint=f"derive(model, params_dtype={layout.param_dtype!r}, ...)",
        )
    if not compute.options.get("fsdp_policy") and compute.memory.buffers != acct.memory.buffers:
        raise SymacctError(
            f"compute= cast the model's floating buffers to {layout.param_dtype}: FSDP2's MixedPrecisionPolicy "
            "casts the parameters only",
            hint=f"derive(model, params_dtype={layout.param_dtype!r}, fsdp_policy=True, ...)",
        )
    same = ("step", "causal_discount", "embedding_flops", "device", "tensor_parallel", "autocast")
    differ = [k for k in same if acct.options.get(k) != compute.options.get(k)]
    if differ or _param_shapes(acct) != _param_shapes(compute) or acct.symbols != compute.symbols:
        raise SymacctError(
            "compute= is not the same model and step as the derivation it goes with"
            + (f" (options differ: {', '.join(differ)})" if differ else " (parameters or sizes differ)"),
            hint="derive both from the same model with the same options, the second with params_dtype=",
        )


def _param_shapes(acct: Accounting) -> list[tuple[str, tuple[Any, ...], Any]]:
    return [(r.name, tuple(r.shape), r.count) for r in acct.memory.tensors]


def _check_context_parallel(acct: Accounting, layout: Layout) -> None:
    """A layout with cp > 1 needs one context-parallel rank's derivation at that degree (the ring unrolls
    cp steps: the degree is a number in it, not a symbol)."""
    traced = acct.options.get("context_parallel")
    if layout.cp != (traced or 1):
        have = f"one context-parallel rank's of cp={traced}" if traced else "of the whole model"
        raise SymacctError(
            f"the layout has cp={layout.cp}; this derivation is {have}",
            hint=f"derive(model, context_parallel={layout.cp}, ...) (the CLI does it for --cp)"
            if layout.cp > 1
            else "derive without context_parallel= for cp=1",
        )


def _check_tensor_parallel(acct: Accounting, layout: Layout) -> None:
    """A layout with tp > 1 needs one tensor-parallel rank's derivation, by the plan the layout names."""
    plan = acct.options.get("tensor_parallel")
    if layout.tp > 1 and plan is None:
        raise SymacctError(
            f"tp={layout.tp} needs one tensor-parallel rank's derivation; this one is of the whole model",
            hint=f"derive(model, tensor_parallel={layout.plan!r}, ...) (the CLI does it for --tp)",
        )
    if layout.tp == 1 and plan is not None:
        raise SymacctError(
            "this derivation is one tensor-parallel rank's: the layout needs tp >= 2",
            hint="derive without tensor_parallel= for tp=1",
        )
    if layout.tp > 1 and plan in ("megatron", "megatron-sp") and plan != layout.plan:
        raise SymacctError(
            f"the derivation ran plan {plan!r}, the layout asks for {layout.plan!r}",
            hint="derive with tensor_parallel= the layout's plan (sequence_parallel: 'megatron-sp')",
        )


_TRACED_OPS = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",  # in place: a whole parameter's gradient summed over the group
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",  # context parallelism's ring: the key/value gradients to the next rank
}
_TRACED_GROUP = {"tp": "tensor parallel", "cp": "context parallel, ring attention"}


def _traced_collectives(
    acct: Accounting,
    holds: dict[str, bool],
    piped: bool,
    group: str = "tp",
    fsdp: tuple[list[tuple[ParamRow, Expr]], int | None] | None = None,
) -> list[Collective]:
    """The collectives of the tensor- or context-parallel rank's traced step (DTensor's or the ring's, over
    the ``group``): each kind (op, phase, payload, module) once with its count per step; on a pipeline rank,
    its share of the stack and the parts before and after it that its stage holds. Payload: an all-reduce's
    tensor, an all-gather's output, a reduce-scatter's input, an all-to-all's input (the rank's traced
    shapes).

    ``fsdp``: FSDP2 over the data-parallel ranks (the rank's parameter rows with their copies, and the
    accumulators' itemsize where the policy has them). The optimizer then reads FSDP2's sharded gradients,
    never a ``Partial`` one: a gradient the traced optimizer all-reduced (sequence parallelism's norm
    weights) is made ``Replicate`` once a step instead, by FSDP2's post-backward before its reduce-scatter
    (``FSDPParam._get_grad_inner_tensor``): one all-reduce of the unsharded gradient per parameter."""
    if acct.step is None:
        return []
    partial: set[str] = set()  # the parameters whose gradient the traced optimizer all-reduced
    m = sym("m")
    stacks = list(acct.per_layer)
    _, side = _sides(acct)
    stage_share = _stage_share(acct, holds)
    found: dict[tuple[str, str, Any, str], Expr] = {}
    for key, node in _part(acct, "collective_ops"):
        if _mesh_dim(acct, key, node) != group:  # the other dimension's (context with tensor parallelism)
            continue
        name = node.op.split(".")[1]
        read = acct.step.ops[key].inputs[:1]
        grad = acct.step.grad_storages.get(read[0].storage) if read and node.phase == "optimizer" else None
        if fsdp is not None and grad is not None:  # FSDP2 reduced this gradient in its post-backward
            partial.add(generic_path(grad, stacks))
            continue
        if name not in _TRACED_OPS:
            raise SymacctError(
                f"no model of the collective {node.op} on a {_TRACED_GROUP[group]} rank",
                module=node.module,
                op=node.op,
                hint="all-reduce, all-gather, reduce-scatter and all-to-all are modelled",
            )
        op = _TRACED_OPS[name]
        shape = node.in_shapes[0] if op == "reduce_scatter" else node.shapes[0]
        itemsize = getattr(torch, node.dtypes[0].removeprefix("torch.")).itemsize
        payload = sympy.expand(itemsize * sympy.Mul(*shape))
        count = sympy.sympify(node.count)
        if any(node.generic == st or node.generic.startswith(st + ".") for st in stacks):
            where = "stack"
        elif node.phase == "optimizer":
            # a gradient the optimizer reads (sequence parallelism's norm weights): where its parameter is
            places = {w for row in acct.memory.tensors if row.module == node.module for w in row.places}
            where = "after" if places == {"after"} else "before"
        else:
            where = side(key, node.phase)
        if where == "stack" and piped:
            count = stage_share(key, count)
            if count == 0:
                continue
        elif where != "stack" and not holds[where]:
            continue
        if node.phase != "optimizer":
            count = m * count  # each micro-batch; the optimizer reads a gradient once a step
        tag = (op, node.phase, payload, node.generic)
        found[tag] = found.get(tag, ZERO) + count
    size = sym(group) if group == "tp" else sympy.Integer(acct.options["context_parallel"])
    out = [
        Collective(
            op, group, size, payload, sympy.expand(count), phase, f"{module or '<root>'} ({_TRACED_GROUP[group]})"
        )
        for (op, phase, payload, module), count in found.items()
    ]
    if fsdp is not None:
        rows, itemsize = fsdp
        for row, copies in rows:
            if row.name in partial and row.grad:
                payload = sympy.expand((itemsize or row.grad_itemsize) * _grad_numel(row))
                what = f"{row.name} (FSDP2's post-backward: its Partial gradient made Replicate)"
                out.append(Collective("all_reduce", group, size, payload, sympy.expand(copies), "backward", what))
    return out


def _mesh_dim(acct: Accounting, key: int, node: Any) -> str:
    """Which dimension of the traced rank's mesh (tp, cp) a collective ran over: its ``group_name`` argument
    read against the trace's groups."""
    groups = acct.step.groups
    if len(groups) == 1:
        return next(iter(groups.values()))
    rec = acct.step.ops[key]
    names = [a.name for a in rec.op._schema.arguments]
    given = dict(zip(names, rec.args)) | rec.kwargs
    found = groups.get(given.get("group_name"))
    if found is None:
        raise SymacctError(
            f"the collective {node.op} ran over a process group that is neither the tensor- nor the "
            f"context-parallel one ({given.get('group_name')!r}; the mesh's: {groups})",
            module=node.module,
            op=node.op,
            hint="a model's own collectives over other groups are not modelled",
        )
    return found


def _chunk_activations(mem: Any, blocks: Expr, first: bool, last: bool) -> Expr:
    """One held micro-batch's saved activations on a stage chunk of ``blocks`` blocks: each block's, and on the
    chunk holding block 0 (``first``) what runs before the stack and what a first block that differs saves
    beyond the others (``Memory.activations_ends``), on the one holding block L - 1 (``last``) likewise after."""
    L = sym("L")
    before = mem.activations_outside.get("before", ZERO)
    after = mem.activations_outside.get("after", ZERO)
    out = sympy.diff(sympy.expand(mem.activations - before - after), L) * blocks
    out += before + mem.activations_ends.get("first", ZERO) if first else ZERO
    out += after + mem.activations_ends.get("last", ZERO) if last else ZERO
    return out


def _collective_ops(acct: Accounting) -> list[tuple[int, Any]]:
    """The traced step's collectives (``_c10d_functional`` ops but the waits), with their op index."""
    return [
        (key, node)
        for key, node in records(acct.graph)
        if isinstance(key, int)
        and node.op.startswith("_c10d_functional.")
        and not node.op.startswith("_c10d_functional.wait_tensor")
    ]


def _stage_share(acct: Accounting, holds: Mapping[str, bool]) -> Callable[[int, Expr], Expr]:
    """``share(op, count)``: how many times a pipeline rank runs a layer-stack op that runs ``count`` times in
    the whole model (``symacct.cost.layers.stage_share``; the rank holds block 0 with what runs before the
    stack, block L - 1 with what runs after it). Kept per derivation and ends held, each (block, count) once."""
    per_acct = acct.__dict__.setdefault("_stage_share", {})
    key = (holds["before"], holds["after"])
    if key not in per_acct:
        blocks = _part(acct, "blocks")
        counts = [ZERO] * len(blocks)
        for k, node in records(acct.graph):
            if isinstance(k, int):
                counts[k] = node.count
        ends = differing_ends(blocks, counts)
        memo: dict[tuple[int, Expr], Expr] = {}

        def share(op: int, count: Expr) -> Expr:
            got = memo.get((blocks[op][1], count))
            if got is None:
                got = memo[blocks[op][1], count] = stage_share(blocks[op][1], count, *key, ends)
            return got

        per_acct[key] = share
    return per_acct[key]


def _stack_flops(acct: Accounting, holds: Mapping[str, bool]) -> Expr:
    """Model FLOPs of a pipeline rank's share of the layer stack, forward and backward (``_stage_share``),
    kept per derivation and ends held."""
    per_acct = acct.__dict__.setdefault("_stack_flops", {})
    key = (holds["before"], holds["after"])
    if key not in per_acct:
        blocks, _ = _sides(acct)
        share = _stage_share(acct, holds)
        grouped: dict[tuple[int, Expr], tuple[int, Expr]] = {}  # (block, count) -> (an op of it, FLOPs summed)
        for k, node in records(acct.graph):
            if isinstance(k, int) and blocks[k] is not None and node.phase in ("forward", "backward"):
                op, total = grouped.get((blocks[k][1], node.count), (k, ZERO))
                grouped[blocks[k][1], node.count] = (op, total + node.cost.flops)
        per_acct[key] = sympy.expand(sum((f * share(op, c) for (_b, c), (op, f) in grouped.items()), ZERO))
    return per_acct[key]


def _part(acct: Accounting, name: str) -> Any:
    """What the per-rank formulas read off one derivation, each worked out once per derivation, when first
    asked for: ``steady`` (``_steady``), ``optimizer`` (``_optimizer_excess``), ``head``, ``outside``, the
    step's op ``blocks``, its ``collective_ops``, block 0's ops of its own (``first_own``), the ``steady_live``
    liveness and its ``optimizer_ops``."""
    per_acct = acct.__dict__.setdefault("_parallel_parts", {})
    if name not in per_acct:
        make: dict[str, Callable[[Accounting], Any]] = {
            "steady": _steady,
            "optimizer": _optimizer_excess,
            "head": _head_output,
            "outside": _outside_flops,
            "blocks": lambda a: op_blocks(a.step.ops, list(a.per_layer)),
            "collective_ops": _collective_ops,
            "first_own": lambda a: first_block_own(a.step.ops, list(a.per_layer)),
            "steady_live": _steady_liveness,
            "brief": _brief_peak,
            "brief_live": lambda a: _steady_live(a).without(lambda st, made, other: False, brief=True),
            "optimizer_ops": lambda a: [t for t, lab in enumerate(_steady_live(a).labels) if lab[3] == "optimizer"],
        }
        per_acct[name] = make[name](acct)
    return per_acct[name]


def _optimizer_excess(acct: Accounting) -> Expr:
    """The single-device optimizer step's own temporaries (beyond the static bytes and ``_kept_by_step``),
    once the states exist: ``Max`` over the optimizer's points largest somewhere in a sample of the sizes
    (``overlay_peaks`` evaluates every point exactly)."""
    steady, ops = _steady_live(acct), _part(acct, "optimizer_ops")
    if not ops:
        return ZERO
    _, points = steady.symbolic_peak(_peak_names(acct), ops=ops)
    static = acct.memory.params + acct.memory.grads + acct.memory.optimizer + _kept_by_step(acct)
    return sympy.Max(ZERO, *(sympy.expand(steady.at_point(t) - static) for t in points), evaluate=False)


def _buffer_broadcast(acct: Accounting, layout: Layout) -> Expr:
    """DDP's buffer broadcast before a step's first forward (``broadcast_buffers``; not with context
    parallelism, whose runs turn it off): the buffers flattened into one tensor (c10d's
    ``broadcast_coalesced``) beside what lives before the step, the parameters, states, buffers and inputs."""
    mem = acct.memory
    if mem.buffers == 0 or layout.cp > 1:
        return ZERO
    return mem.params + mem.optimizer + 2 * mem.buffers + mem.inputs


def _brief_peak(acct: Accounting) -> Expr:
    """The single-device later step's peak with each gradient alive only from the op that makes it to the
    one at which AccumulateGrad takes it (``Liveness.without(brief=True)``): a gradient DDP copies into its
    bucket view, or one added into the gradients an earlier micro-batch left."""
    return _part(acct, "brief_live").symbolic_peak(_peak_names(acct))[0]


def _own_optimizer(acct: Accounting, layout: Layout) -> bool:
    """Whether a pipeline stage's optimizer step is its own parameters' ops, exactly: a single-tensor
    optimizer (``_loop_optimizer``) over whole states (DDP; ZeRO-1 updates only its shards: the share
    model)."""
    return _loop_optimizer(acct) and (layout.dp_mode == "ddp" or layout.replicas == 1)


def _loop_optimizer(acct: Accounting) -> bool:
    """Whether every optimizer op updates one parameter (a single-tensor step: each op named after its
    parameter's module), so that a stage's optimizer step is its own parameters' ops; a foreach or fused
    step runs over all of them at once."""
    live = _steady_live(acct)
    ops = _part(acct, "optimizer_ops")
    return bool(ops) and all(live.labels[t][2] for t in ops)


def _kept_by_step(acct: Accounting) -> Expr:
    """What the single-device optimizer step holds beside the static bytes and its own temporaries: the module
    buffers, the step's inputs and its loss. A rank holds its own of these whole (``_optimizer_beside``); only
    the temporaries scale with its share of the states."""
    mem = acct.memory
    return mem.buffers + mem.inputs + mem.loss


def _optimizer_beside(acct: Accounting, layout: Layout) -> Expr:
    """What a rank holds at its optimizer step beside its static bytes, gradients and the optimizer's
    temporaries: without a pipeline, the buffers, the inputs and the loss (the caller's); a pipeline stage's
    own blocks' buffers (L / pp of them, and those outside the stack) and one micro-batch's inputs (the
    others are ``Rank.runtime``), its losses gone with ``step()``."""
    mem = acct.memory
    if layout.pp == 1:
        return _kept_by_step(acct)
    return sympy.sympify(mem.buffers).subs(sym("L"), sym("L") / sym("pp")) + mem.inputs


def _peak_names(acct: Accounting) -> list[str]:
    """The symbols a single-device peak is sampled over (L with a layer stack)."""
    free = {str(x) for x in sympy.sympify(acct.memory.peak).free_symbols}
    return sorted(free | ({"L"} if acct.per_layer else set()))


def _steady_live(acct: Accounting) -> Liveness:
    """The single-device liveness of a later step (kept: its intervals' layout is reused at every size)."""
    live: Liveness = _part(acct, "steady_live")
    return live


def _steady_liveness(acct: Accounting) -> Liveness:
    live = acct.liveness
    if live is None:
        raise SymacctError("this derivation has no liveness", hint="derive the model again")
    return live.steady()


# the parts of the step a pipeline stage runs: the stack, and what runs before it (first) or after it (last)
STAGE_SIDES = {"first": ("before", "stack"), "middle": ("stack",), "last": ("stack", "after")}


def _stage_rows(mem: Any, stage: str, blocks: Expr) -> list[tuple[ParamRow, Expr]]:
    """The parameter rows a stage (or stage chunk) of kind ``stage`` holds, with their copies: each stack row
    for ``blocks`` blocks, a row outside the stack on the stage that runs its part (before the stack: the
    first; after: the last; both: each of them)."""
    holds = {"before": stage in ("only", "first"), "after": stage in ("only", "last")}
    L = sym("L")
    rows: list[tuple[ParamRow, Expr]] = []
    for row in mem.tensors:
        if _in_stack(row):
            copies = row.count.subs(L, blocks)
        else:
            ends = row.places & {"before", "after"}
            copies = row.count if (any(holds[w] for w in ends) if ends else holds["before"]) else ZERO
        if copies != 0:
            rows.append((row, copies))
    return rows


def _stage_live(
    acct: Accounting, stage: str, accumulating: bool = False, one_block: bool = False
) -> tuple[Liveness, list[int], list[int], list[int]]:
    """A pipeline stage's own live bytes for the micro-batch in flight beside its parameters and states: the
    single-device step's liveness less the parameters and states and less every storage the other parts
    make (the first stage runs no head: the logits' gradient is the last stage's; the stage's input and its
    output's gradient arrive in the runtime's receive buffers, counted apart), its gradients as the first
    backward makes them, evaluated with L set to the stage chunk's blocks; and the forward and the backward
    ops of the stage's parts, and its optimizer ops (a single-tensor optimizer's op belongs to the part whose
    parameter it updates: ``_loop_optimizer``). ``accumulating``: the stage's gradients exist from an earlier
    micro-batch (1F1B, gradient accumulation), so each new one lives until AccumulateGrad adds it in
    (``Liveness.without``). ``one_block``: for a stage of one block (L = 1 here): the probe's block 0 then
    stands for the stage's last block too, and the gradient it receives, made by block 1 in the probe, comes
    from the next stage (a receive buffer) on the first and a middle stage."""
    cache = acct.__dict__.setdefault("_stage_live", {})
    key = (stage, accumulating, one_block and stage != "last")
    if key not in cache:
        live = acct.liveness
        assert live is not None and acct.step is not None
        blocks, side = _sides(acct)
        labels = live.labels
        wanted = STAGE_SIDES[stage]
        # a module outside the stack: the side its forward runs on (a parameter's optimizer ops name its module)
        placed: dict[str, str] = {}
        for t, lab in enumerate(labels):
            if lab[3] == "forward" and blocks[t] is None:
                placed.setdefault(lab[2], side(t, "forward"))

        # block 0's own ops (a first block that differs): the first stage's; another's first block is block 1's
        own0: set[int] = set() if "before" in wanted else _part(acct, "first_own")

        def part(t: int) -> str:
            if t in own0:
                return "before"
            if blocks[t] is not None:
                return "stack"
            phase = labels[t][3]
            if phase == "optimizer" and labels[t][2] in placed:
                return placed[labels[t][2]]
            return side(t, phase if phase in ("forward", "backward") else "forward")

        # one block: the first op of block 0's backward, in the probe and in the probe with one block more
        bwd0 = (t for t, b in enumerate(blocks) if b is not None and b[1] == 0 and labels[t][3] == "backward")
        start0 = next(bwd0, 0)
        cross = (start0, live.align[start0] if live.other is not None else start0)

        def received(st: int, made: int, other: bool) -> bool:
            """Made by block 1's backward, alive into block 0's: the gradient block 0 receives."""
            iv = live.other if other else live.base
            if made < 0 or blocks[made] is None or blocks[made][1] != 1 or labels[made][3] != "backward":
                return False
            return (
                iv is not None
                and iv.end.get(st, 0) > cross[int(other)]
                and st not in (live.other_grads if other else live.grads)
            )

        def drop(st: int, made: int, other: bool) -> bool:
            if made >= 0 and part(made) not in wanted:  # another stage's (its outputs: the receive buffers)
                return True
            if key[2] and received(st, made, other):
                return True
            # parameters and states: the rank's own rows; its gradients as the backward makes them
            return st in (live.other_owned if other else live.owned) and st not in (
                live.other_grads if other else live.grads
            )

        # a checkpointed block's forward run again inside its backward ('recompute') is backward's
        phases = {"forward": ("forward",), "backward": ("backward", "recompute"), "optimizer": ("optimizer",)}
        ops = {
            phase: [t for t, lab in enumerate(labels) if lab[3] in names and part(t) in wanted]
            for phase, names in phases.items()
        }
        steady = live.steady().without(drop, brief=accumulating)
        cache[key] = (steady, ops["forward"], ops["backward"], ops["optimizer"])
    return cache[key]


DEGREES = frozenset({"dp", "pp", "m", "v", "tp", "cp", "dp_shard", "k", "k_first", "k_last", "g_held"})


def _sizes_key(values: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """The model's sizes among ``values`` (the degrees left out): what a per-sizes cache is keyed by."""
    return tuple(sorted((k, v) for k, v in values.items() if k not in DEGREES))


def compiled(acct: Accounting, e: Expr) -> Callable[[Mapping[str, int]], Any]:
    """``exact_form(e)``, kept on ``acct`` by the formula's identity (the formulas are shared; hashing and
    comparing large ones costs more than evaluating them)."""
    cache = acct.__dict__.setdefault("_compiled", {})
    got = cache.get(id(e))
    if got is None:
        got = cache[id(e)] = (exact_form(sympy.sympify(e)), e)  # e kept: its id stays valid
    return got[0]


def _stage_own(acct: Accounting, stage: str, values: dict[str, int]) -> dict[tuple[str, bool], int]:
    """A stage's most live bytes for its micro-batch in flight (``_stage_live``) over its forward ops ('F')
    and its backward ops ('B'), before a first backward and after (the gradients accumulating), exactly at
    ``values`` (L: the stage's blocks); kept per sizes (the planner asks again for each layout)."""
    cache = acct.__dict__.setdefault("_stage_own", {})
    key = (stage, _sizes_key(values))
    if key not in cache:
        if len(cache) >= 4096:
            cache.clear()
        own: dict[tuple[str, bool], int] = {}
        for grads in (False, True):
            live, fwd, bwd, opt = _stage_live(acct, stage, grads, one_block=values.get("L") == 1)
            for kind, ops in (("F", fwd), ("B", bwd), ("O", opt)):
                own[(kind, grads)] = int(live.during_array(values, ops)[1].max()) if ops else 0
        cache[key] = own
    return cache[key]


def _fsdp_stage_live(acct: Accounting, stage: str, kind: str, grads: bool, fs: FsdpStage, one_block: bool) -> Liveness:
    """A pipeline stage's own live bytes (``_stage_live``) over one compute action of FSDP2 ``kind`` with
    FSDP2's buffers at its hooks (``stage_fsdp_liveness``); the root's edge: the stage module's last forward op
    (the loss ops after it are the schedule's ``loss_fn``'s, ops of no module) or its first backward op after
    the loss's."""
    cache = acct.__dict__.setdefault("_fsdp_stage_live", {})
    # fs by value: the layouts' formulas made apart (the interleaved schedule's, per pp and m) share the points
    key = (stage, kind, grads, one_block, fs)
    if key not in cache:
        # with accumulators every backward's gradients are new tensors, freed at their post-backward
        live, fwd, bwd, _opt = _stage_live(acct, stage, grads and not fs.accumulator, one_block=one_block)
        forward = kind.startswith("F")
        ops = fwd if forward else bwd
        phases = ("forward",) if forward else ("backward", "recompute")
        named = [t for t in ops if live.labels[t][2]]
        edge = named[-1] if forward else named[0]
        extra = {u for u, b in enumerate(live.other_point_block) if b == DROP and live.other_phases[u] in phases}
        other_ops = sorted({live.align[t] for t in ops} | extra)
        acc = (fs.root_grads, fs.block_grads, not grads) if fs.accumulator else None
        cache[key] = stage_fsdp_liveness(
            live, kind, ops, edge, other_ops, live.align[edge], fs.root, fs.block, fs.reshard, acc
        )
    got: Liveness = cache[key]
    return got


def _fsdp_stage_own(acct: Accounting, stage: str, kind: str, grads: bool, fs: FsdpStage, values: dict[str, int]) -> int:
    """The most a stage holds beside its shards over one compute action of FSDP2 ``kind`` (every op and hook
    of ``_fsdp_stage_live``), exactly at ``values`` (L: the stage's blocks; dp)."""
    cache = acct.__dict__.setdefault("_fsdp_stage_own", {})
    # the model's sizes and the sharding group's degrees only
    key = (stage, kind, grads, fs, _sizes_key(values), values["dp"], values.get("dp_shard"))
    if key not in cache:
        if len(cache) >= 4096:
            cache.clear()
        live = _fsdp_stage_live(acct, stage, kind, grads, fs, one_block=values.get("L") == 1)
        cache[key] = int(live.during_array(values, range(live.base.n))[1].max())
    got: int = cache[key]
    return got


def _reduce_terms(fs: FsdpStage, blocks: Any, ev: Callable[[Expr], Any]) -> list[Any]:
    """``perform_reduce_grad``: each group's post-backward in the order ``fully_shard``'s states were made
    (the root, then blocks 0, 1, ...): its unsharded parameters freed, the previous group's reduce-scatter
    input freed, its own allocated beside its unsharded gradients (``foreach_reduce``'s copy-in), the
    unsharded gradients freed, then its sharded gradients (the reduce-scatter's output) allocated; what is
    live there beyond the shards and the runtime, at both moments of the root's and of the first and the last
    block's (the bytes are linear in the block's index). ``ev``: a formula's value (or the formula)."""
    un, g, sg, rs = (ev(e) for e in (fs.block.gathered, fs.block_grads, fs.block.sharded_grads, fs.block.reduce_input))
    root_g, root_sg, root_rs = ev(fs.root_grads), ev(fs.root.sharded_grads), ev(fs.root.reduce_input)
    terms = []
    if fs.root.gathered != 0:
        terms += [blocks * (un + g) + root_rs + root_g, blocks * (un + g) + root_rs + root_sg]
    for j in (0, blocks - 1):
        held = (blocks - 1 - j) * (un + g) + root_sg + j * sg + rs  # the later blocks', the earlier shards
        terms += [held + g, held + sg]
    return terms


def _reduce_phase(acct: Accounting, fs: FsdpStage, values: dict[str, int], blocks: int) -> int:
    """``_reduce_terms``' largest at ``values``."""
    return max(_reduce_terms(fs, blocks, lambda e: compiled(acct, e)(values)))


def _stage_in_flight(
    acct: Accounting, stage: str, accumulating: bool = False, chunks: int = 1, phases: str = "FB"
) -> Expr:
    """The most a pipeline stage holds for the micro-batch in flight beside its parameters, gradients and
    states (``_stage_live``) at its forward (``phases`` F), backward (B) or both ops, with one stage
    chunk's L/(pp*chunks) blocks (``chunks``: v, the interleaved schedule's chunks per rank); a ``Max`` over
    the ops largest somewhere in a sample of the sizes (``Liveness.symbolic_peak``). The stage's other held
    micro-batches add their saved activations (``_formulas``)."""
    cache = acct.__dict__.setdefault("_stage_in_flight", {})
    key = (stage, accumulating, chunks, phases)
    if key not in cache:
        stage_live, fwd, bwd, opt = _stage_live(acct, stage, accumulating)
        ops = sorted((fwd if "F" in phases else []) + (bwd if "B" in phases else []) + (opt if "O" in phases else []))
        names = sorted({str(x) for x in sympy.sympify(acct.memory.peak).free_symbols} | {"L"})
        peak, _ = stage_live.symbolic_peak(names, ops=ops)
        share = {sym("L"): sym("L") / (sym("pp") * chunks)}  # each point on its own: no Max evaluated again
        points = peak.args if isinstance(peak, sympy.Max) else (peak,)
        parts = [sympy.sympify(e).xreplace(share) for e in points]
        cache[key] = parts[0] if len(parts) == 1 else sympy.Max(*parts, evaluate=False)
    return cache[key]


def _formulas(
    acct: Accounting,
    layout: Layout,
    mode: str,
    kinds: tuple[str, ...],
    compute: Accounting | None = None,
    overlays: list[Any] | None = None,
    stages: dict[str, StageParts] | None = None,
) -> list[Rank]:
    """Each kind of rank's formulas; ``compute`` (FSDP2's mixed precision): the trace forward and backward
    run, for the activations, temporaries, FLOPs and the gathered dtypes (``derive_parallel``)."""
    mem = acct.memory
    run = compute or acct  # forward and backward as the ranks run them
    L = sym("L")
    pp, m = sym("pp"), sym("m")
    dp = sym("dp") * (sym("cp") if layout.cp > 1 else 1)  # the gradients' group: dp x cp (Layout.replicas)
    # the shard group: dp (x cp), or HSDP's shard group (x cp: the context-parallel ranks shard too)
    n = sym("dp_shard") * (sym("cp") if layout.cp > 1 else 1) if layout.hsdp_shard else dp
    piped = layout.pp > 1
    v = layout.stages_per_rank
    act_total = run.memory.activations
    before_act = run.memory.activations_outside.get("before", ZERO)
    after_act = run.memory.activations_outside.get("after", ZERO)
    stack_act = sympy.expand(act_total - before_act - after_act)
    # a chunk's blocks' saved activations; beyond them, what a first or last block that differs saves
    chunk_act = (sympy.diff(stack_act, L) * L / (pp * v)) if piped else stack_act
    ends = run.memory.activations_ends
    head_out = _part(run, "head")
    outside = _part(run, "outside")
    fwd_stack = sympy.expand(run.flops.forward - outside["before"]["forward"] - outside["after"]["forward"])
    bwd_stack = sympy.expand(run.flops.backward - outside["before"]["backward"] - outside["after"]["backward"])
    gathered = _gathered_sizes(layout, run)
    ranks = []
    for stage in kinds:
        holds = {"before": stage in ("only", "first"), "after": stage in ("only", "last")}
        rows = _stage_rows(mem, stage, L / pp if piped else L)
        params, grads, states = _rows_bytes(
            rows,
            n,
            shard_params=mode == "fsdp",
            shard_grads=mode in ("zero2", "fsdp"),
            shard_states=mode in ("zero1", "zero2", "fsdp"),
        )
        # activations: the schedule's held (stage chunk, micro-batch) pairs; outside parts on the end stages
        if piped:
            activations = sym("k") * chunk_act
            if holds["before"]:
                activations += sym("k_first") * (before_act + ends.get("first", ZERO))
            if holds["after"]:
                activations += sym("k_last") * (after_act + ends.get("last", ZERO))
                if layout.return_outputs:  # schedule.step(return_outputs=True), PyTorch's default: m outputs kept
                    activations += m * head_out
            # a held micro-batch's output (the runtime's fwd_cache) is among the stack's saved activations: the
            # next block saves its input
        else:
            activations = act_total
        stack_rows = [(rw, c) for rw, c in rows if _in_stack(rw)]
        chunk_grads = None
        if piped and v > 1 and mode == "ddp":  # DDP over each stage chunk's module: one reducer each
            chunk = _chunk_parts(run, layout)
            chunk_grads = [chunk[k][1] for k in chunk_kinds(layout.pp, v, stage_rank(stage, layout.pp))]
        colls = _collectives(
            layout,
            mode,
            rows,
            stack_rows=stack_rows,
            n=n,
            stage=stage,
            mem=mem,
            boundary=run.memory.boundary,  # the stages send what forward runs in (param_dtype)
            dp=dp,
            m=m,
            sizes=gathered,
            chunk_grads=chunk_grads,
        )
        if layout.tp > 1:
            sharded = None
            if mode == "fsdp" and layout.replicas > 1:  # the gradient's dtype: the accumulators', param_dtype's
                held = _accumulates(layout, run) and (piped or layout.micro_batches > 1)  # no sync at a backward
                dtype = layout.reduce_dtype if held else layout.param_dtype
                sharded = (rows, DTYPES[dtype][0].itemsize if dtype else None)
            colls += _traced_collectives(run, holds, piped, fsdp=sharded)
        if layout.cp > 1:  # the gradients' group spans the context-parallel ranks too
            cp_groups = {"dp": "dp_cp", "dp_shard": "dp_shard_cp"}
            colls = [dataclasses.replace(c, group=cp_groups.get(c.group, c.group)) for c in colls]
            colls += _traced_collectives(run, holds, piped, group="cp")
        overlay = _fsdp_overlay(acct, layout, mode, rows, stack_rows, n, gathered, params + states, compute)
        if overlay is None:  # the additive model's parts (the optimizer runs on the shards: acct's)
            steady_peak, _, excess_opt = _part(acct, "steady")
            transient = _part(run, "steady")[1]
        else:  # FSDP2's buffers on the trace give the forward and backward; the optimizer step's own points
            steady_peak, transient, excess_opt = ZERO, ZERO, _part(acct, "optimizer")
        stage_transient = transient
        runtime = ZERO
        if piped:  # one micro-batch in flight through the stage's ops, the others held (see _stage_in_flight)
            one = _chunk_activations(run.memory, L / (pp * v), holds["before"], holds["after"])
            # the runtime's receive buffers (one per micro-batch for each stage chunk's input from the stage
            # before and for its output's gradient from the stage after), and the whole batch's inputs
            recv = 2 * v - int(holds["before"]) - int(holds["after"])
            runtime = recv * m * run.memory.boundary + (m - 1) * run.memory.inputs
            if stages is not None:
                fs = _fsdp_stage(layout, mode, rows, stack_rows, n, gathered, _accumulates(layout, run))
                per_chunk = {}
                if fs is not None and v > 1:  # each chunk's module its own FSDP2 root, its blocks sharded
                    for ck in set(chunk_kinds(layout.pp, v, stage_rank(stage, layout.pp))):
                        own_rows = _stage_rows(mem, ck, L / (pp * v))
                        own_stack = [(rw, c) for rw, c in own_rows if _in_stack(rw)]
                        per_chunk[ck] = _fsdp_stage(
                            layout, mode, own_rows, own_stack, n, gathered, _accumulates(layout, run)
                        )
                stages[stage] = StageParts(
                    stage, one, run.memory.boundary, head_out, run.memory.loss, runtime, fs, per_chunk
                )
            stage_transient = ZERO  # every point of the schedule evaluated (_pipeline_peak)
        working = ZERO
        if mode == "fsdp" and layout.replicas > 1 and piped:  # the buffers are in each point's own bytes
            pass
        elif mode == "fsdp" and layout.replicas > 1:
            root = [(rw, c) for rw, c in rows if not _in_stack(rw)]
            block = [(rw, sympy.Integer(1)) for rw, _c in stack_rows]
            working = _gathered(root, n, sizes=gathered) + _gathered(block, n, sizes=gathered)
        elif mode == "ddp" and layout.replicas > 1:  # the reducer's buckets, held from step to step (as views too)
            working = grads
        # model FLOPs of one step on this rank, and of one micro-batch through one stage chunk
        share = L / (pp * v) if piped else L
        # each block's FLOPs times the chunk's blocks; a first or last block that differs on its own stage
        chunk_fwd, chunk_bwd = (sympy.diff(e, L) * share for e in (fwd_stack, bwd_stack))
        f = _stack_flops(run, holds) if piped else fwd_stack + bwd_stack
        if holds["before"]:
            f += outside["before"]["forward"] + outside["before"]["backward"]
        if holds["after"]:
            f += outside["after"]["forward"] + outside["after"]["backward"]
        if not piped and mode == "ddp":  # replicas: the single-device step, exactly, and the buckets
            # each new gradient freed once taken: added into the gradients held from an earlier micro-batch
            # (gradient accumulation), or copied into its bucket view (gradient_as_bucket_view)
            if layout.micro_batches > 1:
                peak = sympy.Max(steady_peak, _part(acct, "brief") + grads, evaluate=False) + working
            elif layout.bucket_view:
                peak = _part(acct, "brief") + working
            else:
                peak = steady_peak + working
            if layout.replicas > 1:
                peak = sympy.Max(peak, _buffer_broadcast(acct, layout) + working, evaluate=False)
        elif piped:  # the schedule's points (derive_parallel: _pipeline_peak)
            peak = sympy.nan
        elif overlay is not None:  # FSDP2's buffers placed on the trace, point by point (symacct.parallel.fsdp)
            share = states / mem.optimizer if mem.optimizer != 0 else ZERO
            opt = overlay[1] + grads + sympy.ceiling(excess_opt * share) + _optimizer_beside(acct, layout)
            if overlays is not None:
                overlays.append((*overlay, stage, opt))
            peak = sympy.nan  # the Max over the overlay's points and the optimizer step's: _overlay_peak
        else:  # the optimizer's temporaries scale with the states it updates
            share = states / mem.optimizer if mem.optimizer != 0 else ZERO
            # gradients are alive at the activations' peak when a backward ran before it: g_held (0 or 1)
            held_grads = sym("g_held") * grads
            # (a model: rounded up to whole bytes, as the share is a fraction of the single device's)
            # the last stage's outputs kept for step()'s return live until the next step: the optimizer's too
            kept = m * head_out if piped and holds["after"] and layout.return_outputs else ZERO
            bucket = _ddp_buckets(layout, working)
            during = sympy.Max(
                activations + working + stage_transient + held_grads,
                grads + sympy.ceiling(excess_opt * share) + kept + _optimizer_beside(acct, layout) + bucket,
                evaluate=False,
            )
            peak = params + states + runtime + during
        ranks.append(
            Rank(
                stage=stage,
                peak=peak,
                params=sympy.expand(params),
                grads=sympy.expand(grads),
                optimizer=sympy.expand(states),
                activations=sympy.expand(activations),
                working=sympy.expand(working),
                runtime=sympy.expand(runtime),
                transient=stage_transient,
                flops=sympy.expand(m * f + acct.flops.optimizer),
                collectives=colls,
                chunk={
                    "forward": sympy.expand(chunk_fwd),
                    "backward": sympy.expand(chunk_bwd),
                    "before_forward": outside["before"]["forward"],
                    "before_backward": outside["before"]["backward"],
                    "after_forward": outside["after"]["forward"],
                    "after_backward": outside["after"]["backward"],
                },
            )
        )
    return ranks


@dataclasses.dataclass(frozen=True)
class StageParts:
    """A pipeline stage's pieces (formulas) for its live bytes at every point of PyTorch's schedule
    (``Parallel.pipeline_peaks``): one held micro-batch's saved activations (``held``), a stage output or
    input gradient (``boundary``), the last stage's output of one micro-batch (``head``), the loss, and
    what the runtime keeps through the step (``runtime``: receive buffers, the whole batch's inputs)."""

    kind: str
    held: Expr
    boundary: Expr
    head: Expr
    loss: Expr
    runtime: Expr
    fsdp: FsdpStage | None = None  # FSDP2 over the stage module
    # the interleaved schedule: FSDP2 over each stage chunk's module, per kind of chunk (first, middle, last)
    chunk_fsdp: dict[str, FsdpStage] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class FsdpStage:
    """FSDP2 over a pipeline stage's module (formulas): the root group's and one block's buffers (the root:
    what the stage runs outside the stack), and the unsharded gradients the micro-batches accumulate into,
    the root's and one block's (``symacct.parallel.fsdp``'s stage kinds)."""

    root: GroupBytes
    block: GroupBytes
    root_grads: Expr
    block_grads: Expr
    reshard: bool
    # a MixedPrecisionPolicy whose reduce_dtype is not the gradients' (param_dtype bf16, reduce_dtype fp32):
    # each group's post-backward moves its new gradients into unsharded accumulators of reduce_dtype
    # (``root_grads``, ``block_grads``: theirs), made at the first backward, added into at each later one
    accumulator: bool = False


SCHEDULE_RUNTIMES = ("gpipe", "1f1b", "interleaved")  # schedules whose runtime's references are modelled


def _beside(
    others: int,
    sent: int,
    losses: int,
    outs: int,
    grads: bool,
    held: Any,
    boundary: Any,
    loss: Any,
    head: Any,
    grad_bytes: Any,
    working: Any,
) -> Any:
    """A stage's bytes at a point of its schedule beside the micro-batch in flight: the held micro-batches'
    saved activations, the outputs and input gradients the runtime references, its losses and kept outputs,
    the gradients once a backward ran, and ``working`` (formulas or numbers alike)."""
    got = others * held + sent * boundary + losses * loss + outs * head + working
    return got + grad_bytes if grads else got


Point = tuple[str, bool, int, int, int, int]


@functools.lru_cache(maxsize=1024)
def _points(
    schedule: str, pp: int, m: int, stage: int, keep_outputs: bool, fsdp: bool | None = None
) -> tuple[Point, ...]:
    """The stage's schedule points (``runtime_holds``) as (kind, gradients exist, held micro-batches, outputs
    and input gradients referenced, losses, last-stage outputs), each once. ``fsdp`` (FSDP2 over the stage,
    its ``reshard_after_forward``): the compute actions' kinds are FSDP2's (``stage_kinds``), and the point
    'R' of ``perform_reduce_grad`` is among them."""
    holds = runtime_holds(schedule, pp, m, stage, keep_outputs, reduce=fsdp is not None)
    kinds = [h.kind for h in holds] if fsdp is None else stage_kinds([h.kind for h in holds], fsdp)
    keys = {
        (k, h.grads, h.others, h.outputs + h.input_grads, h.losses, h.chunks + h.merged)
        for k, h in zip(kinds, holds, strict=True)
    }
    return tuple(sorted(keys))


def _dominant(points: tuple[Point, ...]) -> list[Point]:
    """``points`` less each one another of the same kind and gradients holds at least as much of everything
    beside (it cannot be the larger): the terms of a peak formula."""
    return _undominated(points, lambda k: k[:2], lambda k: k[2:])


def _undominated(points: Any, key: Callable[[Any], Any], counts: Callable[[Any], tuple[int, ...]]) -> list[Any]:
    """``points`` less each one that another of the same ``key`` covers, holding at least as many of each of
    its ``counts`` (held micro-batches, references, losses, ...): every count multiplies bytes >= 0, so a
    covered point is never the larger; grouped by key in key order, each group's points by counts descending."""
    by_key: dict[Any, list[tuple[tuple[int, ...], Any]]] = {}
    for p in sorted(points, key=counts, reverse=True):  # a covering point sorts before what it covers
        c = counts(p)
        same = by_key.setdefault(key(p), [])
        if not any(all(a >= b for a, b in zip(o, c, strict=True)) for o, _ in same):
            same.append((c, p))
    return [p for k in sorted(by_key) for _, p in by_key[k]]


def _candidates(points: Any, key: Callable[[Any], Any], counts: Callable[[Any], tuple[int, ...]]) -> list[Any]:
    """The points an exact peak evaluates: ``points`` less each one whose ``counts`` (each multiplying bytes
    >= 0) another of the same ``key`` covers; one of each group's points of equal counts; a point is compared
    with its group's ``_COVERERS`` largest only (a long schedule's points can be a long chain none of which
    covers another: kept), so the cost stays linear in the points."""
    groups: dict[Any, list[Any]] = {}
    for p in points:
        groups.setdefault(key(p), []).append(p)
    out = []
    for group in groups.values():
        if len(group) == 1:
            out += group
            continue
        rows, first = np.unique(np.array([counts(p) for p in group], dtype=np.int64), axis=0, return_index=True)
        top = rows[np.argsort(-rows.sum(axis=1), kind="stable")[:_COVERERS]]
        at_least = (top[None, :, :] >= rows[:, None, :]).all(axis=2)
        equal = (top[None, :, :] == rows[:, None, :]).all(axis=2)
        covered = (at_least & ~equal).any(axis=1)
        out += [group[i] for i in first[~covered]]
    return out


# the exact peaks compare a point with this many of the largest of its kind (``_candidates``)
_COVERERS = 8


@functools.lru_cache(maxsize=1024)
def _peak_points(
    schedule: str, pp: int, m: int, stage: int, keep_outputs: bool, fsdp: bool | None = None
) -> tuple[Point, ...]:
    """``_points`` that can hold the stage's most (``_candidates``): what its exact peak evaluates."""
    points = _points(schedule, pp, m, stage, keep_outputs, fsdp)
    return tuple(_candidates(points, lambda k: k[:2], lambda k: k[2:]))


def _held_counts(h: Any) -> tuple[int, ...]:
    """What a ``ChunkHeld`` point multiplies by bytes >= 0 (``_chunk_point``): each chunk's held micro-batches,
    the boundary tensors referenced, the losses, the last stage's outputs."""
    return (*h.held, h.outputs + h.input_grads, h.losses, h.chunks + h.merged)


@functools.lru_cache(maxsize=512)
def _chunk_peak_points(pp: int, m: int, v: int, rank: int, keep_outputs: bool) -> tuple[Any, ...]:
    """``interleaved_holds`` that can hold the rank's most (``_candidates``, by action kind, chunk in flight and
    the chunks whose gradients exist): what ``Parallel._chunks_peak`` evaluates."""
    holds = interleaved_holds(pp, m, v, rank, keep_outputs)
    return tuple(_candidates(holds, lambda h: (h.kind, h.chunk, h.grads), _held_counts))


@functools.lru_cache(maxsize=512)
def _chunk_fsdp_peak_points(pp: int, m: int, v: int, rank: int, keep_outputs: bool, reshard: bool) -> tuple[Any, ...]:
    """``interleaved_fsdp_points`` that can hold the rank's most (as ``_chunk_peak_points``, each chunk's FSDP2
    state part of the key): what ``Parallel._chunks_fsdp_peak`` evaluates."""
    points = interleaved_fsdp_points(pp, m, v, rank, keep_outputs, reshard)
    return tuple(
        _candidates(points, lambda p: (p.kind, p.held.chunk, p.held.grads, p.states), lambda p: _held_counts(p.held))
    )


def stage_rank(kind: str, pp: int) -> int:
    """The pipeline rank of a kind of stage (``only``: 0; ``middle``: the first of them)."""
    return {"only": 0, "first": 0, "middle": 1, "last": pp - 1}[kind]


def _pipeline_peak(rank: Rank, parts: StageParts, acct: Accounting, layout: Layout, run: Accounting) -> Expr:
    """A pipeline stage's peak as a formula (an interleaved rank's: ``_chunks_peak_formula``): its parameters, states
    and runtime bytes plus the ``Max`` over the schedule's points (``runtime_holds``; a point left out where another
    of the same kind holds at least as much of everything) of the micro-batch in flight (``_stage_in_flight``,
    forward or backward, its gradients accumulating after a first backward) + the held micro-batches + what the
    runtime references, and the optimizer step's."""

    m = layout.micro_batches
    if layout.stages_per_rank > 1:
        if parts.chunk_fsdp:
            return _chunks_fsdp_peak_formula(rank, parts, acct, layout, run)
        return _chunks_peak_formula(rank, parts, acct, layout, run)
    if parts.fsdp is not None:
        return _fsdp_stage_peak_formula(rank, parts, acct, layout, run)
    terms = []
    index = stage_rank(parts.kind, layout.pp)
    for kind, grads, others, sent, losses, outs in _dominant(
        _points(layout.schedule, layout.pp, m, index, layout.return_outputs)
    ):
        own = ZERO if kind == "end" else _stage_in_flight(run, parts.kind, accumulating=grads, phases=kind)
        sizes = (parts.held, parts.boundary, parts.loss, parts.head, rank.grads, rank.working)
        terms.append(own + _beside(others, sent, losses, outs, grads, *sizes))
    kept_outputs = m * parts.head if parts.kind == "last" and layout.return_outputs else ZERO
    if _own_optimizer(run, layout):  # the stage's own optimizer ops
        terms.append(_stage_in_flight(run, parts.kind, phases="O") + kept_outputs + _ddp_buckets(layout, rank.working))
    else:
        terms.append(_shared_optimizer_formula(rank, acct, layout) + kept_outputs)
    return rank.params + rank.optimizer + parts.runtime + sympy.Max(*terms, evaluate=False)


def _fsdp_stage_peak_formula(rank: Rank, parts: StageParts, acct: Accounting, layout: Layout, run: Accounting) -> Expr:
    """``Parallel._fsdp_stage_peak`` as a formula: each compute action's in-flight bytes the ``Max`` over its
    points largest in a sample of the sizes (``Liveness.symbolic_peak``, L the stage's blocks, then L/pp): at
    sizes where a point no sample made largest is (a wide model's small micro-batch) it is below at()'s."""
    fs = parts.fsdp
    assert fs is not None
    blocks = sym("L") / sym("pp")
    unsharded = fs.root_grads + blocks * fs.block_grads
    sizes = (parts.held, parts.boundary, parts.loss, parts.head)
    terms = []
    index = stage_rank(parts.kind, layout.pp)
    points = _points(layout.schedule, layout.pp, layout.micro_batches, index, layout.return_outputs, fs.reshard)
    for kind, grads, others, sent, losses, outs in _dominant(points):
        if kind == "R":
            own = sympy.Max(*_reduce_terms(fs, blocks, lambda e: e), evaluate=False)
            terms.append(own + _beside(others, sent, losses, outs, False, *sizes, ZERO, ZERO))
        elif kind == "end":
            terms.append(_beside(others, sent, losses, outs, True, *sizes, rank.grads, ZERO))
        else:
            live = _fsdp_stage_live(run, parts.kind, kind, grads, fs, one_block=False)
            free = sympy.sympify(run.memory.peak).free_symbols | sympy.sympify(fs.block.gathered).free_symbols
            peak, _ = live.symbolic_peak(sorted({str(x) for x in free} | {"L", "dp"}))
            points = [sympy.sympify(e).xreplace({sym("L"): blocks}) for e in _max_args(peak)]  # no Max again
            own = points[0] if len(points) == 1 else sympy.Max(*points, evaluate=False)
            terms.append(own + _beside(others, sent, losses, outs, grads, *sizes, unsharded, ZERO))
    kept_outputs = layout.micro_batches * parts.head if parts.kind == "last" and layout.return_outputs else ZERO
    terms.append(_shared_optimizer_formula(rank, acct, layout) + kept_outputs)
    return rank.params + rank.optimizer + parts.runtime + sympy.Max(*terms, evaluate=False)


def _max_args(e: Expr) -> tuple[Expr, ...]:
    """The terms of a ``Max`` (or the expression alone): substituted one by one, as a ``Max`` built again
    would compare them all (seconds on a large model)."""
    return e.args if isinstance(e, sympy.Max) else (e,)


def _ddp_buckets(layout: Layout, working: Any) -> Any:
    """DDP's buckets at a pipeline rank's optimizer step (the reducer holds them from step to step); FSDP2's
    gathered buffers (the other ``working``) are freed by then."""
    return working if layout.dp_mode == "ddp" else 0


def _shared_optimizer_formula(rank: Rank, acct: Accounting, layout: Layout) -> Expr:
    """``Parallel._shared_optimizer`` as a formula."""
    share = rank.optimizer / acct.memory.optimizer if acct.memory.optimizer != 0 else ZERO
    excess = sympy.ceiling(_part(acct, "steady")[2] * share)
    return rank.grads + excess + _optimizer_beside(acct, layout) + _ddp_buckets(layout, rank.working)


def _chunks_peak_formula(rank: Rank, parts: StageParts, acct: Accounting, layout: Layout, run: Accounting) -> Expr:
    """An interleaved rank's peak as a formula: ``Parallel._chunks_peak``'s terms, each chunk's in flight the
    ``Max`` over its ops largest in a sample of the sizes (``_stage_in_flight``), at the distinct points."""
    v, m = layout.stages_per_rank, layout.micro_batches
    kinds = chunk_kinds(layout.pp, v, stage_rank(parts.kind, layout.pp))
    chunk = _chunk_parts(run, layout)
    terms = []
    seen = set()
    for h in interleaved_holds(layout.pp, m, v, stage_rank(parts.kind, layout.pp), layout.return_outputs):
        if h in seen:
            continue
        seen.add(h)
        k = kinds[h.chunk] if h.kind != "end" else None
        own = ZERO if k is None else _stage_in_flight(run, k, accumulating=h.grads[h.chunk], chunks=v, phases=h.kind)
        terms.append(own + _chunk_point(h, kinds, chunk, parts.boundary, parts.loss, parts.head, rank.working))
    kept = m * parts.head if "last" in kinds and layout.return_outputs else ZERO
    if _own_optimizer(run, layout):
        own_opt = {k: _stage_in_flight(run, k, chunks=v, phases="O") for k in set(kinds)}
        terms.append(_chunks_optimizer(kinds, own_opt, chunk) + kept + _ddp_buckets(layout, rank.working))
    else:
        terms.append(_shared_optimizer_formula(rank, acct, layout) + kept)
    return rank.params + rank.optimizer + parts.runtime + sympy.Max(*terms, evaluate=False)


def chunk_kinds(pp: int, v: int, rank: int) -> list[str]:
    """The kinds of the stage chunks pipeline rank ``rank`` holds (stages rank, rank + pp, ... of pp * v)."""
    n = pp * v
    return ["first" if s == 0 else "last" if s == n - 1 else "middle" for s in range(rank, n, pp)]


def _chunk_parts(run: Accounting, layout: Layout) -> dict[str, tuple[Expr, Expr, Expr]]:
    """Per kind of stage chunk (L / (pp v) blocks, and what runs before the stack on the first, after it on
    the last): one held micro-batch's saved activations, the chunk's gradients, its blocks' buffers (formulas in
    the sizes and pp; the gradients unsharded: DDP or ZeRO-1, what a pipeline is derived with)."""
    v = layout.stages_per_rank
    cache = run.__dict__.setdefault("_chunk_parts", {})
    if v not in cache:
        L = sym("L")
        share = {L: L / (sym("pp") * v)}
        mem = run.memory
        out = {}
        for kind in ("first", "middle", "last"):
            ends = {"first": {"before"}, "middle": set(), "last": {"after"}}[kind]
            grads = ZERO
            for row in mem.tensors:
                if not row.grad:
                    continue
                if _in_stack(row):
                    copies = row.count.xreplace(share)
                else:
                    places = row.places & {"before", "after"} or {"before"}
                    copies = row.count if places & ends else ZERO
                grads += copies * row.grad_itemsize * _grad_numel(row)
            held = _chunk_activations(mem, share[L], kind == "first", kind == "last")
            # the stack's buffers (the blocks' own); those outside it (a root's rotary tables, which every stage
            # module shares) are one storage on the rank, in the live bytes of the chunk in flight
            buffers = sympy.sympify(mem.buffers)
            out[kind] = (held, sympy.expand(grads), sympy.expand(buffers - buffers.xreplace({L: 0})).xreplace(share))
        cache[v] = out
    return cache[v]


def _chunk_point(
    h: Any, kinds: list[str], parts: Mapping[str, Any], boundary: Any, loss: Any, head: Any, working: Any
) -> Any:
    """An interleaved rank's bytes at a point (``ChunkHeld``) beside the chunk in flight: each chunk's held
    micro-batches, the outputs and input gradients the runtime references, the last stage's losses and
    kept outputs, each chunk's gradients once a backward ran on it, the other chunks' buffers, and
    ``working`` (numbers or formulas)."""
    got = sum((n * parts[kinds[c]][0] for c, n in enumerate(h.held)), 0)
    got += sum((parts[kinds[c]][1] for c, g in enumerate(h.grads) if g), 0)
    # the buffers of the chunks not in flight (the one in flight: its own live bytes; at the end, every chunk)
    got += sum((parts[kinds[c]][2] for c in range(len(kinds)) if c != h.chunk), 0)
    return got + (h.outputs + h.input_grads) * boundary + h.losses * loss + (h.chunks + h.merged) * head + working


@dataclasses.dataclass(frozen=True)
class ChunkGroups:
    """A stage chunk's FSDP2 bytes by state (numbers or formulas): all its groups gathered (the UNSHARD's
    outputs, or the unsharded parameters: the same bytes), its root alone, its gradients unsharded and sharded,
    and at the wait on its UNSHARD (each group copied out beside its output: every group's bytes and the
    largest group's again)."""

    gathered: Any
    root: Any
    grads: Any
    sharded: Any
    waiting: Any


def _chunk_groups(fs: FsdpStage, blocks: Any, ev: Callable[[Expr], Any]) -> ChunkGroups:
    """``ChunkGroups`` of a chunk of ``blocks`` blocks; ``ev``: a formula's value (or the formula)."""
    root, block = ev(fs.root.gathered), ev(fs.block.gathered)
    gathered = root + blocks * block
    largest = max(root, block) if isinstance(root, int) and isinstance(block, int) else sympy.Max(root, block)
    return ChunkGroups(
        gathered=gathered,
        root=root,
        grads=ev(fs.root_grads) + blocks * ev(fs.block_grads),
        sharded=ev(fs.root.sharded_grads) + blocks * ev(fs.block.sharded_grads),
        waiting=gathered + largest,
    )


def _chunk_fsdp_beside(
    p: Any,
    kinds: list[str],
    parts: Mapping[str, Any],
    groups: Mapping[str, ChunkGroups],
    boundary: Any,
    loss: Any,
    head: Any,
) -> Any:
    """An interleaved FSDP2 rank's bytes at a point beside the chunk in flight's own (``_chunk_point`` without
    the gradients): every other chunk's parameters as its state has them (pending or all unsharded: every
    group; after a forward that resharded: the root; sharded or reduced: none) and its gradients (unsharded
    once a backward ran, sharded once reduced); the chunk in flight's unsharded gradients after its first
    backward, at a compute action or the wait on a later UNSHARD (its reduce phase and the end count their
    own)."""
    h = p.held
    got = _chunk_point(h._replace(grads=(False,) * len(kinds)), kinds, parts, boundary, loss, head, 0)
    for c, state in enumerate(p.states):
        g = groups[kinds[c]]
        if c == h.chunk:
            if p.kind != "R" and h.grads[c]:
                got += g.grads
            continue
        if state == "reduced":
            got += g.sharded
            continue
        if state in ("pending", "all"):
            got += g.gathered
        elif state == "root":
            got += g.root
        got += g.grads if h.grads[c] else 0
    return got


def _chunks_fsdp_peak_formula(rank: Rank, parts: StageParts, acct: Accounting, layout: Layout, run: Accounting) -> Expr:
    """``Parallel._chunks_fsdp_peak`` as a formula: each compute action's in-flight bytes the ``Max`` over its
    points largest in a sample of the sizes (``Liveness.symbolic_peak``, L a chunk's blocks, then
    L/(pp v)), at the distinct points."""
    v = layout.stages_per_rank
    blocks = sym("L") / (sym("pp") * v)
    index = stage_rank(parts.kind, layout.pp)
    kinds = chunk_kinds(layout.pp, v, index)
    chunk = _chunk_parts(run, layout)
    groups = {k: _chunk_groups(fs, blocks, lambda e: e) for k, fs in parts.chunk_fsdp.items()}
    own: dict[tuple[str, str, bool], Expr] = {}
    terms = []
    seen = set()
    for p in interleaved_fsdp_points(
        layout.pp, layout.micro_batches, v, index, layout.return_outputs, layout.reshard_after_forward
    ):
        if p in seen:
            continue
        seen.add(p)
        h, c = p.held, p.held.chunk
        k = kinds[c] if c >= 0 else ""
        if p.kind == "end":
            here = ZERO
        elif p.kind == "U":
            here = groups[k].waiting
        elif p.kind == "R":
            here = sympy.Max(*_reduce_terms(parts.chunk_fsdp[k], blocks, lambda e: e), evaluate=False)
        else:
            key = (k, p.kind, h.grads[c])
            if key not in own:
                fs = parts.chunk_fsdp[k]
                live = _fsdp_stage_live(run, k, p.kind, h.grads[c], fs, one_block=False)
                free = sympy.sympify(run.memory.peak).free_symbols | sympy.sympify(fs.block.gathered).free_symbols
                peak, _ = live.symbolic_peak(sorted({str(x) for x in free} | {"L", "dp"}))
                points = [sympy.sympify(e).xreplace({sym("L"): blocks}) for e in _max_args(peak)]
                own[key] = points[0] if len(points) == 1 else sympy.Max(*points, evaluate=False)
            here = own[key]
        terms.append(here + _chunk_fsdp_beside(p, kinds, chunk, groups, parts.boundary, parts.loss, parts.head))
    kept = layout.micro_batches * parts.head if "last" in kinds and layout.return_outputs else ZERO
    terms.append(_shared_optimizer_formula(rank, acct, layout) + kept)
    return rank.params + rank.optimizer + parts.runtime + sympy.Max(*terms, evaluate=False)


def _chunks_optimizer(kinds: list[str], own_opt: Mapping[str, Any], parts: Mapping[str, Any]) -> Any:
    """An interleaved rank's optimizer step (a single-tensor optimizer): while it updates one chunk's
    parameters (that chunk's own optimizer ops: its gradients, buffers, one micro-batch's inputs and the
    temporaries), the other chunks' gradients and buffers (numbers: the largest; formulas: their ``Max``)."""
    terms = []
    for c, k in enumerate(kinds):
        others = sum((parts[kinds[o]][1] + parts[kinds[o]][2] for o in range(len(kinds)) if o != c), 0)
        terms.append(own_opt[k] + others)
    if all(isinstance(t, int) for t in terms):
        return max(terms)
    return sympy.Max(*terms, evaluate=False)


def _ceil_share(acct: Accounting, states: int, values: dict[str, int]) -> int:
    """The optimizer step's own temporaries (beyond the static bytes and ``_kept_by_step``), scaled by the
    rank's share of the states (a model: the single device's, at every optimizer op exactly, rounded up to
    whole bytes)."""
    cache = acct.__dict__.setdefault("_optimizer_excess", {})
    key = _sizes_key(values)
    if key not in cache:
        if len(cache) >= 4096:
            cache.clear()
        total = evaluate(acct.memory.optimizer, values)
        excess = 0
        if total:
            live = _steady_live(acct).during(values, _part(acct, "optimizer_ops"))
            mem = acct.memory
            static = evaluate(mem.params + mem.grads + mem.optimizer + _kept_by_step(acct), values)
            excess = max([0, *(b - static for b in live.values())])
        cache[key] = (total, excess)
    total, excess = cache[key]
    return -(-excess * states // total) if total else 0


def _fsdp_overlay(
    acct: Accounting,
    layout: Layout,
    mode: str,
    rows: list[tuple[ParamRow, Expr]],
    stack_rows: list[tuple[ParamRow, Expr]],
    n: Expr,
    sizes: Sizes | None,
    static: Expr,
    compute: Accounting | None,
) -> tuple[Liveness, Expr] | None:
    """FSDP2 without a pipeline, tensor parallelism or HSDP, on one layer stack: the rank's live bytes over
    forward and backward with FSDP2's buffers placed at its hooks (``symacct.parallel.fsdp``) and the static
    bytes (sharded parameters and states); None for every other layout. Its peak formula:
    ``_overlay_peak``."""
    run = compute or acct
    live = run.liveness
    if not (
        mode == "fsdp"
        and run.options.get("step") == "train"
        and layout.replicas > 1
        and layout.pp == 1
        and len(acct.per_layer) == 1
        and live is not None
        and live.other is not None
        and live.other_point_block
    ):
        return None

    root = _group_bytes([(rw, c) for rw, c in rows if not _in_stack(rw)], n, sizes)
    block = _group_bytes(stack_rows, n, sizes)
    ov = fsdp_liveness(live.steady(), root, block, static, layout.reshard_after_forward, layout.micro_batches > 1)
    return ov, static


def _overlay_peak(r: Rank, overlays: list[Any], run: Accounting) -> Rank:
    """An FSDP2 rank's peak formula (``_fsdp_overlay``): the ``Max`` over the overlay's points largest in a
    sample of the sizes and the optimizer step's; built only where a formula is asked for (``at()``, fit and
    the planner evaluate every point instead)."""
    for ov, static, stage, opt in overlays:
        if stage == r.stage:
            free = sympy.sympify(run.memory.peak).free_symbols | sympy.sympify(static).free_symbols
            names = sorted({str(x) for x in free} | {"L"})
            # the formula only: a smaller sample than derive's
            return dataclasses.replace(r, peak=sympy.Max(ov.symbolic_peak(names, samples=16)[0], opt, evaluate=False))
    return r


def _fsdp_stage(
    layout: Layout,
    mode: str,
    rows: list[tuple[ParamRow, Expr]],
    stack_rows: list[tuple[ParamRow, Expr]],
    n: Expr,
    sizes: Sizes | None,
    accumulator: bool = False,
) -> FsdpStage | None:
    """FSDP2 over a pipeline stage's module (``fully_shard`` each block, then the stage): its groups' bytes
    (``accumulator``: the policy's reduce_dtype accumulators, ``_accumulates``); None for every other
    layout."""
    if not (mode == "fsdp" and layout.replicas > 1 and layout.pp > 1):
        return None
    reduce = DTYPES[layout.reduce_dtype][0].itemsize if accumulator and layout.reduce_dtype else None

    def itemsize(rw: ParamRow) -> int:
        """An unsharded gradient's: the accumulators', else what backward makes (``param_dtype``'s)."""
        return reduce or (sizes[rw.name][0] if sizes else rw.grad_itemsize)

    def grads(part: list[tuple[ParamRow, Expr]]) -> Expr:
        """The unsharded gradients as backward makes them (a vocabulary-parallel embedding's whole: ParamRow)."""
        return sympy.expand(sum((itemsize(rw) * _grad_numel(rw) for rw, _c in part if rw.grad), ZERO))

    root = [(rw, c) for rw, c in rows if not _in_stack(rw)]
    return FsdpStage(
        _group_bytes(root, n, sizes),
        _group_bytes(stack_rows, n, sizes),
        grads(root),
        grads(stack_rows),
        layout.reshard_after_forward,
        accumulator,
    )


def _accumulates(layout: Layout, run: Accounting) -> bool:
    """FSDP2's policy moves the unsharded gradients into accumulators when its reduce_dtype is not the dtype
    backward makes them in (the traced step's parameters': param_dtype's, or with a reduce_dtype alone the
    model's own): torch 2.13's ``FSDPParam.to_accumulated_grad_if_needed``, run at each post-backward
    without a gradient sync. Parameters of several dtypes under a reduce_dtype alone are refused."""
    if not layout.reduce_dtype:
        return False
    found = {p.meta.dtype for p in run.step.placeholders if p.kind == "param"} if run.step is not None else set()
    if len(found) != 1:
        raise SymacctError(
            f"FSDP2's reduce_dtype={layout.reduce_dtype} over parameters of {len(found)} dtypes is not derived "
            "(which of them it accumulates in another dtype)",
            hint="give the policy a param_dtype too, or the model one parameter dtype",
        )
    return DTYPES[layout.reduce_dtype][0] not in found


def _group_bytes(part: list[tuple[ParamRow, Expr]], n: Expr, sizes: Sizes | None) -> GroupBytes:
    """One FSDP2 group's buffers (each row once: a block's, or the root's)."""
    one = [(rw, sympy.Integer(1)) for rw, _c in part]
    sharded = _rows_bytes(one, n, shard_params=True, shard_grads=True, shard_states=True)[1]
    cast = [(rw, c) for rw, c in one if sizes and sizes.get(rw.name, (rw.itemsize,))[0] != rw.itemsize]
    copy_in = sympy.expand(_gathered(cast, n, sizes=sizes) / n) if cast else ZERO
    return GroupBytes(
        _gathered(one, n, sizes=sizes), _gathered(one, n, grad=True, sizes=sizes), sharded, copy_in=copy_in
    )


# what DTensor's output hook runs to redistribute a module's output (a sharded one gathered: all-gather, wait,
# the chunks split and concatenated, the padding sliced off); the trace puts a module's own forward hooks in
# its parent (the tracer's global hook closes the module first)
_REDISTRIBUTE = (
    "_c10d_functional.all_gather_into_tensor",
    "_c10d_functional.wait_tensor",
    "aten.split.",
    "aten.cat.",
    "aten.slice.",
)


def _head_output(acct: Accounting) -> Expr:
    """Bytes of what the head returns (the logits): what a pipeline's last stage returns. Its last forward
    op's output, or, where a tensor-parallel plan's output hook redistributes it (the logits gathered whole,
    ``ColwiseParallel(output_layouts=Replicate())``), the last op of that redistribution right after it."""
    last = None
    after = gathered = False
    for key, node in records(acct.graph):
        if not isinstance(key, int) or node.phase != "forward":
            continue
        if node.component == "head" and node.shapes:
            last, after, gathered = node, True, False
        elif after and node.module == "" and node.op.startswith(_REDISTRIBUTE if gathered else _REDISTRIBUTE[:1]):
            last, gathered = node, True  # the redistribution starts with the all-gather
        else:
            after = False
    if last is None:
        return ZERO
    itemsize = getattr(torch, last.dtypes[0].removeprefix("torch.")).itemsize
    return sympy.expand(itemsize * sympy.Mul(*last.shapes[0]))


def _steady(acct: Accounting) -> tuple[Expr, Expr, Expr]:
    """The single-device step once the optimizer states exist (every step after the first; the liveness's
    ``steady``): its peak, and its bytes beyond what the model keeps: at the forward and backward candidate
    points, beyond the parameters, the states, the gradients alive there and every saved activation (the
    activations' peak is where backward starts); at the optimizer points, the optimizer's own temporaries
    (beyond the static bytes and ``_kept_by_step``)."""
    mem, live = acct.memory, acct.liveness
    if live is None:
        raise SymacctError("this derivation has no liveness", hint="derive the model again")
    steady = _steady_live(acct)
    peak, points = steady.symbolic_peak(_peak_names(acct))
    static = mem.params + mem.grads + mem.optimizer
    fb, opt = [ZERO], [ZERO]
    for t in points:
        point = steady.at_point(t)
        if steady.labels[t][3] == "optimizer":
            opt.append(sympy.expand(point - static - _kept_by_step(acct)))
        else:  # beyond the parameters, the states, the gradients alive there and every saved activation
            grads = steady.grads_at_point(t)
            fb.append(sympy.expand(point - mem.params - mem.optimizer - grads - mem.activations))
    return peak, sympy.Max(*fb, evaluate=False), sympy.Max(*opt, evaluate=False)


def _in_stack(row: ParamRow) -> bool:
    return "stack" in row.places and sym("L") in sympy.sympify(row.count).free_symbols


def _backward_before_forward(acts: Any, rank: int) -> int:
    """1 when the rank runs a backward before its last forward (1F1B: gradients accumulate while activations
    are still held), else 0 (GPipe: every forward first)."""
    kinds = [a.kind for a in acts[rank]]
    return int("B" in kinds and kinds.index("B") < len(kinds) - 1 - kinds[::-1].index("F"))


def _held_micro(acts: Any, rank: int, stage: int) -> int:
    """Most micro-batches of one stage whose activations rank holds at once."""
    held = peak = 0
    for a in acts[rank]:
        if a.stage != stage:
            continue
        held += 1 if a.kind == "F" else -1
        peak = max(peak, held)
    return peak


def _stage_gathers(layout: Layout, stage: str) -> tuple[Expr, Expr, Expr]:
    """FSDP2 over a pipeline stage: each block's all-gathers per step in forward and in backward, and its
    reduce-scatters (one, at ``perform_reduce_grad``). With ``reshard_after_forward``: every forward before
    the stage's first backward gathers (GPipe: m; 1F1B: its warm-up, pp - stage), and every backward after a
    forward (the rest, and the first: m - that + 1); without: the first forward only."""
    m = sym("m")
    if not layout.reshard_after_forward:
        return sympy.Integer(1), ZERO, sympy.Integer(1)
    pp = sym("pp")
    warmup = m if layout.schedule == "gpipe" else {"first": pp, "middle": pp - 1, "last": sympy.Integer(1)}[stage]
    return warmup, m - warmup + 1, sympy.Integer(1)


def _collectives(
    layout: Layout,
    mode: str,
    rows: list[tuple[ParamRow, Expr]],
    *,
    stack_rows: list[tuple[ParamRow, Expr]],
    n: Expr,
    stage: str,
    mem: Any,
    boundary: Expr,
    dp: Expr,
    m: Expr,
    sizes: Sizes | None = None,
    chunk_grads: list[Expr] | None = None,
) -> list[Collective]:
    out: list[Collective] = []
    if layout.replicas > 1:
        if mode == "ddp":
            g = sum((c * rw.grad_itemsize * rw.numel for rw, c in rows if rw.grad), ZERO)
            # an interleaved rank: DDP over each stage chunk's module, each reducing its own gradients
            for i, part in enumerate(chunk_grads or [g]):
                what = f"gradients of stage chunk {i} (DDP buckets)" if chunk_grads else "gradients (DDP buckets)"
                out.append(Collective("all_reduce", "dp", dp, sympy.expand(part), sympy.Integer(1), "backward", what))
            # broadcast_buffers=True: rank 0's buffers at a forward after a synchronising one (DDP's
            # require_forward_param_sync): once a step, under no_sync for all but the last micro-batch; never
            # after the first step in a pipeline, whose stages run every forward under no_sync
            if mem.buffers != 0 and layout.cp == 1 and layout.pp == 1:
                out.append(
                    Collective("broadcast", "dp", dp, mem.buffers, sympy.Integer(1), "forward", "module buffers (DDP)")
                )
        elif mode in ("zero1", "zero2"):
            out.append(
                Collective(
                    "reduce_scatter",
                    "dp",
                    dp,
                    sympy.expand(sum((c * _gathered([(rw, c)], dp, grad=True) for rw, c in rows), ZERO)),
                    sympy.Integer(1),
                    "backward",
                    "gradients",
                )
            )
            out.append(
                Collective(
                    "all_gather",
                    "dp",
                    dp,
                    sympy.expand(sum((c * _gathered([(rw, c)], dp) for rw, c in rows), ZERO)),
                    sympy.Integer(1),
                    "optimizer",
                    "updated parameters",
                )
            )
        else:
            block = [(rw, sympy.Integer(1)) for rw, _c in stack_rows]
            root = [(rw, c) for rw, c in rows if (rw, c) not in stack_rows]
            n_blocks = stack_rows[0][1] if stack_rows else ZERO
            group = "dp_shard" if layout.hsdp_shard else "dp"
            # per group: (forward all-gathers, backward all-gathers, reduce-scatters) per step
            calls = {"root": (m, ZERO, m), "block": (m, m if layout.reshard_after_forward else ZERO, m)}
            if layout.pp > 1 and layout.stages_per_rank > 1:
                # the actions that gather a chunk's blocks, summed over the rank's chunks (g_f in forward, g_b in
                # backward: chunk_gathers, set per layout as k is), each chunk L / (pp v) blocks; the root's by
                # the UNSHARDs of its chunk (the first stage's or the last's), again after an eviction (v > 3)
                v = layout.stages_per_rank
                one = sympy.Integer(1)
                index = stage_rank(stage, layout.pp)
                rf, rb = chunk_unshards(layout.pp, layout.micro_batches, v, index, 0 if stage == "first" else v - 1)
                calls = {
                    "root": (sympy.Integer(rf), sympy.Integer(rb), one),
                    "block": (sym("g_f") / v, sym("g_b") / v, one),
                }
            elif layout.pp > 1:  # FSDP2 over a stage (symacct.parallel.fsdp): the stage kinds' all-gathers
                calls = {"root": (sympy.Integer(1), ZERO, sympy.Integer(1)), "block": _stage_gathers(layout, stage)}
            for what, part, count in (("root", root, sympy.Integer(1)), ("block", block, n_blocks)):
                if not part or count == 0:
                    continue
                ag = sympy.expand(_gathered(part, n, sizes=sizes))
                rs = sympy.expand(_gathered(part, n, grad=True, sizes=sizes))
                fwd, bwd, red = calls[what]
                out.append(Collective("all_gather", group, n, ag, fwd * count, "forward", f"{what} parameters"))
                if bwd != 0:
                    out.append(Collective("all_gather", group, n, ag, bwd * count, "backward", f"{what} parameters"))
                out.append(Collective("reduce_scatter", group, n, rs, red * count, "backward", f"{what} gradients"))
                if layout.hsdp_shard and layout.replicate > 1:
                    out.append(
                        Collective(
                            "all_reduce",
                            "dp_replicate",
                            dp / n,
                            sympy.expand(rs / n),
                            red * count,
                            "backward",
                            f"{what} gradient shards",
                        )
                    )
    if layout.pp > 1:
        v = layout.stages_per_rank
        # each chunk's output goes to the next stage, its input's gradient to the one before (the first
        # stage's input and the last stage's output stay on the rank)
        fwd = v if stage != "last" else v - 1
        bwd = v if stage != "first" else v - 1
        b = boundary
        two = sympy.Integer(2)
        for op, count, phase, what in (
            ("send", fwd, "forward", "activations to the next stage"),
            ("recv", bwd, "forward", "activations from the previous stage"),
            ("send", bwd, "backward", "activation gradients to the previous stage"),
            ("recv", fwd, "backward", "activation gradients from the next stage"),
        ):
            if count:
                out.append(Collective(op, "pp", two, b, m * count, phase, what))
        if stage in ("first", "last"):
            for rw, c in rows:
                if {"before", "after"} <= rw.places and rw.grad:
                    # FSDP2: the gradient is reduced to its shard by then
                    grad = _rows_bytes([(rw, c)], n, shard_params=True, shard_grads=True, shard_states=True)[1]
                    out.append(
                        Collective(
                            "all_reduce",
                            "tied",
                            sympy.Integer(2),
                            grad if mode == "fsdp" and layout.replicas > 1 else c * rw.grad_itemsize * rw.numel,
                            sympy.Integer(1),
                            "backward",
                            f"tied weight {rw.name}",
                        )
                    )
    return out


def parallel(acct: Accounting, layout: Layout | Mapping[str, Any], compute: Accounting | None = None) -> Parallel:
    """``derive_parallel`` with the layout given as a ``Layout`` or its fields."""
    from symacct.parallel.layout import make_layout

    lay = layout if isinstance(layout, Layout) else make_layout(**dict(layout))
    return derive_parallel(acct, lay, compute)
