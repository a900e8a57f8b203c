"""Each client alone against a Redis that is down, slow or restarted: timeouts, waits, reconnects.

The whole stack riding through an outage is tests/test_outage.py.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from rq import Queue, worker_registration

from coordinator.embedded import EmbeddedRedis
from coordinator.service import Coordinator
from coordinator.worker_loop import PerseusSimpleWorker, wait_for_redis
from protocol import keys
from protocol.connection import connect
from protocol.exceptions import CoordinatorUnavailableError, UnknownJobError
from protocol.models import JobInfo, ProfilingResult, RankInfo, ReportResult, unpack
from protocol.store import JobStore
from tests.helpers import (
    FREQS,
    ROOT,
    free_ports,
    make_settings,
    register,
    running,
    start_perseus,
    stop,
    subprocess_env,
    wait_for,
)
from tests.rank_helpers import make_hook
from worker_client.gpu.frequency import DryRunFrequencyController
from worker_client.hook.session import CoordinatorClient
from worker_client.hook.watchers import MAX_BLOCK_S, ResultReporter, ScheduleWatcher


def test_outage_timeout_must_be_positive(gloo, redis_url):
    with pytest.raises(ValueError, match="outage_timeout"):
        make_hook(redis_url, DryRunFrequencyController(0), outage_timeout=0)


def test_reporter_flushes_at_close_and_counts_what_it_gives_up():
    with EmbeddedRedis(appendonly=True) as server:
        client = CoordinatorClient(server.url)
        results = [
            ProfilingResult(rank=0, schedule_version=v, iter_time=[1.0], iter_energy=[2.0])
            for v in (1, 2, 3)
        ]
        # Redis is back within the flush window: everything is sent, oldest first.
        reporter = ResultReporter(client, "job-a", flush_timeout=15)
        reporter.start()
        server.terminate()
        for result in results[:2]:
            reporter.submit(result)
        threading.Timer(1.0, server.restart).start()
        reporter.stop()
        assert (reporter.sent, reporter.unsent, reporter.outage.count) == (2, 0, 1)
        sent = redis.Redis.from_url(server.url).xrange(keys.RESULTS_STREAM)
        versions = [unpack(ReportResult, f[b"data"]).result.schedule_version for _, f in sent]
        assert versions == [1, 2]

        # Redis stays down past the window: close returns, and says what was not sent.
        reporter = ResultReporter(client, "job-b", flush_timeout=1.0)
        reporter.start()
        server.terminate()
        for result in results:
            reporter.submit(result)
        started = time.monotonic()
        reporter.stop()
        assert time.monotonic() - started < 8
        assert (reporter.sent, reporter.unsent) == (0, 3) and not reporter.is_alive()
        server.restart()
        client.close()


def test_wait_for_redis_says_once_that_a_refused_login_is_no_outage(caplog):
    stop = threading.Event()
    with EmbeddedRedis(password="right-password") as server:
        wrong = redis.Redis(unix_socket_path=str(server.socket_path), password="wrong")
        threading.Timer(1.0, stop.set).start()
        with caplog.at_level(logging.WARNING, logger="coordinator.worker_loop"):
            assert not wait_for_redis(wrong, stop, first_delay=0.05)
    refusals = [r for r in caplog.records if "redis refuses this worker" in r.message]
    assert len(refusals) == 1 and refusals[0].levelname == "ERROR"
    assert "not an outage" in refusals[0].message


def test_wait_for_redis_returns_when_it_answers_or_when_stopped(tmp_path):
    stop = threading.Event()
    with EmbeddedRedis() as server:
        assert wait_for_redis(redis.Redis.from_url(server.url), stop)
    gone = redis.Redis.from_url(f"unix://{tmp_path / 'no.sock'}")
    threading.Timer(0.5, stop.set).start()
    started = time.monotonic()
    assert not wait_for_redis(gone, stop, first_delay=0.05)
    assert 0.4 < time.monotonic() - started < 3


def test_a_stop_request_that_rq_loses_in_a_log_call_still_stops_the_worker(redis_url):
    # The SIGTERM lands while rq logs the task it took (logging swallows rq's StopRequested):
    # the task is finished, then the worker stops instead of waiting for work for ever.
    proc = subprocess.run(
        [sys.executable, "-m", "tests.worker_stop_script", redis_url],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        env=subprocess_env(),
    )
    assert "--- Logging error ---" in proc.stderr  # the stop was raised inside a log call
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "stopped after 0 restarts; tasks done: 1" in proc.stdout


def test_a_registration_answered_after_the_default_socket_timeout_succeeds(redis_url):
    # redis-py's default socket timeout is 5 s: the BLPOP for the reply must outlast it.
    client = CoordinatorClient(redis_url, reply_timeout=10)
    coord = Coordinator(redis.Redis.from_url(redis_url), make_settings(redis_url))
    late = threading.Timer(6.0, coord.run, kwargs={"block_ms": 50})
    late.daemon = True
    late.start()
    started = time.monotonic()
    try:
        job_id = client.register_job(JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1))
    finally:
        coord.stop_event.set()
        late.join(timeout=10)
        client.close()
    assert job_id and time.monotonic() - started > 6.0


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:1/0", "redis+sentinel://127.0.0.1:1,127.0.0.1:2/mymaster"]
)
def test_every_client_has_explicit_timeouts_longer_than_its_blocking_reads(url):
    client = CoordinatorClient(url, reply_timeout=100)  # connects on first use only
    kwargs = client.conn.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] > 100 and kwargs["socket_connect_timeout"] > 0
    watcher = ScheduleWatcher(client, "job", 0, 0)
    kwargs = watcher._conn.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] > MAX_BLOCK_S and kwargs["socket_connect_timeout"] > 0


def test_a_dedicated_client_keeps_one_connection_and_gets_it_back_after_a_restart(
    monkeypatch: pytest.MonkeyPatch,
):
    with EmbeddedRedis() as server:
        probe = redis.Redis.from_url(server.url)
        before = probe.info("stats")["total_connections_received"]
        probe.close()
        conn = connect(server.url, ping=True, dedicated=True)
        # The PING's connection is the one kept: the client it came from let go of the pool.
        assert conn.info("stats")["total_connections_received"] == before + 1
        pool = conn.connection_pool
        checkouts = [0]
        original = type(pool).get_connection

        def counted(self: redis.ConnectionPool, *args: object, **kwargs: object) -> object:
            checkouts[0] += 1
            return original(self, *args, **kwargs)

        monkeypatch.setattr(type(pool), "get_connection", counted)
        for i in range(5):
            conn.set("k", i)
        assert conn.get("k") == b"4" and checkouts[0] == 0  # no checkout per command
        with conn.pipeline() as pipe:  # pipelines still use the pool
            pipe.incr("k").incr("k")
            assert pipe.execute() == [5, 6] and checkouts[0] == 1
        server.terminate()
        with pytest.raises(redis.ConnectionError):
            conn.get("k")
        server.restart()
        assert conn.get("k") is None  # the same client reconnected (to an empty server)


def test_waiting_for_a_schedule_without_redis_raises_the_projects_error(tmp_path):
    """What PerseusOptimizer's start calls: a training script catches one error type."""
    client = CoordinatorClient(f"unix://{tmp_path / 'nobody.sock'}", reply_timeout=1)
    with pytest.raises(CoordinatorUnavailableError, match=r"redis at unix://.*nobody\.sock"):
        client.wait_schedule("some-job", 0, timeout=1)


def test_a_worker_stopping_while_redis_is_down_logs_one_line_not_a_traceback(r, caplog):
    worker = PerseusSimpleWorker([keys.RQ_QUEUE], connection=r, name="w-down")
    # Redis goes away before the worker stops: nothing listens at this port.
    down = redis.Redis(port=free_ports()[0], retry=Retry(NoBackoff(), 0))  # fails at once
    worker.connection = down
    uncaught: list[BaseException | None] = []
    previous, threading.excepthook = threading.excepthook, lambda a: uncaught.append(a.exc_value)
    try:
        with caplog.at_level(logging.WARNING, logger="coordinator.worker_loop"):
            worker.teardown()
    finally:
        threading.excepthook = previous
    assert uncaught == []
    assert "rq worker w-down: exit not recorded in Redis" in caplog.text


def test_a_heartbeat_lists_the_worker_again_when_only_rqs_registry_lost_it(r):
    # What rq's heartbeats during a forked task leave after Redis restarted empty: the worker's
    # hash rebuilt whole (birth included), the registry sets not.
    queue = Queue(keys.RQ_QUEUE, connection=r)
    worker = PerseusSimpleWorker([queue], connection=r)
    worker.register_birth()
    try:
        r.srem(worker_registration.REDIS_WORKER_KEYS, worker.key)
        r.srem(worker_registration.WORKERS_BY_QUEUE_KEY % keys.RQ_QUEUE, worker.key)
        assert r.hexists(worker.key, "birth") and not worker_registration.get_keys(queue=queue)
        worker.heartbeat()
        assert worker_registration.get_keys(queue=queue) == {worker.key}
    finally:
        worker.register_death()


def test_a_rank_starting_rides_through_redis_restarts(tmp_path, monkeypatch):
    """Redis restarts (persistent) while a rank waits for its registration, then its schedule.

    Both waits are part of PerseusOptimizer's start: a restart then failed the training run
    with ``CoordinatorUnavailableError: ... Connection closed by server``, although the request
    waited in the stream and the coordinator answered it once Redis was back.
    """
    monkeypatch.setenv("PERSEUS_SIM_GPU_DIR", str(tmp_path / "simgpu"))
    with EmbeddedRedis(appendonly=True) as server:
        conn = redis.Redis.from_url(server.url)
        store = JobStore(conn)
        client = CoordinatorClient(server.url, reply_timeout=30)
        started: dict[str, Any] = {}

        def start_rank() -> None:
            try:
                job_id = client.register_job(
                    JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
                )
                info = RankInfo(
                    rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=FREQS
                )
                client.register_rank(job_id, info)
                started["schedule"] = client.wait_schedule(job_id, 0, timeout=30)
            except Exception as exc:
                started["error"] = exc

        rank = threading.Thread(target=start_rank, daemon=True)
        rank.start()
        # No coordinator runs yet: the job's registration waits in the stream.
        wait_for(lambda: conn.xlen(keys.REGISTRATIONS_STREAM) == 1, 10, "the registration")
        server.restart(downtime=1.0)
        coord = Coordinator(redis.Redis.from_url(server.url), make_settings(server.url))
        worker = None
        try:
            with running(coord):
                job_id = wait_for(lambda: [j for j, _ in store.list_jobs()], 20, "the job")[0]
                wait_for(lambda: store.rank_count(job_id) == 1 or started, 20, "the rank")
                assert "error" not in started, started.get("error")
                # No worker runs yet: the rank waits for its first schedule.
                server.restart(downtime=1.0)
                worker = start_perseus(["worker", "--redis-url", server.url], tmp_path, "w.log")
                rank.join(timeout=40)
        finally:
            if worker is not None:
                stop([worker])
        assert "error" not in started, started.get("error")
        assert started["schedule"].version == 1
        client.close()


def test_a_rank_waiting_for_its_first_schedule_hears_that_redis_lost_the_job():
    """Redis restarts empty while a rank waits for its first schedule: no worker will ever
    answer, and the error must say the job is gone, not ask whether workers run."""
    with EmbeddedRedis(appendonly=False) as server:
        client = CoordinatorClient(server.url, reply_timeout=20)
        coord = Coordinator(redis.Redis.from_url(server.url), make_settings(server.url))
        try:
            with running(coord):
                job_id = register(client, pp=1)  # no worker runs: version 1 never comes
                threading.Timer(0.5, server.restart, kwargs={"downtime": 0.5}).start()
                started = time.monotonic()
                with pytest.raises(UnknownJobError, match=r"gone from redis at .*restart training"):
                    client.wait_schedule(job_id, 0, timeout=30)
                assert time.monotonic() - started < 15
        finally:
            client.close()
