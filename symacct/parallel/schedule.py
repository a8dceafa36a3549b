"""Pipeline schedules from PyTorch's own action lists: micro-batches in flight per rank and the step's makespan.

The lists come from ``torch.distributed.pipelining``'s schedule classes (``pipeline_order``, as the schedule
visualizer reads them), with no process group. In torch 2.13 ``Schedule1F1B``'s list numbers the last rank's
forwards from 1 (``F1 ... F8`` for 8 micro-batches: an off-by-one of the visual IR, not of the runtime,
which runs the micro-batches of a stage in order), so each stage's forwards and backwards are renumbered
0, 1, ... in the order they appear; the counts and the order are PyTorch's.

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


@functools.lru_cache(maxsize=256)
def actions(schedule: str, pp: int, m: int, v: int = 1) -> tuple[tuple[Action, ...], ...]:
    """Per rank, PyTorch's actions of one step (``schedule``: gpipe, 1f1b, interleaved)."""
    from torch.distributed.pipelining import schedules as sch
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    cls = {"gpipe": sch.ScheduleGPipe, "1f1b": sch.Schedule1F1B, "interleaved": sch.ScheduleInterleaved1F1B}[schedule]
    try:
        lists = get_schedule_ops(_compute_only(cls), pp, m, v if schedule == "interleaved" else None)
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
    peaks = []
    for row in acts:
        held = peak = 0
        for a in row:
            held += 1 if a.kind == "F" else -1
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def makespan(
    acts: tuple[tuple[Action, ...], ...],
    duration: Callable[[Action], float],
    transfer: float = 0.0,
) -> tuple[float, list[float]]:
    """The step's time from first action to last, and each rank's busy time (see the module docstring).
    ``duration(a)`` depends on the action's kind and stage only (it is asked once for each)."""
    n_stages = 1 + max(a.stage for row in acts for a in row)
    done: dict[tuple[int, str, int], float] = {}
    free = [0.0] * len(acts)
    pos = [0] * len(acts)
    busy = [0.0] * len(acts)
    remaining = sum(len(r) for r in acts)
    took: dict[tuple[str, int], float] = {}
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
                ready = 0.0 if dep is None else done[dep] + (transfer if dep[0] != a.stage else 0.0)
                t = took.get((a.kind, a.stage))
                if t is None:
                    t = took[(a.kind, a.stage)] = duration(a)
                end = max(free[r], ready) + t
                done[(a.stage, a.kind, a.micro)] = end
                free[r] = end
                busy[r] += t
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise SymacctError("the schedule's actions wait on each other", internal=True)
    return max(free), busy
