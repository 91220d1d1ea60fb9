"""Shared pytest settings: Hypothesis profiles (a fixed, derandomised one for CI)."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", derandomize=True, max_examples=200, suppress_health_check=[HealthCheck.too_slow]
)
# Input generation is timed against the wall clock; on a loaded machine that check fails
# tests whose inputs are fine, so neither profile makes it.
settings.register_profile("dev", max_examples=100, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))
