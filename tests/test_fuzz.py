"""Fuzzer: random models must match PyTorch's counters exactly or be refused with a SymacctError.

The CI profile draws a few dozen models; ``python -m symacct.measure.fuzz --n 2000``
(or SYMACCT_PROFILE=thorough) runs the thorough one and prints counts and
reasons. It found, and symacct now corrects, a stride difference between
the meta and the CPU kernel of batch norm (see symacct/trace/record.py).
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from symacct.measure.fuzz import LAYERS, check


@given(
    kinds=st.lists(st.sampled_from(LAYERS), min_size=1, max_size=6),
    C=st.sampled_from([2, 4, 6, 8, 10, 12]),
    vocab=st.sampled_from([None, 17, 50]),
    sizes=st.lists(st.tuples(st.integers(2, 5), st.integers(2, 9)), min_size=1, max_size=2),
)
def test_random_models_match_or_are_refused(kinds, C, vocab, sizes):
    out = check(kinds, C, vocab, sizes)
    assert out.status in ("matched", "refused"), out.detail
    if out.status == "refused":
        assert out.detail  # the SymacctError's message says what and where


def test_fuzz_script_reports_counts(capsys):
    from symacct.measure.fuzz import main

    assert main(["--n", "5", "--seed", "3"]) == 0
    assert "generated 5 models" in capsys.readouterr().out


def test_a_crashing_rule_is_a_failure_not_a_refusal(monkeypatch):
    """A SymacctError is a pass only when it refuses by design: a cost rule that crashes fails the fuzzer."""
    from symacct.cost.rules import registry

    def broken(call):
        raise ZeroDivisionError("a bug in a rule")

    by_op = dict(registry._BY_OP)
    by_op[torch.ops.aten.addmm] = broken
    monkeypatch.setattr(registry, "_BY_OP", by_op)
    out = check(["linear"], 4, None, [(2, 3)])
    assert out.status == "FAILED" and "a bug in a rule" in out.detail
    monkeypatch.undo()
    assert check(["linear"], 4, None, [(2, 3)]).status == "matched"


def test_a_refusal_by_design_is_not_a_failure():
    """A model whose loss needs no gradient (no parameter on its path) is refused by design."""
    out = check(["relu"], 4, None, [(2, 3)])
    assert out.status == "refused" and "does not require grad" in out.detail
