"""Kill the rq worker (SIGKILL, whole process group) and the coordinator mid-job; restarted
ones finish the job with nothing lost and no schedule version skipped or duplicated."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from protocol import keys
from protocol.models import JobInfo, ProfilingResult, RankInfo
from protocol.store import JobStore
from tests.helpers import FAST_RECOVERY, start_perseus, wait_for
from worker_client.hook.session import CoordinatorClient
from worker_client.hook.watchers import ScheduleWatcher

FREQS = [1980, 1965, 1950, 1935, 1920]


def kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def test_killed_worker_and_coordinator_lose_nothing(tmp_path, redis_url, r):
    coordinator_args = [
        "coordinator",
        "--redis-url",
        redis_url,
        "--scheduler",
        "tests.toy_schedulers:StepDown",
        "--scheduler-args",
        json.dumps({"delay": 1.5}),
    ]
    worker_args = ["worker", "--redis-url", redis_url]
    coordinator = start_perseus(coordinator_args, tmp_path, "coordinator.log", FAST_RECOVERY)
    worker = start_perseus(worker_args, tmp_path, "worker.log", FAST_RECOVERY)
    store = JobStore(r)
    client = CoordinatorClient(redis_url, reply_timeout=30)
    try:
        job_id = client.register_job(JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2))
        for rank in range(2):
            client.register_rank(
                job_id,
                RankInfo(
                    rank=rank, dp_rank=0, pp_rank=rank, tp_rank=0, available_frequencies=FREQS
                ),
            )
        watcher = ScheduleWatcher(client, job_id, rank=0, version=0)
        seen: list[int] = []
        watcher.start()

        # 1. The worker is computing version 1 (it holds the lease): kill it, and the
        #    coordinator with it.
        wait_for(lambda: store.lease_holder(job_id) is not None, 60, "worker to start v1")
        kill(worker)
        kill(coordinator)
        assert store.version(job_id) == 0

        # 2. Fresh ones take over: the stalled computation is enqueued again.
        coordinator = start_perseus(coordinator_args, tmp_path, "coordinator.log", FAST_RECOVERY)
        worker = start_perseus(worker_args, tmp_path, "worker.log", FAST_RECOVERY)
        wait_for(lambda: store.version(job_id) == 1, 60, "version 1")

        # 3. Results arrive while no coordinator runs; they wait in the stream.
        kill(coordinator)
        for rank in range(2):
            client.report(
                job_id,
                ProfilingResult(rank=rank, schedule_version=1, iter_time=[1.0], iter_energy=[5.0]),
            )
        coordinator = start_perseus(coordinator_args, tmp_path, "coordinator.log", FAST_RECOVERY)

        # 4. Kill the worker again while it computes version 2.
        wait_for(
            lambda: store.result_count(job_id, 1) == 2 and store.lease_holder(job_id),
            timeout=60,
            what="worker to start v2",
        )
        kill(worker)
        worker = start_perseus(worker_args, tmp_path, "worker.log", FAST_RECOVERY)
        wait_for(lambda: store.version(job_id) == 2, 60, "version 2")
        wait_for(
            lambda: (
                (s := watcher.take()) is not None
                and seen.append(s.version) is None
                and s.version == 2
            ),
            timeout=10,
            what="watcher to see version 2",
        )
        watcher.stop()
    finally:
        for proc in (worker, coordinator):
            if proc.poll() is None:
                kill(proc)

    journal = store.journal(job_id)
    assert [e.version for e in journal] == [1, 2]
    assert [e.observed_version for e in journal] == [None, 1]
    published = [int(f[b"version"]) for _, f in r.xrange(keys.job_updates(job_id))]
    assert published == [1, 2]  # none skipped, none twice
    assert len(store.results(job_id, 1)) == 2
    assert store.schedule(job_id, 2, 1).frequencies[0] == ("forward", 1965)
    for stream in keys.INPUT_STREAMS:
        assert r.xpending(stream, keys.COORDINATOR_GROUP)["pending"] == 0
    assert r.xlen(keys.DEADLETTER_STREAM) == 0


@pytest.mark.parametrize("mode", [[], ["--fork"]], ids=["long-lived", "fork"])
def test_a_cold_shutdown_mid_task_releases_the_lease(tmp_path, redis_url, r, mode):
    # A second SIGTERM (rq's cold shutdown) ends the running advance task with SystemExit: the
    # lease must be released on the way out, not left to expire while no worker computes.
    # The forking worker kills the task's work horse (SIGKILL), which can release nothing: the
    # worker releases its lease once it has reaped it (the job waited out the 10 s lease).
    coordinator = start_perseus(
        [
            "coordinator",
            "--redis-url",
            redis_url,
            "--scheduler",
            "tests.toy_schedulers:StepDown",
            "--scheduler-args",
            json.dumps({"delay": 30}),
        ],
        tmp_path,
        "coordinator.log",
    )
    worker = start_perseus(["worker", "--redis-url", redis_url, *mode], tmp_path, "worker.log")
    store = JobStore(r)
    client = CoordinatorClient(redis_url, reply_timeout=30)
    try:
        job_id = client.register_job(JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1))
        client.register_rank(
            job_id, RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=FREQS)
        )
        wait_for(lambda: store.lease_holder(job_id) is not None, 60, "worker to start v1")
        worker.send_signal(signal.SIGTERM)  # warm: stop after the task
        wait_for(lambda: "warm shut down requested" in (tmp_path / "worker.log").read_text())
        time.sleep(1.2)  # rq ignores a second signal within a second of the first
        worker.send_signal(signal.SIGTERM)  # cold: the task ends now
        worker.wait(timeout=10)
        assert store.lease_holder(job_id) is None
    finally:
        client.close()
        for proc in (worker, coordinator):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
