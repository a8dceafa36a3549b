"""Record one training step at aten level on fake tensors.

The step (forward, backward, optionally the optimizer) runs under
``FakeTensorMode``: every tensor has a shape, a dtype and a (meta) storage,
but nothing of real size is allocated. A ``TorchDispatchMode`` stacked on top
of it sees every aten op that reaches dispatch (the same ops that
``torch.utils.flop_counter.FlopCounterMode`` sees), and records:

- the op, its arguments with tensors replaced by :class:`TMeta`,
- the module path (``blocks.1.attn.c_attn``), named as PyTorch's ``ModTracker`` names it (a module
  shared by several parents: as the child of the one calling it),
- the phase (forward / backward / optimizer),
- which storages autograd saves for backward (``saved_tensors_hooks``).

Shapes here are concrete integers (the probe sizes); ``symbolize`` turns
them into sympy expressions afterwards.

A tensor-parallel model (DTensor parameters, ``symacct.trace.tensor_parallel``) is recorded as one rank
runs it: the mode lets each DTensor op through to DTensor's own dispatch and records the ops DTensor runs
on the local shards and the collectives it issues; DTensor's output-shape propagation (ops on global-shape
fake tensors) is not recorded; a DTensor's storage is its local shard's.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import compress
from typing import Any

import sympy
import torch
from torch import nn
from torch._subclasses.fake_tensor import _DISPATCH_META_HANDLERS, FakeTensor, FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from symacct.errors import SymacctError
from symacct.trace import eager, known, versions, views
from symacct.trace.counted import counted_flops
from symacct.trace.engine import Saved, refusing_hooks
from symacct.trace.engine import backward as engine_backward
from symacct.trace.loops import INDEXING, SPLITTING, SizeLoops, walk_refusal
from symacct.trace.saved import composing, noting_disabled
from symacct.trace.sdpa import choosing, forced
from symacct.trace.sdpa_choice import Target

aten = torch.ops.aten
_EXPIRED = torch.UntypedStorage._expired  # type: ignore[attr-defined]  # the C call StorageWeakRef.expired makes

# PyTorch's fused inference paths (eval mode, no grad, batch_first, an even head count): one op allocates
# and frees the layer's inner buffers (the attention scores among them), which no trace of ops can see, and
# FlopCounterMode counts it as 0. Refused; the unfused path runs the same arithmetic as separate ops.
_FUSED_INFERENCE = {
    aten._transformer_encoder_layer_fwd.default: "nn.TransformerEncoderLayer",
    aten._native_multi_head_attention.default: "nn.MultiheadAttention",
}

_UNFUSED = "derive (and run) the unfused ops: torch.backends.mha.set_fastpath_enabled(False)"

# Metadata queries that are not computation (the same list FlopCounterMode skips).
_QUERIES = {
    aten.sym_is_contiguous.default,
    aten.is_contiguous.default,
    aten.is_contiguous.memory_format,
    aten.is_strides_like_format.default,
    aten.is_non_overlapping_and_dense.default,
    aten.size.default,
    aten.sym_size.default,
    aten.stride.default,
    aten.sym_stride.default,
    aten.storage_offset.default,
    aten.sym_storage_offset.default,
    aten.numel.default,
    aten.sym_numel.default,
    aten.dim.default,
    torch.ops.prim.layout.default,
    torch.ops.prim.device.default,
}


@dataclass(frozen=True)
class TMeta:
    """A tensor as the rules see it: shape, dtype and the value it belongs to."""

    shape: tuple[Any, ...]  # ints while recording, sympy expressions after symbolize
    dtype: torch.dtype
    vid: int  # value id: one per distinct tensor object seen in the step
    storage: int  # storage id: values that share memory share it

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


@dataclass
class OpRecord:
    """One aten op of the step."""

    index: int
    op: torch._ops.OpOverload
    module: str  # innermost module path, '' for the root
    phase: str  # 'forward' | 'backward' | 'optimizer'
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: Any  # the op's return value with TMeta in place of tensors
    outputs: list[TMeta]  # flattened tensor outputs
    inputs: list[TMeta]  # flattened tensor arguments
    is_view: bool  # every output aliases an input without writing it
    mutated: list[TMeta]  # arguments the op writes in place
    out_shapes: tuple[tuple[int, ...], ...] = ()  # the shapes of the tensors it returns
    # an ``only_ops`` record of an op PyTorch counts the FLOPs of: its count (``symacct.trace.counted``; else None)
    flops: int | None = None


@dataclass
class Placeholder:
    """A tensor that enters the step from outside: parameter, buffer or input."""

    kind: str  # 'param' | 'buffer' | 'input' | 'state'
    name: str
    meta: TMeta


@dataclass
class StepTrace:
    """All ops of one step in execution order, plus what entered and what was saved."""

    ops: list[OpRecord] = field(default_factory=list)
    placeholders: list[Placeholder] = field(default_factory=list)
    saved_storages: dict[int, int] = field(default_factory=dict)  # storage -> nbytes
    storage_producer: dict[int, int] = field(default_factory=dict)  # storage -> op index
    storage_nbytes: dict[int, int] = field(default_factory=dict)
    # storage -> (shape, itemsize) of a tensor that spans it: its size read dimension by dimension
    storage_shape: dict[int, tuple[tuple[int, ...], int]] = field(default_factory=dict)
    # storage -> elements it holds beyond that tensor's: a kernel's buffer resized down (``eager.bag_buffers``)
    storage_extra: dict[int, int] = field(default_factory=dict)
    external_storages: set[int] = field(default_factory=set)  # params, buffers, inputs
    param_names: dict[int, list[str]] = field(default_factory=dict)  # storage -> names
    # parameter name (tied ones under each name) -> its shape as built (a DTensor's: the whole, unsharded)
    param_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    param_dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # parameter name -> its dtype as traced
    param_frozen: set[str] = field(default_factory=set)  # parameters that require no gradient
    hooks: dict[str, tuple[str, ...]] = field(default_factory=dict)  # as built (symacct.trace.hooks), set by derive
    buffer_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # buffer name (shared: each) -> shape
    buffer_dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # buffer name -> its dtype as traced
    module_names: list[str] = field(default_factory=list)  # named_modules order
    module_types: dict[str, str] = field(default_factory=dict)  # path -> class name
    # memory bookkeeping
    marks: dict[str, int] = field(default_factory=dict)  # 'after_forward' ... -> number of ops before the mark
    grad_storages: dict[int, str] = field(default_factory=dict)  # storage -> parameter name
    state_storages: dict[int, tuple[str, str]] = field(default_factory=dict)  # storage -> (parameter, state key)
    held_storages: set[int] = field(default_factory=set)  # kept alive to the end of the step (the loss)
    loss_storage: int | None = None  # the training step's loss
    cache_storages: set[int] = field(default_factory=set)  # the KV cache after a serving step (args["cache"])
    # what a step's forward changed in the model itself (a module replaced, a parameter or buffer added or
    # removed: work done once, on a first call), or "" (``changed_itself``); ``warmed``: the same, for a trace
    # taken after one untraced call (record_step's ``warm``)
    changed: str = ""
    warmed: str = ""
    cache_untouched: bool = False  # a KV cache given (args["cache"]) that the step neither filled nor extended
    # storages only reference cycles hold (record_step's ``cycles``): -> "step" (so at the step's end, with the
    # output and the loss still held) or "after" (once the caller drops them)
    cycle_held: dict[int, str] = field(default_factory=dict)
    owner: dict[int, str] = field(default_factory=dict)  # storage -> parameter it belongs to (param, grad, state)
    storage_end: dict[int, float] = field(default_factory=dict)  # storage -> position it died at (see reap)
    persistent_buffers: set[int] = field(default_factory=set)  # buffer storages that state_dict() saves
    # storages on the CPU: all of a CPU step's; on CUDA, those eager code keeps there (AdamW's step counters)
    storage_device: dict[int, str] = field(default_factory=dict)
    # SDPA kernels run on CUDA (how the note describes each -> calls); symacct.trace.sdpa
    sdpa_kernels: dict[str, int] = field(default_factory=dict)
    groups: dict[str, str] = field(default_factory=dict)  # process group name -> its mesh dimension (tp, cp)
    # (stacks, ops left out) -> the forward and backward ops by key (symacct.sameness; a memoised probe's reused)
    op_groups: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    def note_storage(self, st: int, t: torch.Tensor) -> None:
        """Record the bytes of storage ``st`` and, when ``t`` spans it, the shape they come from."""
        t = local(t)
        nbytes = t.untyped_storage().nbytes()
        self.storage_nbytes[st] = nbytes
        if t.device.type == "cpu":
            self.storage_device[st] = "cpu"
        extra = eager.KEPT.get(t, 0)
        if (t.numel() + extra) * t.element_size() == nbytes:
            self.storage_shape[st] = (tuple(int(d) for d in t.shape), t.element_size())
            if extra:
                self.storage_extra[st] = extra

    def bytes_of(self, st: int, read: Callable[[int], Any], nbytes: int | None = None) -> Any:
        """The bytes of a storage as a formula: itemsize times the product of its dimensions read one by one
        (a product of shifted sizes such as (H + 2*H_kv)*D/H times D reads only so), with the elements a kernel
        kept beyond them (``storage_extra``), else the number read whole. A parameter or buffer whose size reads
        in no symbols (a part the model never runs in the step, built from a nested config the probes keep, such
        as GIT's image encoder in a text-only step, 197 patch positions wide) counts as the number it is: its
        bytes are then checked against the second probe with every parameter's and buffer's (``_check_memory``)."""
        nb = self.storage_nbytes.get(st, nbytes) if nbytes is None else nbytes
        shape = self.storage_shape.get(st)
        extra = self.storage_extra.get(st, 0)
        if shape is not None and shape[0] and (math.prod(shape[0]) + extra) * shape[1] == nb:
            dims = [read(d) for d in shape[0]]
            if all(d is not None for d in dims):
                return shape[1] * (math.prod(dims) + extra)
        got = read(nb)
        if got is None and isinstance(nb, int) and self._built(st):
            return sympy.Integer(nb)
        return got

    def _built(self, st: int) -> bool:
        """Whether a storage is a parameter's or a buffer's."""
        return any(ph.meta.storage == st for ph in self.placeholders if ph.kind in ("param", "buffer"))


class _Paused:
    """Depth of DTensor sharding propagations under way: the ops they run on global-shape fake tensors to
    learn an output's shape are not the rank's computation, and are not recorded."""

    def __init__(self) -> None:
        self.depth = 0


_SHARDING_PROP = _Paused()


@functools.cache
def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a build without torch.distributed
        return None
    return DTensor


def dtensor_op(types: Any) -> bool:
    """Whether a dispatch mode sees a DTensor op (its ``types``): a mode that returns NotImplemented for it
    lets DTensor's own dispatch run, and then sees the local ops on each shard."""
    dt = _dtensor_type()
    return dt is not None and any(t is dt for t in types)


@contextlib.contextmanager
def _sharding_prop_unrecorded() -> Any:
    """While active, DTensor's output-shape propagation runs unrecorded (see ``_Paused``)."""
    if _dtensor_type() is None:
        yield
        return
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    orig = ShardingPropagator._propagate_tensor_meta_non_cached

    def unrecorded(self: Any, op_schema: Any) -> Any:
        _SHARDING_PROP.depth += 1
        try:
            return orig(self, op_schema)
        finally:
            _SHARDING_PROP.depth -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = unrecorded  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = orig  # type: ignore[method-assign]


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds and computes on); any other tensor itself."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


class _Ids:
    """Small ids for the tensors and storages of the step, and when each storage dies.

    Nothing here holds a tensor: storages are watched through weak references,
    so they die exactly when eager PyTorch (the same Python code, the same
    references, autograd's saved tensors) lets them go.
    """

    def __init__(self) -> None:
        self._values: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._n_values = 0
        self._storages: dict[int, int] = {}  # live storage address -> storage id
        self._refs: dict[int, tuple[int, StorageWeakRef]] = {}  # storage id -> (address, weak ref)
        self._live: dict[int, int] = {}  # storage id -> its weak reference's handle, while alive

    def meta(self, t: torch.Tensor) -> TMeta:
        t = local(t)
        vid = self._values.get(t)
        if vid is None:
            vid = self._values[t] = self._n_values
            self._n_values += 1
        return TMeta(tuple(int(s) for s in t.shape), t.dtype, vid, self.storage(t))

    def same_value(self, alias: torch.Tensor, t: torch.Tensor) -> None:
        """``alias`` (what the pack hook keeps of a saved tensor: ``versions.alias``) is ``t``'s value: backward
        reads it where the forward made ``t``."""
        if alias is not t:
            self._values[local(alias)] = self.meta(t).vid

    def storage(self, t: torch.Tensor) -> int:
        st = local(t).untyped_storage()
        key = st._cdata
        sid = self._storages.get(key)
        if sid is None or self._refs[sid][1].expired():
            if sid is not None:  # the address was reused before a reap saw the old storage die: never reaped
                self._live.pop(sid, None)
            sid = len(self._refs)
            self._storages[key] = sid
            ref = StorageWeakRef(st)
            self._refs[sid] = (key, ref)
            self._live[sid] = ref.cdata
        return sid

    def reap(self) -> list[int]:
        """Storage ids that died since the last call (called before every op: the check is the one call
        StorageWeakRef.expired makes, mapped over the handles in C, without a Python frame per storage)."""
        live = self._live
        dead = list(compress(live, map(_EXPIRED, live.values())))
        for sid in dead:
            del self._live[sid]
            del self._storages[self._refs[sid][0]]
        return dead


def _grouped_mm_cpu(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``aten._grouped_mm`` on fake CPU tensors, as the CPU kernel does it.

    The meta kernel checks CUDA's rules (bf16 only), so a float32 mixture of
    experts that runs on a CPU could not be traced. The CPU kernel takes
    float32, bfloat16 and float16, wants every leading stride a multiple of 16
    bytes (checked here too, so that a size the kernel refuses is refused),
    and returns a contiguous tensor: (rows, N) for a 2-d input and 3-d
    weights (each row multiplied by its group's matrix), (groups, M, N) for
    two 2-d operands split along the contraction (the weight gradient).
    """
    allowed = (torch.float32, torch.bfloat16, torch.float16)
    if mat_a.dtype not in allowed or mat_b.dtype != mat_a.dtype:
        raise RuntimeError(f"Expected mat_a to be Float32, BFloat16 or Float16 matrix, got {mat_a.dtype}")
    for t in (mat_a, mat_b):
        lead = max(t.stride()[-2:])
        if (lead * t.element_size()) % 16:
            raise RuntimeError(f"strides should be multiple of 16 bytes (strides {tuple(t.stride())}, {t.dtype})")
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if a2 and b2:
        size = [offs.size(0) if offs is not None else 1, mat_a.size(0), mat_b.size(1)]
    elif a2:
        size = [mat_a.size(0), mat_b.size(-1)]
    elif b2:
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    return torch.empty(size, dtype=out_dtype or mat_a.dtype, device=mat_a.device)


def _made_like_input(func: Any) -> Callable[..., torch.Tensor]:
    """``func`` on fake CPU tensors, with the storage its CPU kernel leaves: ``im2col`` and ``col2im`` (nn.Unfold,
    nn.Fold) allocate their result like their input (``empty_like``), then resize it to its shape. The storage
    keeps the larger of the two sizes: F.fold of (2, 24, 7) columns into a (2, 8, 7, 1) image holds 1,344 bytes,
    not 448 (the meta kernel's)."""

    def run(inp: torch.Tensor, *args: Any) -> torch.Tensor:
        out = func(inp, *args)
        if inp.device.type != "cpu" or inp.numel() <= out.numel():
            return out
        whole = torch.empty(inp.numel(), dtype=out.dtype, device=out.device)
        return whole.as_strided(out.shape, out.stride())

    return run


# ops whose meta kernel follows another device's rules than the CPU kernel's: the CPU kernel's rules instead
_CPU_KERNELS: dict[Any, Callable[..., torch.Tensor]] = {
    aten._grouped_mm.default: _grouped_mm_cpu,
    aten.im2col.default: _made_like_input(aten.im2col.default),
    aten.col2im.default: _made_like_input(aten.col2im.default),
}


# ``_c10d_functional.wait_tensor`` returns the tensor it waited for (a collective's output, in place); its
# fake kernel makes a new tensor, which would count the output's bytes twice
_WAIT = getattr(getattr(getattr(torch.ops, "_c10d_functional", None), "wait_tensor", None), "default", None)


def _run(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run an op on fake tensors: by the CPU kernel's rules where the meta kernel's differ (and
    ``wait_tensor`` as eager PyTorch runs it: its input back)."""
    if func is _WAIT:
        return args[0]
    own = _CPU_KERNELS.get(func)
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if own is not None and first is not None and first.device.type == "cpu":
        return own(*args, **kwargs)
    return func(*args, **kwargs)


class _CpuKernels(TorchDispatchMode):
    """Ops on fake tensors by the CPU kernels' rules where the meta kernels' differ (``_run``)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        return _run(func, args, kwargs or {})


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """An untraced call of the model on fake tensors (a first call, a call that reads a cache's layout), run as
    the traced one is: ops by the CPU kernels' rules (a float32 mixture of experts' grouped matmuls), and a
    failing meta kernel's traceback not logged (the caller refuses, or derives again)."""
    with _quiet("torch._subclasses.fake_tensor"), _CpuKernels():
        yield


def _split_lists(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> list[tuple[Any, Any, Any]]:
    """A foreach or fused-optimizer op over N tensors, as N one-tensor calls.

    Each parameter's share then has its own node (its module, its
    multiplicity in the layer stack); every list argument of length N is
    indexed, other arguments are shared.
    """
    name = func.overloadpacket.__name__
    if not (name.startswith("_foreach_") or name.startswith("_fused_")) or not args:
        return [(args, kwargs, out)]
    if not isinstance(args[0], (list, tuple)) or len(args[0]) <= 1:
        return [(args, kwargs, out)]
    n = len(args[0])

    def pick(x: Any, i: int) -> Any:
        return [x[i]] if isinstance(x, (list, tuple)) and len(x) == n else x

    calls = []
    for i in range(n):
        o = [out[i]] if isinstance(out, (list, tuple)) and len(out) == n else out
        calls.append((tuple(pick(a, i) for a in args), {k: pick(v, i) for k, v in kwargs.items()}, o))
    return calls


@functools.cache
def _mutated_args(op: torch._ops.OpOverload) -> list[int]:
    """Indices of the arguments the op writes in place, from its schema."""
    return [i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def _metas(x: Any, meta: Callable[[Any], Any], found: list[Any], tensors: list[torch.Tensor] | None = None) -> Any:
    """``x`` with every tensor replaced by ``meta(tensor)``; the replacements appended to ``found`` (and the
    tensors to ``tensors``) in the order ``tree_flatten`` gives. An op's arguments and results are tensors,
    plain scalars and (nested) tuples, lists and dicts: those are walked here directly, for speed (this runs
    for every op of every trace); any other container goes through pytree."""
    if isinstance(x, torch.Tensor):
        m = meta(x)
        found.append(m)
        if tensors is not None:
            tensors.append(x)
        return m
    cls = type(x)
    if cls is tuple or cls is list:
        return cls(_metas(v, meta, found, tensors) for v in x)
    if cls is dict:
        return {k: _metas(v, meta, found, tensors) for k, v in x.items()}
    if x is None or cls in _LEAVES:
        return x
    leaves, spec = tree_flatten(x)
    if spec.is_leaf():
        return x
    return tree_unflatten([_metas(v, meta, found, tensors) for v in leaves], spec)


# kernels whose outputs hold a size rounded up: op -> (output index, dim, multiple, input index, its dim)
_PADDED = {
    # the memory-efficient attention kernel's logsumexp: (B, H, 32*ceiling(M/32)) for M queries
    "aten._scaled_dot_product_efficient_attention.default": (1, 2, 32, 0, 2),
}


def padded_sizes(trace: StepTrace) -> dict[int, tuple[int, int]]:
    """The rounded-up sizes the step's kernels made (``_PADDED``): value -> (multiple, the size it rounds), for
    ``Probe.pad``; a size that needed no rounding is left out."""
    out: dict[int, tuple[int, int]] = {}
    for rec in trace.ops:
        how = _PADDED.get(str(rec.op))
        if how is None:
            continue
        o, d, multiple, i, j = how
        if len(rec.outputs) <= o or len(rec.inputs) <= i:
            continue
        got, of = rec.outputs[o].shape[d], rec.inputs[i].shape[j]
        if got and got != of and got == multiple * -(-of // multiple):
            out[got] = (multiple, of)
    return out


def op_record(
    index: int,
    func: Any,
    module: str,
    phase: str,
    args: Any,
    kwargs: Any,
    out: Any,
    meta: Callable[[torch.Tensor], TMeta],
    tensors: list[torch.Tensor] | None = None,
) -> OpRecord:
    """One op as a record: its arguments and result with ``meta(tensor)`` in place of tensors, what it writes
    in place (from its schema), and whether it is a view (``tensors`` gets the output tensors)."""
    inputs: list[TMeta] = []
    margs = _metas(args, meta, inputs)
    mkwargs = _metas(kwargs, meta, inputs)
    outputs: list[TMeta] = []
    mout = _metas(out, meta, outputs, tensors)
    mutated: list[TMeta] = []
    for i in _mutated_args(func):
        # a written argument passed by position, or by name (out= of the .out overloads)
        name = func._schema.arguments[i].name
        _tmetas(margs[i] if i < len(margs) else mkwargs.get(name), mutated)
    in_storages = {m.storage for m in inputs}
    # a view: writes nothing and every output shares an input's storage
    # (by storage, not schema: aten._unsafe_view has no alias annotation)
    is_view = not mutated and bool(outputs) and all(m.storage in in_storages for m in outputs)
    shapes = tuple(tuple(m.shape) for m in outputs)
    return OpRecord(index, func, module, phase, margs, mkwargs, mout, outputs, inputs, is_view, mutated, shapes)


def _tmetas(x: Any, found: list[TMeta]) -> None:
    """Append every TMeta in (nested) tuples, lists and dicts ``x`` to ``found``."""
    if isinstance(x, TMeta):
        found.append(x)
    elif isinstance(x, (tuple, list)):
        for v in x:
            _tmetas(v, found)
    elif isinstance(x, dict):
        for v in x.values():
            _tmetas(v, found)


_LEAVES = (int, float, bool, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _text(e: BaseException) -> str:
    """An exception's whole message on one line (the CLI prints errors as one line; nothing is cut)."""
    return " ".join(str(e).split())


def _strided_only(func: Any, out: Any, index: int, module: str) -> None:
    """Refuse an op that returns a sparse (or other non-strided) tensor: its bytes and the costs of the ops that
    read it are set by how many of its entries are stored, a count of values that a fake tensor does not have
    (``nn.Embedding(sparse=True)``'s gradient, for one)."""
    tensors = (out,) if isinstance(out, torch.Tensor) else out if isinstance(out, (tuple, list)) else ()
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.layout != torch.strided:
            raise SymacctError(
                f"the step makes a tensor of layout {t.layout}: its bytes and the costs of the ops that read it "
                "depend on how many entries it stores (values), which a trace on fake tensors does not have",
                node=f"#{index}",
                module=module,
                op=str(func),
                shapes=[tuple(t.shape)],
                hint="keep the step's tensors dense: nn.Embedding(..., sparse=False) (the default) and "
                "EmbeddingBag likewise, no to_sparse() in forward",
            )


def _failure(func: Any, e: Exception) -> tuple[str, str]:
    """What went wrong when an op failed on fake tensors, and what the user can do about it."""
    if "convert all Tensors to FakeTensors" in str(e):
        return (
            "a real tensor reached the traced step",
            "keep every tensor the step uses in a parameter or a registered buffer, or make it inside forward; "
            "a tensor held in a plain attribute or a global is not faked",
        )
    name = type(e).__name__
    if "data-dependent" in name.lower() or "DataDependent" in name or func in _VALUE_READS:
        if _validating_distribution():
            return (
                "the step depends on tensor values: torch.distributions checks a distribution's arguments by "
                "reading them (validate_args, on by default)",
                "symacct traces with fake tensors and cannot read values: construct the distribution with "
                "validate_args=False, or call torch.distributions.Distribution.set_default_validate_args(False)",
            )
        return (
            "the step depends on tensor values (data-dependent control flow or output shape)",
            "symacct traces with fake tensors and cannot read values: replace the "
            "value-dependent branch (e.g. .item(), nonzero, bool(tensor)) by tensor ops",
        )
    if "DynamicOutputShape" in name:
        return (
            f"the step depends on tensor values: {func} returns as many elements as its input's values select",
            "symacct traces with fake tensors and cannot read values: keep the shape fixed with a mask "
            "(torch.where(mask, x, 0) for x[mask] or masked_select, a padded index for nonzero or unique)",
        )
    if any(k in str(e) for k in ("expected dtype", "expected scalar type", "Expected object of scalar type")):
        return (
            f"the op refuses its arguments' dtypes: {name}: {_text(e)}",
            "give its tensor arguments one dtype (under autocast, an op autocast does not cast can get a "
            "low-precision tensor beside a float32 one, which eager PyTorch refuses as well: lerp, for one)",
        )
    if "grouped_mm" in str(func):
        return (
            f"the op failed on fake tensors: {name}: {_text(e)}",
            "the CPU grouped-matmul kernel (a mixture of experts) takes float32, bfloat16 or float16 and wants "
            "row strides of a multiple of 16 bytes: widths a multiple of 4 (float32) or 8 (16-bit)",
        )
    return (
        f"the op failed on fake tensors: {name}: {_text(e)}",
        "the step runs at probe sizes of symacct's choosing (distinct primes): a size typed in rather than "
        "taken from the config or the inputs (an input of fixed width, a view to a literal size) breaks there; "
        "derive every size from the model's fields",
    )


_VALUE_READS = (aten._local_scalar_dense.default, aten.nonzero.default)


def _validating_distribution() -> bool:
    """Whether a ``torch.distributions`` argument check (``Distribution.__init__`` with ``validate_args``, or
    ``_validate_sample``) is under way on the Python stack: its value read is the failure to name."""
    frame = sys._getframe()
    while frame is not None:
        code = frame.f_code
        if code.co_name in ("__init__", "_validate_sample") and code.co_filename.endswith(
            os.path.join("torch", "distributions", "distribution.py")
        ):
            return True
        frame = frame.f_back
    return False


class _Recorder(TorchDispatchMode):
    def __init__(
        self, trace: StepTrace, ids: _Ids, root: str, only_ops: bool = False, size_primes: dict[int, str] | None = None
    ) -> None:
        super().__init__()
        self.only_ops = only_ops
        self.loops = SizeLoops(size_primes or {})  # a Python loop over a size, refused as soon as it is seen
        self.trace = trace
        self.ids = ids
        self.root = root
        self.active: list[str] = []  # the forward's module calls under way, outermost first
        self.calls: list[nn.Module] = []  # the modules of those calls
        self.known: dict[int, str] = {}  # id(module) -> its name as ModTracker gives it ('GPT2.blocks.0')
        self.seen: set[int] = set()
        self.phase = "forward"
        self.seq_module: dict[int, str] = {}  # autograd sequence number -> module path
        self.seq_seen = -1  # the last sequence number given a module
        self.names: dict[int, str] = {}  # id(module) -> path
        self.recomputing: list[str] = []  # modules whose forward runs again inside backward
        # a recomputed call's inputs (reentrant checkpointing detaches them; a nested backward accumulates their
        # gradients): the module that call runs
        self.recompute_inputs: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.replays = views.Replays()  # views changed in place: their backward nodes as on a real tensor

    def _name(self, module: nn.Module) -> str:
        """A module's name as ``torch.distributed._tools.ModTracker`` names it: the root by its class, each
        child by its parent's name and its attribute (a module shared by two parents: the later one's; a call
        names it by its caller where it can, ``_called``)."""
        key = id(module)
        if key not in self.known:
            self.known[key] = type(module).__name__
        name = self.known[key]
        if key not in self.seen:
            for child_name, child in module.named_children():
                self.known[id(child)] = f"{name}.{child_name}"
                self._name(child)
            self.seen.add(key)
        return name

    def _called(self, module: nn.Module) -> str:
        """A module's name in this call: as a child of the module calling it (the innermost call under way),
        or by ``_name``. A module shared by the blocks of a stack (an activation instance passed to each, as
        OpenAI GPT's ``gelu_new``; a rotary table) is then each block's own, as an unshared one is."""
        if self.calls:
            parent = self.calls[-1]
            for attr, child in parent._modules.items():
                if child is module:
                    return f"{self.active[-1]}.{attr}"
        return self._name(module)

    def pre_hook(self, module: nn.Module, args: Any) -> None:
        self.active.append(self._called(module))
        self.calls.append(module)
        if self.phase == "backward" and id(module) in self.names:
            self.recomputing.append(self.names[id(module)])
            for t in tree_flatten(args)[0]:
                if isinstance(t, torch.Tensor):
                    self.recompute_inputs.setdefault(t, self.names[id(module)])

    def post_hook(self, module: nn.Module, args: Any, out: Any) -> None:
        for i in range(len(self.calls) - 1, -1, -1):
            if self.calls[i] is module:
                del self.active[i], self.calls[i]
                break
        if self.phase == "backward" and self.recomputing and id(module) in self.names:
            self.recomputing.pop()

    def reap(self, position: float) -> None:
        for sid in self.ids.reap():
            self.trace.storage_end.setdefault(sid, position)

    def mark(self, name: str) -> None:
        """A phase point between two ops; storages freed before it are dead at it."""
        self.reap(len(self.trace.ops) - 0.75)
        self.trace.marks[name] = len(self.trace.ops)

    def module(self) -> str:
        """Innermost module path of the op being dispatched.

        Forward: the innermost active module (the deepest name among the
        module calls under way, as ModTracker's ``parents`` gives it; the
        module hooks here track them without ModTracker's gradient hooks,
        which only the backward would use). Backward: the module
        whose forward op created the autograd node now running (matched by
        the node's sequence number), or the parameter's module for
        ``AccumulateGrad``.
        """
        if self.phase == "backward" and self.recomputing:
            return self.recomputing[-1]  # activation checkpointing: a forward run again in backward
        if self.phase == "backward":
            node = torch._C._current_autograd_node()
            if node is None:
                return ""
            seq = node._sequence_nr()
            if seq in self.seq_module:
                return self.seq_module[seq]
            var = getattr(node, "variable", None)
            if var is not None:
                names = self.trace.param_names.get(self.ids.storage(var), [])
                return names[0].rpartition(".")[0] if names else self.recompute_inputs.get(var, "")
            return ""
        if self.phase == "optimizer":
            return ""  # set after the op is recorded, from the parameter its tensors belong to
        if not self.active:
            return ""
        inner = max(self.active, key=lambda n: n.count("."))
        return inner[len(self.root) + 1 :] if inner.startswith(self.root + ".") else ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func in _DISPATCH_META_HANDLERS and args and type(args[0]) is FakeTensor:
            # a fake tensor's device, sizes or strides, asked by C++ (autograd asks each tensor's device: two in
            # three of the calls here): answered by FakeTensorMode's own handler, as that mode would answer it
            return _DISPATCH_META_HANDLERS[func](args)
        kwargs = kwargs or {}
        if func in _QUERIES or func.namespace == "profiler" or _SHARDING_PROP.depth:
            return func(*args, **kwargs)
        if dtensor_op(types):
            return NotImplemented  # a DTensor op: its own dispatch runs the local ops, recorded here
        if func in _FUSED_INFERENCE:
            raise SymacctError(
                f"the step runs PyTorch's fused inference path of {_FUSED_INFERENCE[func]}: one op whose inner "
                "buffers (the attention scores among them) no trace of ops can see, and that FlopCounterMode "
                "counts as 0",
                node=f"#{len(self.trace.ops)}",
                module=self.module(),
                op=str(func),
                shapes=[tuple(a.shape) for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)],
                hint=f"{_UNFUSED}; PyTorch takes the fused path only in eval mode without grad, with batch_first "
                "and an even head count",
            )
        mixed = eager.mixed_loss(func, args)
        if mixed is not None:
            raise SymacctError(
                mixed,
                node=f"#{len(self.trace.ops)}",
                module=self.module(),
                op=str(func),
                shapes=[tuple(a.shape) for a in args if isinstance(a, torch.Tensor)],
                hint="give the target the prediction's dtype (target.to(pred.dtype)), or compute the loss in "
                "float32 (pred.float())",
            )
        answered, value = known.read(func, args)
        if answered:  # a value read whose answer is known without values (symacct.trace.known)
            return value
        if self.phase == "forward" and self.replays.pending:
            self.replays.resolve()
        elif self.phase == "backward" and self.replays.copies:
            self.replays.backward_op(func, args)  # a view's node after an in-place op, as on a real tensor
        if self.phase == "forward" and self.loops.primes:
            walk = self.loops.index(func, args) if func in INDEXING else None
            if walk is None and self.loops.watching:
                walk = self.loops.use(args)
            if walk is not None:
                raise walk_refusal(walk, node=f"#{len(self.trace.ops)}", module=self.module(), op=str(func))
        if not self.only_ops:
            self.reap(len(self.trace.ops) - 0.25)  # died before this op
        try:
            out = _run(func, args, kwargs)
        except SymacctError:
            raise
        except Exception as e:  # data-dependent ops, missing fake kernels
            shapes = [tuple(a.shape) for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            what, hint = _failure(func, e)
            raise SymacctError(
                what, node=f"#{len(self.trace.ops)}", module=self.module(), op=str(func), shapes=shapes, hint=hint
            ) from e
        out = eager.as_on_the_cpu(func, args, out)
        _strided_only(func, out, len(self.trace.ops), self.module())
        if func in SPLITTING and self.phase == "forward" and self.loops.primes:
            self.loops.split(func, args, out)
        known.propagate(func, args, kwargs, out)
        if self.phase == "forward":
            self.replays.after_op(func, args)
        for a, k, o in _split_lists(func, args, kwargs, out):
            if self.only_ops:
                self._record_op(func, a, k, o)
            else:
                self._record(func, a, k, o)
        if self.phase == "forward" or self.recomputing:
            # every autograd node made since the last op is this op's: an in-place op's node is made before the
            # clone of the value it overwrites (saved for backward), so it is not always the newest one. A forward
            # run again in backward (reentrant checkpointing) makes nodes that a nested backward then runs
            last = torch.autograd._get_sequence_nr() - 1
            for seq in range(self.seq_seen + 1, last + 1):
                self.seq_module.setdefault(seq, self.trace.ops[-1].module)
            self.seq_seen = max(self.seq_seen, last)
        return out

    def _record_op(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """The op, its module, its phase and the shapes it returns (and the FLOPs PyTorch counts for it, where it
        counts any: ``symacct.trace.counted``); nothing else of its tensors."""
        phase = "recompute" if self.phase == "backward" and self.recomputing else self.phase
        index = len(self.trace.ops)
        if isinstance(out, torch.Tensor):
            shapes: tuple[tuple[int, ...], ...] = (tuple(out.shape),)
        elif isinstance(out, tuple) and all(isinstance(o, torch.Tensor) for o in out):
            shapes = tuple(tuple(o.shape) for o in out)
        else:
            shapes = tuple(tuple(o.shape) for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor))
        flops = counted_flops(func, args, kwargs, out)
        rec = OpRecord(index, func, self.module(), phase, (), {}, None, [], [], False, [], shapes, flops)
        self.trace.ops.append(rec)

    def _record(self, func, args, kwargs, out) -> None:
        phase = "recompute" if self.phase == "backward" and self.recomputing else self.phase
        tensors: list[torch.Tensor] = []
        rec = op_record(len(self.trace.ops), func, self.module(), phase, args, kwargs, out, self.ids.meta, tensors)
        self.trace.ops.append(rec)
        outputs, is_view = rec.outputs, rec.is_view
        if not is_view:
            for t, m in zip(tensors, outputs):
                if m.storage not in self.trace.storage_producer and m.storage not in self.trace.external_storages:
                    self.trace.storage_producer[m.storage] = rec.index
                    self.trace.note_storage(m.storage, t)


def call_inputs(
    inputs: Callable[..., Any], model: nn.Module, B: int, S: int, **dims: int
) -> tuple[Any, ...] | dict[str, Any]:
    """Call an inputs builder given as ``f(B, S)`` or ``f(model, B, S)`` (input sizes besides B and S, such as
    a decoder's length ``S_dec``, by keyword).

    A tuple (or one tensor) is passed positionally, ``model(*inputs)``; a dict
    by keyword, ``model(**inputs)`` (``input_ids=..., labels=...``).
    """
    try:
        n = len(inspect.signature(inputs).parameters)
    except (TypeError, ValueError):
        n = 2
    got = inputs(model, B, S, **dims) if n >= 3 else inputs(B, S, **dims)
    if isinstance(got, dict):
        bad = [k for k in got if not isinstance(k, str)]
        if bad:
            raise SymacctError(
                f"inputs= returned a dict with keys that are not argument names: {bad}",
                hint="return a dict of keyword arguments (str keys) or a tuple of positional ones",
            )
        return dict(got)
    return tuple(got) if isinstance(got, (tuple, list)) else (got,)


def _invoke(model: nn.Module, args: tuple[Any, ...] | dict[str, Any]) -> Any:
    return model(**args) if isinstance(args, dict) else model(*args)


def record_step(
    build: Callable[[FakeTensorMode], nn.Module],
    make_inputs: Callable[[nn.Module], tuple[Any, ...]],
    *,
    loss: Callable[[Any], torch.Tensor] | None = None,
    step: str = "train",
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
    autocast: torch.dtype | None = None,
    params_dtype: torch.dtype | None = None,
    fsdp_policy: bool = False,
    device: str = "cpu",
    only_ops: bool = False,
    python_engine: bool | None = None,
    sdpa_backend: str | None = None,
    sdpa_target: Target | None = None,
    sdpa_size: Callable[[int], int] = int,
    step_context: Callable[[nn.Module, Any], contextlib.AbstractContextManager[Any]] | None = None,
    size_primes: dict[int, str] | None = None,
    warm: str = "",
    cycles: bool = False,
) -> StepTrace:
    """Build a model and run one step on fake tensors, recording every aten op.

    ``build(fake_mode)`` constructs the model with fake parameters (by
    building it inside the mode, or by copying a real one with
    FakeCopyMode); ``make_inputs`` returns the positional inputs; ``loss``
    turns the model's output into the scalar to differentiate (default: the
    output itself). ``step`` is 'train' (forward + backward [+ optimizer]) or
    'forward' (forward under ``torch.no_grad()``). ``only_ops=True`` records
    each op's name, module and phase only (what ``symacct.sameness``
    compares: no tensors, storages or saved tensors), and builds the
    optimizer (hooks it registers run in the backward) without running its
    ``step()``.

    Factory calls that name no device make CPU tensors, as in eager PyTorch with
    no default device set, even when ``derive`` is called inside
    ``with torch.device("meta")`` (where a model too large to build is made):
    the optimizer's step counters, say, stay fake CPU tensors.

    ``python_engine`` runs the backward node by node from Python (``symacct.trace.engine``): by default for
    fake CUDA tensors on a machine without a GPU, where PyTorch's engine cannot start. ``sdpa_backend``: the
    kernel ``scaled_dot_product_attention`` runs on CUDA (``symacct.trace.sdpa``), or with ``sdpa_target`` the
    one PyTorch chooses on that GPU, reading sizes through ``sdpa_size`` (``symacct.trace.sdpa_choice``); one
    of them is required without a GPU. The kernels run are in ``trace.sdpa_kernels``. ``step_context(model,
    args)``: a context the step runs in, entered once the inputs are made (context parallelism shards them).
    ``size_primes``: a probe's own primes and their symbols; a forward that reads every index of a dimension
    whose size holds one, one by one, is refused as it does it (``symacct.trace.loops``).

    A step records in ``trace.changed`` what its forward changed in the model itself (``changed_itself``).
    ``warm`` (that description, from a first trace) runs one call first, untraced and without gradients, on
    inputs of its own, and records the step as a second call runs it: what the model does once on its first
    call (BigBird's switch to full attention builds a new attention module) is then not in the step.
    ``cycles``: a training step records in ``trace.cycle_held`` the storages only reference cycles hold
    (``_cycle_collected``), found by two collections at its end (a few milliseconds).
    """
    check_device(device)
    if python_engine is None:
        python_engine = device != "cpu" and not torch.cuda.is_available()
    trace = StepTrace()
    ids = _Ids()
    fake = FakeTensorMode(allow_non_fake_inputs=False)
    try:
        with torch.device(device):
            model = build(fake)
    except SymacctError:
        raise
    except Exception as e:
        if "UninitializedParameter" in str(e):  # made under the fake mode, a lazy module's parameter fails
            raise SymacctError(
                f"could not build the model at probe sizes: it has lazy modules (nn.LazyLinear and the like), whose "
                f"parameters take their shapes from the first input: {type(e).__name__}: {_text(e)}",
                hint="build the model with the widths given (nn.Linear(in, out)), or pass a factory with dims={...} "
                "that does",
            ) from e
        raise SymacctError(
            f"could not build the model at probe sizes: {type(e).__name__}: {_text(e)}",
            hint="the model must be rebuildable as type(model)(config) with other sizes; "
            "keep fields it cannot vary fixed with derive(..., fixed=[...])",
        ) from e
    # a train step records autograd whatever the caller's grad mode (derive inside torch.no_grad())
    grad_mode = torch.enable_grad() if step == "train" else contextlib.nullcontext()
    with (
        fake,
        no_default_device(),
        torch.inference_mode(False),
        grad_mode,
        _optimizer_defaults_as_on_real_tensors(),
        _unchanged_conversions(),
        contextlib.ExitStack() as around,
    ):
        try:
            if params_dtype is not None:
                _cast_floats(model, params_dtype, buffers=not fsdp_policy)
                if fsdp_policy:
                    _cast_block_inputs(model, params_dtype)
            if warm:
                choice = choosing(sdpa_backend, device, sdpa_target, sdpa_size)
                _first_call(model, make_inputs, device, autocast, choice, train=step == "train")
                trace.warmed = warm
            built = _structure(model)
            with torch.device(device):
                args = make_inputs(model)
            made = changed_itself(built, _structure(model))  # a call made with the inputs (a cache's layout read)
            del built
            if params_dtype is not None:  # fp32 inputs follow the parameters (an fp8 KV cache stays fp8)
                args = tree_map(
                    lambda a: a.to(params_dtype) if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a,
                    args,
                )
        except SymacctError:
            raise
        except Exception as e:
            raise SymacctError(
                f"could not build the inputs: {type(e).__name__}: {e}",
                hint="pass inputs=lambda B, S: (...) returning the positional inputs of one step",
            ) from e
        for name, b in model.named_buffers(remove_duplicate=False):  # as built (context parallelism shards some)
            trace.buffer_shapes[name] = tuple(int(d) for d in b.shape)
            trace.buffer_dtypes[name] = b.dtype
        if step_context is not None:
            around.enter_context(step_context(model, args))
        if step == "train":
            model.train()
        else:
            model.eval()
        for name, p in model.named_parameters(remove_duplicate=False):
            m = ids.meta(p)
            trace.param_names.setdefault(m.storage, []).append(name)
            trace.param_shapes[name] = tuple(int(d) for d in p.shape)
            trace.param_dtypes[name] = p.dtype
            if not p.requires_grad:
                trace.param_frozen.add(name)
            if python_engine and getattr(p, "_backward_hooks", None):  # run by the C++ engine only
                raise SymacctError(
                    f"the model's parameter {name} has a gradient hook (Tensor.register_hook), which symacct's "
                    "Python autograd engine (CUDA without a GPU) does not run",
                    module=name.rpartition(".")[0],
                    hint="derive on a machine with a GPU, or with device='cpu'",
                )
        for name, p in model.named_parameters():
            m = ids.meta(p)
            trace.owner[m.storage] = name
            trace.placeholders.append(Placeholder("param", name, m))
            trace.external_storages.add(m.storage)
            trace.note_storage(m.storage, p)
        state_keys = set(model.state_dict(keep_vars=True))
        for name, b in model.named_buffers():
            m = ids.meta(b)
            if name in state_keys:
                trace.persistent_buffers.add(m.storage)
            trace.placeholders.append(Placeholder("buffer", name, m))
            trace.external_storages.add(m.storage)
            trace.note_storage(m.storage, b)
        named = list(args.items()) if isinstance(args, dict) else [(f"input{i}", a) for i, a in enumerate(args)]
        _register_inputs(trace, ids, named)
        del named
        trace.module_names = [n for n, _ in model.named_modules()]
        trace.module_types = {n: type(m).__name__ for n, m in model.named_modules()}
        opt = optimizer(model) if (optimizer is not None and step == "train") else None
        if step != "train" and forced(device, sdpa_target):
            _refuse_hidden_fused_path(model)

        root = type(model).__name__
        recorder = _Recorder(trace, ids, root, only_ops, size_primes)
        recorder.names = {id(m): n for n, m in model.named_modules()}
        hooks = [
            torch.nn.modules.module.register_module_forward_pre_hook(recorder.pre_hook),
            torch.nn.modules.module.register_module_forward_hook(recorder.post_hook, always_call=True),
        ]

        def note(t: torch.Tensor) -> None:
            st = ids.storage(t)
            if st not in trace.external_storages:
                trace.saved_storages[st] = local(t).untyped_storage().nbytes()

        def pack(t: torch.Tensor) -> tuple[torch.Tensor, int]:
            if not only_ops:
                note(t)
            packed = versions.pack(t)
            ids.same_value(packed[0], t)
            return packed

        def unpack(packed: tuple[torch.Tensor, int]) -> torch.Tensor:  # PyTorch's in-place check, kept
            return versions.unpack(packed, recorder.module)

        def seen(t: torch.Tensor) -> None:  # a tensor the model's own saved-tensor hooks keep (symacct.trace.saved)
            if python_engine:
                raise SymacctError(
                    "the model sets saved-tensor hooks of its own, whose saved tensors symacct's Python autograd "
                    "engine (CUDA without a GPU) cannot release as PyTorch's engine does",
                    module=recorder.module(),
                    hint="derive on a machine with a GPU, or with device='cpu'",
                )
            if t.device.type != torch.device(device).type:
                raise SymacctError(
                    f"the model's saved-tensor hooks keep a saved tensor on {t.device.type} "
                    "(torch.autograd.graph.save_on_cpu offloads activations): symacct counts the memory of the "
                    f"device the step runs on ({device}) only",
                    module=recorder.module(),
                    shapes=[tuple(t.shape)],
                    hint="derive without the offloading hooks (an upper bound on the device's memory)",
                )
            if not only_ops:
                note(t)

        with (
            recorder,
            _removing(hooks),
            _step_objects_apart(cycles and step == "train" and not only_ops),
            _quiet("torch._subclasses.fake_tensor"),
            _sharding_prop_unrecorded(),
            choosing(sdpa_backend, device, sdpa_target, sdpa_size) as kernels,
            refusing_hooks() if python_engine else contextlib.nullcontext(),
        ):
            if step == "train":
                # the loss is part of the step: what it saves for backward is activations too, and it runs
                # under autocast as the forward does (as PyTorch's AMP recipe has it)
                # hooks are set for a trace of ops only too: their presence changes what some ops run (a detach)
                # the Python engine empties each node's once it has run
                boxes = Saved(None if only_ops else note, ids.same_value)
                if python_engine:
                    saving = torch.autograd.graph.saved_tensors_hooks(boxes.pack, boxes.unpack)
                else:
                    saving = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
                before = _structure(model)
                with saving, composing(seen), _autocast(autocast, device):
                    out = _call_model(model, args, recorder)
                    value = _call_loss(loss, out) if loss is not None else out
                trace.changed = made or changed_itself(before, _structure(model))
                del before
                if not isinstance(value, torch.Tensor) or value.dim() != 0:
                    raise SymacctError(
                        "the step's output is not a scalar loss",
                        module="",
                        shapes=[tuple(value.shape)] if isinstance(value, torch.Tensor) else None,
                        hint="make forward return the loss when targets are given, or pass loss=",
                    )
                for t in [value, *tree_flatten(out)[0]]:
                    if isinstance(t, torch.Tensor):  # the caller still holds the output and the loss
                        trace.held_storages.add(ids.storage(t))
                trace.loss_storage = ids.storage(value)
                recorder.mark("after_forward")
                recorder.phase = "backward"
                if not value.requires_grad:
                    raise SymacctError(
                        "the loss does not require grad: no parameter reaches it",
                        module="",
                        hint="a training step needs parameters on the path to the loss; use step='forward'",
                    )
                if python_engine:
                    # the caller's hold on the output keeps its storages, not the graph (the engine releases
                    # each node's saved tensors as PyTorch's does only where nothing else holds the node)
                    _held = [t.untyped_storage() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
                    del out, t
                    engine_backward(value, boxes, recorder.replays.after_node)
                else:
                    value.backward()
                recorder.mark("after_backward")
                for name, p in model.named_parameters():
                    if p.grad is not None:
                        st = ids.storage(p.grad)
                        trace.grad_storages[st] = name
                        trace.owner[st] = name
                if opt is not None and not only_ops:
                    _state_storages(opt, model, ids, trace)  # states made before the step (Adagrad)
                    recorder.phase = "optimizer"
                    try:
                        opt.step()
                    except SymacctError:
                        raise
                    except Exception as e:
                        raise SymacctError(
                            f"the optimizer step failed on fake tensors: {type(e).__name__}: {_text(e)}",
                            op=type(opt).__name__,
                            hint="use an optimizer whose step() runs without a closure and without reading "
                            "tensor values (SGD, Adam, AdamW, Adagrad, ...)",
                        ) from e
                    _state_storages(opt, model, ids, trace)
                    _attribute_optimizer_ops(trace)
                    opt.zero_grad(set_to_none=True)
                recorder.reap(len(trace.ops) + 0.25)  # what zero_grad freed
                trace.marks["after_optimizer"] = len(trace.ops)
                if cycles and not only_ops:
                    trace.cycle_held = dict.fromkeys(_cycle_collected(ids, 0), "step")
                    out = value = t = None  # the caller lets go of the output and the loss
                    ids.reap()  # freed by reference counting
                    trace.cycle_held.update(dict.fromkeys(_cycle_collected(ids, 1), "after"))
            else:
                before = _structure(model)
                cache = args.get("cache") if isinstance(args, dict) else None
                given = _leaves_seen(cache)
                with torch.no_grad(), _autocast(autocast, device):
                    out = _call_model(model, args, recorder)
                trace.changed = made or changed_itself(before, _structure(model))
                del before
                trace.cache_untouched = _keys_and_values(cache) and _leaves_seen(cache) == given
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        trace.held_storages.add(ids.storage(t))
                for t in _tensor_leaves(cache):  # a KV cache the step filled or extended (serving)
                    trace.cache_storages.add(ids.storage(t))
                    trace.held_storages.add(ids.storage(t))
                recorder.mark("after_forward")
    trace.sdpa_kernels = kernels
    return trace


@contextlib.contextmanager
def no_cycle_collection() -> Iterator[None]:
    """Python's cycle collector paused while a derivation runs (reference counting still frees everything
    else): a collection in the middle of a trace would free a storage held in a reference cycle at an
    arbitrary op, where eager code frees it only at some later collection; and a derivation makes many
    short-lived objects, so collections are frequent and cost about a sixth of its time. The planner
    pauses it too (``symacct.parallel.plan``: a fifth of its time), and so does a measured real step
    (``symacct.measure.run``): what only reference cycles hold stays held there as derive counts it
    (``StepTrace.cycle_held``)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextlib.contextmanager
def _step_objects_apart(on: bool) -> Iterator[None]:
    """With ``on``, the objects made before the step set apart from the cycle collector while it runs
    (``gc.freeze``), so that ``_cycle_collected`` scans the step's own objects only: a few milliseconds, where a
    process's young objects would take tens to hundreds. Not where the caller has frozen objects of its own
    (``gc.unfreeze`` would release theirs too)."""
    frozen = on and gc.get_freeze_count() == 0
    if frozen:
        gc.freeze()
    try:
        yield
    finally:
        if frozen:
            gc.unfreeze()


def _cycle_collected(ids: _Ids, generation: int) -> list[int]:
    """The storages a collection of Python's cycle collector frees: held only by reference cycles (an autograd
    Function that keeps its output as an attribute of ``ctx``: the output's ``grad_fn`` is the node that holds
    it). Derive pauses the collector (``no_cycle_collection``), so every object the step made is
    in generation 0 until the first such collection, in 1 after it."""
    gc.collect(generation)
    return ids.reap()


def _first_call(
    model: nn.Module,
    make_inputs: Callable[[nn.Module], Any],
    device: str,
    autocast: torch.dtype | None,
    kernels: contextlib.AbstractContextManager[Any],
    train: bool = False,
) -> None:
    """One call of the model on inputs of its own, untraced and without gradients, in training mode for a
    training step (record_step's ``warm``)."""
    with torch.device(device):
        args = make_inputs(model)
    model.train(train)
    with torch.no_grad(), _autocast(autocast, device), kernels, untraced():
        _invoke(model, args)


Structure = tuple[dict[str, Any], dict[str, Any], dict[str, None]]


def _structure(model: nn.Module) -> Structure:
    """The model's modules and parameters by name (held, compared by identity) and its buffers' names (a
    buffer a call assigns anew each time, a rotary table recomputed, is the call's own work)."""
    return (
        dict(model.named_modules(remove_duplicate=False)),
        dict(model.named_parameters(remove_duplicate=False)),
        dict.fromkeys(n for n, _ in model.named_buffers(remove_duplicate=False)),
    )


def changed_itself(before: Structure, after: Structure) -> str:
    """What a call changed in the model's structure (``_structure`` before and after it), in words, or ""."""
    for kind, old, new in zip(("module", "parameter", "buffer"), before, after):
        replaced = [n for n in new if n in old and old[n] is not new[n]]
        added = [n for n in new if n not in old]
        removed = [n for n in old if n not in new]
        for what, names in (("replaced", replaced), ("added", added), ("removed", removed)):
            if names:
                more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
                return f"{kind} {names[0] or '<root>'} {what}{more}"
    return ""


def _register_inputs(trace: StepTrace, ids: _Ids, named: list[tuple[str, Any]]) -> None:
    """The step's inputs as placeholders. A function of its own, so that no local keeps an input tensor alive
    through the step: a KV cache entry the model replaces must die then, as in eager PyTorch."""
    for key, value in named:
        leaves = _tensor_leaves(value)
        for j, a in enumerate(leaves):
            m = ids.meta(a)
            trace.placeholders.append(Placeholder("input", key if len(leaves) == 1 else f"{key}.{j}", m))
            trace.external_storages.add(m.storage)
            trace.note_storage(m.storage, a)


def _keys_and_values(cache: Any) -> bool:
    """Whether a cache is a transformers cache whose every layer holds keys and values (a linear attention's
    layer holds other state, which ``_tensor_leaves`` does not see)."""
    layers = getattr(cache, "layers", None)
    return isinstance(layers, list) and bool(layers) and all(hasattr(layer, "keys") for layer in layers)


def _leaves_seen(cache: Any) -> list[tuple[int, tuple[int, ...]]]:
    """A cache's tensors by identity and shape (not held: an entry the model replaces must die as it does)."""
    return [(id(t), tuple(t.shape)) for t in _tensor_leaves(cache)]


# what a transformers cache layer holds a position of: keys, values, a sparse attention's indexer keys
CACHED = ("keys", "values", "indexer_keys")


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors in an input: pytree leaves, and a transformers cache's keys, values and indexer keys layer
    by layer (a DynamicCache is no pytree)."""
    layers = getattr(value, "layers", None)
    if isinstance(layers, list) and not isinstance(value, nn.Module):
        return [
            t
            for layer in layers
            for t in (getattr(layer, name, None) for name in CACHED)
            if isinstance(t, torch.Tensor)
        ]
    return [a for a in tree_flatten(value)[0] if isinstance(a, torch.Tensor)]


def _call_model(model: nn.Module, args: tuple[Any, ...] | dict[str, Any], recorder: Any) -> Any:
    """``model(*args)``; an error raised above dispatch (an argument check in Python or C++) is named with
    the module it happened in and its full text, as a refusal at probe sizes, not as symacct's defect; so is
    code that refuses saved-tensor hooks (``torch.func.grad`` in the forward)."""
    try:
        with noting_disabled() as disabled:
            return _invoke(model, args)
    except SymacctError:
        raise
    except Exception as e:
        inner = e.__cause__
        if isinstance(inner, SymacctError):  # refused inside PyTorch code that wraps what it raises
            raise SymacctError(inner.what, module=recorder.module(), shapes=inner.shapes, hint=inner.hint) from e
        if any(m and m in str(e) for m in disabled):
            raise SymacctError(
                f"the step runs code that refuses saved-tensor hooks ({type(e).__name__}: {_text(e)}), and symacct "
                "counts what autograd saves for backward through them",
                module=recorder.module(),
                hint="torch.func.grad, vjp, jacrev and hessian refuse them: compute the inner gradient with "
                "torch.autograd.grad(..., create_graph=True), which derive traces",
            ) from e
        unfit = _unfit_inputs(model, args) if isinstance(e, TypeError) else None
        if unfit is not None:
            raise SymacctError(
                f"the model's forward does not take the step's inputs: {unfit}",
                module=recorder.module(),
                hint="the inputs builder (inputs=, or the model's example_inputs) returns what forward takes: a "
                "tuple is passed by position, a dict by keyword",
            ) from e
        raise SymacctError(
            f"the model's forward failed at probe sizes: {type(e).__name__}: {_text(e)}",
            module=recorder.module(),
            hint="the step runs at sizes of symacct's choosing (distinct primes per symbol): a size relation "
            "the model needs (heads dividing the width, key/value heads dividing the heads) must come from "
            "fields symacct knows (n_head, n_kv_heads, ...), or keep those fields at their values with fixed=[...]",
        ) from e


@contextlib.contextmanager
def _unchanged_conversions() -> Iterator[None]:
    """``Module.to`` (``.float()``, ``.half()``) called inside the step on a module of fake parameters: a router
    cast to its own dtype each forward, as SwitchTransformers and NLLB-MoE do. PyTorch's ``Module._apply`` swaps
    fake parameters with ``torch.utils.swap_tensors``, which refuses them (FakeTensorMode keeps weak references
    to them: pytorch/pytorch#153056), where eager sets ``param.data`` to the converted tensor. A conversion that
    changes nothing (the converted tensor is the parameter's own storage, shape and dtype) changes nothing in
    eager either, and none here; one that changes a dtype or device is refused by name."""
    swap_tensors = torch.utils.swap_tensors

    def swap(t1: torch.Tensor, t2: torch.Tensor) -> None:
        if not (isinstance(t1, FakeTensor) and isinstance(t2, FakeTensor)):
            return swap_tensors(t1, t2)
        if (t1.dtype, t1.device, t1.shape, t1.stride(), t1.storage_offset()) == (
            t2.dtype,
            t2.device,
            t2.shape,
            t2.stride(),
            t2.storage_offset(),
        ) and StorageWeakRef(t1.untyped_storage()) == StorageWeakRef(t2.untyped_storage()):
            return None
        raise SymacctError(
            f"the step converts a module's parameters (Module.to, .float(), .half()) from {t1.dtype} on "
            f"{t1.device} to {t2.dtype} on {t2.device}, which PyTorch's fake tensors cannot follow (Module._apply "
            "swaps them, and swap_tensors refuses fake parameters: pytorch/pytorch#153056)",
            shapes=[tuple(t1.shape)],
            hint="build that module in the dtype the step converts it to (a router in float32) and derive the model "
            "as built, without params_dtype= (which casts every parameter)",
        )

    torch.utils.swap_tensors = swap
    try:
        yield
    finally:
        torch.utils.swap_tensors = swap_tensors


def _unfit_inputs(model: nn.Module, args: tuple[Any, ...] | dict[str, Any]) -> str | None:
    """Why ``model.forward`` cannot be called with ``args`` (its signature refuses them), else None; None too
    where a forward pre-hook may change the arguments first."""
    if model._forward_pre_hooks:
        return None
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a forward with no signature to read (a builtin)
        return None
    try:
        sig.bind(**args) if isinstance(args, dict) else sig.bind(*args)
    except TypeError as e:
        return f"{type(model).__name__}.forward{sig}: {e}"
    return None


def _call_loss(loss: Callable[[Any], torch.Tensor], out: Any) -> Any:
    """``loss(out)``; a Python error in the user's loss function is named as such, not as symacct's."""
    try:
        return loss(out)
    except SymacctError:
        raise
    except Exception as e:
        raise SymacctError(
            f"the loss= function failed on the model's output: {type(e).__name__}: {_text(e)}",
            hint=f"the output is a {type(out).__name__}; loss= receives exactly what forward returns",
        ) from e


def _refuse_hidden_fused_path(model: nn.Module) -> None:
    """An inference step on CUDA with SDPA's kernel chosen by symacct's torch-function mode: while a mode is
    active PyTorch never takes the fused inference path of ``nn.TransformerEncoderLayer`` and
    ``nn.MultiheadAttention`` (``no_default_device``), which a GPU takes where its conditions hold; refused
    rather than derived as the unfused path, unless that path is switched off."""
    if not torch.backends.mha.get_fastpath_enabled():
        return
    found = [n for n, m in model.named_modules() if isinstance(m, (nn.TransformerEncoderLayer, nn.MultiheadAttention))]
    if found:
        raise SymacctError(
            "an inference step on CUDA of a model with nn.TransformerEncoderLayer or nn.MultiheadAttention: a GPU "
            "may run PyTorch's fused inference path, which symacct cannot follow while it chooses SDPA's kernel",
            module=found[0],
            hint=_UNFUSED,
        )


@contextlib.contextmanager
def no_default_device() -> Iterator[None]:
    """Inside, factory calls that name no device make CPU tensors, as in eager PyTorch with no default device
    set: the caller's ``with torch.device(...)`` (or ``torch.set_default_device``) is taken off the
    torch-function mode stack, and put back on exit.

    Not by entering ``torch.device("cpu")``: a device context is a torch-function mode, and while one is
    active ``has_torch_function`` holds for every tensor, so PyTorch's fused inference paths
    (``nn.TransformerEncoderLayer``'s ``_transformer_encoder_layer_fwd``, ``nn.MultiheadAttention``'s
    ``_native_multi_head_attention``) step aside and the step runs other ops than the model run eagerly."""
    from torch.utils._device import DeviceContext

    modes = []
    while torch._C._len_torch_function_stack() > 0:
        modes.append(torch._C._pop_torch_function_stack())
    modes.reverse()  # bottom first
    kept = [m for m in modes if not isinstance(m, DeviceContext)]
    for m in kept:
        torch._C._push_on_torch_function_stack(m)
    try:
        yield
    finally:
        for _ in kept:
            torch._C._pop_torch_function_stack()
        for m in modes:
            torch._C._push_on_torch_function_stack(m)


@contextlib.contextmanager
def _quiet(logger: str) -> Any:
    """Silence a logger: fake tensors log a traceback for a failing meta kernel, which symacct
    turns into one SymacctError naming the node, module, op and shapes."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def _removing(handles: list[Any]) -> Any:
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _cast_floats(model: nn.Module, dtype: torch.dtype, buffers: bool = True) -> None:
    """``model.to(dtype)`` for fake parameters (``.to`` would swap tensors, which fake ones refuse).

    Floating parameters and (with ``buffers``) buffers are replaced by cast
    copies; a parameter shared by several modules (tied weights) stays shared.
    """
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_floating_point():
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            module._parameters[name] = done[id(p)]
        for name, b in list(module._buffers.items()):
            if buffers and b is not None and b.is_floating_point():
                module._buffers[name] = b.to(dtype)


def _cast_block_inputs(model: nn.Module, dtype: torch.dtype) -> None:
    """FSDP2's ``cast_forward_inputs``: each block of every ``nn.ModuleList`` (the modules the reference plan
    wraps with ``fully_shard``) casts its floating tensor inputs to ``dtype`` before its forward."""

    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype else x

    def hook(_module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        return tree_map(cast, args), tree_map(cast, kwargs)

    for stack in model.modules():
        if isinstance(stack, nn.ModuleList):
            for block in stack:
                block.register_forward_pre_hook(hook, with_kwargs=True)


def check_device(device: str) -> None:
    """Refuse a device the fake trace cannot run on, before anything touches it (the CPU build of torch
    aborts the process at the first CUDA device guard)."""
    kind = torch.device(device).type
    if kind == "cpu":
        return
    if kind != "cuda":
        raise SymacctError(f"cannot trace for device {device!r}", hint="use device='cpu' or device='cuda'")
    if torch.version.cuda is None:
        raise SymacctError(
            f"device={device!r} needs the CUDA build of torch; this is {torch.__version__}, a CPU build",
            hint="install a CUDA build (e.g. pip install torch==2.14.1; no GPU is needed to derive), "
            "or derive with device='cpu'",
        )


@contextlib.contextmanager
def _optimizer_defaults_as_on_real_tensors() -> Iterator[None]:
    """A fake tensor counts as the tensor it stands for when an optimizer picks its implementation.

    With ``foreach`` and ``fused`` unset, PyTorch's optimizers choose by the parameters' type and device
    (``torch.optim.optimizer._default_to_fused_or_foreach``): foreach on CUDA, the single-tensor loop on the
    CPU. A fake tensor's type is not on the list it checks, so on fake CUDA tensors they would run the loop
    where a real CUDA run runs foreach, whose temporaries are whole lists at once (AdamW's square root of
    every second moment): a silent wrong optimizer phase. During a trace the device decides, as for real
    tensors (PyTorch adds DTensor to the same lists for the same reason); an explicit ``foreach=`` or
    ``fused=`` is the user's and stays theirs. ``clip_grad_norm_``'s list is widened alike."""
    from torch.optim import optimizer as optim_base
    from torch.utils import _foreach_utils

    lists = (optim_base._foreach_supported_types, _foreach_utils._foreach_supported_types)
    added = [types for types in lists if FakeTensor not in types]
    for types in added:
        types.append(FakeTensor)
    try:
        yield
    finally:
        for types in added:
            types.remove(FakeTensor)


def _autocast(dtype: torch.dtype | None, device: str) -> Any:
    """``torch.autocast`` on the device the trace's fake tensors are on, or nothing. CUDA autocast on a
    machine without a GPU: ``torch.autocast`` would warn and switch itself off, so its state is set
    directly (``_cuda_autocast``)."""
    if dtype is None:
        return contextlib.nullcontext()
    kind = torch.device(device).type
    if kind == "cuda" and not torch.cuda.is_available():
        return _cuda_autocast(dtype)
    return torch.autocast(device_type=kind, dtype=dtype)


@contextlib.contextmanager
def _cuda_autocast(dtype: torch.dtype) -> Iterator[None]:
    """What ``torch.autocast("cuda", dtype)`` does on entry and exit, without its check for a GPU."""
    enabled, was = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", was)


def _attribute_optimizer_ops(trace: StepTrace) -> None:
    """Give each optimizer op the module of the one parameter whose tensors it touches.

    Single-tensor optimizers touch one parameter (its grad, its states) per op;
    foreach and fused ops touch all of them and stay at the root ('').
    """
    owner = dict(trace.owner)  # grows with the temporaries each parameter's ops make
    for rec in trace.ops:
        if rec.phase != "optimizer":
            continue
        owners = {owner[m.storage] for m in (*rec.inputs, *rec.outputs, *rec.mutated) if m.storage in owner}
        if len(owners) == 1:
            name = owners.pop()
            rec.module = name.rpartition(".")[0]
            for m in rec.outputs:
                owner.setdefault(m.storage, name)


def _state_storages(opt: torch.optim.Optimizer, model: nn.Module, ids: _Ids, trace: StepTrace) -> None:
    """Record the optimizer's per-parameter state tensors; refuse state that is not per-parameter."""
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        if not isinstance(p, torch.Tensor) or id(p) not in names:
            raise SymacctError(
                f"{type(opt).__name__} keeps state that is not keyed by a parameter",
                op=type(opt).__name__,
                hint="symacct accounts optimizer state per parameter; this optimizer's state cannot be attributed",
            )
        for key, v in state.items():
            if isinstance(v, torch.Tensor):
                st = ids.storage(v)
                if st not in trace.storage_producer:  # made before the step (Adagrad's __init__)
                    trace.external_storages.add(st)
                trace.state_storages[st] = (names[id(p)], key)
                trace.owner[st] = names[id(p)]
                if st not in trace.storage_nbytes:
                    trace.note_storage(st, v)
