"""Pure decision logic of FleetBroker: throughput model, elastic DP allocator, baselines, placement.

Nothing in this package does I/O or imports ``broker`` or ``providers``.
"""
