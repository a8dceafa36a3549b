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
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
    out = []
    for rank, acts in enumerate(lists):
        seen: dict[tuple[int, str], int] = defaultdict(int)
        row = []
        for a in acts:
            if a is None:
                continue
            kind = {"FORWARD": "F", "FULL_BACKWARD": "B"}.get(a.computation_type.name)
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
