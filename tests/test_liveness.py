"""Per-rank liveness: heartbeats on the Redis server's clock; silent ranks and stalled jobs."""

from __future__ import annotations

import json
import time

from coordinator.status import format_snapshot, snapshot
from protocol import keys
from protocol.job_lifecycle import JobLifecycle
from protocol.store import JobStore
from tests.helpers import drain, invoke_perseus, register, result, wait_for
from worker_client.hook.session import CoordinatorClient


def job_at_version_1(r, redis_url: str, pp: int) -> tuple[CoordinatorClient, str, JobStore]:
    """A registered pp-rank job whose version 1 is published (the service fixture runs)."""
    client = CoordinatorClient(redis_url)
    job_id = register(client, pp=pp)
    drain(r)
    store = JobStore(r)
    wait_for(lambda: store.version(job_id) >= 1, 10, "version 1")
    return client, job_id, store


def test_a_job_waiting_on_a_silent_rank_is_shown_stalled(service, r, redis_url):
    client, job_id, store = job_at_version_1(r, redis_url, pp=2)
    for rank in (0, 1):
        assert client.heartbeat(job_id, rank)
    snap = snapshot(r, silent_after=1.5)
    (job,) = snap["jobs"]
    assert job["alive"] == 2 and job["state"] == "running"

    # Rank 0 reports and keeps beating; rank 1 went quiet without reporting.
    client.report(job_id, result(0, 1))
    wait_for(lambda: store.result_count(job_id, 1) == 1, 10, "rank 0's result")
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        client.heartbeat(job_id, 0)
        time.sleep(0.2)
    snap = snapshot(r, silent_after=1.5)
    (job,) = snap["jobs"]
    assert job["alive"] == 1 and job["silent_ranks"] == [1]
    assert job["state"] == "stalled" and job["waiting_on"] == [1]
    assert "stalled: waiting on silent ranks 1" in format_snapshot(snap)


def test_a_job_waiting_on_a_rank_whose_hook_closed_is_stalled_at_once(service, r, redis_url):
    """Closed early, a rank sends nothing more: no need to wait until it counts as silent."""
    client, job_id, store = job_at_version_1(r, redis_url, pp=3)
    client.report(job_id, result(0, 1))
    wait_for(lambda: store.result_count(job_id, 1) == 1, 10, "rank 0's result")
    # Any rank may write into a job's finished set: only proven finishes count.
    r.sadd(keys.job_finished(job_id), "2:forged", "7:forged")
    for rank in range(3):
        client.heartbeat(job_id, rank)
    (job,) = snapshot(r, silent_after=60)["jobs"]
    assert job["state"] == "running" and job["closed_ranks"] == []
    r.srem(keys.job_finished(job_id), "2:forged", "7:forged")  # (they would finish the job)
    assert JobLifecycle(store).finish_rank(job_id, 1, client.token(job_id, 1) or "") is False
    for rank in range(3):
        client.heartbeat(job_id, rank)
    snap = snapshot(r, silent_after=60)
    (job,) = snap["jobs"]
    assert job["closed_ranks"] == [1] and job["silent_ranks"] == []
    assert job["state"] == "stalled" and job["waiting_on"] == [1]
    assert "stalled: waiting on ranks 1 whose hook closed" in format_snapshot(snap)
    client.report(job_id, result(1, 1))  # it had reported after all: not waited on
    wait_for(lambda: store.result_count(job_id, 1) == 2, 10, "rank 1's result")
    (job,) = snapshot(r, silent_after=60)["jobs"]
    assert job["state"] == "running" and job["waiting_on"] == []


def test_heartbeats_use_the_servers_clock_not_the_ranks(service, r, redis_url, monkeypatch):
    client = CoordinatorClient(redis_url)
    job_id = register(client, pp=1)
    store = JobStore(r)
    # A rank whose clock is 8 days ahead (or behind) still records the server's time.
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 8 * 86400)
    assert client.heartbeat(job_id, 0)
    monkeypatch.setattr(time, "time", real)
    heard = store.ranks_heard(job_id)[0]
    assert abs(heard - store.server_time()) < 5
    (score,) = [s for j, s in store.list_jobs() if j == job_id]
    assert abs(score - store.server_time()) < 5
    # A deleted job is not revived by a late heartbeat.
    assert store.delete_job(job_id)
    assert not client.heartbeat(job_id, 0)
    assert not r.exists(keys.job_alive(job_id))


def test_a_rank_never_heard_from_goes_silent_and_stalls_its_job(service, r, redis_url):
    # Registered, then gone before its hook's first heartbeat (it died in the constructor).
    client = CoordinatorClient(redis_url)
    job_id = register(client, pp=1)
    drain(r)
    store = JobStore(r)
    wait_for(lambda: store.version(job_id) >= 1, 10, "version 1")
    (job,) = snapshot(r, silent_after=60)["jobs"]
    assert job["alive"] == 1 and job["state"] == "running"  # within its first minute
    time.sleep(1.2)
    (job,) = snapshot(r, silent_after=1.0)["jobs"]
    assert job["alive"] == 0 and job["state"] == "stalled" and job["waiting_on"] == [0]


def test_status_names_a_few_waited_on_ranks_and_its_json_every_one(service, r, redis_url):
    """The tables bound the list (a 100,000-rank job's line was 600 kB); scripts get it whole."""
    job_at_version_1(r, redis_url, pp=13)
    time.sleep(1.5)  # none of the 13 ranks ever beat: all silent after --silent-after 1
    args = ("status", "--redis-url", redis_url, "--silent-after", "1")
    code, out = invoke_perseus(*args)
    assert code == 0, out
    named = "silent ranks 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, ... and 3 more (13 in all)"
    assert f"stalled: waiting on {named}" in out, out
    code, out = invoke_perseus(*args, "--json")
    assert code == 0, out
    (listed,) = json.loads(out)["jobs"]
    assert listed["waiting_on"] == list(range(13)) and listed["silent_ranks"] == list(range(13))
