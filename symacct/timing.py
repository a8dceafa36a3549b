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

GB = 10**9 bytes throughout (see ``symacct.hardware``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from symacct.accounting import Accounting, generic_path
from symacct.errors import SymacctError
from symacct.hardware import Accelerator, get

DAY = 86400.0
DEFAULT_RESERVE = 0.15  # CUDA context, allocator slack, library workspaces: the seed's 15-20 %


def _check_mfu(mfu: float) -> None:
    if not isinstance(mfu, (int, float)) or not 0 < mfu <= 1:
        raise SymacctError(f"MFU must be in (0, 1], got {mfu!r}", hint="MFU is a fraction of the peak, e.g. 0.5")


def _check_positive(**values: Any) -> None:
    for k, v in values.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
            raise SymacctError(f"{k} must be a positive number, got {v!r}", hint=f"pass a positive {k}")


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
    _check_positive(params=params, tokens=tokens, gpus=gpus)
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
    _check_positive(tokens=tokens, gpus=gpus)
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
    """Model FLOPs utilisation of a measured step: flops / (seconds * peak * gpus)."""
    _check_positive(flops=flops, seconds=seconds, gpus=gpus)
    return flops / (seconds * get(hardware).peak_flops(dtype) * gpus)


@dataclass
class Roofline:
    seconds: float  # predicted step time on one device
    by_phase: dict[str, float]
    by_module: dict[str, float]
    memory_bound_seconds: float
    memory_bound: list[tuple[str, float]]  # (op in module, seconds), largest first
    mfu: float  # model FLOPs / (seconds * peak)
    graph: Any = None  # the evaluated graph; every op node has 'seconds' (one instance) and 'bound'
    formula: str = "node seconds = max(flops / peak(dtype), bytes / bandwidth)"


def _dtype_key(dtypes: list[str]) -> str:
    d = dtypes[0] if dtypes else "torch.float32"
    return {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "tf32"}.get(d, "fp32")


def roofline(acct: Accounting, hardware: str | Accelerator, *, tf32: bool = False, **sizes: int) -> Roofline:
    """Predicted step time from the per-op roofline (see the module docstring)."""
    hw = get(hardware)
    at = acct.at(**sizes)
    phase: dict[str, float] = defaultdict(float)
    module: dict[str, float] = defaultdict(float)
    mem_bound: dict[str, float] = defaultdict(float)
    stacks = [p for p in acct.per_layer]
    vector = hw.peak.get("fp32", min(hw.peak.values())) * 1e12
    for _, a in at.graph.nodes(data=True):
        if a["phase"] == "input":
            continue
        key = _dtype_key(a["dtypes"])
        if key == "tf32" and not tf32:
            key = "fp32"
        tensor_peak = hw.peak.get(key, hw.peak.get("bf16", 0)) * 1e12 if a["flops"] else 1.0
        compute = a["flops"] / tensor_peak + a["flops_other"] / vector
        memory = (a["bytes_read"] + a["bytes_written"]) / hw.bandwidth
        a["seconds"] = max(compute, memory)
        a["bound"] = "memory" if memory > compute else "compute"
        t = a["seconds"] * a["count"]
        phase[a["phase"]] += t
        module[generic_path(a["module"], stacks)] += t
        if memory > compute and t > 0:
            mem_bound[f"{a['op']} in '{generic_path(a['module'], stacks)}'"] += t
    total = sum(phase.values())
    peak = hw.peak_flops("bf16")
    return Roofline(
        total,
        dict(sorted(phase.items())),
        dict(sorted(module.items(), key=lambda kv: -kv[1])),
        sum(mem_bound.values()),
        sorted(mem_bound.items(), key=lambda kv: -kv[1])[:20],
        at.flops.total / (total * peak) if total else 0.0,
        at.graph,
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
    next_peak_bytes: int  # the peak one size up (does not fit)
    formula: str


def fit(
    acct: Accounting,
    symbol: str,
    *,
    hardware: str | Accelerator,
    gpus: int = 1,
    reserve: float = DEFAULT_RESERVE,
    limit: int = 1 << 24,
    **sizes: int,
) -> Fit:
    """The largest value of ``symbol`` (B, S, L, ...) whose peak fits one device's budget.

    ``gpus`` devices each hold a full replica (data parallel): the budget is
    one device's capacity times (1 - reserve). The answer is found on the
    exact peak (``acct.at``), by doubling then bisection; it fits and the
    next value does not.
    """
    if not 0 <= reserve < 1:
        raise SymacctError(f"reserve must be in [0, 1), got {reserve!r}", hint="e.g. reserve=0.15")
    hw = get(hardware)
    budget = int(hw.memory_bytes * (1 - reserve))

    def peak(v: int) -> int:
        vals = {**sizes, symbol: v}
        if symbol == "S" and "S_max" in acct.symbols and "S_max" not in sizes:
            vals["S_max"] = max(acct.symbols["S_max"], v)
        return int(acct.peak(**vals))

    lo = acct.minimum.get(symbol, 1)
    if peak(lo) > budget:
        raise SymacctError(
            f"nothing fits: {symbol}={lo} already needs {peak(lo) / 1e9:.1f} GB of {budget / 1e9:.1f} GB",
            hint="use more memory per device, a smaller model, or a lower reserve",
        )
    hi = lo
    while peak(hi * 2) <= budget:
        hi *= 2
        if hi > limit:
            raise SymacctError(f"{symbol} fits beyond {limit}", hint="the peak does not grow with this symbol")
    lo, hi = hi, hi * 2  # peak(lo) fits, peak(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if peak(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return Fit(symbol, lo, peak(lo), budget, peak(lo + 1), "largest v with memory.peak(v) <= capacity * (1 - reserve)")
