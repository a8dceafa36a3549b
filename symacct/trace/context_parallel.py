"""Context parallelism in a trace: PyTorch's ring attention (``torch.distributed.tensor.experimental``'s
``context_parallel``) on its fake process group, so that the traced step is one rank's.

PyTorch's ``context_parallel(mesh, buffers=..., buffer_seq_dims=...)`` shards the given tensors along the
sequence in place (head-tail load balancing: rank r of cp keeps chunks r and 2cp-1-r of 2cp) and replaces
``F.scaled_dot_product_attention`` by a ring: each rank keeps its queries and all-gathers the keys and
values of the group (one all-gather a call, forward; again in backward, where the key/value gradients
travel round the ring in fp32, one all-to-all a step), merging the partial outputs by their logsumexp.
PyTorch routes the CUDA kernels (flash, memory-efficient, cuDNN) to the ring; the CPU's SDPA kernel
(``_scaled_dot_product_flash_attention_for_cpu``, which returns the logsumexp the ring merges by) is routed
here to the same ring functions, ``_templated_ring_attention`` and its backward, unchanged. A real gloo run
with this routing gives the loss and gradients of one process (``tests/test_context_parallel.py``).

What is sharded: every input tensor along dim 1 (token ids and targets, ``(B, S)``), and the buffers the
model names in ``context_parallel_buffers()`` (the reference Llama: its rotary tables, along dim 0, which
therefore have S rows: ``S_max = S``, torchtitan's convention). S must be a multiple of ``2 * cp``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from symacct.errors import SymacctError

SEQ_DIM = 1  # the sequence dimension of every input tensor, (B, S)
_RING_CALLS = [0]  # ring attention calls since the last sharded step began (the check that attention is SDPA)


def _ops() -> tuple[Any, Any]:
    aten = torch.ops.aten
    return (
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    )


def _cpu_ring(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """DTensor's handler of the CPU SDPA kernel under context parallelism: PyTorch's ring functions on the
    local shards (sequence dim 2 of (B, H, S, Dh)), the results sharded the same way."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    forward, _ = _ops()
    _RING_CALLS[0] += 1
    info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    mesh = info.compute_mesh
    group = mesh.get_group()
    if op_call is forward:
        names = ("query", "key", "value", "dropout_p", "is_causal")
        call = dict(zip(names, info.local_args)) | dict(info.local_kwargs)
        if call.get("attn_mask") is not None:
            raise SymacctError(
                "context parallelism runs causal attention without a mask (PyTorch's ring attention)",
                op=str(op_call),
                hint="call F.scaled_dot_product_attention(q, k, v, is_causal=True)",
            )
        call.pop("attn_mask", None)
        q, k, v = call.pop("query"), call.pop("key"), call.pop("value")
        causal = call.pop("is_causal", False)
        out = ring._templated_ring_attention(group, 2, forward, q, k, v, is_causal=causal, **call)
    else:
        names = ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal")
        call = dict(zip(names, info.local_args)) | dict(info.local_kwargs)
        call.pop("attn_mask", None)
        _, backward = _ops()
        out = ring._templated_ring_attention_backward(
            group,
            2,
            backward,
            call.pop("grad_out"),
            "grad_out",
            call.pop("query"),
            call.pop("key"),
            call.pop("value"),
            call.pop("out"),
            call.pop("logsumexp"),
            call.pop("is_causal"),
            **call,
        )
    return tuple(DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in out)


@contextlib.contextmanager
def _cpu_routed() -> Iterator[None]:
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    saved = {op: handlers.get(op) for op in _ops()}
    handlers.update(dict.fromkeys(_ops(), _cpu_ring))
    try:
        yield
    finally:
        for op, old in saved.items():
            if old is None:
                handlers.pop(op, None)
            else:
                handlers[op] = old


def model_buffers(model: nn.Module) -> list[tuple[torch.Tensor, int]]:
    """The model's own tensors that follow the sequence: ``model.context_parallel_buffers()`` ((tensor,
    sequence dim) pairs; an empty list for a model whose positions all come with its inputs). A model
    without the method is refused: positions it makes itself (``arange(S)``) would be each shard's own."""
    own = getattr(model, "context_parallel_buffers", None)
    if not callable(own):
        raise SymacctError(
            f"{type(model).__name__} does not say which of its tensors follow the sequence "
            "(context_parallel_buffers): positions it makes from the local length would be wrong on every rank",
            hint="give the model a method context_parallel_buffers() returning [(tensor, seq_dim), ...] "
            "(its position tables; [] when positions come with the inputs)",
        )
    return list(own())


def sequence_buffers(model: nn.Module, args: Any) -> list[tuple[torch.Tensor, int]]:
    """What a context-parallel step shards: every input tensor along dim 1, then the model's buffers."""
    inputs = list(args.values()) if isinstance(args, dict) else list(args)
    found = [(t, SEQ_DIM) for t in inputs if isinstance(t, torch.Tensor)]
    if not found:
        raise SymacctError(
            "context parallelism shards the inputs along the sequence: this step has no input tensor",
            hint="pass inputs whose dim 1 is the sequence (B, S)",
        )
    for t, dim in found:
        if t.dim() <= dim:
            raise SymacctError(
                f"an input of shape {tuple(t.shape)} has no sequence dimension {dim} to shard",
                shapes=[tuple(t.shape)],
                hint="context parallelism takes inputs of shape (B, S, ...)",
            )
    return found + model_buffers(model)


@contextlib.contextmanager
def sharded(model: nn.Module, args: Any, mesh: Any) -> Iterator[None]:
    """One rank's context-parallel step inside the block: the inputs and the model's sequence buffers sharded
    by PyTorch's ``context_parallel`` over ``mesh``, SDPA run as its ring (the CPU kernel routed to it)."""
    from torch.distributed.tensor.experimental import context_parallel

    pairs = sequence_buffers(model, args)
    S = pairs[0][0].shape[SEQ_DIM]
    cp = mesh.size()
    for t, dim in pairs:
        if t.shape[dim] != S:
            raise SymacctError(
                f"a tensor sharded along the sequence has {t.shape[dim]} rows at dim {dim}, the inputs S = {S}",
                shapes=[tuple(t.shape)],
                hint="context parallelism shards the model's sequence buffers whole: build it with S_max = S",
            )
    if S % (2 * cp):
        raise SymacctError(
            f"context parallelism over {cp} ranks splits the sequence into 2*cp = {2 * cp} chunks: S = {S}",
            hint=f"choose S a multiple of {2 * cp}",
        )
    _RING_CALLS[0] = 0
    with _cpu_routed(), context_parallel(mesh, buffers=[t for t, _ in pairs], buffer_seq_dims=[d for _, d in pairs]):
        yield
        if _RING_CALLS[0] == 0:
            raise SymacctError(
                "context parallelism ran no attention as a ring: this model's attention is not "
                "F.scaled_dot_product_attention, and would attend within each rank's shard only",
                hint="build the model with SDPA attention (the reference models: sdpa=True)",
            )
