"""Formula sheets: what a derived accounting says, laid out for a reader.

A sheet has, in this order: the notation (each symbol, its meaning, the
config field it comes from and its value); one table per component
(embedding, attention, mlp, norm, head, loss, other) with a row per module:
matmul FLOPs forward and backward, other FLOPs of forward and backward,
bytes saved for backward and parameters, the layer stack factored as
``L (...)``; the optimizer's states; the totals (parameters, FLOPs per phase,
memory parts and the peak, time on one accelerator). Every formula is
printed by ``symacct.formula`` (fixed symbol order, leading terms first,
terms under 1 % grey) and evaluated at the sheet's sizes with ``acct.at``.

``build`` makes a JSON-ready dict; ``render_md``, ``render_tex`` and
``render_json`` print it. Output is byte-identical across runs and hash seeds:
every collection is ordered explicitly and numbers are exact integers.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import sympy

from symacct.accounting import Accounting
from symacct.cost.graph import records
from symacct.formula import latex, negligible_terms, si, text
from symacct.options import dtype_key
from symacct.symbols import MEANING, evaluate, sort_key, sym

COMPONENTS = ("embedding", "attention", "mlp", "norm", "head", "loss", "other")
_TITLES = {
    "embedding": "Embedding",
    "attention": "Attention",
    "mlp": "MLP",
    "norm": "Norms",
    "head": "Head",
    "loss": "Loss",
    "other": "Other (residual adds, ...)",
}
_PHASES = ("forward", "backward")


def _entry(expr: Any, values: dict[str, int], at_value: Any = None) -> dict[str, Any]:
    """Formula as text and LaTeX, its value, and its negligible terms at ``values``."""
    e = sympy.expand(sympy.sympify(expr))
    v = evaluate(e, values) if at_value is None else int(at_value)
    return {
        "formula": text(e, values),
        "latex": latex(e, values),
        "value": v,
        "negligible": negligible_terms(e, values),
    }


def _short(op: str) -> str:
    return op.removeprefix("aten.").split(".")[0]


def _rows(acct: Accounting) -> dict[str, list[tuple[str, list[str], dict[str, Any]]]]:
    """Per component, one row per module (generic path), in the order the forward pass meets them."""
    zero = sympy.Integer(0)
    comp_of: dict[str, str] = {}
    order: list[str] = []
    other: dict[str, dict[str, Any]] = defaultdict(lambda: {"forward": zero, "backward": zero})
    ops: dict[str, list[str]] = defaultdict(list)
    for _, a in records(acct.graph):
        gp = a.generic
        if a.phase != "optimizer" and gp not in comp_of:
            comp_of[gp] = a.component
            order.append(gp)
        if a.phase in _PHASES:
            other[gp][a.phase] += a.cost.flops_other * a.count
        moves = a.cost.flops or a.cost.flops_other or a.cost.bytes_written
        if a.phase == "forward" and moves and _short(a.op) not in ops[gp]:
            ops[gp].append(_short(a.op))
    saved = acct.memory.activations_by_module
    out: dict[str, list[tuple[str, list[str], dict[str, Any]]]] = {}
    for gp in order:
        m = acct.modules.get(gp, {})
        cols = {
            "matmul_forward": m.get("flops_forward", zero),
            "matmul_backward": m.get("flops_backward", zero),
            "other_forward": sympy.expand(other[gp]["forward"]),
            "other_backward": sympy.expand(other[gp]["backward"]),
            "saved_bytes": saved.get(gp, zero),
            "params": m.get("params", zero),
        }
        if m.get("flops_recompute", zero) != 0:
            cols["matmul_recompute"] = m["flops_recompute"]
        if all(sympy.sympify(v) == 0 for v in cols.values()):
            continue
        out.setdefault(comp_of[gp], []).append((gp or "(model)", ops[gp][:4], cols))
    return out


def _component(rows: list[tuple[str, list[str], dict[str, Any]]], values: dict[str, int]) -> dict[str, Any]:
    """Rows as entries, and their subtotal (the sum of the row formulas)."""
    keys = sorted({k for _, _, cols in rows for k in cols})
    subtotal = {k: _entry(sum((cols.get(k, 0) for _, _, cols in rows), sympy.Integer(0)), values) for k in keys}
    entries = [{"module": gp, "ops": ops, **{k: _entry(v, values) for k, v in cols.items()}} for gp, ops, cols in rows]
    return {"rows": entries, "subtotal": subtotal}


def _peak_formula(acct: Accounting, values: dict[str, int], peak: int) -> sympy.Expr:
    """The argument of the symbolic Max that equals the exact peak at these sizes (else the whole Max)."""
    e = sympy.sympify(acct.memory.peak)
    args = e.args if isinstance(e, sympy.Max) else (e,)
    hits = [a for a in args if evaluate(a, values) == peak]
    return min(hits, key=sympy.default_sort_key) if hits else e


def build(
    acct: Accounting,
    *,
    name: str,
    B: int,
    S: int | None = None,
    hardware: str = "H100-SXM",
    mfu: float = 0.5,
    dtype: str | None = None,
    config: dict[str, Any] | None = None,
    C: int | None = None,
) -> dict[str, Any]:
    """The sheet of ``acct`` evaluated at batch ``B`` and sequence ``S`` (S defaults to S_max); a decode step
    at ``C`` cached positions (default S_max - 1)."""
    from symacct.time.hardware import get
    from symacct.time.model import roofline
    from symacct.time.serving import textbook_bytes_per_token

    sizes = {"B": B}
    if "S" in acct.free_symbols():
        sizes["S"] = S if S is not None else acct.symbols.get("S_max", 1)
    if "C" in acct.free_symbols():
        sizes["C"] = C if C is not None else acct.symbols.get("S_max", 2) - 1
    at = acct.at(**sizes)
    values = dict(at.values or {})
    hw = get(hardware)
    opts = acct.options
    if dtype is None:
        low = {dtype_key(opts.get("autocast")), dtype_key(opts.get("params_dtype"))}
        dtype = "bf16" if "bf16" in low else "fp16" if "fp16" in low else "fp32"
    notation = [
        {
            "symbol": k,
            "latex": latex(sympy.Symbol(k)),
            "meaning": MEANING.get(k, f"config field {acct.fields.get(k, k)}"),
            "field": acct.fields.get(
                k, {"B": "--batch", "S": "--seq", "S_dec": "--seq", "C": "--context (minus one)"}.get(k, "")
            ),
            "value": v,
        }
        for k, v in sorted(values.items(), key=lambda kv: sort_key(kv[0]))
    ]
    rows = _rows(acct)
    components = [{"component": c, **_component(rows[c], values)} for c in COMPONENTS if c in rows]
    states = [{"state": k, **_entry(v, values)} for k, v in sorted(acct.memory.optimizer_by_state.items())]
    fl, mem = acct.flops, acct.memory
    totals: list[dict[str, Any]] = []

    def add(key: str, label: str, unit: str, expr: Any, value: Any) -> None:
        totals.append({"name": key, "label": label, "unit": unit, **_entry(expr, values, value)})

    add("params", "parameters N", "params", acct.params, at.params)
    add("params_embedding", "of which embedding tables", "params", acct.params_embedding, at.params_embedding)
    for ph in ("forward", "backward", "optimizer", "total", "recompute"):
        if ph in ("optimizer", "recompute") and sympy.sympify(getattr(fl, ph)) == 0:
            continue
        label = {"total": "matmul FLOPs, step (model FLOPs)", "recompute": "matmul FLOPs, recomputed in backward"}
        add(f"flops.{ph}", label.get(ph, f"matmul FLOPs, {ph}"), "FLOP", getattr(fl, ph), getattr(at.flops, ph))
    add(
        "flops.other",
        "other FLOPs, step (elementwise, reductions, norms, softmax, optimizer)",
        "FLOP",
        fl.other,
        at.flops.other,
    )
    if opts.get("step") == "decode":  # one new token a sequence
        add(
            "flops.per_token",
            "matmul FLOPs per generated token (step / B)",
            "FLOP",
            sympy.expand(fl.total / sym("B")),
            sympy.Rational(at.flops.total, values["B"]).round(),
        )
    elif "B" in values and "S" in values:
        per_tok = sympy.expand(fl.total / (sym("B") * sym("S")))
        add(
            "flops.per_token",
            "matmul FLOPs per token (step / BS)",
            "FLOP",
            per_tok,
            sympy.Rational(at.flops.total, values["B"] * values["S"]).round(),
        )
    add(
        "bytes.moved",
        "bytes read + written by all ops",
        "B",
        acct.bytes.read + acct.bytes.written,
        at.bytes.read + at.bytes.written,
    )
    for key, label in (
        ("params", "memory: parameters"),
        ("grads", "memory: gradients"),
        ("optimizer", "memory: optimizer states"),
        ("activations", "memory: activations saved for backward"),
        ("after_forward", "memory: live after forward"),
        ("after_backward", "memory: live after backward"),
        ("after_optimizer", "memory: live after optimizer step + zero_grad"),
    ):
        add(f"memory.{key}", label, "B", getattr(mem, key), getattr(at.memory, key))
    add("memory.peak", "memory: peak of the step", "B", _peak_formula(acct, values, at.memory.peak), at.memory.peak)
    add("memory.checkpoint", "checkpoint file (model + optimizer tensors)", "B", mem.checkpoint, at.memory.checkpoint)
    if opts.get("step") in ("prefill", "decode"):
        positions = sym("C") + 1 if opts.get("step") == "decode" else sym("S")
        per_position = sympy.factor(sympy.simplify(mem.kv_cache / (sym("B") * positions)))
        add("memory.kv_cache", "memory: KV cache after the step", "B", mem.kv_cache, at.memory.kv_cache)
        add(
            "memory.kv_cache_per_token",
            f"KV cache a position of one sequence (textbook 2*L*H_kv*d_head*bytes: {textbook_bytes_per_token(acct):,})",
            "B",
            per_position,
            evaluate(per_position, values),
        )
    if opts.get("step") != "train":  # no backward, no update: those rows would all read 0
        train_only = {"flops.backward", "memory.grads", "memory.optimizer", "memory.activations"}
        train_only |= {"memory.after_backward", "memory.after_optimizer"}
        totals = [t for t in totals if t["name"] not in train_only]
    peak = hw.peak_flops(dtype)
    roof = roofline(acct, hw, **sizes)
    step_mfu = at.flops.total / (peak * mfu)
    time = {
        "hardware": hw.name,
        "dtype": dtype,
        "peak_flops": peak,
        "mfu": mfu,
        "seconds_at_mfu": step_mfu,
        "formula_at_mfu": f"flops.total / ({peak:.4g} FLOP/s * {mfu:g})",
        "roofline_seconds": roof.seconds,
        "roofline_memory_bound_seconds": roof.memory_bound_seconds,
        "roofline_mfu": roof.mfu,
        "roofline_hfu": roof.hfu,
        "roofline_dtype": roof.dtype,
        "memory_gb": hw.memory_gb,
        # every step's peak: a later step holds the optimizer's states from its start (acct.peak_every_step)
        "peak_fits": (acct.peak_every_step(**sizes) if acct.liveness is not None else at.memory.peak)
        <= hw.memory_bytes,
    }
    return {
        "model": name,
        "step": opts.get("step", "train"),
        "optimizer": opts.get("optimizer"),
        "autocast": opts.get("autocast"),
        "params_dtype": opts.get("params_dtype"),
        "causal_discount": bool(opts.get("causal_discount")),
        "config": {k: config[k] for k in sorted(config)} if config else {},
        "notation": notation,
        "components": components,
        "optimizer_states": states,
        "optimizer_flops": _entry(fl.other_optimizer, values, at.flops.other_optimizer),
        "totals": totals,
        "time": time,
        "bytes_per_param": str(acct.bytes_per_param()),
        "bytes_per_param_peak": str(acct.bytes_per_param_peak()),
        "peak_at": list(at.memory.peak_at),
        "notes": list(at.notes),
    }


# ---- renderers ----------------------------------------------------------------------

_COLS = (
    ("matmul_forward", "matmul FLOPs fwd"),
    ("matmul_backward", "matmul FLOPs bwd"),
    ("other_forward", "other FLOPs fwd"),
    ("other_backward", "other FLOPs bwd"),
    ("saved_bytes", "bytes saved"),
    ("params", "params"),
)


def title(sheet: dict[str, Any]) -> str:
    bits = [f"step: {sheet['step']}"]
    if sheet["optimizer"]:
        bits.append(f"optimizer: {sheet['optimizer']}")
    if sheet["autocast"]:
        bits.append(f"autocast: {sheet['autocast'].removeprefix('torch.')}")
    if sheet["params_dtype"]:
        bits.append(f"parameters: {sheet['params_dtype'].removeprefix('torch.')}")
    return ", ".join(bits)


def columns(sheet: dict[str, Any]) -> list[tuple[str, str]]:
    """The component-table columns that hold something (a forward-only sheet has no backward columns)."""
    cols = list(_COLS)
    cols.insert(2, ("matmul_recompute", "matmul FLOPs recompute"))
    rows = [r for c in sheet["components"] for r in c["rows"]]
    return [(k, label) for k, label in cols if any(r.get(k, {}).get("formula", "0") != "0" for r in rows)]


def render_md(sheet: dict[str, Any]) -> str:
    """GitHub-flavoured Markdown; formulas as inline math (``$...$``)."""
    at = ", ".join(f"{n['symbol']} = {n['value']:,}" for n in sheet["notation"])
    out = [
        f"# Formula sheet: {sheet['model']}",
        "",
        f"Derived by `symacct` from the model's code ({title(sheet)}). Every formula is evaluated at {at}.",
        "Terms in grey are below 1 % of their formula's value at these sizes. FLOPs count 2 per multiply-add;",
        "bytes are exact for sizes of 2 or more; GB = 10^9 bytes.",
        "",
        "## Notation",
        "",
        "| symbol | meaning | config field | value |",
        "|---|---|---|---:|",
    ]
    for n in sheet["notation"]:
        out.append(f"| ${n['latex']}$ | {n['meaning']} | `{n['field']}` | {n['value']:,} |")
    cols = columns(sheet)
    for comp in sheet["components"]:
        out += ["", f"## {_TITLES[comp['component']]}", ""]
        out.append("| module | ops | " + " | ".join(label for _, label in cols) + " |")
        out.append("|---|---|" + "---|" * len(cols))
        for r in comp["rows"]:
            ops = ", ".join(f"`{o}`" for o in r["ops"])
            out.append(f"| `{r['module']}` | {ops} | " + " | ".join(_md_cell(r.get(k)) for k, _ in cols) + " |")
        out.append("| **subtotal** | | " + " | ".join(_md_cell(comp["subtotal"].get(k)) for k, _ in cols) + " |")
    if sheet["optimizer_states"]:
        out += ["", "## Optimizer states", "", "| state | bytes | value |", "|---|---|---:|"]
        for s in sheet["optimizer_states"]:
            out.append(f"| `{s['state']}` | ${s['latex']}$ | {s['value']:,} ({si(s['value'], 'B')}) |")
        f = sheet["optimizer_flops"]
        out += ["", f"FLOPs of the optimizer step (elementwise): ${f['latex']}$ = {f['value']:,}."]
    out += ["", "## Totals", "", "| quantity | formula | value |", "|---|---|---:|"]
    for t in sheet["totals"]:
        out.append(f"| {t['label']} | ${t['latex']}$ | {t['value']:,} ({si(t['value'], _unit(t))}) |")
    tm = sheet["time"]
    out += [
        "",
        f"## Time on one {tm['hardware']}",
        "",
        "| quantity | value |",
        "|---|---:|",
        f"| dense peak, {tm['dtype']} | {si(tm['peak_flops'], 'FLOP/s')} |",
        f"| step at MFU {tm['mfu']:g} (`{tm['formula_at_mfu']}`) | {tm['seconds_at_mfu']:.4g} s |",
        f"| step by per-op roofline (no overlap, no launch cost) | {tm['roofline_seconds']:.4g} s |",
        f"| of which memory-bound ops | {tm['roofline_memory_bound_seconds']:.4g} s |",
        f"| MFU / HFU the roofline implies (model / hardware FLOPs, {tm['roofline_dtype']} peak) "
        f"| {tm['roofline_mfu']:.3f} / {tm['roofline_hfu']:.3f} |",
        f"| every step's peak memory (a later step's: optimizer states alive) fits in {tm['memory_gb']:g} GB "
        f"| {'yes' if tm['peak_fits'] else 'no'} |",
        "",
        f"Bytes per parameter (leading terms): {sheet['bytes_per_param']} between steps, "
        f"{sheet['bytes_per_param_peak']} at the optimizer step's peak. "
        f"The peak occurs at {', '.join(sheet['peak_at'])}.",
    ]
    if sheet["notes"]:
        out += ["", "## Notes", ""] + [f"- {n}" for n in sheet["notes"]]
    return "\n".join(out) + "\n"


def _unit(t: dict[str, Any]) -> str:
    return {"B": "B", "FLOP": "FLOP", "params": ""}[t["unit"]]


def _md_cell(e: dict[str, Any] | None) -> str:
    if not e or e["value"] == 0 and e["formula"] == "0":
        return ""
    return f"${e['latex']}$ = {si(e['value'])}"


def render_tex(sheet: dict[str, Any]) -> str:
    """A standalone LaTeX document (article, amsmath, xcolor, longtable)."""

    def esc(s: str) -> str:
        return s.replace("_", r"\_").replace("%", r"\%").replace("&", r"\&").replace("#", r"\#")

    at = ", ".join(f"${n['latex']} = {n['value']}$" for n in sheet["notation"])
    out = [
        r"\documentclass[10pt,landscape]{article}",
        r"\usepackage[margin=1.5cm]{geometry}",
        r"\usepackage{amsmath,xcolor,longtable}",
        r"\begin{document}",
        rf"\section*{{Formula sheet: {esc(sheet['model'])}}}",
        rf"Derived by \texttt{{symacct}} ({esc(title(sheet))}); evaluated at {at}. "
        r"Grey terms are below 1\,\% of their formula's value.",
        r"\subsection*{Notation}",
        r"\begin{longtable}{lllr}",
        r"symbol & meaning & config field & value \\ \hline",
    ]
    for n in sheet["notation"]:
        out.append(rf"${n['latex']}$ & {esc(n['meaning'])} & \texttt{{{esc(n['field'])}}} & {n['value']} \\")
    out.append(r"\end{longtable}")
    cols = columns(sheet)
    for comp in sheet["components"]:
        out += [rf"\subsection*{{{_TITLES[comp['component']]}}}", r"\begin{longtable}{ll}"]
        for r in [*comp["rows"], {"module": "subtotal", **comp["subtotal"]}]:
            out.append(rf"\multicolumn{{2}}{{l}}{{\texttt{{{esc(r['module'])}}}}} \\ \hline")
            for k, label in cols:
                e = r.get(k)
                if e and e["formula"] != "0":
                    out.append(rf"\quad {esc(label)} & ${e['latex']} = {e['value']}$ \\")
        out.append(r"\end{longtable}")
    if sheet["optimizer_states"]:
        out += [r"\subsection*{Optimizer states}", r"\begin{longtable}{ll}"]
        for s in sheet["optimizer_states"]:
            out.append(rf"\texttt{{{esc(s['state'])}}} & ${s['latex']} = {s['value']}$ \\")
        f = sheet["optimizer_flops"]
        out.append(rf"FLOPs of the step (elementwise) & ${f['latex']} = {f['value']}$ \\")
        out.append(r"\end{longtable}")
    out += [r"\subsection*{Totals}", r"\begin{longtable}{ll}"]
    for t in sheet["totals"]:
        out.append(rf"{esc(t['label'])} & ${t['latex']} = {t['value']}$ \\")
    tm = sheet["time"]
    out += [
        r"\end{longtable}",
        rf"\subsection*{{Time on one {esc(tm['hardware'])}}}",
        rf"Step at MFU {tm['mfu']:g}: {tm['seconds_at_mfu']:.4g}\,s; per-op roofline: "
        rf"{tm['roofline_seconds']:.4g}\,s (memory-bound ops {tm['roofline_memory_bound_seconds']:.4g}\,s).",
        r"\end{document}",
    ]
    return "\n".join(out) + "\n"


def render_json(sheet: dict[str, Any]) -> str:
    return json.dumps(sheet, indent=2, sort_keys=True) + "\n"


RENDERERS = {"md": render_md, "tex": render_tex, "json": render_json}


def write(acct: Accounting, sheet: dict[str, Any], out: Path, *, formats: list[str], plots: bool = True) -> list[Path]:
    """Write the sheet in ``formats`` and its plots under ``out``; all or nothing (staged, then moved)."""
    from symacct.report import plots as plotting

    name = sheet["model"]
    with tempfile.TemporaryDirectory(dir=out, prefix=".symacct-") as tmp:
        stage = Path(tmp)
        staged = []
        for fmt in formats:
            p = stage / f"{name}.{fmt}"
            p.write_text(RENDERERS[fmt](sheet))
            staged.append(p)
        if plots:
            S = next((n["value"] for n in sheet["notation"] if n["symbol"] == "S"), None)
            B = next(n["value"] for n in sheet["notation"] if n["symbol"] == "B")
            staged += plotting.write(acct, stage, name=name, B=B, S=S)
        written = []
        for p in staged:
            target = out / p.name
            os.replace(p, target)
            written.append(target)
    return written


# ---- notebooks (Accounting._repr_markdown_ / _repr_latex_) ------------------------------------
