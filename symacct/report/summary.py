"""Plain summaries of an accounting: formulas as text, evaluated numbers.

Formulas are printed by the one formula printer (``symacct.formula.text``: the
layer stack first, ``L*(...) + ...``, leading terms first, deterministic).
No torch here: reports only read the accounting.
"""

from __future__ import annotations

from typing import Any

import sympy

from symacct.accounting import Accounting
from symacct.formula import si, text
from symacct.memory.reserved import Reserved
from symacct.symbols import MEANING, sort_key

_ROWS = (
    ("params", "parameters N"),
    ("flops.forward", "matmul FLOPs, forward"),
    ("flops.backward", "matmul FLOPs, backward"),
    ("flops.total", "matmul FLOPs, step"),
    ("flops.other", "other FLOPs, step"),
    ("saved_bytes", "activation bytes saved for backward"),
    ("bytes.read", "bytes read by all ops"),
    ("bytes.written", "bytes written by all ops"),
    ("memory.params", "memory: parameters, bytes"),
    ("memory.grads", "memory: gradients, bytes"),
    ("memory.optimizer", "memory: optimizer states, bytes"),
    ("memory.after_forward", "memory: live after forward, bytes"),
    ("memory.after_backward", "memory: live after backward, bytes"),
    ("memory.after_optimizer", "memory: live after optimizer step + zero_grad, bytes"),
    ("memory.peak", "memory: peak of the step, bytes"),
    ("memory.checkpoint", "checkpoint file tensors, bytes"),
)


def summary(acct: Accounting, *, B: int, S: int, name: str) -> dict[str, Any]:
    """A JSON-ready summary: symbols, each formula and its value at (B, S)."""
    at = acct.at(B=B, S=S) if "S" in acct.free_symbols() else acct.at(B=B)
    values = dict(sorted(at.values.items(), key=lambda kv: sort_key(kv[0]))) if at.values else {}
    rows = []
    for key, label in _ROWS:
        rows.append({"name": key, "label": label, "formula": text(acct.formula(key)), "value": int(at.formula(key))})
    comps = []
    for comp, metrics in acct.components.items():
        mm = sum((v for k, v in metrics.items() if k.startswith("flops_") and k != "flops_other"), sympy.Integer(0))
        mm_at = sum((v for k, v in at.components[comp].items() if k.startswith("flops_") and k != "flops_other"), 0)
        comps.append(
            {
                "component": comp,
                "flops": text(mm),
                "flops_value": int(mm_at),
                "params": text(metrics.get("params", 0)),
                "params_value": int(at.components[comp].get("params", 0)),
            }
        )
    later = None
    if acct.liveness is not None and acct.options.get("step", "train") == "train":
        # every step after the traced first: the optimizer's states live from its start (acct.steady)
        later = acct.steady(B=B, S=S) if "S" in acct.free_symbols() else acct.steady(B=B)
    return {
        "model": name,
        "peak_at": list(at.memory.peak_at),
        "later_steps": later,
        "bytes_per_param": str(acct.bytes_per_param()),
        "bytes_per_param_peak": str(acct.bytes_per_param_peak()),
        "step": acct.options.get("step", "train"),
        "symbols": [
            {
                "symbol": k,
                "meaning": MEANING.get(k, f"config field {acct.fields.get(k, k)}"),
                "field": acct.fields.get(k),
                "value": v,
            }
            for k, v in values.items()
        ],
        "formulas": rows,
        "components": comps,
        "notes": list(acct.notes),
        "unaccounted": list(acct.unaccounted),
    }


def reserved_summary(r: Reserved, context_source: str = "") -> dict[str, Any]:
    """The caching-allocator replay (``Accounting.reserved``), JSON-ready; with a GPU named, its CUDA context
    (outside the allocator) and where that figure comes from."""
    sizes: dict[int, int] = {}
    for seg in r.segments:
        sizes[seg] = sizes.get(seg, 0) + 1
    out: dict[str, Any] = {
        "steps": r.steps,
        "reserved_peak": r.reserved_peak,
        "allocated_peak": r.allocated_peak,
        "requested_peak": r.requested_peak,
        "workspace": r.workspace,
        "segments": [{"bytes": b, "count": n} for b, n in sorted(sizes.items())],
    }
    if r.context:
        out |= {"cuda_context": r.context, "cuda_context_source": context_source, "device_peak": r.device_peak}
    return out


def _mib(b: int) -> str:
    return f"{b / 2**20:.4g} MiB"


def _reserved_lines(r: dict[str, Any]) -> list[str]:
    segs = ", ".join(f"{s['count']} x {_mib(s['bytes'])}" for s in r["segments"])
    ws = f", cuBLAS workspace {_mib(r['workspace'])}" if r["workspace"] else ""
    return [
        "",
        f"CUDA caching allocator (a model of it; {r['steps']} step(s) replayed{ws}):",
        f"  reserved peak   {r['reserved_peak']}  ({_mib(r['reserved_peak'])})  torch.cuda.max_memory_reserved",
        f"  allocated peak  {r['allocated_peak']}  ({_mib(r['allocated_peak'])})  max_memory_allocated: whole blocks",
        f"  live peak       {r['requested_peak']}  ({_mib(r['requested_peak'])})  the storages' own bytes",
        f"  segments        {segs}",
        *(
            [
                f"  CUDA context    {r['cuda_context']}  ({_mib(r['cuda_context'])})  outside the allocator: "
                f"{r['cuda_context_source']}",
                f"  device peak     {r['device_peak']}  ({_mib(r['device_peak'])})  reserved + context, as nvidia-smi",
            ]
            if "cuda_context" in r
            else []
        ),
    ]


def render_text(report: dict[str, Any]) -> str:
    """The summary as aligned plain text."""
    lines = [f"symacct derive {report['model']}  (step: {report['step']})", "", "symbols:"]
    for s in report["symbols"]:
        field = f" ({s['field']})" if s.get("field") and s["field"] != s["symbol"] else ""
        lines.append(f"  {s['symbol']:<6} = {s['value']:<10} {s['meaning']}{field}")
    lines += ["", "formulas (value at the symbols above):"]
    for r in report["formulas"]:
        lines.append(f"  {r['label']}")
        lines.append(f"    = {r['formula']}")
        lines.append(f"    = {r['value']}  ({si(r['value'])})")
    lines += ["", "matmul FLOPs and parameters by component:"]
    for c in report["components"]:
        lines.append(f"  {c['component']:<10} FLOPs {c['flops']}  = {si(c['flops_value'])}")
        lines.append(f"  {'':<10} params {c['params']}  = {si(c['params_value'])}")
    lines += [
        "",
        f"peak at: {', '.join(report['peak_at'])}",
        f"bytes per parameter: {report['bytes_per_param']} between steps, "
        f"{report['bytes_per_param_peak']} at the optimizer step's peak",
    ]
    later = report.get("later_steps")
    if later:
        lines.append(
            "every later step (the formulas above are the first's; the optimizer's states alive from the start): "
            f"peak {later['peak']} ({si(later['peak'])}), after forward {later['after_forward']} "
            f"({si(later['after_forward'])})"
        )
    if "reserved" in report:
        lines += _reserved_lines(report["reserved"])
    if report["notes"]:
        lines += ["", "notes:"] + [f"  {n}" for n in report["notes"]]
    if report["unaccounted"]:
        lines += ["", "ops without a rule (counted as 0):"] + [f"  {u}" for u in report["unaccounted"]]
    return "\n".join(lines)
