"""Hypothesis profiles: 'ci' (quick, the default: 4 examples a property, the same ones every run; 6 until
the default run passed 20 minutes on these 2 cores) and 'thorough' (on demand: SYMACCT_PROFILE=thorough
python -m pytest, 300 random ones)."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=4, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("SYMACCT_PROFILE", "ci"))
