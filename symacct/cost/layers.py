"""Layer stacks: which ModuleLists repeat L times, which block an op belongs to, and how a stack is factored.

A *stack* is a module whose numbered children are exactly ``0 .. n-1`` (a
``ModuleList`` or ``Sequential``) with ``n`` the probe's layer count, not
inside a block of another, and (where the first probe has several, or its
blocks differ) holding one block more in the model built with one layer more
(``symacct.pipeline._following_layers``): a block's ``Sequential`` of four
modules is no stack. The probe is traced with ``LAYERS[0]`` blocks (and the
checking trace with one more); here:

- ``find_stacks``: the stacks of a trace; ``block_of`` / ``op_blocks``: the
  block ``(stack, i)`` a module path or an op belongs to (ops between two
  blocks count with the later one);
- ``generic_path``: ``blocks.3.attn`` -> ``blocks.*.attn``;
- ``factor``: the multiplicity of every op and parameter,
  ``first + (L-2)*middle + last`` (or ``L*block``) when the middle blocks
  are identical op for op;
- ``align_layers`` / ``one_block_less``: the trace with one block more,
  aligned op for op (and parameter for parameter) with the first by
  leaving out a middle block (block ``DROP``).
"""

from __future__ import annotations

import difflib
from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import sympy

from symacct.symbols import sym
from symacct.trace.record import StepTrace

if TYPE_CHECKING:
    from symacct.cost.graph import CostedOp

METRICS = ("flops", "flops_recompute", "flops_other", "bytes_read", "bytes_written")


def repeated(names: Iterable[str]) -> dict[str, int]:
    """Module path -> n for every module whose numbered children are exactly 0..n-1 (a ModuleList, a Sequential)."""
    children: dict[str, set[int]] = defaultdict(set)
    for name in names:
        parent, _, last = name.rpartition(".")
        if last.isdigit():
            children[parent].add(int(last))
    return {p: len(idx) for p, idx in children.items() if idx == set(range(len(idx)))}


def find_stacks(trace: StepTrace, n: int) -> list[str]:
    """Paths of ModuleLists with exactly ``n`` numbered children, the outermost where one lies in a block of
    another: a block's own ``Sequential`` of ``n`` modules (Linear, GELU, Linear, Dropout at the probe's
    L = 4) is part of the block, not a stack of its own. A list inside a block that does repeat L times too
    (L * L modules) is then one of the block's parts, which the model given holds another number of: refused
    as another model than the probe's (``tests/test_layer_field.py``)."""
    found = sorted(p for p, count in repeated(trace.module_names).items() if count == n)
    return [p for p in found if block_of(p, [q for q in found if q != p]) is None]


def block_of(module: str, stacks: list[str]) -> tuple[str, int] | None:
    """``(stack, i)`` when the module path lies in block i of a stack ('blocks.3.attn' -> ('blocks', 3))."""
    for p in stacks:
        prefix = p + "." if p else ""
        if module.startswith(prefix):
            head = module[len(prefix) :].split(".", 1)[0]
            if head.isdigit():
                return p, int(head)
    return None


def generic_path(module: str, stacks: list[str]) -> str:
    """'blocks.3.attn' -> 'blocks.*.attn' for modules inside a factored stack."""
    for p in stacks:
        prefix = p + "."
        if module.startswith(prefix):
            head, _, rest = module[len(prefix) :].partition(".")
            if head.isdigit():
                return f"{p}.*" + (f".{rest}" if rest else "")
    return module


def op_blocks(
    ops: list[Any], stacks: list[str], zipped: set[frozenset[str]] | None = None
) -> list[tuple[str, int] | None]:
    """The layer-stack block ``(stack, i)`` each op belongs to, or None outside every block.

    An op belongs to the block whose module path it runs in, and so does an op
    outside every block that runs between block i-1 and block i of a stack (in
    the forward, or between i and i-1 in the backward's reverse order), in the
    same phase: the loop's own per-iteration work, such as the two empty
    tensors that ``torch.utils.checkpoint`` makes per call in torch 2.11; or
    between two ops of block i (the loop calls the block twice, with work in
    between: ``F.normalize(blk(h)) * blk(h)``). Stacks zipped in one loop
    (``for attn, mlp in zip(self.attns, self.mlps): h = h + attn(h); h = h +
    mlp(h)``; ``zipped_stacks``, or ``zipped`` where another trace tells) alike:
    the residual add between block i of one and block i or i + 1 of the other
    belongs to the one of the larger index, of two equal to the stack whose
    name sorts last. Between stacks run one after the other (an encoder's last
    block, then a decoder's first) an op belongs to neither.
    """
    own = [block_of(rec.module, stacks) for rec in ops]
    out = list(own)
    if zipped is None:
        zipped = _zipped(ops, own)
    prev: tuple[tuple[str, int], int] | None = None  # (block, position) of the last op in a block
    for pos, b in enumerate(own):
        if b is None:
            continue
        if (
            prev is not None
            and (prev[0][0] == b[0] or frozenset((prev[0][0], b[0])) in zipped)  # one stack, or two zipped
            and abs(prev[0][1] - b[1]) <= 1
        ):
            later = max(prev[0], b, key=lambda blk: (blk[1], blk[0]))
            for j in range(prev[1] + 1, pos):
                if ops[j].phase == ops[pos].phase == ops[prev[1]].phase:
                    out[j] = later
        prev = (b, pos)
    return out


def zipped_stacks(ops: list[Any], stacks: list[str]) -> set[frozenset[str]]:
    """The pairs of stacks zipped in one loop in a trace (``op_blocks``): read off a trace of two blocks or more,
    as a model of one block runs its stacks' blocks one after the other either way."""
    return _zipped(ops, [block_of(rec.module, stacks) for rec in ops])


def _zipped(ops: list[Any], own: list[tuple[str, int] | None]) -> set[frozenset[str]]:
    """The pairs of stacks zipped in one loop: their blocks interleave in the forward (the span of one stack's
    ops overlaps the other's). Stacks run one after the other (an encoder's, then a decoder's) do not, at any
    number of blocks: an op between the first's last block and the second's first belongs to neither."""
    span: dict[str, list[int]] = {}
    for pos, (rec, b) in enumerate(zip(ops, own, strict=True)):
        if b is not None and rec.phase == "forward":
            span.setdefault(b[0], [pos, pos])[1] = pos
    names = sorted(span)
    return {
        frozenset((a, c))
        for i, a in enumerate(names)
        for c in names[i + 1 :]
        if span[a][0] < span[c][1] and span[c][0] < span[a][1]
    }


def differing_ends(blocks: list[tuple[str, int] | None], counts: Iterable[Any]) -> tuple[bool, bool]:
    """Whether the factored stack's first block and its last differ from the others (``factor``: an op of
    such a block has a count of its own, 1; the others' ops of it 0), read off each op's block and count."""
    n = 1 + max((b[1] for b in blocks if b is not None), default=0)
    counted = {b[1] for b, c in zip(blocks, counts, strict=True) if b is not None and c != 0}
    return 0 in counted and n > 1, n - 1 in counted and n > 2


def stage_share(block: int, count: Any, first: bool, last: bool, ends: tuple[bool, bool]) -> Any:
    """How many times a pipeline rank runs a layer-stack op (of probe block ``block``) that runs ``count``
    times in the whole model, the rank holding ``L / pp`` blocks (``first``: block 0 among them, ``last``: block
    L - 1). The stack is ``first + (L - f - l) * block + last`` (``factor``; ``ends``: f, l, ``differing_ends``):
    a block-1 op runs L / pp times, less once on the rank holding a first block that differs and on the one
    holding a last block that differs; an op of a block that differs only on its own rank."""
    L = sym("L")
    count = sympy.sympify(count)
    if L not in count.free_symbols:
        return count if (first if block == 0 else last) else sympy.Integer(0)
    per = sympy.diff(count, L)
    return sympy.expand(per * (L / sym("pp") - int(ends[0] and first) - int(ends[1] and last)))


def first_block_own(ops: list[Any], stacks: list[str]) -> set[int]:
    """The ops of block 0 of each stack with no counterpart in block 1 (a first block that differs: a
    sequence-parallel plan's conversion of the stack's input, run by block 0's input hook, and its backward):
    what only the pipeline stage holding block 0 runs. Matched per phase by op and relative module, in
    order (``difflib``'s longest matching runs)."""
    blocks = op_blocks(ops, stacks)
    own: set[int] = set()
    for p in stacks:
        if (p, 1) not in blocks:  # one block: nothing to tell it from
            continue
        for phase in {rec.phase for rec in ops}:
            ids = {i: [t for t, b in enumerate(blocks) if b == (p, i) and ops[t].phase == phase] for i in (0, 1)}
            keys = {i: [(str(ops[t].op), _relative(ops[t].module, p, i)) for t in ids[i]] for i in (0, 1)}
            matcher = difflib.SequenceMatcher(None, keys[0], keys[1], autojunk=False)
            matched = {a + k for a, _b, size in matcher.get_matching_blocks() for k in range(size)}
            own |= {t for j, t in enumerate(ids[0]) if j not in matched}
    return own


def _relative(module: str, stack: str, i: int) -> str:
    prefix = f"{stack}.{i}" if stack else str(i)
    return module[len(prefix) :]


def _signature(ops: list[CostedOp], trace: StepTrace, stack: str, i: int) -> list[tuple[Any, ...]]:
    sig = []
    for c in ops:
        r = c.rec
        sig.append(
            (
                str(r.op),
                r.phase,
                _relative(r.module, stack, i),
                tuple(t.shape for t in c.call.outputs),
                tuple(getattr(c.cost, m) for m in METRICS),
                any(t.storage in trace.saved_storages for t in r.outputs),
            )
        )
    return sig


def factor(
    trace: StepTrace, costed: list[CostedOp], stacks: list[str], n: int
) -> tuple[list[sympy.Expr], dict[str, sympy.Expr], list[str], int] | None:
    """Multiplicity of every node and parameter, from ``n`` probe blocks per stack.

    The middle blocks (1 .. n-2) must be identical; the first and the last may
    differ (a first layer whose input needs no gradient, a last layer that
    feeds the head): ``first + (L-2)*block + last``, or ``L*block`` when all
    agree. Returns None when the middle blocks differ; the int is the least L
    for which the formula holds.
    """
    L = sym("L")
    zero, one = sympy.Integer(0), sympy.Integer(1)
    blocks = op_blocks(trace.ops, stacks)
    per_block: dict[tuple[str, int], list[CostedOp]] = defaultdict(list)
    for c in costed:
        b = blocks[c.rec.index]
        if b is not None:
            per_block[b].append(c)
    block_count: dict[tuple[str, int], sympy.Expr] = {}
    notes = []
    min_layers = 1
    for p in stacks:
        sigs = [_signature(per_block[(p, i)], trace, p, i) for i in range(n)]
        if any(sigs[i] != sigs[1] for i in range(2, n - 1)):
            return None
        first, last = sigs[0] != sigs[1], sigs[n - 1] != sigs[1]
        count = {i: zero for i in range(n)}
        count[1] = L - int(first) - int(last)
        if first:
            count[0] = one
        if last:
            count[n - 1] = one
        block_count.update({(p, i): c for i, c in count.items()})
        min_layers = max(min_layers, int(first) + int(last))
        name = p or "<root>"
        shape = " + ".join(
            ([f"{name}.0"] if first else []) + [f"({count[1]}) * {name}.1"] + ([f"{name}.{n - 1}"] if last else [])
        )
        notes.append(f"{name}: layer stack factored as {shape}" + (" (L >= 2)" if first and last else ""))
    counts = []
    for c in costed:
        b = blocks[c.rec.index]
        counts.append(block_count[b] if b is not None else one)
    param_counts = {}
    for ph in trace.placeholders:
        b = block_of(ph.name.rpartition(".")[0], stacks)
        param_counts[ph.name] = block_count[b] if b is not None else one
    return counts, param_counts, notes, min_layers


DROP = 2  # the middle block of the trace with one block more that ``align_layers`` leaves out


def align_layers(base: StepTrace, other: StepTrace, stacks: list[str], layers: int) -> list[int] | None:
    """Map each op of ``base`` (``layers`` blocks) to ``other`` (one more) by removing a middle block
    (its ops as ``op_blocks`` assigns them)."""
    kept = [rec for rec, b in zip(other.ops, op_blocks(other.ops, stacks)) if b is None or b[1] != DROP]
    if len(kept) != len(base.ops) or any(str(a.op) != str(b.op) for a, b in zip(base.ops, kept)):
        return None
    return [rec.index for rec in kept]


def one_block_less(name: str, stacks: list[str]) -> str:
    """A parameter's name in the trace with one block less: the blocks after the dropped one move down one,
    the dropped one stands for block 1 (``align_layers``)."""
    for p in stacks:
        prefix = p + "." if p else ""
        if name.startswith(prefix):
            head, dot, rest = name[len(prefix) :].partition(".")
            if head.isdigit():
                i = int(head)
                i = 1 if i == DROP else i - 1 if i > DROP else i
                return f"{prefix}{i}{dot}{rest}"
    return name
