"""Reserved bytes: the derived live-storage timeline replayed through the caching-allocator model.

The timeline is the step's storages with their lifetimes and byte formulas (``liveness.Intervals``) for
a model with the number of blocks asked for: the trace with that many blocks at the probe's sizes (its
formulas read as the first trace's are), so that every allocation and free is in the order eager
PyTorch makes them. At given sizes each storage becomes one request (``symacct.memory.allocator``):

- before the step: parameters, buffers and the step's inputs, in the order the trace met them;
- op by op: the storages an op makes, in the order it made them, after the frees of the storages that
  died before it;
- at the step's end, what the caller still holds (the output, the loss) is freed (``del`` in a
  training loop); optimizer states made by the first step stay, and later steps do not make them again;
- ``warmup``: one forward and backward first, everything it made then freed (``measure_cuda_steps``
  runs one, so that the CUDA libraries' workspaces exist before it measures);
- ``workspace``: the cuBLAS workspace, handed out by the same allocator at the first matmul and kept
  (``Accelerator.cublas_workspace``).

Beside the allocator, ``Reserved.context`` is the CUDA context of the named GPU
(``Accelerator.cuda_context``, a published figure with its source): device memory nvidia-smi counts and
``max_memory_reserved`` does not; ``Reserved.device_peak`` adds it to the reserved peak.

The caching allocator only ever reserves more, so ``reserved_peak`` is the reserved bytes at the end.
What the timeline leaves out, the model cannot see: kernels' own scratch memory from the allocator
(cuDNN, some reductions). A step derived on the CPU stands for the same step on a GPU: every storage is
counted, AdamW's step counters too (4 bytes each, a 512-byte block here), which a CUDA run keeps on the
CPU and a step derived with ``device="cuda"`` leaves out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from symacct.memory.allocator import CachingAllocator, Event, Stats, replay
from symacct.memory.liveness import Intervals
from symacct.symbols import integer_form
from symacct.trace.record import StepTrace

# the ops that call cuBLAS (its workspace is made at the first one)
CUBLAS_OPS = frozenset(
    f"aten.{name}.{overload}"
    for name in ("mm", "addmm", "bmm", "baddbmm", "addbmm", "_addmm_activation", "addmv", "mv", "dot")
    for overload in ("default", "out")
)


@dataclass(frozen=True)
class Timeline:
    """One step's storages and lifetimes (``Intervals``) with what the replay needs of the trace."""

    intervals: Intervals
    order: dict[int, int]  # storage -> the order the trace met it (allocations at one position follow it)
    states: frozenset[int]  # optimizer states, made by the first step only
    phases: tuple[str, ...]  # each op's phase
    ops: tuple[str, ...]  # each op's name

    @classmethod
    def of(cls, trace: StepTrace, iv: Intervals, device: str = "cpu") -> Timeline:
        """The timeline of ``trace``; on a CUDA step without the storages it keeps on the CPU (the caching
        allocator never sees them)."""
        if device != "cpu":
            kept = [st for st in iv.start if trace.storage_device.get(st) != "cpu"]
            iv = Intervals(
                iv.n,
                {st: iv.start[st] for st in kept},
                {st: iv.end[st] for st in kept},
                {st: iv.nbytes[st] for st in kept},
            )
        order: dict[int, int] = {}
        for ph in trace.placeholders:
            order.setdefault(ph.meta.storage, len(order))
        for st in sorted(trace.external_storages):
            order.setdefault(st, len(order))
        for rec in trace.ops:
            for m in (*rec.inputs, *rec.outputs, *rec.mutated):
                order.setdefault(m.storage, len(order))
        for st in iv.start:
            order.setdefault(st, len(order))
        return cls(
            iv,
            order,
            frozenset(trace.state_storages),
            tuple(r.phase for r in trace.ops),
            tuple(str(r.op) for r in trace.ops),
        )


@dataclass(frozen=True)
class Reserved:
    """What the caching allocator holds over the replayed steps (bytes)."""

    allocated_peak: int  # torch.cuda.max_memory_allocated()
    reserved_peak: int  # torch.cuda.max_memory_reserved()
    requested_peak: int  # the live storages' own bytes at their largest (the derived peak, without rounding)
    segments: tuple[int, ...]  # each segment reserved, in order
    workspace: int  # the cuBLAS workspace counted in the figures above
    steps: int
    warmup: bool
    # the CUDA context and its modules, outside the allocator (``Accelerator.cuda_context``; 0: no GPU named)
    context: int = 0

    @property
    def device_peak(self) -> int:
        """The device memory the process holds at its peak, as nvidia-smi shows it: what the allocator reserved
        plus the CUDA context."""
        return self.reserved_peak + self.context

    @classmethod
    def of(cls, stats: Stats, workspace: int, steps: int, warmup: bool, context: int = 0) -> Reserved:
        return cls(
            stats.peak_allocated,
            stats.peak_reserved,
            stats.peak_requested,
            tuple(stats.segments),
            workspace,
            steps,
            warmup,
            context,
        )


def events(
    tl: Timeline, values: Mapping[str, int], *, steps: int = 1, warmup: bool = False, workspace: int = 0
) -> list[Event]:
    """The allocations and frees of ``steps`` training steps at ``values`` (see the module docstring)."""
    iv = tl.intervals
    n = iv.n
    nbytes = {}
    cache: dict[object, int] = {}
    for st, e in iv.nbytes.items():
        if e not in cache:
            cache[e] = int(integer_form(e)(dict(values)))
        nbytes[st] = cache[e]
    external = sorted((st for st, s in iv.start.items() if s < 0), key=tl.order.__getitem__)
    out: list[Event] = [("alloc", ("external", st), nbytes[st]) for st in external]
    first_matmul = next((t for t, op in enumerate(tl.ops) if op in CUBLAS_OPS), None)

    def one(tag: object, cut: int, made_states: bool, with_workspace: bool) -> None:
        """Ops [0, cut) of the step; what is alive at the end of them is freed there, but states."""
        timed: list[tuple[float, int, Event]] = []
        for st, s in iv.start.items():
            if s < 0 or s >= cut or (made_states and st in tl.states):
                continue
            key = ("state", st) if st in tl.states else (tag, st)
            timed.append((s, tl.order[st], ("alloc", key, nbytes[st])))
            if st not in tl.states:
                end = iv.end[st]
                timed.append((end if end < cut else cut, 0, ("free", key, 0)))
        if with_workspace and first_matmul is not None and first_matmul < cut:
            # inside the first matmul, after its output: at::cuda::blas takes the handle's workspace then
            timed.append((first_matmul, len(tl.order), ("alloc", ("workspace",), workspace)))
        timed.sort(key=lambda x: (x[0], x[1]))
        out.extend(e for _, _, e in timed)

    if warmup:
        cut = next((t for t, ph in enumerate(tl.phases) if ph == "optimizer"), n)
        one("warmup", cut, made_states=False, with_workspace=workspace > 0)
    for k in range(1, steps + 1):
        one(k, n + 3, made_states=k > 1, with_workspace=workspace > 0 and not warmup and k == 1)
    return out


def replay_steps(
    tl: Timeline,
    values: Mapping[str, int],
    *,
    steps: int = 1,
    warmup: bool = False,
    workspace: int = 0,
    context: int = 0,
) -> Reserved:
    """The caching allocator after ``steps`` steps of this timeline at ``values``; ``context`` (the CUDA
    context's bytes, outside the allocator) is carried along for ``Reserved.device_peak``."""
    if steps < 1:
        raise ValueError("steps must be >= 1")
    alloc = replay(events(tl, values, steps=steps, warmup=warmup, workspace=workspace), CachingAllocator())
    return Reserved.of(alloc.stats, workspace, steps, warmup, context)
