"""`python -m bench` (`make bench`): every component's benchmark, one after the other."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path


def main() -> int:
    names = sorted(
        m.name
        for m in pkgutil.iter_modules([str(Path(__file__).parent)])
        if not m.name.startswith("_")
    )
    status = 0
    for name in names:
        print(f"\n=== bench.{name} ===", flush=True)
        module = importlib.import_module(f"bench.{name}")
        status |= int(module.main([]) or 0)
    return status


if __name__ == "__main__":
    sys.exit(main())
