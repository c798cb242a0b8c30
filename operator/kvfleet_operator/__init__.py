"""kvfleet_operator: the kopf operator that reconciles InferenceService resources.

Lives in `operator/kvfleet_operator/` (never `operator/__init__.py`, which would shadow the
standard library's `operator` module).
"""
