"""``derive``: one step of a model as formulas, by a short sequence of passes, each from one result to the next.

1. ``read_source``: which config fields are sizes (and their letters), the
   layer count, the step's inputs and loss (a transformers model's task),
   fields kept at their values; every choice is a note on the result.
2. ``choose_probes``: two sets of probe sizes (``symacct.trace.probe``), distinct
   primes; nothing of real size is built, so the model's own size does not
   matter (a 405B config, or a model on the meta device).
3. ``trace_first``: the model rebuilt at the first probe's sizes with 4
   blocks, its step recorded on fake tensors (``symacct.trace.record``), every size
   read back as a product of symbols and every op costed (``symacct.cost.rules``),
   the layer stacks factored (``symacct.cost.layers``).
4. ``check_same_model``: the user's own parameters have the probe model's
   dtypes, gradient flags and tying, and the user's own model (a fake copy,
   blocks 0, 1, 2 and the last) runs the probe model's ops
   (``symacct.sameness``); a difference is refused, after one more try with
   degenerate sizes tied or kept.
5. ``trace_check``: the probe model at the second probe's sizes with one block
   more, costed in plain integers; every total must equal the formulas there.
   Then ``check_parameters`` (pass 4's second half, once the readings are
   confirmed): every parameter of the user's model has the probe model's
   shape at the model's own sizes (a module resized after construction runs
   the same ops at other sizes).
6. ``memory_pass``: static bytes, saved activations, live bytes factored by L
   (the checking trace gives the block more), the phase points and the peak.
7. ``account``: the graph and its totals, the constraints on the sizes, the
   experts, the notes (``symacct.accounting``).

A family derived before in the process (``symacct.memo``, keyed by ``family_key``) takes passes 3, 5 and 6
from the memo (``from_memo``); pass 4 still traces the user's model, against the memo's probe trace, and
compares its parameters' shapes; a difference drops the entry and derives afresh.

A pass that finds the layer stack cannot be factored raises ``_FixLayers``:
derive starts again with L fixed at its value. A failure with size fields of
the model's own as symbols (no known name) is tried again with each
following the known width it equals, or kept at its value, then with all
kept (``_tie_or_keep_own``); a failure that neither mends, with the head
counts as symbols, once more with them fixed (ALiBi's power-of-two split of
the heads). Transformers models get their
task's step (``symacct.models.hf``); models with strided convolutions or pooling an
image side S that halves (S = 64 * prime).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import sys
import threading
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import networkx as nx
import numpy as np
import sympy
import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeCopyMode,
    FakeTensorMode,
)

from symacct import memo
from symacct.accounting import Accounting, aggregate
from symacct.cost.experts import expert_layers
from symacct.cost.experts import note as experts_note
from symacct.cost.graph import CostedOp, build_graph, cost_ops
from symacct.cost.layers import METRICS, factor, find_stacks, generic_path, repeated
from symacct.cost.rules import registry as rule_registry
from symacct.cost.rules.memory_ops import MOVES
from symacct.errors import SymacctError
from symacct.memory.liveness import Liveness, fill_phases, intervals, liveness
from symacct.memory.reserved import Timeline
from symacct.memory.static import Memory, static_and_activations
from symacct.models.hf import (
    WINDOWS,
    carried_settings,
    carry_checkpointing,
    check_experts_path,
    check_routing,
    eager_paths,
    is_transformers_model,
    last_within,
    window_constraints,
)
from symacct.models.hf import serving_inputs as hf_serving_inputs
from symacct.models.hf import task as task_for
from symacct.models.hf import tp_plan as hf_tp_plan
from symacct.options import CACHE_DTYPES, OPTIMIZERS, dtype_key, optimizer_factory, torch_dtype
from symacct.sameness import (
    AT_OWN_SIZES,
    KEEP,
    NOT_THE_SAME,
    TENSOR_PARALLEL_IGNORED,
    _empty_like,
    compare_flops,
    compare_parameters,
    compare_settings,
    compare_shapes,
    fake_copy,
    op_counts,
    shortened,
    unlike_middle,
)
from symacct.sameness import compare as compare_ops
from symacct.symbols import ALIASES, ORDER, exact_form, letter_for_field, sym
from symacct.time.hardware import get as get_hardware
from symacct.trace.constraints import Constraint
from symacct.trace.constraints import check as check_constraints
from symacct.trace.constraints import learn as learn_constraints
from symacct.trace.context_parallel import sharded as sequence_sharded
from symacct.trace.counted import counts_flops
from symacct.trace.hooks import describe as describe_hook
from symacct.trace.hooks import hooks_of
from symacct.trace.probe import (
    EVEN_LENGTHS,
    FIRST_PRIMES,
    HEAD_PRIMES,
    HEAD_WIDTHS,
    LAYERS,
    OFFSETS,
    SECOND_PRIMES,
    SMALL_PRIMES,
    TP_PRIMES,
    Probe,
    make_probe,
)
from symacct.trace.record import (
    StepTrace,
    call_inputs,
    check_device,
    no_cycle_collection,
    padded_sizes,
    record_step,
)
from symacct.trace.sdpa import check_backend
from symacct.trace.sdpa_choice import Target
from symacct.trace.tensor_parallel import apply_plan, check_plan, fake_group, mesh_groups


@dataclasses.dataclass
class _Source:
    """How to build the model at any sizes: fields -> letters, and a builder."""

    fields: dict[str, str]  # config field -> letter
    values: dict[str, int]  # config field -> the model's own value
    build: Callable[[dict[str, int]], nn.Module]  # field values -> model (called inside fake mode)
    inputs: Callable[[nn.Module, int, int], tuple[Any, ...]]
    configless: bool = False
    lists: dict[str, Any] = dataclasses.field(default_factory=dict)  # list/tuple config fields (per-layer lists)
    notes: list[str] = dataclasses.field(default_factory=list)
    # while the layer count is looked for: the candidate field, whose per-layer lists follow it in build()
    candidate: dict[str, str] = dataclasses.field(default_factory=dict)
    # the model has strided convolutions or pooling: S (an image side) is probed as IMAGE_SCALE * prime
    strided: bool = False
    # derive's retry: the widths probed even (2 * prime), for a step that halves one (x.chunk(2, -1))
    even: bool = False
    # fields that each count the blocks of one of several stacks at the same depth (encoder, decoder)
    repeat_counts: list[str] = dataclasses.field(default_factory=list)
    # the context every trace runs in (transformers: the eager paths, symacct.models.hf.eager_paths)
    context: Callable[[], Any] = contextlib.nullcontext
    # a field that is a quotient of two others at the user's values (head_dim = hidden_size / heads) and
    # follows them at probe sizes: field -> (numerator field, denominator field or None for the numerator itself)
    follow: dict[str, tuple[str, str | None]] = dataclasses.field(default_factory=dict)
    # input sizes besides B and S (a sequence-to-sequence step's decoder length S_dec): probed like them,
    # passed to inputs by keyword
    input_dims: tuple[str, ...] = ()
    loss: Any = None  # the step's loss (the user's, a transformers task's, or None: the output is the loss)
    constants: list[str] = dataclasses.field(default_factory=list)  # integer fields that set no size
    kept: list[str] = dataclasses.field(default_factory=list)  # own size fields kept at their values (the retry)
    inputs_given: bool = False  # the inputs come from inputs= (or a task), not from model.example_inputs
    seq: int | None = None  # S kept at this value, no symbol (a decode step: one new token)
    # field values -> the config build() constructs the model with (a model with a config; else None)
    config_at: Callable[[dict[str, int]], Any] | None = None
    # the memory format build() converts the model to, as the user's was after construction (_converted_layout)
    layout: torch.memory_format | None = None


@contextlib.contextmanager
def _global_reads(config: Any) -> Iterator[None]:
    """Reads of a transformers config's global values, where it gives some fields per layer (Gemma 4's
    ``head_dim`` of its full-attention layers): the global value is a size like any other; a layer's own value
    stays in the config's per-layer overrides, a constant of the rebuilt model (the comparison with the user's
    model checks that the rebuilt one is the same model)."""
    flag = "allow_global_per_layer_attribute_access"
    if "_heterogeneity_spec" not in getattr(config, "__dict__", {}) or getattr(config, flag, True):
        yield
        return
    setattr(config, flag, True)
    try:
        yield
    finally:
        setattr(config, flag, False)


def _config_items(config: Any) -> list[tuple[str, Any]]:
    """(name, value) of every field of a dataclass, dict or plain-object config."""
    if dataclasses.is_dataclass(config):
        with _global_reads(config):
            return [(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)]
    if isinstance(config, Mapping):
        return list(config.items())
    if hasattr(config, "__dict__"):
        return list(vars(config).items())
    raise SymacctError(
        f"the model's config is a {type(config).__name__}, which symacct cannot read fields from",
        hint="give the model a dataclass (or dict, or plain object) config, or pass a factory with dims={...}",
    )


def _int_fields(config: Any) -> dict[str, int]:
    return {k: v for k, v in _config_items(config) if isinstance(v, int) and not isinstance(v, bool)}


def _with_fields(config: Any, values: Mapping[str, int]) -> Any:
    """The config with ``values`` replaced and every other setting carried over.

    ``dataclasses.replace`` builds a new object through ``__init__``: an
    attribute set after construction (an attention implementation chosen on the
    config, a flag) would be lost or reset, and the probe model would silently
    be another model. Such attributes are copied over unless they are integers
    (sizes ``__post_init__`` derives from the new values).
    """
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        with _global_reads(config):
            new = dataclasses.replace(config, **values)
        for k, v in vars(config).items():
            # an integer the new config derived itself (a size __post_init__ computes) is its own; one it lacks
            # (transformers keeps unknown keyword arguments such as decoder_start_token_id as attributes) is kept
            if k in values or (isinstance(v, int) and not isinstance(v, bool) and k in vars(new)):
                continue
            if k not in vars(new) or vars(new)[k] is not v and vars(new)[k] != v:
                try:
                    setattr(new, k, v)
                except (AttributeError, TypeError) as e:  # frozen: refuse rather than trace another model
                    raise SymacctError(
                        f"the config's setting {k}={v!r} is lost when it is rebuilt at other sizes",
                        hint="make it a field of the config dataclass, so that dataclasses.replace keeps it",
                    ) from e
        return new
    if isinstance(config, Mapping):
        return type(config)({**config, **values}) if not isinstance(config, type) else config
    new = copy.copy(config)
    for k, v in values.items():
        setattr(new, k, v)
    return new


def _source(
    model: Any, inputs: Callable[..., Any] | None, dims: Mapping[str, int] | None, fixed: Iterable[str]
) -> _Source:
    fixed = set(fixed)

    def make_inputs_fn(default_owner: bool) -> Callable[[nn.Module, int, int], tuple[Any, ...]]:
        if inputs is not None:
            return lambda m, B, S, **more: call_inputs(inputs, m, B, S, **more)
        if not default_owner:
            raise SymacctError(
                "the model has no example_inputs(B, S) method",
                hint="pass inputs=lambda B, S: (...) returning the positional inputs of one step",
            )
        return lambda m, B, S: tuple(m.example_inputs(B, S))

    if dims is not None:
        if not callable(model) or isinstance(model, nn.Module):
            raise SymacctError(
                "dims= needs a factory, not a built module",
                hint="pass derive(lambda D, L: MyModel(D, L), dims={'D': 512, 'L': 4}, inputs=...)",
            )
        if not isinstance(dims, Mapping):
            raise SymacctError(f"dims= must be a dict of sizes, got {type(dims).__name__}", hint="dims={'D': 512}")
        for k, v in dims.items():
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise SymacctError(
                    f"dims={{{k!r}: {v!r}}}: a size must be a positive integer",
                    hint="pass the model's own sizes, e.g. dims={'D': 512, 'L': 4}",
                )
        _check_fixed(fixed, set(dims), "dims")
        factory = model
        fields = {k: letter_for_field(k) for k in dims if k not in fixed}
        return _Source(
            fields=fields,
            values=dict(dims),
            build=lambda vals: factory(**{**dims, **vals}),
            inputs=make_inputs_fn(False),
        )
    if not isinstance(model, nn.Module):
        raise SymacctError(
            f"expected an nn.Module, got {type(model).__name__}",
            hint="pass a model, or a factory with dims={...}",
        )
    config = getattr(model, "config", None)
    has_example = hasattr(model, "example_inputs")
    if config is None:
        if fixed:
            raise SymacctError(
                f"fixed={sorted(fixed)} names fields, but the model has no config",
                hint="without a config only B and S are symbols; drop fixed=",
            )
        original = model
        _refuse_tensor_hooks(model)

        def build_copy(vals: dict[str, int]) -> nn.Module:
            return copy.deepcopy(original)

        return _Source({}, {}, build_copy, make_inputs_fn(has_example), configless=True)
    ints = _int_fields(config)
    _check_fixed(fixed, set(ints), "config")
    fields = {k: letter_for_field(k) for k in ints if k not in fixed}
    cls = type(model)
    lists = _list_fields(config)
    candidate: dict[str, str] = {}
    follow: dict[str, tuple[str, str | None]] = {}

    def config_at(vals: dict[str, int]) -> Any:
        # a per-layer list (one entry per layer) follows the layer count: all alike, it is resized; while the
        # layer count is looked for (candidate), a mixed one is repeated cyclically, only to count the repeats
        lfield = candidate.get("field") or next((f for f, letter in fields.items() if letter == "L"), None)
        extra = {}
        if lfield is not None and lfield in vals:
            for name, seq in lists.items():
                if len(seq) == ints[lfield] and (_uniform(seq) or candidate):
                    extra[name] = type(seq)(seq[i % len(seq)] for i in range(vals[lfield]))
        for name, (num, den) in follow.items():
            if den is None and num in vals:
                extra[name] = vals[num]
            elif den is not None and (num in vals or den in vals):
                extra[name] = vals.get(num, ints[num]) // vals.get(den, ints[den])
        return _with_fields(config, {k: v for k, v in {**vals, **extra}.items() if k != TP})

    layout = _converted_layout(model)

    def build(vals: dict[str, int]) -> nn.Module:
        built = cls(config_at(vals))
        if is_transformers_model(model):
            carry_checkpointing(model, built)
        if layout is not None:  # model.to(memory_format=torch.channels_last) after construction, done again
            _to_layout(built, layout)
        return built

    return _Source(
        fields=fields,
        values=ints,
        build=build,
        inputs=make_inputs_fn(has_example),
        lists=lists,
        candidate=candidate,
        follow=follow,
        config_at=config_at,
        layout=layout,
    )


IMAGE_SCALE = 64  # S = 64 * prime: six halvings of the image side stay whole (ResNet's stem and stages: five)
# ops that shrink a size by their stride: a step that runs them outside any module ``_strided`` sees is derived again
# with S probed as IMAGE_SCALE * prime (F.max_pool2d, F.avg_pool2d, F.conv2d with a stride)
_HALVING = {
    *(f"{kind}_pool{n}d" for kind in ("max", "avg") for n in (1, 2, 3)),
    *(f"max_pool{n}d_with_indices" for n in (2, 3)),
    "convolution",
}
# a mixture of experts: grouped matmuls (transformers' default experts path) want every row stride a multiple of
# 16 bytes, so widths other than D (already 8*H*prime) are probed as 16 * prime
EXPERT_WIDTH_SCALE = 16
_NOT_WIDTHS = {"H", "H_kv", "L", "E", "k"}  # counts: never a kept part of a width (Probe.cuts)
_NOT_HALVED = {"B", "S", "S_max", "S_dec", "C", "L", "H", "H_kv", "E", "k", "tp"}  # sizes the even retry keeps
# sizes never scaled as an expert width: counts, lengths (a cache of C positions, a decoder of S_dec), tables
_LENGTHS = {"S", "S_dec", "C", "S_max"}
_COUNTS = {"B", "L", "D", "H", "H_kv", "V", "E", "k", "patch_size", "image_size", *HEAD_WIDTHS, *_LENGTHS}


def _refuse_tensor_hooks(model: nn.Module) -> None:
    """A model without a config is traced as a fake copy: its modules' hooks come with it, its parameters' do
    not (a fake tensor is made anew from each), so a step with them is refused rather than traced without."""
    for key, names in hooks_of(model).items():
        where, kind, module = describe_hook(key)
        if module != where:  # a parameter's hook
            raise SymacctError(
                f"the model has a {kind} on its parameter {where} ({', '.join(names)}), which the fake copy "
                "derive traces would run without: a parameter's hooks are not copied with it (they can free "
                "gradients inside backward or add ops)",
                module=module,
                hint="pass a factory with dims={...} that builds the model and registers the hook (it is then "
                "traced), or derive the model without it",
            )


def _converted_layout(model: nn.Module) -> torch.memory_format | None:
    """``torch.channels_last`` (``channels_last_3d``) when every 4-d (5-d) parameter whose strides tell the two
    layouts apart has it, as after ``model.to(memory_format=torch.channels_last)``: the model rebuilt from its
    config is converted so too (its convolutions then run on the same layout: other copies, other saved
    tensors). A model only partly converted is left as it is (the sameness check then refuses it)."""
    for dim, layout in ((4, torch.channels_last), (5, torch.channels_last_3d)):
        told = [
            p
            for p in model.parameters()
            if p.dim() == dim and p.is_contiguous() != p.is_contiguous(memory_format=layout)
        ]
        if told and all(p.is_contiguous(memory_format=layout) for p in told):
            return layout
    return None


def _to_layout(model: nn.Module, layout: torch.memory_format) -> None:
    """``model.to(memory_format=layout)`` as eager PyTorch runs it on the CPU (``Module._apply``: each parameter's
    ``.data`` set, each buffer replaced), for the 4-d (or 5-d) tensors the layout applies to; on fake tensors
    too, where ``Module.to`` fails (it would swap the parameters)."""
    dim = 5 if layout == torch.channels_last_3d else 4
    with torch.no_grad():
        for module in model.modules():
            for p in module._parameters.values():
                if p is not None and p.dim() == dim:
                    p.data = p.data.contiguous(memory_format=layout)
            for name, b in module._buffers.items():
                if b is not None and b.dim() == dim:
                    module._buffers[name] = b.contiguous(memory_format=layout)


def _odd_halves(failed: SymacctError) -> bool:
    """Whether an op failed on two shapes one apart in one dimension, as the halves of an odd width are
    (``x.chunk(2, -1)`` of a prime width; a rotary table ``cat([f, f])`` of ``arange(0, D, 2)``'s ceil(D/2)
    frequencies, D + 1 wide, broadcast against a tensor of D): the retry that probes the widths even. The
    dimensions are aligned from the last, as broadcasting aligns them."""
    if not failed.what.startswith("the op failed on fake tensors"):
        return False
    shapes = [s for s in failed.shapes or () if isinstance(s, tuple)]
    return any(
        any(abs(x - y) == 1 and min(x, y) > max(OFFSETS) for x, y in zip(reversed(a), reversed(b)))
        for i, a in enumerate(shapes)
        for b in shapes[i + 1 :]
    )


def _strided(model: Any, src: _Source) -> bool:
    """Whether the model has a convolution or pooling with a stride above 1: its image side is then halved,
    and S is probed as a multiple of IMAGE_SCALE so that the halves are whole. The user's own module is
    looked at (a factory's model is built on fake tensors)."""
    if not isinstance(model, nn.Module):
        model = _fake_build(src, {})
        if model is None:
            return False
    for m in model.modules():
        stride = getattr(m, "stride", None)
        if isinstance(m, (nn.modules.conv._ConvNd, nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd)):
            strides = stride if isinstance(stride, tuple) else (stride,)
            if any(isinstance(x, int) and x > 1 for x in strides):
                return True
    return False


def _follow_heads(src: _Source, degenerate: bool, tp: int | None = None) -> list[str]:
    """Notes on fields that follow others at probe sizes instead of being symbols of their own, or stay fixed.

    - a head width equal to D/H (``head_dim`` stored by transformers' configs): it follows D/H;
    - with ``degenerate`` (derive's second try, when the model rebuilt at probe sizes ran other ops than the
      user's): key/value heads equal to the heads follow H (code branches on H == H_kv: transformers'
      ``repeat_kv`` returns at once), the width equal to the heads follows H (heads of width 1: their
      transposes are free, so fewer copies run), and sizes of 1 stay 1 (they broadcast and make transposes
      free);
    - with tensor parallelism of degree ``tp``, heads or key/value heads equal to tp (one a rank) follow tp, on
      the first try: the probe's many heads a rank would run other ops.
    """
    notes = []

    def follow(field: str, leader: str, why: str) -> None:
        src.follow[field] = (leader, None)
        del src.fields[field]
        notes.append(f"{field} = {leader} ({why}): it follows {'tp' if leader == TP else 'H'}")

    for one in _heads_per_rank_one(src, tp):  # at once: a single head a rank takes views where several copy
        follow(one, TP, f"one {'key/value ' if src.fields[one] == 'H_kv' else ''}head a rank")
    tie, narrow = _heads_tie(src), _width_one_head(src)
    if degenerate and tie is not None:
        follow(tie[1], tie[0], "no grouped heads")
    if degenerate and narrow is not None:
        follow(narrow[0], narrow[1], "heads of width 1")
    ones = sorted(f for f, letter in src.fields.items() if src.values[f] == 1 and letter != "L") if degenerate else []
    for f in ones:
        del src.fields[f]
    if ones:
        notes.append(f"{', '.join(ones)} = 1: kept at 1 (a size of 1 runs other ops: broadcasts, free transposes)")
    for f in _follow_head_width(src):
        notes.append(f"{f} = {src.values[f]} is the model width over the heads: it follows D/H")
    return notes


def _own_letters(src: _Source) -> list[str]:
    """Fields that read as one letter with different values (MiniMax's linear-attention ``block_size``, 256,
    and its ``max_position_embeddings``, both S_max by name): one symbol cannot be both sizes, so the field
    listed first in ``ALIASES`` keeps the letter (transformers' names first, nanoGPT's ``block_size`` last)
    and the others are symbols of their own names. Fields with equal values share their letter (CodeGen's
    ``n_positions`` and ``n_ctx``): one size, probed as one."""
    by_letter: dict[str, list[str]] = defaultdict(list)
    for f, letter in src.fields.items():
        if letter != f:
            by_letter[letter].append(f)
    notes = []
    for letter, names in sorted(by_letter.items()):
        if len(names) < 2:
            continue
        values = ", ".join(f"{f} = {src.values[f]}" for f in sorted(names))
        if len({src.values[f] for f in names}) == 1:
            notes.append(f"{values} read as one size, {letter}, by name: one symbol (a size at() gives sets both)")
            continue
        keeper = next(f for f in ALIASES if f in names)
        own = sorted(f for f in names if f != keeper)
        for f in own:
            src.fields[f] = f
        notes.append(
            f"{values} read as one size, {letter}, by name: {keeper} is {letter}; {', '.join(own)} a symbol of its own"
        )
    return notes


def _tied(src: _Source) -> dict[str, str | int]:
    """Letters of size fields that are no symbol here: the letter they follow (H_kv follows H), or their kept
    value (a size of 1). ``at(H_kv=...)`` accepts them at that value only."""
    out: dict[str, str | int] = {}
    for f, v in src.values.items():
        letter = letter_for_field(f)
        if f in src.fields or letter == f or letter in src.fields.values():
            continue
        follow = src.follow.get(f)
        if follow is not None and follow[1] is None and follow[0] == TP:
            out[letter] = TP
        elif follow is not None and follow[1] is None and follow[0] in src.fields:
            out[letter] = src.fields[follow[0]]
        else:
            out[letter] = v
    return out


def _heads_tie(src: _Source) -> tuple[str, str] | None:
    """The (heads, key/value heads) fields when both are symbols with equal values (no grouped heads)."""
    by_letter = {letter: f for f, letter in src.fields.items()}
    h, kv = by_letter.get("H"), by_letter.get("H_kv")
    return (h, kv) if h is not None and kv is not None and src.values[h] == src.values[kv] else None


def _width_one_head(src: _Source) -> tuple[str, str] | None:
    """The (width, heads) fields when both are symbols with equal values above 1: heads of width D/H = 1, whose
    transposes are free (a size-1 dimension's stride is not read), so the model copies less than at sizes
    where a head is wider."""
    by_letter = {letter: f for f, letter in src.fields.items()}
    d, h = by_letter.get("D"), by_letter.get("H")
    return (d, h) if d is not None and h is not None and src.values[d] == src.values[h] > 1 else None


def _heads_per_rank_one(src: _Source, tp: int | None) -> list[str]:
    """The heads and key/value heads fields that tensor parallelism leaves one a rank (H == tp, H_kv == tp)."""
    if tp is None:
        return []
    heads = {letter: f for f, letter in src.fields.items() if letter in ("H", "H_kv")}
    one = {letter: f for letter, f in heads.items() if src.values[f] == tp}
    if "H" in one and "H_kv" in heads and "H_kv" not in one:  # fewer key/value heads than ranks: not split
        del one["H"]
    return list(one.values())


def _degenerate_sizes(src: _Source) -> bool:
    """Whether the config has sizes that a second try ties or fixes (see _follow_heads)."""
    ones = any(src.values[f] == 1 and letter != "L" for f, letter in src.fields.items())
    return _heads_tie(src) is not None or _width_one_head(src) is not None or ones


def _follow_head_width(src: _Source) -> list[str]:
    """Head-width fields equal to D/H at the user's values: they follow D/H instead of being symbols."""
    by_letter = {letter: f for f, letter in src.fields.items()}
    d, h = by_letter.get("D"), by_letter.get("H")
    out = []
    if d is None or h is None or src.values[h] <= 0:
        return out
    for f in HEAD_WIDTHS:
        if f in src.fields and src.fields[f] == f and src.values[f] * src.values[h] == src.values[d]:
            src.follow[f] = (d, h)
            del src.fields[f]
            out.append(f)
    return out


def _list_fields(config: Any) -> dict[str, Any]:
    """The config's lists that may hold one entry a layer: not lists of token ids (Whisper's
    ``begin_suppress_tokens``, two ids, read as per-layer in a two-layer model, kept L at its value; Llama
    3.1's ``eos_token_id``, three)."""
    return {
        k: v
        for k, v in _config_items(config)
        if isinstance(v, (list, tuple)) and v and not k.endswith(("_tokens", "_id", "_ids"))
    }


def _uniform(seq: Any) -> bool:
    return all(x == seq[0] for x in seq)


def _build_fake(make: Callable[[], nn.Module], fake: FakeTensorMode, device: str = "cpu") -> nn.Module:
    """``make()`` inside ``fake``. Built on the meta device instead, where initialisation runs nothing, and
    copied to fake tensors: a constructor that reads values while initialising weights (transformers' ViT: a
    data-dependent op, which fake tensors cannot answer), and one that deep-copies a module it built
    (``nn.TransformerEncoder``'s clones of its layer: PyTorch copies a fake tensor into a fake mode of its own,
    which the step then cannot mix with ``fake``), and one that converts a submodule (``.to(torch.float32)``:
    ``Module._apply`` swaps a fake parameter, which fails)."""
    try:
        with fake, warnings.catch_warnings(), _no_weight_init():
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")  # a deep copy's
            model = make()
    except (DataDependentOutputException, DynamicOutputShapeException):
        model = None
    except AssertionError as e:  # the clones initialised in the constructor (nn.Transformer's reset)
        if "Mixing fake modes" not in str(e):
            raise
        model = None
    except RuntimeError as e:  # Module.to() in the constructor (DeepSeek V4's float32 norms): PyTorch swaps a
        if "Couldn't swap" not in str(e):  # fake parameter for its copy, which the fake tensor's weakref forbids
            raise
        model = None
    if model is not None and all(getattr(t, "fake_mode", fake) is fake for t in _tensors_of(model)):
        return model
    with torch.device("meta"):
        model = make()
    return fake_copy(model, fake, device)


@contextlib.contextmanager
def _no_weight_init() -> Iterator[None]:
    """transformers' weight initialisation (``PreTrainedModel.initialize_weights``) switched off, as transformers
    itself does on the meta device: it sets values only, which a fake tensor does not hold, and some of it is
    Python loops over a size (Marian's and Pegasus's sinusoidal tables, position by position: two minutes at
    probe sizes). Weights are still tied (``init_weights`` ties them after this)."""
    tf = sys.modules.get("transformers")
    base = getattr(tf, "PreTrainedModel", None) if tf is not None else None
    if base is None or "initialize_weights" not in base.__dict__:
        yield
        return
    original = base.__dict__["initialize_weights"]
    here = threading.get_ident()

    def initialize_weights(self: Any) -> None:  # another thread's models are initialised as ever
        if threading.get_ident() != here:
            original(self)

    base.initialize_weights = initialize_weights  # type: ignore[method-assign]
    try:
        yield
    finally:
        base.initialize_weights = original  # type: ignore[method-assign]


def _tensors_of(model: nn.Module) -> Iterator[torch.Tensor]:
    for module in model.modules():
        yield from (t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None)


def _fake_build(src: _Source, overrides: dict[str, int]) -> nn.Module | None:
    """The model built with ``overrides`` on fake tensors (nothing allocated); None when it cannot be built so."""
    try:
        with torch.device("cpu"):
            return _build_fake(lambda: src.build(overrides), FakeTensorMode())
    except Exception:  # a size it cannot be built at: no evidence either way
        return None


def _shapes(src: _Source, overrides: dict[str, int]) -> tuple[tuple[Any, ...], dict[str, str], dict[str, int]] | None:
    """Every parameter's and buffer's shape, the module count, each module's type by path, and the number of
    numbered children of each module list, of the model built with ``overrides`` (on fake tensors); None when
    it cannot be built so."""
    model = _fake_build(src, overrides)
    if model is None:
        return None
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    names = [n for n, _ in model.named_modules()]
    types = {n: type(m).__qualname__ for n, m in model.named_modules()}
    return (len(names), *sorted((n, tuple(t.shape)) for n, t in tensors)), types, repeated(names)


def _not_sizes(src: _Source) -> tuple[list[str], list[str]]:
    """Integer fields without a size name that change no tensor of the model, or that switch which modules are
    built: ids, flags, chunk sizes, a step between sparse layers; and, apart, those that set how many modules
    a list holds (ALBERT's ``num_hidden_groups`` and ``inner_group_num``; not the layer count).

    A field such as ``pad_token_id`` or ``bos_token_id`` is not a size: probed
    as one, it would take a value the model rejects (a padding index beyond the
    vocabulary) or another meaning. Each integer field with no known name (not
    an alias, not the layer count) is increased in a model built on fake
    tensors (with at most 2 layers, to stay cheap); when no parameter or buffer
    shape and no module count changes, it stays at the user's value. So does a
    field that changes the type of a module at the same path (Qwen2-MoE's
    ``decoder_sparse_step`` turns expert blocks into dense MLPs): a switch, not
    a size. A field that changes how many numbered modules a list holds is a
    count of modules: probed at a prime in the hundreds it would build that
    many modules (and, nested, their product), so it keeps its value too. A field named by a letter (a
    factory's ``dims={"H": ...}``) is that size by name unless it counts modules: the head count of attention
    whose projections are D x D sets no parameter's shape, only its views and scores.
    """
    if src.configless:
        return [], []
    unknown = sorted(f for f, letter in src.fields.items() if letter == f and letter != "L")
    if not unknown:  # every field a known size name or the layer count: nothing to build
        return [], []
    lfield = next((f for f, letter in src.fields.items() if letter == "L"), None)
    small = {lfield: 2} if lfield is not None and src.values[lfield] > 2 else {}
    built = _shapes(src, small)
    if built is None:
        return [], []
    base, types, lists = built
    out, counts = [], []
    for f in unknown:
        v = src.values[f]
        # 2v + 1, not v + 1: a size read through a floor (image_size // patch_size) may not move by one
        other = _shapes(src, {**small, f: 2 * v + 1 if v != -1 else v + 2})
        if other is None:
            continue
        shapes, kinds, grown = other
        if f not in ORDER and (shapes == base or any(kinds[n] != t for n, t in types.items() if n in kinds)):
            out.append(f)
        elif grown != lists:
            counts.append(f)
    return out, counts


def _repeats(src: _Source, overrides: dict[str, int]) -> dict[str, int]:
    """Module path -> number of numbered children (0..n-1) of the model built with ``overrides``, on fake tensors."""
    model = _fake_build(src, overrides)
    return {} if model is None else repeated(name for name, _ in model.named_modules())


def _layer_field(src: _Source) -> tuple[str, str] | None:
    """The field that sets how many times a module repeats (the layer count), whatever its name.

    Used when no field has a layer-count name (n_layer, num_hidden_layers, ...).
    Candidates are integer fields equal to the length of a repeated module list;
    the model is built again (on fake tensors) with each one increased by 1, and
    the field whose list grows by one is the layer count. When several do, the
    outermost list wins (the layer stack, not the experts inside a layer); a tie
    finds none. Returns (field, module path).
    """
    if src.configless or "L" in src.fields.values():
        return None
    base = _repeats(src, {})
    found: list[tuple[int, str, str]] = []
    for f in sorted(src.fields):
        n = src.values[f]
        if not any(length == n for length in base.values()) or n < 1:
            continue
        alone = _fake_build(src, {f: n + 1})  # the field grown alone: a width equal to a list's length stays put
        src.candidate["field"] = f
        try:
            grown = _repeats(src, {f: n + 1})
        finally:
            src.candidate.clear()
        if alone is not None:  # it builds without its per-layer lists following: it must grow a list itself
            alone_counts = repeated(name for name, _ in alone.named_modules())
            grown = {p: c for p, c in grown.items() if alone_counts.get(p) == c}
        paths = [p for p, length in base.items() if length == n and grown.get(p) == n + 1]
        if paths:
            path = min(paths, key=lambda p: (p.count(".") if p else -1, p))
            found.append((path.count(".") if path else -1, f, path))
    if not found:
        return None
    found.sort()
    if len(found) > 1 and found[0][0] == found[1][0]:  # stacks side by side (an encoder and a decoder)
        src.repeat_counts = [f for depth, f, _ in found if depth == found[0][0]]
        return None
    return found[0][1], found[0][2]


def _check_fixed(fixed: set[str], known: set[str], where: str) -> None:
    """A name in fixed= that is not an integer field would silently fix nothing."""
    unknown = sorted(fixed - known)
    if unknown:
        import difflib

        close = [m for u in unknown for m in difflib.get_close_matches(u, sorted(known), n=1)]
        raise SymacctError(
            f"fixed= names {', '.join(unknown)}, not an integer field of the {where}",
            hint=(f"did you mean {', '.join(close)}? " if close else "")
            + "integer fields: "
            + (", ".join(sorted(known)) or "none"),
        )


def _probe_for(
    src: _Source,
    primes: tuple[int, ...],
    layers: int,
    avoid: set[int],
    head_primes: tuple[int, ...],
    offsets: bool = False,
    tp_prime: int | None = None,
    tp_sequence: bool = True,
    cp: int | None = None,
    cuts: tuple[int, ...] = (),
    lengths: int = 1,
    even: bool = False,
) -> Probe:
    seq = {"S"} if src.seq is None else set()  # a decode step's one new token is no symbol
    degree = {TP} if tp_prime is not None else set()
    letters = sorted(
        {letter for letter in src.fields.values() if letter != "L"} | {"B", *seq, *src.input_dims, *degree}
    )
    layers_or_none = layers if "L" in src.fields.values() else None
    kept = [  # heads kept at their value, or one a tensor-parallel rank (they follow tp: its prime)
        tp_prime if src.follow.get(f) == (TP, None) and tp_prime is not None else v
        for f, v in src.values.items()
        if letter_for_field(f) == "H" and f not in src.fields
    ]
    scale = {"S": IMAGE_SCALE} if src.strided else {}
    if cp:  # the sequence in 2 * cp chunks (head-tail load balancing), each whole
        scale["S"] = scale.get("S", 1) * 2 * cp
    if "C" in letters and "S_max" in letters:  # C + S positions must fit the table: S_max a multiple of 4
        scale["S_max"] = 4
    # grouped matmuls want 16-byte strides: widths are probed as multiples of 16 (one expert too, E kept at 1)
    if "E" in letters or any(letter_for_field(f) == "E" for f in src.values):
        scale |= {n: EXPERT_WIDTH_SCALE for n in letters if n not in _COUNTS}
    groups = src.values.get("n_group")  # DeepSeek-V3's grouped routing: E / n_group experts a group, n_group kept
    if "E" in letters and isinstance(groups, int) and groups > 1 and "n_group" not in src.fields:
        scale["E"] = int(np.lcm(scale.get("E", 1), groups))  # at its value (no parameter's shape reads it)
    if src.even:  # derive's retry for a step that halves a width: every width probed even
        scale |= {n: 2 * scale.get(n, 1) for n in letters if n not in _NOT_HALVED}
    if "S" in scale and "S_max" in letters:  # the table still longer than S: S_max a multiple of S's factor too
        scale["S_max"] = int(np.lcm(scale.get("S_max", 1), scale["S"]))
    for n in ("S", "C", "S_max") if lengths > 1 else ():  # the second probe past a window, as the first is
        if n in letters:
            scale[n] = scale.get(n, 1) * lengths
    heads = kept[0] if len(kept) == 1 and isinstance(kept[0], int) and kept[0] > 0 else 1
    return make_probe(
        letters,
        primes,
        layers_or_none,
        strict=not src.configless,
        avoid=avoid,
        offsets=offsets,
        head_primes=head_primes,
        heads=heads,
        scale=scale or None,
        tp_prime=tp_prime,
        tp_sequence=tp_sequence,
        cuts=cuts,
        even=EVEN_LENGTHS if even else (),
    )


def _input_dims(src: _Source, probe: Probe) -> dict[str, int]:
    """The probe values of the input sizes besides B and S (S_dec), for the inputs' keywords."""
    return {d: probe.values[d] for d in src.input_dims}


def _field_values(src: _Source, probe: Probe) -> dict[str, int]:
    """The config fields' probe values (and the tensor-parallel degree, under ``TP``, for fields that follow
    it; build() does not pass it to the config)."""
    out = {}
    for f, letter in src.fields.items():
        out[f] = probe.layers if letter == "L" else probe.values[letter]
    if TP in probe.values:
        out[TP] = probe.values[TP]
    return out


def _record(
    src: _Source,
    probe: Probe,
    step: str,
    loss: Any,
    optimizer: Any,
    precision: dict[str, Any] | None = None,
    cycles: bool = False,
) -> StepTrace:
    vals = _field_values(src, probe)
    B, S = probe.values["B"], probe.values.get("S", src.seq)

    hooks: dict[str, tuple[str, ...]] = {}

    def build(fake: FakeTensorMode) -> nn.Module:
        if src.configless:
            with FakeCopyMode(fake):  # parameters copied as fake tensors, nothing real allocated
                model = src.build(vals)
        else:
            model = _build_fake(lambda: src.build(vals), fake, (precision or {}).get("device", "cpu"))
            if src.config_at is None:  # a factory's: refused before its step runs, as the model given is
                _refuse_compiled(model, "the model the factory builds")
        hooks.update(hooks_of(model))  # as built: before a tensor-parallel plan or an optimizer adds its own
        return model

    trace = _trace(src, probe, build, B, S, step, loss, optimizer, precision or {}, cycles=cycles)
    trace.hooks = hooks
    return trace


def _size_primes(probe: Probe) -> dict[int, str]:
    """The probe's own primes of its sizes and their symbols: a tensor-parallel degree's small prime, and a
    prime a constant may hold (2, 3, 5, 7), are none."""
    return {p: name for name, p in probe.own.items() if name != TP and p not in SMALL_PRIMES}


def _trace(
    src: _Source,
    probe: Probe,
    build: Callable[[FakeTensorMode], nn.Module],
    B: int,
    S: int,
    step: str,
    loss: Any,
    optimizer: Any,
    precision: dict[str, Any],
    only_ops: bool = False,
    dims: dict[str, int] | None = None,
    tp_world: int | None = None,
    cycles: bool = False,
) -> StepTrace:
    """One step of the model ``build`` makes, at (B, S) and the probe's other input sizes (or ``dims``), in
    the source's context (transformers' eager paths). With a tensor-parallel plan (``precision``'s
    ``tensor_parallel``) the model is sharded on a fake process group of ``tp_world`` ranks (default: the
    probe's tp) and the step is rank 0's (``symacct.trace.tensor_parallel``)."""
    precision = dict(precision)
    if "sdpa_target" in precision or torch.device(precision.get("device", "cpu")).type == "cuda":
        precision["sdpa_size"] = _own_size(src, probe)
    plan, degree = precision.pop("tensor_parallel", None), precision.pop(TP, None)
    cp = precision.pop(CP, None)
    tp = (tp_world or probe.values.get(TP) or degree) if plan is not None else None
    axes = tuple((name, k) for name, k in (("cp", cp), ("tp", tp)) if k)  # tp innermost, torchtitan's order
    group: Any = fake_group(tuple(k for _, k in axes), names=tuple(n for n, _ in axes)) if axes else None
    if cp is not None:
        precision["step_context"] = lambda model, args: sequence_sharded(model, args, mesh["cp"])
    if plan is not None:
        unsharded = build

        def build(fake: FakeTensorMode) -> nn.Module:  # called by record_step, inside the group below
            model = unsharded(fake)
            with fake:
                return apply_plan(model, plan, mesh["tp"], carried=hf_tp_plan)

    with src.context(), group or contextlib.nullcontext() as mesh:
        run = functools.partial(
            record_step,
            build,
            lambda m: src.inputs(m, B, S, **(dims if dims is not None else _input_dims(src, probe))),
            loss=loss,
            step="forward" if step in SERVING else step,
            optimizer=optimizer,
            only_ops=only_ops,
            size_primes=None if only_ops else _size_primes(probe),
            cycles=cycles,
            **precision,
        )
        trace = run()
        if trace.changed:  # work done once (a module replaced): the step traced as a second call runs it
            trace = run(warm=trace.changed)
        if step in SERVING and trace.cache_untouched:
            raise SymacctError(
                f"step {step!r}: the model neither filled nor extended the KV cache it was given: it keeps no "
                "cache (it takes the keyword and ignores it), so generating a token runs the whole sequence again",
                module="",
                hint="derive step='forward' with S the sequence's length for one token's cost, or pass "
                "inputs=lambda m, B, S[, C]: {...} with the cache the model keeps",
            )
        trace.groups = mesh_groups(mesh) if axes else {}
        return trace


def _own_size(src: _Source, probe: Probe) -> Callable[[int], int]:
    """A traced dimension as the user's model has it, for the kernel choices that read sizes: its reading in
    symbols at the model's own values (a head D/H, 232 wide at the probe, is 128 in a model with D = 4096 and
    H = 32); a dimension with no reading, or in symbols the model leaves free (B, S), as traced."""
    read = _at_own_sizes(src, probe)

    def size(n: int) -> int:
        own = read(n)
        return n if own is None else own

    return size


def _at_own_sizes(src: _Source, probe: Probe, free: Mapping[str, int] | None = None) -> Callable[[int], int | None]:
    """A probe size as the user's model has it: its reading in symbols at the model's own values (and the
    sizes in ``free`` for the symbols the model leaves free: B, S); None where it has no reading or the reading
    names a symbol without a value."""
    own = {sym(letter): src.values[f] for f, letter in src.fields.items() if f in src.values}
    own.update({sym(letter): v for letter, v in (free or {}).items()})

    @functools.cache
    def read(n: int) -> int | None:
        expr = probe.to_expr(n)
        if expr is None:
            return None
        value = sympy.sympify(expr).subs(own)
        return int(value) if value.is_Integer else None

    return read


@dataclasses.dataclass(frozen=True)
class UserRun:
    """The user's own model traced in pass 4 (ops and the shapes they return), the sizes of the symbols it
    leaves free that it ran at (B, S, other input sizes, the tensor-parallel degree), and the ops left out of
    the comparison."""

    trace: StepTrace
    sizes: dict[str, int]
    ignore: frozenset[str]
    # the user's trace at the probe's own lengths, where it ran longer (``_longest``): what a difference
    # found at the longer lengths is checked against before it is put down to a length
    at_probe_lengths: Callable[[], UserRun] | None = None
    # where it ran at other lengths than the probe's: a probe's count of an op as it scales to them (``_count_at``)
    scale: Callable[[int], int | None] | None = None
    # the user's model traced again at other lengths (S, the other input sizes) and batch sizes (``batch=``),
    # and compared op by op
    rerun: Callable[..., UserRun] | None = None
    # for ``shortest_path``: the length it moves ("S", or "C" in a decode step) and the shortest it takes, on the
    # probe's side of every window (None, None where the lengths keep their structure), and the probe's own
    # lengths it moves from
    span: tuple[str | None, int | None, tuple[int, dict[str, int]]] | None = None
    # a factory's model at the given sizes (``_factory_model``), where the user gave a factory
    model: nn.Module | None = None
    # where it ran at a larger batch than the probe's (``LARGEST_BATCH``): its trace at the probe's B and the
    # same lengths, what a difference found there is checked against before it is put down to B
    at_probe_batch: Callable[[], UserRun] | None = None
    # the batch size at which it took another path than the probe's (a threshold above the probes' B) and the
    # difference, where the run at the probe's B then ran the probe's ops: ``shortest_path`` bounds B below it
    over: tuple[int, SymacctError] | None = None


def _same_model(
    model: nn.Module,
    src: _Source,
    probe: Probe,
    trace: StepTrace,
    stacks: list[str],
    step: str,
    loss: Any,
    precision: dict[str, Any],
    optimizer: Any = None,
    counted: frozenset[str] = frozenset(),
) -> UserRun:
    """Trace the user's own model (a fake copy) at the longest lengths it runs and the largest batch
    (``LARGEST_BATCH``; else at the probe's B and S) and compare its ops with the probe's; the trace that
    passed and the sizes it ran at (for ``compare_shapes``, once the readings are checked). Where it differs
    there and not at the probe's B, the trace at the probe's B, with the difference (``UserRun.over``).

    The optimizer is built on it too (hooks it registers, such as the mixed recipe's fp32 gradient casts, run
    in the backward); its step is not run, as its phase is not compared.

    S is kept below the user's position table (S_max) when the model has one, as the probe's S is below its
    S_max (``x[:, :S]`` of a whole table runs no slice op).
    """
    blocks = probe.layers or 1
    depth = [(f, src.values[f]) for f, letter in src.fields.items() if letter == "L" and f in src.values]
    compare_settings(
        model,
        trace,
        stacks,
        blocks,
        dtypes=precision.get("params_dtype") is None,
        grads=step == "train",
        depth=depth[0] if len(depth) == 1 and probe.layers is not None else None,
    )
    B, S0 = probe.values["B"], probe.values.get("S", src.seq)
    dims0 = _input_dims(src, probe)
    device = precision.get("device", "cpu")
    ignore = TENSOR_PARALLEL_IGNORED if TP in precision else frozenset()

    def lengths(long: bool) -> tuple[int, dict[str, int]]:
        if long and CP not in precision:
            S, dims = _longest(src, probe, S0, dims0, per_position=_per_position(probe, trace, stacks, ignore))
        else:
            S, dims = _below(src, S0, dims0)
        if TP in precision and _splits_sequence(precision):  # sequence parallelism: whole shards of S
            S = max(precision[TP], S - S % precision[TP])
        if CP in precision:  # the user's tables' rows (S_max is S), else whole chunks of S: 2 * cp of them
            tied = [src.values[f] for f, letter in src.fields.items() if letter == "S" and f in src.values]
            S = tied[0] if tied else max(2 * precision[CP], S - S % (2 * precision[CP]))
        return S, dims

    short = lengths(False)

    def run(S: int, dims: dict[str, int], keep: int = KEEP, batch: int = B) -> UserRun:
        def user_trace(cut: bool) -> StepTrace:
            def build(fake: FakeTensorMode) -> nn.Module:
                if not cut:
                    return fake_copy(model, fake, device)
                with shortened(model, stacks, keep):  # copied with its stacks shortened, then restored
                    return fake_copy(model, fake, device)

            tp = precision.get(TP)
            return _trace(
                src, probe, build, batch, S, step, loss, optimizer, precision, only_ops=True, dims=dims, tp_world=tp
            )

        sizes = {"B": batch, "S": S, **dims}
        if TP in precision:
            sizes[TP] = precision[TP]
        scale = _count_at(probe, sizes) if (batch, S, dims) != (B, *short) else None

        one = batch == 1 or dims.get("C", S) == 1  # B or the length that moves at 1: views and copies aside

        def compared(user: StepTrace) -> frozenset[str]:  # the ops left out, once the rest are alike
            left = ignore | _aside_at_one(user, trace, counted) if one else ignore
            compare_ops(user, trace, stacks, blocks, left, scale)
            if one:  # the matmuls left out there: alike in the FLOPs PyTorch counts, whatever ops carry them
                compare_flops(user, trace, stacks, blocks, _at_own_sizes(src, probe, sizes))
            return left

        try:  # the first three blocks and the last, when the middle ones are built alike (symacct.sameness)
            user = user_trace(True)
            left = compared(user)
        except SymacctError:  # a difference (or a model that needs all its blocks): the whole model decides
            user = user_trace(False)
            try:
                left = compared(user)
            except SymacctError as differ:
                raise _window_between(src, probe, dims.get("C", 0) + S) or differ from differ
        return UserRun(user, sizes, left, scale=scale)

    whole = CP in precision or (TP in precision and _splits_sequence(precision))  # S in whole shards or chunks
    low = None if whole else _shortest(src, probe, *short)
    # at the shortest lengths, a stack's first block and its last (the middle ones are built alike): the check
    # then costs the same at any depth, as a model of two blocks is traced whole
    more: dict[str, Any] = {
        "rerun": functools.partial(run, keep=SHORTEST_KEEP),
        "span": (*(low or (None, None)), short),
    }
    long = lengths(True)
    # as large a batch as it runs too, in the same trace (a threshold on B above the probes'), unless the step
    # runs an op once a sequence of the batch (its trace would grow with B)
    big = B if B >= LARGEST_BATCH or _per_sample(probe, trace, stacks, ignore) else LARGEST_BATCH
    if long == short and big == B:
        return dataclasses.replace(run(*short), **more)
    if long != short:
        more["at_probe_lengths"] = lambda: run(*short)
    try:
        user = run(*long, batch=big)
    except SymacctError as differ:
        at_probe = run(*short)  # a difference at the probe's sizes too is no size's doing: it is refused as such
        if big == B:
            raise _length_branch(src, long, short, differ) from differ
        try:  # at the probe's B: alike there, the larger batch took another path (a bound, ``shortest_path``)
            at_b = at_probe if long == short else run(*long)
        except SymacctError as again:
            raise _length_branch(src, long, short, again) from again
        return dataclasses.replace(at_b, over=(big, differ), **more)
    if big != B:  # its trace at the probe's B, with the same reruns
        reruns = dict(more)
        more["at_probe_batch"] = lambda: dataclasses.replace(run(*long), **reruns)
    return dataclasses.replace(user, **more)


def _aside_at_one(user: StepTrace, probe: StepTrace, counted: frozenset[str]) -> frozenset[str]:
    """The ops left out of the comparison where the user's model runs at B = 1 or at a length of 1, where
    PyTorch may view what it otherwise copies and skips a reduction over the size of 1 (a gradient summed over a
    broadcast batch), which change bytes and the other FLOPs (``symacct.accounting``'s note at a size of 1): the
    probe's ops that its FLOPs do not count (``counted``: the matmuls'), and of the user's own, those that view,
    copy or allocate (``memory_ops.MOVES``). The ops PyTorch counts the FLOPs of are compared by those FLOPs
    instead (``sameness.compare_flops``): at a size of 1 a Linear may run ``addmm`` where it otherwise runs
    ``mm`` and ``add``, for the same FLOPs."""
    probe_ops = {str(rec.op) for rec in probe.ops} - counted
    ops = {rec.op for rec in (*user.ops, *probe.ops)}
    moves = {op for op in ops if isinstance(op, torch._ops.OpOverload) and rule_registry.lookup(op) in MOVES}
    pooled = {op for op in ops if counts_flops(op)}
    return frozenset(probe_ops | {str(op) for op in moves | pooled})


SHORTEST_KEEP = 2  # blocks of a stack the user's trace at the shortest lengths keeps (``shortened``)
# the user's trace of a model without a position table runs this many positions (a prime); one that runs ops
# once a position, at most as many as the second (its trace grows with the length)
LONGEST = 8191
PER_POSITION_LONGEST = 2053


def _per_position(probe: Probe, trace: StepTrace, stacks: list[str], ignore: frozenset[str]) -> bool:
    """Whether the probe's step runs an op once a position (a count read in S or C: the S pieces ``stack``'s
    backward selects), so that a trace grows with the length it runs at: a count ``_count_at`` reads."""
    scale = _count_at(probe, probe.values)
    return any(scale(n) is not None for n in set(op_counts(trace, stacks, ignore)))


def _longest(
    src: _Source, probe: Probe, S: int, dims: dict[str, int], per_position: bool = False
) -> tuple[int, dict[str, int]]:
    """The lengths the user's trace runs at: as long as the model runs (below its position table, else
    ``LONGEST``) and on the probe's side of every window the config keeps. A step whose path turns on a
    length's value (``if S > 1024``) then takes the other path there than in the probe traces wherever the
    threshold lies between the second probe's lengths and the longest the model runs, and its ops or shapes
    differ; the probes' lengths alone see only the thresholds between them. S keeps its probe value where
    the probe gives it structure (a multiple of the pooled sides) or no symbol; with cached positions C
    (a decode step), C takes the length and S keeps its value. A step that runs ops once a position
    (``per_position``) runs at most ``PER_POSITION_LONGEST`` positions: its trace grows with the length
    (131,071 positions of a long context would take minutes)."""
    structured = "S" in probe.values and probe.values["S"] != probe.own.get("S")  # 64 * prime, tp * prime
    if structured or ("S" not in probe.values and "C" not in dims):
        return _below(src, S, dims)
    tables = [src.values[f] for f, letter in src.fields.items() if letter == "S_max" and f in src.values]
    if tables:
        top = min(tables) - 1  # a whole table runs no slice op
    elif "C" not in dims:
        top = LONGEST
    else:
        return _below(src, S, dims)
    if per_position:
        top = min(top, PER_POSITION_LONGEST)
    for f in WINDOWS:  # on the probe's side of every window: within it where the probe is within it
        w = src.values.get(f)
        if f in src.constants and isinstance(w, int) and _length(probe) <= last_within(f, w):
            top = min(top, last_within(f, w))
    dims = dict(dims)
    if "C" in dims:
        dims["C"] = max(1, top - S)
        return S, dims
    return max(1, top), dims


def _shortest(src: _Source, probe: Probe, S: int, dims: dict[str, int]) -> tuple[str, int] | None:
    """The length ``shortest_path`` moves (C in a decode step, else S) and the shortest value it takes: 2 (a size
    of 1 is another convention, ``Accounting.at``'s note, traced apart), on the probe's side of every window the
    config keeps (past it where the probe is past it); None where S keeps its structure (64 * prime, tp * prime),
    where the step has no length, or where that value is not below the probe's."""
    structured = "S" in probe.values and probe.values["S"] != probe.own.get("S")
    if structured:
        return None
    if "C" in dims:  # C + S positions: past a window from C = last + 1 - S on
        name, value, other = "C", dims["C"], S
    elif "S" in probe.values:
        name, value, other = "S", S, 0
    else:
        return None
    low = 2
    for f in WINDOWS:
        w = src.values.get(f)
        if f in src.constants and isinstance(w, int) and _length(probe) > last_within(f, w):
            low = max(low, last_within(f, w) + 1 - other)
    return (name, low) if low < value else None


def _below(src: _Source, S: int, dims: dict[str, int]) -> tuple[int, dict[str, int]]:
    """The probe's lengths, below the model's position tables: S below each, and C + S below each where the
    step has cached positions C (the user's trace at the probe's own lengths)."""
    S = _below_tables(src, S)
    dims = dict(dims)
    for f, letter in src.fields.items():
        if letter == "S_max" and "C" in dims:  # cached positions and new ones share the table: C + S < S_max
            dims["C"] = max(1, min(dims["C"], src.values[f] - S - 1))  # (a whole table runs no slice)
    return S, dims


def _count_at(probe: Probe, sizes: Mapping[str, int]) -> Callable[[int], int | None]:
    """A probe's count of an op read as a product of the lengths (and B), at ``sizes``: what the user's trace at
    other lengths runs of an op the probe runs once a position (the S pieces ``stack``'s backward selects); None
    for a count that is no such product. Only lengths may scale a count: a count read in a width (a loop over
    the heads) must be equal, as the user's trace runs the model's own widths."""
    lengths = {sym(n) for n in ("S", "C")}
    at = {sym(n): v for n, v in sizes.items() if n in ("B", "S", "C")}

    @functools.cache
    def scale(n: int) -> int | None:
        expr = probe.to_expr(n)
        if expr is None or not (expr.free_symbols & lengths) or not expr.free_symbols <= set(at):
            return None
        value = sympy.sympify(expr).subs(at)
        return int(value) if value.is_Integer else None

    return scale


def _lengths_of(user: UserRun) -> tuple[int, dict[str, int]]:
    """S and the other input sizes a user's trace ran at."""
    return user.sizes["S"], {k: v for k, v in user.sizes.items() if k not in ("B", "S", TP)}


def _length_branch(
    src: _Source, long: tuple[int, dict[str, int]], short: tuple[int, dict[str, int]], differ: SymacctError
) -> SymacctError:
    """The refusal of a step whose ops or shapes at the longest lengths the model runs differ from those at the
    probe's, where at the probe's lengths they are alike: the step's path turns on a length's value."""

    def name(S: int, dims: dict[str, int]) -> str:
        return f"S = {S}" + (f", C = {dims['C']}" if "C" in dims else "")

    tables = [f for f, letter in src.fields.items() if letter == "S_max" and f in src.values]
    longest = f"below its {tables[0]} = {src.values[tables[0]]}" if tables else "having no position table"
    if src.configless:
        table = (
            "give the model a config (a dataclass, as model.config) with a position-table field (n_positions) "
            "that ends where the lengths you run end, below the threshold"
        )
    elif src.config_at is None:  # a factory
        table = "give the factory a position-table size (n_positions) in dims= that ends below the threshold"
    else:
        table = "derive a config whose position table ends where the lengths you run end, below the threshold"
    return differ.restated(
        f"the model given takes another path at {name(*long)} (the longest it runs, {longest}) than at the "
        f"probe's {name(*short)}, where it runs the probe model's ops: the step branches on a length's value "
        f"between the two (an ``if`` on S, a ``min(S, n)``), and formulas read on one side would be wrong on the "
        f"other ({differ.what})",
        hint=f"{table}: the figures then hold up to that table (formulas for lengths past the threshold cannot be "
        "read from these probes)",
        sizes=("S", "C") if "C" in long[1] else ("S",),
    )


def _window_between(src: _Source, probe: Probe, own: int) -> SymacctError | None:
    """Where the user's model, run at ``own`` positions (below its position table), and the probe model fall on
    two sides of a window the config keeps: the two take two paths, and their ops differ for that reason."""
    tables = [src.values[f] for f, letter in src.fields.items() if letter == "S_max"]
    for f in WINDOWS:
        w = src.values.get(f)
        if (
            f in src.constants
            and isinstance(w, int)
            and (_length(probe) > last_within(f, w)) != (own > last_within(f, w))
        ):
            table = f" (its position table: {tables[0]} positions)" if tables else ""
            return SymacctError(
                f"the model given runs {own} positions{table}, within its {f} = {w}, and the probe's sizes pass "
                "it: the two take two paths (another mask beyond the window), so their ops differ",
                hint=f"a window no shorter than the position table never binds: set config.{f} = None where the "
                "config accepts it (the same model), or derive a config whose position table is longer than the "
                "window (its formulas then hold past the window)",
            )
    return None


def _terms(costed: list[CostedOp], counts: list[Any]) -> dict[tuple[str, str], list[Any]]:
    """Per (phase, metric): the terms cost * count, one per op."""
    out: dict[tuple[str, str], list[Any]] = defaultdict(list)
    for c, n in zip(costed, counts):
        for m in METRICS:
            out[(c.rec.phase, m)].append(getattr(c.cost, m) * n)
    return out


def _check(costed1: list[CostedOp], counts1: list[Any], costed2: list[CostedOp], probe2: Probe, L2: int | None) -> None:
    values = dict(probe2.values)
    if L2 is not None:
        values["L"] = L2
    subs = {sym(k): v for k, v in values.items()}
    predicted = _terms(costed1, counts1)
    measured = _terms(costed2, [1] * len(costed2))
    for key in sorted(set(predicted) | set(measured)):
        p, m = (sum(exact_form(sympy.sympify(t))(values) for t in got.get(key, ())) for got in (predicted, measured))
        if p != m:
            _locate(costed1, costed2, subs)
            phase, metric = key
            at = ", ".join(f"{n} = {values[n]}" for n in ("B", *EVEN_LENGTHS) if n in values)
            raise SymacctError(
                f"the derived {metric} of the {phase} phase does not predict a second trace at other sizes "
                f"({at}; {p} predicted, {m} counted)",
                hint="a size or the op sequence depends on the dimensions in a way that is not a product of "
                "symbols (a branch on a size's value, or on a length's parity: the second trace's lengths are "
                "even, the first's odd, so that the even sizes users run are checked); a field that counts "
                "layers must be called L or an alias (n_layer, n_layers, "
                "num_hidden_layers); keep other fields involved at their values with derive(..., fixed=[...])",
            )


def _locate(costed1: list[CostedOp], costed2: list[CostedOp], subs: dict[sympy.Symbol, int]) -> None:
    """Raise naming the first node whose symbolic shapes miss the second trace."""
    by_key1: dict[tuple[str, str], list[CostedOp]] = defaultdict(list)
    by_key2: dict[tuple[str, str], list[CostedOp]] = defaultdict(list)
    for c in costed1:
        by_key1[(c.rec.module, c.rec.phase)].append(c)
    for c in costed2:
        by_key2[(c.rec.module, c.rec.phase)].append(c)
    for key, ops1 in by_key1.items():
        ops2 = by_key2.get(key)
        if ops2 is None:
            continue
        for a, b in zip(ops1, ops2):
            if a.rec.op != b.rec.op:
                raise SymacctError(
                    "the op sequence changes with the sizes (size-dependent control flow)",
                    node=f"#{a.rec.index}",
                    module=a.rec.module,
                    op=f"{a.rec.op} vs {b.rec.op}",
                    hint="symacct needs the same ops at every size; remove the size-dependent branch",
                )
            for ta, tb, traw in zip(a.call.outputs, b.call.outputs, a.rec.outputs):
                pred = tuple(sympy.sympify(s).subs(subs) for s in ta.shape)
                if pred != tuple(tb.shape):
                    raise SymacctError(
                        f"a tensor size is not the product of symbols it looked like: read as "
                        f"({', '.join(str(s) for s in ta.shape)}) from {traw.shape}, which predicts "
                        f"{pred} at other sizes, but the trace has {tuple(tb.shape)}",
                        node=f"#{a.rec.index}",
                        module=a.rec.module,
                        op=str(a.rec.op),
                        hint="make that size a config field of its own (it then gets a symbol), or keep "
                        "the fields it depends on at their values with derive(..., fixed=[...])",
                    )


class _Identity:
    """A probe that leaves integers as they are (for the verification trace)."""

    @staticmethod
    def to_expr(v: int) -> int:
        return v


_LOCK = threading.RLock()


@contextlib.contextmanager
def hermetic() -> Iterator[None]:
    """The state a derivation must not take from its caller's thread. Inside ``torch.inference_mode()`` it
    traces the step it traces outside. Anomaly detection (``torch.autograd.detect_anomaly``), a debugging
    mode that reads every gradient's values for NaN, is switched off: the step it checks is the same step.
    An autocast the caller entered is refused: it would cast the backward and the optimizer's step too,
    where derive's ``autocast`` option casts the forward and the loss (PyTorch's AMP recipe), and the
    figures would not be those of the options the result reports. Saved-tensor hooks disabled by the caller
    are refused: symacct counts with them. So are saved-tensor hooks the caller set (``save_on_cpu``, a
    compressing pair): symacct's own hooks, set inside them, would take their place, and the figures would be
    those of a step without them; a model that sets them in its forward is counted with them."""
    for kind in ("cpu", "cuda"):
        if torch.is_autocast_enabled(kind):
            dtype = torch.get_autocast_dtype(kind)
            name = dtype_key(dtype)
            raise SymacctError(
                f"derive was called inside torch.autocast('{kind}', dtype={dtype}); "
                "symacct traces the step its options describe and does not take an autocast from the caller",
                hint=f"call derive outside the autocast context, with autocast='{name}' (--autocast {name}) for "
                "the forward and the loss under autocast and the backward outside, as PyTorch's AMP recipe has it",
            )
    if not torch._C._autograd._saved_tensors_hooks_is_enabled():
        raise SymacctError(
            "derive was called where saved-tensor hooks are disabled (torch.autograd.graph."
            "disable_saved_tensors_hooks); symacct counts the tensors autograd saves with such hooks",
            hint="call derive outside that context",
        )
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        raise SymacctError(
            "derive was called inside saved-tensor hooks the caller set (torch.autograd.graph.saved_tensors_hooks, "
            "save_on_cpu); symacct traces with hooks of its own, which would take their place: the figures would "
            "be those of a step without the caller's",
            hint="call derive outside that context; to count what such hooks keep, set them in the model's "
            "forward (derive counts a model's own saved-tensor hooks)",
        )
    with torch.inference_mode(False), torch.autograd.set_detect_anomaly(False):
        yield


def _locked(fn: Callable[..., Accounting]) -> Callable[..., Accounting]:
    @functools.wraps(fn)
    def derive(model: Any, **options: Any) -> Accounting:
        with _LOCK, no_cycle_collection(), hermetic():
            try:
                return fn(model, **options)
            except SymacctError:
                raise
            except TypeError as e:
                if "unexpected keyword argument" in str(e) and "_derive()" in str(e):
                    raise SymacctError(
                        str(e).replace("_derive()", "derive()"), hint="see help(symacct.derive) for the options"
                    ) from e
                raise _internal(e) from e
            except Exception as e:  # an exception symacct did not expect: its own defect, with the full cause
                raise _internal(e) from e

    return derive


def _derive(
    model: Any,
    *,
    inputs: Callable[..., Any] | None = None,
    loss: Callable[[Any], torch.Tensor] | None = None,
    step: str = "train",
    optimizer: str | type | None = None,
    optimizer_options: Mapping[str, Any] | None = None,
    dims: Mapping[str, int] | None = None,
    fixed: Iterable[str] = (),
    strict: bool = True,
    causal_discount: bool = False,
    embedding_flops: str = "lookup",
    autocast: torch.dtype | str | None = None,
    params_dtype: torch.dtype | str | None = None,
    fsdp_policy: bool = False,
    device: str = "cpu",
    sdpa_backend: str | None = None,
    hardware: Any = None,
    without_gpu: bool = False,
    routing: Sequence[Any] | None = None,
    cache_dtype: torch.dtype | str | None = None,
    tensor_parallel: Any = None,
    tp: int = 2,
    context_parallel: int | None = None,
    _degenerate: bool = False,
    _own_fields: str | None = None,
    _strided: bool = False,
    _even: bool = False,
    _layers_fixed: bool = False,
) -> Accounting:
    """Derive the FLOP, byte and memory formulas of one step of ``model`` (``symacct.derive``).

    The model rebuilt at probe sizes is compared op by op with a trace of
    ``model`` itself (``symacct.sameness``); a difference is refused.

    Args:
        model: an ``nn.Module`` whose ``config`` (a dataclass) rebuilds it as
            ``type(model)(config)``; or, with ``dims``, a factory called as
            ``model(**dims)``; or a module without config (only B and S are
            symbols then).
        inputs: ``(B, S) -> args`` or ``(model, B, S) -> args``: a tuple of
            positional inputs or a dict of keyword inputs; default
            ``model.example_inputs``, or for a transformers model its task's
            step (``symacct.models.hf.task``).
        loss: turns the model's output into the scalar loss (default: the
            output must be the loss; a transformers model: ``output.loss``).
        step: ``"train"`` (forward + backward [+ optimizer]), ``"forward"``
            (inference under ``torch.no_grad()``), ``"prefill"`` (a prompt of S
            tokens filling an empty KV cache) or ``"decode"`` (one new token
            after a cache of C positions; S = 1, C a symbol): docs/serving.md.
        optimizer: a name (``"adamw"``, ``"sgd"``, ...) or a
            ``torch.optim.Optimizer`` subclass; its real ``step()`` runs on
            fake tensors inside the traced step (phase ``optimizer``), then
            ``zero_grad(set_to_none=True)``.
        optimizer_options: keyword arguments of the optimizer (``lr`` defaults
            to 1e-3), e.g. ``{"momentum": 0.9, "foreach": True}``.
        dims: config-free sizes for a factory, e.g. ``{"D": 512, "L": 4}``.
        fixed: config fields kept at their values (constants, not symbols).
        strict: raise on an op without a rule (default); False lists it in
            ``acct.unaccounted`` and counts it as 0.
        causal_discount: halve attention-score matmul FLOPs (Megatron's
            convention); default False (flop_counter's, PaLM's).
        embedding_flops: ``"lookup"`` (0 FLOPs, flop_counter's; default) or
            ``"matmul"`` (2*tokens*V*D forward, twice that backward).
        autocast: ``torch.bfloat16`` or ``torch.float16`` (or ``"bf16"``,
            ``"fp16"``): the forward runs under ``torch.autocast`` (backward
            outside it, as usual).
        params_dtype: build the parameters in this dtype (pure low-precision
            training or inference); float inputs follow.
        fsdp_policy: with ``params_dtype``, run the parameters as FSDP2's
            ``MixedPrecisionPolicy(param_dtype=...)`` does, not as
            ``model.to(dtype)``: floating buffers keep their dtype and each
            block of an ``nn.ModuleList`` (what ``fully_shard`` wraps) has its
            floating inputs cast to ``params_dtype`` (``cast_forward_inputs``);
            the compute trace of ``symacct.parallel.rank.derive_compute``.
        device: the device the fake tensors claim to be on (``"cpu"``
            default; ``"cuda"`` traces the CUDA kernels, e.g. flash attention,
            and needs a CUDA build of torch, not a GPU: without one the
            backward runs node by node from Python, ``symacct.trace.engine``).
        sdpa_backend: the kernel ``scaled_dot_product_attention`` runs on CUDA:
            ``"flash"``, ``"cudnn"``, ``"efficient"`` or ``"math"``; needed on
            CUDA without a GPU when the model calls SDPA (there is no device to
            choose it), a restriction of PyTorch's choice with one
            (symacct.trace.sdpa). On the CPU, ``"flash"`` (its CPU kernel) or
            ``"math"``, a restriction of the CPU's choice.
        hardware: with ``device="cuda"``, the GPU (a catalog name or entry)
            whose kernel choices the step follows: SDPA runs the kernel
            PyTorch 2.14 picks on it (by compute capability, dtype, head dim,
            mask, the cuDNN this torch loads; symacct.trace.sdpa_choice),
            with or without a GPU here, and a note names it; a named
            ``sdpa_backend`` overrides the choice.
        without_gpu: with ``device="cuda"`` and ``hardware``, derive as on a
            machine without a GPU even when this one has one: the backward by
            symacct.trace.engine, SDPA by symacct's reading of PyTorch's
            rules. On a GPU this is the no-GPU prediction that ``symacct
            verify`` compares with the device (``--predict no-gpu``); without
            a GPU it is the only route, and the flag changes nothing.
        routing: a mixture of experts' split of the routed (token, expert)
            pairs over the E experts, as E non-negative shares (normalised),
            for ``acct.experts``; default balanced. Totals do not depend on
            it (symacct.cost.experts).
        tensor_parallel: derive one tensor-parallel rank: the model sharded by
            this plan with PyTorch's ``parallelize_module`` on its fake process
            group (``"megatron"``, ``"megatron-sp"``: the model's own
            ``tp_plan``; a plan dict; or ``plan(model, mesh)``); every figure is
            rank 0's, in the symbol ``tp`` (symacct.trace.tensor_parallel).
        tp: the degree ``at()`` takes for ``tp`` unless told (default 2).
        context_parallel: derive one context-parallel rank of this many: the
            inputs and the model's sequence tables sharded and SDPA run as a
            ring by PyTorch's ``context_parallel`` on its fake process group;
            every figure is rank 0's, the degree a number in them, S a
            multiple of 2 * cp (symacct.trace.context_parallel). With
            ``tensor_parallel`` too: rank 0 of a (cp, tp) mesh, tp innermost,
            the model sharded over its tp ranks and the ring over its cp ranks.

    Memo: a derivation of a model family already derived in this process (the same class, config settings
    and options, at other sizes or the same) reuses its probe traces and formulas (``symacct.memo``); the
    given model is still traced and compared with the probe model, and derived afresh where it differs.
    ``symacct.memo.clear()`` forgets them; ``SYMACCT_MEMO=0`` in the environment switches the memo off.

    Thread safety: one derivation runs at a time (a process-wide lock):
    PyTorch's module tracking and fake-tensor state are global, so two traces
    at once would corrupt each other; a second thread waits for the first.

    Conventions: docs/conventions.md.
    """
    kwargs = dict(
        inputs=inputs,
        loss=loss,
        step=step,
        optimizer=optimizer,
        optimizer_options=optimizer_options,
        dims=dims,
        fixed=fixed,
        strict=strict,
        causal_discount=causal_discount,
        embedding_flops=embedding_flops,
        autocast=autocast,
        params_dtype=params_dtype,
        fsdp_policy=fsdp_policy,
        device=device,
        sdpa_backend=sdpa_backend,
        hardware=hardware,
        without_gpu=without_gpu,
        routing=routing,
        cache_dtype=cache_dtype,
        tensor_parallel=tensor_parallel,
        tp=tp,
        context_parallel=context_parallel,
        _degenerate=_degenerate,
        _own_fields=_own_fields,
        _strided=_strided,
        _even=_even,
        _layers_fixed=_layers_fixed,
    )
    req = _request(**kwargs)
    src: _Source | None = None
    try:
        src = read_source(model, req)
        probes = choose_probes(model, src, req)
        key = family_key(model, src, probes, kwargs)
        known = from_memo(model, src, key, req)
        if known is None:
            first = trace_first(src, probes, req)
            user = check_same_model(model, src, probes, first, req)
            second = trace_check(src, probes, first, req)
            user = check_parameters(model, src, probes, first, req, user)  # the probe's readings checked by now
            bounds = shortest_path(src, probes, first, user)
            memory, live = memory_pass(src, probes, first, second, req)
            known = Known(probes, first, memory, live, bounds=bounds)
            if key is not None:
                graph = build_graph(first.trace, first.costed, first.counts, probes.first.to_expr, first.stacks)
                constraints = learn_constraints(first.trace, probes.first.to_expr)
                memo.FAMILIES.put(key, dataclasses.replace(known, graph=graph, constraints=constraints))
                known = dataclasses.replace(known, memory=memory.copy(), graph=graph.copy(), constraints=constraints)
    except _FixLayers as why:  # exact for this L, not factored by it
        lfields = [f for f, letter in why.src.fields.items() if letter == "L"]
        acct = _derive(model, **{**kwargs, "fixed": [*req.fixed, *lfields], "_layers_fixed": True})
        acct.notes.insert(0, f"{why.reason}: the layer stack is left unfactored, L fixed at its value")
        return acct
    except _Degenerate as first_difference:  # sizes such as H == H_kv or 1 run other ops: tied or fixed
        try:
            return _derive(model, **{**kwargs, "_degenerate": True})
        except SymacctError as again:
            if again.what.startswith(NOT_THE_SAME) and AT_OWN_SIZES not in again.what:
                raise first_difference.error from None  # still another model: the first difference is the one
            raise
    except SymacctError as failed:
        if src is None or req.own_fields or failed.internal:
            raise
        if failed.sizes and not set(failed.sizes) & set(src.fields.values()):
            raise  # about sizes no field carries (the inputs' S): a retry on the fields cannot change them
        acct, note = None, ""
        later: list[tuple[str, SymacctError]] = []  # a retry that got past the first failure and stopped elsewhere
        name = (failed.op or "").split(".")  # 'aten.max_pool2d_with_indices.default'
        if not src.strided and len(name) == 3 and name[0] == "aten" and name[1] in _HALVING:  # F.max_pool2d, ...
            try:
                acct = _derive(model, **{**kwargs, "_strided": True})
                note = (
                    f"the step halves a size with {failed.op} outside any pooling or strided convolution module, so "
                    f"the probe's odd sizes did not divide ({failed.what}): derived again with S probed as "
                    f"{IMAGE_SCALE} * prime, as for such modules"
                )
            except SymacctError as again:
                later.append((f"with S probed as {IMAGE_SCALE} * prime", again))
        if acct is None and not src.even and _odd_halves(failed):  # a width halved (chunk(2)): odd at primes
            try:
                acct = _derive(model, **{**kwargs, "_even": True})
                note = (
                    f"the step could not run with its widths probed as primes ({failed.what}): derived again with "
                    "them probed as 2 * prime, as a step that halves a width (x.chunk(2, -1)) needs"
                )
            except SymacctError as again:
                later.append(("with the widths probed as 2 * prime", again))
        own = _own_size_fields(src)  # sizes of the model's own (rotary_dim, word_embed_proj_dim): tied or kept
        for how in ("tie", "keep") if own and acct is None else ():  # "keep": a field equal to a width by chance
            try:
                acct = _derive(model, **{**kwargs, "_own_fields": how})
                note = (
                    f"with symbols of their own, {', '.join(own)} did not let the step run at probe sizes "
                    f"({failed.what}): derived again with them following an equal size or kept at their values"
                )
                break
            except SymacctError as again:
                what = "tied to an equal size" if how == "tie" else "kept at their values"
                later.append((f"with {', '.join(own)} {what}", again))
                continue
        heads = [f for f, letter in src.fields.items() if letter in ("H", "H_kv")]
        if acct is None and heads:  # a step that splits its heads at a power of two (ALiBi's slopes)
            try:
                acct = _derive(model, **{**kwargs, "fixed": [*req.fixed, *heads]})
                values = ", ".join(f"{f} = {src.values[f]}" for f in heads)
                note = (
                    f"with the head counts as symbols the step could not be derived ({failed.what}): derived again "
                    f"with {values} kept at the model's values (fixed=); the formulas hold at those head counts"
                )
            except SymacctError as again:
                later.append((f"with {', '.join(heads)} kept at their values", again))
                acct = None
        if acct is None:
            broken = _fails_at_own_sizes(model, src, req, failed)
            if broken is not None:
                raise broken from failed
            elsewhere = [(how, e) for how, e in later if e.what != failed.what and not e.internal]
            if not elsewhere:
                raise  # the first failure, with its cause: neither retry was what the step needed
            how, again = elsewhere[-1]  # the retry that kept most: where the step stops once sizes are not the cause
            raise failed.restated(
                failed.what, hint=f"{failed.hint}; derived again {how}, the step stopped elsewhere: {again}"
            ) from failed
        acct.notes.insert(0, note)
        return acct
    return account(model, src, known, req)


OWN_SIZES_FAIL = "the model's forward fails at its own sizes too"


def _below_tables(src: _Source, S: int) -> int:
    """``S``, lowered below every position table (S_max) of the model's own sizes (at least 1)."""
    for f, letter in src.fields.items():
        if letter == "S_max":
            S = max(1, min(S, src.values[f] - 1))
    return S


def _fails_at_own_sizes(model: Any, src: _Source, req: Request, failed: SymacctError) -> SymacctError | None:
    """Where the step failed at probe sizes and no retry ran it: the user's model run on fake tensors at its own
    sizes (B = 2, S = 8 or below its position table). If it fails there too, the model as given cannot run the
    step (DeepSeek-V3 with key/value heads it does not use for its latent attention: SDPA refuses the repeated
    keys), and the probe's sizes are not the cause that the probe-size refusal would suggest."""
    if not failed.what.startswith(("the model's forward failed at probe sizes", "the op failed on fake tensors")):
        return None
    if src.configless or req.dims is not None or "C" in src.input_dims or not isinstance(model, nn.Module):
        return None
    S = _below_tables(src, 8 if src.seq is None else src.seq)
    lengths = dict.fromkeys(src.input_dims, S)  # a decoder's length (S_dec) as S, as at() takes it untold
    device = req.precision.get("device", "cpu")
    try:
        with src.context():
            record_step(
                lambda fake: fake_copy(model, fake, device),
                lambda m: src.inputs(m, 2, S, **lengths),
                loss=src.loss,
                step="forward" if req.step in SERVING else req.step,
                only_ops=True,
                device=device,
            )
    except SymacctError as e:
        cause = e.what.removeprefix("the model's forward failed at probe sizes: ")
        cause = cause.removeprefix("the op failed on fake tensors: ")
        return e.restated(
            f"{OWN_SIZES_FAIL} (B=2, S={S}): {cause}",
            hint="the model as given cannot run this step, whatever the sizes: run it once eagerly to see the error "
            "(a config whose fields contradict each other, inputs the model does not take)",
        )
    except Exception:  # noqa: BLE001 - anything else: the probe-size refusal stands
        return None
    return None


# ---- the passes of a derivation, each from one result to the next ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class Request:
    """The options of one derivation, checked: what every pass reads."""

    step: str
    make_opt: Callable[[nn.Module], torch.optim.Optimizer] | None
    precision: dict[str, Any]  # autocast, params_dtype, device (record_step's keywords)
    rule_options: dict[str, Any]  # what the cost rules read (embedding_flops)
    options: dict[str, Any]  # acct.options
    inputs: Callable[..., Any] | None
    loss: Callable[[Any], torch.Tensor] | None
    dims: Mapping[str, int] | None
    fixed: tuple[str, ...]
    strict: bool
    causal_discount: bool
    routing: Sequence[Any] | None
    degenerate: bool
    own_fields: str | None = None  # derive's last tries: the fields of the model's own 'tie'd or kept, or all 'keep'
    strided: bool = False  # derive's retry: S probed as IMAGE_SCALE * prime though no module halves the image side
    even: bool = False  # derive's retry: the widths probed as 2 * prime (a step that halves one)
    # derive's retry with the layer count fixed (``_FixLayers``): no other field is looked for as one (a list of
    # experts inside each layer grows with its own count, and would be taken for the stack next)
    layers_fixed: bool = False
    cache_dtype: torch.dtype | None = None  # the KV cache's dtype (serving steps; None: the compute dtype)


NO_LIST_OF_BLOCKS = (
    "the ops change with L but no nn.ModuleList of L blocks holds them (the layers share modules, or each is an "
    "attribute of its own)"
)


class _FixLayers(Exception):
    """A pass found the layer stack cannot be factored: derive again with L fixed at its value."""

    def __init__(self, src: _Source, reason: str) -> None:
        super().__init__(reason)
        self.src, self.reason = src, reason


class _Degenerate(Exception):
    """The user's model runs other ops than the probe model, and a size may be degenerate (H == H_kv, 1)."""

    def __init__(self, error: SymacctError) -> None:
        super().__init__(str(error))
        self.error = error


def _request(
    *,
    inputs: Callable[..., Any] | None,
    loss: Callable[[Any], torch.Tensor] | None,
    step: str,
    optimizer: str | type | None,
    optimizer_options: Mapping[str, Any] | None,
    dims: Mapping[str, int] | None,
    fixed: Iterable[str],
    strict: bool,
    causal_discount: bool,
    embedding_flops: str,
    autocast: torch.dtype | str | None,
    params_dtype: torch.dtype | str | None,
    device: str,
    routing: Sequence[Any] | None,
    cache_dtype: torch.dtype | str | None,
    _degenerate: bool,
    _own_fields: str | None = None,
    _strided: bool = False,
    _even: bool = False,
    _layers_fixed: bool = False,
    tensor_parallel: Any = None,
    tp: int = 2,
    sdpa_backend: str | None = None,
    hardware: Any = None,
    without_gpu: bool = False,
    context_parallel: int | None = None,
    fsdp_policy: bool = False,
) -> Request:
    """Check the options and put them in one record."""
    autocast, params_dtype = torch_dtype("autocast", autocast), torch_dtype("params_dtype", params_dtype)
    kv_dtype = torch_dtype("cache_dtype", cache_dtype, names=CACHE_DTYPES)
    if kv_dtype is not None and step not in SERVING:
        raise SymacctError("cache_dtype= is for step='prefill' or 'decode'", hint="drop cache_dtype= for this step")
    if step not in STEPS:
        raise SymacctError(f"unknown step {step!r}", hint="use step= " + ", ".join(repr(s) for s in STEPS))
    if embedding_flops not in ("lookup", "matmul"):
        raise SymacctError(f"unknown embedding_flops {embedding_flops!r}", hint="use 'lookup' or 'matmul'")
    make_opt = optimizer_factory(optimizer, optimizer_options)
    if make_opt is not None and step != "train":
        raise SymacctError("an optimizer needs step='train'", hint=f"drop optimizer= for step={step!r}")
    for name, dt in (("autocast", autocast), ("params_dtype", params_dtype)):
        if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
            raise SymacctError(f"{name}={dt!r} is not a floating dtype", hint="use torch.bfloat16 or torch.float16")
    if autocast is not None and autocast not in (torch.bfloat16, torch.float16):
        raise SymacctError(
            f"autocast={autocast} is no autocast: PyTorch's autocast casts to bfloat16 or float16, and disables itself "
            "for another dtype (with a warning), so the step would run as without it",
            hint="use autocast='bf16' or 'fp16', or drop autocast= (params_dtype= sets the parameters' dtype)",
        )
    check_device(device)
    check_backend(sdpa_backend, device)
    precision: dict[str, Any] = {"autocast": autocast, "params_dtype": params_dtype, "device": device}
    if fsdp_policy is not False:
        if fsdp_policy is not True:
            raise SymacctError(f"fsdp_policy={fsdp_policy!r} is not True or False", hint="pass fsdp_policy=True")
        if params_dtype is None:
            raise SymacctError("fsdp_policy=True runs params_dtype as FSDP2's policy does: it needs params_dtype=")
        precision["fsdp_policy"] = True
    if sdpa_backend is not None:
        precision["sdpa_backend"] = sdpa_backend
    if hardware is not None:
        if torch.device(device).type != "cuda":
            raise SymacctError(
                f"hardware= names the GPU whose CUDA kernel choices the step follows; device={device!r} runs the "
                "CPU's kernels",
                hint="pass device='cuda' with hardware= (CLI: --device cuda --hardware NAME)",
            )
        precision["sdpa_target"] = Target.of(get_hardware(hardware))
    if without_gpu is not False:
        if without_gpu is not True:
            raise SymacctError(f"without_gpu={without_gpu!r} is not True or False", hint="pass without_gpu=True")
        if "sdpa_target" not in precision:
            raise SymacctError(
                "without_gpu=True derives for a named GPU as a machine without one would: it needs device='cuda' "
                "and hardware=",
                hint="pass device='cuda', hardware='H100-SXM' (CLI: --device cuda --hardware NAME)",
            )
        precision["python_engine"] = True
    if tensor_parallel is not None:
        check_plan(tensor_parallel)
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 2:
            raise SymacctError(f"tp={tp!r} is not a tensor-parallel degree", hint="pass tp= a whole number >= 2")
        if step != "train":
            raise SymacctError("tensor_parallel= is derived for step='train'", hint="drop tensor_parallel=")
        precision |= {"tensor_parallel": tensor_parallel, TP: tp}
    if context_parallel is not None:
        precision[CP] = _check_cp(context_parallel, step, device)
    return Request(
        step=step,
        make_opt=make_opt,
        precision=precision,
        rule_options={"embedding_flops": embedding_flops},
        options={
            "step": step,
            "causal_discount": causal_discount,
            "embedding_flops": embedding_flops,
            "optimizer": getattr(optimizer, "__name__", optimizer),
            "optimizer_options": dict(optimizer_options or {}),
            "autocast": str(autocast) if autocast else None,
            "params_dtype": str(params_dtype) if params_dtype else None,
            **({"fsdp_policy": True} if fsdp_policy is True else {}),
            "cache_dtype": str(kv_dtype) if kv_dtype else None,
            "device": device,
            "sdpa_backend": sdpa_backend,
            "hardware": precision["sdpa_target"].name if "sdpa_target" in precision else None,
            "without_gpu": bool(precision.get("python_engine")),
            "tensor_parallel": _plan_name(tensor_parallel),
            "context_parallel": context_parallel,
        },
        inputs=inputs,
        loss=loss,
        dims=dims,
        fixed=tuple(fixed),
        strict=strict,
        causal_discount=causal_discount,
        routing=routing,
        degenerate=_degenerate,
        own_fields=_own_fields,
        strided=_strided,
        even=_even,
        layers_fixed=_layers_fixed,
        cache_dtype=kv_dtype,
    )


def _check_cp(cp: Any, step: str, device: str) -> int:
    """A context-parallel degree symacct derives: a whole number >= 2 made of the primes 2, 3, 5, 7 (S is
    probed as 2 * cp times a prime of its own), a training step on the CPU's kernels."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 2:
        raise SymacctError(
            f"context_parallel={cp!r} is not a degree", hint="pass context_parallel= a whole number >= 2"
        )
    if set(sympy.factorint(cp)) - {2, 3, 5, 7}:
        raise SymacctError(
            f"context_parallel={cp}: a degree with a prime factor above 7 is not derived",
            hint="cp = 2, 4, 8, 16, ... (products of 2, 3, 5, 7)",
        )
    if step != "train":
        raise SymacctError("context_parallel= is derived for step='train'", hint="drop context_parallel=")
    if device != "cpu":
        raise SymacctError(
            "context parallelism is derived on the CPU's kernels (the ring runs flash attention's CPU kernel)",
            hint="drop device= for context_parallel=",
        )
    return cp


def _plan_name(plan: Any) -> str | None:
    if plan is None or isinstance(plan, str):
        return plan
    return "plan dict" if isinstance(plan, dict) else getattr(plan, "__name__", "plan function")


TP = "tp"  # the tensor-parallel degree's symbol (and its key among a build's values)
CP = "context_parallel"  # the context-parallel degree's key among the precision options (a number, no symbol)
STEPS = ("train", "forward", "prefill", "decode")
SERVING = ("prefill", "decode")
_SERVING_NOTE = {
    "prefill": "step prefill: a prompt of S tokens run with an empty KV cache, which the step fills (no grad)",
    "decode": "step decode: one new token a sequence after a KV cache of C positions (no grad; S = 1, no symbol)",
}


def _serving_inputs(
    model: Any, step: str, inputs: Callable[..., Any] | None, cache_dtype: torch.dtype | None = None
) -> Callable[..., Any]:
    """The inputs of a prefill or a decode step: given (inputs= taking B, S and, to decode, C), or the model's
    own ``prefill_inputs(B, S)`` / ``decode_inputs(B, S, C)`` (the reference models have them)."""
    if inputs is not None:
        return inputs
    method = f"{step}_inputs"
    if not hasattr(model, method):
        raise SymacctError(
            f"step={step!r} needs the model's {method}(B, S{', C' if step == 'decode' else ''}) or inputs=",
            hint="pass inputs=lambda m, B, S"
            + (", C" if step == "decode" else "")
            + ": {...} building the step's arguments, with the KV cache under the key 'cache' "
            + ("(C positions a layer)" if step == "decode" else "(empty: the step fills it)"),
        )
    kw = {"cache_dtype": cache_dtype} if cache_dtype is not None else {}
    if step == "decode":
        return lambda m, B, S, C: m.decode_inputs(B, S, C, **kw)
    return lambda m, B, S: m.prefill_inputs(B, S, **kw)


def _refuse_compiled(model: nn.Module, who: str = "the model") -> None:
    """Refuse a model that does not run as eager PyTorch, or holds a module that does not: a torch.compile
    wrapper (``torch.compile(module)``, at the root or as a child), a module compiled in place
    (``module.compile()``), a TorchScript module. symacct would trace it as eager (or fail inside the TorchScript
    interpreter on fake tensors), where a compiled graph may fuse ops and keep other tensors. ``who``: whose
    model it is (a factory's, built at the sizes given)."""
    for path, m in model.named_modules():
        name = who if not path else f"{who}'s module {path}"
        if type(m).__name__ == "OptimizedModule" and hasattr(m, "_orig_mod"):
            raise SymacctError(
                f"{name} is a torch.compile wrapper: symacct traces eager PyTorch, and a compiled graph may fuse "
                "ops and keep other tensors",
                module=path or "<root>",
                hint=f"pass the eager module, {'model' if not path else path}._orig_mod (the figures are then those "
                "of eager execution)",
            )
        if isinstance(m, torch.jit.ScriptModule):
            raise SymacctError(
                f"{name} is a TorchScript module ({type(m).__name__}, from torch.jit.script or torch.jit.trace): "
                "symacct traces eager PyTorch",
                module=path or "<root>",
                hint="pass the eager module it was made from (the figures are then those of eager execution)",
            )
        if getattr(m, "_compiled_call_impl", None) is not None:  # module.compile(): compiled in place
            raise SymacctError(
                f"{who}'s module {path or '<root>'} is compiled in place (module.compile()): symacct traces eager "
                "PyTorch, and a compiled graph may fuse ops and keep other tensors",
                module=path or "<root>",
                hint="derive the model before compiling it (the figures are then those of eager execution)",
            )


def read_source(model: Any, req: Request) -> _Source:
    """Pass 1: which config fields are sizes and which letters they get, the layer count, the step's inputs
    and loss (a transformers model's task), the notes that say what was chosen."""
    if isinstance(model, nn.Module):
        _refuse_compiled(model)
        lazy = [n for n, p in model.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
        if lazy:
            raise SymacctError(
                f"the model's parameter {lazy[0]} is not initialized yet (a lazy module: nn.LazyLinear and the like "
                "take their shapes from the first input)",
                module=lazy[0].rpartition(".")[0] or "<root>",
                hint="run the model once on an input of the real widths (its parameters then have their shapes), "
                "then derive",
            )
    inputs, loss = req.inputs, req.loss
    hf_task = None
    input_dims: tuple[str, ...] = ()
    hf = req.dims is None and is_transformers_model(model)
    if hf and req.step not in SERVING:
        if inputs is None or loss is None:
            hf_task = task_for(model, inputs=inputs is None)
        if inputs is None:
            inputs = _drop_labels(hf_task.inputs) if req.step == "forward" else hf_task.inputs
            input_dims = hf_task.dims
        if loss is None and req.step == "train":
            loss = hf_task.loss
    if req.step in SERVING:
        if req.cache_dtype is not None and (hf or inputs is not None):
            raise SymacctError(
                "cache_dtype= needs the model's own prefill_inputs / decode_inputs (the reference models')",
                hint="a transformers model's quantized caches need their own libraries; with inputs=, build the "
                "cache in the dtype you want and leave cache_dtype= out",
            )
        if hf and inputs is None:
            inputs = hf_serving_inputs(model, req.step)
        else:
            inputs = _serving_inputs(model, req.step, inputs, req.cache_dtype)
    src = _source(model, inputs, req.dims, req.fixed)
    if req.step in SERVING:
        input_dims = ("C",) if req.step == "decode" else ()
        src.seq = 1 if req.step == "decode" else None
        src.notes.append(_SERVING_NOTE[req.step])
    src.loss = loss
    src.inputs_given = inputs is not None
    src.input_dims = input_dims
    src.strided = req.strided or _strided(model, src)
    src.even = req.even
    if src.layout is not None:
        src.notes.append(
            f"the model's parameters are {str(src.layout).removeprefix('torch.')}, as after "
            "model.to(memory_format=...): the model rebuilt from its config is converted so too"
        )
    if hf_task is not None:
        if req.inputs is None:  # the class first: a config.json names none
            src.notes.append(f"{type(model).__name__}: {hf_task.note}")
        elif req.loss is None and req.step == "train":
            src.notes.append(f"{type(model).__name__}: the inputs given, the loss of its {hf_task.name} step")
        if req.step == "forward" and req.inputs is None:  # what _drop_labels feeds instead
            dec = getattr(getattr(model, "config", None), "is_encoder_decoder", False)
            src.notes.append(
                "step='forward' runs these inputs without the labels"
                + (" (given as decoder_input_ids, so the decoder runs on S_dec positions)" if dec else "")
                + " and computes no loss"
            )
    if hf:
        check_experts_path(model)
        if req.routing is not None:
            check_routing(model, req.routing)
        _eager_transformers(src)
    src.notes += _own_letters(src)
    layer = None if req.layers_fixed else _layer_field(src)
    if layer is not None:
        field_name, path = layer
        src.fields[field_name] = "L"
        src.notes.append(f"{field_name} counts the layers ('{path or '<root>'}' repeats {field_name} times): L")
    for f in src.repeat_counts:  # never probed as a size: a prime number of blocks, traced, would take minutes
        del src.fields[f]
    if src.repeat_counts:
        src.notes.append(
            f"{', '.join(src.repeat_counts)} each count the blocks of a stack side by side with another: "
            "kept at their values (the stacks are not factored by L)"
        )
    lfield = next((f for f, letter in src.fields.items() if letter == "L"), None)
    if lfield is not None:
        for name, seq in src.lists.items():
            if len(seq) == src.values[lfield] and not _uniform(seq):
                raise _FixLayers(src, f"the per-layer list {name} differs between layers (it has one entry a layer)")
    src.notes += _follow_heads(src, req.degenerate, req.precision.get(TP))
    if CP in req.precision:
        _tie_tables(src)
    constants, counts = _not_sizes(src)
    src.constants = [*constants, *counts]
    for f in src.constants:
        del src.fields[f]
    if req.own_fields:
        src.notes += _tie_or_keep_own(src, tie=req.own_fields == "tie")
    if constants:
        src.notes.append(
            f"{', '.join(constants)} set no tensor size (ids, flags, chunk sizes) or switch which modules are "
            "built: kept at their values"
        )
    if counts:
        src.notes.append(f"{', '.join(counts)} count the modules of a list (not the layers): kept at their values")
    nested = _nested_configs(model)
    if nested:
        src.notes.append(
            f"{', '.join(nested)}: configs inside the model's config; symacct reads the top-level fields as sizes, "
            "and theirs are kept at their values (derive a model built from one of them alone for its sizes as "
            "symbols, e.g. transformers.AutoModelForCausalLM.from_config(config.text_config))"
        )
    return src


def _nested_configs(model: Any) -> list[str]:
    """The fields of the model's config that are configs themselves (a multimodal model's ``text_config`` and
    ``vision_config``): no field of theirs is read as a size."""
    config = getattr(model, "config", None)
    if config is None or isinstance(config, Mapping) or not hasattr(config, "__dict__"):
        return []
    return sorted(
        k
        for k, v in vars(config).items()
        if dataclasses.is_dataclass(v) and not isinstance(v, type) and hasattr(v, "to_dict")
    )


# the widths a field of the model's own may follow when equal, in the order preferred when several are (not
# the head or expert counts: small numbers a rotary width or a group size equals by chance)
_TIE_ORDER = ("D", "F", "V", "S_max")


def _own_size_fields(src: _Source) -> list[str]:
    """The size fields with a symbol of their own (no known name): derive's last try ties or keeps them. A
    field named by a known letter (a factory's ``dims={"D": ...}``) is not one."""
    return sorted(f for f, letter in src.fields.items() if letter == f and letter not in ORDER)


def _tie_or_keep_own(src: _Source, tie: bool = True) -> list[str]:
    """derive's last tries, after a failure at probe sizes with the model's own size fields as symbols (a
    rotary width that must stay below the head width, a projection built only when its width differs from
    D): each that equals a known size at the model's values follows it (OPT's ``word_embed_proj_dim`` =
    ``hidden_size``), the others keep their values; without ``tie`` (the try after, where a field equals a
    width by chance) every one keeps its value. Exact at the model's values; the formulas hold these fields
    as the model has them."""
    known = {letter: f for f, letter in src.fields.items() if letter in _TIE_ORDER} if tie else {}
    notes = []
    for f in _own_size_fields(src):
        equal = next((known[x] for x in _TIE_ORDER if x in known and src.values[known[x]] == src.values[f]), None)
        del src.fields[f]
        if equal is not None:
            src.follow[f] = (equal, None)
            notes.append(f"{f} = {equal} ({src.values[f]}): it follows {letter_for_field(equal)}")
        else:
            src.kept.append(f)
            notes.append(f"{f} kept at {src.values[f]}")
    return notes


def _tie_tables(src: _Source) -> None:
    """Context parallelism shards the model's sequence tables whole (``context_parallel_buffers``): a table
    of S_max rows has S rows, S_max is S (torchtitan's convention)."""
    tied = [f for f, letter in src.fields.items() if letter == "S_max"]
    for f in tied:
        src.fields[f] = "S"
    if tied:
        src.notes.append(
            f"context parallelism shards the sequence tables with the inputs: {', '.join(tied)} = S (S_max is S)"
        )


@dataclasses.dataclass(frozen=True)
class Probes:
    """The two probe size sets: the first is read back into symbols, the second checks the formulas."""

    first: Probe
    second: Probe


def choose_probes(model: Any, src: _Source, req: Request) -> Probes:
    """Pass 2: probe sizes, avoiding the primes of every constant (fixed fields, a config-free module's
    own sizes)."""
    avoid = set()
    for f in [*req.fixed, *src.constants]:
        if f in src.values and abs(src.values[f]) > 1:  # 0, 1, -1 carry no prime
            avoid |= set(sympy.factorint(abs(src.values[f])))
    # a window's neighbours (a sliding layer caches window - 1 positions) read as constants; their primes are
    # not kept from the probes, whose sizes they would move (a prime shared with a symbol: the check refuses)
    near = {
        q
        for f in WINDOWS
        if isinstance(w := src.values.get(f), int) and f in src.constants and w > 2
        for q in [*sympy.factorint(w - 1), *sympy.factorint(w + 1)]
    }
    if src.configless:  # every size of the module is a constant: no probe may collide with one
        for t in [*model.parameters(), *model.buffers()]:
            for d in t.shape:
                avoid |= set(sympy.factorint(int(d))) if d > 1 else set()
    tp: list[int | None] = [None, None]
    if "tensor_parallel" in req.precision:  # the degree's own primes: the fake groups' world sizes
        free = [p for p in TP_PRIMES if p not in avoid]
        if len(free) < 2:
            raise SymacctError(
                f"the model's constants take the primes a tensor-parallel probe needs ({TP_PRIMES})",
                hint="keep fewer fields fixed (fixed=...)",
            )
        tp = [free[0], free[1]]
    seq, cp = _splits_sequence(req.precision), req.precision.get(CP)
    # widths kept at their values (a rotary part of the head): the rest of a width, X - k, is read too
    kept = [src.values.get(f) for f in [*req.fixed, *src.kept] if letter_for_field(f) not in _NOT_WIDTHS]
    cuts = tuple(sorted({v for v in kept if isinstance(v, int) and v > max(OFFSETS)}))
    first = _probe_for(
        src, FIRST_PRIMES, LAYERS[0], avoid, HEAD_PRIMES[0], offsets=True, tp_prime=tp[0], tp_sequence=seq, cp=cp,
        cuts=cuts,
    )  # fmt: skip
    if near:
        first = dataclasses.replace(first, constants=tuple(sorted({*first.constants, *near})), _cache={})

    def second(lengths: int = 1) -> Probe:
        return _probe_for(
            src, SECOND_PRIMES, LAYERS[1], avoid, HEAD_PRIMES[1], tp_prime=tp[1], tp_sequence=seq, cp=cp,
            lengths=lengths, even=True,
        )  # fmt: skip

    factor = _past_windows(src, first, second())
    return Probes(first, second(factor))


def _length(probe: Probe, factor: int = 1) -> int:
    """The positions a probe's step attends to (its cached positions and its new ones), with S and C
    ``factor`` times as long."""
    S = probe.values.get("S")
    return factor * (probe.values.get("C", 0) + (S or 0)) + (0 if S else 1)


def _past_windows(src: _Source, first: Probe, second: Probe) -> int:
    """The factor (a power of 2) that takes the second probe's lengths (S, C, S_max) past every sliding window
    the first probe's are past: a window kept at its value (GPT-OSS's ``sliding_window = 128``) between the
    two probes has them trace two paths (another mask, a cache that stops growing), and the formulas read
    from the first could not be checked by the second. 1 when no window lies between them."""
    windows = [v for f in src.constants if f in WINDOWS and isinstance(v := src.values.get(f), int) and v > 2]
    factor = 1
    for w in windows:
        while _length(first) > w >= _length(second, factor):
            factor *= 2
    return factor


def _splits_sequence(precision: dict[str, Any]) -> bool:
    """Whether a tensor-parallel plan may split the sequence: all but ``"megatron"`` (the model's plan without
    sequence parallelism) may; S is then probed and run as a multiple of the degree."""
    return precision.get("tensor_parallel", "megatron") != "megatron"


@dataclasses.dataclass(frozen=True)
class FirstTrace:
    """The probe model's step, symbolised: each op costed in symbols, each op and parameter counted."""

    trace: StepTrace
    stacks: list[str]
    costed: list[CostedOp]
    counts: list[Any]
    param_counts: dict[str, Any]
    notes: list[str]
    min_layers: int
    # the stacks were checked against the model built with one layer more (``_following_layers``)
    followed: bool = False


def trace_first(src: _Source, probes: Probes, req: Request) -> FirstTrace:
    """Pass 3: trace the probe model, cost every op in symbols, factor the layer stacks
    (``symacct.cost.layers.factor``)."""
    probe = probes.first
    trace = _record(src, probe, req.step, src.loss, req.make_opt, req.precision, cycles=True)
    probe.pad(padded_sizes(trace))  # a kernel's rounded-up sizes, read as such
    stacks = find_stacks(trace, LAYERS[0]) if probe.layers is not None else []
    checked = len(stacks) > 1  # a list of L blocks beside one of as many modules by chance (a stem of 4 layers)
    if checked:
        stacks = _following_layers(src, probe, stacks)
    costed = cost_ops(trace, probe.to_expr, strict=req.strict, options=req.rule_options)
    got = factor(trace, costed, stacks, LAYERS[0]) if stacks else None
    if stacks and got is None and not checked:
        checked = True
        if (held := _following_layers(src, probe, stacks)) != stacks:
            stacks = held  # a Sequential of 4 unlike modules is no stack: the step's ops follow L otherwise
            got = factor(trace, costed, stacks, LAYERS[0]) if stacks else None
    if not stacks:
        counts = [sympy.Integer(1)] * len(costed)
        param_counts = {ph.name: sympy.Integer(1) for ph in trace.placeholders}
        return FirstTrace(trace, stacks, costed, counts, param_counts, [], 1)
    if got is None:
        raise _FixLayers(src, "the blocks of the layer stack differ")
    counts, param_counts, notes, min_layers = got
    return FirstTrace(trace, stacks, costed, counts, param_counts, notes, min_layers, followed=checked)


def check_same_model(model: Any, src: _Source, probes: Probes, first: FirstTrace, req: Request) -> UserRun | None:
    """Pass 4: the user's own model runs the probe model's ops (``symacct.sameness``); its trace. A module
    without config is the probe model itself, and a factory's model is the factory's at the given sizes
    (``_factory_model``): their traces here, as long and as short as they run, check the lengths (and the
    factory's, the readings at its own sizes)."""
    if req.dims is not None:
        model = _factory_model(src, req.dims)
    if TP in req.precision:
        _check_degree(src, probes.first, first.trace, req.precision[TP])
    try:
        counted = frozenset(str(c.rec.op) for c in first.costed if c.cost.flops != 0 or c.cost.flops_recompute != 0)
        user = _same_model(
            model,
            src,
            probes.first,
            first.trace,
            first.stacks,
            req.step,
            src.loss,
            req.precision,
            req.make_opt,
            counted=counted,
        )
        return dataclasses.replace(user, model=model) if req.dims is not None else user
    except SymacctError as e:
        if not first.stacks and "L" in src.fields.values() and probes.first.layers is not None:
            # the layer count set, yet no list of L blocks: the layers share modules (ALBERT runs one group L
            # times) or are kept apart (attributes block0, block1, ...), so the probe's L and the model's run
            # different numbers of ops: exact at the model's L only
            raise _FixLayers(src, NO_LIST_OF_BLOCKS) from e
        _fix_no_stack(src, probes.first, first, e)
        _fix_unlike_layers(model, src, first, e)
        _retry_degenerate(src, req, e)
        raise


def _factory_model(src: _Source, dims: Mapping[str, int]) -> nn.Module:
    """A factory's model at the given sizes (``dims=``) with meta tensors, nothing allocated at any size: built
    on fake tensors (``_build_fake``), then each parameter and buffer made a meta tensor of its shape and dtype
    (tied ones stay tied), which pass 4's fake copies take as a model built on the meta device."""
    try:
        with torch.device("cpu"):
            model = _build_fake(lambda: src.build({}), FakeTensorMode())
    except Exception as e:
        raise SymacctError(
            f"the factory fails at the sizes given ({', '.join(f'{k}={v}' for k, v in dims.items())}): "
            f"{type(e).__name__}: {' '.join(str(e).split())}",
            hint="pass dims= at which the factory builds its model",
        ) from e
    metas: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in metas:
                    metas[id(t)] = _empty_like(t, "meta")
                table[name] = metas[id(t)]
    return model


def _fix_unlike_layers(model: Any, src: _Source, first: FirstTrace, e: SymacctError) -> None:
    """Raise ``_FixLayers`` for a difference between the user's model and the probe model when a layer stack
    of the user's model has middle blocks built unlike each other (DeepSeek-V3's first three blocks dense):
    the probe's few blocks factor as first + (L - 2) * middle + last by accident, which the model's own
    blocks then contradict; exact at the model's L only."""
    why = unlike_middle(model, first.stacks) if first.stacks and "L" in src.fields.values() else None
    if why is not None:
        raise _FixLayers(src, why) from e


def _retry_degenerate(src: _Source, req: Request, e: SymacctError) -> None:
    """Raise ``_Degenerate`` for a difference between the user's model and the probe model (other ops, or the
    same ops returning other shapes) when the model has sizes derive's second try ties or fixes (H == H_kv:
    Llama's ``repeat_kv`` at one key/value head a head makes a view where grouped heads make a copy, so a
    matmul after it reshapes other shapes); else return, and the caller raises the difference."""
    if not req.degenerate and _degenerate_sizes(src):
        raise _Degenerate(e) from None


def check_parameters(
    model: Any, src: _Source, probes: Probes, first: FirstTrace, req: Request, user: UserRun | None
) -> UserRun | None:
    """Pass 4, after the check at other sizes has confirmed the first probe's readings: the user's parameters
    and buffers have the probe model's shapes at the model's own sizes (``symacct.sameness.compare_parameters``),
    and each op of the user's trace returns the shapes its counterpart does at the sizes that trace ran at
    (``compare_shapes``). A factory's model is built again at its sizes, as pass 4 built it. The user's trace
    that passed: where shapes differ at the largest batch only, the one at the probe's B, with the difference
    (``UserRun.over``)."""
    if user is None:
        return None
    if user.model is not None:  # a factory's, as pass 4 built it
        model = user.model
    blocks = probes.first.layers or 1
    try:
        compare_parameters(model, first.trace, first.stacks, blocks, _at_own_sizes(src, probes.first))
    except SymacctError as e:
        _fix_unlike_layers(model, src, first, e)
        raise
    if CP not in req.precision:  # context parallelism runs the user's model at its own S (the tables' rows)
        read = _at_own_sizes(src, probes.first, user.sizes)
        try:
            compare_shapes(user.trace, first.trace, first.stacks, blocks, read, user.ignore, user.scale)
        except SymacctError as e:
            _retry_degenerate(src, req, e)
            if user.at_probe_batch is not None:  # alike at the probe's B: the larger batch took another path
                big, user = user.sizes["B"], user.at_probe_batch()
                read = _at_own_sizes(src, probes.first, user.sizes)
                try:
                    compare_shapes(user.trace, first.trace, first.stacks, blocks, read, user.ignore, user.scale)
                    return dataclasses.replace(user, over=(big, e))
                except SymacctError as again:
                    e = again
            if user.at_probe_lengths is None:
                raise e
            short = user.at_probe_lengths()  # alike at the probe's lengths: the longer ones took another path
            compare_shapes(
                short.trace,
                first.trace,
                first.stacks,
                blocks,
                _at_own_sizes(src, probes.first, short.sizes),
                short.ignore,
            )
            raise _length_branch(src, _lengths_of(user), _lengths_of(short), e) from e
    return user


@dataclasses.dataclass(frozen=True)
class Bound:
    """The least value of a size (a length, or B) the derived path holds from, or the largest batch it holds up
    to (``shortest_path``): a constraint ``at`` checks, and the note that says where the model takes another
    path."""

    constraint: Constraint
    note: str


SHORTEST_BATCH = 2  # the least B ``shortest_path`` runs: a size of 1 is another convention (``Accounting.at``'s note)
LARGEST_BATCH = 8191  # the largest B it runs (a prime, as ``LONGEST``): thresholds past it are not seen


def shortest_path(src: _Source, probes: Probes, first: FirstTrace, user: UserRun | None) -> tuple[Bound, ...]:
    """Pass 4, last: the user's model traced at the shortest lengths (S = 2, or C = 2 in a decode step, on the
    probe's side of every window) and the least batch (B = 2), and compared with the probe's ops and shapes, as
    at its longest (where it runs the largest batch, ``LARGEST_BATCH``, too). A step whose path turns on a
    length below both probes' (``if S <= 32``: the second probe runs about 74 positions, the first a few
    hundred), on a batch size below theirs (``if B <= 8``: they run dozens and hundreds) or above them
    (``if B > 256``: a batch chunked past a size), or on the tokens in a step (``if B * S <= 4096``) takes
    another path there, and the formulas read from the probes would be given for sizes the model runs
    otherwise.

    Where they differ, the sizes between which the user's model runs the probe's ops are found by bisection,
    B first (at the probe's lengths), then the length (at the least B), one threshold between two values as a
    window has; the formulas hold between them: constraints ``at`` checks (a path the derivation did not
    trace), each with a note. A threshold on B, on a length or on their product is monotone in each, so the
    corner found bounds every larger size (every smaller batch, for the largest). The largest batch is read
    at the probe's lengths, or where the longest lengths alone take the other path (``B * S > n``) at those,
    which bounds it for every shorter length too. A model that cannot run at the shortest lengths (the top 5
    along S) is bounded the same way, as sizes it cannot run; ``fit`` searches between the bounds
    (``symacct.time.model.least``, ``most``). B = 1 and a length of 1 are traced too, compared in the ops the
    probe's FLOPs count (``_aside_at_one``): another matmul there (``if B == 1``; an einsum, which runs no bmm
    where the sizes it keeps are 1) bounds B, or the length, from 2. Empty where they all agree, or where pass 4
    is skipped."""
    if user is None or user.rerun is None or user.span is None:
        return ()
    name, low, (S0, dims0) = user.span
    B0, rerun, blocks = probes.first.values["B"], user.rerun, probes.first.layers or 1
    top = S0 if name == "S" else dims0.get("C", 0)  # the probe's own value of the length that moves (0: none)

    def _differs_at(b: int, S: int, dims: dict[str, int]) -> SymacctError | None:
        try:
            run = rerun(S, dims, batch=b)
            read = _at_own_sizes(src, probes.first, run.sizes)
            compare_shapes(run.trace, first.trace, first.stacks, blocks, read, run.ignore, run.scale)
        except SymacctError as e:
            if e.internal:
                raise
            return e
        return None

    @functools.cache
    def differs(b: int, n: int) -> SymacctError | None:
        S, dims = (n, dims0) if name == "S" else (S0, {**dims0, "C": n}) if name == "C" else (S0, dims0)
        return _differs_at(b, S, dims)

    least = min(SHORTEST_BATCH, B0)
    b, n = least, top if low is None else low  # n: the shortest length, or (S keeping its structure) the probe's
    bounds = []
    if b < B0 and differs(b, n) is not None and differs(b, top) is not None:  # a threshold on B
        b, lo, found = _threshold(lambda m: differs(m, top), B0, b)
        bounds.append(_bound("B", lo, b, found, "smaller batches"))
    if low is not None and name is not None and differs(b, low) is not None:
        n, lo, found = _threshold(lambda m: differs(b, m), top, low)
        bounds.append(_bound(name, lo, n, found, "shorter lengths", f", B = {b}" if b < B0 else ""))
    if b == least and B0 > 1 and (found := differs(1, n)) is not None:  # B = 1: views and copies aside
        bounds.append(_bound("B", 1, 2, found, "B = 1"))
    if low == n == 2 and name is not None and (found := differs(b, 1)) is not None:  # the length at 1, alike
        bounds.append(_bound(name, 1, 2, found, f"{name} = 1"))
    if user.over is not None:  # a threshold above the probe's B: the largest that runs its ops, at the lengths
        big, found = user.over  # it was seen at (the longest, where a step's tokens decide: B * S > n)
        S, dims = _lengths_of(user)
        if differs(big, top) is not None:  # at the probe's lengths, where the bound is the loosest
            most, hi, found = _threshold(lambda m: differs(m, top), B0, big)
            read = ""
        elif _differs_at(big, S, dims) is not None:
            most, hi, found = _threshold(lambda m: _differs_at(m, S, dims), B0, big)
            read = f" (at S = {S}" + (f", C = {dims['C']}" if "C" in dims else "") + ")"
        else:  # alike with a stack's first and last blocks only: a block between them differs, not bounded
            raise found.restated(
                f"the model given takes another path at B = {big} than at the probe's B = {B0}, in a block of its "
                f"layer stack between the first and the last, where the batch sizes between cannot be bisected "
                f"({found.what})",
                hint="branch on the batch size alike in every block of the stack (or in none), so that its first "
                "and last blocks show where",
                sizes=("B",),
            )
        bounds.append(_bound("B", hi, most, found, "larger batches", read))
    return tuple(bounds)


def _per_sample(probe: Probe, trace: StepTrace, stacks: list[str], ignore: frozenset[str]) -> bool:
    """Whether the probe's step runs an op once a sequence of the batch (a count read in B: a loop over the
    batch), so that a trace grows with B."""
    batch = sym("B")
    return any(
        (expr := probe.to_expr(n)) is not None and batch in sympy.sympify(expr).free_symbols
        for n in set(op_counts(trace, stacks, ignore))
    )


def _threshold(differs: Callable[[int], SymacctError | None], same: int, other: int) -> tuple[int, int, SymacctError]:
    """Bisection between a value where the user's model runs the probe's ops, ``same``, and one where it takes
    another path (or fails), ``other``, on either side: the last value of the one, the first of the other,
    and the difference there."""
    found = differs(other)
    assert found is not None
    while abs(other - same) > 1:
        mid = (same + other) // 2
        e = differs(mid)
        if e is None:
            same = mid
        else:
            other, found = mid, e
    return same, other, found


def _bound(name: str, at: int, last: int, found: SymacctError, sizes: str, read: str = "") -> Bound:
    """The bound ``name >= last`` (``name <= last`` where ``last`` is below ``at``): a constraint and its
    note, where at ``at`` the model differs as ``found`` says (``read``: at which other sizes the bound was
    read)."""
    path = found.what.startswith(NOT_THE_SAME)
    where = f"{name} = {at}" + (f" ({found.op}" + (f" in {found.module})" if found.module else ")") if found.op else "")
    how = "takes another path" if path else "does not run"
    cause = found.what.removeprefix(NOT_THE_SAME + ": ")
    ones = (
        ", in the ops its FLOPs count (at a size of 1 PyTorch may view what it otherwise copies, or skip a "
        "reduction: bytes and the other FLOPs are a convention there)"
        if at == 1
        else ""
    )
    up = last < at
    holds = f"up to {name} = {last}" if up else f"from {name} = {last} on"
    note = (
        f"the model given {how} at {name} = {at}{read}{ones} ({cause}); {holds} it runs the probe's "
        f"ops: the figures hold for {name} {'<=' if up else '>='} {last}, and at() refuses {sizes}"
    )
    lhs, rhs = (sym(name), sympy.Integer(last)) if up else (sympy.Integer(last), sym(name))
    return Bound(Constraint("le", lhs, rhs, f"the model given at {where}", path=path), note)


def _cycle_note(trace: StepTrace, stacks: list[str]) -> str:
    """What the step leaves to Python's cycle collector (``StepTrace.cycle_held``): the ops that made it, and
    whether the step's figures hold it."""
    made: dict[str, list[str]] = {"step": [], "after": []}
    for st, when in sorted(trace.cycle_held.items()):
        op = trace.ops[trace.storage_producer[st]] if st in trace.storage_producer else None
        what = f"{op.op} in '{generic_path(op.module, stacks) or '<root>'}' ({op.phase})" if op else "the step's inputs"
        if what not in made[when]:
            made[when].append(what)
    parts = []

    def listed(what: list[str]) -> str:
        return ", ".join(what[:6]) + (f" and {len(what) - 6} more" if len(what) > 6 else "")

    if made["step"]:
        parts.append(
            f"tensors made by {listed(made['step'])} are held only by reference cycles at the step's end: the "
            "figures count them held to the step's end, as with Python's cycle collector paused, and they outlive "
            "the step until it runs (the next step starts with them); a collection may free them sooner"
        )
    if made["after"]:
        parts.append(
            f"tensors made by {listed(made['after'])} outlive the step in reference cycles once its loss is "
            "dropped, until Python's cycle collector runs (not in the figures: the next step starts with them)"
        )
    return (
        "; ".join(parts) + " (an autograd Function that keeps a tensor as an attribute of ctx makes such a cycle: "
        "ctx.save_for_backward does not)"
    )


def _check_degree(src: _Source, probe: Probe, trace: StepTrace, tp: int) -> None:
    """Refuse a tensor-parallel degree the user's model cannot be split by: the constraints the probe rank's
    trace teaches (tp dividing the heads, F, V; S with sequence parallelism) at the model's own sizes."""
    values: dict[str, Any] = {letter: np.asarray(src.values[f]) for f, letter in src.fields.items()}
    values[TP] = np.asarray(tp)
    for f, (num, _den) in src.follow.items():  # H_kv following tp: at the model's value
        letter = letter_for_field(f)
        if num == TP and letter not in values:
            values[letter] = np.asarray(src.values[f])
    tp_only = [c for c in learn_constraints(trace, probe.to_expr) if TP in c.symbols() and c.symbols() <= set(values)]
    broken = check_constraints(tp_only, values)
    if broken is not None:
        c, at = broken
        fields = ", ".join(f"{f}={src.values[f]}" for f, letter in src.fields.items() if letter in c.symbols())
        raise SymacctError(
            f"tp={tp} does not split this model: {c.describe()} breaks at {fields or at} (from {c.where})",
            hint="choose a tensor-parallel degree that divides the sizes the plan splits, or change those sizes "
            "(Megatron pads the vocabulary to a multiple of 128 * tp)",
        )


@dataclasses.dataclass(frozen=True)
class CheckTrace:
    """The probe model at the second probe's sizes with one block more, costed in plain integers."""

    trace: StepTrace
    costed: list[CostedOp]


def trace_check(src: _Source, probes: Probes, first: FirstTrace, req: Request) -> CheckTrace:
    """Pass 5: every formula must predict a trace at other sizes (and one block more)."""
    probe1, probe2 = probes.first, probes.second
    trace2 = _record(src, probe2, req.step, src.loss, req.make_opt, req.precision)
    count_changed = probe1.layers is not None and not first.stacks and len(trace2.ops) != len(first.trace.ops)
    if count_changed and _count_follows_layers(src, probes, first, req):
        raise _FixLayers(src, NO_LIST_OF_BLOCKS)
    costed2 = cost_ops(trace2, lambda v: v, strict=req.strict, options=req.rule_options)
    try:
        _check(first.costed, first.counts, costed2, probe2, probe2.layers if first.stacks else None)
    except SymacctError as e:
        _fix_no_stack(src, probe1, first, e)
        raise
    return CheckTrace(trace2, costed2)


def _fix_no_stack(src: _Source, probe: Probe, first: FirstTrace, error: SymacctError) -> None:
    """On a failing comparison (the user's model against the probe's, or the checking trace against the
    formulas), where a stack was taken without the check of ``_following_layers`` (one candidate list that
    factors): a list of ``LAYERS[0]`` modules the model holds at every L (a ``Sequential`` of four layers applied
    L times, or a stem of four beside a loop over one shared layer) is no layer stack, and derive runs again
    with L fixed (``_FixLayers``) rather than blame the user's block count or the sizes. Built on this failing
    path only, so a derive that passes pays nothing for it."""
    if not first.stacks or first.followed or probe.layers is None:
        return
    if (held := _following_layers(src, probe, first.stacks)) == first.stacks:
        return
    lists = ", ".join(p or "<root>" for p in first.stacks if p not in held)
    raise _FixLayers(
        src,
        f"{lists} holds {LAYERS[0]} modules at every L (built with one layer more, it has as many), so it is no "
        "layer stack, and no nn.ModuleList of L blocks holds the layers",
    ) from error


def _following_layers(src: _Source, probe: Probe, stacks: list[str]) -> list[str]:
    """The stacks of the first probe (lists of ``LAYERS[0]`` numbered modules, ``find_stacks``) that hold
    ``LAYERS[1]`` in the model built at its sizes with one layer more (on fake tensors; the constructor only):
    a ``Sequential`` of four layers the model always has, or the four modules of a block applied L times, has as
    many there and is no layer stack. All of them where that model cannot be built (no evidence)."""
    lfields = [f for f, letter in src.fields.items() if letter == "L"]
    more = _repeats(src, {**_field_values(src, probe), **dict.fromkeys(lfields, LAYERS[1])}) if lfields else {}
    return [p for p in stacks if more.get(p) == LAYERS[1]] if more else stacks


def _count_follows_layers(src: _Source, probes: Probes, first: FirstTrace, req: Request) -> bool:
    """Whether the first probe's sizes with one block more run another number of ops: the checking trace ran
    another number (it has other sizes and one block more) and no layer stack was found. Traced again on this
    failing path only. When L is the cause, derive fixes it (``_FixLayers``); when it is not, the sizes are (an
    RNN unrolled over the sequence in Python, chunks of a fixed length), and the comparison with the checking
    trace names the first op that differs."""
    probe = probes.first
    more = dataclasses.replace(probe, layers=(probe.layers or 0) + 1, _cache={})
    try:
        trace = _record(src, more, req.step, src.loss, req.make_opt, req.precision)
    except SymacctError:
        return True  # no evidence against L: the message about L stands
    return len(trace.ops) != len(first.trace.ops)


def memory_pass(
    src: _Source, probes: Probes, first: FirstTrace, second: CheckTrace, req: Request
) -> tuple[Memory, Liveness]:
    """Pass 6: static bytes, saved activations (checked at the second probe), live bytes over the step
    factored by L, the phase points and the peak (``symacct.memory.liveness``)."""
    probe1, probe2, stacks = probes.first, probes.second, first.stacks
    trace1 = first.trace
    generic = functools.partial(generic_path, stacks=stacks)
    memory = static_and_activations(trace1, probe1, first.counts, first.param_counts, stacks, generic)
    _check_memory(memory, second.trace, probe2, stacks, generic)
    if stacks:  # the checking trace has one block more: its liveness, bytes borrowed from the first trace
        live = liveness(trace1, second.trace, probe1, stacks, LAYERS[0], other_values=probe2.values)
        if live is None:  # a storage whose bytes it could not borrow: one block more at the first probe's sizes
            probe_more = dataclasses.replace(probe1, layers=LAYERS[1], _cache={})
            trace_more = _record(src, probe_more, req.step, src.loss, req.make_opt, req.precision)
            live = liveness(trace1, trace_more, probe1, stacks, LAYERS[0])
    else:
        live = liveness(trace1, None, probe1, stacks, 1)
    if live is None:  # a peak that is wrong at other L would be a silent wrong number
        raise _FixLayers(src, "the op order outside the blocks changes with L")
    fill_phases(memory, live, sorted(set(probe1.values) | ({"L"} if stacks else set())))
    return memory, live


@dataclasses.dataclass(frozen=True)
class Known:
    """What passes 3, 5 and 6 found for a family (``symacct.memo``): the probes (padded as pass 3 read them),
    the first trace symbolised, the memory formulas and the liveness; in the memo, pass 7's graph and size
    constraints too."""

    probes: Probes
    first: FirstTrace
    memory: Memory
    live: Liveness
    graph: nx.DiGraph | None = None  # the step graph (pass 7's build_graph), copied for each accounting
    constraints: list[Any] | None = None  # the size constraints the first trace teaches
    # the least B and length the user's model runs the probe's ops from, and the largest B (pass 4's
    # ``shortest_path``): kept in the memo, whose pass 4 traces the user's model at its longest lengths only
    bounds: tuple[Bound, ...] = ()


def family_key(model: Any, src: _Source, probes: Probes, options: Mapping[str, Any]) -> Any:
    """The memo key of a derivation (``symacct.memo``), or None (not memoised): the model's class, the
    config each probe builds, the size fields and their letters, the probe sizes, derive's options (the
    optimizer class a name stands for), the cost rules, and the global settings a trace reads (the default
    dtype, deterministic algorithms, SDPA's backends; ``hermetic`` refuses an autocast the caller entered).
    With CUDA kernels chosen by size (``_own_size``) the model's own sizes too. A model without config, or a
    factory, is not memoised: its build reads the user's object."""
    if src.config_at is None or src.configless:
        return None
    probe_list = (probes.first, probes.second)
    try:
        configs = tuple(memo.fingerprint(src.config_at(_field_values(src, p))) for p in probe_list)
    except Exception:  # a config that refuses the probe sizes: not memoised; the probe's build says why
        return None
    options = {k: v for k, v in options.items() if k != "routing"}  # read by the accounting pass only
    named = memo.fingerprint(options)
    if named is None or None in configs:
        return None
    cuda = options.get("device") not in (None, "cpu") or options.get("hardware") is not None
    shape = (
        sorted(src.fields.items()),
        sorted(src.follow.items()),
        tuple(src.kept),
        tuple(src.constants),
        src.input_dims,
        src.seq,
        src.strided,
        src.even,
        src.layout,
        tuple(src.repeat_counts),
        sorted(src.values.items()) if cuda else None,
    )
    sized = tuple(
        (sorted(p.values.items()), p.layers, p.strict, p.constants, p.offsets, p.cuts, sorted(p.padded.items()))
        for p in probe_list
    )
    optimizer = options.get("optimizer")
    settings = (
        torch.get_default_dtype(),
        torch.are_deterministic_algorithms_enabled(),
        tuple(f() for f in _SDPA_FLAGS),
        rule_registry.generation(),
        OPTIMIZERS.get(optimizer.lower()) if isinstance(optimizer, str) else None,  # the class a name stands for
        carried_settings(model) if is_transformers_model(model) else None,
    )
    return (type(model), configs, named, repr(shape), repr(sized), settings)


_SDPA_FLAGS = (
    torch.backends.cuda.flash_sdp_enabled,
    torch.backends.cuda.mem_efficient_sdp_enabled,
    torch.backends.cuda.math_sdp_enabled,
    torch.backends.cuda.cudnn_sdp_enabled,
)


def from_memo(model: Any, src: _Source, key: Any, req: Request) -> Known | None:
    """The family's results, when memoised and the user's model runs the memo's probe model's ops (pass 4,
    run every time); a difference drops the entry and the derivation runs afresh (its own pass 4 decides).
    The memory formulas are copied: the accounting hands them out."""
    known = memo.FAMILIES.get(key)
    if known is None:
        return None
    try:
        user = check_same_model(model, src, known.probes, known.first, req)
        check_parameters(model, src, known.probes, known.first, req, user)
    except (SymacctError, _Degenerate):
        memo.FAMILIES.drop(key)
        return None
    graph = known.graph.copy() if known.graph is not None else None
    return dataclasses.replace(known, memory=known.memory.copy(), graph=graph)


def account(model: Any, src: _Source, known: Known, req: Request) -> Accounting:
    """Pass 7: the graph and its totals (``symacct.accounting.aggregate``), with the memory, the constraints
    on the sizes, the experts and the notes. The graph and the constraints are the memo's when it has them."""
    first, memory, live = known.first, known.memory, known.live
    probe1, stacks = known.probes.first, first.stacks
    graph = known.graph
    if graph is None:
        graph = build_graph(first.trace, first.costed, first.counts, probe1.to_expr, stacks)
    defaults = {}
    field_names = {}
    for f, letter in src.fields.items():
        defaults.setdefault(letter, src.values[f])
        field_names.setdefault(letter, f)
    if TP in probe1.values:
        defaults[TP] = req.precision[TP]
    acct = aggregate(
        graph,
        first.trace,
        probe1,
        first.param_counts,
        stacks,
        defaults=defaults,
        fields=field_names,
        notes=list(first.notes),
        causal_discount=req.causal_discount,
        options=dict(req.options),
        minimum={"L": first.min_layers} if stacks else {},
    )
    acct.memory = memory
    acct.liveness = live
    acct.step = first.trace
    acct.timelines = _timelines(src, probe1, first.trace, live, req)
    acct.tied = _tied(src)
    for f in src.values:  # the config field behind a tied letter, for the notation tables
        if letter_for_field(f) in acct.tied:
            acct.fields.setdefault(letter_for_field(f), f)
    acct.constraints = (
        list(known.constraints) if known.constraints is not None else learn_constraints(first.trace, probe1.to_expr)
    )
    if is_transformers_model(model):
        acct.constraints += window_constraints(model, probe1.values.get("S", src.seq), probe1.values.get("C"))
    for bound in known.bounds:
        acct.constraints.append(bound.constraint)
        acct.notes.append(bound.note)
    # an input size defaults to S (a decoder as long as the encoder); C (cached positions) has no default
    acct.input_sizes = {d: None if d == "C" else "S" for d in src.input_dims}
    acct.experts = expert_layers(graph, acct.symbols, req.routing)
    if acct.experts:
        acct.notes.append(experts_note(acct.experts))
        acct.options["routing"] = None if req.routing is None else [str(s) for s in acct.experts[0].shares or ()]
    acct.notes[:0] = src.notes
    if first.trace.cycle_held:
        acct.notes.append(_cycle_note(first.trace, stacks))
    if first.trace.warmed:
        acct.notes.append(
            f"the model changes itself on its first call ({first.trace.warmed}): the {req.step} step is traced as "
            "a second call runs it (a first call's one-time work is not in its figures)"
        )
    device = req.precision.get("device", "cpu")
    if torch.device(device).type == "cuda":
        if not torch.cuda.is_available():
            how = "on fake CUDA tensors, no GPU: backward by symacct.trace.engine"
        elif req.precision.get("python_engine"):
            how = "on fake CUDA tensors as without a GPU (without_gpu): backward by symacct.trace.engine"
        else:
            how = "on fake CUDA tensors"
        kernels = first.trace.sdpa_kernels
        sdpa = "; ".join(f"SDPA: {k}" for k in sorted(kernels))  # each kernel once, however many calls
        acct.notes.append(f"CUDA kernels traced {how}" + (f"; {sdpa}" if sdpa else ""))
    if "B" not in acct.free_symbols():
        acct.notes.append(
            "B reaches no tensor shape: the inputs do not use their B argument, so every figure is per call "
            "of the inputs, whatever B is passed to at()"
            + ("; make inputs= build tensors of batch B" if src.inputs_given else "")
        )
    return acct


derive = _locked(_derive)


def _timelines(
    src: _Source, probe: Probe, trace: StepTrace, live: Liveness, req: Request
) -> Callable[[int | None], Timeline]:
    """Blocks -> the step's storage timeline with that many blocks (``symacct.memory.reserved``): the first
    trace's for its own number, else one more trace at the probe's sizes, its bytes read by the probe."""
    device = req.precision.get("device", "cpu")
    cache = {probe.layers: Timeline.of(trace, live.base, device)}

    def timeline(layers: int | None) -> Timeline:
        if layers not in cache:
            more = dataclasses.replace(probe, layers=layers, _cache={})
            with _LOCK, no_cycle_collection(), hermetic():
                got = _record(src, more, req.step, src.loss, req.make_opt, req.precision)
            cache[layers] = Timeline.of(got, intervals(got, probe), device)
        return cache[layers]

    return timeline


def _eager_transformers(src: _Source) -> None:
    """Trace a transformers model on the path an eager run takes (symacct.models.hf.eager_paths): the inputs' keys
    are remembered at each call, to know whether the model numbers the positions itself."""
    keys: list[str] = []
    make = src.inputs

    def remembering(m: nn.Module, B: int, S: int, **more: int) -> Any:
        got = make(m, B, S, **more)
        if isinstance(got, dict):
            keys[:] = list(got)
        else:  # positional: the names of the forward's first parameters
            keys[:] = list(inspect.signature(m.forward).parameters)[: len(got)]
        return got

    src.inputs = remembering
    src.context = lambda: eager_paths(lambda: "position_ids" not in keys)


def _drop_labels(inputs: Callable[..., Any]) -> Callable[..., Any]:
    """A forward (inference) step computes no loss: the task's inputs without its labels (an encoder-decoder's
    labels become its decoder_input_ids: the decoder still runs on S_dec positions)."""

    def without(m: nn.Module, B: int, S: int, **dims: int) -> dict[str, Any]:
        got = dict(inputs(m, B, S, **dims))
        labels = got.pop("labels", None)
        if labels is not None and getattr(getattr(m, "config", None), "is_encoder_decoder", False):
            got["decoder_input_ids"] = labels
        return got

    return without


def _internal(e: Exception) -> SymacctError:
    return SymacctError(
        f"symacct failed: {type(e).__name__}: {' '.join(str(e).split())}",
        hint="this is a defect of symacct, not of the model: please report it with the model",
        internal=True,
    )


def _check_memory(memory: Any, trace2: StepTrace, probe2: Probe, stacks: list[str], generic: Any) -> None:
    """Static and saved bytes must predict the second trace too."""
    L2 = LAYERS[1]
    concrete = static_and_activations(
        trace2,
        _Identity(),
        [sympy.Integer(1)] * len(trace2.ops),
        {ph.name: sympy.Integer(1) for ph in trace2.placeholders},
        [],
        lambda m: m,
    )
    subs = {sym(k): v for k, v in probe2.values.items()}
    if stacks:
        subs[sym("L")] = L2
    for name in ("params", "buffers", "grads", "optimizer", "activations"):
        predicted = sympy.sympify(getattr(memory, name)).subs(subs)
        if predicted != getattr(concrete, name):
            raise SymacctError(
                f"the derived {name} bytes do not predict a second trace at other sizes "
                f"({predicted} predicted, {getattr(concrete, name)} counted)",
                hint="a tensor's size is not a product of the model's symbols; keep the fields involved fixed",
            )
