"""Pipeline schedules from PyTorch's own action lists: micro-batches in flight per rank and the step's makespan.

The lists come from ``torch.distributed.pipelining``'s schedule classes (``pipeline_order``, as the schedule
visualizer reads them, on one stand-in stage made once), with no process group. In torch 2.13
``Schedule1F1B``'s list numbers the last rank's forwards from 1 (``F1 ... F8`` for 8 micro-batches: an
off-by-one of the visual IR, not of the runtime, which runs the micro-batches of a stage in order), so each
stage's forwards and backwards are renumbered 0, 1, ... in the order they appear; the counts and the order
are PyTorch's.

In flight: a rank holds a micro-batch's saved activations of a stage from its forward to its backward;
the most it holds at once, in units of one stage's activations for one micro-batch, sizes its memory
(1F1B with pp=4, m=8: 4, 3, 2, 1).

Makespan: every action takes the time given for its kind and stage; an action starts when its rank is free
and its input is ready (the same micro-batch's forward on the stage before, or its backward on the stage
after, plus a transfer time between ranks); a rank runs its list in order (PyTorch's ``None`` slots are
visual spacing, not waits). The bubble is the makespan less the rank's own busy time.
"""

from __future__ import annotations

import functools
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from symacct.errors import SymacctError


@dataclass(frozen=True)
class Action:
    rank: int
    stage: int
    kind: str  # 'F' forward, 'B' full backward
    micro: int


@functools.cache
def _compute_only(cls: type) -> type:
    """``cls`` without the runtime's communication plan: a multi-stage schedule adds send, receive, unshard and
    reshard actions to its compute order when built (quadratic in the micro-batches), which
    ``get_schedule_ops`` then leaves unread; the compute order is the class's own."""

    class ComputeOnly(cls):  # type: ignore[misc, valid-type]
        def _prepare_schedule_with_comms(self, *args: object, **kwargs: object) -> None:
            return None

    ComputeOnly.__name__ = cls.__name__
    return ComputeOnly


@functools.cache
def _stand_in() -> Any:
    """The stand-in for a stage that PyTorch's schedule visualizer (``get_schedule_ops``) builds, an autospec
    of ``PipelineStage``, made once and reused: building it is most of the cost of reading a list."""
    from unittest import mock

    from torch.distributed.pipelining.stage import PipelineStage

    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.submod = None
    return stage


def _pipeline_order(cls: type, pp: int, m: int, v: int) -> list[list[Any]]:
    """Per rank, the schedule class's own compute order (its ``pipeline_order``), read as ``get_schedule_ops``
    reads it (rank 0's view of a group of ``pp``; ``v`` stages per rank for a multi-stage schedule)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    stage = _stand_in()
    stage.reset_mock()
    stage.group_rank, stage.group_size, stage.num_stages = 0, pp, v * pp
    single = issubclass(cls, PipelineScheduleSingle)
    if single != (v == 1):
        raise ValueError(f"{cls.__name__} runs {'one stage' if single else 'two or more stages'} per rank, not {v}")
    order = cls(stage if single else [stage] * v, m).pipeline_order
    if order is None:
        raise ValueError(f"{cls.__name__} has no action list")
    return [order[r] for r in range(pp)]


@functools.lru_cache(maxsize=256)
def actions(schedule: str, pp: int, m: int, v: int = 1) -> tuple[tuple[Action, ...], ...]:
    """Per rank, PyTorch's actions of one step (``schedule``: gpipe, 1f1b, interleaved)."""
    from torch.distributed.pipelining import schedules as sch

    cls = {"gpipe": sch.ScheduleGPipe, "1f1b": sch.Schedule1F1B, "interleaved": sch.ScheduleInterleaved1F1B}[schedule]
    try:
        lists = _pipeline_order(_compute_only(cls), pp, m, v)
    except (ValueError, AssertionError) as e:
        raise SymacctError(
            f"PyTorch refuses the {schedule} schedule with pp={pp}, m={m}, v={v}: {e}",
            hint="change the micro-batches or the stages per rank",
        ) from e
    forward, backward = sch._ComputationType.FORWARD, sch._ComputationType.FULL_BACKWARD
    out = []
    for rank, acts in enumerate(lists):
        seen: dict[tuple[int, str], int] = defaultdict(int)
        row = []
        for a in acts:
            if a is None:
                continue
            ct = a.computation_type  # compared by identity: an enum's name is a Python-level lookup
            kind = "F" if ct is forward else "B" if ct is backward else None
            if kind is None:  # REDUCE_GRAD and other bookkeeping: no compute of its own here
                continue
            key = (a.stage_index, kind)
            row.append(Action(rank, a.stage_index, kind, seen[key]))
            seen[key] += 1
        for (stage, kind), n in seen.items():
            if n != m:
                raise SymacctError(
                    f"PyTorch's {schedule} list for rank {rank} runs {n} {kind} of stage {stage}, not m={m}",
                    hint="a schedule symacct cannot read",
                    internal=True,
                )
        out.append(tuple(row))
    return tuple(out)


def in_flight(acts: tuple[tuple[Action, ...], ...]) -> list[int]:
    """Per rank, the most (stage, micro-batch) activations held at once: forwards done, backwards not."""
    return list(_memo(acts, "in_flight", _in_flight))


def _in_flight(acts: tuple[tuple[Action, ...], ...]) -> tuple[int, ...]:
    peaks = []
    for row in acts:
        held = peak = 0
        for a in row:
            held += 1 if a.kind == "F" else -1
            peak = max(peak, held)
        peaks.append(peak)
    return tuple(peaks)


def makespan(
    acts: tuple[tuple[Action, ...], ...],
    duration: Callable[[Action], float],
    transfer: float = 0.0,
) -> tuple[float, list[float]]:
    """The step's time from first action to last, and each rank's busy time (see the module docstring).
    ``duration(a)`` depends on the action's kind and stage only (it is asked once for each)."""
    order, first = _memo(acts, "order", _order)
    took = [duration(a) for a in first]
    end = [0.0] * len(order)
    free = [0.0] * len(acts)
    busy = [0.0] * len(acts)
    for i, (r, dep, cross, k) in enumerate(order):
        ready = 0.0 if dep < 0 else end[dep] + (transfer if cross else 0.0)
        t = took[k]
        e = (free[r] if free[r] > ready else ready) + t
        end[i] = free[r] = e
        busy[r] += t
    return max(free), busy


_MEMO: dict[int, tuple[Any, dict[str, Any]]] = {}


def _memo(acts: tuple[tuple[Action, ...], ...], name: str, make: Callable[[Any], Any]) -> Any:
    """``make(acts)`` once per list (``actions`` caches the lists: kept by identity, hashing one costs)."""
    kept = _MEMO.get(id(acts))
    if kept is None or kept[0] is not acts:
        if len(_MEMO) >= 1024:  # a long session's lists: start again
            _MEMO.clear()
        kept = _MEMO[id(acts)] = (acts, {})
    if name not in kept[1]:
        kept[1][name] = make(acts)
    return kept[1][name]


def _order(acts: tuple[tuple[Action, ...], ...]) -> tuple[list[tuple[int, int, bool, int]], list[Action]]:
    """The order ``makespan`` runs the actions in, which the durations do not change: a rank runs its list
    in order, an action once its input is ready (the same micro-batch's forward on the stage before, its
    backward on the stage after, or its own forward on the last stage). Per action, in that order: its
    rank, the index of the action it waits on (-1: none), whether that ran on another stage, and its
    (kind, stage) class; and each class's first action."""
    n_stages = 1 + max(a.stage for row in acts for a in row)
    done: dict[tuple[int, str, int], int] = {}
    classes: dict[tuple[str, int], int] = {}
    first: list[Action] = []
    order: list[tuple[int, int, bool, int]] = []
    pos = [0] * len(acts)
    remaining = sum(len(r) for r in acts)
    while remaining:
        progressed = False
        for r, row in enumerate(acts):
            while pos[r] < len(row):
                a = row[pos[r]]
                if a.kind == "F":
                    dep = (a.stage - 1, "F", a.micro) if a.stage > 0 else None
                else:
                    dep = (a.stage + 1, "B", a.micro) if a.stage < n_stages - 1 else (a.stage, "F", a.micro)
                if dep is not None and dep not in done:
                    break
                k = classes.setdefault((a.kind, a.stage), len(classes))
                if k == len(first):
                    first.append(a)
                before = -1 if dep is None else done[dep]
                done[(a.stage, a.kind, a.micro)] = len(order)
                order.append((r, before, dep is not None and dep[0] != a.stage, k))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise SymacctError("the schedule's actions wait on each other", internal=True)
    return order, first


class Held(NamedTuple):
    """What a pipeline stage holds during one of its compute actions beyond the micro-batch in flight (its own
    ops' storages, the trace's): ``others``, micro-batches whose forward is done and backward is not (their
    saved activations); and what PyTorch's runtime keeps referenced that the trace does not: stage outputs
    (``outputs``: the send ops and works that hold them, a backward's ``stage_output``), input gradients
    waiting in ``bwd_cache`` or in send ops (``input_grads``), the last stage's losses (``losses``) and its
    outputs kept for ``step``'s return (``chunks``; a held micro-batch's too: the trace does not save logits).
    ``grads``: a backward ran before (the stage's gradients exist). ``kind`` 'end': after the last backward,
    while ``step`` merges the last stage's outputs (``merged`` of them, a new tensor). A tuple: a long
    schedule's points cost the garbage collector nothing once kept."""

    kind: str  # F | B | R (FSDP2: perform_reduce_grad) | end
    micro: int
    others: int
    outputs: int = 0
    input_grads: int = 0
    losses: int = 0
    chunks: int = 0
    grads: bool = False
    merged: int = 0


class _Runtime:
    """References PyTorch's runtime keeps during one ``step`` of a single-stage schedule (torch 2.13's
    ``PipelineStage`` and ``_step_microbatches``); objects are (kind, micro-batch): 'out' a stage output (on
    the last stage, its logits), 'ig' an input gradient, 'loss'. Each holder (a variable, a cache, a list)
    counts its references, so a point costs the same at any m."""

    def __init__(self, first: bool, last: bool, keep_outputs: bool, reduce_point: bool = False) -> None:
        self.first, self.last, self.keep = first, last, keep_outputs
        self.reduce_point = reduce_point  # a point 'R' at perform_reduce_grad (``reduce``)
        self.refs: dict[tuple[str, int], int] = defaultdict(int)
        self.alive: dict[str, int] = defaultdict(int)  # per kind: objects referenced at all
        self.vars: dict[str, tuple[tuple[str, int], ...]] = {}
        self.fwd_cache: dict[int, tuple[str, int]] = {}
        self.bwd_cache: dict[int, tuple[str, int]] = {}
        self.works: list[tuple[str, int]] = []  # what the send works kept in lists hold (GPipe)
        self.output_chunks = self.losses = 0  # the last stage's lists: kept after _step_microbatches returns
        self.points: list[Held] = []
        self.backwards = 0

    def _hold(self, *objs: tuple[str, int]) -> None:
        for o in objs:
            self.refs[o] += 1
            if self.refs[o] == 1:
                self.alive[o[0]] += 1

    def _drop(self, *objs: tuple[str, int]) -> None:
        for o in objs:
            self.refs[o] -= 1
            if self.refs[o] == 0:
                self.alive[o[0]] -= 1

    def assign(self, name: str, objs: tuple[tuple[str, int], ...]) -> None:
        """A variable of the schedule's code now refers to ``objs`` (what it referred to before let go)."""
        self._hold(*objs)
        self._drop(*self.vars.get(name, ()))
        self.vars[name] = objs

    def keep_works(self, objs: tuple[tuple[str, int], ...]) -> None:
        """Works kept in a list until ``_step_microbatches`` returns (a work holds its tensor)."""
        self._hold(*objs)
        self.works.extend(objs)

    def _point(self, kind: str, micro: int) -> None:
        # beside the micro-batch in flight: its own loss is the trace's (its output and input gradient are
        # made after a forward's point, its input gradient after a backward's); the held micro-batches'
        # outputs are their saved activations, except the last stage's logits (not saved)
        cached = len(self.fwd_cache)
        outs = self.alive["out"] - cached
        losses = self.alive["loss"] - (1 if kind == "B" and self.refs[("loss", micro)] else 0)
        self.points.append(
            Held(
                kind,
                micro,
                cached,
                outputs=0 if self.last else outs,
                input_grads=self.alive["ig"],
                losses=losses,
                chunks=outs + cached if self.last else 0,
                grads=self.backwards > 0,
            )
        )

    def forward(self, i: int) -> tuple[str, int]:
        self._point("F", i)
        out = ("out", i)
        self.fwd_cache[i] = out
        self._hold(out)
        if self.last and self.keep:  # output_chunks
            self._hold(out)
            self.output_chunks += 1
        if self.last:  # _internal_losses
            self._hold(("loss", i))
            self.losses += 1
        return out

    def backward(self, i: int) -> None:
        out = self.fwd_cache.pop(i)  # held by backward_one_chunk's stage_output while it runs
        self._point("B", i)
        self._drop(out)
        self.backwards += 1
        if not self.first:
            self.bwd_cache[i] = ("ig", i)
            self._hold(("ig", i))

    def fwd_sends(self, i: int) -> tuple[tuple[str, int], ...]:
        """``get_fwd_send_ops``: ops holding the output (a detached view of it) for the next stage."""
        return () if self.last else (self.fwd_cache[i],)

    def bwd_sends(self, i: int) -> tuple[tuple[str, int], ...]:
        """``get_bwd_send_ops``: pops the input gradient into the ops sending it to the previous stage."""
        if self.first:
            return ()
        ig = self.bwd_cache.pop(i)
        self._drop(ig)
        return (ig,)

    def reduce(self) -> None:
        """``perform_reduce_grad``, the last thing ``_step_microbatches`` runs (FSDP2's reduce-scatters, with
        the step's variables and works still referenced): a point 'R' when asked for (``runtime_holds``)."""
        if self.reduce_point:
            self._point("R", -1)

    def end(self) -> None:
        """``_step_microbatches`` returned (its variables and works let go); ``step`` merges the kept outputs."""
        for name in list(self.vars):
            self.assign(name, ())
        self._drop(*self.works)
        self.works.clear()
        kept = self.output_chunks
        self.points.append(Held("end", -1, 0, losses=self.losses, chunks=kept, grads=True, merged=kept))


def _gpipe(rt: _Runtime, m: int) -> None:
    """torch 2.13 ``ScheduleGPipe._step_microbatches``: every forward, then every backward; the send works
    are kept in lists until it returns (a work holds its tensor)."""
    for i in range(m):
        rt.assign("output", (rt.forward(i),))
        rt.assign("ops", rt.fwd_sends(i))
        rt.keep_works(rt.vars["ops"])  # fwd_sends_to_wait
    for i in range(m):
        rt.assign("ops", ())  # the receive ops: their buffers are the stage's own
        rt.backward(i)
        rt.assign("ops", rt.bwd_sends(i))
        rt.keep_works(rt.vars["ops"])  # bwd_sends_to_wait
    rt.reduce()
    rt.end()


def _one_f_one_b(rt: _Runtime, m: int, warmup: int) -> None:
    """torch 2.13 ``Schedule1F1B._step_microbatches``: ``warmup`` forwards, then one backward and one
    forward in turn, then the remaining backwards; ``send_work`` and the ops lists stay referenced until
    reassigned (a waited work still holds its tensor)."""
    f = b = 0
    for _ in range(warmup):
        rt.assign("output", (rt.forward(f),))
        rt.assign("fwd_sends", rt.fwd_sends(f))
        if f != warmup - 1:
            rt.assign("send_work", rt.vars["fwd_sends"])
        f += 1
    while True:
        rt.backward(b)
        rt.assign("bwd_sends", rt.bwd_sends(b))
        b += 1
        if f == m:
            break
        rt.assign("output", (rt.forward(f),))
        rt.assign("fwd_sends", rt.fwd_sends(f))
        f += 1
    rt.assign("send_work", rt.vars["bwd_sends"])
    while b < m:
        rt.backward(b)
        rt.assign("bwd_sends", rt.bwd_sends(b))
        rt.assign("send_work", rt.vars["bwd_sends"])
        b += 1
    rt.reduce()
    rt.end()


@functools.lru_cache(maxsize=512)
def runtime_holds(
    schedule: str, pp: int, m: int, stage: int, keep_outputs: bool = True, reduce: bool = False
) -> tuple[Held, ...]:
    """Per compute action of ``stage`` (in the order it runs them), then the step's end: what it holds
    beyond its micro-batch in flight (``Held``), as PyTorch's runtime runs ``schedule`` (gpipe or 1f1b, one
    stage per rank). ``keep_outputs``: ``step(return_outputs=True)``, PyTorch's default. ``reduce``: a point
    'R' before the end, where ``perform_reduce_grad`` runs (FSDP2's reduce-scatters)."""
    rt = _Runtime(stage == 0, stage == pp - 1, keep_outputs, reduce)
    if schedule == "gpipe":
        _gpipe(rt, m)
    elif schedule == "1f1b":
        _one_f_one_b(rt, m, min(m, pp - stage))
    else:
        raise SymacctError(f"no model of the runtime's references for the {schedule} schedule", internal=True)
    return tuple(rt.points)


class ChunkHeld(NamedTuple):
    """``Held`` for a rank of several stage chunks (the interleaved schedule): the chunk in flight (an index
    into the rank's chunks, ``pp_rank, pp_rank + pp, ...``; -1 at the end), per chunk the micro-batches held
    (forwarded, not yet backwarded; the one in flight left out) and whether a backward ran (its gradients
    exist), and what the runtime references beside them, as ``Held`` counts it."""

    kind: str  # F | B | R (FSDP2: perform_reduce_grad) | U (FSDP2: the UNSHARD's wait) | end
    chunk: int
    held: tuple[int, ...]
    grads: tuple[bool, ...]
    outputs: int = 0
    input_grads: int = 0
    losses: int = 0
    chunks: int = 0
    merged: int = 0


@functools.lru_cache(maxsize=512)
def interleaved_holds(
    pp: int, m: int, v: int, rank: int, keep_outputs: bool = True, reduce: bool = False, waits: bool = False
) -> tuple[ChunkHeld, ...]:
    """Per compute action of pipeline rank ``rank`` (in the order it runs them), then the step's end, what it
    holds beyond its micro-batch in flight, as torch 2.13's ``_PipelineScheduleRuntime._step_microbatches``
    runs ``ScheduleInterleaved1F1B``: every send's work is kept in ``send_ops`` until the step's end (a work
    holds its tensor), so each stage output a chunk sent (every chunk but the last stage's) and each input
    gradient it sent (every chunk but the first stage's) lives to the end; a chunk's output is also in its
    ``fwd_cache`` from its forward to its backward, which holds it while it runs; the last stage keeps its
    losses (``_internal_losses``) and, with ``keep_outputs``, its outputs (``output_chunks``) to the end,
    where ``step`` merges the outputs. The receive buffers are the stages' own (``Rank.runtime``). ``reduce``:
    a point 'R' after each chunk's last backward, where the runtime's REDUCE_GRAD action runs its
    ``perform_reduce_grad`` (FSDP2's reduce-scatters; ``_add_reduce_grad`` puts it there). ``waits``: a point
    'U' before every compute action, what the rank holds before it starts (a backward's micro-batch still in
    its chunk's ``fwd_cache``): where the runtime waits on the chunk's UNSHARD, if one is pending."""
    n = pp * v
    mine = list(range(rank, n, pp))
    chunk = {s: c for c, s in enumerate(mine)}
    held, grads = [0] * v, [False] * v
    fwd = [0] * v  # forwards done per chunk
    bwd = [0] * v
    points: list[ChunkHeld] = []

    def point(kind: str, c: int) -> None:
        outs = sum(fwd[i] - held[i] for i, s in enumerate(mine) if s != n - 1)
        igs = sum(bwd[i] for i, s in enumerate(mine) if s != 0)
        last = chunk.get(n - 1)
        losses = chunks = 0
        if last is not None:  # the last stage's logits: in fwd_cache, output_chunks, a running backward
            losses = fwd[last] - (1 if kind == "B" and c == last else 0)
            chunks = fwd[last] if keep_outputs else held[last] + (1 if kind == "B" and c == last else 0)
        points.append(ChunkHeld(kind, c, tuple(held), tuple(grads), outs, igs, losses, chunks))

    for a in actions("interleaved", pp, m, v)[rank]:
        c = chunk[a.stage]
        if waits:
            point("U", c)
        if a.kind == "F":
            point("F", c)
            fwd[c] += 1
            held[c] += 1
        else:
            held[c] -= 1  # popped from fwd_cache; the running backward holds it
            point("B", c)
            bwd[c] += 1
            grads[c] = True
            if reduce and bwd[c] == m:
                point("R", c)
    last = chunk.get(n - 1)
    kept = m if last is not None and keep_outputs else 0
    losses = m if last is not None else 0
    points.append(ChunkHeld("end", -1, (0,) * v, (True,) * v, 0, 0, losses, kept, kept))
    return tuple(points)


# FSDP2 over a stage, the kinds of compute action by what is unsharded when it starts (symacct.parallel.fsdp)
STAGE_KINDS = ("F0", "F", "Fw", "B", "Bw")


def stage_kinds(kinds: list[str], reshard: bool) -> list[str]:
    """The FSDP2 kind (``STAGE_KINDS``) of each of a stage's compute actions in order ('F' or 'B'; anything
    else passed through), from the blocks' state before it: unsharded after a backward (the stage sets
    ``reshard_after_backward`` False) and after a forward without ``reshard_after_forward``, resharded after
    a forward with it. A forward that finds them unsharded is 'Fw', else 'F' once the root is gathered (a forward
    ran) and 'F0' before; a backward that finds them unsharded 'Bw', else 'B'. (GPipe and 1F1B never run a
    forward after a forward after a backward; the interleaved schedule's chunks do, and gather again.)"""
    out: list[str] = []
    forwarded = unsharded = False
    for k in kinds:
        if k == "F":
            out.append("Fw" if unsharded else ("F" if forwarded else "F0"))
            forwarded, unsharded = True, not reshard
        elif k == "B":
            out.append("Bw" if unsharded else "B")
            unsharded = True
        else:
            out.append(k)
    return out


class FsdpPoint(NamedTuple):
    """A point of an interleaved rank whose stage chunks are FSDP2 modules: what the runtime holds (``ChunkHeld``),
    the FSDP2 kind of the chunk in flight's action (``symacct.parallel.fsdp.STAGE_KINDS``; 'U' the wait on its
    UNSHARD, 'R' its REDUCE_GRAD, 'end'), and each chunk's parameters then (``CHUNK_STATES``)."""

    held: ChunkHeld
    kind: str
    states: tuple[str, ...]


# a chunk's parameters at a point: sharded (before its first UNSHARD, and after a RESHARD evicted it; its
# unsharded gradients kept once a backward ran), its UNSHARD's all-gather outputs waiting (before the chunk's
# next compute action), the root unsharded (the blocks resharded after a forward), root and blocks unsharded,
# or resharded once its gradients are reduced (REDUCE_GRAD: the post-backward of every group,
# reshard_after_backward set)
CHUNK_STATES = ("sharded", "pending", "root", "all", "reduced")


@functools.lru_cache(maxsize=256)
def fsdp_lowering(pp: int, m: int, v: int, rank: int) -> tuple[tuple[str, int], ...]:
    """Pipeline rank ``rank``'s actions of ``ScheduleInterleaved1F1B`` with FSDP2 stage chunks as torch 2.13's
    ``_PipelineScheduleRuntime`` runs them: PyTorch's own lowering (``_add_unshard_reshard``, which keeps at most
    three chunks unsharded, prefetching the next ones to compute and evicting the others, then
    ``_add_reduce_grad``) of the class's compute order. Each action as (kind, the rank's chunk index); kind: F,
    B, UNSHARD, RESHARD or REDUCE_GRAD.

    Up to v = 3 the lowering is written out directly (``_lowering_up_to_three``), which
    ``tests/test_parallel.py`` compares with PyTorch's action for action: ``_add_unshard_reshard`` rescans the
    rest of the list at every action, seconds over a planner's long schedules."""
    if v <= 3:
        return _lowering_up_to_three(pp, m, v, rank)
    from torch.distributed.pipelining import schedules as sch

    order = _pipeline_order(_compute_only(sch.ScheduleInterleaved1F1B), pp, m, v)[rank]
    names = {
        sch.FORWARD: "F",
        sch.FULL_BACKWARD: "B",
        sch.UNSHARD: "UNSHARD",
        sch.RESHARD: "RESHARD",
        sch.REDUCE_GRAD: "REDUCE_GRAD",
    }
    out = []
    for a in sch._add_reduce_grad(sch._add_unshard_reshard(order), m):
        if a is None:
            continue
        kind = names.get(a.computation_type)
        if kind is None:
            raise SymacctError(f"torch's FSDP lowering has an action symacct cannot read: {a}", internal=True)
        out.append((kind, (a.stage_index - rank) // pp))
    return tuple(out)


def _lowering_up_to_three(pp: int, m: int, v: int, rank: int) -> tuple[tuple[str, int], ...]:
    """``fsdp_lowering`` of a rank of at most three chunks: every chunk is among the next three to compute from
    the first action on, so each is unsharded before it (in the order of the chunks' first actions) and
    evicted before the first action after its last one (or at the end), each REDUCE_GRAD right after the
    chunk's last backward."""
    acts = actions("interleaved", pp, m, v)[rank]
    chunks = [(a.stage - rank) // pp for a in acts]
    last = {c: i for i, c in enumerate(chunks)}
    backwards = Counter(c for a, c in zip(acts, chunks, strict=True) if a.kind == "B")
    active = list(dict.fromkeys(chunks))
    out = [("UNSHARD", c) for c in active]
    for i, (a, c) in enumerate(zip(acts, chunks, strict=True)):
        for gone in sorted(k for k in active if last[k] < i):
            out.append(("RESHARD", gone))
            active.remove(gone)
        out.append((a.kind, c))
        if a.kind == "B":
            backwards[c] -= 1
            if backwards[c] == 0:
                out.append(("REDUCE_GRAD", c))
    return tuple(out + [("RESHARD", c) for c in sorted(active)])


@functools.lru_cache(maxsize=512)
def interleaved_fsdp_points(
    pp: int, m: int, v: int, rank: int, keep_outputs: bool, reshard: bool
) -> tuple[FsdpPoint, ...]:
    """The points of pipeline rank ``rank`` of ``ScheduleInterleaved1F1B`` with FSDP2 over each stage chunk's
    module, as torch 2.13's runtime runs its lowering (``fsdp_lowering``): an UNSHARD all-gathers every group
    of a chunk at once (``unshard(async_op=True)``, its outputs allocated then); the chunk's next compute action
    waits on it (point 'U': each group copied out, its output then freed), so it finds root and blocks
    unsharded ('Fw', 'Bw'); each later action as ``stage_kinds`` has it (each forward's post-forward reshards
    the blocks with ``reshard_after_forward``, a backward keeps them: the stage sets ``reshard_after_backward``
    False); a RESHARD reshards every group (its unsharded gradients kept: they are the parameters' ``.grad``);
    after its last backward, REDUCE_GRAD (point 'R') reduce-scatters and reshards every group of the chunk. Up
    to v = 3 every chunk is unsharded before the rank's first action and resharded after its last; with more,
    chunks are evicted and gathered again within the step, before forwards and before backwards."""
    holds = iter(interleaved_holds(pp, m, v, rank, keep_outputs, reduce=True, waits=True))
    state = ["sharded"] * v
    out: list[FsdpPoint] = []
    for kind, c in fsdp_lowering(pp, m, v, rank):
        if kind == "UNSHARD":
            state[c] = "pending"
        elif kind == "RESHARD":
            state[c] = "reduced" if state[c] == "reduced" else "sharded"
        elif kind == "REDUCE_GRAD":
            h = next(holds)
            _same_action(h, "R", c)
            out.append(FsdpPoint(h, "R", tuple(state)))
            state[c] = "reduced"
        else:
            wait, h = next(holds), next(holds)
            _same_action(wait, "U", c)
            _same_action(h, kind, c)
            if state[c] == "pending":
                out.append(FsdpPoint(wait, "U", tuple(state)))
                state[c] = "all"
            if state[c] not in ("all", "root"):
                raise SymacctError(f"torch's lowering computes on chunk {c} while it is {state[c]}", internal=True)
            out.append(FsdpPoint(h, kind + ("w" if state[c] == "all" else ""), tuple(state)))
            state[c] = "all" if kind == "B" or not reshard else "root"
    end = next(holds)
    _same_action(end, "end", -1)
    out.append(FsdpPoint(end, "end", tuple(state)))
    return tuple(out)


def _same_action(h: ChunkHeld, kind: str, chunk: int) -> None:
    """``interleaved_holds`` and ``fsdp_lowering`` walk the same compute actions."""
    if (h.kind, h.chunk) != (kind, chunk):
        raise SymacctError(
            f"the FSDP lowering's {kind} of chunk {chunk} meets the schedule's {h.kind} of chunk {h.chunk}",
            internal=True,
        )


@functools.lru_cache(maxsize=512)
def chunk_gathers(pp: int, m: int, v: int, rank: int, reshard: bool) -> tuple[int, int]:
    """All-gathers of one block of each of the rank's chunks per step, summed over its chunks, in forward and in
    backward (``interleaved_fsdp_points``): each UNSHARD's (in the phase of the action that waits on it), each
    forward after a forward with ``reshard_after_forward``, each backward after a forward. A chunk's root
    is gathered by its UNSHARDs alone (``chunk_unshards``)."""
    fwd = bwd = 0
    for _p, kind in _waits_read(interleaved_fsdp_points(pp, m, v, rank, True, reshard)):
        if kind in ("F", "UF"):
            fwd += 1
        elif kind in ("B", "UB"):
            bwd += 1
    return fwd, bwd


@functools.lru_cache(maxsize=512)
def chunk_unshards(pp: int, m: int, v: int, rank: int, chunk: int) -> tuple[int, int]:
    """The UNSHARDs of the rank's chunk ``chunk`` per step waited on by a forward and by a backward: its
    root's all-gathers (no post-forward reshards a root)."""
    kinds = [k for p, k in _waits_read(interleaved_fsdp_points(pp, m, v, rank, True, True)) if p.held.chunk == chunk]
    return kinds.count("UF"), kinds.count("UB")


def _waits_read(points: tuple[FsdpPoint, ...]) -> list[tuple[FsdpPoint, str]]:
    """Each point with its FSDP2 kind, a wait 'U' as 'UF' or 'UB' by the compute action that follows it."""
    out = []
    for i, p in enumerate(points):
        kind = p.kind
        if kind == "U":
            kind += points[i + 1].kind[0]
        out.append((p, kind))
    return out
