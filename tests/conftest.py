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
    """Each test derives afresh: a test that patches symacct or a model class must not meet a family memoised
    by another test (symacct.memo; its own tests exercise it)."""
    from symacct import memo

    memo.clear()
    yield
