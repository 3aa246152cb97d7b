"""Benchmarks: ``make bench`` runs ``python -m tests.bench``, which runs every ``bench_*.py``."""
