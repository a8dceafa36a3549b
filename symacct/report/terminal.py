"""Terminal output with rich: tables for sheets and verdicts, a spinner for slow work.

Not a terminal (a pipe, a file, a test): no colour, no spinner, a fixed width
of 160 columns, so what is printed is byte-identical across runs.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

WIDTH = 160


def console() -> Console:
    tty = sys.stdout.isatty()
    return Console(width=None if tty else WIDTH, no_color=not tty, highlight=False, soft_wrap=False)


@contextlib.contextmanager
def progress(message: str) -> Iterator[Any]:
    """A spinner on stderr while slow work runs (only when stderr is a terminal)."""
    if not sys.stderr.isatty():
        yield None
        return
    err = Console(stderr=True)
    with err.status(message) as status:
        yield status


def print_sheet(sheet: dict[str, Any]) -> None:
    """The sheet as rich tables: formulas in the fixed text layout, values exact and abbreviated."""
    from symacct.report.sheet import columns, si, title

    out = console()
    out.print(f"symacct sheet {sheet['model']}  ({title(sheet)})")
    t = Table("symbol", "meaning", "config field", "value", box=box.SIMPLE, title="notation", title_justify="left")
    for n in sheet["notation"]:
        t.add_row(n["symbol"], n["meaning"], n["field"], f"{n['value']:,}")
    out.print(t)
    cols = columns(sheet)
    for comp in sheet["components"]:
        t = Table(
            "module", *(label for _, label in cols), box=box.SIMPLE, title=comp["component"], title_justify="left"
        )
        t.columns[0].no_wrap = True
        for r in [*comp["rows"], {"module": "subtotal", **comp["subtotal"]}]:
            cells = []
            for k, _ in cols:
                e = r.get(k)
                cells.append("" if not e or e["formula"] == "0" else f"{e['formula']}\n= {si(e['value'])}")
            t.add_row(r["module"], *cells)
        out.print(t)
    t = Table("quantity", "formula", "value", box=box.SIMPLE, title="totals", title_justify="left")
    for row in sheet["totals"]:
        t.add_row(row["label"], row["formula"], f"{row['value']:,}")
    out.print(t)
    tm = sheet["time"]
    out.print(
        f"one {tm['hardware']} ({tm['dtype']} dense peak): step {tm['seconds_at_mfu']:.4g} s at MFU {tm['mfu']:g}, "
        f"{tm['roofline_seconds']:.4g} s by per-op roofline; every step's peak memory "
        f"{'fits' if tm['peak_fits'] else 'does not fit'} in {tm['memory_gb']:g} GB"
    )
    for n in sheet["notes"]:
        out.print(f"note: {n}")


def print_claims(claims: list[dict[str, Any]]) -> None:
    out = console()
    t = Table("claim", "the seed says", "derived", "verdict", box=box.SIMPLE, show_lines=True)
    for c in claims:
        t.add_row(
            c["claim"], c["seed"], c["derived"], c["verdict"] + (f"\n{c['correction']}" if c["correction"] else "")
        )
    out.print(t)
