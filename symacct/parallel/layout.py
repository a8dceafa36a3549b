"""A parallel layout: how many ranks of each kind, how the data-parallel ranks shard, how the pipeline runs.

Conventions (docs/distributed.md):

- ``B`` in every formula is the **micro-batch of one data-parallel rank**; a step runs ``m`` micro-batches
  on each of the ``dp`` replicas, so the global batch is ``B * m * dp`` sequences.
- Ranks are numbered with tensor parallelism innermost, then context parallelism, then data parallelism,
  then the pipeline (``rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank``, torchtitan's
  and Megatron's order), so a group lies inside one node when its size times its stride is at most the
  node's GPUs.
- Context parallelism (``cp > 1``): the sequence split over ``cp`` ranks, attention run as PyTorch's ring
  (``symacct.trace.context_parallel``); the ranks hold the same parameters, so the gradients are reduced
  (and FSDP2 or ZeRO shard) over ``dp * cp`` ranks (``Layout.replicas``, torchtitan's ``dp_shard_cp``).
- Data-parallel sharding (``dp_mode``): ``ddp`` (replicas, one all-reduce of the gradients), ``zero1``
  (optimizer states sharded), ``zero2`` (states and gradients sharded), ``fsdp`` (FSDP2 ``fully_shard`` of
  each block and then the root: parameters, gradients and states sharded; ``hsdp_shard`` set: HSDP,
  sharded over groups of that size and replicated over ``dp / hsdp_shard`` of them; with ``cp > 1`` the
  shard group spans the context-parallel ranks too, ``hsdp_shard * cp``, torchtitan's ``dp_shard_cp``).
- Tensor parallelism (``tp > 1``): the model sharded by a plan (``parallelize_module``; the reference models'
  ``tp_plan``, Megatron's), ``sequence_parallel`` for the plan that also splits the norms and the residual
  stream along the sequence; the per-rank step is traced on PyTorch's fake process group
  (``symacct.trace.tensor_parallel``), so a layout with ``tp > 1`` needs an accounting derived with
  ``tensor_parallel=``.
- The pipeline (``pp > 1``): the layer stack split evenly, what runs before it on the first stage and
  what runs after it on the last; ``schedule`` one of ``gpipe``, ``1f1b``, ``interleaved`` (PyTorch's
  ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B`` with ``v`` stages per rank).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from symacct.errors import SymacctError

DP_MODES = ("ddp", "zero1", "zero2", "fsdp")
SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Degrees and options of one parallel layout (see the module docstring)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp_mode: str = "fsdp"
    reshard_after_forward: bool = True  # FSDP2: free each block's gathered parameters after its forward
    hsdp_shard: int | None = None  # HSDP: size of the sharding group (dp = shard * replicate)
    bucket_view: bool = False  # DDP gradient_as_bucket_view: each gradient a view of its bucket once reduced
    schedule: str = "1f1b"
    micro_batches: int = 1  # m
    stages_per_rank: int = 1  # v (interleaved only)
    sequence_parallel: bool = False
    return_outputs: bool = True  # pipeline: schedule.step(return_outputs=...), the last stage keeps m outputs
    param_dtype: str | None = None  # FSDP2 MixedPrecisionPolicy(param_dtype=...), a short name ('bf16')
    reduce_dtype: str | None = None  # FSDP2 MixedPrecisionPolicy(reduce_dtype=...); None: param_dtype's

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def replicas(self) -> int:
        """The ranks a gradient is reduced over (and FSDP2 or ZeRO shards over): ``dp``, times ``cp`` (the
        context-parallel ranks hold the same parameters, as torchtitan's ``dp_shard_cp`` mesh)."""
        return self.dp * self.cp

    @property
    def shard(self) -> int:
        """The group a sharded tensor is split over: dp, or HSDP's shard group."""
        return self.hsdp_shard or self.dp

    @property
    def replicate(self) -> int:
        return self.dp // self.shard

    @property
    def rank_options(self) -> dict[str, Any]:
        """``derive``'s options for one rank of this layout: its tensor-parallel plan and degree, its
        context-parallel degree (none for a layout of whole replicas)."""
        out: dict[str, Any] = {"tensor_parallel": self.plan, "tp": self.tp} if self.tp > 1 else {}
        return out | ({"context_parallel": self.cp} if self.cp > 1 else {})

    @property
    def plan(self) -> str:
        """The name of the reference models' tensor-parallel plan this layout runs."""
        return "megatron-sp" if self.sequence_parallel else "megatron"

    def describe(self) -> str:
        mixed = "".join(f", {k} {v}" for k, v in (("params", self.param_dtype), ("reduce", self.reduce_dtype)) if v)
        shard = f", shard {self.hsdp_shard}" if self.hsdp_shard else ""
        parts = [f"dp={self.dp} ({self.dp_mode}{shard}{mixed})"]
        if self.tp > 1:
            parts.append(f"tp={self.tp}" + (" (sequence parallel)" if self.sequence_parallel else ""))
        if self.cp > 1:
            parts.append(f"cp={self.cp} (ring attention)")
        if self.pp > 1:
            parts.append(f"pp={self.pp} ({self.schedule}, m={self.micro_batches}, v={self.stages_per_rank})")
        elif self.micro_batches > 1:
            parts.append(f"m={self.micro_batches} (gradient accumulation)")
        return " x ".join(parts)


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SymacctError(f"{name} must be a positive whole number, not {value!r}", hint=f"pass {name}=1 or more")
    return value


def make_layout(
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    *,
    world: int | None = None,
    **options: Any,
) -> Layout:
    """A checked ``Layout``: degrees positive, modes known, ``world = dp * tp * pp * cp`` when given.

    Context parallelism (``cp > 1``) is derived alone, with data parallelism (HSDP included), with tensor
    parallelism, with a pipeline, or all of them. Whether ``tp`` divides the model's sizes is the
    derivation's to check (``Accounting.at`` refuses a size its constraints rule out: heads, F, V, S for
    sequence parallelism; S a multiple of ``2 * cp``)."""
    unknown = set(options) - {f.name for f in dataclasses.fields(Layout)}
    if unknown:
        raise SymacctError(f"unknown layout option(s): {', '.join(sorted(unknown))}")
    lay = Layout(
        dp=_positive("dp", dp), tp=_positive("tp", tp), pp=_positive("pp", pp), cp=_positive("cp", cp), **options
    )
    _positive("micro_batches", lay.micro_batches)
    _positive("stages_per_rank", lay.stages_per_rank)
    if lay.dp_mode not in DP_MODES:
        raise SymacctError(f"unknown data-parallel mode {lay.dp_mode!r}", hint=f"one of {', '.join(DP_MODES)}")
    if lay.schedule not in SCHEDULES:
        raise SymacctError(f"unknown pipeline schedule {lay.schedule!r}", hint=f"one of {', '.join(SCHEDULES)}")
    if world is not None and lay.world != world:
        raise SymacctError(
            f"the layout has dp*tp*pp*cp = {lay.dp}*{lay.tp}*{lay.pp}*{lay.cp} = {lay.world} ranks, "
            f"not the world size {world}",
            hint="choose degrees whose product is the number of GPUs",
        )
    if lay.sequence_parallel and lay.tp == 1:
        raise SymacctError("sequence parallelism splits the sequence over the tensor-parallel group", hint="tp >= 2")
    _check_mixed(lay)
    if lay.hsdp_shard is not None:
        _positive("hsdp_shard", lay.hsdp_shard)
        if lay.dp_mode != "fsdp":
            raise SymacctError("hsdp_shard is an FSDP2 (HSDP) option", hint="pass dp_mode='fsdp' with hsdp_shard")
        if lay.dp % lay.hsdp_shard:
            raise SymacctError(
                f"the HSDP shard group ({lay.hsdp_shard}) does not divide dp={lay.dp}",
                hint="dp must be shard * replicate",
            )
    if lay.tp > 1 and lay.replicas > 1 and lay.dp_mode != "fsdp":
        # measured (tests/test_tensor_parallel.py): under PyTorch's DDP + TP composition each DTensor gradient
        # is redistributed to its parameter's placement in backward (the embedding's whole-vocabulary gradient
        # sharded there, sequence parallelism's norm all-reduces moved from the optimizer into backward), so
        # its gradients, collectives and peak are not the traced tensor-parallel rank's
        raise SymacctError(
            f"{lay.dp_mode} over tensor-parallel ranks is not derived: PyTorch composes data parallelism with "
            "tensor parallelism by FSDP2 (torchtitan refuses DDP with a second mesh dimension); DDP over DTensor "
            "parameters runs only through the private _pre_dp_module_transform, whose gradients and collectives "
            "differ from the traced tensor-parallel rank's",
            hint="dp_mode='fsdp' (--dp-mode fsdp; hsdp_shard for replicas), or tp=1",
        )
    if lay.pp > 1 and lay.dp_mode == "zero2" and lay.replicas > 1:
        raise SymacctError(
            "zero2 with a pipeline is not derived (PyTorch's pipeline accumulates the gradients unsharded over "
            "the micro-batches and reduces them once: FSDP2's way)",
            hint="with pp > 1 use dp_mode='ddp', 'zero1' or 'fsdp'",
        )
    if lay.bucket_view and (lay.pp > 1 or lay.micro_batches > 1):
        raise SymacctError(
            "gradient_as_bucket_view with a pipeline or gradient accumulation is not derived yet (the gradients "
            "of the no_sync micro-batches are tensors of their own until the last backward copies them in)",
            hint="drop bucket_view (--bucket-view), or use m=1 without a pipeline",
        )
    if lay.pp == 1 and (lay.schedule == "interleaved" or lay.stages_per_rank > 1):
        raise SymacctError("an interleaved schedule needs a pipeline", hint="pass pp > 1, or schedule='1f1b'")
    if lay.schedule == "interleaved":
        if lay.stages_per_rank < 2:
            raise SymacctError("the interleaved schedule needs v >= 2 stages per rank", hint="pass stages_per_rank=2")
        if lay.micro_batches % lay.pp:
            raise SymacctError(
                f"the interleaved schedule needs m divisible by pp ({lay.micro_batches} micro-batches, pp={lay.pp})",
                hint="PyTorch's ScheduleInterleaved1F1B runs micro-batches in rounds of pp",
            )
    elif lay.stages_per_rank > 1:
        raise SymacctError(f"{lay.schedule} runs one stage per rank", hint="use schedule='interleaved' for v > 1")
    if lay.pp > 1 and lay.schedule == "1f1b" and lay.micro_batches < lay.pp:
        raise SymacctError(
            f"1F1B needs at least pp micro-batches ({lay.micro_batches} < pp={lay.pp})",
            hint="raise micro_batches, or use schedule='gpipe'",
        )
    return lay


MIXED_DTYPES = ("bf16", "fp16", "fp32")


def _check_mixed(lay: Layout) -> None:
    """FSDP2's ``MixedPrecisionPolicy``: short dtype names, on a sharded data-parallel layout."""
    for name in ("param_dtype", "reduce_dtype"):
        value = getattr(lay, name)
        if value is not None and value not in MIXED_DTYPES:
            raise SymacctError(f"{name}={value!r} is not a dtype name", hint=f"one of {', '.join(MIXED_DTYPES)}")
    if (lay.param_dtype or lay.reduce_dtype) and (lay.dp_mode != "fsdp" or lay.replicas == 1):
        raise SymacctError(
            "param_dtype and reduce_dtype are FSDP2's MixedPrecisionPolicy: they need dp_mode='fsdp' and dp >= 2",
            hint="for one device, derive with params_dtype= or autocast=",
        )


def check_model(lay: Layout, layers: int | None, stacks: list[str]) -> None:
    """The layout against the model: pp needs one layer stack whose L (times v) it divides."""
    if lay.pp == 1:
        return
    if len(stacks) != 1 or layers is None:
        raise SymacctError(
            f"a pipeline needs one stack of repeated blocks; this model has {len(stacks)}",
            hint="pp=1, or a model with its blocks in one nn.ModuleList",
        )
    chunks = lay.pp * lay.stages_per_rank
    if layers % chunks:
        raise SymacctError(
            f"pp*v = {chunks} pipeline stages do not divide the {layers} layers of '{stacks[0]}'",
            hint="choose pp (and v) dividing L: uneven stages are not derived",
        )
