"""Hypothesis profiles: 'ci' (quick, the default: 6 examples a property, the same ones every run) and
'thorough' (on demand: SYMACCT_PROFILE=thorough python -m pytest, 300 random ones)."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("SYMACCT_PROFILE", "ci"))
