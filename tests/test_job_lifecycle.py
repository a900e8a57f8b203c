"""Job lifecycle: ranks finish at close, finished jobs and jobs that never started are deleted."""

from __future__ import annotations

import json
import time

import pytest
import redis
from click.testing import CliRunner

from coordinator.cli import main
from coordinator.service import Coordinator
from coordinator.status import format_snapshot, snapshot
from coordinator.tasks import advance_job
from protocol import keys
from protocol.exceptions import UnknownJobError, WrongTokenError
from protocol.job_lifecycle import JobLifecycle
from protocol.models import JobConfig, JobInfo, JournalEntry, RankInfo
from protocol.store import JobStore
from protocol.tokens import new_token
from tests.helpers import FREQS, TOY_SCHEDULER, make_settings, result, start_perseus, stop, wait_for
from tests.rank_helpers import collect_ranks, spawn_ranks, write_1f1b_plan


def new_job(store: JobStore, job_id: str, world: int = 2, ranks: int | None = None) -> list[str]:
    """Create a job and register ranks; return their tokens."""
    job = JobInfo(job_id=job_id, pp_degree=world, dp_degree=1, tp_degree=1, world_size=world)
    store.create_job(job, JobConfig(scheduler=TOY_SCHEDULER), f"1-{len(job_id)}")
    tokens = []
    for rank in range(world if ranks is None else ranks):
        info = RankInfo(rank=rank, dp_rank=0, pp_rank=rank, tp_rank=0, available_frequencies=FREQS)
        tokens.append(new_token())
        store.add_rank(job, info, token=tokens[-1])
    return tokens


def cli(redis_url: str, *args: str):
    return CliRunner().invoke(main, [*args, "--redis-url", redis_url])


def job_keys(r: redis.Redis, job_id: str) -> list[bytes]:
    return list(r.scan_iter(match=f"{keys.job_key(job_id)}:*", count=1000))


def test_ranks_that_close_finish_their_job_which_is_deleted_after_retention(
    redis_url, r, tmp_path, monkeypatch
):
    """Real processes: coordinator and worker via the CLI, two gloo ranks that close their hook."""
    monkeypatch.setenv("PERSEUS_SIM_GPU_DIR", str(tmp_path / "simgpu"))
    plan = tmp_path / "freqs_pipeline_00001.py"
    write_1f1b_plan(plan, 2, 2, [(1980, 1980), (1830, 1905)])
    env = {"PERSEUS_FINISHED_RETENTION": "4", "PERSEUS_RECONCILE_INTERVAL": "0.3"}
    scheduler = ["--scheduler", "PointSolution3D"]
    scheduler += ["--scheduler-args", json.dumps({"solution_path": str(plan)})]
    services = [
        start_perseus(
            ["coordinator", "--redis-url", redis_url, *scheduler],
            tmp_path,
            "coordinator.log",
            env=env,
        ),
        start_perseus(["worker", "--redis-url", redis_url], tmp_path, "worker.log"),
    ]
    try:
        out = tmp_path / "out"
        out.mkdir()
        records = collect_ranks(spawn_ranks(2, 2, redis_url, out, "fin", 4, 2), out, "fin")
        (job_id,) = {rec["job_id"] for rec in records}
        finished_at = r.zscore(keys.FINISHED_JOBS, job_id)
        assert finished_at is not None  # both hooks closed: the job finished (server clock)
        # Each mark carries its rank's proof (the sweep checks it before deleting the job).
        marks = r.smembers(keys.job_finished(job_id))
        assert {m.partition(b":")[0] for m in marks} == {b"0", b"1"}
        assert JobLifecycle(JobStore(r)).finish_proven(job_id)
        (job,) = snapshot(r)["jobs"]
        assert job["state"] == "finished" and job["ranks_finished"] == 2
        assert "finished:" in format_snapshot(snapshot(r))
        listed = cli(redis_url, "jobs", "list")
        assert listed.exit_code == 0, listed.output
        assert job_id in listed.output and "finished" in listed.output and "2/2" in listed.output
        # The sweep deletes it finished_retention (4 s) after it finished, every key of it.
        wait_for(lambda: not r.exists(keys.job_info(job_id)), 15, "the finished job deleted")
        assert store_time(r) - finished_at >= 4
        assert job_keys(r, job_id) == [] and r.zscore(keys.FINISHED_JOBS, job_id) is None
    finally:
        stop(services)
    assert f"deleted job {job_id}: finished" in (tmp_path / "coordinator.log").read_text()


def store_time(r: redis.Redis) -> float:
    return JobStore(r).server_time()


def test_finishing_a_rank_is_idempotent_and_checked(r):
    store = JobStore(r)
    tokens = new_job(store, "two")
    lifecycle = JobLifecycle(store)
    assert lifecycle.finish_rank("two", 0, tokens[0]) is False
    assert lifecycle.finish_rank("two", 0, tokens[0]) is False  # a retried close counts once
    try:
        lifecycle.finish_rank("two", 2, tokens[1])
        raise AssertionError("rank 2 of a 2-rank job was accepted")
    except ValueError as exc:
        assert "out of range" in str(exc)
    # Another rank's token, or none, finishes nothing: a client cannot end a job it is not in.
    for wrong in (tokens[0], ""):
        with pytest.raises(WrongTokenError, match="rank 1 of job two"):
            lifecycle.finish_rank("two", 1, wrong)
    assert lifecycle.endings(["two"])["two"].ranks_finished == 1
    assert lifecycle.finish_rank("two", 1, tokens[1]) is True
    first = r.zscore(keys.FINISHED_JOBS, "two")
    assert lifecycle.finish_rank("two", 1, tokens[1]) is True
    assert r.zscore(keys.FINISHED_JOBS, "two") == first
    assert lifecycle.finish_rank("gone", 0, tokens[0]) is None  # no such job: nothing created
    assert not r.exists(keys.job_finished("gone")) and r.zscore(keys.FINISHED_JOBS, "gone") is None


def test_jobs_finish_delete_and_list(r, redis_url):
    store = JobStore(r)
    new_job(store, "busy")
    advance_job("busy", conn=r)  # version 1
    for rank in (0, 1):
        store.add_result(store.get_job("busy").info, result(rank, 1))
    new_job(store, "other")
    assert r.zscore(keys.DUE_JOBS, "busy") is not None  # complete results: work due

    done = cli(redis_url, "jobs", "finish", "busy")
    assert done.exit_code == 0 and "job busy is finished" in done.output
    listed = json.loads(cli(redis_url, "jobs", "list", "--json").output)
    rows = {row["job_id"]: row for row in listed}
    assert rows["busy"]["state"] == "finished" and rows["busy"]["version"] == 1
    assert rows["other"]["state"] == "starting" and rows["other"]["ranks_finished"] == 0
    assert rows["busy"]["world_size"] == 2 and rows["busy"]["age_s"] >= 0

    assert job_keys(r, "busy")
    # A job named twice (a pasted list, a glob) was deleted, then called unknown: exit code 1.
    gone = cli(redis_url, "jobs", "delete", "busy", "busy")
    assert gone.exit_code == 0 and gone.output.count("deleted job busy") == 1, gone.output
    assert job_keys(r, "busy") == []
    for index in (keys.JOBS_INDEX, keys.DUE_JOBS, keys.FINISHED_JOBS, keys.STARTING_JOBS):
        assert r.zscore(index, "busy") is None, index
    assert job_keys(r, "other") and r.zscore(keys.JOBS_INDEX, "other") is not None

    for command in ("delete", "finish"):
        missing = cli(redis_url, "jobs", command, "nope")
        assert missing.exit_code == 1
        assert "unknown job id 'nope' (never registered, or expired)" in missing.output


def test_a_job_that_never_started_is_deleted_after_start_retention(r, redis_url):
    store = JobStore(r)
    new_job(store, "half", ranks=1)  # rank 1 failed before registering (e.g. no NVML)
    new_job(store, "started")
    assert advance_job("started", conn=r) == [1]
    coord = Coordinator(r, make_settings(redis_url, start_retention=1.0))
    coord.sweep()
    assert r.exists(keys.job_info("half"))  # not idle for 1 s yet
    time.sleep(1.3)
    coord.sweep()
    assert not r.exists(keys.job_info("half")) and job_keys(r, "half") == []
    # A job that got its first version leaves the starting set and stays (idle limit: a week).
    assert store.version("started") == 1 and r.zscore(keys.STARTING_JOBS, "started") is None
    # One still being registered is checked again later instead of deleted.
    new_job(store, "slow", ranks=1)
    r.zadd(keys.STARTING_JOBS, {"slow": 0})  # registered long ago, but a rank just joined
    coord.sweep()
    assert r.exists(keys.job_info("slow")) and r.zscore(keys.STARTING_JOBS, "slow") > 0


def commands(conn: redis.Redis) -> int:
    return int(conn.info("stats")["total_commands_processed"])


def test_the_sweep_costs_the_same_with_300_or_600_finished_jobs(r, redis_url):
    store = JobStore(r)
    lifecycle = JobLifecycle(store)
    coord = Coordinator(r, make_settings(redis_url))
    cost = {}
    for finished in (300, 600):
        while r.zcard(keys.FINISHED_JOBS) < finished:
            job_id = f"f{r.zcard(keys.FINISHED_JOBS)}"
            new_job(store, job_id, world=1)
            assert lifecycle.finish_job(job_id)
        coord.sweep()  # the page walk starts over at the same place each time below
        coord.sweeper._page_at = 0
        before = commands(r)
        coord.sweep()
        cost[finished] = commands(r) - before
        coord.sweeper._page_at = 0
    assert cost[300] == cost[600], cost


def test_writes_racing_a_jobs_deletion_leave_nothing_behind(r):
    """A worker or coordinator that writes after the job was deleted revives none of it."""
    store = JobStore(r)
    new_job(store, "gone")
    advance_job("gone", conn=r)  # version 1
    latest = store.schedules("gone", 1)
    assert store.delete_job("gone")
    entry = JournalEntry(version=2, observed_version=1, controls_upto=0)
    with pytest.raises(UnknownJobError):
        store.publish("gone", latest, entry, journal_length=1)
    with pytest.raises(UnknownJobError):
        store.record_unpublished("gone", entry, journal_length=0)
    assert not store.save_snapshot("gone", b"state", 0, range(1, 1))
    store.set_fields("gone", enqueued_at="1.0", rq_job="task")
    store.fail_job("gone", "RuntimeError: late")
    store.save_artifacts("gone", {"plan.csv": b"late"})
    with r.pipeline(transaction=True) as pipe:
        store.set_fields("gone", pipeline=pipe, rq_job="task")
        pipe.execute()
    assert job_keys(r, "gone") == []
    assert "gone" not in dict(store.list_jobs())
    # While the job exists, the same calls write.
    new_job(store, "kept")
    store.set_fields("kept", rq_job="task")
    store.fail_job("kept", "RuntimeError: boom")
    store.save_artifacts("kept", {"plan.csv": b"x"})
    assert store.job_fields("kept", "rq_job", "error") == {
        "rq_job": "task",
        "error": "RuntimeError: boom",
    }
    assert store.artifacts("kept") == {"plan.csv": b"x"}
    assert r.xrange(keys.job_updates("kept"))[-1][1] == {b"error": b"RuntimeError: boom"}
