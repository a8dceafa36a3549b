"""Printing formulas for people: LaTeX and plain text with one fixed layout.

Conventions (every sheet, report and notebook view uses them):

- a formula is expanded, then its terms are grouped by their power of L, so
  the layer stack reads ``L (...) + ...``;
- terms are ordered leading first: by their value at the given sizes when
  sizes are given, otherwise by total degree; ties by the printed text, so
  the output never depends on hashing or on sympy's internal order;
- inside a monomial the symbols follow ``symbols.ORDER`` (B, S, L, D, H,
  H_kv, F, V, S_max, then others alphabetically); negative powers go to a
  denominator;
- a term whose value is below ``NEGLIGIBLE`` of the whole formula's value is
  negligible: grey in LaTeX (``{\\color{gray} ...}``), and listed by
  ``negligible_terms``;
- ``Max(a, b, ...)`` prints as ``\\max(a, b, ...)`` with each argument laid
  out the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import sympy

from symacct.symbols import sort_key

NEGLIGIBLE = 0.01  # a term below 1 % of the formula's value is marked negligible

_SUBSCRIPTS = {"max": r"\max", "kv": r"\mathrm{kv}"}


@dataclass(frozen=True)
class Term:
    """One term: a rational coefficient times a product of symbol powers."""

    coeff: Fraction
    powers: tuple[tuple[str, int], ...]  # in print order

    def degree(self) -> int:
        return sum(p for _, p in self.powers)

    def value(self, values: Mapping[str, int]) -> Fraction:
        v = Fraction(self.coeff)
        for name, p in self.powers:
            v *= Fraction(values[name]) ** p
        return v


def _terms(expr: sympy.Expr) -> list[Term] | None:
    """The terms of an expanded polynomial-like expression; None for anything else."""
    out = []
    for t in sympy.Add.make_args(sympy.expand(expr)):
        coeff, rest = t.as_coeff_Mul()
        if not coeff.is_Rational:
            return None
        powers: dict[str, int] = {}
        for factor in sympy.Mul.make_args(rest):
            if factor == 1:
                continue
            base, exp = factor.as_base_exp()
            if not isinstance(base, sympy.Symbol) or not exp.is_Integer:
                return None
            powers[base.name] = powers.get(base.name, 0) + int(exp)
        ordered = tuple(sorted(powers.items(), key=lambda kv: sort_key(kv[0])))
        out.append(Term(Fraction(int(coeff.p), int(coeff.q)), ordered))
    return out


def _sym_latex(name: str) -> str:
    head, sep, sub = name.partition("_")
    if not sep:
        return name if len(name) == 1 else rf"\mathrm{{{name}}}"
    return f"{head}_{{{_SUBSCRIPTS.get(sub, sub)}}}"


def _mono(term: Term, tex: bool, unit_coeff: bool = True) -> str:
    num = [(n, p) for n, p in term.powers if p > 0]
    den = [(n, -p) for n, p in term.powers if p < 0]
    c = abs(term.coeff)

    def part(items: list[tuple[str, int]], k: int) -> str:
        if tex:
            body = " ".join(_sym_latex(n) + (f"^{{{p}}}" if p != 1 else "") for n, p in items)
        else:
            body = "*".join(n + (f"**{p}" if p != 1 else "") for n, p in items)
        if k != 1 or not body:
            body = (f"{k} " if tex else f"{k}*") + body if body else str(k)
        return body

    top, bottom = part(num, c.numerator), part(den, c.denominator)
    if bottom == "1":
        return top
    if tex:
        return rf"\frac{{{top}}}{{{bottom}}}"
    return f"{top}/({bottom})" if "*" in bottom else f"{top}/{bottom}"


def _join(pieces: list[tuple[str, Fraction]]) -> str:
    out = ""
    for i, (text, sign_src) in enumerate(pieces):
        neg = sign_src < 0
        if i == 0:
            out = ("-" if neg else "") + text
        else:
            out += (" - " if neg else " + ") + text
    return out


def _layout(expr: sympy.Expr, values: Mapping[str, int] | None, tex: bool) -> str:
    e = sympy.sympify(expr)
    if isinstance(e, sympy.Max):
        args = [_layout(a, values, tex) for a in e.args]
        args.sort()
        return (r"\max\left(" if tex else "Max(") + ", ".join(args) + (r"\right)" if tex else ")")
    terms = _terms(e)
    if terms is None:
        return sympy.latex(e) if tex else sympy.sstr(e)
    if not terms or e == 0:
        return "0"
    total = sum((t.value(values) for t in terms), Fraction(0)) if values is not None else None

    def strip_l(t: Term) -> tuple[int, Term]:
        k = dict(t.powers).get("L", 0)
        return k, Term(t.coeff, tuple((n, p) for n, p in t.powers if n != "L"))

    groups: dict[int, list[tuple[Term, Term]]] = {}
    for t in terms:
        k, inner = strip_l(t)
        groups.setdefault(k if k > 0 else 0, []).append((t, inner))

    def weight(ts: list[Term]) -> tuple:
        if values is not None:
            return (-abs(sum((t.value(values) for t in ts), Fraction(0))),)
        return (-max(t.degree() for t in ts),)

    def fmt_term(t: Term, inner: Term) -> str:
        text = _mono(inner, tex)
        if tex and total and abs(t.value(values)) < NEGLIGIBLE * abs(total):  # type: ignore[arg-type]
            text = rf"{{\color{{gray}} {text}}}"
        return text

    blocks: list[tuple[tuple, str, Fraction]] = []
    for k, members in groups.items():
        members.sort(key=lambda m: (*weight([m[0]]), _mono(m[1], tex)))
        if k == 0 or len(members) == 1:
            for t, _inner in members:
                blocks.append(((*weight([t]), _mono(t, tex)), fmt_term(t, t), t.coeff))
            continue
        body = _join([(fmt_term(t, inner), inner.coeff) for t, inner in members])
        lpow = ("L" if k == 1 else f"L^{{{k}}}") if tex else ("L" if k == 1 else f"L**{k}")
        text = rf"{lpow} \left({body}\right)" if tex else f"{lpow}*({body})"
        blocks.append(((*weight([m[0] for m in members]), text), text, Fraction(1)))
    blocks.sort(key=lambda b: b[0])
    return _join([(text, sign) for _, text, sign in blocks])


def latex(expr: Any, values: Mapping[str, int] | None = None) -> str:
    """LaTeX of a formula in the fixed layout; with ``values``, leading terms first and negligible ones grey."""
    return _layout(sympy.sympify(expr), values, tex=True)


def text(expr: Any, values: Mapping[str, int] | None = None) -> str:
    """The same layout as plain text (``**`` for powers), for terminals and JSON."""
    return _layout(sympy.sympify(expr), values, tex=False)


def negligible_terms(expr: Any, values: Mapping[str, int]) -> list[str]:
    """Terms (as text) whose value is below ``NEGLIGIBLE`` of the formula's value at ``values``."""
    terms = _terms(sympy.sympify(expr))
    if not terms:
        return []
    total = sum((t.value(values) for t in terms), Fraction(0))
    if total == 0:
        return []
    small = [t for t in terms if abs(t.value(values)) < NEGLIGIBLE * abs(total)]
    return [("-" if t.coeff < 0 else "") + _mono(t, tex=False) for t in small]


def si(v: float, unit: str = "") -> str:
    """1234567 -> '1.23 M' (decimal prefixes; GB = 10^9 bytes)."""
    for prefix, scale in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.3g} {prefix}{unit}".rstrip()
    return f"{v:g} {unit}".rstrip()


# ---- the overview of an accounting (its notebook display) ----------------------------------

_OVERVIEW = (
    ("params", "N", "parameters"),
    ("flops.forward", r"C_{\mathrm{fwd}}", "matmul FLOPs, forward"),
    ("flops.backward", r"C_{\mathrm{bwd}}", "matmul FLOPs, backward"),
    ("flops.total", r"C_{\mathrm{step}}", "matmul FLOPs, step"),
    ("flops.other", r"C_{\mathrm{other}}", "other FLOPs, step"),
    ("memory.params", r"M_{\mathrm{params}}", "memory: parameters (bytes)"),
    ("memory.grads", r"M_{\mathrm{grads}}", "memory: gradients (bytes)"),
    ("memory.optimizer", r"M_{\mathrm{opt}}", "memory: optimizer states (bytes)"),
    ("memory.activations", r"M_{\mathrm{act}}", "memory: saved activations (bytes)"),
    ("memory.peak", r"M_{\mathrm{peak}}", "memory: peak of the step (bytes)"),
)


def _overview(acct: Any) -> list[tuple[str, str, str]]:
    """(symbol, label, LaTeX of the formula or of the value) for the main quantities."""
    rows = []
    for key, symbol, label in _OVERVIEW:
        e = acct.formula(key)
        if acct.values is not None and e.is_Integer:
            body = f"{int(e):,}".replace(",", r"{,}")
        else:
            body = latex(e)
        rows.append((symbol, label, body))
    return rows


def overview_md(acct: Any) -> str:
    head = "| quantity | | formula |" if acct.values is None else "| quantity | | value |"
    at = ""
    if acct.values is not None:
        at = "at " + ", ".join(f"{k} = {v:,}" for k, v in sorted(acct.values.items(), key=lambda kv: sort_key(kv[0])))
        at += "\n\n"
    lines = [at + head, "|---|---|---|"]
    for symbol, label, body in _overview(acct):
        lines.append(f"| {label} | ${symbol}$ | ${body}$ |")
    return "\n".join(lines) + "\n"


def overview_latex(acct: Any) -> str:
    body = r" \\ ".join(f"{symbol} &= {tex}" for symbol, _, tex in _overview(acct))
    return rf"$$\begin{{aligned}} {body} \end{{aligned}}$$"
