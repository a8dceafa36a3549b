"""What PyTorch itself counts and holds on a real step: the independent side of every check.

These helpers run a real step (on whatever device the model is) and report
PyTorch's own numbers: matmul FLOPs from ``torch.utils.flop_counter``
(forward and backward separately) and the bytes autograd saves for backward
seen through ``saved_tensors_hooks``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from symacct.trace import versions
from symacct.trace.counted import FLASH_CPU, FLASH_CPU_BACKWARD, counted_flops
from symacct.trace.record import no_cycle_collection
from symacct.trace.saved import composing


def _no_storage(t: torch.Tensor) -> bool:
    """A tensor that holds no memory of its own: a fake tensor (DTensor learns an output's global shape by
    running the op on fake tensors), or a wrapper subclass (the functional collectives' AsyncCollectiveTensor,
    a DTensor) whose storage is a placeholder reporting its size: the data lives in the tensor it wraps."""
    return isinstance(t, FakeTensor) or is_traceable_wrapper_subclass(t)


def dtensor_op(types: Any) -> bool:
    """Whether a dispatch mode sees a DTensor op: returning NotImplemented for it lets DTensor's own dispatch
    run, and the mode then sees the ops on the rank's shards (and DTensor's collectives)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a build without torch.distributed
        return False
    return any(issubclass(t, DTensor) for t in types)


def _storage_refs(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _settle_collective(func: Any, out: Any, held: list[tuple[torch.Tensor, int, int]], timeout_s: float = 10.0) -> None:
    """Wait for a functional collective ``func`` just issued, and until its process group has let go of its
    tensors. A real backend's worker thread (gloo's) drops its hold on a finished collective an instant after
    the waiter wakes, so live bytes read right after a later op would race with that thread: a buffer the
    program has released (the collective's input, its output) could still show as held. Settled at issue,
    a real run's live bytes follow program order, as a derivation does. Once the group lets go, a fresh
    output is held by this frame alone, and its storage by that tensor alone (a view the group keeps would
    share it), and each input (``held``: the tensors with their holds before the call, ``_holds``) is back
    to the holds it had: after an all-reduce on gloo whose output had been let go, a buffer of its input's
    size was seen still held, about once in 6000 rounds on a loaded machine. With one check, an all-reduce's
    output was still seen held after it (under load, about once in 6,000 all-reduces), and then only Python's
    cycle collector freed it, its Python object having outlived the program's last reference; the cause was
    not found, so the group counts as done only after three checks in a row, 0.1 ms apart, find no hold
    (no such miss in 150 runs of 400 rounds under the same load). In-place collectives (but c10d's
    broadcast, ``_coalesced_broadcast``) and the wait itself are left alone; a group that never lets go is
    waited for ``timeout_s`` at most."""
    if _coalesced_broadcast(func):  # waited for here; its caller waits again, at once
        out[1].wait()
        outs: list[torch.Tensor] = []
    else:
        if func.namespace != "_c10d_functional" or func._schema.is_mutable:
            return
        if func.overloadpacket.__name__ in ("wait_tensor", "_wrap_tensor_autograd"):
            return
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and not _no_storage(t)]
        for t in outs:
            torch.ops._c10d_functional.wait_tensor(t)
    alone = _storage_refs(torch.empty(1))  # a tensor's own hold, with the one the query takes

    def holding() -> bool:
        return any(t._use_count() > 1 or _storage_refs(t) > alone for t in outs) or any(
            t._use_count() > uses or _storage_refs(t) > refs for t, uses, refs in held
        )

    deadline = time.monotonic() + timeout_s
    quiet = 0  # consecutive checks that found no hold: a hold can come back an instant after it went
    while quiet < 3 and time.monotonic() < deadline:
        quiet = 0 if holding() else quiet + 1
        time.sleep(1e-4)


def _coalesced_broadcast(func: Any) -> bool:
    """c10d's in-place broadcast, which DDP's buffer broadcast issues (``broadcast_coalesced``) on a flat
    copy of the buffers and waits for at once: settled as a functional collective is, else the copy, freed
    by its caller right after, shows as held by gloo's worker thread an instant longer (a few KB too much
    at the next ops, seen in two runs of seven). Other in-place collectives (DDP's bucket all-reduces, a
    pipeline's sends and receives) are waited for later by design, and left alone."""
    return func.namespace == "c10d" and func.overloadpacket.__name__ == "broadcast_"


def _gloo_reduce_scatter(func: Any) -> bool:
    """c10d's reduce-scatter of one tensor. Gloo runs it as an all-reduce of a flat copy of the input that the
    backend makes out of a dispatch mode's sight, then splits that copy (an ``aten.split`` seen right after
    the collective) and copies the rank's chunk out: the storage first seen through that split is the
    backend's buffer, which NCCL (reducing in place into the output) does not have, and is not counted (it
    was the peak of a pipeline stage under FSDP2, whose reduce-scatters come at the step's end)."""
    names = ("_reduce_scatter_base_", "reduce_scatter_tensor_")
    return func.namespace == "c10d" and func.overloadpacket.__name__ in names


def _holds(func: Any, args: Any, kwargs: Any) -> list[tuple[torch.Tensor, int, int]]:
    """A functional collective's input tensors with the holds on them before the call (``_settle_collective``
    waits until the process group has dropped the ones it took); c10d's broadcast's likewise."""
    if func.namespace != "_c10d_functional" and not _coalesced_broadcast(func):
        return []
    ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and not _no_storage(t)]
    return [(t, t._use_count(), _storage_refs(t)) for t in ins]


@dataclass
class Measured:
    flops_forward: int
    flops_backward: int
    saved_bytes: int  # distinct storages saved for backward, params and inputs excluded
    # the CPU flash-attention kernel, which FlopCounterMode counts as 0: its FLOPs by flop_counter's own SDPA
    # formulas (sdpa_flop_count, sdpa_backward_flop_count) from the shapes of each call, per phase (the
    # backward's include a forward kernel run again by activation checkpointing)
    flash_forward: int = 0
    flash_backward: int = 0
    # grouped matmuls (a mixture of experts' routed tokens), which FlopCounterMode counts as 0 too: counted
    # group by group from the offsets the kernel was given (the real routing), per phase
    grouped_forward: int = 0
    grouped_backward: int = 0

    @property
    def flops_total(self) -> int:
        return self.flops_forward + self.flops_backward


class CpuFlashCounter(TorchDispatchMode):
    """FLOPs of ``_scaled_dot_product_flash_attention_for_cpu`` and its backward, which FlopCounterMode leaves
    out, with flop_counter's own formulas (the backward's five products include the recomputed scores).
    ``total`` sums every call made while the mode is active (one mode per phase)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if dtensor_op(types):
            return NotImplemented  # a sharded call (context parallelism's ring): its local kernels come back here
        if func in _FLASH:
            self.total += counted_flops(func, args, kwargs, None) or 0
        return func(*args, **(kwargs or {}))


class LocalFlopCounter(CpuFlashCounter):
    """A sharded rank's own FLOPs: FlopCounterMode's formulas (its registry) on the local ops only, the CPU
    flash kernel's calls with them. FlopCounterMode counts a DTensor op at its global shapes (a
    tensor-parallel matmul as the whole model's); here a DTensor op passes through and its local kernels come
    back, so each rank counts its shards' work (not DTensor's shape propagation on fake tensors). An op
    outside the registry is decomposed as FlopCounterMode does, else counts 0."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        from torch.utils.flop_counter import flop_registry

        kwargs = kwargs or {}
        if dtensor_op(types) or func in _QUERIES:
            return NotImplemented
        if any(isinstance(t, FakeTensor) for t in tree_flatten((args, kwargs))[0]):
            return func(*args, **kwargs)  # DTensor's shape propagation on global-shape fake tensors: no work
        packet = func._overloadpacket
        if packet not in flop_registry and func not in _FLASH:
            with self:
                out = func.decompose(*args, **kwargs)
                if out is not NotImplemented:
                    return out
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if packet in flop_registry:
            self.total += flop_registry[packet](*args, **kwargs, out_val=out)
        return out


_FLASH = {FLASH_CPU, FLASH_CPU_BACKWARD}
_QUERIES = {  # metadata queries, not computation (FlopCounterMode's list)
    torch.ops.aten.sym_is_contiguous.default,
    torch.ops.aten.is_contiguous.default,
    torch.ops.aten.is_contiguous.memory_format,
    torch.ops.aten.is_strides_like_format.default,
    torch.ops.aten.is_non_overlapping_and_dense.default,
    torch.ops.aten.size.default,
    torch.ops.aten.sym_size.default,
    torch.ops.aten.stride.default,
    torch.ops.aten.sym_stride.default,
    torch.ops.aten.storage_offset.default,
    torch.ops.aten.sym_storage_offset.default,
    torch.ops.aten.numel.default,
    torch.ops.aten.sym_numel.default,
    torch.ops.aten.dim.default,
    torch.ops.prim.layout.default,
}


def group_sizes(offs: torch.Tensor) -> list[int]:
    """The rows of each group of a grouped matmul, from its offsets (each group's end)."""
    ends = [int(x) for x in offs.tolist()]
    return [e - s for s, e in zip([0, *ends[:-1]], ends)]


def grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> list[int]:
    """FLOPs of one ``_grouped_mm`` call, group by group over the real offsets (2 per multiply-add).

    (M, K) rows by 3-d (G, K, N) weights: group g's n_g rows by its matrix. Two 2-d operands, (M, K) by
    (K, N) cut along K (the weight gradient): group g multiplies M x n_g by n_g x N. 3-d (G, M, K) by 2-d
    (K, N) cut along N. Two 3-d operands: a batched matmul, one group per matrix. Rows past the last offset
    are skipped, as the kernel skips them.
    """
    if offs is None:
        return [2 * a.shape[1] * a.shape[2] * b.shape[-1]] * a.shape[0]
    sizes = group_sizes(offs)
    if a.dim() == 2 and b.dim() == 3:
        return [2 * n * a.shape[1] * b.shape[2] for n in sizes]
    if a.dim() == 2:
        return [2 * a.shape[0] * n * b.shape[1] for n in sizes]
    return [2 * a.shape[1] * a.shape[2] * n for n in sizes]


class GroupedMmCounter(TorchDispatchMode):
    """FLOPs of ``aten._grouped_mm`` (FlopCounterMode leaves it out), group by group from the real offsets:
    what the routed experts did, whatever the routing (``grouped_mm_flops``). ``per_group`` sums each
    group's (expert's) FLOPs over the calls; ``rows`` lists the rows of each group of every call with 3-d
    weights (its (token, expert) pairs)."""

    def __init__(self) -> None:
        super().__init__()
        self.per_group: list[int] = []
        self.rows: list[list[int]] = []

    @property
    def total(self) -> int:
        return sum(self.per_group)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func is torch.ops.aten._grouped_mm.default:
            kw = kwargs or {}
            a, b = args[0], args[1]
            offs = args[2] if len(args) > 2 else kw.get("offs")
            flops = grouped_mm_flops(a, b, offs)
            if len(self.per_group) < len(flops):
                self.per_group += [0] * (len(flops) - len(self.per_group))
            for g, f in enumerate(flops):
                self.per_group[g] += f
            if offs is not None and a.dim() == 2 and b.dim() == 3:
                self.rows.append(group_sizes(offs))
        return func(*args, **(kwargs or {}))


Args = tuple[Any, ...] | dict[str, Any]  # positional inputs, or keyword inputs (transformers' input_ids=...)


def _tensors(args: Args) -> list[torch.Tensor]:
    return [a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)]


def _call(model: nn.Module, args: Args) -> Any:
    return model(**args) if isinstance(args, dict) else model(*args)


def _autocast(dtype: torch.dtype | None, args: Args) -> Any:
    if dtype is None:
        return contextlib.nullcontext()
    device = next((a.device.type for a in _tensors(args)), "cpu")
    return torch.autocast(device_type=device, dtype=dtype)


@contextlib.contextmanager
def _mode(model: nn.Module, train: bool) -> Iterator[None]:
    """The model in train (or eval) mode for the step, each module's own mode given back afterwards: measuring
    leaves the caller's model as it was (one in eval mode is in eval mode again after a training step)."""
    was = [(m, m.training) for m in model.modules()]
    model.train(train)
    try:
        yield
    finally:
        for m, training in was:
            m.training = training


def measure_step(
    model: nn.Module,
    args: Args,
    loss: Callable[[Any], torch.Tensor] | None = None,
    autocast: torch.dtype | None = None,
) -> Measured:
    """Run one real training step (forward under ``autocast`` if given, then backward) and count, with the model
    in train mode (each module's own mode given back afterwards)."""
    with _mode(model, True):
        return _measure_step(model, args, loss, autocast)


def _measure_step(
    model: nn.Module, args: Args, loss: Callable[[Any], torch.Tensor] | None, autocast: torch.dtype | None
) -> Measured:
    external = {p.untyped_storage().data_ptr() for p in model.parameters()}
    external |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    external |= {a.untyped_storage().data_ptr() for a in _tensors(args)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in external:
            saved[st.data_ptr()] = st.nbytes()
        return t

    keep: list[torch.Tensor] = []  # saved tensors stay alive until backward, so data_ptr is unique

    def pack_keep(t: torch.Tensor) -> tuple[torch.Tensor, int]:
        keep.append(t)
        return versions.pack(pack(t))

    fwd, flash_fwd, grouped_fwd = FlopCounterMode(display=False), CpuFlashCounter(), GroupedMmCounter()
    hooks = torch.autograd.graph.saved_tensors_hooks(pack_keep, versions.unpack)  # PyTorch's in-place check
    with fwd, flash_fwd, grouped_fwd, hooks, composing(pack), _autocast(autocast, args):  # the model's own hooks
        out = _call(model, args)
        value = loss(out) if loss is not None else out
    bwd, flash_bwd, grouped_bwd = FlopCounterMode(display=False), CpuFlashCounter(), GroupedMmCounter()
    with bwd, flash_bwd, grouped_bwd:
        value.backward()  # with checkpointing, the forward's kernels run again here
    keep.clear()
    return Measured(
        fwd.get_total_flops(),
        bwd.get_total_flops(),
        sum(saved.values()),
        flash_fwd.total,
        flash_bwd.total,
        grouped_fwd.total,
        grouped_bwd.total,
    )


class StorageTracker(TorchDispatchMode):
    """Live bytes of a real step on any device, by storage: what eager really holds.

    Every storage an op returns is registered with a weak reference; a storage
    is live until PyTorch frees it. ``current()`` sums the live storages;
    ``peak`` is the largest sum seen right after an op (its inputs and its
    outputs both alive).
    """

    def __init__(self, initial: list[torch.Tensor]) -> None:
        """``initial``: what is alive before (with what a C++ owner holds, such as DDP's gradient buckets: a
        copy into one shows its storage, which must then not count as new)."""
        super().__init__()
        from torch.multiprocessing.reductions import StorageWeakRef

        self._ref = StorageWeakRef
        self._reduced = False  # the last op was c10d's reduce-scatter (``_gloo_reduce_scatter``)
        self.live: dict[int, tuple[Any, int]] = {}
        for t in initial:
            self._add(t)
        self.peak = self.current()

    def _add(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key not in self.live:
            self.live[key] = (self._ref(st), st.nbytes())

    def current(self) -> int:
        """Bytes of the live storages now: read again, since code may resize a storage it keeps (FSDP2 frees
        its gathered parameters with ``untyped_storage().resize_(0)`` and regrows them for the next use)."""
        live, dead = 0, []
        for k, (ref, _) in self.live.items():
            # a storage another thread lets go of (gloo's worker) can expire between a check and the read
            st = None if ref.expired() else torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            if st is None:
                dead.append(k)
            else:
                live += st.nbytes()
        for k in dead:
            del self.live[k]
        return live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if dtensor_op(types):
            return NotImplemented  # DTensor runs it on the shards, seen here
        held = _holds(func, args, kwargs)
        out = func(*args, **(kwargs or {}))
        _settle_collective(func, out, held)
        backend = self._reduced and func is torch.ops.aten.split.Tensor  # gloo's split of its own flat copy
        self._reduced = _gloo_reduce_scatter(func) or (self._reduced and func is torch.ops.aten.split.Tensor)
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not _no_storage(t):
                if backend and t.untyped_storage()._cdata not in self.live:
                    continue
                self._add(t)
        self.peak = max(self.peak, self.current())
        return out


@dataclass
class MeasuredMemory:
    params: int
    grads: int
    optimizer: int
    after_forward: int
    after_backward: int
    after_optimizer: int  # after step() and zero_grad(set_to_none=True)
    peak: int


def _distinct_nbytes(ts: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in ts:
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def measure_memory(
    model: nn.Module,
    args: Args,
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
    loss: Callable[[Any], torch.Tensor] | None = None,
    autocast: torch.dtype | None = None,
    step: str = "train",
) -> MeasuredMemory:
    """Run one real step and measure its memory.

    ``step="train"``: forward (under ``autocast`` if given), backward, the
    optimizer step and ``zero_grad(set_to_none=True)``; ``step="forward"``:
    the forward under ``torch.no_grad()`` (the other phase points are then
    the after-forward value, and grads and optimizer 0).
    """
    if step != "forward":
        return measure_memory_steps(model, args, optimizer, 1, autocast, loss)[0]
    tracker = StorageTracker(_held(model, args, None))
    with _mode(model, False), tracker, torch.no_grad(), _autocast(autocast, args):
        out = _call(model, args)
    after = tracker.current()
    params = _distinct_nbytes(list(model.parameters()))
    del out
    return MeasuredMemory(params, 0, 0, after, after, after, tracker.peak)


def _optimizer_step(model: nn.Module, opt: torch.optim.Optimizer | None) -> tuple[int, int]:
    """The gradients' bytes after the backward; then the optimizer's step (when there is one) and
    ``zero_grad(set_to_none=True)``, and its states' bytes (0 without an optimizer)."""
    grads = _distinct_nbytes([p.grad for p in model.parameters() if p.grad is not None])
    states = 0
    if opt is not None:
        opt.step()
        states = _distinct_nbytes(_state_tensors(opt))
        opt.zero_grad(set_to_none=True)
    return grads, states


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _held(model: nn.Module, args: Args, opt: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """What exists before the step: parameters, buffers, inputs, states made at construction (Adagrad)."""
    held = [*model.parameters(), *model.buffers(), *_tensors(args)]
    return held + (_state_tensors(opt) if opt is not None else [])


def measure_memory_steps(
    model: nn.Module,
    args: Args,
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None,
    steps: int,
    autocast: torch.dtype | None = None,
    loss: Callable[[Any], torch.Tensor] | None = None,
) -> list[MeasuredMemory]:
    """``steps`` real training steps on the CPU, each measured (the peak is reset at each step's start), in train
    mode (each module's own mode given back afterwards), with Python's cycle collector paused in each step as
    derive counts (``symacct.trace.record.no_cycle_collection``)."""
    opt = optimizer(model) if optimizer is not None else None
    with _mode(model, True):
        return _train_steps(model, args, opt, StorageTracker(_held(model, args, opt)), loss, autocast, steps)


def _train_steps(
    model: nn.Module,
    args: Args,
    opt: torch.optim.Optimizer | None,
    tracker: StorageTracker,
    loss: Callable[[Any], torch.Tensor] | None,
    autocast: torch.dtype | None,
    steps: int,
) -> list[MeasuredMemory]:
    out_steps = []
    for _ in range(steps):
        with tracker, no_cycle_collection():  # as derive counts: what only reference cycles hold stays held
            tracker.peak = tracker.current()
            with _autocast(autocast, args):
                out = _call(model, args)
                value = loss(out) if loss is not None else out
            after_forward = tracker.current()
            value.backward()
            after_backward = tracker.current()
            grads, states = _optimizer_step(model, opt)
            after_optimizer = tracker.current()  # the caller still holds the output and the loss, as in derive
            del out, value  # dropped before the next step, so steps 2.. start from the same state
        params = _distinct_nbytes(list(model.parameters()))
        out_steps.append(
            MeasuredMemory(params, grads, states, after_forward, after_backward, after_optimizer, tracker.peak)
        )
    return out_steps


def measure_cuda_memory(
    model: nn.Module,
    args: Args,
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
    autocast: torch.dtype | None = None,
) -> MeasuredMemory:
    """One real step on the GPU, measured by the caching allocator (see ``measure_cuda_steps``)."""
    return measure_cuda_steps(model, args, optimizer, 1, autocast).memory[0]


@dataclass
class CudaSteps:
    memory: list[MeasuredMemory]  # per step
    reserved: list[int]  # memory_reserved at the end of each step, above the baseline
    seconds: list[float]  # per step, CUDA events around forward + backward + optimizer step + zero_grad
    workspace: int = 0  # kept by the CUDA libraries after a warm-up pass (cuBLAS / cuBLASLt), not in ``memory``
    # device memory in use (cudaMemGetInfo: total - free) less what the caching allocator reserves, after the
    # steps: the CUDA context and the modules loaded (and any other process on this GPU)
    context: int = 0


def measure_cuda_steps(
    model: nn.Module,
    args: Args,
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None,
    steps: int,
    autocast: torch.dtype | None = None,
    loss: Callable[[Any], torch.Tensor] | None = None,
) -> CudaSteps:
    """``steps`` real training steps on the GPU, measured by the caching allocator and CUDA events.

    ``model`` and ``args`` are given on the CPU and moved to the GPU here, after
    the baseline is read, so that every figure includes them (as derive's do).
    Then one forward and backward runs and everything it made is dropped: what
    stays allocated is the CUDA libraries' own memory, chiefly the cuBLAS /
    cuBLASLt workspace (32 MiB on Hopper) that the caching allocator hands out
    at the first matmul and keeps. It is reported as ``workspace`` and left out
    of every figure, as it is out of derive's (a library's scratch is no tensor
    of the step); otherwise the first step of a small model would be off by it.
    Each step's peak is ``max_memory_allocated`` with the peak reset at the
    step's start; its time is the elapsed time between two CUDA events. Python's
    cycle collector is paused in each step, as derive counts.
    """
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    base_reserved = torch.cuda.memory_reserved()
    model = model.cuda()
    with _mode(model, True):
        args = tree_map(lambda a: a.cuda() if isinstance(a, torch.Tensor) else a, args)
        moved = torch.cuda.memory_allocated()
        with _autocast(autocast, args):
            warm = _call(model, args)
            warm = loss(warm) if loss is not None else warm
        warm.backward()
        model.zero_grad(set_to_none=True)
        del warm
        torch.cuda.synchronize()
        workspace = torch.cuda.memory_allocated() - moved
        base += workspace
        opt = optimizer(model) if optimizer is not None else None
        result = CudaSteps([], [], [], workspace)
        for _ in range(steps):
            with no_cycle_collection():  # as derive counts: what only reference cycles hold stays held
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                with _autocast(autocast, args):
                    out = _call(model, args)
                    value = loss(out) if loss is not None else out
                after_forward = torch.cuda.memory_allocated() - base
                value.backward()
                after_backward = torch.cuda.memory_allocated() - base
                grads, states = _optimizer_step(model, opt)
                end.record()
                torch.cuda.synchronize()
                after_optimizer = torch.cuda.memory_allocated() - base
                peak = torch.cuda.max_memory_allocated() - base
                params = _distinct_nbytes(list(model.parameters()))
                result.memory.append(
                    MeasuredMemory(params, grads, states, after_forward, after_backward, after_optimizer, peak)
                )
                result.reserved.append(torch.cuda.memory_reserved() - base_reserved)
                result.seconds.append(begin.elapsed_time(end) / 1000.0)
                del out, value
        free, total = torch.cuda.mem_get_info()
        result.context = total - free - torch.cuda.memory_reserved()
        return result
