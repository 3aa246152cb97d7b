"""Run every ``tests/bench/bench_*.py`` main(), or those whose names contain an argument."""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    names = sorted(p.stem for p in Path(__file__).parent.glob("bench_*.py"))
    chosen = [n for n in names if not argv or any(a in n for a in argv)]
    if not chosen:
        print(f"no benchmark matches {argv}; have {', '.join(names)}", file=sys.stderr)
        return 2
    for name in chosen:
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        importlib.import_module(f"tests.bench.{name}").main()
        print(f"== {name} done in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
