"""Portability: judging whether a run moved to other hardware, kernels or layout still trains the same."""

from ferry.portability.comparison.compare import DEFAULT_PROFILE, Verdict, compare_runs
from ferry.portability.comparison.tolerances import ToleranceProfile, tolerance_profile, tolerance_profiles

__all__ = ["DEFAULT_PROFILE", "ToleranceProfile", "Verdict", "compare_runs", "tolerance_profile", "tolerance_profiles"]
