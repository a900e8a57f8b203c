"""Recovery after a Redis restart: how soon the next schedule version is visible again.

A private, persistent Redis (append-only file) runs a coordinator thread and one forking
`perseus worker`. A 4-rank job is at version 1. Redis is then stopped for DOWNTIME seconds and
started again. Each rank reports its result once Redis answers, and the script measures the
time from the restart until version 2 is visible to a client, once for each downtime and trial.
The worker's share of that time is rq's own reconnect backoff.

    python benchmarks/bench_outage.py [--downtimes 1 5 10] [--trials 2]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import threading
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_coordinator import FREQS, start_worker, stop  # noqa: E402
from coordinator.embedded import EmbeddedRedis  # noqa: E402
from coordinator.service import Coordinator  # noqa: E402
from coordinator.settings import PerseusSettings  # noqa: E402
from protocol.models import JobInfo, ProfilingResult, RankInfo  # noqa: E402
from worker_client.hook.session import CoordinatorClient  # noqa: E402

RANKS = 4


def one_trial(downtime: float) -> float:
    """Seconds from Redis being back until version 2 is visible."""
    with EmbeddedRedis(appendonly=True) as server:
        settings = PerseusSettings(
            redis_url=server.url, scheduler="tests.toy_schedulers:StepDown", log_level="ERROR"
        )
        coordinator = Coordinator(redis.Redis.from_url(server.url), settings)
        thread = threading.Thread(target=coordinator.run, kwargs={"block_ms": 100}, daemon=True)
        thread.start()
        worker = start_worker(server.url)
        client = CoordinatorClient(server.url)
        try:
            job = JobInfo(pp_degree=RANKS, dp_degree=1, tp_degree=1, world_size=RANKS)
            job_id = client.register_job(job)
            for rank in range(RANKS):
                info = RankInfo(
                    rank=rank, dp_rank=0, pp_rank=rank, tp_rank=0, available_frequencies=FREQS
                )
                client.register_rank(job_id, info)
            client.wait_schedule(job_id, 0, timeout=60)
            server.restart(downtime=downtime)
            back = time.perf_counter()
            for rank in range(RANKS):
                result = ProfilingResult(
                    rank=rank, schedule_version=1, iter_time=[1.0], iter_energy=[1.0]
                )
                while True:
                    try:
                        client.report(job_id, result)
                        break
                    except redis.ConnectionError:
                        time.sleep(0.01)
            client.wait_schedule(job_id, 0, newer_than=1, timeout=120)
            return time.perf_counter() - back
        finally:
            client.close()
            stop(worker)
            coordinator.stop_event.set()
            thread.join(timeout=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--downtimes", type=float, nargs="+", default=[1.0, 5.0, 10.0])
    parser.add_argument("--trials", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # The coordinator's retry warnings are expected.
    print("Redis restart -> next schedule version visible (persistent Redis, forking worker):")
    for downtime in args.downtimes:
        times = [one_trial(downtime) for _ in range(args.trials)]
        print(
            f"  down {downtime:5.1f} s: median {statistics.median(times):6.2f} s, "
            f"max {max(times):6.2f} s after Redis was back (n={len(times)})",
            flush=True,
        )


if __name__ == "__main__":
    main()
