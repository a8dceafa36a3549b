"""The probe model must be the user's model at other sizes: its ops are compared with a trace of the user's own.

``derive`` rebuilds a model from its config at probe sizes. A setting lost
on the way (an attention implementation chosen after construction, a flag
the config's constructor resets) would make it another model, and every
figure silently wrong. So the user's own model object is traced too, on
fake tensors (nothing allocated, also for a model on the meta device), at
the probe's batch and sequence sizes, and its ops are compared with the
probe's, block by block:

- ops outside the layer stacks: the same (phase, op, module) counts;
- each block of the user's stack against the probe block in its position
  (the first, the last, a middle one).

A deep model is not traced whole: when its middle blocks are built alike
(the same module types, settings and parameter shapes), blocks 0, 1, 2 and
the last are kept (``shortened``), so the check costs one probe trace
whatever the depth. Where that shortened trace differs, the whole model is traced
before anything is refused.

Counts, not order: a different order of the same ops changes no total.
A difference is refused, naming the first op that differs.

Counts alone miss a model that runs the same ops at other sizes or holds
other tensors, so around them (``symacct.pipeline`` runs each where its
inputs are known): before the ops, the parameters and buffers by name,
dtype, ``requires_grad`` and tying (``compare_settings``); once the second
probe has confirmed the readings, their shapes (``compare_parameters``) and
the shapes every op returns (``compare_shapes``), read in symbols and taken
at the user's sizes.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn
from torch._prims_common import suggest_memory_format
from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode
from torch.utils._pytree import tree_map

from symacct.cost.layers import op_blocks, zipped_stacks
from symacct.errors import SymacctError
from symacct.options import dtype_key
from symacct.trace.counted import counted_flops, counts_flops
from symacct.trace.hooks import describe as describe_hook
from symacct.trace.hooks import hooks_of
from symacct.trace.hooks import keys as hook_places
from symacct.trace.record import OpRecord, StepTrace, TMeta

D = TypeVar("D")
Key = tuple[str, str, str]  # phase, op, module path within its block (or the full path outside blocks)


def fake_copy(model: nn.Module, fake: FakeTensorMode, device: str = "cpu") -> nn.Module:
    """``model`` copied with fake parameters and buffers (nothing allocated); meta tensors, and tensors on
    another device than ``device`` (a CPU model derived for CUDA), become fake ones on ``device``, so that
    the copy runs with the step's inputs.

    Those are made first, in their memory format, and handed to ``copy.deepcopy`` in its memo, so the copy
    neither clones them (FakeCopyMode's way, a dispatched op each) nor replaces them afterwards; tied weights
    stay tied (one memo entry per tensor object). Tensors already on ``device``, and tensor subclasses, are copied by
    FakeCopyMode with their strides."""
    memo: dict[int, Any] = {}
    kind = torch.device(device).type
    with fake:
        for module in model.modules():
            for t in (*module._parameters.values(), *module._buffers.values()):
                if _elsewhere(t, kind) and id(t) not in memo and type(t) in (nn.Parameter, torch.Tensor):
                    memo[id(t)] = _empty_like(t, device)
    with FakeCopyMode(fake):
        out = copy.deepcopy(model, memo)
        _copy_tensor_hooks(model, memo)
    moved: dict[int, torch.Tensor] = {}
    with fake:  # what the memo did not hold (a tensor subclass on the meta device)
        for module in out.modules():
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    if not _elsewhere(t, kind):
                        continue
                    if id(t) not in moved:  # tied weights stay tied
                        moved[id(t)] = _empty_like(t, device)
                    table[name] = moved[id(t)]
    return out


def _copy_tensor_hooks(model: nn.Module, memo: dict[int, Any]) -> None:
    """Register each parameter's hooks on its copy (``copy.deepcopy`` makes a fake parameter anew, without
    them), each hook copied with the same memo: a bound method is bound to the copied module, so a hook the
    constructor registered (an optimizer stepped inside backward) runs on the copy as on the model."""
    for p in model.parameters():
        q = memo.get(id(p))
        if q is None or q is p:
            continue
        for fn in (getattr(p, "_backward_hooks", None) or {}).values():
            q.register_hook(copy.deepcopy(fn, memo))
        for fn in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values():
            q.register_post_accumulate_grad_hook(copy.deepcopy(fn, memo))


def _elsewhere(t: torch.Tensor | None, kind: str) -> bool:
    """A tensor on the meta device or on another device type than the step's."""
    return t is not None and (t.device.type == "meta" or t.device.type != kind)


def _empty_like(t: torch.Tensor, device: str) -> torch.Tensor:
    """An empty tensor of ``t``'s shape, dtype and memory format (contiguous, or channels-last as after
    ``model.to(memory_format=torch.channels_last)``) on ``device`` (a parameter for a parameter), made inside
    the fake mode by the caller."""
    layout = suggest_memory_format(t)
    new = torch.empty(t.shape, dtype=t.dtype, device=device, memory_format=layout)
    return nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new


Groups = tuple[dict[Key, list[OpRecord]], dict[int, dict[Key, list[OpRecord]]]]


def _grouped(
    trace: StepTrace, stacks: list[str], ignore: frozenset[str] = frozenset(), like: StepTrace | None = None
) -> Groups:
    """The forward and backward ops by key, in the order they ran: outside the blocks, and per block index
    (ops named in ``ignore`` left out), the stacks zipped in one loop as in ``like`` (the probe's trace: a user's
    model of one block cannot tell). Kept on the trace: its ops are final once recorded."""
    zipped = _zipped_in(like or trace, stacks)
    key = (tuple(stacks), ignore, zipped)
    if key not in trace.op_groups:
        trace.op_groups[key] = _group(trace, stacks, ignore, set(zipped))
    return trace.op_groups[key]


def _zipped_in(trace: StepTrace, stacks: list[str]) -> frozenset[frozenset[str]]:
    """``layers.zipped_stacks`` of a trace, kept on it as its groups are."""
    key = ("zipped", tuple(stacks))
    if key not in trace.op_groups:
        trace.op_groups[key] = frozenset(zipped_stacks(trace.ops, stacks))
    return trace.op_groups[key]


def _group(trace: StepTrace, stacks: list[str], ignore: frozenset[str], zipped: set[frozenset[str]]) -> Groups:
    blocks = op_blocks(trace.ops, stacks, zipped)
    outside: dict[Key, list[OpRecord]] = {}
    per: dict[int, dict[Key, list[OpRecord]]] = {}
    for rec, b in zip(trace.ops, blocks):
        if rec.phase not in ("forward", "backward"):  # the optimizer is symacct's own, built the same for both
            continue
        op = str(rec.op)
        if op in ignore:
            continue
        if b is None:
            outside.setdefault((rec.phase, op, rec.module), []).append(rec)
            continue
        stack, i = b
        prefix = f"{stack}.{i}" if stack else str(i)
        per.setdefault(i, {}).setdefault((rec.phase, op, rec.module[len(prefix) :]), []).append(rec)
    return outside, per


def _keys(groups: Groups) -> tuple[Counter[Key], dict[int, Counter[Key]]]:
    """Op counts outside the blocks, and per block index."""
    outside, per = groups
    count = lambda by_key: Counter({key: len(recs) for key, recs in by_key.items()})  # noqa: E731
    return count(outside), {i: count(by_key) for i, by_key in per.items()}


def op_counts(trace: StepTrace, stacks: list[str], ignore: frozenset[str] = frozenset()) -> list[int]:
    """How many times each (phase, op, module) ran in the forward and backward, outside the blocks and in each
    block: the counts ``compare`` compares."""
    outside, per = _keys(_grouped(trace, stacks, ignore))
    return [*outside.values(), *(n for block in per.values() for n in block.values())]


_PHASES = {"forward": 0, "backward": 1, "optimizer": 2}


def _first_difference(
    a: Counter[Key], b: Counter[Key], scale: Callable[[int], int | None] | None = None
) -> tuple[Key, int, int] | None:
    """The first key whose counts differ: the forward first (a backward difference follows from it), views and
    detaches last (they follow from the ops that make their inputs). ``scale``: a probe's count as the user's
    trace, run at other lengths, runs it (``stack``'s backward selects each of S pieces), or None."""

    def order(key: Key) -> tuple[int, bool, Key]:
        view = any(w in key[1] for w in ("detach", "view", "alias", "expand", "transpose", "unsqueeze", "t.default"))
        return _PHASES.get(key[0], 3), view, key

    for key in sorted(set(a) | set(b), key=order):
        n_user, n_probe = a.get(key, 0), b.get(key, 0)
        if n_user != n_probe and (scale is None or scale(n_probe) != n_user):
            return key, n_user, n_probe
    return None


# DTensor's gather ends in a no-op narrow (a slice view) when the gathered size is not the same int object
# as the logical size (`is not`): with sizes above 256, as a probe's are, but not at small sizes
TENSOR_PARALLEL_IGNORED = frozenset({"aten.slice.Tensor"})


def _difference(
    user: tuple[Any, dict[int, Any]],
    probe: tuple[Any, dict[int, Any]],
    stacks: list[str],
    probe_blocks: int,
    differ: Callable[[Any, Any], D | None],
) -> tuple[D, int | None] | None:
    """The first difference ``differ`` finds between the ops outside the blocks, else in the first block of the
    user's stack that differs from every probe block in its position (``_positions``): (it, the block index,
    None outside the blocks). ``user`` and ``probe``: (outside, per block index), as ``_grouped`` gives them."""
    (u_out, u_blocks), (p_out, p_blocks) = user, probe
    found = differ(u_out, p_out)
    if found is not None:
        return found, None
    n = max(u_blocks, default=-1) + 1 if stacks else 0
    for i in range(n):
        diffs = [differ(u_blocks.get(i, {}), p_blocks.get(j, {})) for j in _positions(i, n, probe_blocks)]
        if all(d is not None for d in diffs):
            return diffs[0], i
    return None


def _where(block: int | None) -> str:
    return "outside the layer stack" if block is None else f"in block {block} of the layer stack"


def compare(
    user: StepTrace,
    probe: StepTrace,
    stacks: list[str],
    probe_blocks: int,
    ignore: frozenset[str] = frozenset(),
    scale: Callable[[int], int | None] | None = None,
) -> None:
    """Refuse when the user's model and the probe model do not run the same ops (see the module doc); ops
    named in ``ignore`` (``TENSOR_PARALLEL_IGNORED``) are not compared. ``scale``: where the user's trace ran
    at other lengths than the probe's, a probe's count of an op as a length-proportional count reads at the
    user's lengths (None: the counts must be equal)."""
    differ = functools.partial(_first_difference, scale=scale)
    at = _difference(_keys(_grouped(user, stacks, ignore, probe)), _keys(_grouped(probe, stacks, ignore)), stacks,
                     probe_blocks, differ)  # fmt: skip
    if at is None:
        return
    ((phase, op, module), n_user, n_probe), i = at
    if i is not None:
        module = (f"{stacks[0]}.{i}" if stacks[0] else str(i)) + module
    raise SymacctError(
        f"{NOT_THE_SAME}: {op} runs {n_user} times "
        f"in the given model and {n_probe} times in the rebuilt one ({phase}, {_where(i)})",
        module=module,
        op=op,
        hint="a setting of the model is lost or changed when it is rebuilt as type(model)(config) (an attention "
        "implementation, a flag set after construction, a size-dependent kernel choice): make it a field of the "
        "config, or pass a factory with dims={...}",
    )


def compare_shapes(
    user: StepTrace,
    probe: StepTrace,
    stacks: list[str],
    probe_blocks: int,
    read: Callable[[int], int | None],
    ignore: frozenset[str] = frozenset(),
    scale: Callable[[int], int | None] | None = None,
) -> None:
    """Refuse when an op of the user's model returns tensors of other shapes than its counterpart in the probe
    model, read in symbols and taken at the sizes of the user's trace (``read``, as in ``compare_parameters``).
    Where a key's count scales with the lengths (``scale``, as in ``compare``), each of the user's ops must
    return what one of the probe's does.

    ``compare`` has found the same op counts; this finds the same ops run at other sizes with the same
    parameters: an attribute changed after construction (an attention module's head count, which splits the
    same width into more heads and saves a larger score matrix; an MoE layer's top-k). Ops are paired in the
    order they ran within each (phase, op, module) key, else matched in any order.
    """
    differ = functools.partial(_shape_difference, read=read, scale=scale)
    mine = _grouped(user, stacks, ignore, probe)
    at = _difference(mine, _grouped(probe, stacks, ignore), stacks, probe_blocks, differ)
    if at is None:
        return
    (rec, got, want), i = at
    raise SymacctError(
        f"{NOT_THE_SAME}: {rec.op} returns {_shapes_text(got)} in the given model and {_shapes_text(want)} "
        f"{AT_OWN_SIZES} ({rec.phase}, {_where(i)})",
        module=rec.module,
        op=str(rec.op),
        shapes=list(got),
        hint="an attribute that sets a size (a head count, a top-k, a window) changed after construction makes "
        "another model than type(model)(config), with the same ops at other sizes: set it in the config, or pass "
        "a factory with dims={...}",
    )


def _shape_difference(
    user: dict[Key, list[OpRecord]],
    probe: dict[Key, list[OpRecord]],
    read: Callable[[int], int | None],
    scale: Callable[[int], int | None] | None = None,
) -> tuple[OpRecord, tuple[tuple[int, ...], ...], tuple[Any, ...]] | None:
    """The first op of ``user`` (forward first) with no op of the same key in ``probe`` that returns its
    shapes: (the user's op, its shapes, the shapes of the probe's op in its place, read)."""
    for key in sorted(user, key=lambda k: (_PHASES.get(k[0], 3), k)):
        mine, theirs = user[key], probe.get(key, [])
        gots = [r.out_shapes for r in mine]
        wants = [p.out_shapes for p in theirs]
        if len(gots) == len(wants) and all(_returns(g, w, read) for g, w in zip(gots, wants)):
            continue
        scaled = len(gots) != len(wants) and scale is not None and scale(len(wants)) == len(gots)
        left = list(range(len(wants)))  # the same ops in another order
        for i, (r, got) in enumerate(zip(mine, gots)):
            match = next((j for j in left if _returns(got, wants[j], read)), None)
            if match is None:
                want = wants[i] if i < len(wants) else ()
                return r, got, tuple(tuple(read(d) if read(d) is not None else "?" for d in w) for w in want)
            if not scaled:  # as many ops as the probe's: each its own counterpart
                left.remove(match)
    return None


def compare_flops(
    user: StepTrace, probe: StepTrace, stacks: list[str], probe_blocks: int, read: Callable[[int], int | None]
) -> None:
    """Refuse when the ops PyTorch counts the FLOPs of (``symacct.trace.counted``: the matmuls, convolutions
    and attention kernels) count other FLOPs in a module and phase of the user's model than in the probe
    model's, read at the sizes of the user's trace (``read``): the comparison at a size of 1, where the ops
    and shapes that carry them may differ (a Linear's ``addmm`` on a tensor that is contiguous at one position
    where it runs ``mm`` and ``add`` otherwise; a group's query heads folded into one product's rows), the
    FLOPs may not. Their ops are left out of the comparison of ops and shapes there (``pipeline._aside_at_one``)."""
    mine = _pooled(_grouped(user, stacks, like=probe), lambda rec: rec.flops)
    theirs = _pooled(_grouped(probe, stacks), lambda rec: _read_flops(rec, read) if counts_flops(rec.op) else None)
    at = _difference(mine, theirs, stacks, probe_blocks, _pool_difference)
    if at is None:
        return
    ((phase, module), got, want, op), i = at
    raise SymacctError(
        f"{NOT_THE_SAME}: the ops whose FLOPs PyTorch counts ({op} among them) count {got} FLOPs in the given "
        f"model and {want} {AT_OWN_SIZES} ({phase}, {_where(i)})",
        module=module,
        op=op,
        hint="a step that runs other matmuls at a size of 1 takes another path there: its figures hold from 2",
    )


Pools = dict[tuple[str, str], tuple[int | None, str]]


def _pooled(groups: Groups, flops_of: Callable[[OpRecord], int | None]) -> tuple[Pools, dict[int, Pools]]:
    """Per (phase, module), outside the blocks and per block index: the FLOPs PyTorch counts for its ops (None
    where one of them has a dimension with no reading) and the first such op's name."""

    def pool(by_key: dict[Key, list[OpRecord]]) -> Pools:
        out: Pools = {}
        for (phase, op, module), recs in by_key.items():
            if not counts_flops(recs[0].op):
                continue
            for rec in recs:
                f = flops_of(rec)
                total, first = out.get((phase, module), (0, op))
                out[(phase, module)] = (None if total is None or f is None else total + f, first)
        return out

    outside, per = groups
    return pool(outside), {i: pool(by_key) for i, by_key in per.items()}


def _pool_difference(user: Pools, probe: Pools) -> tuple[tuple[str, str], Any, Any, str] | None:
    """The first (phase, module) whose FLOPs differ (or cannot be read): (it, the user's, the probe's, an op)."""
    for key in sorted(set(user) | set(probe), key=lambda k: (_PHASES.get(k[0], 3), k)):
        got, op = user.get(key, (0, ""))
        want, theirs = probe.get(key, (0, ""))
        if got is None or want is None or got != want:
            return key, got, "?" if want is None else want, op or theirs
    return None


def _read_flops(rec: OpRecord, read: Callable[[int], int | None]) -> int | None:
    """What PyTorch counts for a probe's op (``symacct.trace.counted``) at the sizes ``read`` takes its
    dimensions to; None for an op it does not count, or a dimension with no reading."""
    unread = False

    def size(x: Any) -> Any:
        nonlocal unread
        if not isinstance(x, TMeta):
            return x
        dims = [read(d) if isinstance(d, int) else None for d in x.shape]
        unread = unread or None in dims
        return torch.Size(d or 0 for d in dims)

    args, kwargs, out = tree_map(size, (rec.args, rec.kwargs, rec.out))
    return None if unread else counted_flops(rec.op, args, kwargs, out)


def _returns(
    got: tuple[tuple[int, ...], ...], want: tuple[tuple[int, ...], ...], read: Callable[[int], int | None]
) -> bool:
    if len(got) != len(want):  # a split into a number of chunks that is a size (the tensor-parallel degree)
        return len(set(got)) == len(set(want)) == 1 and _fits(got[0], want[0], read)
    return all(_fits(g, w, read) for g, w in zip(got, want))


def _shapes_text(shapes: tuple[Any, ...]) -> str:
    return ", ".join(str(tuple(s)) for s in shapes) or "nothing"


NOT_THE_SAME = "the model rebuilt from its config at probe sizes is not the model given"
# in the refusals of the checks after the op counts (compare_parameters, compare_shapes): the shapes differ
AT_OWN_SIZES = "in the rebuilt one at the given model's sizes"


def _positions(i: int, n: int, probe_blocks: int) -> list[int]:
    """The probe blocks that block i of a stack of n stands for: the first, the last, a middle one (both ends
    when n is 1)."""
    if n == 1:
        return [0, probe_blocks - 1]
    return [0] if i == 0 else [probe_blocks - 1] if i == n - 1 else [1]


def compare_settings(
    model: nn.Module,
    probe: StepTrace,
    stacks: list[str],
    probe_blocks: int,
    dtypes: bool,
    grads: bool,
    depth: tuple[str, int] | None = None,
) -> None:
    """Refuse, before any op is compared, when the user's ``model`` differs from the probe model in what the op
    comparison would report only as an op count, or not at all:

    - its parameters and buffers, by name: one added after construction and never used in the step (an
      adapter not yet wired in, a lookup table) still takes memory the probe model does not have, and one
      removed frees some; block i of a layer stack is compared with the probe's block in its position;
    - with ``grads`` (a training step), whether a parameter requires a gradient: a frozen part of the model is
      not trained by the probe model, which trains every parameter its config builds;
    - how parameters are tied;
    - the hooks on its modules and parameters (``symacct.trace.hooks``): one registered after construction
      runs in the user's step only, and can keep tensors alive, free gradients inside backward or add ops;
    - with ``dtypes`` (no ``params_dtype`` given), the dtype of every parameter and buffer: a model cast to
      bf16 runs the fp32 model's ops, and would otherwise be derived with fp32 bytes;
    - with ``depth`` (the config field read as L and its value), the number of blocks of each layer stack: the
      probe model builds L of them, and a stack cut or grown after construction (layers pruned, the config
      left as it was) runs as many blocks as it holds while the figures are taken at the config's L.
    """
    counts = _stack_counts(model, stacks)
    if depth is not None:
        field, value = depth
        for path, n in counts.items():
            if n != value:
                raise SymacctError(
                    f"the given model's layer stack {path} has {n} blocks where its config's {field} = {value} "
                    f"builds {value}: the figures would be the config's model's, at L = {value}",
                    module=path,
                    hint=f"set the config's {field} to the number of blocks the model holds (the model rebuilt from "
                    "it then has as many), or pass a factory with dims={...}",
                )
    if len(counts) == len(stacks):  # every stack found in the user's model: its names map onto the probe's
        _compare_names(model, probe, counts, probe_blocks)
    for name, p in model.named_parameters(remove_duplicate=False):
        theirs = [n for n in _probe_names(name, counts, probe_blocks) if n in probe.param_dtypes]
        if grads and theirs and all(p.requires_grad == (n in probe.param_frozen) for n in theirs):
            frozen = theirs[0] in probe.param_frozen
            state = "requires a gradient" if frozen else "requires no gradient (frozen)"
            other = "keeps it frozen" if frozen else "trains it"
            raise SymacctError(
                f"the given model's parameter {name} {state}; the model rebuilt from its config {other}",
                module=name.rpartition(".")[0],
                hint="derive traces the step of the config's model: pass a factory with dims={...} that builds "
                "the model at the sizes given and freezes the same parameters, or derive the model as built",
            )
    _compare_ties(model, probe)
    _compare_hooks(model, probe, counts, probe_blocks)
    if dtypes:
        _compare_dtypes(model, probe, counts, probe_blocks)


def _compare_hooks(model: nn.Module, probe: StepTrace, counts: dict[str, int], probe_blocks: int) -> None:
    """Each place of the user's model holds the hooks its counterpart in the probe model holds (block i of a
    layer stack against the probe's block in its position), by the hooks' names."""
    mine = hooks_of(model)
    if not mine and not probe.hooks:  # the common case: no hook on either
        return
    for key in hook_places(model):
        have = mine.get(key, ())
        for name in _probe_names(key, counts, probe_blocks):
            theirs = probe.hooks.get(name, ())
            if have != theirs:
                where, kind, module = describe_hook(key)
                extra = Counter(have) - Counter(theirs)  # hooks the given model has beyond the rebuilt one's
                state, other = ("has", "has not") if extra else ("lacks", "has")
                named = sorted((extra or Counter(theirs) - Counter(have)).elements())
                raise SymacctError(
                    f"the given model {state} a {kind} on {where} ({', '.join(named)}) that the model rebuilt from "
                    f"its config {other}: a hook or a replaced method runs in the step, and can keep tensors alive, "
                    "free gradients inside backward or add ops, so the figures of the rebuilt model would not be "
                    "this model's",
                    module=module,
                    hint="register it where the model is built (its __init__), or pass a factory with dims={...} "
                    "that builds the model at the sizes given and registers it, or derive the model without it",
                )


def _kinds(model: nn.Module, params: dict[str, Any], buffers: dict[str, Any]) -> list[tuple[str, Any, dict[str, Any]]]:
    """("parameter", the model's named parameters, ``params``) and the same for its buffers: every name, shared
    tensors under each of theirs, as the probe trace records them."""
    return [
        ("parameter", model.named_parameters(remove_duplicate=False), params),
        ("buffer", model.named_buffers(remove_duplicate=False), buffers),
    ]


def _compare_names(model: nn.Module, probe: StepTrace, counts: dict[str, int], probe_blocks: int) -> None:
    for kind, named, theirs in _kinds(model, probe.param_dtypes, probe.buffer_dtypes):
        mine = [name for name, _ in named]
        for name in mine:
            if not any(n in theirs for n in _probe_names(name, counts, probe_blocks)):
                _refuse_name(kind, name, "the given model has", "has none")
        lost = _missing(set(mine), theirs, counts, probe_blocks)
        if lost is not None:
            _refuse_name(kind, lost, "the model rebuilt from its config has", "has none: it was removed")


def _refuse_name(kind: str, name: str, who: str, other: str) -> None:
    raise SymacctError(
        f"{NOT_THE_SAME}: {who} a {kind} {name}; the other {other}",
        module=name.rpartition(".")[0],
        hint=f"a {kind} added or removed after construction makes another model than type(model)(config) "
        "(other bytes held, even where no op uses it): build the model from its config, or pass a factory "
        "with dims={...}",
    )


def _missing(mine: set[str], theirs: Iterable[str], counts: dict[str, int], probe_blocks: int) -> str | None:
    """The first name of the probe model's (parameters or buffers) that the user's model lacks: outside the
    layer stacks by name, in block i of a stack those of the probe block(s) in its position (``_positions``)."""
    rests: dict[tuple[str, int], set[str]] = {}
    for name in sorted(theirs):
        at = _in_stack(name, counts)
        if at is None:
            if name not in mine:
                return name
            continue
        path, j, rest = at
        rests.setdefault((path, j), set()).add(rest)
    for path, n in counts.items():
        prefix = f"{path}." if path else ""
        for i in range(n):
            js = [i] if n == probe_blocks else _positions(i, n, probe_blocks)
            need = set.intersection(*(rests.get((path, j), set()) for j in js))
            for rest in sorted(need):
                if f"{prefix}{i}.{rest}" not in mine:
                    return f"{prefix}{i}.{rest}"
    return None


def _compare_ties(model: nn.Module, probe: StepTrace) -> None:
    """Parameters shared under several names (tied weights) are shared alike in both models, among the names
    both have (the probe's blocks are fewer than the user's)."""
    both = set(probe.param_dtypes)
    theirs: dict[str, frozenset[str]] = {}
    for names in probe.param_names.values():
        group = frozenset(n for n in names if n in both)
        theirs.update(dict.fromkeys(group, group))
    by_tensor: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
    for names in by_tensor.values():
        mine = frozenset(n for n in names if n in both)
        for n in sorted(mine):
            if theirs.get(n, mine) != mine:
                given, rebuilt = (_sharing(group) for group in (mine, theirs[n]))
                raise SymacctError(
                    f"the given model's parameter {n} {given}; in the model rebuilt from its config it {rebuilt}",
                    module=n.rpartition(".")[0],
                    hint="weights tied or untied after construction make another model than type(model)(config) "
                    "(another parameter count, another backward): set the config's own tying field, or pass a "
                    "factory with dims={...}",
                )


def _sharing(group: frozenset[str]) -> str:
    return "is a parameter of its own" if len(group) == 1 else f"is shared by {', '.join(sorted(group))}"


def _compare_dtypes(model: nn.Module, probe: StepTrace, counts: dict[str, int], probe_blocks: int) -> None:
    floats = {p.dtype for p in model.parameters() if p.is_floating_point()}
    for kind, named, theirs in _kinds(model, probe.param_dtypes, probe.buffer_dtypes):
        for name, t in named:
            wants = [theirs[n] for n in _probe_names(name, counts, probe_blocks) if n in theirs]
            if wants and t.dtype not in wants:
                _refuse_dtype(kind, name, t.dtype, wants[0], floats)


def _refuse_dtype(kind: str, name: str, dtype: torch.dtype, want: torch.dtype, floats: set[torch.dtype]) -> None:
    module = name.rpartition(".")[0]
    if kind == "buffer":
        raise SymacctError(
            f"the given model's buffer {name} is {dtype} where the model rebuilt from its config builds it in {want}",
            module=module,
            hint="a buffer cast after construction makes another model than type(model)(config) (other bytes, "
            "other ops): build the model from its config, with params_dtype= (or autocast=) for low precision",
        )
    if len(floats) > 1:
        raise SymacctError(
            f"the given model's parameters mix {', '.join(sorted(str(d) for d in floats))}; the model rebuilt "
            f"from its config builds {name} in {want}, the given one has it in {dtype}",
            module=module,
            hint="derive traces one parameter dtype: give the model in one dtype, with params_dtype= (or "
            "autocast=) for low precision",
        )
    short = dtype_key(dtype)
    raise SymacctError(
        f"the given model's parameter {name} is {dtype} where the model rebuilt from its config builds it in {want}",
        module=module,
        hint=f"pass params_dtype='{short}' (--params-dtype {short}) to derive a step with the parameters in "
        f"{dtype}, as the given model's are; for mixed precision (fp32 parameters, {short} compute) give the "
        f"{want} model with autocast='{short}'",
    )


def _stack_counts(model: nn.Module, stacks: list[str]) -> dict[str, int]:
    """Stack path -> its number of blocks in ``model`` (a path the model lacks is left out)."""
    counts = {}
    for path in stacks:
        try:
            counts[path] = len(model.get_submodule(path)) if path else len(model)  # type: ignore[arg-type]
        except (AttributeError, TypeError):
            continue
    return counts


def compare_parameters(
    model: nn.Module,
    probe: StepTrace,
    stacks: list[str],
    probe_blocks: int,
    read: Callable[[int], int | None],
) -> None:
    """Refuse when a parameter or buffer of the user's ``model`` is not the shape its counterpart in the probe
    model has, read in symbols and taken at the model's own sizes (``read``: a probe size -> that size in the
    user's model, None where it has no reading, which is then not compared).

    The op comparison counts ops, not sizes: a module resized after construction (an MLP pruned to another
    width, a longer mask or rotary table) or a constructor patched since the family was memoised runs the same
    ops at other sizes, and would otherwise be derived as the config's model. A tensor of block i of a layer
    stack is compared with the probe's block in the same position (the first, a middle one, the last; block i
    itself when both have as many blocks); one with no counterpart is refused by ``compare_settings``.
    """
    counts = _stack_counts(model, stacks)
    for kind, named, probe_shapes in _kinds(model, probe.param_shapes, probe.buffer_shapes):
        for name, t in named:
            if isinstance(t, nn.parameter.UninitializedParameter | nn.parameter.UninitializedBuffer):
                continue
            shape = tuple(int(d) for d in t.shape)
            targets = [probe_shapes[n] for n in _probe_names(name, counts, probe_blocks) if n in probe_shapes]
            if not targets or any(_fits(shape, target, read) for target in targets):
                continue
            want = tuple(read(d) if read(d) is not None else "?" for d in targets[0])
            raise SymacctError(
                f"{NOT_THE_SAME}: {kind} {name} is {shape} in the given model and {want} {AT_OWN_SIZES}",
                module=name.rpartition(".")[0],
                shapes=[shape, want],
                hint="a module replaced or resized after construction, or a constructor changed since the model "
                "was built, makes another model than type(model)(config): build the model from its config, or "
                "pass a factory with dims={...}",
            )


def _in_stack(name: str, counts: dict[str, int]) -> tuple[str, int, str] | None:
    """(stack path, block index, name within the block) of a name inside a layer stack, else None."""
    for path in counts:
        prefix = f"{path}." if path else ""
        if not name.startswith(prefix):
            continue
        head, _, rest = name[len(prefix) :].partition(".")
        if head.isdigit() and rest:
            return path, int(head), rest
    return None


def _probe_names(name: str, counts: dict[str, int], probe_blocks: int) -> list[str]:
    """The names a parameter or buffer of the user's model has in the probe model (see ``compare_parameters``)."""
    at = _in_stack(name, counts)
    if at is None:
        return [name]
    path, i, rest = at
    n = counts[path]
    prefix = f"{path}." if path else ""
    js = [i] if n == probe_blocks else _positions(i, n, probe_blocks)
    return [f"{prefix}{j}.{rest}" for j in js]


def _fits(shape: tuple[int, ...], probe: tuple[int, ...], read: Callable[[int], int | None]) -> bool:
    return len(shape) == len(probe) and all(read(d) in (None, s) for s, d in zip(shape, probe))


KEEP = 4  # blocks of the user's model traced: the first three and the last (the probe has 4)


@contextlib.contextmanager
def shortened(model: nn.Module, stacks: list[str], keep: int = KEEP) -> Iterator[bool]:
    """While open, each layer stack of the user's ``model`` holds only its blocks 0, 1, 2 and the last (its first
    ``keep - 1`` and the last), when every middle block is built alike: the same module types, settings and
    parameter shapes (``_block_signature``). The model is restored on exit (derive holds a process-wide lock
    meanwhile).

    A fake copy taken inside then costs as much to copy and to trace as the probe, whatever the model's
    depth; the blocks left out are checked by their structure, the ones kept by their ops. Yields whether
    any stack was shortened.
    """
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        for path in stacks:
            if not path:
                continue
            stack = model.get_submodule(path)
            n = len(stack)
            if n <= keep or not isinstance(stack, (nn.ModuleList, nn.Sequential)):
                continue
            if _first_unlike(stack) is not None:
                continue
            kept = [stack[i] for i in (*range(keep - 1), n - 1)]
            parent, _, name = path.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            short = nn.ModuleList(kept) if isinstance(stack, nn.ModuleList) else nn.Sequential(*kept)
            owner._modules[name] = short
            swapped.append((owner, name, stack))
        yield bool(swapped)
    finally:
        for owner, name, stack in reversed(swapped):
            owner._modules[name] = stack


def _first_unlike(stack: nn.Module) -> int | None:
    """The first middle block (1 .. n-2) of a stack built unlike block 1 (``_block_signature``), or None when
    they are all alike. A setting equal to the block's number in every block is its layer number
    (``layer_idx``): not compared."""
    n = len(stack)
    sigs = {i: _block_signature(stack[i]) for i in range(1, n - 1)}
    if not sigs:
        return None
    numbered = {k for k in sigs[1] if all(sig.get(k) == i for i, sig in sigs.items())}
    alike = {i: {k: v for k, v in sig.items() if k not in numbered} for i, sig in sigs.items()}
    return next((i for i in sigs if alike[i] != alike[1]), None)


def unlike_middle(model: nn.Module, stacks: list[str]) -> str | None:
    """Why a layer stack of the user's ``model`` cannot be factored as its first block, L - 2 identical
    middle blocks and its last: the stack and its first middle block built unlike block 1 (DeepSeek-V3's
    first three blocks dense, the rest experts); None when every stack's middle blocks are alike."""
    for path in stacks:
        stack = model.get_submodule(path) if path else model
        if not isinstance(stack, (nn.ModuleList, nn.Sequential)) or len(stack) < 4:
            continue
        i = _first_unlike(stack)
        if i is not None:
            return f"block {i} of {path or 'the model'} is built unlike block 1 (the middle blocks differ)"
    return None


def _block_signature(block: nn.Module) -> dict[tuple[str, ...], object]:
    """What makes a block run the ops it runs, short of tracing it: per module its type, its settings
    (attributes), its hooks and its parameters' and buffers' shapes, dtypes and grad flags."""
    out: dict[tuple[str, ...], object] = {}
    for name, m in block.named_modules():
        out[("type", name)] = type(m).__qualname__
        for k, v in vars(m).items():
            if k in ("_parameters", "_buffers", "_modules"):
                continue
            out[("attr", name, k)] = len(v) if "hook" in k and hasattr(v, "__len__") else _setting(v)
        out[("tensors", name)] = tuple(
            (k, tuple(t.shape), str(t.dtype), t.requires_grad)
            for k, t in [*m._parameters.items(), *m._buffers.items()]
            if t is not None
        )
    return out


def _setting(v: object) -> object:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return tuple(_setting(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((str(k), repr(_setting(x))) for k, x in v.items()))
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), str(v.dtype))
    if isinstance(v, functools.partial):
        return (_setting(v.func), _setting(v.keywords))
    if callable(v):
        return getattr(v, "__qualname__", type(v).__qualname__)
    if hasattr(v, "__dict__"):  # a config object: its settings, private ones included (_attn_implementation)
        return (type(v).__qualname__, _setting(dict(vars(v))))
    return type(v).__qualname__
