"""Registrations served by two checkouts' coordinators, side by side, each process pinned.

Unpinned, where the OS runs the client, the coordinator and Redis on a 2-core machine moves a
run's figure by up to 10% (the same checkout against itself gives 0.90-1.12); pinned, two runs
agree within about 2%. That is what a change of a few percent needs. Each side has its own
private Redis on CPU 0 and its `perseus coordinator` (from its checkout) on CPU 1; the client
(this process, this checkout's `CoordinatorClient`) runs on ``--client-cpu``; with
``--own-clients`` each side's client is a process of its own, run from its checkout (a change
to the client then shows). The sides take turns job by job (64 ranks each, who goes first
alternates); the figure is the median job's time per request. No rq worker runs: each job's
first version is queued, never computed, on both sides alike.

    git worktree add /tmp/before <commit>
    python benchmarks/bench_registration_ab.py /tmp/before . [--jobs 40] [--client-cpu 0]
        [--own-clients]
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

# A side's client with --own-clients, run from its checkout: registers a job of RANKS ranks
# for each line read, and answers with the seconds it took.
_OWN_CLIENT = """
import sys, time
from benchmarks.bench_coordinator import register
from worker_client.hook.session import CoordinatorClient
client, ranks = CoordinatorClient(sys.argv[1]), int(sys.argv[2])
for _line in sys.stdin:
    start = time.perf_counter()
    register(client, ranks)
    print(time.perf_counter() - start, flush=True)
"""


class OwnClient:
    """A side's client as a process of its own, from ``tree``, pinned to ``cpu``."""

    def __init__(self, tree: Path, url: str, ranks: int, cpu: int) -> None:
        self.proc = subprocess.Popen(
            ["taskset", "-c", str(cpu), sys.executable, "-c", _OWN_CLIENT, url, str(ranks)],
            env=dict(os.environ, PYTHONPATH=str(tree)),
            cwd=tree,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def job(self) -> float:
        """Register one job; its time, seconds, as the client measured it."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=20)


def timed_job(client: CoordinatorClient | OwnClient, ranks: int) -> float:
    """Seconds one job's registration took (its job and ``ranks`` ranks)."""
    if isinstance(client, OwnClient):
        return client.job()
    start = time.perf_counter()
    register(client, ranks)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path, help="checkout A (its coordinator package is run)")
    parser.add_argument("b", type=Path, help="checkout B")
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--client-cpu", type=int, default=0, choices=(0, 1))
    parser.add_argument(
        "--own-clients", action="store_true", help="each side's client from its checkout"
    )
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs at least 2 CPUs to pin Redis and the coordinator apart")
    os.sched_setaffinity(0, {args.client_cpu})
    sides: list[tuple[Path, EmbeddedRedis, subprocess.Popen, CoordinatorClient | OwnClient, list]]
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
            client: CoordinatorClient | OwnClient = (
                OwnClient(tree, server.url, args.ranks, args.client_cpu)
                if args.own_clients
                else CoordinatorClient(server.url)
            )
            sides.append((tree, server, proc, client, []))
        for _tree, _server, _proc, client, _times in sides:
            timed_job(client, args.ranks)  # warm up: imports, caches, the first stamps
        for job in range(args.jobs):
            for _tree, _server, _proc, client, times in sides if job % 2 == 0 else sides[::-1]:
                times.append(timed_job(client, args.ranks))
        per_request = [statistics.median(s[4]) / (args.ranks + 1) * 1e6 for s in sides]
        whose = "each side's own" if args.own_clients else "this checkout's"
        print(
            f"registrations, {args.jobs} jobs x {args.ranks + 1} requests a side, Redis on "
            f"CPU 0, coordinators on CPU 1, client ({whose}) on CPU {args.client_cpu}:"
        )
        for (tree, *_), value in zip(sides, per_request, strict=True):
            print(f"  {tree!s:<50} {value:7.1f} us per request (median job)")
        print(f"  B / A: {per_request[1] / per_request[0]:.3f}")
    finally:
        for _tree, server, proc, client, _times in sides:
            if isinstance(client, OwnClient):
                client.close()
            stop(proc)
            server.stop()


if __name__ == "__main__":
    main()
