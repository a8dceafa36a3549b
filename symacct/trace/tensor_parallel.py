"""Tensor parallelism in a trace: the model sharded by PyTorch's own ``parallelize_module`` on its fake
process group, so that the traced step is one rank's.

A plan is what ``torch.distributed.tensor.parallel.parallelize_module`` takes (a dict from module paths to
``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``, ``PrepareModuleInput`` ...), or a function
``plan(model, mesh)`` that shards the model itself, or a name: ``"megatron"`` / ``"megatron-sp"`` ask the
model for its own standard plan (``model.tp_plan(sequence_parallel=False / True)``, a dict or a function;
the reference models have one). The trace then records the rank's local ops on its shards and the
collectives DTensor runs (``symacct.trace.record``); the degree ``tp`` is the fake group's world size, a
probe symbol like any size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from symacct.errors import SymacctError

PLAN_NAMES = {"megatron": False, "megatron-sp": True}  # name -> sequence parallel


def check_plan(plan: Any) -> None:
    """Refuse what is not a plan, before anything is traced."""
    if isinstance(plan, str) and plan not in PLAN_NAMES:
        raise SymacctError(
            f"unknown tensor-parallel plan {plan!r}",
            hint=f"one of {', '.join(PLAN_NAMES)}, a parallelize_module plan (dict) or a function plan(model, mesh)",
        )
    if not isinstance(plan, (str, dict)) and not callable(plan):
        raise SymacctError(
            f"a tensor-parallel plan is a name, a dict or a function, not {type(plan).__name__}",
            hint="pass tensor_parallel='megatron' (or 'megatron-sp'), a parallelize_module plan, or plan(model, mesh)",
        )


@contextlib.contextmanager
def fake_group(world: int | tuple[int, ...], rank: int = 0, names: tuple[str, ...] | None = None) -> Iterator[Any]:
    """PyTorch's fake process group of ``world`` ranks (this process is ``rank``), and a device mesh over it,
    for the ``with`` block; nothing is sent anywhere. ``world`` a tuple: a mesh of that shape (its dimensions
    ``names``, the last innermost), over their product."""
    import math

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise SymacctError(
            "a process group is already initialised in this process",
            hint="derive tensor-parallel layouts outside a distributed job (the trace runs on a fake group)",
        )
    shape = world if isinstance(world, tuple) else (world,)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=math.prod(shape))
    try:
        yield init_device_mesh("cpu", shape, mesh_dim_names=names)
    finally:
        dist.destroy_process_group()


def mesh_groups(mesh: Any) -> dict[str, str]:
    """The process groups of a named mesh's dimensions: group name -> dimension name."""
    names = mesh.mesh_dim_names or ()
    return {mesh[n].get_group().group_name: n for n in names}


def apply_plan(
    model: nn.Module, plan: Any, mesh: Any, carried: Callable[[nn.Module], dict[str, Any] | None] | None = None
) -> nn.Module:
    """Shard ``model`` over ``mesh`` by ``plan`` (see the module docstring). ``carried(model)``: the plan a
    model carries without a ``tp_plan`` method (a transformers model's config has one, without sequence
    parallelism), for the name ``"megatron"``."""
    from torch.distributed.tensor.parallel import parallelize_module

    if isinstance(plan, str):
        own = getattr(model, "tp_plan", None)
        own = own if callable(own) else None  # transformers models have a tp_plan attribute of their own
        found = carried(model) if own is None and carried is not None and plan == "megatron" else None
        if own is None and found is None:
            raise SymacctError(
                f"{type(model).__name__} has no standard tensor-parallel plan"
                + (" with sequence parallelism" if PLAN_NAMES[plan] and carried is not None else "")
                + " (model.tp_plan, or a transformers config's base_model_tp_plan)",
                hint="pass tensor_parallel= a parallelize_module plan (dict) or a function plan(model, mesh)",
            )
        plan = found if own is None else own(sequence_parallel=PLAN_NAMES[plan])
    try:
        if isinstance(plan, dict):
            parallelize_module(model, mesh, plan)
        else:
            plan(model, mesh)
    except SymacctError:
        raise
    except Exception as e:
        raise SymacctError(
            f"the tensor-parallel plan failed on {type(model).__name__}: {type(e).__name__}: {e}",
            hint="each key must name a submodule (nn.Linear / nn.Embedding for Colwise/RowwiseParallel)",
        ) from e
    return model
