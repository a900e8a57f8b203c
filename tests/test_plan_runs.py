"""A planner run whose rq worker dies ends as failed, with the reason and the usual expiry."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import redis
from rq.executions import Execution
from rq.job import Job
from rq.registry import StartedJobRegistry
from rq.worker import SimpleWorker

from coordinator.settings import PerseusSettings
from coordinator.sweep import Sweeper
from protocol import keys
from protocol.store import JobStore
from schedulers.planning.job import PLAN_KEY_TTL, enqueue_planning
from schedulers.planning.profile_csv import read_profile_csv
from schedulers.planning.synthetic_profile import write_synthetic_profile
from tests.helpers import run_perseus, start_perseus, stop, subprocess_env, wait_for


def perseus(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return run_perseus(list(args), 60, subprocess_env(tmp_path))


def record(r: redis.Redis, plan_id: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in r.hgetall(keys.plan_key(plan_id)).items()}


def status_runs(redis_url: str, tmp_path: Path) -> dict[str, dict[str, str]]:
    done = perseus("status", "--json", "--redis-url", redis_url, tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    return {run["plan_id"]: run for run in json.loads(done.stdout)["plans"]}


def test_killed_worker_fails_its_planner_run_which_then_expires(tmp_path, redis_url, r):
    # 4 x 128 with the pure-Python solver: about ten seconds of planning, time to kill it.
    profile = write_synthetic_profile(tmp_path / "profile.csv", 4)
    name = "planner-w"
    worker = start_perseus(["worker", "--redis-url", redis_url, "--name", name], tmp_path, "w.log")
    coordinator = None
    try:
        enqueued = perseus(
            "optimize", str(profile), "--stages", "4", "--microbatches", "128",
            "--p2p-power", "100", "--solver", "python", "--out", str(tmp_path / "plans"),
            "--no-plot", "--enqueue", "--redis-url", redis_url, tmp_path=tmp_path,
        )  # fmt: skip
        assert enqueued.returncode == 0, enqueued.stderr
        plan_id = enqueued.stdout.split("plan id: ")[1].split()[0]
        wait_for(
            lambda: float(record(r, plan_id).get("progress", 0)) > 0, 60, "the run to progress"
        )
        worker_key = SimpleWorker.redis_worker_namespace_prefix + name
        assert int(r.hget(worker_key, "pid") or 0) == worker.pid
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)

        # Nobody has noticed yet: the record says running, and so does rq.
        assert record(r, plan_id)["state"] == "running"
        assert r.ttl(keys.plan_key(plan_id)) == -1
        rq_id = keys.plan_rq_job(plan_id)
        started = StartedJobRegistry(keys.RQ_QUEUE, connection=r)
        [(entry, expires)] = r.zrange(started.key, 0, -1, withscores=True)
        assert entry.decode().startswith(rq_id + ":")
        # The long-lived worker sent rq's heartbeats during the task: its execution expires
        # 90 s after the last one, not after the task's 24 h time-out.
        assert expires < time.time() + 91
        # The worker's record expires as soon (it was an hour or a day).
        assert 0 < r.ttl(worker_key) <= 90

        # So does its execution's key, on Redis's clock, which is what tells it dead.
        execution = Execution(entry.decode().split(":")[1], rq_id, r).key
        assert 0 < r.ttl(execution) <= 90

        # Let the 90 s pass: the execution's heartbeat expires.
        r.delete(execution)
        # `perseus status` (which writes nothing) shows the run failed already ...
        shown = status_runs(redis_url, tmp_path)[plan_id]
        assert shown["state"] == "failed"
        assert shown["message"].startswith("its worker died (rq: abandoned)")
        assert record(r, plan_id)["state"] == "running"
        # ... and a coordinator's sweep runs rq's cleanup, which fails the rq job as
        # abandoned; the planning job's failure callback ends the run (taken off the active
        # runs here, so that the sweep's own check of rq's records cannot be what ends it).
        r.zrem(keys.PLANS_ACTIVE, plan_id)
        coordinator = start_perseus(["coordinator", "--redis-url", redis_url], tmp_path, "c.log")
        wait_for(lambda: record(r, plan_id)["state"] == "failed", 60, "the run to fail")
        assert record(r, plan_id)["message"] == "its worker died (rq: abandoned)"
        assert 0 < r.ttl(keys.plan_key(plan_id)) <= PLAN_KEY_TTL
        assert r.zscore(keys.PLANS_ACTIVE, plan_id) is None
        # rq runs the failure callback first, then marks its job failed.
        rq_failed = lambda: Job.fetch(rq_id, connection=r).get_status() == "failed"  # noqa: E731
        wait_for(rq_failed, 60, "rq to mark its job failed")
        shown = status_runs(redis_url, tmp_path)[plan_id]
        assert (shown["state"], shown["message"]) == ("failed", "its worker died (rq: abandoned)")
    finally:
        stop([p for p in (worker, coordinator) if p is not None])


def test_sweep_ends_runs_whose_rq_job_was_canceled_or_is_gone(tmp_path, redis_url, r):
    profile = read_profile_csv(write_synthetic_profile(tmp_path / "profile.csv", 2))
    canceled = enqueue_planning(r, profile, 2, 4, out_dir=tmp_path / "a", plan_id="canceled")
    gone = enqueue_planning(r, profile, 2, 4, out_dir=tmp_path / "b", plan_id="gone")
    waiting = enqueue_planning(r, profile, 2, 4, out_dir=tmp_path / "c", plan_id="waiting")
    assert r.zcard(keys.PLANS_ACTIVE) == 3
    Job.fetch(keys.plan_rq_job(canceled), connection=r).cancel()
    Job.fetch(keys.plan_rq_job(gone), connection=r).delete()

    shown = status_runs(redis_url, tmp_path)
    assert (shown[canceled]["state"], shown[canceled]["message"]) == (
        "failed",
        "its rq job was canceled",
    )
    assert shown[gone]["state"] == "failed" and "is gone from Redis" in shown[gone]["message"]
    assert shown[waiting]["state"] == "queued"

    Sweeper(JobStore(r)).run(PerseusSettings(redis_url=redis_url), lambda job_id: None)
    for plan_id in (canceled, gone):
        assert record(r, plan_id)["state"] == "failed"
        assert 0 < r.ttl(keys.plan_key(plan_id)) <= PLAN_KEY_TTL
    assert record(r, waiting)["state"] == "queued" and r.ttl(keys.plan_key(waiting)) == -1
    assert [m.decode() for m in r.zrange(keys.PLANS_ACTIVE, 0, -1)] == [waiting]

    # A run that ends on its own leaves the active runs, and its own outcome stands.
    SimpleWorker([keys.RQ_QUEUE], connection=r).work(burst=True)
    assert record(r, waiting)["state"] == "done"
    assert r.zcard(keys.PLANS_ACTIVE) == 0
    Sweeper(JobStore(r)).run(PerseusSettings(redis_url=redis_url), lambda job_id: None)
    assert record(r, waiting)["state"] == "done"
