"""Serving on one device: the KV cache, time to first token, decode time per token, what fits.

Conventions (docs/serving.md):

- ``context`` is the sequence length when the last token is generated; the figures are the worst case
  at that length: the prompt is ``prompt`` tokens (by default ``context - 1``: the longest prefill), and
  the decode step is the last one, with ``C = context - 1`` positions cached before it.
- Times are the per-op roofline of the derived step (``symacct.time.model.roofline``): every op takes
  ``max(FLOPs / peak, bytes / bandwidth)``, no fusion, no overlap, no kernel launch cost.
- Time to first token: the prefill of the prompt for ``batch`` sequences. Decode: one step, one new token
  for each of ``batch`` sequences; tokens/s = batch / step time.
- The decode step is memory-bound while its bytes over the bandwidth exceed its FLOPs over the peaks
  (the step's totals, each FLOP at the peak of its kind); ``compute_bound_batch`` is the least batch where
  that turns (at ``context``), found on the exact totals by doubling and bisection.
- What fits: the exact peak of the decode step (weights, the cache before and after the step, the
  step's working set) against the device's capacity times (1 - reserve); the longest prompt that fits is
  the longest whose prefill, one prompt at once and whole, fits the same budget (a longer one needs a
  prefill in chunks, which is not the traced step).
- Weight-only quantization (``weight_bits=8`` or ``4``) is a re-pricing, not a trace: every ``nn.Linear``
  weight is held and read at ``bits / 8 + scale_bytes / group_size`` bytes a weight (symmetric, one scale a
  group of ``group_size`` weights along a row); the ops that read a weight (through its views) read that
  many bytes, the weights' bytes and the peak (weights live through the whole step) drop by the
  difference. Embeddings, norms and biases keep their dtype; dequantization is taken as fused into the
  matmul (no extra bytes, no extra FLOPs), as weight-only kernels do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import networkx as nx
import sympy
import torch

from symacct.cost.graph import records
from symacct.errors import SymacctError
from symacct.formula import text
from symacct.symbols import evaluate, sym
from symacct.time.hardware import Accelerator, get
from symacct.time.model import DEFAULT_RESERVE, _peak, bounded_by_table, fit, roofline, step_dtype
from symacct.time.model import most as largest

if TYPE_CHECKING:
    from symacct.accounting import Accounting


@dataclass
class Serving:
    """The serving figures at one (batch, context) on one device (see the module docstring)."""

    hardware: str
    batch: int
    context: int
    prompt: int
    weights_bytes: int
    cache_bytes: int  # the KV cache after the last decode step (context positions, batch sequences)
    cache_bytes_per_token: int  # a position of one sequence
    cache_formula: str  # bytes a position, derived
    textbook_bytes_per_token: int  # 2 * L * H_kv * d_head * itemsize (keys and values, every layer): compared
    peak_bytes: int  # the decode step's peak
    prefill_peak_bytes: int  # the prefill's peak: the batch's prompts at once, as the time to first token is
    ttft_seconds: float  # the prefill of the prompt
    decode_seconds: float  # the last decode step
    tokens_per_second: float  # batch / decode_seconds
    tokens_per_second_per_sequence: float  # 1 / decode_seconds
    decode_bound: str  # 'memory' or 'compute'
    compute_bound_batch: int | None  # least batch where the decode step turns compute-bound at this context
    max_batch: int | None  # the largest batch whose decode step fits at this context
    max_context: int | None  # the longest context whose decode step fits at this batch
    max_prompt: int | None = None  # the longest prompt whose prefill fits, one prompt, whole (no chunks)
    notes: list[str] = field(default_factory=list)
    decode_traffic: dict[str, int] = field(default_factory=dict)  # the last decode step's bytes (Traffic)
    weight_bits: int | None = None  # weight-only quantization (re-priced), None: the weights' own dtype
    bytes_per_weight: float | None = None  # of a quantized linear weight, its scale's share included


@dataclass(frozen=True)
class Quantized:
    """A decode (or prefill) accounting with its linear weights re-priced (see the module docstring)."""

    acct: Accounting  # graph re-priced, memory.params and memory.peak's formula shifted
    bytes_per_weight: sympy.Rational
    saved: sympy.Expr  # bytes the weights shrink by (weights and peak), a formula
    weights: list[str]  # the parameters re-priced


def quantize(acct: Accounting, bits: int, *, group_size: int = 128, scale_bytes: int = 2) -> Quantized:
    """Re-price every nn.Linear weight at ``bits`` a weight plus one ``scale_bytes`` scale a group."""
    if bits not in (4, 8):
        raise SymacctError(f"weight_bits={bits!r}: weight-only quantization takes 8 or 4 bits", hint="use 8 or 4")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise SymacctError(f"group_size must be a positive integer, got {group_size!r}", hint="e.g. 128")
    if acct.step is None:
        raise SymacctError("this accounting keeps no trace of its modules", hint="quantize a derive() result")
    if acct.options.get("step") not in ("prefill", "decode", "forward"):
        raise SymacctError(
            "weight-only quantization is for inference steps", hint="derive with step='prefill' or 'decode'"
        )
    bpw = sympy.Rational(bits, 8) + sympy.Rational(scale_bytes, group_size)
    g = acct.graph
    types = acct.step.module_types
    new = nx.DiGraph(g)
    saved = sympy.Integer(0)
    names = []
    cuts: list[tuple[Any, Any]] = []  # (reader's record, bytes it reads less a call)
    for key, node in records(g):
        if node.op != "param" or len(node.shapes[0]) != 2 or types.get(node.module) != "Linear":
            continue
        numel = node.shapes[0][0] * node.shapes[0][1]
        itemsize = _itemsize(node.dtypes[0])
        cut = numel * (itemsize - bpw)
        names.append(str(key).removeprefix("param:"))
        for reader in _readers(g, key):
            r = new.nodes[reader]["node"]
            new.nodes[reader]["node"] = dataclasses.replace(
                r, cost=dataclasses.replace(r.cost, bytes_read=r.cost.bytes_read - cut)
            )
            saved += cut * r.count
            cuts.append((r, cut))
    saved = sympy.expand(saved)
    memory = dataclasses.replace(
        acct.memory, params=sympy.expand(acct.memory.params - saved), peak=sympy.expand(acct.memory.peak - saved)
    )
    live = _Shifted(acct.liveness, saved) if acct.liveness is not None else None
    out = dataclasses.replace(
        acct,
        graph=new,
        memory=memory,
        liveness=live,
        options={**acct.options, "weight_bits": bits},
        **_rebased(acct, cuts),
    )
    return Quantized(out, bpw, saved, sorted(names))


def _rebased(acct: Accounting, cuts: list[tuple[Any, Any]]) -> dict[str, Any]:
    """The byte totals and breakdowns (per phase, module, component, layer) with the readers' cuts taken off,
    as ``aggregate`` adds them: a cut times its node's count, per layer without the count."""
    L = sym("L")
    by_phase: dict[str, Any] = {}
    modules = {k: dict(v) for k, v in acct.modules.items()}
    comps = {k: dict(v) for k, v in acct.components.items()}
    layers = {k: dict(v) for k, v in acct.per_layer.items()}
    for r, cut in cuts:
        if r.count == 0:
            continue
        by_phase[r.phase] = by_phase.get(r.phase, 0) + cut * r.count
        modules[r.generic]["bytes_read"] -= cut * r.count
        comps[r.component]["bytes_read"] -= cut * r.count
        if r.generic != r.module and sympy.sympify(r.count).has(L):
            stack = next(p for p in layers if r.module.startswith(p + "."))
            layers[stack]["bytes_read"] -= cut
    total = sympy.expand(sum(by_phase.values(), sympy.Integer(0)))
    b = acct.bytes
    fields = {"read": sympy.expand(b.read - total)}
    for ph in ("forward", "backward"):
        if ph in by_phase:
            fields[f"read_{ph}"] = sympy.expand(getattr(b, f"read_{ph}") - by_phase[ph])

    def tidy(d: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        return {k: {m: sympy.expand(v) for m, v in inner.items()} for k, inner in d.items()}

    return {
        "bytes": dataclasses.replace(b, **fields),
        "modules": tidy(modules),
        "components": tidy(comps),
        "per_layer": tidy(layers),
    }


class _Shifted:
    """A liveness whose every point holds ``saved`` bytes less: the weights, live through the whole step,
    held smaller. ``at``, ``peak`` and ``sweep`` read it as the original (its exact evaluation, shifted)."""

    def __init__(self, base: Any, saved: sympy.Expr) -> None:
        self.base, self.saved = base, saved

    def evaluate(self, values: dict[str, Any]) -> tuple[Any, int]:
        from symacct.symbols import evaluate

        peak, t = self.base.evaluate(values)
        return peak - evaluate(self.saved, values), t

    def __getattr__(self, name: str) -> Any:
        if name == "steady":
            raise AttributeError("an inference step has no steady state (no optimizer)")
        return getattr(self.base, name)


def _is_view(op: str) -> bool:
    """Whether a node's op (``aten.t.default``) is one the rules cost as a view (memory_ops.view)."""
    from symacct.cost.rules import lookup
    from symacct.cost.rules.memory_ops import view

    namespace, name, overload = op.split(".")
    packet = getattr(getattr(torch.ops, namespace, None), name, None)
    return packet is not None and lookup(getattr(packet, overload)) is view


def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype.removeprefix("torch.")).itemsize


def _readers(g: nx.DiGraph, key: Any) -> list[Any]:
    """The ops that read a parameter's data: its consumers, through views."""
    out, todo, seen = [], list(g.successors(key)), set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if _is_view(g.nodes[n]["node"].op):
            todo.extend(g.successors(n))
        else:
            out.append(n)
    return sorted(out)


@dataclass(frozen=True)
class Traffic:
    """Where a serving step's bytes go, as formulas: the weights and the cache read, the cache written (a
    concatenating cache writes all of it again), and the rest (activations)."""

    weights_read: sympy.Expr
    cache_read: sympy.Expr
    cache_written: sympy.Expr
    other_read: sympy.Expr
    other_written: sympy.Expr


def traffic(acct: Accounting) -> Traffic:
    """Split a prefill or decode step's bytes read and written (see :class:`Traffic`): a parameter's or an
    incoming cache tensor's bytes are counted at the ops that read it whole, through its views (an
    embedding lookup reads only its rows: those stay with the rest); the cache written is what the ops that
    make the cache's final storages write."""
    if acct.step is None or acct.options.get("step") not in ("prefill", "decode"):
        raise SymacctError("traffic() splits a prefill or decode step", hint="derive with step='decode'")
    g = acct.graph
    weights = cache = sympy.Integer(0)
    for key, node in records(g):
        kind = node.op
        if kind not in ("param", "input") or (kind == "input" and not str(key).startswith("input:cache")):
            continue
        nbytes = _itemsize(node.dtypes[0])
        for d in node.shapes[0]:
            nbytes = nbytes * d
        readers = [g.nodes[r]["node"] for r in _readers(g, key)]
        # a lookup reads the rows it gathers, not the table: left with the activations
        read = sum((nbytes * r.count for r in readers if not r.op.startswith("aten.embedding")), sympy.Integer(0))
        if kind == "param":
            weights += read
        else:
            cache += read
    written = sympy.Integer(0)
    makers = {acct.step.storage_producer.get(st) for st in acct.step.cache_storages} - {None}
    for index in makers:
        node = g.nodes[index]["node"]
        written += node.cost.bytes_written * node.count
    weights, cache, written = (sympy.expand(x) for x in (weights, cache, written))
    return Traffic(
        weights,
        cache,
        written,
        sympy.expand(acct.bytes.read - weights - cache),
        sympy.expand(acct.bytes.written - written),
    )


def _per_token(acct: Accounting) -> sympy.Expr:
    """The cache bytes a position of one sequence: kv_cache / (B * (C + 1)), as a formula."""
    B, C = sym("B"), sym("C")
    return sympy.factor(sympy.simplify(acct.memory.kv_cache / (B * (C + 1))))


def textbook_bytes_per_token(decode: Accounting) -> int:
    """2 * L * H_kv * d_head * itemsize, from the model's own sizes and the step's dtype (the hand formula the
    derived figure is compared with; H_kv = H without grouped-query attention, d_head = D / H; the bytes of
    the cache's dtype, else the parameters')."""
    from symacct.options import CACHE_DTYPES, torch_dtype

    v = decode.with_defaults()
    L, H, D = v.get("L", 1), v["H"], v["D"]
    held = decode.options.get("cache_dtype") or decode.options.get("params_dtype")
    dtype = torch_dtype("cache_dtype", held, names=CACHE_DTYPES) or torch.float32
    return 2 * L * v.get("H_kv", H) * (D // H) * dtype.itemsize


def _split_time(acct: Accounting, hw: Accelerator, matmul: str, **sizes: int) -> tuple[float, float]:
    """(compute seconds, memory seconds) of a step's totals: matmul FLOPs at the ``matmul`` dtype's peak, other
    FLOPs at the vector (fp32) peak, bytes read and written at the bandwidth; the formulas evaluated alone
    (the batch search calls this often: no evaluation of the whole graph)."""
    values = acct.with_defaults(**sizes)
    compute = evaluate(acct.flops.total, values) / _peak(hw, matmul, "the decode step")
    other = evaluate(acct.flops.other, values)
    if other:
        compute += other / _peak(hw, "fp32", "elementwise work")
    return compute, evaluate(acct.bytes.read + acct.bytes.written, values) / hw.bandwidth


# options that must agree between the two steps of one served model (the weights, the cache, the kernels, the
# ranks); the step itself differs, and so may options that only shape a report (embedding_flops, causal_discount)
_SAME_SERVING = (
    "params_dtype",
    "autocast",
    "cache_dtype",
    "device",
    "hardware",
    "sdpa_backend",
    "without_gpu",
    "tensor_parallel",
    "context_parallel",
)


def _same_model(prefill: Accounting, decode: Accounting) -> None:
    """Refuse a prefill and a decode derived from different models: other sizes, other parameters, or options
    that change the weights, the cache or the kernels (each figure of serve() mixes the two steps)."""
    if prefill.values is not None or decode.values is not None:
        raise SymacctError("serve needs the formulas: pass the results of derive, not of at()")
    differ = [k for k in _SAME_SERVING if prefill.options.get(k) != decode.options.get(k)]
    sizes = {k: (v, decode.symbols.get(k)) for k, v in prefill.symbols.items() if decode.symbols.get(k) != v}
    sizes |= {k: (None, v) for k, v in decode.symbols.items() if k not in prefill.symbols}

    def params(acct: Accounting) -> list[tuple[str, tuple[Any, ...], Any, Any]]:
        return [(r.name, tuple(r.shape), r.itemsize, r.count) for r in acct.memory.tensors]

    if differ or sizes or params(prefill) != params(decode):
        pairs = [f"{k}={prefill.options.get(k)!r} and {decode.options.get(k)!r}" for k in differ]
        what = (
            f"options differ: {', '.join(pairs)}"
            if differ
            else f"sizes differ: {', '.join(f'{k}={a} and {b}' for k, (a, b) in sizes.items())}"
            if sizes
            else "their parameters differ"
        )
        raise SymacctError(
            f"the prefill and decode accountings are not of the same model ({what})",
            hint="derive both steps from the same model with the same options: derive(model, step='prefill', ...) "
            "and derive(model, step='decode', ...)",
        )


def serve(
    prefill: Accounting,
    decode: Accounting,
    *,
    hardware: str | Accelerator,
    context: int,
    batch: int = 1,
    prompt: int | None = None,
    reserve: float = DEFAULT_RESERVE,
    weight_bits: int | None = None,
    group_size: int = 128,
) -> Serving:
    """The serving figures (module docstring) from a derived prefill and decode step of the same model."""
    if prefill.options.get("step") != "prefill" or decode.options.get("step") != "decode":
        raise SymacctError(
            "serve needs a prefill and a decode accounting",
            hint="derive(model, step='prefill') and derive(model, step='decode')",
        )
    _same_model(prefill, decode)
    for name, v in (("context", context), ("batch", batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise SymacctError(f"{name} must be a positive integer, got {v!r}")
    if context < 2:
        raise SymacctError("context must be at least 2 (a prompt token and a generated one)")
    prompt = context - 1 if prompt is None else prompt
    if isinstance(prompt, bool) or not isinstance(prompt, int) or not 1 <= prompt < context:
        raise SymacctError(f"prompt must be in [1, context), got {prompt!r}", hint="the tokens before the first one")
    hw = get(hardware)
    bpw = None
    if weight_bits is not None:
        q = quantize(decode, weight_bits, group_size=group_size)
        decode, prefill, bpw = q.acct, quantize(prefill, weight_bits, group_size=group_size).acct, q.bytes_per_weight
    C = context - 1
    at = decode.at(B=batch, C=C)
    step = roofline(decode, hw, B=batch, C=C)
    first = roofline(prefill, hw, B=batch, S=prompt)
    matmul = step_dtype(at)
    compute, memory = _split_time(decode, hw, matmul, B=batch, C=C)
    per_token = _per_token(decode)
    sizes = decode.with_defaults(B=batch, C=C)
    split = {k: int(evaluate(v, sizes)) for k, v in dataclasses.asdict(traffic(decode)).items()}
    notes = []

    def turns(b: int) -> bool:
        c, m = _split_time(decode, hw, matmul, B=b, C=C)
        return c >= m

    bound_batch: int | None = None
    most_batch = largest(decode, "B") or 1 << 20  # the largest batch the formulas hold at (a bound)
    hi = 1
    while not turns(hi) and hi < most_batch:
        hi = min(hi * 2, most_batch)
    if turns(hi):
        lo = hi // 2 if hi > 1 else 0  # turns(lo) is false (or lo = 0)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if turns(mid):
                hi = mid
            else:
                lo = mid
        bound_batch = hi
    elif most_batch < 1 << 20:
        notes.append(
            f"the decode step stays memory-bound up to a batch of {most_batch} at this context, the largest the "
            "formulas hold at (the model takes another path past it)"
        )
    else:
        notes.append("the decode step stays memory-bound up to a batch of 2^20 at this context")
    max_batch = max_context = None
    try:
        fitted = fit(decode, "B", hardware=hw, reserve=reserve, C=C)
        max_batch = fitted.value
        notes += [f"batch: {n}" for n in fitted.notes]
    except SymacctError as e:
        notes.append(f"batch: {e.what}")
    budget = int(hw.memory_bytes * (1 - reserve))
    if at.memory.peak > budget:  # the decode figures at this batch are of a step the device cannot hold
        notes.append(
            f"decode: batch {batch} at context {context} peaks at {at.memory.peak / 1e9:.1f} GB, beyond the "
            f"{budget / 1e9:.1f} GB budget, so the decode step's figures are of a step this device cannot hold"
            + (f" (the largest batch that fits: {max_batch})" if max_batch else "")
        )
    smax = decode.symbols.get("S_max")
    top_prompt = smax or 1 << 24
    prompt_from = _least(lambda p: _uncovered(prefill, B=1, S=p) is None, top_prompt)  # a window's far side: from w + 1
    max_prompt = None
    if prompt_from is not None:
        max_prompt = _longest(
            lambda p: _uncovered(prefill, B=1, S=p) is None and prefill.peak(B=1, S=p) <= budget,
            top_prompt,
            prompt_from,
        )
    prefill_peak = prefill.peak(B=batch, S=prompt)
    if prefill_peak > budget:  # the time to first token is of the whole batch's prefill: say when it cannot run
        if batch == 1:
            what, most = f"the prompt of {prompt} tokens", "prefill it in chunks"
        else:
            try:
                n = fit(prefill, "B", hardware=hw, reserve=reserve, S=prompt).value
                most = f"at most {n} of them fit at once: prefill them in groups, or in chunks of the prompt"
            except SymacctError:
                most = "not even one fits at once: prefill in chunks of the prompt"
            what = f"the {batch} prompts of {prompt} tokens at once"
        notes.append(
            f"prefill: {what} peak{'s' if batch == 1 else ''} at {prefill_peak / 1e9:.1f} GB, beyond the "
            f"{budget / 1e9:.1f} GB budget, so the time to first token is of a step this device cannot hold "
            f"({most}; the longest prompt prefilled whole: {max_prompt or 'none'})"
        )
    top = smax - 1 if smax else 1 << 24  # the most positions the model can cache before a step

    def uncovered(c: int) -> str | None:
        return _uncovered(decode, B=batch, C=c)

    def fits(c: int) -> bool:
        return uncovered(c) is None and decode.peak(B=batch, C=c) <= budget

    context_from = _least(lambda c: uncovered(c) is None, top)  # a window's far side: from w cached positions
    lo = _longest(fits, top, context_from) if context_from is not None else None
    if lo is not None:
        max_context = lo + 1
        if lo == top and smax:
            notes.append(
                f"context: the position table bounds it (S_max = {smax}), not the memory"
                if bounded_by_table(decode)
                else f"context: {decode.fields.get('S_max', 'S_max')} (S_max = {smax}) bounds it, the longest "
                "sequence the model was made for and a serving engine's default limit, not the memory (the model "
                "has no table of positions: its step would run beyond it)"
            )
        elif lo < top and (why := uncovered(lo + 1)) is not None:
            notes.append(f"context: the derivation bounds it, not the memory ({why})")
        if prompt_from is not None and (max_prompt or 0) < lo:  # a prompt of lo tokens, one generated
            longer = f"more than {max_prompt}" if max_prompt else f"{prompt_from} or more"
            notes.append(
                f"context: a prompt of {longer} tokens does not fit prefilled whole (one prompt), so the longest "
                f"context, {max_context}, is the decode step's: its prompt prefilled in chunks"
            )
    elif context_from is None:
        notes.append(f"context: the derivation holds at no context up to {top + 1} ({uncovered(top)})")
    else:
        least = "one cached position" if context_from == 1 else f"{context_from} cached positions, the fewest derived,"
        notes.append(f"context: not even {least} fit{'s' if context_from == 1 else ''} at this batch")
    return Serving(
        hardware=hw.name,
        batch=batch,
        context=context,
        prompt=prompt,
        weights_bytes=int(at.memory.params),
        cache_bytes=int(at.memory.kv_cache),
        cache_bytes_per_token=int(at.memory.kv_cache) // (batch * context),
        cache_formula=text(per_token),
        textbook_bytes_per_token=textbook_bytes_per_token(decode),
        peak_bytes=int(at.memory.peak),
        prefill_peak_bytes=int(prefill_peak),
        ttft_seconds=first.seconds,
        decode_seconds=step.seconds,
        tokens_per_second=batch / step.seconds,
        tokens_per_second_per_sequence=1 / step.seconds,
        decode_bound="compute" if compute >= memory else "memory",
        compute_bound_batch=bound_batch,
        max_batch=max_batch,
        max_context=max_context,
        max_prompt=max_prompt,
        notes=notes,
        decode_traffic=split,
        weight_bits=weight_bits,
        bytes_per_weight=float(bpw) if bpw is not None else None,
    )


def _uncovered(acct: Accounting, **sizes: int) -> str | None:
    """Why the derivation does not hold at these sizes (a sliding window's path: not beyond its window), or
    None where it holds."""
    try:
        acct.values_at(**sizes)
    except SymacctError as e:
        return e.what
    return None


def _least(ok: Callable[[int], bool], top: int) -> int | None:
    """The least n in [1, top] with ok(n), ok being false below some n and true from it (bisection); None when
    ok(top) is false. Where the derivation holds: from 1, or beyond a sliding window."""
    if ok(1):
        return 1
    if not ok(top):
        return None
    lo, hi = 1, top
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def _longest(ok: Callable[[int], bool], top: int, start: int = 1) -> int | None:
    """The largest n in [start, top] with ok(n), ok being true from start up to some n and false beyond
    (doubling, then bisection); None when ok(start) is false."""
    if not ok(start):
        return None
    lo, hi = start, 2 * start
    while hi <= top and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, top + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def as_dict(s: Serving) -> dict[str, Any]:
    """JSON-ready (the CLI's --json)."""
    from dataclasses import asdict

    return asdict(s)
