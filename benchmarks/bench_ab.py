"""Report -> next version of two checkouts, side by side: is a change to the version path faster?

A change worth 0.5 ms of a 13 ms version drowns in this machine's drift (the same code gives
13 ms one minute and 18 ms the next). This runs the long-lived stack of
`bench_coordinator.py` (private Redis, `perseus coordinator`, one `perseus worker`, a 64-rank
job whose results are shaped as the hook sends them) once per source tree, and the stacks take
turns version by version (who goes first alternates), each waiting until its worker is idle, so
drift hits both alike. Each tree's services run from that tree (``cwd`` and ``PYTHONPATH``);
the client side (results, tokens, timing) is this checkout's.

Printed per tree: p25/p50/p75 of report -> next version visible (from version 3), and CPU
per version of the client, coordinator, worker and Redis until the version is visible. Run a
tree against itself to see the noise: the two rows then differ by the noise alone.

    git worktree add /tmp/before HEAD~1
    python benchmarks/bench_ab.py /tmp/before . [--versions 200] [--ranks 64]
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


def start_stack(tree: Path, ranks: int) -> bench.Stack:
    """A long-lived stack whose coordinator and worker run ``tree``'s code."""

    def perseus(url: str, *args: str) -> subprocess.Popen:
        # ``python -m`` puts the working directory first on sys.path: it picks the tree.
        env = dict(os.environ, PYTHONPATH=str(tree))
        return subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", *args, "--redis-url", url],
            cwd=tree,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    bench.perseus = perseus  # start_worker/_coordinator use it
    return bench.Stack(str(tree), ranks, "long-lived")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs=2, type=Path, help="two source trees (A, then B)")
    parser.add_argument("--versions", type=int, default=200)
    parser.add_argument("--ranks", type=int, default=64)
    args = parser.parse_args()
    trees = [tree.resolve() for tree in args.trees]
    for tree in trees:
        if not (tree / "coordinator" / "cli.py").is_file():
            parser.error(f"{tree}: not a perseus-mq source tree (no coordinator/cli.py)")
    print(
        f"A/B of report -> next version: {args.ranks} ranks, {args.versions} versions, "
        f"{os.cpu_count()} cores; the stacks take turns version by version"
    )
    stacks: list[bench.Stack] = []
    try:
        for tree in trees:
            stacks.append(start_stack(tree, args.ranks))
        for version in range(1, args.versions + 1):
            for stack in stacks if version % 2 else stacks[::-1]:
                stack.round(version)
                stack.settle()
        print("\n  ms:      p25     p50     p75    CPU per version until visible (ms):")
        print(f"  {'':<29}  client   coord  worker   Redis   tree")
        medians = []
        for name, stack in zip("AB", stacks, strict=True):
            values = [t * 1000 for v, t in sorted(stack.latencies.items()) if v >= 3]
            q1, median, q3 = statistics.quantiles(values, n=4)
            medians.append(median)
            cpu = "".join(f"{c / args.versions * 1000:8.2f}" for c in stack.cpu_visible)
            print(f"  {name:<5}{q1:8.2f}{median:8.2f}{q3:8.2f}   {cpu}   {stack.name}")
        print(f"\n  B's p50 / A's: {medians[1] / medians[0]:.3f}")
    finally:
        for stack in stacks:
            stack.close()


if __name__ == "__main__":
    main()
