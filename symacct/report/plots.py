"""Plots of a derived accounting (matplotlib, PNG and SVG, byte-identical across runs).

- ``memory-seq`` / ``memory-batch``: parameters, gradients, optimizer states
  and saved activations stacked, and the exact peak of the step (a line),
  against the sequence length at fixed batch and against the batch at fixed
  sequence length; GB = 10^9 bytes.
- ``flops-share``: each component's share of the step's FLOPs (matmul and
  other) against S, with the length where one layer's S^2 matmul terms
  (attention scores) equal its other matmul terms (the D^2 projections) marked.

Every value plotted is a derived formula evaluated exactly (``acct.at``,
``acct.peak``); nothing is interpolated. Determinism: no pyplot global
state, SVG text kept as text, a fixed SVG hash salt, no date or software
version in the files' metadata.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from symacct.accounting import Accounting
from symacct.symbols import evaluate

_PARTS = (
    ("params", "parameters"),
    ("grads", "gradients"),
    ("optimizer", "optimizer states"),
    ("activations", "activations saved for backward"),
)
_COLORS = ("#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974", "#64b5cd", "#8c8c8c", "#dd8452")


def _sizes(lo: int, hi: int) -> list[int]:
    """Powers-of-two steps from ``lo`` up to ``hi``; from ``hi`` itself when it is below ``lo`` (a model without a
    position table and a short --seq would otherwise plot no point)."""
    out, v = [], min(lo, hi)
    while v <= hi:
        out.append(v)
        v *= 2
    return out


def _save(fig: Any, stem: Path) -> list[Path]:
    import matplotlib

    paths = []
    with matplotlib.rc_context({"svg.hashsalt": "symacct", "svg.fonttype": "none"}):
        for ext, meta in (("png", {"Software": None}), ("svg", {"Date": None, "Creator": None})):
            p = stem.with_name(f"{stem.name}.{ext}")
            fig.savefig(p, format=ext, metadata=meta, dpi=110)
            paths.append(p)
    return paths


def _figure() -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _memory(acct: Accounting, axis: str, xs: list[int], fixed: dict[str, int], title: str, stem: Path) -> list[Path]:
    fig, ax = _figure()
    stacks = []
    for key, _ in _PARTS:
        stacks.append([evaluate(getattr(acct.memory, key), acct.with_defaults(**fixed, **{axis: x})) / 1e9 for x in xs])
    ax.stackplot(xs, *stacks, labels=[label for _, label in _PARTS], colors=_COLORS[:4], alpha=0.85)
    peaks = [acct.peak_every_step(**{**fixed, axis: x}) / 1e9 for x in xs]  # a later step's: what must fit
    ax.plot(
        xs,
        peaks,
        color="black",
        marker="o",
        markersize=3,
        label="peak of every step (a later one: optimizer states alive; the parts are never all live at once)",
    )
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel({"S": "sequence length S (tokens)", "B": "batch size B (sequences)"}[axis])
    ax.set_ylabel("memory (GB, 10^9 bytes)")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(True, alpha=0.3)
    return _save(fig, stem)


def _flops_share(acct: Accounting, xs: list[int], B: int, cross: float | None, name: str, stem: Path) -> list[Path]:
    fig, ax = _figure()
    comps = sorted(acct.components)
    totals = {c: sum((v for k, v in acct.components[c].items() if k.startswith("flops_")), 0) for c in comps}
    grid = [[evaluate(totals[c], acct.with_defaults(B=B, S=x)) for x in xs] for c in comps]
    sums = [sum(col) for col in zip(*grid)]
    shares = [[100.0 * v / s if s else 0.0 for v, s in zip(row, sums)] for row in grid]
    ax.stackplot(xs, *shares, labels=comps, colors=_COLORS[: len(comps)], alpha=0.85)
    if cross is not None:
        ax.axvline(cross, color="black", linestyle="--", linewidth=1)
        right = cross > (xs[0] * xs[-1]) ** 0.5  # label on the side with room
        label = (
            f"S^2 terms = D^2 terms \nat S = {cross:,.0f} "
            if right
            else f" S^2 terms = D^2 terms\n at S = {cross:,.0f}"
        )
        ax.text(cross, 50, label, fontsize=8, va="center", ha="right" if right else "left")
    smax = acct.symbols.get("S_max")
    if smax:
        ax.axvline(smax, color="gray", linestyle=":", linewidth=1)
        ax.text(smax, 95, f" S_max = {smax:,}", fontsize=8, va="top", color="dimgray")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs], fontsize=7)
    ax.set_xlim(xs[0], xs[-1])
    ax.set_ylim(0, 100)
    ax.set_xlabel("sequence length S (tokens)")
    ax.set_ylabel("share of the step's FLOPs (%)")
    ax.set_title(f"{name}: FLOPs by component (matmul + other), B = {B}")
    ax.legend(loc="lower left", fontsize=7, ncols=2)
    return _save(fig, stem)


def write(acct: Accounting, out: Path, *, name: str, B: int, S: int | None) -> list[Path]:
    """Write the plots of ``acct`` under ``out`` (``{name}-memory-seq.png`` ...); returns the paths."""
    paths: list[Path] = []
    if acct.options.get("step") == "decode":  # one token after C cached: memory against the context
        return serving_memory(acct, out, name=name, batches=tuple(sorted({1, B, 8 * B})))
    has_s = "S" in acct.free_symbols()
    what = "one training step" if acct.options.get("step", "train") == "train" else "one forward pass"
    S = S if S is not None else acct.symbols.get("S_max", 1024)
    if has_s:
        hi = max(acct.symbols.get("S_max", S), S)
        xs = _sizes(64, hi)
        title = f"{name}: memory of {what} against S, B = {B}"
        paths += _memory(acct, "S", xs, {"B": B}, title, out / f"{name}-memory-seq")
    xb = _sizes(2, max(64, B))  # byte figures are exact from size 2 (docs/memory.md)
    fixed = {"S": S} if has_s else {}
    label = f", S = {S}" if has_s else ""
    title = f"{name}: memory of {what} against B{label}"
    paths += _memory(acct, "B", xb, fixed, title, out / f"{name}-memory-batch")
    if has_s:
        cross = acct.crossover()
        hi = max(acct.symbols.get("S_max", S), S, int(2 * (cross or 0)))
        xs = _sizes(64, 1 << (hi - 1).bit_length())
        xs = xs if len(xs) > 1 else [xs[0], 2 * xs[0]]  # a share plot needs a range (a short --seq, no S_max)
        paths += _flops_share(acct, xs, B, cross, name, out / f"{name}-flops-share")
    return paths


def serving_memory(
    decode: Accounting, out: Path, *, name: str, batches: tuple[int, ...] = (1, 8, 32), budget: int | None = None
) -> list[Path]:
    """The exact peak of a decode step (weights, KV cache, the step's working set) against the context, one
    line a batch; the device's budget dashed when given. Writes ``{name}-serving-memory.png`` and ``.svg``."""
    fig, ax = _figure()
    top = decode.symbols.get("S_max", 1 << 17)
    xs = _sizes(64, top)
    for b, color in zip(batches, _COLORS):
        ax.plot(
            xs, [decode.peak(B=b, C=x - 1) / 1e9 for x in xs], marker="o", markersize=3, color=color, label=f"B = {b}"
        )
    weights = evaluate(decode.memory.params, decode.with_defaults(B=1, C=1)) / 1e9
    ax.axhline(weights, color="gray", linestyle=":", linewidth=1, label="weights")
    if budget is not None:
        ax.axhline(budget / 1e9, color="black", linestyle="--", linewidth=1, label="device budget")
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_xticks(xs, [str(x) for x in xs], fontsize=7)
    ax.set_xlabel("context (tokens in the sequence at the generated one)")
    ax.set_ylabel("peak of a decode step (GB, 10^9 bytes)")
    ax.set_title(f"{name}: serving memory against context, one line a batch")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(True, alpha=0.3)
    return _save(fig, out / f"{name}-serving-memory")
