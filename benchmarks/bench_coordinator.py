"""Coordinator latencies on a private Redis, measured side by side in one run.

1. report -> new schedule version: every rank of a job reports its result; time until the
   next version is visible to a client (coordinator thread + one rq worker), with a forking
   `perseus worker` and with `perseus worker --simple`. The scheduler is
   `tests.toy_schedulers:StepDown`, which changes the clocks every round, so that every round
   publishes a version.
2. rq round trip of a task that imports the planner (lowtime): forking worker with the
   scheduler modules preloaded (the default) against `--no-preload`.

    python benchmarks/bench_coordinator.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import redis
from rq import Queue, Worker

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coordinator.embedded import EmbeddedRedis  # noqa: E402
from coordinator.service import Coordinator  # noqa: E402
from coordinator.settings import PerseusSettings  # noqa: E402
from protocol import keys  # noqa: E402
from protocol.models import JobInfo, ProfilingResult, RankInfo  # noqa: E402
from worker_client.hook.session import CoordinatorClient  # noqa: E402

FREQS = list(range(1980, 344, -15))


def start_worker(url: str, *flags: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "coordinator.cli",
            "worker",
            "--redis-url",
            url,
            "--log-level",
            "WARNING",
            *flags,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    conn = redis.Redis.from_url(url)
    deadline = time.monotonic() + 60
    while not Worker.all(connection=conn) and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=20)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report_to_version(url: str, rounds: int, pp: int = 4) -> list[float]:
    client = CoordinatorClient(url)
    job_id = client.register_job(JobInfo(pp_degree=pp, dp_degree=1, tp_degree=1, world_size=pp))
    for rank in range(pp):
        client.register_rank(
            job_id,
            RankInfo(rank=rank, dp_rank=0, pp_rank=rank, tp_rank=0, available_frequencies=FREQS),
        )
    version = client.wait_schedule(job_id, 0, timeout=60).version
    latencies = []
    for _ in range(rounds):
        start = time.perf_counter()
        for rank in range(pp):
            client.report(
                job_id,
                ProfilingResult(
                    rank=rank, schedule_version=version, iter_time=[1.0], iter_energy=[1.0]
                ),
            )
        version = client.wait_schedule(job_id, 0, newer_than=version, timeout=60).version
        latencies.append(time.perf_counter() - start)
    return latencies


def import_round_trips(url: str, rounds: int) -> list[float]:
    queue = Queue(keys.RQ_QUEUE, connection=redis.Redis.from_url(url))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        job = queue.enqueue("benchmarks.bench_tasks.import_planner")
        while job.get_status(refresh=True) not in ("finished", "failed"):
            time.sleep(0.002)
        assert job.get_status() == "finished", job.exc_info
        times.append(time.perf_counter() - start)
    return times


def row(name: str, values: list[float]) -> str:
    ms = [v * 1000 for v in values]
    return (
        f"  {name:<44} median {statistics.median(ms):8.1f} ms   p90 "
        f"{percentile(ms, 0.9):8.1f} ms   n={len(ms)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    with EmbeddedRedis() as server:
        settings = PerseusSettings(
            redis_url=server.url, scheduler="tests.toy_schedulers:StepDown", log_level="WARNING"
        )
        coordinator = Coordinator(redis.Redis.from_url(server.url), settings)
        thread = threading.Thread(target=coordinator.run, kwargs={"block_ms": 100}, daemon=True)
        thread.start()
        print(
            f"coordinator benchmark: private Redis, python {sys.version.split()[0]}, "
            f"{os.cpu_count()} cores"
        )
        print("report -> next schedule version visible to the client (4 ranks):")
        for name, flags in (
            ("forking worker (perseus worker)", ()),
            ("SimpleWorker (perseus worker --simple)", ("--simple",)),
        ):
            worker = start_worker(server.url, *flags)
            try:
                print(row(name, report_to_version(server.url, args.rounds)), flush=True)
            finally:
                stop(worker)
        print("rq round trip of a task that imports the planner (lowtime):")
        results = {}
        for name, flags in (
            ("forking worker, schedulers preloaded", ()),
            ("forking worker, --no-preload", ("--no-preload",)),
        ):
            worker = start_worker(server.url, *flags)
            try:
                results[name] = import_round_trips(server.url, max(5, args.rounds // 2))
                print(row(name, results[name]), flush=True)
            finally:
                stop(worker)
        fast, slow = (statistics.median(v) for v in results.values())
        print(f"preloading makes such a job {slow / fast:.1f}x faster")
        coordinator.stop_event.set()
        thread.join(timeout=5)


if __name__ == "__main__":
    main()
