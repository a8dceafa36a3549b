"""Per-rank measurements of a parallel layout on PyTorch's own distributed code.

Two ways, both running the real sharding code on a small model:

- ``fake_rank``: one rank of FSDP2 / HSDP in this process, on PyTorch's fake process group and fake
  tensors (the model built on ``meta``, sharded, then ``to_empty``): per-rank static bytes and every
  collective's payload, in a second or two, at any world size.
- ``gloo_world``: ``world`` real processes on the gloo backend with real CPU tensors, for DDP (with gradient
  accumulation), FSDP2, HSDP (over context-parallel ranks too) and ``torch.distributed.pipelining`` (GPipe,
  1F1B, interleaved; DDP, FSDP2 or HSDP over the stages; tensor parallelism inside them, the model
  parallelized by its plan over the mesh's ``tp`` dimension before the stages are cut from it): the loss
  of the first step; static bytes,
  collectives and the peak of live storage bytes (``symacct.measure.run.StorageTracker``) of a later step
  (the optimizer states alive from its start; DDP's buckets rebuilt).

Collectives are counted by a dispatch mode over the ``c10d`` and ``_c10d_functional`` ops, with the payload
``torch.distributed._tools.fake_collectives`` reads (an all-gather's output, a reduce-scatter's input; an
all-to-all's input, where it counts input and output);
DDP's bucket all-reduces run in C++ and are read from a communication hook (each bucket's buffer); a
pipeline's sends from ``c10d.send``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from symacct.errors import SymacctError
from symacct.measure.capacity import RUN_SMALLER, require
from symacct.measure.run import StorageTracker, _distinct_nbytes, _state_tensors, dtensor_op
from symacct.options import DTYPES
from symacct.parallel.layout import Layout
from symacct.trace import versions
from symacct.trace.saved import composing
from symacct.trace.tensor_parallel import apply_plan, fake_group


@dataclasses.dataclass
class RankMeasure:
    """What one rank held and sent in one step."""

    rank: int
    params: int
    grads: int
    optimizer: int
    collectives: list[tuple[str, str, int]]  # (op, phase, payload bytes), in order
    loss: float | None = None
    peak: int | None = None


_NAMES = {
    "_allgather_base_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "allgather_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "allreduce_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "send": "send",
    "recv_": "recv",
    "broadcast_": "broadcast",
    "all_to_all_single": "all_to_all",
}


class CollectiveCounter(TorchDispatchMode):
    """Each collective op dispatched while active: (op, phase, payload bytes); set ``phase`` between phases."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.log: list[tuple[str, str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed._tools.fake_collectives import CollectiveOp, collective_ops, sync_ops

        if dtensor_op(types):
            return NotImplemented  # DTensor issues its collectives on the shards, seen here
        kwargs = kwargs or {}
        res = func(*args, **kwargs)
        if func in collective_ops and func not in sync_ops:
            name = _NAMES.get(func._opname, func._opname)
            if name == "all_to_all":  # what it sends (fake_collectives counts its input and output)
                size = args[0].numel() * args[0].element_size()
            else:
                size = CollectiveOp.get_comm_tensor_size(func, res, args, kwargs)
            self.log.append((name, self.phase, size))
        return res


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``t``'s bytes: a DTensor's local shard; the tensor a functional
    collective's ``AsyncCollectiveTensor`` wraps (its own storage is a placeholder, another object for the
    same bytes)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    t = t.to_local() if hasattr(t, "to_local") else t
    while isinstance(t, AsyncCollectiveTensor):
        t = t.elem
    return t


def static_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[int, int, int]:
    """Distinct storage bytes of the rank's parameters, gradients and optimizer states (DTensors' local parts).
    The parameters are the optimizer's: with tensor parallelism under DDP, PyTorch's ``_pre_dp_module_transform``
    swaps the module's parameters for DTensor attributes at every forward, so ``model.parameters()`` no longer
    lists them, while the optimizer and DDP's reducer hold the local ones."""
    own = [p for g in opt.param_groups for p in g["params"]] or list(model.parameters())
    params = [_local(p) for p in own]
    grads = [_local(p.grad) for p in own if p.grad is not None]
    states = [_local(s) for s in _state_tensors(opt)]
    return _distinct_nbytes(params), _distinct_nbytes(grads), _distinct_nbytes(states)


def stack_of(model: nn.Module, path: str) -> nn.ModuleList:
    got = model.get_submodule(path) if path else model
    if not isinstance(got, nn.ModuleList):
        raise SymacctError(f"'{path}' is not an nn.ModuleList of blocks", hint="pass the layer stack's path")
    return got


def shard(model: nn.Module, layout: Layout, stack: str, mesh: Any = None) -> nn.Module:
    """FSDP2 (or HSDP) as the reference plan applies it: ``fully_shard`` each block, then the root (over
    ``mesh``, the data-parallel part of a 2-D mesh, when given)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh is None and layout.hsdp_shard:
        mesh = init_device_mesh("cpu", (layout.replicate, layout.hsdp_shard), mesh_dim_names=("replicate", "shard"))
    elif mesh is None:
        mesh = init_device_mesh("cpu", (layout.replicas,))
    policy = mixed_precision(layout)
    for block in stack_of(model, stack):
        fully_shard(block, mesh=mesh, reshard_after_forward=layout.reshard_after_forward, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def mixed_precision(layout: Layout) -> Any:
    """The layout's FSDP2 ``MixedPrecisionPolicy`` (the default policy, full precision, without one)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    def dtype(name: str | None) -> torch.dtype | None:
        return DTYPES[name][0] if name else None

    return MixedPrecisionPolicy(param_dtype=dtype(layout.param_dtype), reduce_dtype=dtype(layout.reduce_dtype))


@contextlib.contextmanager
def _fake_group(layout: Layout, rank: int) -> Iterator[None]:
    """PyTorch's fake process group as ``rank`` of an FSDP2 / HSDP layout (over tensor- or context-parallel
    ranks too: its whole world), for the ``with`` block."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if layout.dp_mode != "fsdp" or layout.pp > 1:
        raise SymacctError("the fake process group runs FSDP2 / HSDP only", hint="use gloo_world for DDP and pipelines")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _tracker(
    model: nn.Module, args: tuple[Any, ...], opt: torch.optim.Optimizer, more: tuple[torch.Tensor, ...] = ()
) -> StorageTracker:
    """A storage tracker holding what lives before a step: the rank's local parameters, its buffers, the
    inputs, the optimizer states, and ``more`` (DDP's gradient buckets)."""
    held = [*map(_local, model.parameters()), *model.buffers(), *[a for a in args if isinstance(a, torch.Tensor)]]
    return StorageTracker(held + [_local(s) for s in _state_tensors(opt)] + list(more))


def fake_rank(
    build: Callable[[], nn.Module],
    layout: Layout,
    rank: int,
    inputs: Callable[[nn.Module], tuple[Any, ...]],
    optimizer: Callable[[Any], torch.optim.Optimizer],
    stack: str = "blocks",
) -> RankMeasure:
    """One FSDP2 / HSDP rank on the fake process group and fake tensors (see the module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with _fake_group(layout, rank):
        with torch.device("meta"):
            model = build()
        shard(model, layout, stack)
        model.to_empty(device="cpu")
        with FakeTensorMode(allow_non_fake_inputs=True):
            opt = optimizer(model.parameters())
            args = inputs(model)
            counter = CollectiveCounter()
            with counter:
                loss = model(*args)
                counter.phase = "backward"
                loss.backward()
                counter.phase = "optimizer"
                opt.step()
            params, grads, states = static_bytes(model, opt)
        return RankMeasure(rank, params, grads, states, counter.log)


def fake_rank_peak(
    build: Callable[[], nn.Module],
    layout: Layout,
    rank: int,
    inputs: Callable[[nn.Module], tuple[Any, ...]],
    optimizer: Callable[[Any], torch.optim.Optimizer],
    stack: str = "blocks",
) -> int:
    """The peak of live storage bytes of one FSDP2 / HSDP rank's second step, with real CPU tensors on the
    fake process group: every buffer FSDP2 allocates is real (the collectives move nothing, so the values
    are not, which memory does not depend on); ``layout.micro_batches`` forward and backward passes (gradient
    accumulation) before the optimizer step. With tensor or context parallelism (a 2-D mesh, as the gloo
    runner lays it) the third step, as ``gloo_world`` measures it."""
    with _fake_group(layout, rank):
        if layout.tp > 1 or layout.cp > 1:
            model = build()
            return _dp_step(model, layout, rank, inputs(model), optimizer, stack, CollectiveCounter()).peak or 0
        model = shard(build(), layout, stack)
        opt = optimizer(model.parameters())
        args = inputs(model)
        model(*args).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tracker = _tracker(model, args, opt)
        with tracker:
            for _ in range(layout.micro_batches):  # gradient accumulation: each micro-batch reduce-scattered
                model(*args).backward()
            opt.step()
        return tracker.peak


@dataclasses.dataclass
class TensorParallelMeasure:
    """One tensor-parallel rank's first step (static bytes, saved bytes, collectives, peak) and the peak of
    a later one (the optimizer states alive from its start)."""

    rank: RankMeasure
    saved: int  # distinct local storages autograd saved in forward: parameters, buffers and inputs excluded
    first_peak: int


def tp_rank(
    build: Callable[[], nn.Module],
    plan: Any,
    tp: int,
    inputs: Callable[[nn.Module], tuple[Any, ...]],
    optimizer: Callable[[Any], torch.optim.Optimizer],
    rank: int = 0,
) -> TensorParallelMeasure:
    """Rank ``rank`` of a tensor-parallel model, with real CPU tensors, on PyTorch's fake process group of
    ``tp`` ranks: ``parallelize_module`` by ``plan`` (a dict, a function ``plan(model, mesh)`` or a name the
    model's ``tp_plan`` answers); every buffer DTensor allocates is real, the collectives move nothing (the
    values are not the model's, which memory does not depend on)."""
    with fake_group(tp, rank) as mesh:
        model = apply_plan(build(), plan, mesh)
        opt = optimizer(model.parameters())
        args = inputs(model)
        got = _two_steps(model, args, opt)
        measured = RankMeasure(rank, *got.static, got.log, None, got.later_peak)
        return TensorParallelMeasure(measured, got.saved, got.first_peak)


@dataclasses.dataclass
class ContextParallelMeasure:
    """One context-parallel rank's first step (static bytes, saved bytes, FLOPs, collectives, peak) and the
    peak of a later one (the optimizer states alive from its start)."""

    rank: RankMeasure
    saved: int  # distinct storages autograd saved in forward: parameters, buffers and inputs excluded
    flops: int  # the rank's local ops' by flop_counter's formulas, the CPU flash kernel's in the ring too
    first_peak: int


def cp_rank(
    build: Callable[[], nn.Module],
    cp: int,
    inputs: Callable[[nn.Module], tuple[Any, ...]],
    optimizer: Callable[[Any], torch.optim.Optimizer],
    rank: int = 0,
    autocast: torch.dtype | None = None,
    tp: int = 1,
    plan: Any = "megatron",
) -> ContextParallelMeasure:
    """Rank ``rank`` of a context-parallel step, with real CPU tensors, on PyTorch's fake process group of
    ``cp`` ranks: the inputs and the model's sequence tables sharded and SDPA run as PyTorch's ring
    (``symacct.trace.context_parallel.sharded``); every buffer the ring allocates is real, the collectives
    move nothing (the values are not the model's, which memory does not depend on). ``autocast``: the
    forward (and loss) under CPU autocast to that dtype, as derive's ``autocast=``. ``tp > 1``: the ring's
    ranks tensor-parallel too, a (cp, tp) mesh (tp innermost), the model sharded by ``plan`` over its ``tp``
    dimension before the step."""
    from symacct.measure.run import LocalFlopCounter
    from symacct.trace.context_parallel import sharded

    with fake_group((cp, tp), rank, names=("cp", "tp")) as mesh:
        model = build()
        if tp > 1:
            model = apply_plan(model, plan, mesh["tp"])
        opt = optimizer(model.parameters())
        args = inputs(model)
        flops = LocalFlopCounter()
        with sharded(model, args, mesh["cp"]):
            got = _two_steps(model, args, opt, autocast, counting=(flops,))
        measured = RankMeasure(rank, *got.static, got.log, None, got.later_peak)
        return ContextParallelMeasure(measured, got.saved, flops.total, got.first_peak)


@dataclasses.dataclass
class _Steps:
    saved: int  # distinct local storages autograd saved in the first forward: parameters, buffers, inputs excluded
    log: list[tuple[str, str, int]]  # the first step's collectives
    static: tuple[int, int, int]  # parameters, gradients, optimizer states
    first_peak: int
    later_peak: int  # a later step's (the optimizer states alive from its start; the loss held through it)


def _two_steps(
    model: nn.Module,
    args: tuple[Any, ...],
    opt: torch.optim.Optimizer,
    autocast: torch.dtype | None = None,
    counting: tuple[Any, ...] = (),
) -> _Steps:
    """One rank's first step (saved bytes, collectives, static bytes and peak; the ``counting`` modes active
    through forward and backward) and the peak of a later one."""
    external = {_local(t).untyped_storage()._cdata for t in [*model.parameters(), *model.buffers(), *args]}
    saved: dict[int, int] = {}
    keep: list[torch.Tensor] = []  # alive until backward: storage handles stay unique

    def see(t: torch.Tensor) -> None:
        st = _local(t).untyped_storage()
        if st._cdata not in external:
            saved[st._cdata] = st.nbytes()
        keep.append(t)

    def pack(t: torch.Tensor) -> tuple[torch.Tensor, int]:
        see(t)
        return versions.pack(t)  # PyTorch's in-place check, which hooks switch off (symacct.trace.versions)

    counter = CollectiveCounter()
    first = _tracker(model, args, opt)
    with first, counter:
        with contextlib.ExitStack() as modes:
            for mode in counting:
                modes.enter_context(mode)
            hooks = torch.autograd.graph.saved_tensors_hooks(pack, versions.unpack)
            with hooks, composing(see), _autocast(autocast):  # composing: the model's own hooks' tensors too
                loss = model(*args)
            counter.phase = "backward"
            keep.clear()
            loss.backward()
        counter.phase = "optimizer"
        opt.step()
    static = static_bytes(model, opt)
    opt.zero_grad(set_to_none=True)
    del loss
    later = _tracker(model, args, opt)
    with later:
        with _autocast(autocast):
            loss = model(*args)  # held through the step, as derive has the caller hold it
        loss.backward()
        opt.step()
    return _Steps(sum(saved.values()), counter.log, static, first.peak, later.peak)


def _autocast(dtype: torch.dtype | None) -> Any:
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def gloo_world(
    build: Callable[[], nn.Module],
    layout: Layout,
    inputs: Callable[[nn.Module], tuple[Any, ...]],
    optimizer: Callable[[Any], torch.optim.Optimizer],
    stack: str = "blocks",
    split: Callable[[nn.Module, int, int], nn.Module] | None = None,
) -> list[RankMeasure]:
    """``layout.world`` real gloo processes, one step each (``split(model, stage, pp)``: a stage's module,
    for a pipeline). ``build``, ``inputs``, ``optimizer`` and ``split`` must be picklable (module-level).

    A world one of whose ranks dies of a native crash (SIGABRT, SIGSEGV, SIGBUS: no Python traceback) is run
    once more, with a warning naming the rank and the signal. In three of four runs of the slow tests one
    rank of one world aborted ("terminate called without an active exception", or glibc's "malloc():
    unaligned tcache chunk detected"), each test passing when run again (the same pipeline world alone: no
    crash in 40 runs of 4 processes); PyTorch reports gloo's worker threads holding work objects whose
    tensors are destroyed without the interpreter (pytorch/pytorch#179291), and a rank now leaves by
    ``os._exit`` once its results are written and its groups destroyed. A deterministic crash fails both
    runs, a Python error fails at once, and a rank killed (SIGKILL: most often the out-of-memory killer) is
    not run again."""
    import warnings

    for attempt in (1, 2):
        try:
            return _gloo_world_once(build, layout, inputs, optimizer, stack, split)
        except _NativeCrash as crash:
            if attempt == 2:
                raise crash.error from crash.error.__cause__
            warnings.warn(f"{crash.error.what}: run once more", RuntimeWarning, stacklevel=2)
    raise AssertionError("unreachable")


class _NativeCrash(Exception):
    """A rank of a gloo world ended by a native crash (``gloo_world`` runs it once more)."""

    def __init__(self, error: SymacctError) -> None:
        super().__init__(error.what)
        self.error = error


_CRASHES = ("SIGABRT", "SIGSEGV", "SIGBUS")


def _gloo_world_once(
    build: Callable[[], nn.Module],
    layout: Layout,
    inputs: Callable[[nn.Module], tuple[Any, ...]],
    optimizer: Callable[[Any], torch.optim.Optimizer],
    stack: str,
    split: Callable[[nn.Module, int, int], nn.Module] | None,
) -> list[RankMeasure]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(
                _gloo_rank,
                args=(layout, build, inputs, optimizer, stack, split, tmp),
                nprocs=layout.world,
                join=True,
            )
        except mp.ProcessRaisedException as e:
            raise SymacctError(
                f"the real run of {layout.describe()} failed: {_first_error(tmp, layout.world)}",
                hint="the ranks' tracebacks follow the cause",
            ) from e
        except mp.ProcessExitedException as e:  # a rank ended by a signal (no traceback of its own)
            killed = e.signal_name == "SIGKILL"
            error = SymacctError(
                f"the real run of {layout.describe()} failed: rank {e.error_index} ended by "
                f"{e.signal_name or f'exit code {e.exit_code}'}"
                + (" (on Linux most often the out-of-memory killer: see dmesg)" if killed else ""),
                hint=RUN_SMALLER if killed else "the cause follows",
            )
            error.__cause__ = e
            if e.signal_name in _CRASHES:
                raise _NativeCrash(error) from e
            raise error from e
        out = []
        for r in range(layout.world):
            d = json.loads(Path(tmp, f"rank{r}.json").read_text())
            d["collectives"] = [tuple(c) for c in d["collectives"]]
            out.append(RankMeasure(**d))
        return out


def _first_error(tmp: str, world: int) -> str:
    """The ranks' errors, the one that is not a peer's hang-up first, each rank's traceback kept in full."""
    errs = [(r, Path(tmp, f"rank{r}.err")) for r in range(world)]
    texts = [(r, p.read_text()) for r, p in errs if p.exists()]
    texts.sort(key=lambda rt: "Connection closed by peer" in rt[1])
    return "\n".join(f"rank {r}:\n{t}" for r, t in texts)


def _gloo_rank(
    rank: int,
    layout: Layout,
    build: Callable[[], nn.Module],
    inputs: Callable[[nn.Module], tuple[Any, ...]],
    optimizer: Callable[[Any], torch.optim.Optimizer],
    stack: str,
    split: Callable[[nn.Module, int, int], nn.Module] | None,
    tmp: str,
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=rank, world_size=layout.world
    )
    try:
        torch.manual_seed(0)
        model = build()
        args = inputs(model)  # the same batch on every rank: the loss is comparable with one process
        counter = CollectiveCounter()
        if layout.pp > 1:
            got = _pipeline_step(model, layout, rank, args, optimizer, split, counter, stack)
        else:
            got = _dp_step(model, layout, rank, args, optimizer, stack, counter)
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(dataclasses.asdict(got)))
    except BaseException:  # each rank's own error: spawn reports the first to exit, often a peer's hang-up
        import traceback

        Path(tmp, f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
    # its results written and its groups destroyed, the rank leaves without the interpreter's teardown, where
    # tensors gloo's threads still hold would be destroyed (pytorch/pytorch#179291; see gloo_world)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _layout_mesh(layout: Layout, model: nn.Module) -> tuple[Any, Any]:
    """The layout's device mesh over the world, torchtitan's order: the pipeline outermost, then data
    parallelism (HSDP's replicate and shard), then cp, tp innermost; the model sharded by its tensor-parallel
    plan over the ``tp`` dimension. With the data-parallel mesh the gradients are reduced over: the ``dp x
    cp`` ranks of each tensor-parallel shard flattened (torchtitan's ``dp_shard_cp``), HSDP's (replicate,
    shard x cp); None without replicas."""
    from torch.distributed.device_mesh import init_device_mesh

    if layout.replicas > 1 and layout.dp_mode not in ("ddp", "fsdp"):
        raise SymacctError(f"no real run for {layout.dp_mode}", hint="ddp, fsdp (hsdp_shard for HSDP)")
    dims = [("pp", layout.pp)] if layout.pp > 1 else []
    dims += (
        [("replicate", layout.replicate), ("shard", layout.hsdp_shard)] if layout.hsdp_shard else [("dp", layout.dp)]
    )
    dims += [(name, k) for name, k in (("cp", layout.cp), ("tp", layout.tp)) if k > 1]
    mesh = init_device_mesh("cpu", tuple(k for _, k in dims), mesh_dim_names=tuple(n for n, _ in dims))
    if layout.tp > 1:
        apply_plan(model, layout.plan, mesh["tp"])
    if layout.replicas == 1:
        return mesh, None
    shards = "shard" if layout.hsdp_shard else "dp"
    dp_mesh = mesh[shards, "cp"]._flatten(f"{shards}_cp") if layout.cp > 1 else mesh[shards]
    if layout.hsdp_shard:
        dp_mesh = mesh["replicate", f"{shards}_cp" if layout.cp > 1 else shards]
    return mesh, dp_mesh


def _dp_step(
    model: nn.Module,
    layout: Layout,
    rank: int,
    args: tuple[Any, ...],
    optimizer: Callable[[Any], torch.optim.Optimizer],
    stack: str,
    counter: CollectiveCounter,
) -> RankMeasure:
    hooked: list[tuple[str, str, int]] = []
    buckets: dict[tuple[int, int], torch.Tensor] = {}  # DDP's gradient buckets, by wrapper and index
    dp_mesh = None
    ring: Callable[[], Any] = contextlib.nullcontext  # context parallelism: each step in PyTorch's context_parallel
    if layout.cp > 1 or layout.tp > 1:
        mesh, dp_mesh = _layout_mesh(layout, model)
        if layout.cp > 1:
            from symacct.trace.context_parallel import sharded

            ring = functools.partial(sharded, model, args, mesh["cp"])

    if layout.tp > 1 and layout.replicas == 1:
        net: nn.Module = model
    elif layout.dp_mode == "ddp":
        # with cp, each rank's sequence tables are its own shard: rank 0's must not be broadcast over them
        group = None
        if layout.tp > 1:
            from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform

            _pre_dp_module_transform(model)
            group = dp_mesh.get_group()
        net = _ddp(model, layout, group, hooked, buckets, broadcast_buffers=layout.cp == 1)
    elif layout.dp_mode == "fsdp":
        net = shard(model, layout, stack, dp_mesh)
    else:
        raise SymacctError(f"no real run for {layout.dp_mode}", hint="ddp, fsdp (hsdp_shard for HSDP)")
    opt = optimizer(net.parameters())
    # the first step makes the optimizer states, DDP rebuilds its buckets in the second (a broadcast of the
    # order); the third, measured, is every later one
    m = layout.micro_batches
    if m > 1 and layout.dp_mode != "ddp":
        raise SymacctError(f"the real run of gradient accumulation is DDP's, not {layout.dp_mode}'s", hint="m=1")
    first_loss = None
    b = args[0].shape[0] // m
    rows = [torch.arange(i * b, (i + 1) * b) for i in range(m)]
    for _ in range(2):
        with ring():
            if m > 1:
                mean, warm, _mb = _accumulate(net, args, rows, counter)
            else:
                warm, _mb = net(*args), args
                mean = float(_local(warm.detach()))
                warm.backward()
            first_loss = first_loss if first_loss is not None else mean
        opt.step()
        opt.zero_grad(set_to_none=True)
        del warm, _mb
    hooked.clear()
    # DDP's gradient buckets, which its C++ reducer holds from step to step (with gradient_as_bucket_view too,
    # though zero_grad(set_to_none=True) lets go of the views), as the hook saw them: held all along (a
    # gradient's copy into its bucket shows the bucket's storage, not new bytes)
    held = tuple(buckets.values())
    with ring():  # entered first: its copies of the inputs and tables to restore are not the step's
        # gradient accumulation: each micro-batch's inputs copied out of the batch as a loader hands them over
        tracker = _tracker(net, args if m == 1 else (), opt, more=held)
        with tracker:
            with counter:
                if m > 1:
                    _, loss, _mb = _accumulate(net, args, rows, counter)
                else:
                    loss = net(*args)
                    counter.phase = "backward"
                    loss.backward()
                counter.phase = "optimizer"
                opt.step()
    log = _without_hooked(counter.log, hooked)  # DDP: the buckets as the hook saw them
    params, grads, states = static_bytes(net, opt)
    return RankMeasure(rank, params, grads, states, log, first_loss, tracker.peak)


def _accumulate(
    net: nn.Module, args: tuple[Any, ...], rows: list[torch.Tensor], counter: CollectiveCounter
) -> tuple[float, torch.Tensor, tuple[Any, ...]]:
    """Gradient accumulation over the micro-batches of ``args`` (the ``rows`` of dim 0 of each), DDP's
    ``no_sync`` for all but the last: each micro-batch's inputs copied out as a loader would hand them over
    (``index_select``: a storage of its own, the whole batch never an op's output), dropped after its
    backward. Returned: the micro-batches' mean loss, and the last one's loss and inputs (alive through the
    optimizer step, as one step's are)."""
    m = len(rows)
    total = 0.0
    for i in range(m):
        mb = tuple(a.index_select(0, rows[i]) if isinstance(a, torch.Tensor) else a for a in args)
        with net.no_sync() if i < m - 1 else contextlib.nullcontext():  # type: ignore[operator]
            counter.phase = "forward"
            loss = net(*mb)
            counter.phase = "backward"
            loss.backward()
        total += float(_local(loss.detach()))
        if i < m - 1:
            del loss, mb
    return total / m, loss, mb


def _ddp(
    model: nn.Module,
    layout: Layout,
    group: Any,
    hooked: list[tuple[str, str, int]],
    buckets: dict[tuple[int, int], torch.Tensor],
    broadcast_buffers: bool = True,
) -> nn.Module:
    """``model`` in DDP over ``group`` (None: the world), its bucket all-reduces read from a communication
    hook: each call's payload into ``hooked``, each bucket's flat buffer into ``buckets`` (the reducer's,
    rebuilt after the first step that synchronises)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = DDP(
        model, process_group=group, gradient_as_bucket_view=layout.bucket_view, broadcast_buffers=broadcast_buffers
    )

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        hooked.append(("all_reduce", "backward", buf.numel() * buf.element_size()))
        buckets[id(net), bucket.index()] = buf
        fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0].div_(layout.replicas))  # the mean over the dp x cp ranks

    # DDP checks the annotations as objects, which this module's postponed annotations are not
    hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    net.register_comm_hook(None, hook)
    return net


def _without_hooked(log: list[tuple[str, str, int]], hooked: list[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    """The counter's log less the all-reduces DDP's hook issued (one per hooked bucket, by payload), then the
    hooked buckets: each bucket counted once, as the hook saw it."""
    drop = [payload for _op, _phase, payload in hooked]
    out = []
    for c in log:
        if c[0] == "all_reduce" and c[2] in drop:
            drop.remove(c[2])
        else:
            out.append(c)
    return out + hooked


def _pipeline_step(
    model: nn.Module,
    layout: Layout,
    rank: int,
    args: tuple[Any, ...],
    optimizer: Callable[[Any], torch.optim.Optimizer],
    split: Callable[[nn.Module, int, int], nn.Module] | None,
    counter: CollectiveCounter,
    stack: str = "blocks",
) -> RankMeasure:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as sch

    if split is None:
        raise SymacctError("a pipeline run needs split(model, stage, pp)")
    # ranks (pp_rank, dp_rank, cp_rank, tp_rank): DDP's replicas over each stage's module, or the stages'
    # context-parallel rings (each step in PyTorch's context_parallel over the cp ranks), the model sharded by
    # its tensor-parallel plan before the stages are cut from it (each stage's modules its own shards)
    pp_rank = rank // (layout.dp * layout.cp * layout.tp)
    pp_group = dp_group = dp_mesh = None
    ring: Callable[[], Any] = contextlib.nullcontext
    if layout.tp > 1 or layout.replicas > 1:
        mesh, dp_mesh = _layout_mesh(layout, model)
        pp_group = mesh["pp"].get_group()
        dp_group = None if dp_mesh is None or layout.hsdp_shard else dp_mesh.get_group()
        if layout.cp > 1:
            from symacct.trace.context_parallel import sharded

            ring = functools.partial(sharded, model, args, mesh["cp"])
    # the rank's stages: pp_rank, pp_rank + pp, ... of pp * v (the interleaved schedule's v per rank)
    n = layout.pp * layout.stages_per_rank
    index = range(pp_rank, n, layout.pp)
    part = nn.ModuleList([split(model, s, n) for s in index])
    hooked: list[tuple[str, str, int]] = []
    buckets: dict[tuple[int, int], torch.Tensor] = {}
    idx, target = args
    # one micro-batch's shapes (a context-parallel rank's: S / cp of the sequence)
    micro = idx[: idx.shape[0] // layout.micro_batches, : idx.shape[1] // layout.cp]
    shapes = _stage_shapes(model, split, n, micro, layout.param_dtype) if layout.replicas > 1 else {}
    if layout.replicas > 1 and layout.dp_mode == "fsdp":  # each stage module FSDP2's root, its blocks sharded
        subs = [shard(p, layout, stack, dp_mesh) for p in part]
    else:  # a context-parallel rank's own shard of the sequence: not broadcast from rank 0 (its tables its own)
        subs = [_ddp(p, layout, dp_group, hooked, buckets, layout.cp == 1) if layout.replicas > 1 else p for p in part]
    stages = [
        PipelineStage(p, s, n, torch.device("cpu"), group=pp_group, **shapes.get(s, {}))
        for p, s in zip(subs, index, strict=True)
    ]
    last = pp_rank == layout.pp - 1

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    cls = {"gpipe": sch.ScheduleGPipe, "1f1b": sch.Schedule1F1B, "interleaved": sch.ScheduleInterleaved1F1B}
    # every rank gets loss_fn: a schedule without one runs no backward (and the ranks then wait on each other)
    one = stages[0] if layout.stages_per_rank == 1 else stages
    schedule = cls[layout.schedule](one, layout.micro_batches, loss_fn=loss_fn, scale_grads=True)
    opt = optimizer(part.parameters())
    # the first step infers the stages' shapes; DDP rebuilds its buckets in the second
    first_loss = None
    for _ in range(2 if layout.replicas > 1 else 1):
        with ring():
            got = _run_schedule(schedule, pp_rank, last, idx, target)
        first_loss = first_loss if first_loss is not None else got
        opt.step()
        opt.zero_grad(set_to_none=True)
    hooked.clear()
    counter.phase = "step"  # a schedule interleaves forwards and backwards
    held = tuple(b for st in stages for b in _runtime_buffers(st)) + tuple(buckets.values())
    with ring():  # entered first: its copies of the inputs and tables to restore are not the step's
        tracker = _tracker(part, (idx, target), opt, held)
        with tracker, counter:
            _run_schedule(schedule, pp_rank, last, idx, target)
            counter.phase = "optimizer"
            opt.step()
    params, grads, states = static_bytes(part, opt)
    return RankMeasure(rank, params, grads, states, _without_hooked(counter.log, hooked), first_loss, tracker.peak)


def _stage_shapes(
    model: nn.Module,
    split: Callable[[nn.Module, int, int], nn.Module],
    n: int,
    micro: torch.Tensor,
    param_dtype: str | None = None,
) -> dict[int, dict[str, torch.Tensor]]:
    """Each stage's example input and output for one micro-batch, run through the stages in turn without
    gradients: PipelineStage's static metadata (with FSDP2's ``param_dtype``, a copy of the model in that
    dtype: the stages then send and receive activations in it). DDP needs it: the dynamic inference's real
    backward through the DDP module records its parameters for the bucket rebuild once more than the reducer
    allows (torch 2.13: an internal assert, "rebuilt parameter indices size is not same as original model
    parameters size").
    The gradients the stages run are PipelineStage's own, made at each micro-batch."""
    if param_dtype is not None:
        model = copy.deepcopy(model).to(DTYPES[param_dtype][0])
    out = {}
    x = micro
    for s in range(n):
        y = split(model, s, n)(x).detach().requires_grad_(True)  # metadata: a float output carries gradients
        out[s] = {"input_args": x, "output_args": y}
        x = y
    return out


def _runtime_buffers(stage: Any) -> tuple[torch.Tensor, ...]:
    """The receive buffers a pipeline stage allocates at its first step and keeps (torch 2.13's
    ``PipelineStage``: one per micro-batch for the activations it receives, one per micro-batch for the
    gradients it receives); alive before a later step starts, and read by no op the tracker sees return them."""
    infos = [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]
    return tuple(i.buffer for group in infos for i in group if getattr(i, "buffer", None) is not None)


def _run_schedule(schedule: Any, rank: int, last: bool, idx: torch.Tensor, target: torch.Tensor) -> float | None:
    """One step of the schedule on this rank; the mean micro-batch loss on the last stage."""
    losses: list[torch.Tensor] = []
    if rank == 0:
        schedule.step(idx)
    elif last:
        schedule.step(target=target, losses=losses)
    else:
        schedule.step()
    return float(torch.stack(losses).detach().mean()) if losses else None


@dataclasses.dataclass(frozen=True)
class Construct:
    """A model of class ``cls`` from ``config``, on the CPU, seeded: the same weights in every process."""

    cls: type
    config: Any

    def __call__(self) -> nn.Module:
        torch.manual_seed(0)
        return self.cls(self.config)


@dataclasses.dataclass(frozen=True)
class ExampleBatch:
    """The model's ``example_inputs(B, S)``, seeded: the same batch on every rank."""

    B: int
    S: int

    def __call__(self, model: nn.Module) -> tuple[Any, ...]:
        torch.manual_seed(1)
        return tuple(model.example_inputs(self.B, self.S))


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """``torch.optim`` class ``cls`` with lr 1e-3 (picklable)."""

    cls: type

    def __call__(self, params: Any) -> torch.optim.Optimizer:
        return self.cls(params, lr=1e-3)


def _stage(model: nn.Module, s: int, pp: int) -> nn.Module:
    return model.pipeline_stage(s, pp)


def _peak_exact(par: Any, layout: Layout) -> bool:
    """Whether the derived peaks of ``par`` are exact for the gloo runner's step (else an estimate)."""
    from symacct.parallel.rank import SCHEDULE_RUNTIMES

    # DDP: the traced step; FSDP2 without a pipeline: its buffers placed on it (symacct.parallel.fsdp)
    overlay = par.overlay is not None and layout.micro_batches == 1  # the gloo runner runs one micro-batch
    exact = layout.pp == 1 and (layout.replicas == 1 or layout.dp_mode == "ddp" or overlay)
    return exact or (layout.pp > 1 and layout.schedule in SCHEDULE_RUNTIMES)  # the runner: pp alone


def verify_parallel(model: nn.Module, layout: Layout, B: int, S: int, optimizer: str = "adamw") -> list[Any]:
    """The layout run for real (``gloo_world``) beside its derived figures, as ``symacct.measure.verify`` rows:
    each rank's static bytes and collective payloads exactly (rank 0 of the data-parallel group, the
    worst; each pipeline stage), the loss against one process (1e-5; with FSDP2's param_dtype, one process
    with its parameters in that dtype), the peak exactly for DDP (gradient accumulation included), for FSDP2
    without a pipeline and for each stage of a GPipe, 1F1B or interleaved pipeline (DDP over it included).
    With context parallelism the rank derived is the ring's rank 0, the other ranks' peaks at most its own
    (measured); the loss is the ranks' mean."""
    from symacct.measure.verify import Row
    from symacct.options import OPTIMIZERS
    from symacct.parallel.rank import derive_compute, derive_parallel, stage_rank
    from symacct.pipeline import derive

    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(model, "example_inputs"):
        raise SymacctError("verify --parallel runs a model with a config and example_inputs(B, S)")
    if layout.pp > 1 and not hasattr(model, "pipeline_stage"):
        raise SymacctError(
            f"{type(model).__name__} has no pipeline_stage(stage, pp)", hint="the reference gpt2 and llama have one"
        )
    if layout.pp > 1 and getattr(cfg, "tie_weights", False):
        raise SymacctError(
            "a pipeline of a tied head does not sum the copies' gradients", hint="--config tie_weights=false"
        )
    acct = derive(model, optimizer=optimizer, **layout.rank_options)
    compute = derive_compute(model, layout, optimizer=optimizer, **layout.rank_options)
    if layout.cp > 1 and acct.symbols.get("S") != S:  # the tables are sharded whole: S_max is S
        raise SymacctError(
            f"context parallelism shards the model's sequence tables whole: S = {S} is not their "
            f"{acct.symbols.get('S')} rows",
            hint=f"run at S = {acct.symbols.get('S')} (--seq), or build the model with its tables of S rows",
        )
    par = derive_parallel(acct, layout, compute).at(B=B, S=S)  # B: one micro-batch of one data-parallel rank
    exact = _peak_exact(par, layout)
    # every process builds the whole model (then keeps its stage, its shards): at least that each, at once
    whole = acct.at(B=B, S=S).memory
    need = max(layout.world * int(whole.params + whole.buffers), sum(int(r.peak) for r in par.ranks) if exact else 0)
    what = f"the real run of {layout.describe()} ({type(model).__name__} at B={B}, S={S}, {layout.world} processes)"
    require(need, "cpu", what, RUN_SMALLER)
    build = Construct(type(model), cfg)
    opt = Optimizer(OPTIMIZERS[optimizer])
    global_batch = B * layout.micro_batches  # a pipeline's or gradient accumulation's m micro-batches
    got = gloo_world(
        build, layout, ExampleBatch(global_batch, S), opt, stack=next(iter(acct.per_layer), ""), split=_stage
    )
    one = build()
    if layout.param_dtype:  # FSDP2 runs forward on the parameters cast to param_dtype
        one = one.to(DTYPES[layout.param_dtype][0])
    batch = ExampleBatch(global_batch, S)(one)
    if layout.param_dtype and layout.pp > 1:  # the schedule's: the mean of the micro-batches' bf16 losses
        micro = [one(*(t[i * B : (i + 1) * B] for t in batch)).detach() for i in range(layout.micro_batches)]
        loss = float(torch.stack(micro).mean())
    else:
        loss = float(one(*batch).detach())
    rows = []
    # data-parallel rank 0 of each kind of stage (rank = pp_rank * dp + dp_rank; the first middle stage)
    stride = layout.dp * layout.cp * layout.tp
    pairs = [(got[stage_rank(r.stage, layout.pp) * stride], r) for r in par.ranks]
    for g, p in pairs:
        who = f"rank {g.rank} ({p.stage})"
        for f in ("params", "grads", "optimizer"):
            rows.append(Row(f"{who} {f} bytes", getattr(p, f), getattr(g, f), 0.0))
        want: dict[str, list[int]] = {}
        for c in p.collectives:
            want.setdefault(c.op, [0, 0])
            want[c.op][0] += c.payload * c.count
            want[c.op][1] += c.count
        seen: dict[str, list[int]] = {}
        for op, _phase, payload in g.collectives:
            seen.setdefault(op, [0, 0])
            seen[op][0] += payload
            seen[op][1] += 1
        for op in sorted(set(want) | set(seen)):
            w, s = want.get(op, [0, 0]), seen.get(op, [0, 0])
            rows.append(Row(f"{who} {op} bytes", w[0], s[0], 0.0))
            rows.append(Row(f"{who} {op} calls", w[1], s[1], 0.0))
        rows.append(Row(f"{who} peak bytes", p.peak, g.peak or 0, 0.0 if exact else float("inf")))
    # dropout draws its masks per process and per micro-batch: the loss of one process is then another sample
    random = float(getattr(cfg, "dropout", 0) or 0) > 0
    tol, note = (float("inf"), "; dropout: shown") if random else (1e-5, "")
    if layout.cp > 1:  # each rank's loss is its shard's mean: equal shards, so their mean is the batch's
        shards = [g.loss for g in got if g.loss is not None]  # a pipeline's: its last stage's ring
        mean = sum(shards) / len(shards)
        rows.append(Row(f"loss (ranks' mean, against one process{note})", mean, loss, tol))
    elif got[-1].loss is not None:
        rows.append(Row(f"loss (against one process{note})", got[-1].loss, loss, tol))
    return rows
