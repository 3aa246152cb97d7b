"""I/O adapters to capacity: measured tables, price catalog, cloud and local providers.

Providers never import ``broker``; they may use the shared types in ``policies.models``.
"""
