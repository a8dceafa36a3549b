"""Time and capacity: training-time estimates, MFU, per-op roofline, and what fits.

Every function says which formula it used (``formula`` in its result).

- ``estimate``: the 6ND rule, ``seconds = 6 * N * tokens / (peak * mfu * gpus)``.
- ``train_time``: the same with the step's FLOPs derived from the model:
  ``seconds = flops.total(B, S) * (tokens / (B*S)) / (peak * mfu * gpus)``.
- ``mfu``: ``flops / (seconds * peak * gpus)``.
- ``roofline``: every node of the graph takes ``max(flops / peak, bytes /
  bandwidth)``; matmul FLOPs against the tensor-core peak of the node's
  dtype, other FLOPs against the fp32 (vector) peak; summed with the node's
  multiplicity per phase and per module, with the MFU it implies.
- ``fit_*``: the largest batch, sequence, layer count (or any one symbol)
  whose derived peak fits ``capacity * gpus_per_replica * (1 - reserve)``,
  re-checked exactly with ``acct.at`` (and the next size up must not fit);
  ``max_params`` for the bare bytes-per-parameter rule.

GB = 10**9 bytes throughout (see ``symacct.time.hardware``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from symacct.cost.graph import records
from symacct.cost.layers import generic_path
from symacct.errors import SymacctError
from symacct.options import DTYPES, dtype_key
from symacct.time.hardware import Accelerator, get

if TYPE_CHECKING:
    from symacct.accounting import Accounting

DAY = 86400.0
DEFAULT_RESERVE = 0.15  # CUDA context, allocator slack, library workspaces: the seed's 15-20 %


def _check_mfu(mfu: float) -> None:
    if not isinstance(mfu, (int, float)) or isinstance(mfu, bool) or not math.isfinite(mfu) or not 0 < mfu <= 1:
        raise SymacctError(f"MFU must be in (0, 1], got {mfu!r}", hint="MFU is a fraction of the peak, e.g. 0.5")


def _check_positive(**values: Any) -> None:
    """Each value a finite positive number (NaN and infinity refused: they would print as a figure)."""
    for k, v in values.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            raise SymacctError(f"{k} must be a finite positive number, got {v!r}", hint=f"pass a positive {k}")


def check_gpus(gpus: Any) -> int:
    """The one rule for device counts, in Python and on the command line: a positive whole number.

    ``gpus=1.5`` is refused, not truncated: half a device is not a data-parallel replica.
    """
    if isinstance(gpus, bool) or not isinstance(gpus, (int, float)) or not math.isfinite(gpus):
        raise SymacctError(f"gpus must be a positive whole number, got {gpus!r}", hint="e.g. gpus=8")
    if gpus <= 0 or gpus != int(gpus):
        raise SymacctError(f"gpus must be a positive whole number, got {gpus!r}", hint="e.g. gpus=8")
    return int(gpus)


@dataclass
class Estimate:
    flops: float
    seconds: float
    days: float
    formula: str
    inputs: dict[str, Any] = field(default_factory=dict)


def estimate(
    *, params: float, tokens: float, hardware: str | Accelerator, gpus: int = 1, mfu: float = 0.5, dtype: str = "bf16"
) -> Estimate:
    """Training time from bare figures by the 6ND rule."""
    _check_positive(params=params, tokens=tokens)
    gpus = check_gpus(gpus)
    _check_mfu(mfu)
    hw = get(hardware)
    return _at_mfu(
        6.0 * params * tokens,
        hw,
        dtype,
        mfu,
        gpus,
        "seconds = 6 * N * tokens / (peak * MFU * gpus)",
        {"params": params, "tokens": tokens, "peak": hw.peak_flops(dtype)},
    )


def train_time(
    acct: Accounting,
    *,
    hardware: str | Accelerator,
    tokens: float,
    gpus: int = 1,
    mfu: float = 0.5,
    dtype: str = "bf16",
    **sizes: int,
) -> Estimate:
    """Training time with the step's matmul FLOPs derived from the model (sizes must give B and S)."""
    _check_positive(tokens=tokens)
    gpus = check_gpus(gpus)
    _check_mfu(mfu)
    hw = get(hardware)
    at = acct.at(**sizes)
    tokens_per_step = at.values.get("B", 1) * at.values.get("S", 1)
    return _at_mfu(
        at.flops.total * tokens / tokens_per_step,
        hw,
        dtype,
        mfu,
        gpus,
        "seconds = flops.total(B, S) * tokens / (B*S) / (peak * MFU * gpus)",
        {"tokens": tokens, "step_flops": at.flops.total, **at.values},
    )


def _at_mfu(
    flops: float, hw: Accelerator, dtype: str, mfu: float, gpus: int, formula: str, inputs: dict[str, Any]
) -> Estimate:
    """Seconds for ``flops`` on ``gpus`` accelerators at ``mfu`` of the dense ``dtype`` peak."""
    seconds = flops / (hw.peak_flops(dtype) * mfu * gpus)
    return Estimate(flops, seconds, seconds / DAY, formula, {**inputs, "hardware": hw.name, "gpus": gpus, "mfu": mfu})


def mfu(flops: float, seconds: float, hardware: str | Accelerator, gpus: int = 1, dtype: str = "bf16") -> float:
    """Model FLOPs utilisation of a measured step: flops / (seconds * peak * gpus).

    ``flops`` are model FLOPs of the whole step on all ``gpus`` (``acct.flops.total``:
    no recomputation); ``dtype`` names the peak the step runs at. A result above 1
    is impossible and refused, naming the likely cause.
    """
    _check_positive(flops=flops, seconds=seconds)
    gpus = check_gpus(gpus)
    hw = get(hardware)
    peak = hw.peak_flops(dtype)
    value = flops / (seconds * peak * gpus)
    if value > 1:
        raise SymacctError(
            f"MFU would be {value:.3g}, above 1: {flops:.4g} FLOPs in {seconds:.4g} s on {gpus} x {hw.name} "
            f"exceeds the {dtype} dense peak ({peak:.4g} FLOP/s each)",
            hint="check that flops are per step for all gpus (not summed over steps), that seconds are one step's, "
            "the gpus count, and the dtype of the peak (fp8 work against an fp8 peak)",
        )
    return value


@dataclass
class Roofline:
    seconds: float  # predicted step time on one device
    by_phase: dict[str, float]
    by_module: dict[str, float]
    memory_bound_seconds: float
    memory_bound: list[tuple[str, float]]  # (op in module, seconds), largest first
    mfu: float  # model FLOPs (flops.total, no recompute) / (seconds * peak of the step's dtype)
    graph: Any = None  # the evaluated graph (acct.at(...).graph)
    hfu: float = 0.0  # hardware FLOPs (flops.hardware: with recomputation) / (seconds * the same peak)
    dtype: str = "bf16"  # the catalog peak MFU and HFU are against (step_dtype)
    formula: str = "node seconds = max(flops / peak(dtype), bytes / bandwidth)"
    by_node: dict[Any, NodeTime] = field(default_factory=dict)  # graph node -> its time, one instance


@dataclass(frozen=True)
class NodeTime:
    """One op's roofline time for one call, and which side bounds it."""

    seconds: float
    bound: str  # 'compute' or 'memory'


def _dtype_key(dtypes: list[str], tf32: bool) -> str:
    """The catalog peak a matmul in these dtypes runs at; fp32 matmuls at tf32 only when ``tf32``."""
    d = dtypes[0] if dtypes else "torch.float32"
    key = dtype_key(d)
    key = key if key in DTYPES else "fp32"  # an integer matmul: the fp32 (vector) peak
    return "tf32" if key == "fp32" and tf32 else key


def _peak(hw: Accelerator, key: str, what: str) -> float:
    if key not in hw.peak or not hw.peak[key] > 0:
        raise SymacctError(
            f"{hw.name} has no {key} peak in the catalog, needed for {what}",
            hint=f"{hw.name} lists: {', '.join(sorted(hw.peak)) or 'nothing'}; add the figure with "
            "symacct.time.hardware.load, or choose other hardware",
        )
    return hw.peak[key] * 1e12


def step_dtype(acct: Accounting, *, tf32: bool = False) -> str:
    """The dtype (catalog key) of the step's matmul work: the one most matmul FLOPs run in.

    Compared at the evaluated sizes of an ``acct.at(...)`` copy, else at the
    model's own sizes with B = S = 1.
    """
    from symacct.symbols import evaluate

    by: dict[str, Any] = defaultdict(int)
    for _, a in records(acct.graph):
        if a.phase != "input" and a.cost.flops != 0:
            by[_dtype_key(a.dtypes, tf32)] += a.cost.flops * a.count
    if not by:
        return "tf32" if tf32 else "fp32"
    if acct.values is None:
        sizes = acct.with_defaults(B=1, S=1)
        by = {k: evaluate(v, sizes) for k, v in by.items()}
    return max(sorted(by), key=lambda k: by[k])


def roofline(acct: Accounting, hardware: str | Accelerator, *, tf32: bool = False, **sizes: int) -> Roofline:
    """Predicted step time from the per-op roofline (see the module docstring).

    A node's matmul FLOPs (with what its kernel recomputes) run at the dense
    peak of its dtype, its other FLOPs at the fp32 (vector) peak; a peak the
    catalog lacks is refused, never replaced by another dtype's. MFU is model
    FLOPs (``flops.total``) against the peak of the step's dtype
    (:func:`step_dtype`), HFU hardware FLOPs (``flops.hardware``) against the same.
    """
    hw = get(hardware)
    at = acct.at(**sizes)
    phase: dict[str, float] = defaultdict(float)
    module: dict[str, float] = defaultdict(float)
    mem_bound: dict[str, float] = defaultdict(float)
    stacks = [p for p in acct.per_layer]
    vector = None
    times: dict[Any, NodeTime] = {}
    for n, a in records(at.graph):
        if a.phase == "input":
            continue
        matmul = a.cost.flops + a.cost.flops_recompute
        compute = 0.0
        if matmul:
            compute += matmul / _peak(hw, _dtype_key(a.dtypes, tf32), f"{a.op} ({a.dtypes[0]})")
        if a.cost.flops_other:
            vector = vector or _peak(hw, "fp32", "elementwise work (the vector peak)")
            compute += a.cost.flops_other / vector
        memory = (a.cost.bytes_read + a.cost.bytes_written) / hw.bandwidth
        times[n] = NodeTime(max(compute, memory), "memory" if memory > compute else "compute")
        t = times[n].seconds * a.count
        phase[a.phase] += t
        module[generic_path(a.module, stacks)] += t
        if memory > compute and t > 0:
            mem_bound[f"{a.op} in '{generic_path(a.module, stacks)}'"] += t
    total = sum(phase.values())
    key = step_dtype(at, tf32=tf32)
    peak = _peak(hw, key, "MFU")
    return Roofline(
        total,
        dict(sorted(phase.items())),
        dict(sorted(module.items(), key=lambda kv: -kv[1])),
        sum(mem_bound.values()),
        sorted(mem_bound.items(), key=lambda kv: -kv[1])[:20],
        at.flops.total / (total * peak) if total else 0.0,
        at.graph,
        hfu=at.flops.hardware / (total * peak) if total else 0.0,
        dtype=key,
        by_node=times,
    )


def max_params(
    *, hardware: str | Accelerator, gpus: int = 1, bytes_per_param: float = 16, reserve: float = DEFAULT_RESERVE
) -> float:
    """The bare rule: params = capacity * gpus * (1 - reserve) / bytes_per_param (static memory only)."""
    _check_positive(gpus=gpus, bytes_per_param=bytes_per_param)
    if not 0 <= reserve < 1:
        raise SymacctError(f"reserve must be in [0, 1), got {reserve!r}", hint="e.g. --reserve 0.15")
    return get(hardware).memory_bytes * gpus * (1 - reserve) / bytes_per_param


@dataclass
class Fit:
    symbol: str
    value: int  # the largest value that fits
    peak_bytes: int  # the derived peak there
    budget_bytes: int
    # the peak one size up (does not fit); None where the value is the largest the formulas hold at (``most``)
    next_peak_bytes: int | None
    formula: str
    replicas: int = 1  # data-parallel replicas (gpus): memory per device is unchanged
    global_batch: int | None = None  # B x replicas, when B is known (solved or given)
    notes: list[str] = field(default_factory=list)  # e.g. S_max raised with S


def bounded_by_table(acct: Accounting) -> bool:
    """Whether a size constraint the trace learned reads S_max (``S <= S_max``: a position table's rows)."""
    return any(
        any(str(x) == "S_max" for side in (c.lhs, c.rhs) if side is not None for x in side.free_symbols)
        for c in acct.constraints
    )


def least(acct: Accounting, symbol: str) -> int:
    """The least value of ``symbol`` the formulas hold at: the accounting's minimum (a layer count), raised by
    each bound ``n <= symbol`` of its constraints (a length below which the model takes another path, or which
    it cannot run; a window's far side)."""
    floors = [
        int(c.lhs)
        for c in acct.constraints
        if c.kind == "le" and c.lhs.is_Integer and c.rhs is not None and c.rhs.is_Symbol and c.rhs.name == symbol
    ]
    return max([acct.minimum.get(symbol, 1), *floors])


def most(acct: Accounting, symbol: str) -> int | None:
    """The largest value of ``symbol`` the formulas hold at, from the bounds ``symbol <= n`` of its
    constraints (a batch size above which the model takes another path, a window's near side); None where
    none bounds it."""
    return min(
        (
            int(c.rhs)
            for c in acct.constraints
            if c.kind == "le" and c.lhs.is_Symbol and c.lhs.name == symbol and c.rhs is not None and c.rhs.is_Integer
        ),
        default=None,
    )


def fits_at_most(symbol: str, top: int) -> str:
    """The note of a search that stops at ``most``'s bound, where it still fits (``fit``, ``fit_layout``)."""
    return (
        f"{symbol}={top} is the largest value the formulas hold at (above it the model takes another path, not "
        "derived: the accounting's notes say where), and it fits: larger values may fit too"
    )


def fit(
    acct: Accounting,
    symbol: str,
    *,
    hardware: str | Accelerator,
    gpus: int = 1,
    reserve: float = DEFAULT_RESERVE,
    limit: int = 1 << 24,
    allocator: bool = False,
    **sizes: int,
) -> Fit:
    """The largest value of ``symbol`` (B, S, L, ...) whose peak fits one device's budget.

    ``gpus`` is the number of data-parallel replicas: each device holds a full
    copy of the model and its optimizer states and runs B sequences; the
    memory per device is taken as the single-device step's, so the answer
    does not depend on it; it sets ``global_batch`` (B x gpus). DDP holds
    its gradient buckets besides (a note says so): ``fit_layout`` with a
    ddp layout counts them. The budget is one device's capacity times
    (1 - reserve). The answer is found on the exact peak of every step
    (``acct.peak_every_step``: the first step's, or a later one's with the
    optimizer states alive from its start, whichever is larger: a size whose
    first step fits and whose second does not is a run that stops at its
    second step), by doubling then bisection; it fits and the next value
    does not. Solving S
    on a model with a position table raises S_max with S (the table grows
    with it), and says so in ``notes``.

    ``allocator=True`` fits what the CUDA caching allocator would reserve instead of the live peak:
    ``acct.reserved`` over two steps (the first, and one with the optimizer states alive) with the
    device's cuBLAS workspace (``symacct.memory.reserved``), plus its CUDA context (``device_peak``); the
    search assumes it grows with the size, as the live peak does, and the answer is checked on both sides.
    """
    if isinstance(reserve, bool) or not isinstance(reserve, (int, float)) or not 0 <= reserve < 1:
        raise SymacctError(f"reserve must be in [0, 1), got {reserve!r}", hint="e.g. reserve=0.15")
    gpus = check_gpus(gpus)
    hw = get(hardware)
    budget = int(hw.memory_bytes * (1 - reserve))
    # S_max raised with S only where the model bounds S by it (a position table: S <= S_max learned from the
    # trace); a rotary model's max_position_embeddings bounds nothing it runs, and stays
    raise_smax = symbol == "S" and "S_max" in acct.symbols and "S_max" not in sizes and bounded_by_table(acct)

    def peak(v: int) -> int:
        vals = {**sizes, symbol: v}
        if raise_smax:
            vals["S_max"] = max(acct.symbols["S_max"], v)
        if allocator:
            return acct.reserved(steps=2, hardware=hw, **vals).device_peak
        return int(acct.peak_every_step(**vals))

    lo = least(acct, symbol)
    if peak(lo) > budget:
        floor = (
            f" ({symbol}={lo} is the least value the formulas hold at: below it the model takes another path, not "
            "derived, or cannot run)"
            if lo > acct.minimum.get(symbol, 1)
            else ""
        )
        raise SymacctError(
            f"nothing fits: {symbol}={lo} already needs {peak(lo) / 1e9:.1f} GB of {budget / 1e9:.1f} GB{floor}",
            hint="use more memory per device, a smaller model, or a lower reserve",
        )
    top = most(acct, symbol)
    notes = []
    capped = top is not None and peak(top) <= budget
    if capped:  # fits up to the bound: larger sizes are not derived
        lo = top
        notes.append(fits_at_most(symbol, top))
    else:
        hi = lo
        while top is None or hi * 2 < top:
            if peak(hi * 2) > budget:
                break
            hi *= 2
            if hi > limit:
                raise SymacctError(f"{symbol} fits beyond {limit}", hint="the peak does not grow with this symbol")
        lo, hi = hi, hi * 2 if top is None else min(hi * 2, top)  # peak(lo) fits, peak(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if peak(mid) <= budget:
                lo = mid
            else:
                hi = mid
    if gpus > 1:
        notes.append(
            f"gpus={gpus}: each replica's memory is the single-device step's; DDP's gradient buckets (the gradients' "
            "bytes again, without gradient_as_bucket_view) are not in it: symacct.parallel.plan.fit_layout with a "
            "ddp layout counts them (symacct fit MODEL --gpus N does)"
        )
    if raise_smax and lo > acct.symbols["S_max"]:
        field_name = acct.fields.get("S_max", "S_max")
        notes.append(
            f"S_max raised from {acct.symbols['S_max']} to {lo} with S ({field_name}={lo}): the model cannot run "
            f"S > S_max, and its position table grows with it"
        )
    B = lo if symbol == "B" else sizes.get("B")
    return Fit(
        symbol,
        lo,
        peak(lo),
        budget,
        None if capped else peak(lo + 1),
        (
            "largest v with the caching allocator's reserved bytes (2 steps, cuBLAS workspace) + the CUDA context "
            "<= capacity * (1 - reserve)"
            if allocator
            else "largest v with the peak of every step (the first, and a later one with the optimizer states "
            "alive from its start) <= capacity * (1 - reserve)"
        ),
        replicas=gpus,
        global_batch=B * gpus if B is not None else None,
        notes=notes,
    )
