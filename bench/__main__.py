"""`make bench`: run every benchmark, print a summary table, exit 1 if any requirement is missed.

python -m bench                 # all
python -m bench local_cluster   # one (its module name without bench_)
"""

import importlib
import pkgutil
import signal
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table


def discover() -> list[str]:
    here = Path(__file__).parent
    return sorted(m.name[len("bench_") :] for m in pkgutil.iter_modules([str(here)]) if m.name.startswith("bench_"))


def main(argv: list[str]) -> int:
    # A benchmark killed by `timeout` or CI still runs its `finally` blocks (clusters get taken down).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    names = argv or discover()
    console = Console(highlight=False)
    results = []
    for name in names:
        console.rule(f"bench_{name}")
        module = importlib.import_module(f"bench.bench_{name}")
        started = time.perf_counter()
        for check in module.run():
            results.append((name, check))
        console.print(f"({time.perf_counter() - started:.0f} s)")
    table = Table(title="benchmarks")
    for column in ("bench", "measure", "figure", "requirement", "ok"):
        table.add_column(column)
    for name, check in results:
        table.add_row(name, check.measure, check.figure, check.requirement, "yes" if check.ok else "NO")
    console.print(table)
    return 0 if all(check.ok for _, check in results) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main(sys.argv[1:]))
