"""Run every ``tests/bench/bench_*.py`` module's ``main()`` (or only those named on the line)."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path


def main(selected: list[str]) -> None:
    here = Path(__file__).parent
    names = sorted(m.name for m in pkgutil.iter_modules([str(here)]) if m.name.startswith("bench_"))
    for name in names:
        if selected and name not in selected and name.removeprefix("bench_") not in selected:
            continue
        print(f"\n## {name}\n", flush=True)
        importlib.import_module(f"tests.bench.{name}").main()


if __name__ == "__main__":
    main(sys.argv[1:])
