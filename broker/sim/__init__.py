"""Trace-driven, deterministic cluster simulator.

Two parts. The classic simulation (``engine.py``) replays Pollux/Sia workloads under the
allocation policies of ``policies.schedulers`` (elastic, fixed-batch, static, Tiresias) on one pool
per accelerator type. The spot simulation (``spot.py``) adds markets, regions, traces and cost:
its ``fleet`` policy is a driver of the live broker's scheduling round (``driver.py`` runs
``broker.scheduler.plan_round`` on a virtual clock); its other policies (on-demand only and the
SkyPilot-like ones) are baselines, for comparison only.
"""
