"""Hypothesis profiles: 'ci' (quick, the default: 4 examples a property, the same ones every run; 6 until
the default run passed 20 minutes on these 2 cores) and 'thorough' (on demand: SYMACCT_PROFILE=thorough
python -m pytest, 300 random ones)."""

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=4, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("SYMACCT_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _fresh_memo():
    """Each test derives afresh: a test must not meet a family another test memoised (symacct.memo)."""
    from symacct import memo

    memo.clear()
    yield
    memo.clear()


class _Patching(pytest.MonkeyPatch):
    """pytest's monkeypatch, forgetting memoised derivations at each patch and undo: a patch of symacct or of
    a model between two derivations changes what the second computes, which the memo's key does not see.
    (tests/test_memo.py patches with a plain ``pytest.MonkeyPatch`` where the memo's own reaction is tested.)"""

    def setattr(self, *a, **k):
        super().setattr(*a, **k)
        _forget()

    def setitem(self, *a, **k):
        super().setitem(*a, **k)
        _forget()

    def delattr(self, *a, **k):
        super().delattr(*a, **k)
        _forget()

    def delitem(self, *a, **k):
        super().delitem(*a, **k)
        _forget()

    def undo(self):
        super().undo()
        _forget()


def _forget() -> None:
    from symacct import memo

    memo.clear()


@pytest.fixture
def monkeypatch():
    mp = _Patching()
    yield mp
    mp.undo()
