"""Benchmarks: ``python -m tests.bench`` (``make bench``) runs every ``bench_*.py`` main()."""
