"""What advancing a job costs stays flat over a run, and a restarted worker picks up exactly.

Costs are counted, not timed: Redis commands (the server's own counter) and results decoded.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import redis
from rq import Queue, SimpleWorker

from coordinator.advance_queue import RESULT_TTL_S, enqueue
from coordinator.dump import dump_job
from coordinator.replay import LiveSchedulers
from coordinator.service import Coordinator
from coordinator.sweep import RECONCILE_PAGE
from coordinator.tasks import advance_job, advance_once
from protocol import keys
from protocol.models import JobConfig, JobInfo, RankInfo, ReportResult, encode_message
from protocol.store import JobStore
from tests.helpers import (
    CLOCKS,
    RANKS,
    SNAPSHOTTING,
    STEPDOWN,
    make_settings,
    new_job,
    report_all,
    result,
    start_perseus,
    wait_for,
)


def commands(conn: redis.Redis) -> int:
    """Commands the server has processed so far (this INFO call included)."""
    return int(conn.info("stats")["total_commands_processed"])


@pytest.mark.parametrize("scheduler", [STEPDOWN, SNAPSHOTTING])
def test_advancing_at_version_50_costs_what_it_costs_at_version_2(r, scheduler):
    store = JobStore(r)
    new_job(store, "flat", scheduler)
    cache = LiveSchedulers()
    assert advance_once(store, "flat", cache) == 1
    cost: dict[int, tuple[int, int]] = {}
    for version in range(2, 51):
        report_all(store, "flat")
        decoded, before = store.results_decoded, commands(r)
        assert advance_once(store, "flat", cache, snapshot_every=7) == version
        cost[version] = (commands(r) - before, store.results_decoded - decoded)
    assert cache.rebuilds == 1  # built once, then fed only the new results
    # Version 2 reads the results of version 1 only; version 50 those of version 49 only.
    assert cost[2][1] == cost[50][1] == RANKS
    # Same Redis commands too (a snapshot every 7 entries adds one: 50 - 1 = 49 is one).
    assert cost[50][0] <= cost[2][0] + 1, cost


def test_a_worker_that_lost_its_cache_rebuilds_from_the_snapshot_not_the_start(r, tmp_path):
    store = JobStore(r)
    new_job(store, "snap", SNAPSHOTTING)
    advance_job("snap", conn=r, snapshot_every=5)
    for _ in range(49):
        report_all(store, "snap")
        advance_job("snap", conn=r, snapshot_every=5)
    assert store.version("snap") == 50
    report_all(store, "snap")
    cold = LiveSchedulers()  # a fresh process: nothing cached
    before = store.results_decoded
    assert advance_once(store, "snap", cold, snapshot_every=5) == 51
    # The snapshot covers 50 journal entries: only the newest version's results are read.
    assert store.results_decoded - before == RANKS
    assert cold.rebuilds == 1
    # What the snapshot consumed is gone (a summary of each version stays); so are old
    # schedules, while the newest versions are kept for slow readers.
    assert not r.exists(keys.job_results("snap", 1)) and not r.exists(keys.job_results("snap", 44))
    summaries = store.summaries("snap")
    assert sorted(summaries) == list(range(1, 51))
    assert summaries[3] == {"ranks": RANKS, "iter_time": 1.0, "iter_energy": 2.0 * RANKS}
    assert not r.exists(keys.job_schedule("snap", 40))
    assert all(store.schedules("snap", v) for v in (48, 49, 50, 51))
    # `perseus dump` writes what is left, and the summaries of everything observed.
    folder = dump_job(store, "snap", str(tmp_path)).folder
    assert sorted(p.name for p in folder.glob("*.sched.json")) == [
        f"{v}.sched.json" for v in (48, 49, 50, 51)
    ]
    dumped = json.loads((folder / "summaries.json").read_text())
    assert dumped["3"] == summaries[3] and len(dumped) == 50


def test_a_late_result_of_a_consumed_version_is_dead_lettered(r, redis_url):
    store = JobStore(r)
    new_job(store, "late", SNAPSHOTTING)
    advance_job("late", conn=r, snapshot_every=2)
    for _ in range(4):
        report_all(store, "late")
        advance_job("late", conn=r, snapshot_every=2)
    assert not r.exists(keys.job_results("late", 2))
    coord = Coordinator(r, make_settings(redis_url))
    fields = encode_message(ReportResult(job_id="late", result=result(0, 2)), token="token-0")
    coord.handle(keys.RESULTS_STREAM, "1-1", _bytes(fields))
    assert not r.exists(keys.job_results("late", 2))
    ((_id, letter),) = r.xrange(keys.DEADLETTER_STREAM)  # nothing lost silently
    assert b"after the scheduler consumed that version's results" in letter[b"reason"]


def _bytes(fields: dict) -> dict[bytes, bytes]:
    """Stream entry fields as Redis returns them."""
    return {k.encode(): v.encode() if isinstance(v, str) else v for k, v in fields.items()}


@pytest.mark.parametrize("scheduler", [STEPDOWN, SNAPSHOTTING])
def test_restarted_workers_continue_the_same_schedule_sequence(r, scheduler):
    """One job advanced by a worker that never stops, one by workers that keep restarting."""
    store = JobStore(r)
    sequences: dict[str, list[int]] = {}
    for job_id, restart_every in (("steady", 0), ("restarted", 3)):
        new_job(store, job_id, scheduler)
        cache = LiveSchedulers()
        sequence = []
        for step in range(1, 25):
            if restart_every and step % restart_every == 0:
                cache = LiveSchedulers()  # what a restart (or a forking worker) starts with
            if step > 1:
                report_all(store, job_id)
            version = advance_once(store, job_id, cache, snapshot_every=4)
            sequence.append(store.schedule(job_id, version, 2).frequencies[0][1])
        sequences[job_id] = sequence
    assert sequences["restarted"] == sequences["steady"] == CLOCKS[:24]


def test_killed_perseus_worker_is_replaced_and_the_sequence_goes_on(r, redis_url, tmp_path):
    """Real processes: a long-lived `perseus worker` is killed mid-run; a new one continues."""
    settings = make_settings(redis_url, SNAPSHOTTING, snapshot_every=3)
    worker = start_perseus(["worker", "--redis-url", redis_url], tmp_path, "w.log")
    coord = Coordinator(redis.Redis.from_url(redis_url), settings)
    store = JobStore(r)
    new_job(store, "procs", SNAPSHOTTING)
    seen = []
    try:
        coord.enqueue_advance("procs")
        for version in range(1, 13):
            wait_for(lambda v=version: store.version("procs") == v, 30, f"version {version}")
            seen.append(store.schedule("procs", version, 0).frequencies[0][1])
            if version == 7:
                wait_for(lambda: store.lease_holder("procs") is None, 10, "the lease")
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait(timeout=10)
                worker = start_perseus(["worker", "--redis-url", redis_url], tmp_path, "w.log")
            if version < 12:
                report_all(store, "procs")
                coord.enqueue_advance("procs")
    finally:
        worker.terminate()
        worker.wait(timeout=10)
    assert seen == CLOCKS[:12]
    assert [e.observed_version for e in store.journal("procs")] == [None, *range(1, 12)]
    assert r.get(keys.job_snapshot("procs")) is not None


def test_sweep_cost_does_not_grow_with_finished_jobs(r, redis_url):
    coord = Coordinator(r, make_settings(redis_url, STEPDOWN))
    store = JobStore(r)
    cost = {}
    for finished in (0, 300, 600):
        while len(store.list_jobs()) < finished:
            job_id = f"done{len(store.list_jobs())}"
            new_job(store, job_id, STEPDOWN)
            advance_job(job_id, conn=r)  # finished: version 1 published, nothing due
        before = commands(r)
        coord.sweep()
        cost[finished] = commands(r) - before
    # One page of the jobs index per sweep (each check a script of a few commands), however
    # many jobs there are; checking every job each time cost ~10 commands per job.
    assert cost[600] == cost[300] <= 7 * RECONCILE_PAGE, cost


def test_a_batch_of_results_is_one_script_call_and_one_xack(r, redis_url):
    store = JobStore(r)
    new_job(store, "batch", STEPDOWN)
    advance_job("batch", conn=r)
    coord = Coordinator(r, make_settings(redis_url))
    entries = [
        (
            keys.RESULTS_STREAM,
            f"5-{rank}",
            _bytes(
                encode_message(
                    ReportResult(job_id="batch", result=result(rank, 1)), token=f"token-{rank}"
                )
            ),
        )
        for rank in range(RANKS)
    ]
    r.config_resetstat()
    coord.handle_batch(entries)
    stats = r.info("commandstats")
    assert stats["cmdstat_evalsha"]["calls"] == 1  # the 4 results, in one script call
    assert stats["cmdstat_xack"]["calls"] == 1
    assert store.result_count("batch", 1) == RANKS
    assert r.zscore(keys.DUE_JOBS, "batch") is not None  # complete: due, and enqueued


def test_the_lease_is_renewed_while_a_scheduler_computes(r):
    """A 1 s lease outlives a 2.5 s computation: the process's renewer thread extends it."""
    store = JobStore(r)
    job = JobInfo(job_id="slow", pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    store.create_job(job, JobConfig(scheduler=STEPDOWN, scheduler_args={"delay": 2.5}), "1-0")
    store.add_rank(
        job, RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=CLOCKS)
    )
    done: list[list[int]] = []
    thread = threading.Thread(target=lambda: done.append(advance_job("slow", 1000, conn=r)))
    thread.start()
    token = wait_for(lambda: store.lease_holder("slow"), 5, "the lease")
    holders = set()
    while True:  # computing: without renewal the lease would expire at 1 s
        # One transaction: read apart, the version could still be 0 and the lease already
        # released after the publish (as a loaded CI machine showed).
        with r.pipeline(transaction=True) as pipe:
            pipe.get(keys.job_version("slow"))
            pipe.get(keys.job_lease("slow"))
            version, holder = pipe.execute()
        if int(version or 0) != 0:
            break
        holders.add(holder.decode() if holder is not None else None)
        time.sleep(0.02)
    thread.join()
    assert done == [[1]] and holders == {token}
    assert store.lease_holder("slow") is None  # released at the end


def test_a_finished_advance_task_leaves_rq_state_for_a_minute_only(r, redis_url):
    # rq's default keeps a finished task (hash and result stream, ~6.5 kB) for 10 minutes:
    # a job publishing a version a second would hold 4 MB of them.
    store = JobStore(r)
    new_job(store, "brief", STEPDOWN)
    queue = Queue(keys.RQ_QUEUE, connection=r)
    task = enqueue(queue, store, make_settings(redis_url), "brief")
    SimpleWorker([queue], connection=r).work(burst=True)
    assert store.version("brief") == 1 and task.get_status(refresh=True) == "finished"
    for key in (task.key, f"rq:results:{task.id}"):
        assert r.exists(key) and 0 < r.ttl(key) <= RESULT_TTL_S == 60, key
