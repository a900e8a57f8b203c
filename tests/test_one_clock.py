"""One clock: idle GC, stall detection and activity stamps use the Redis server's time."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import rq.utils
from rq import Queue

from coordinator.service import Coordinator
from coordinator.tasks import advance_job
from coordinator.worker_loop import PerseusSimpleWorker, PerseusWorker
from protocol import keys
from protocol.deadletter import purge
from protocol.models import JobConfig, JobInfo, RankInfo
from protocol.store import JobStore
from protocol.tokens import new_token
from tests.helpers import (
    FREQS,
    TOY_SCHEDULER,
    make_settings,
    register,
    result,
    running,
    start_perseus,
    stop,
    wait_for,
)
from worker_client.hook.session import CoordinatorClient

EIGHT_DAYS = 8 * 86400


def new_job(
    store: JobStore, job_id: str, world: int = 1, delay: float = 0.0
) -> dict[tuple[str, int], str]:
    """Create a job with its ranks registered; return their tokens, as a client keeps them.

    ``delay`` is the seconds each of its versions takes to compute.
    """
    job = JobInfo(job_id=job_id, pp_degree=world, dp_degree=1, tp_degree=1, world_size=world)
    config = JobConfig(scheduler=TOY_SCHEDULER, scheduler_args={"delay": delay} if delay else {})
    store.create_job(job, config, f"1-{len(job_id)}")
    tokens = {}
    for rank in range(world):
        info = RankInfo(rank=rank, dp_rank=0, pp_rank=rank, tp_rank=0, available_frequencies=FREQS)
        tokens[(job_id, rank)] = new_token()
        store.add_rank(job, info, token=tokens[(job_id, rank)])
    return tokens


def activity(store: JobStore, job_id: str) -> float:
    (score,) = [s for j, s in store.list_jobs() if j == job_id]
    return score


@contextmanager
def _a_task_running(r: Any, redis_url: str, tmp_path: Path) -> Iterator[Queue]:
    """A job whose version takes 8 s to compute, its task started by a `perseus worker`.

    Yields the queue once the task runs. At the end, the task must go on to publish
    version 1 and no task may have failed; the worker is stopped whatever happens.
    """
    store = JobStore(r)
    new_job(store, "slow", delay=8.0)
    coordinator = Coordinator(r, make_settings(redis_url))
    coordinator.enqueue_advance("slow")
    worker = start_perseus(["worker", "--redis-url", redis_url], tmp_path, "worker.log")
    try:
        queue = coordinator.queue
        started = queue.started_job_registry
        wait_for(lambda: started.get_job_ids(cleanup=False), 30, "the task to start")
        yield queue
        wait_for(lambda: store.version("slow") == 1, 30, "version 1")
    finally:
        stop([worker])
    assert queue.failed_job_registry.get_job_ids() == []


@contextmanager
def _clocks_ahead(monkeypatch: pytest.MonkeyPatch, seconds: float) -> Iterator[None]:
    """This process's clocks (``time.time`` and rq's ``now``) run ``seconds`` ahead inside."""
    real_time, real_now = time.time, rq.utils.now
    monkeypatch.setattr(time, "time", lambda: real_time() + seconds)
    monkeypatch.setattr(rq.utils, "now", lambda: real_now() + timedelta(seconds=seconds))
    try:
        yield
    finally:
        monkeypatch.setattr(time, "time", real_time)
        monkeypatch.setattr(rq.utils, "now", real_now)


def test_a_coordinator_8_days_ahead_keeps_live_jobs_and_stamps_the_servers_time(
    r, redis_url, monkeypatch
):
    store = JobStore(r)
    tokens = new_job(store, "live")  # registered through a coordinator whose clock is right
    client = CoordinatorClient(redis_url, tokens=tokens)
    assert client.heartbeat("live", 0)

    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + EIGHT_DAYS)
    coord = Coordinator(r, make_settings(redis_url, reconcile_interval=0.1), claim_idle_ms=60_000)
    with running(coord):
        # Its sweeps (every 0.1 s) see the live job as just active (idle limit: 7 days).
        wait_for(lambda: coord._last_sweep > 0, 5, "a first sweep")
        swept = coord._last_sweep
        wait_for(lambda: coord._last_sweep > swept + 0.5, 5, "several sweeps")
        assert r.exists(keys.job_info("live"))
        # A job registered through the fast coordinator is stamped with the server's time,
        # and so is the scheduler work it enqueues.
        fresh = register(client, pp=2)
        server = store.server_time()
        assert abs(activity(store, fresh) - server) < 5
        enqueued = wait_for(lambda: store.job_fields(fresh, "enqueued_at")["enqueued_at"], 5)
        assert abs(float(enqueued) - server) < 5
        # A dead letter's dead_at as well (``perseus deadletter list`` prints it).
        client.report("no-such-job", result(0, 1))
        wait_for(lambda: r.xlen(keys.DEADLETTER_STREAM), 5, "the dead letter")
        [(_id, letter)] = r.xrange(keys.DEADLETTER_STREAM)
        assert abs(float(letter[b"dead_at"]) - store.server_time()) < 5
        coord.sweep()
        # The coordinator's heartbeat (read by the healthcheck and the consumer cleanup) too
        # (while it runs: a clean stop removes it).
        (beat,) = [float(t) for t in r.hgetall(keys.COORDINATORS).values()]
        assert abs(beat - store.server_time()) < 5
    assert store.get_job("live") and store.get_job(fresh)


def test_a_rank_and_a_worker_120_s_behind_keep_their_job(r, redis_url, monkeypatch):
    store = JobStore(r)
    tokens = new_job(store, "behind")
    coord = Coordinator(r, make_settings(redis_url, max_job_idle_time=60))

    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 120)
    client = CoordinatorClient(redis_url, tokens=tokens)
    assert client.heartbeat("behind", 0)  # a rank 120 s behind
    assert advance_job("behind", conn=r) == [1]  # a worker 120 s behind publishes version 1
    assert abs(activity(store, "behind") - store.server_time()) < 5
    monkeypatch.setattr(time, "time", real)

    coord.sweep()  # idle limit 60 s: a stamp 120 s in the past would delete the job
    assert store.version("behind") == 1


def test_stall_detection_uses_the_servers_clock(r, redis_url, monkeypatch):
    """Work enqueued by a coordinator 8 days behind is not 'unclaimed for 8 days' at once."""
    store = JobStore(r)
    new_job(store, "due")
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - EIGHT_DAYS)
    slow = Coordinator(r, make_settings(redis_url, stall_timeout=60))
    slow.enqueue_advance("due")
    assert store.settle("due")  # due, and in the due set
    monkeypatch.setattr(time, "time", real)
    r.delete(f"rq:queue:{keys.RQ_QUEUE}")  # taken by a worker that is still computing
    enqueued: list[str] = []
    right = Coordinator(r, make_settings(redis_url, stall_timeout=60))
    right.sweeper.run(right.settings, enqueued.append)
    assert enqueued == []  # enqueued a moment ago by the server's clock: not stalled yet


def test_purging_dead_letters_by_age_uses_the_servers_clock(r, monkeypatch):
    """Dead-letter ids are the server's time: a clock 8 days ahead purges nothing new."""
    r.xadd(keys.DEADLETTER_STREAM, {"reason": "x"})
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + EIGHT_DAYS)
    assert purge(r, older_than_s=3600) == 0
    assert r.xlen(keys.DEADLETTER_STREAM) == 1


def test_a_coordinator_minutes_ahead_does_not_fail_a_task_its_worker_still_runs(
    r, redis_url, tmp_path, monkeypatch
):
    """rq stamps a running task's expiry with its worker's clock; the sweep judges it by Redis.

    The task's worker (this machine's clock) beats for it, and its execution in Redis lives
    on. A coordinator whose clock runs 5 minutes ahead must not call it abandoned (rq's own
    cleanup, on the local clock, moved it to the failed tasks while it ran).
    """
    with _a_task_running(r, redis_url, tmp_path) as queue, _clocks_ahead(monkeypatch, 300):
        ahead = Coordinator(r, make_settings(redis_url))
        ahead.sweep()
        assert queue.failed_job_registry.get_job_ids() == []
        assert queue.started_job_registry.get_job_ids(cleanup=False)  # still running, as it is


def test_a_task_that_ends_while_the_registry_is_read_is_not_called_abandoned(r):
    # The registry's entries are read first, their executions checked next: a task that ended
    # in between (rq deletes its execution and its entry in one transaction) looked abandoned.
    from rq.executions import Execution
    from rq.registry import StartedJobRegistry

    from schedulers.planning.plan_runs import expired_executions

    started = StartedJobRegistry(keys.RQ_QUEUE, connection=r)
    execution = Execution("e1", "task-1", r)
    r.zadd(started.key, {"task-1:e1": time.time() + 60})
    r.set(execution.key, "running", ex=60)
    assert expired_executions(r) == []
    read = r.zrange

    def read_then_end(*args: object, **kwargs: object) -> object:
        entries = read(*args, **kwargs)  # type: ignore[arg-type]
        with r.pipeline(transaction=True) as pipe:  # the task ends, as rq ends it
            pipe.delete(execution.key)
            pipe.zrem(started.key, "task-1:e1")
            pipe.execute()
        return entries

    r.zrange = read_then_end  # type: ignore[method-assign]
    assert expired_executions(r) == []
    r.zrange = read  # type: ignore[method-assign]
    r.zadd(started.key, {"task-2:e2": time.time() + 60})  # listed, its execution expired
    assert expired_executions(r) == ["task-2:e2"]


@pytest.mark.parametrize("worker_class", [PerseusSimpleWorker, PerseusWorker])
def test_a_worker_minutes_ahead_does_not_fail_another_workers_running_task(
    r, redis_url, tmp_path, monkeypatch, worker_class
):
    """rq's workers clean the registries every ten minutes, on their own clocks.

    A worker whose clock runs 5 minutes ahead must not call another worker's running task
    abandoned (rq's cleanup moved it to the failed tasks); one whose execution expired in
    Redis (its worker died) still is.
    """
    from rq.executions import Execution

    with _a_task_running(r, redis_url, tmp_path) as queue:
        started = queue.started_job_registry
        # A task whose worker died: listed as started, its execution gone from Redis.
        dead = Execution("e-dead", "task-dead", r)
        r.zadd(started.key, {"task-dead:e-dead": time.time() + 60})
        with _clocks_ahead(monkeypatch, 300):
            ahead = worker_class([queue], connection=r, name="ahead")
            ahead.clean_registries()
            assert queue.failed_job_registry.get_job_ids() == []
            running = started.get_job_ids(cleanup=False)
            assert len(running) == 1 and running[0] != "task-dead"  # the live one, as it is
            assert not r.exists(dead.key)


def test_abandoned_tasks_are_found_on_the_queue_cleaned(r):
    # fail_abandoned and the workers' cleanup take any queue; the expired executions were
    # looked up on perseus's queue whatever the queue, so another queue's stayed listed.
    from rq.registry import StartedJobRegistry

    from coordinator.abandoned import fail_abandoned

    other = Queue("other", connection=r)
    started = StartedJobRegistry("other", connection=r)
    r.zadd(started.key, {"task-3:e3": time.time() + 60})  # its execution expired
    fail_abandoned(other)
    assert r.zcard(started.key) == 0
