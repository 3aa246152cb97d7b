"""Trace-driven, deterministic cluster simulator: a driver of the live broker's round.

One loop (``spot.SpotRounds``) on a virtual clock, the jobs' physics from the measured tables
(``engine.py``). The decisions are the live broker's: ``driver.py`` runs
``broker.scheduler.plan_round`` every round and carries out its plans, on classic clusters (one
on-demand pool per accelerator type: ``elastic``, ``fixed-batch``, ``static``) and on spot
clusters (markets, regions, traces, cost: ``fleet``). The other policies are baselines, for
comparison only (``baselines.py``): Tiresias on classic clusters, on-demand only and the
SkyPilot-like ones on spot clusters.
"""
