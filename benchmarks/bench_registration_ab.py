"""Registrations served by two checkouts' coordinators, side by side, each process pinned.

Unpinned, where the OS runs the client, the coordinator and Redis on a 2-core machine moves a
run's figure by up to 10% (the same checkout against itself gives 0.90-1.12); pinned, two runs
agree within about 2%. That is what a change of a few percent needs. Each side has its own
private Redis on CPU 0 and its `perseus coordinator` (from its checkout) on CPU 1; the client
(this process, this checkout's `CoordinatorClient`) runs on ``--client-cpu``. The sides take
turns job by job (64 ranks each, who goes first alternates); the figure is the median job's
time per request. No rq worker runs: each job's first version is queued, never computed, on
both sides alike.

    git worktree add /tmp/before <commit>
    python benchmarks/bench_registration_ab.py /tmp/before . [--jobs 40] [--client-cpu 0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_coordinator import MICROBATCHES, SCHEDULER, register, stop  # noqa: E402
from coordinator.embedded import EmbeddedRedis  # noqa: E402
from worker_client.hook.session import CoordinatorClient  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path, help="checkout A (its coordinator package is run)")
    parser.add_argument("b", type=Path, help="checkout B")
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--client-cpu", type=int, default=0, choices=(0, 1))
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs at least 2 CPUs to pin Redis and the coordinator apart")
    os.sched_setaffinity(0, {args.client_cpu})
    sides = []
    try:
        for tree in (args.a.resolve(), args.b.resolve()):
            server = EmbeddedRedis()
            os.sched_setaffinity(server.pid, {0})
            command = [sys.executable, "-m", "coordinator.cli", "coordinator"]
            command += ["--scheduler", SCHEDULER, "--scheduler-args"]
            command += [json.dumps({"microbatches": MICROBATCHES}), "--log-level", "WARNING"]
            proc = subprocess.Popen(
                ["taskset", "-c", "1", *command, "--redis-url", server.url],
                env=dict(os.environ, PYTHONPATH=str(tree)),
                cwd=tree,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            sides.append((tree, server, proc, CoordinatorClient(server.url), []))
        for _tree, _server, _proc, client, _times in sides:
            register(client, args.ranks)  # warm up: imports, caches, the first stamps
        for job in range(args.jobs):
            for _tree, _server, _proc, client, times in sides if job % 2 == 0 else sides[::-1]:
                start = time.perf_counter()
                register(client, args.ranks)
                times.append(time.perf_counter() - start)
        per_request = [statistics.median(s[4]) / (args.ranks + 1) * 1e6 for s in sides]
        print(
            f"registrations, {args.jobs} jobs x {args.ranks + 1} requests a side, Redis on "
            f"CPU 0, coordinators on CPU 1, client on CPU {args.client_cpu}:"
        )
        for (tree, *_), value in zip(sides, per_request, strict=True):
            print(f"  {tree!s:<50} {value:7.1f} us per request (median job)")
        print(f"  B / A: {per_request[1] / per_request[0]:.3f}")
    finally:
        for _tree, server, proc, _client, _times in sides:
            stop(proc)
            server.stop()


if __name__ == "__main__":
    main()
