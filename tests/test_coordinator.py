"""Coordinator, store and rq task behaviour against a real Redis server."""

from __future__ import annotations

import json
import time

import pytest
import redis
from rq import Queue
from rq.job import Job, JobStatus

from coordinator.dump import load_prof, load_ranks, load_sched
from coordinator.service import Coordinator
from coordinator.settings import PerseusSettings
from coordinator.tasks import advance_job, rebuild_scheduler
from protocol import keys
from protocol.exceptions import (
    ProtocolError,
)
from protocol.models import (
    FrequencySchedule,
    JobConfig,
    JobInfo,
    RankInfo,
    RegisterJob,
    ReportResult,
    SetTarget,
    encode_message,
)
from protocol.store import JobStore
from protocol.store_scripts import ADD_RANK, ADD_RESULTS
from protocol.tokens import credentials, new_token
from tests.helpers import (
    FREQS,
    age_job,
    drain,
    make_settings,
    register,
    result,
    running,
    wait_for,
)
from worker_client.hook.session import CoordinatorClient

# A two-stage plan for PointSolution: the scheduler converges on its first version.
POINT_PLAN = (
    "[\n[('forward', 1965), ('backward', 1950)],\n[('forward', 1980), ('backward', 1980)],\n]\n"
)


def report_round(client: CoordinatorClient, r: redis.Redis, job_id: str, version: int) -> None:
    """Both ranks report ``version``; run the task that their results make due."""
    for rank in range(2):
        client.report(job_id, result(rank, version))
    wait_for(lambda: JobStore(r).result_count(job_id, version) == 2)
    wait_for(lambda: Queue(keys.RQ_QUEUE, connection=r).count)
    drain(r)


def test_register_schedule_report_advance(service, r, redis_url):
    client = CoordinatorClient(redis_url, reply_timeout=5)
    job_id = register(client)
    assert "+dp1+pp2+tp1+StepDown" in job_id
    wait_for(lambda: Queue(keys.RQ_QUEUE, connection=r).count)
    drain(r)
    first = client.wait_schedule(job_id, rank=1, timeout=5)
    assert first.version == 1 and first.rank == 1
    assert first.frequencies == [("forward", 1980), ("backward", 1980)] * 2

    for version in (1, 2):
        report_round(client, r, job_id, version)
    store = JobStore(r)
    assert store.version(job_id) == 3
    assert store.schedule(job_id, 3, 0).frequencies[0] == ("forward", 1950)
    assert [e.observed_version for e in store.journal(job_id)] == [None, 1, 2]
    # Any worker can rebuild the scheduler from Redis alone.
    scheduler, journal = rebuild_scheduler(store, store.get_job(job_id))
    assert len(journal) == 3 and len(scheduler.observed) == 2
    assert [len(batch) for batch in scheduler.observed] == [2, 2]


def test_a_redis_that_lost_its_scripts_gets_them_again(service, r, redis_url):
    """After SCRIPT FLUSH (a restart, say), single writes and batches load their script again."""
    client = CoordinatorClient(redis_url, reply_timeout=5)
    r.script_flush()
    job_id = client.register_job(JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2))
    for rank in range(2):
        r.script_flush()  # a registration is one script call, sent without a pipeline
        info = RankInfo(rank=rank, dp_rank=0, pp_rank=rank, tp_rank=0, available_frequencies=FREQS)
        assert client.register_rank(job_id, info).ok
    wait_for(lambda: Queue(keys.RQ_QUEUE, connection=r).count)
    drain(r)
    r.script_flush()  # results go in a batch, with the version's task in its transaction
    report_round(client, r, job_id, 1)
    assert JobStore(r).version(job_id) == 2
    assert not r.xlen(keys.DEADLETTER_STREAM)


def test_a_batch_that_met_a_lost_script_sends_only_the_failed_calls_again(r):
    """NOSCRIPT fails a call, not its transaction: what ran is not sent a second time."""
    store = JobStore(r)
    job = JobInfo(job_id="j", pp_degree=2, dp_degree=1, tp_degree=1, world_size=2)
    store.create_job(job, JobConfig(scheduler="tests.toy_schedulers:StepDown"), "1-1")
    r.script_flush()
    r.script_load(ADD_RANK)  # known again: the registration's script, not the control's
    now = store.clock.now()
    batch = store.batch()
    info = RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=FREQS)
    batch.add_rank(job, info, now, credentials(new_token()), "req-0")
    batch.add_control(SetTarget(job_id="j", iteration_time=1.0), "5-0", now)
    # Sent twice, this registration would come back as answered already (DuplicateEntryError).
    assert batch.execute(then=lambda pipe: pipe.rpush("probe", "x")) == [1, True]
    assert r.xlen(keys.job_control("j")) == 1
    assert r.llen("probe") == 2  # ``then`` ran with the first send, and after the retry


def test_two_jobs_registered_in_the_same_second_get_different_ids(service, redis_url):
    client = CoordinatorClient(redis_url, reply_timeout=5)
    ids = {
        client.register_job(JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1))
        for _ in range(5)
    }
    assert len(ids) == 5


def test_the_worker_publishes_with_the_coordinators_stream_cap(r, redis_url):
    """PERSEUS_STREAM_MAXLEN reaches the rq task: workers cap the updates streams with it."""
    coord = Coordinator(r, make_settings(redis_url, stream_maxlen=150, snapshot_every=3))
    task = coord.enqueue_advance("some-job")
    assert task.kwargs == {"snapshot_every": 3, "stream_maxlen": 150}


def test_publish_is_compare_and_set(r, redis_url):
    from protocol.models import JobConfig, JournalEntry

    store = JobStore(r)
    job = JobInfo(job_id="j1", pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    store.create_job(job, JobConfig(scheduler="x"), "1-0")
    sched = [FrequencySchedule(rank=0, frequencies=[("forward", 1980)])]
    assert store.publish("j1", sched, JournalEntry(version=1))
    assert not store.publish("j1", sched, JournalEntry(version=1))
    assert not store.publish("j1", sched, JournalEntry(version=3))
    assert store.version("j1") == 1 and len(store.journal("j1")) == 1
    assert [f[b"version"] for _, f in r.xrange(keys.job_updates("j1"))] == [b"1"]


def test_idle_jobs_are_deleted_with_all_their_keys(service, r, redis_url):
    client = CoordinatorClient(redis_url, reply_timeout=5)
    job_id = register(client)
    drain(r)
    client.report(job_id, result(0, 1))
    wait_for(lambda: JobStore(r).result_count(job_id, 1) == 1)
    assert list(r.scan_iter(match=f"perseus:job:{job_id}:*"))
    age_job(r, job_id, 10)
    service.settings = service.settings.model_copy(update={"max_job_idle_time": 5})
    service.sweep()
    assert list(r.scan_iter(match=f"perseus:job:{job_id}:*")) == []
    assert r.zscore(keys.JOBS_INDEX, job_id) is None


def due_one_rank_job(store: JobStore, job_id: str) -> None:
    """A registered one-rank job whose first version is due, enqueued nowhere."""
    from protocol.models import JobConfig

    job = JobInfo(job_id=job_id, pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    store.create_job(job, JobConfig(scheduler="tests.toy_schedulers:StepDown"), "1-0")
    store.add_rank(
        job, RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=FREQS)
    )


def test_sweep_reenqueues_stalled_work(r, redis_url):
    coord = Coordinator(r, make_settings(redis_url, stall_timeout=0.1))
    store = JobStore(r)
    due_one_rank_job(store, "j2")
    # Due work with no rq job at all (e.g. the enqueue was lost): the sweep enqueues it.
    coord.sweep()
    assert Queue(keys.RQ_QUEUE, connection=r).count == 1
    coord.sweep()  # still queued: not enqueued twice
    assert Queue(keys.RQ_QUEUE, connection=r).count == 1
    drain(r)
    assert store.version("j2") == 1


def test_sweep_reenqueues_work_a_killed_worker_had_dequeued(r, redis_url):
    coord = Coordinator(r, make_settings(redis_url, stall_timeout=0.1))
    store = JobStore(r)
    due_one_rank_job(store, "j3")
    coord.sweep()
    queue = Queue(keys.RQ_QUEUE, connection=r)
    (first,) = queue.job_ids
    # A worker took the job (rq moves it to an intermediate list) and was killed before it
    # started it (`docker kill` in the fork window): rq still calls it queued, until its
    # maintenance notices, 10 minutes or more later.
    r.lmove(queue.key, queue.intermediate_queue_key)
    assert queue.count == 0
    assert Job.fetch(first, connection=r).get_status() == JobStatus.QUEUED
    time.sleep(0.2)
    coord.sweep()
    assert queue.count == 1 and queue.job_ids != [first]
    drain(r)
    assert store.version("j3") == 1


def test_stale_pending_entries_are_claimed(r, redis_url):
    from coordinator.resilience import ensure_groups

    ensure_groups(r)
    r.xadd(
        keys.REGISTRATIONS_STREAM,
        encode_message(
            RegisterJob(
                request_id="c1", job=JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
            )
        ),
    )
    # A coordinator that read the entry and died before acknowledging it.
    r.xreadgroup(keys.COORDINATOR_GROUP, "dead-one", {keys.REGISTRATIONS_STREAM: ">"})
    coord = Coordinator(r, make_settings(redis_url), consumer="alive", claim_idle_ms=0)
    coord.step(block_ms=None)
    assert len(JobStore(r).list_jobs()) == 1
    assert r.xpending(keys.REGISTRATIONS_STREAM, keys.COORDINATOR_GROUP)["pending"] == 0


def test_scheduler_args_are_checked_at_start(r, redis_url):
    from protocol.exceptions import ConfigError

    bad = PerseusSettings(redis_url=redis_url, scheduler="PointSolution", scheduler_args={"x": 1})
    with pytest.raises(ConfigError, match="solution_path"):
        Coordinator(r, bad)
    with pytest.raises(ConfigError, match="unknown scheduler"):
        Coordinator(r, PerseusSettings(redis_url=redis_url, scheduler="NoSuchScheduler"))
    with pytest.raises(ValueError, match="extra"):
        PerseusSettings(redis_url=redis_url, bogus_field=1)


def test_redis_down_is_reported_clearly():
    client = CoordinatorClient("redis://127.0.0.1:1/0", reply_timeout=1)
    from protocol.exceptions import CoordinatorUnavailableError

    with pytest.raises(CoordinatorUnavailableError, match=r"127\.0\.0\.1:1"):
        client.register_job(JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1))
    with pytest.raises(redis.ConnectionError):
        client.latest_version("x")


def test_job_may_choose_a_builtin_scheduler_with_inline_plan(service, r, redis_url, tmp_path):
    from schedulers.planning.plan_file import write_plan_file

    plan = tmp_path / "plan.py"
    write_plan_file(plan, [[("forward", 1965), ("backward", 1950)]], {"plan": 7})
    client = CoordinatorClient(redis_url, reply_timeout=5)
    job = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    job_id = client.register_job(job, "PointSolution", {"plan_text": plan.read_text()})
    assert job_id.endswith("+dp1+pp1+tp1+PointSolution")
    client.register_rank(
        job_id, RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=FREQS)
    )
    wait_for(lambda: Queue(keys.RQ_QUEUE, connection=r).count)
    drain(r)
    assert client.wait_schedule(job_id, 0, timeout=5).frequencies == [
        ("forward", 1965),
        ("backward", 1950),
    ]
    # Only built-in names, with arguments that fit; both refused with the reason.
    with pytest.raises(ProtocolError, match="a job may choose one of"):
        client.register_job(job, "tests.toy_schedulers:StepDown")
    with pytest.raises(ProtocolError, match="exactly one of solution_path"):
        client.register_job(job, "PointSolution", {})


def test_scheduler_artifacts_are_stored_and_dumped(r, redis_url, tmp_path):
    from coordinator.dump import dump_job
    from protocol.models import JobConfig

    store = JobStore(r)
    job = JobInfo(job_id="j3", pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    store.create_job(job, JobConfig(scheduler="tests.toy_schedulers:WithArtifact"), "1-0")
    store.add_rank(
        job, RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=FREQS)
    )
    advance_job("j3", conn=r)
    assert store.artifacts("j3") == {"note.txt": b"made by version 1"}
    folder = dump_job(store, "j3", str(tmp_path)).folder
    assert (folder / "artifacts" / "note.txt").read_bytes() == b"made by version 1"
    assert (folder / "1.sched.json").exists() and (folder / "journal.json").exists()
    store.delete_job("j3")
    assert r.exists(keys.job_artifacts("j3")) == 0


def test_artifacts_named_like_the_dumps_own_files_overwrite_nothing(r, redis_url, tmp_path):
    from coordinator.dump import dump_job
    from protocol.models import JobConfig

    # Written beside them, an artifact "job.json" replaced the job's file, and "complete"
    # was replaced by the dump's marker; "a/x" and "b/x" both went to "x".
    store = JobStore(r)
    job = JobInfo(job_id="j4", pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    store.create_job(job, JobConfig(scheduler="PointSolution"), "1-0")
    named = ["complete", "job.json", "journal.json", "1.sched.json", "a/x", "b/x", "..", "."]
    artifacts = {name: f"artifact {name}".encode() for name in named}
    store.save_artifacts("j4", artifacts)
    folder = dump_job(store, "j4", str(tmp_path)).folder
    assert json.loads((folder / "job.json").read_text())["info"]["job_id"] == "j4"
    assert (folder / "complete").read_text().startswith("perseus dump of j4")
    assert json.loads((folder / "journal.json").read_text()) == []
    assert not (folder / "1.sched.json").exists() and not (folder / "x").exists()
    from coordinator.dump import artifact_path

    assert {name: artifact_path(folder, name).read_bytes() for name in named} == artifacts
    assert len(list((folder / "artifacts").iterdir())) == len(named)
    assert artifact_path(folder, "a/x").name == "a%2Fx"


def test_dump_and_status_commands(service, r, redis_url, tmp_path):
    from click.testing import CliRunner

    from coordinator.cli import main

    client = CoordinatorClient(redis_url, reply_timeout=5)
    job_id = register(client)
    drain(r)
    runner = CliRunner()
    result = runner.invoke(main, ["dump", job_id, "--out", str(tmp_path), "--redis-url", redis_url])
    assert result.exit_code == 0, result.output
    folder = tmp_path / job_id
    assert {"job.json", "ranks.json", "1.sched.json", "journal.json"} <= {
        p.name for p in folder.iterdir()
    }
    result = runner.invoke(main, ["dump", "nope", "--out", str(tmp_path), "--redis-url", redis_url])
    assert result.exit_code == 1 and "unknown job id 'nope'" in result.output
    result = runner.invoke(main, ["status", "--redis-url", redis_url])
    assert result.exit_code == 0, result.output
    assert job_id in result.output and "perseus:stream:results" in result.output
    result = runner.invoke(main, ["status", "--redis-url", "redis://127.0.0.1:1/0"])
    assert result.exit_code == 1 and "cannot reach Redis" in result.output
    # Not a URL, or an empty one: said so (no fallback to localhost).
    for url in ("localhost:6379", ""):
        result = runner.invoke(main, ["status", "--redis-url", url])
        assert result.exit_code == 1, result.output
        assert f"invalid Redis URL {url!r}: it must start with redis://" in result.output
        assert "redis+sentinel://" in result.output


def test_dump_data_writes_each_version_as_it_is_published(r, redis_url, tmp_path):
    settings = make_settings(redis_url, dump_data=True, dump_dir=str(tmp_path))
    with running(Coordinator(r, settings)):
        client = CoordinatorClient(redis_url, reply_timeout=5)
        job_id = register(client)
        drain(r)
        report_round(client, r, job_id, 1)
    folder = tmp_path / job_id
    names = {p.name for p in folder.iterdir()}
    assert {"job.json", "ranks.json", "1.sched.json", "2.sched.json", "1.prof.json"} <= names
    import json

    prof = json.loads((folder / "1.prof.json").read_text())
    assert [p["rank"] for p in prof] == [0, 1]
    # Read back as Zeus's load_prof / load_sched / load_ranks read its dump folder.
    assert load_prof(folder, 1) == [result(0, 1), result(1, 1)]
    assert [s.rank for s in load_sched(folder, 2)] == [0, 1]
    assert load_sched(folder, 2) == JobStore(r).schedules(job_id, 2)
    assert load_ranks(folder) == JobStore(r).ranks(job_id)


def test_dump_data_writes_the_results_a_converged_scheduler_observed(r, redis_url, tmp_path):
    # Zeus's server dumps every round's results; a PointSolution job publishes no version
    # after its first, so its results were never dumped.
    settings = make_settings(redis_url, dump_data=True, dump_dir=str(tmp_path))
    with running(Coordinator(r, settings)):
        client = CoordinatorClient(redis_url, reply_timeout=5)
        job_id = register(client, 2, "PointSolution", {"plan_text": POINT_PLAN})
        drain(r)
        report_round(client, r, job_id, 1)
    assert JobStore(r).version(job_id) == 1  # converged: no version 2
    assert load_prof(tmp_path / job_id, 1) == [result(0, 1), result(1, 1)]


def test_converged_scheduler_records_observation_without_new_version(service, r, redis_url):
    client = CoordinatorClient(redis_url, reply_timeout=5)
    job_id = register(client, 2, "PointSolution", {"plan_text": POINT_PLAN})
    drain(r)
    report_round(client, r, job_id, 1)
    store = JobStore(r)
    journal = store.journal(job_id)
    assert [(e.version, e.observed_version, e.published) for e in journal] == [
        (1, None, True),
        (1, 1, False),
    ]
    assert store.version(job_id) == 1
    assert not store.due(store.get_job(job_id))  # the observation is not made twice
    assert advance_job(job_id, conn=r) == []
    scheduler, _ = rebuild_scheduler(store, store.get_job(job_id))
    assert scheduler.converged
    assert [int(f[b"version"]) for _, f in r.xrange(keys.job_updates(job_id))] == [1]


def test_idle_deletion_spares_a_job_refreshed_since_it_was_listed(r, redis_url):
    from protocol.models import JobConfig

    store = JobStore(r)
    job = JobInfo(job_id="j9", pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    store.create_job(job, JobConfig(scheduler="x"), "1-0")
    listed_at = time.time()
    r.zadd(keys.JOBS_INDEX, {"j9": listed_at + 5})  # a heartbeat after the sweep's listing
    assert not store.delete_job("j9", idle_before=listed_at)
    assert r.exists(keys.job_info("j9")) and r.zscore(keys.JOBS_INDEX, "j9") is not None
    assert store.delete_job("j9", idle_before=listed_at + 5)
    assert not r.exists(keys.job_info("j9")) and r.zscore(keys.JOBS_INDEX, "j9") is None


def test_redis_older_than_6_2_is_refused_clearly(r):
    from coordinator.service import check_redis_version
    from protocol.exceptions import ConfigError

    check_redis_version(str(r.info("server")["redis_version"]))  # the test server is new enough
    check_redis_version("7.0.15")
    with pytest.raises(ConfigError, match=r"needs Redis >= 6.2; this server runs 6.0.16"):
        check_redis_version("6.0.16")
    with pytest.raises(ConfigError, match="cannot parse"):
        check_redis_version("banana")


def test_a_burst_of_a_full_batch_of_results_or_more_is_handled(r, redis_url):
    # A 1,000-rank job reports at once: the first blocked read already returns a full batch.
    # (The top-up reads once asked XREADGROUP for COUNT 0 here, and the coordinator died.)
    from coordinator.resilience import ensure_groups

    coord = Coordinator(r, make_settings(redis_url))
    ensure_groups(r)
    for rank in range(250):
        r.xadd(
            keys.RESULTS_STREAM, encode_message(ReportResult(job_id="nope", result=result(rank, 1)))
        )
    handled = 0
    while handled < 250:
        step = coord.step(block_ms=10)
        assert step > 0
        handled += step
    assert r.xlen(keys.DEADLETTER_STREAM) == 250  # unknown job: each dead-lettered, none lost
    assert r.xpending(keys.RESULTS_STREAM, keys.COORDINATOR_GROUP)["pending"] == 0


def test_results_completing_a_version_are_stored_acked_and_its_task_enqueued_at_once(r, redis_url):
    """One transaction: the results script acknowledges its entries and records the task
    enqueued with it. A second one (XACK and the record) followed every batch."""
    coord = Coordinator(r, make_settings(redis_url))
    client = CoordinatorClient(redis_url, reply_timeout=5)
    with running(coord):
        job_id = register(client)
    drain(r)  # version 1
    for rank in range(2):
        client.report(job_id, result(rank, 1))
    r.script_load(ADD_RESULTS)  # as after a coordinator's first batch (no NOSCRIPT retry)
    # Only the read and its batch: no claim, heartbeat or sweep in this step.
    coord._last_claim = coord._last_beat = coord._last_sweep = float("inf")
    exec_calls = r.info("commandstats").get("cmdstat_exec", {}).get("calls", 0)
    assert coord.step(block_ms=None) == 2
    assert r.info("commandstats")["cmdstat_exec"]["calls"] == exec_calls + 1
    assert r.xpending(keys.RESULTS_STREAM, keys.COORDINATOR_GROUP)["pending"] == 0
    task = r.hget(keys.job_info(job_id), "rq_job").decode()
    assert Queue(keys.RQ_QUEUE, connection=r).job_ids == [task]
    drain(r)
    assert JobStore(r).version(job_id) == 2
