"""Per-rank liveness: heartbeats on the Redis server's clock; silent ranks and stalled jobs."""

from __future__ import annotations

import time

from coordinator.status import format_snapshot, snapshot
from protocol import keys
from protocol.store import JobStore
from tests.helpers import drain, register, result, wait_for
from worker_client.hook.session import CoordinatorClient


def test_a_job_waiting_on_a_silent_rank_is_shown_stalled(service, r, redis_url):
    client = CoordinatorClient(redis_url)
    job_id = register(client, pp=2)
    drain(r)
    store = JobStore(r)
    wait_for(lambda: store.version(job_id) >= 1, 10, "version 1")
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


def test_status_names_each_job_state_in_its_table():
    from coordinator.status import format_snapshot

    def job(state: str, **kw):
        base = {"job_id": f"j-{state}", "ranks": 1, "alive": 1, "world_size": 1, "version": 1}
        base.update(results_for_version=0, idle_s=0, error="", waiting_on=[], state=state)
        return {**base, **kw}

    first = {"version": 1, "time_s": 0.5, "energy_j": 0.0}
    snap = {
        "jobs": [
            job("starting", version=0),
            job("failed", error="boom"),
            job("running", first=first, latest=first),
        ],
        "streams": [],
        "rq": {"queue": "perseus", "queued": 0, "workers": 0, "failed": 0},
    }
    text = format_snapshot(snap)
    assert "starting: -" in text and "failed: boom" in text
    assert "running: 0.5000 s/it, no energy measured (v1)" in text


def test_status_columns_stay_in_line_with_long_job_ids():
    from coordinator.status import format_snapshot

    def job(job_id: str):
        return {
            "job_id": job_id,
            "ranks": 1,
            "alive": 1,
            "world_size": 1,
            "version": 1,
            "results_for_version": 0,
            "idle_s": 0,
            "error": "",
            "waiting_on": [],
            "state": "starting",
        }

    long_id = "2026-11-26-12-24-59.035+dp1+pp2+tp1+InstructionProfiler+demo-profile-0123abcd"
    snap = {
        "jobs": [job("short"), job(long_id)],
        "streams": [],
        "rq": {"queue": "perseus", "queued": 0, "workers": 0, "failed": 0},
    }
    lines = [line for line in format_snapshot(snap).splitlines() if "starting" in line]
    assert len({line.index(" 1/1") for line in lines}) == 1, lines
