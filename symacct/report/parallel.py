"""Per-rank figures and plans for the terminal, JSON and a plot of the Pareto front (memory vs step time)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table

from symacct.formula import si
from symacct.parallel.plan import PlanRow, StepTime
from symacct.parallel.rank import Parallel
from symacct.report.terminal import console

_FIELDS = ("params", "grads", "optimizer", "activations", "working", "runtime", "transient", "peak")


def rank_report(par: Parallel, at: Parallel, time: StepTime | None = None) -> dict[str, Any]:
    """Formulas and values of every kind of rank, its collectives, the worst rank and the step time."""
    ranks = []
    for sym_rank, num in zip(par.ranks, at.ranks, strict=True):
        ranks.append(
            {
                "stage": sym_rank.stage,
                "held": par.held.get(sym_rank.stage, {}),
                "formulas": {f: str(getattr(sym_rank, f)) for f in _FIELDS},
                "bytes": {f: int(getattr(num, f)) for f in _FIELDS},
                "collectives": [
                    {
                        "op": c.op,
                        "group": c.group,
                        "group_size": int(n.size),
                        "phase": c.phase,
                        "what": c.what,
                        "payload": str(c.payload),
                        "payload_bytes": int(n.payload),
                        "count": int(n.count),
                        "wire_bytes": float(n.wire) * int(n.count),
                    }
                    for c, n in zip(sym_rank.collectives, num.collectives, strict=True)
                ],
                "comm_bytes": int(num.comm_bytes()),
                "wire_bytes": float(num.wire_bytes()),
            }
        )
    out: dict[str, Any] = {
        "layout": par.layout.describe(),
        "degrees": par.degrees(),
        "sizes": {k: v for k, v in (at.values or {}).items() if k in ("B", "S")},
        "ranks": ranks,
        "worst_stage": at.worst().stage,
        "notes": par.notes,
    }
    if time is not None:
        out["time"] = {
            "step_seconds": time.seconds,
            "compute_seconds": time.compute,
            "bubble_seconds": time.bubble,
            "exposed_comm_seconds": time.exposed,
            "comm_seconds": time.comm,
            "optimizer_seconds": time.optimizer,
            "tokens_per_s": time.tokens_per_s,
            "mfu": time.mfu,
            "assumptions": time.assumptions,
        }
    return out


def print_ranks(report: dict[str, Any]) -> None:
    c = console()
    t = Table(title=f"per rank: {report['layout']} at {report['sizes']}", box=box.SIMPLE)
    t.add_column("rank")
    for f in _FIELDS:
        t.add_column(f, justify="right")
    t.add_column("sent on the wire", justify="right")
    for r in report["ranks"]:
        mark = " (worst)" if r["stage"] == report["worst_stage"] else ""
        t.add_row(r["stage"] + mark, *[si(r["bytes"][f], "B") for f in _FIELDS], si(r["wire_bytes"], "B"))
    c.print(t)
    worst = next(r for r in report["ranks"] if r["stage"] == report["worst_stage"])
    for f in _FIELDS:
        c.print(f"  {f} = {worst['formulas'][f]}")
    ct = Table(title=f"collectives of the {worst['stage']} rank, one step", box=box.SIMPLE)
    for col in ("op", "group", "n", "phase", "what", "payload", "count"):
        ct.add_column(col, justify="right" if col in ("n", "count") else "left")
    for co in worst["collectives"]:
        ct.add_row(
            co["op"],
            co["group"],
            str(co["group_size"]),
            co["phase"],
            co["what"],
            f"{co['payload']} = {si(co['payload_bytes'], 'B')}",
            str(co["count"]),
        )
    c.print(ct)
    if "time" in report:
        tm = report["time"]
        c.print(
            f"step {tm['step_seconds']:.4g} s (compute {tm['compute_seconds']:.4g}, bubble {tm['bubble_seconds']:.4g}, "
            f"exposed communication {tm['exposed_comm_seconds']:.4g}, optimizer {tm['optimizer_seconds']:.4g}); "
            f"{tm['tokens_per_s']:.4g} tokens/s; MFU {tm['mfu']:.1%}"
        )
        for a in tm["assumptions"]:
            c.print(f"  assuming {a}")
    for n in report["notes"]:
        c.print(f"  note: {n}")


def print_plan(rows: list[PlanRow], top: int, header: str) -> None:
    c = console()
    t = Table(title=header, box=box.SIMPLE)
    variants = any(r.variant for r in rows)
    for col in (
        "#",
        *(("model",) if variants else ()),
        "dp",
        "tp",
        "pp",
        "cp",
        "data parallel",
        "schedule",
        "B",
        "m",
        "peak/GPU",
        "worst",
        "fits",
        "step s",
        "tokens/s",
        "MFU",
    ):
        t.add_column(col, justify="left" if col in ("model", "data parallel", "schedule", "worst", "fits") else "right")
    for i, r in enumerate(rows[:top], 1):
        lay = r.layout
        mode = lay.dp_mode + (f" shard {lay.hsdp_shard}" if lay.hsdp_shard else "")
        sched = (
            f"{lay.schedule}" + (f" v={lay.stages_per_rank}" if lay.stages_per_rank > 1 else "") if lay.pp > 1 else "-"
        )
        t.add_row(
            str(i),
            *((r.variant or "",) if variants else ()),
            str(lay.dp),
            str(lay.tp) + (" sp" if lay.sequence_parallel else ""),
            str(lay.pp),
            str(lay.cp),
            mode,
            sched,
            str(r.micro_batch),
            str(lay.micro_batches),
            si(r.peak, "B"),
            r.worst_stage,
            "yes" if r.fits else "no",
            f"{r.seconds:.4g}",
            f"{r.tokens_per_s:.4g}",
            f"{r.mfu:.1%}",
        )
    c.print(t)


def pareto(rows: list[PlanRow]) -> list[PlanRow]:
    """The layouts no other beats on both peak memory and step time."""
    front = []
    for r in sorted(rows, key=lambda r: (r.seconds, r.peak)):
        if not front or r.peak < front[-1].peak:
            front.append(r)
    return front


def plot_plan(rows: list[PlanRow], capacity: float, path: Path, title: str) -> list[Path]:
    """Peak per GPU against step time, every layout a point, the Pareto front a line, the capacity a rule."""
    from symacct.report.plots import _figure, _save

    fig, ax = _figure()
    ax.scatter([r.seconds for r in rows], [r.peak / 1e9 for r in rows], s=10, alpha=0.5, label="layouts")
    front = pareto(rows)
    ax.plot([r.seconds for r in front], [r.peak / 1e9 for r in front], "o-", color="C3", label="Pareto front")
    ax.axhline(capacity / 1e9, color="k", linestyle="--", linewidth=1, label="capacity (less reserve)")
    ax.set_xlabel("step time (s)")
    ax.set_ylabel("peak memory per GPU (GB)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    return _save(fig, path)
