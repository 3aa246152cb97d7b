"""I/O adapters to capacity: measured tables, price catalog, cloud and local providers.

Of ``broker`` providers import only its contracts, ``broker.protocol`` and ``broker.errors``; they
may use the shared types in ``policies.models``.
"""
