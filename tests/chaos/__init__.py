"""Fault-and-attack suite: fast cases run in ``make test``, long ones (marked ``chaos``) in
``make chaos``."""
