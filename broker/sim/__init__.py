"""Trace-driven, deterministic cluster simulator.

The same policies as the live broker (``policies/``), on a virtual clock.
"""
