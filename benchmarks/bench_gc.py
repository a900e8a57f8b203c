"""Report -> next version with the services' garbage collector as set, against Python's default.

`perseus coordinator` and `perseus worker` call ``coordinator.service_process.tune_gc`` at
start: ``gc.freeze()`` and a young-generation collection every 20,000 container allocations
instead of 700. This runs two long-lived stacks of `bench_coordinator.py` side by side (64
ranks, results shaped as the hook sends them), one as shipped, one whose services put the
threshold back to Python's default after ``tune_gc`` (the freeze stays, so the figure is the
threshold's alone). The stacks take turns version by version and wait for their worker to go
idle, as in `bench_coordinator.py`.

    python benchmarks/bench_gc.py [--versions 300] [--ranks 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import bench_coordinator as bench  # noqa: E402

# The services as shipped, except that the young generation is collected at Python's default.
DEFAULT_THRESHOLD = """
import gc, sys
import coordinator.service_process as sp
shipped = sp.tune_gc
def tune_gc():
    shipped()
    gc.set_threshold(700, 10, 10)
sp.tune_gc = tune_gc
from coordinator.cli import main
sys.argv[0] = "perseus"
main()
"""


def launcher(default_threshold: bool):
    """A replacement for ``bench_coordinator.perseus`` starting the services one way."""

    def start(url: str, *args: str) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        head = ["-c", DEFAULT_THRESHOLD] if default_threshold else ["-m", "coordinator.cli"]
        return subprocess.Popen(
            [sys.executable, *head, *args, "--redis-url", url],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    return start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=300)
    parser.add_argument("--ranks", type=int, default=64)
    args = parser.parse_args()
    stacks = {}
    for name, default in (("as shipped (every 20,000)", False), ("Python's default (700)", True)):
        bench.perseus = launcher(default)  # Stack starts its services through it
        stacks[name] = bench.Stack(name, args.ranks, "long-lived")
    try:
        for version in range(1, args.versions + 1):
            for stack in stacks.values():
                stack.round(version)
                stack.settle()
    finally:
        for stack in stacks.values():
            stack.close()
    print(f"report -> next version visible, {args.ranks} ranks, versions 2-{args.versions}:")
    for name, stack in stacks.items():
        lat = [stack.latencies[v] * 1000 for v in range(2, args.versions + 1)]
        p50, p90 = statistics.median(lat), bench.percentile(lat, 0.9)
        print(f"  young-generation GC {name:<27} p50 {p50:5.1f} ms  p90 {p90:5.1f} ms")


if __name__ == "__main__":
    main()
