"""Formulas evaluated without sympy, against sympy.

- ``exact_form`` (each formula compiled once to Python: the planner's and ``Parallel.at``'s evaluation)
  against sympy's own substitution, on drawn expressions with rational coefficients, negative powers,
  ``ceiling``, ``floor``, ``Max``, ``Min`` and ``Mod``: the same exact value (an ``int`` where it is whole).
- ``integer_forms`` (a liveness's distinct formulas compiled into one function) against ``integer_form``
  of each; a liveness's live bytes summed in float64 (where every partial sum is below 2**53) against the
  same in Python integers.
- A point's live bytes as expanded terms (``Liveness.point_terms``, which ``at_point``, the phase points
  and the symbolic peak read) against ``sympy.expand`` of the factored sum it stands for, at every op of a
  derived step.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import sympy
from hypothesis import given
from hypothesis import strategies as st

import symacct
from symacct.memory.liveness import Intervals
from symacct.models.gpt2 import GPT2, GPT2Config
from symacct.symbols import exact_form, integer_form, integer_forms, sym

NAMES = ("B", "S", "D", "dp", "L")


def _leaf() -> st.SearchStrategy[Any]:
    number = st.builds(sympy.Rational, st.integers(-7, 9), st.integers(1, 5))
    return st.one_of(st.sampled_from([sym(n) for n in NAMES]), number)


def _node(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    pair = st.tuples(children, children)
    return st.one_of(
        pair.map(lambda p: p[0] + p[1]),
        pair.map(lambda p: p[0] * p[1]),
        st.tuples(st.sampled_from([sym(n) for n in NAMES]), st.integers(-2, 3)).map(lambda p: p[0] ** p[1]),
        children.map(sympy.ceiling),
        children.map(sympy.floor),
        pair.map(lambda p: sympy.Max(*p)),
        pair.map(lambda p: sympy.Min(*p)),
        children.map(lambda c: sympy.Mod(c, sym("dp"))),
    )


EXPRS = st.recursive(_leaf(), _node, max_leaves=8)


@given(e=EXPRS, values=st.fixed_dictionaries({n: st.integers(1, 10**6) for n in NAMES}))
def test_exact_form_is_sympys_value(e: Any, values: dict[str, int]) -> None:
    want = sympy.sympify(e).xreplace({sym(k): sympy.Integer(v) for k, v in values.items()})
    got = exact_form(sympy.sympify(e))(values)
    assert want.is_Rational
    assert got == Fraction(int(want.p), int(want.q))
    assert isinstance(got, int) == (want.q == 1)


@given(
    exprs=st.lists(EXPRS, min_size=1, max_size=6),
    values=st.fixed_dictionaries({n: st.integers(1, 10**6) for n in NAMES}),
)
def test_integer_forms_are_each_integer_form(exprs: list[Any], values: dict[str, int]) -> None:
    exprs = [sympy.sympify(e) for e in exprs]
    assert integer_forms(tuple(exprs))(values) == [integer_form(e)(values) for e in exprs]


@given(
    spans=st.lists(st.tuples(st.integers(-1, 30), st.integers(0, 40), st.integers(0, 3)), min_size=1, max_size=40),
    scale=st.sampled_from([1, 2**40, 2**60]),
    B=st.integers(1, 2**20),
)
def test_live_bytes_exact_in_float_and_in_integers(spans: list[tuple[int, int, int]], scale: int, B: int) -> None:
    """Storages of bytes B * c * scale over drawn spans: the live bytes at every op equal a direct count,
    whichever path (float64 below 2**53, int64, Python integers) the totals take."""
    formulas = [sym("B") * c * scale for c in range(4)]
    start = {i: float(s) for i, (s, _e, _c) in enumerate(spans)}
    end = {i: float(max(s, e)) for i, (s, e, _c) in enumerate(spans)}
    nbytes = {i: formulas[c] for i, (_s, _e, c) in enumerate(spans)}
    iv = Intervals(32, start, end, nbytes)
    got = iv.live({"B": B})
    for t in range(-1, 32):
        want = sum(B * c * scale for i, (_s, _e, c) in enumerate(spans) if start[i] <= t <= min(end[i], 31))
        assert got[t + 1] == want


def test_point_terms_are_the_expanded_factored_sum() -> None:
    acct = symacct.derive(GPT2(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=40, block_size=16)))
    live = acct.liveness
    assert live is not None and live.other is not None
    L = sym("L")
    for lv in (live, live.steady()):
        for t in range(lv.base.n):
            e = sympy.Add(*(lv.base.nbytes[s] for s in lv.base.alive_at(t)))
            e2 = sympy.Add(*(lv.other.nbytes[s] for s in lv.other.alive_at(lv.align[t])))
            want = sympy.expand(e + (L - lv.layers) * (e2 - e))
            assert lv.at_point(t) == want, t
