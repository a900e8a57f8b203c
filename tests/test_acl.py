"""`perseus acl`'s users: each role works with its permissions and is refused outside them."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import redis
from click.testing import CliRunner

from coordinator.cli import main
from coordinator.embedded import EmbeddedRedis
from protocol import keys
from protocol.acl import role_user
from protocol.connection import connect
from protocol.exceptions import CoordinatorUnavailableError
from protocol.models import JobConfig, JobInfo
from protocol.store import JobStore
from tests.acl_users import refused, url_of
from tests.helpers import TOY_SCHEDULER, result, start_perseus, stop, wait_for
from tests.rank_helpers import make_hook, step_until
from worker_client.gpu.frequency import DryRunFrequencyController
from worker_client.hook.session import CoordinatorClient
from worker_client.hook.watchers import ResultReporter, ScheduleWatcher


@pytest.mark.parametrize("major", [6, 7])
def test_each_role_works_within_its_permissions_and_is_refused_outside(
    major, request, gloo, tmp_path, monkeypatch
):
    # On Redis 7 ranks heartbeat and finish through the functions the coordinator loads.
    port = (
        request.getfixturevalue("acl_server")[1]
        if major == 6
        else request.getfixturevalue("redis7_port")
    )
    monkeypatch.setenv("PERSEUS_SIM_GPU_DIR", str(tmp_path / "simgpu"))
    service_url = url_of(port, "service")
    services = [
        start_perseus(
            ["coordinator", "--redis-url", service_url, "--scheduler", TOY_SCHEDULER],
            tmp_path,
            "coordinator.log",
        ),
        start_perseus(["worker", "--redis-url", service_url], tmp_path, "worker.log"),
    ]
    try:
        # Ranks train through the rank user: registration, schedules, results, heartbeats.
        hook = make_hook(url_of(port, "rank"), DryRunFrequencyController(0), report_every=1)
        try:
            step_until(hook, lambda: hook.schedule.version >= 3, 60, "version 3 as a rank")
            hook.watcher._beat()  # a heartbeat, as every heartbeat_interval
            assert not hook.watcher.job_lost and hook.watcher.error is None
            job_id = hook.job_id
        finally:
            hook.close()
        assert hook.reporter.unsent == 0
        # Closing marked its rank finished, and with it the one-rank job.
        assert redis.Redis.from_url(service_url).zscore(keys.FINISHED_JOBS, job_id) is not None

        # Operators read everything a command shows, and change nothing.
        operator = url_of(port, "operator")
        letter = redis.Redis.from_url(service_url).xadd(keys.DEADLETTER_STREAM, {"reason": "x"})
        for args in (
            ["status"],
            ["dump", job_id, "--out", str(tmp_path / "d")],
            ["deadletter", "list"],
            ["deadletter", "show", letter.decode()],
        ):
            result = CliRunner().invoke(main, [*args, "--redis-url", operator])
            assert result.exit_code == 0, (args, result.output)
        result = CliRunner().invoke(main, ["target", job_id, "1.0", "--redis-url", operator])
        assert result.exit_code == 1  # A job whose scheduler takes targets, but no permission.
        # Changing state as the operator: one line naming the user to use, no traceback.
        for args in (["jobs", "delete", job_id], ["deadletter", "purge", "--all"]):
            result = CliRunner().invoke(main, [*args, "--redis-url", operator])
            assert result.exit_code == 1, (args, result.output)
            assert "NOPERM" in result.output and "perseus-service" in result.output, result.output
            assert result.exception is None or isinstance(result.exception, SystemExit)
    finally:
        stop(services)
    for log in ("coordinator.log", "worker.log"):
        text = (tmp_path / log).read_text()
        assert "NOPERM" not in text, text[-3000:]

    rank = redis.Redis.from_url(url_of(port, "rank"))
    job_info = keys.job_info(job_id)
    assert rank.hget(job_info, "scheduler") is not None  # may read its job's info
    assert refused(rank, "HGETALL", keys.job_results(job_id, 1))
    assert refused(rank, "HGETALL", keys.job_tokens(job_id))  # the results' HMAC keys
    assert rank.hget(keys.job_beatcheck(job_id), "0")  # heartbeats check these digests
    assert refused(rank, "LRANGE", keys.job_journal(job_id), "0", "-1")
    assert refused(rank, "XADD", keys.DEADLETTER_STREAM, "*", "x", "1")
    assert refused(rank, "DEL", job_info)
    assert refused(rank, "HSET", job_info, "error", "forged")
    assert refused(rank, "SMEMBERS", "rq:workers")
    assert refused(rank, "FLUSHALL")
    assert refused(rank, "CONFIG", "GET", "*")

    op = redis.Redis.from_url(url_of(port, "operator"))
    assert op.hget(job_info, "scheduler") is not None
    assert refused(op, "XADD", keys.RESULTS_STREAM, "*", "x", "1")
    assert refused(op, "DEL", job_info)
    assert refused(op, "HSET", job_info, "error", "x")

    svc = redis.Redis.from_url(service_url)
    assert refused(svc, "FLUSHALL")
    assert refused(svc, "CONFIG", "SET", "appendonly", "no")
    assert refused(svc, "SET", "someone-else:key", "1")

    anonymous = redis.Redis(host="127.0.0.1", port=port)
    assert refused(anonymous, "GET", keys.job_version(job_id))
    assert JobStore(svc).version(job_id) >= 3


def test_a_wrong_password_is_named_as_the_problem_not_the_address(acl_server):
    _server, port = acl_server
    wrong = f"redis://{role_user('operator')}:not-the-password@127.0.0.1:{port}/0"
    with pytest.raises(CoordinatorUnavailableError, match="refused the login") as caught:
        connect(wrong, ping=True)
    assert "cannot reach" not in str(caught.value) and "not-the-password" not in str(caught.value)


def test_a_coordinator_started_as_the_operator_stops_at_once_naming_the_user(acl_server):
    _server, port = acl_server
    result = CliRunner().invoke(
        main, ["coordinator", "--redis-url", url_of(port, "operator"), "--scheduler", ""]
    )
    assert result.exit_code == 1, result.output
    assert "NOPERM" in result.output and "perseus-service" in result.output, result.output


def test_wrong_users_get_one_line_from_the_worker_and_from_jobs_finish(acl_server):
    _server, port = acl_server
    result = CliRunner().invoke(main, ["worker", "--redis-url", url_of(port, "operator")])
    assert result.exit_code == 1, result.output
    assert "NOPERM" in result.output and "perseus-service" in result.output, result.output
    svc = redis.Redis.from_url(url_of(port, "service"))
    JobStore(svc).create_job(
        JobInfo(job_id="j", pp_degree=1, dp_degree=1, tp_degree=1, world_size=1),
        JobConfig(scheduler=TOY_SCHEDULER),
        "1-1",
    )
    for role in ("rank", "operator"):
        result = CliRunner().invoke(
            main, ["jobs", "finish", "j", "--redis-url", url_of(port, role)]
        )
        assert result.exit_code == 1, (role, result.output)
        assert "perseus-service" in result.output and "Traceback" not in result.output, (
            result.output
        )
        assert result.exception is None or isinstance(result.exception, SystemExit), role


def test_a_refused_registration_is_raised_at_once_not_retried_as_an_outage(acl_server, caplog):
    # A rank waiting for its reply rides through a Redis restart; an ACL's refusal is no outage.
    _server, port = acl_server
    client = CoordinatorClient(url_of(port, "operator"), reply_timeout=30)
    with (
        caplog.at_level(logging.WARNING),
        pytest.raises(CoordinatorUnavailableError, match="no permissions"),
    ):
        client.register_job(JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1))
    assert "retrying" not in caplog.text


@pytest.mark.parametrize("refusal", ["password", "noperm"])
def test_a_background_thread_refused_by_redis_says_so_not_that_redis_is_unreachable(
    refusal, caplog
):
    # Mid-training, the rank's login or its ACL rules stop working: the hook's threads go on
    # retrying (Redis's operator may fix it), but they must say what is wrong, loudly, once.
    with EmbeddedRedis(password="pw-1") as server:
        admin = redis.Redis.from_url(server.url)
        client = CoordinatorClient(server.url)
        watcher = ScheduleWatcher(client, "job-r", 0, 1, heartbeat_interval=0.2)
        reporter = ResultReporter(client, "job-r", flush_timeout=1.0)
        with caplog.at_level(logging.WARNING, logger="worker_client.hook.watchers"):
            watcher.start()
            reporter.start()
            if refusal == "password":  # a new password, every connection dropped
                admin.config_set("requirepass", "pw-2")
                admin = redis.Redis(unix_socket_path=str(server.socket_path), password="pw-2")
                admin.client_kill_filter(_type="normal", skipme=True)
            else:  # the user's rules no longer grant what the hook sends
                admin.execute_command("ACL", "SETUSER", "default", "-xadd", "-evalsha")
            reporter.submit(result(0, 1))
            wait_for(lambda: watcher.outage.refused and reporter.outage.refused, 10, "refusals")
            reporter.stop()
            watcher.stop()
        client.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    for thread in ("rank 0 schedule watcher", "result reporter"):
        said = [m for m in errors if m.startswith(f"{thread}: redis at") and "refused" in m]
        assert len(said) == 1 and "not an outage" in said[0], errors
    assert reporter.unsent == 1
    assert any("still refusing this client" in m for m in errors), errors


def test_rq_info_reads_as_the_operator_and_a_named_queue_needs_the_service(acl_server, tmp_path):
    # `rq info QUEUE` cleans that queue's registries as it counts them (ZREMRANGEBYSCORE), a
    # write: the read-only operator gets `rq info`, the README says to name a queue as the
    # service user.
    _server, port = acl_server
    worker = start_perseus(["worker", "--redis-url", url_of(port, "service")], tmp_path, "w.log")
    try:
        svc = redis.Redis.from_url(url_of(port, "service"))
        wait_for(lambda: svc.scard("rq:workers") == 1, 30, "the rq worker to register")

        def rq_info(role: str, *args: str) -> subprocess.CompletedProcess:
            command = [sys.executable, "-m", "rq.cli", "info", "-u", url_of(port, role), *args]
            return subprocess.run(command, capture_output=True, text=True, timeout=60)

        listed = rq_info("operator")
        assert listed.returncode == 0, listed.stderr
        assert "1 workers" in listed.stdout and keys.RQ_QUEUE in listed.stdout, listed.stdout
        named = rq_info("operator", keys.RQ_QUEUE)
        assert named.returncode != 0 and "zremrangebyscore" in named.stderr, named.stderr
        named = rq_info("service", keys.RQ_QUEUE)
        assert named.returncode == 0 and "1 workers" in named.stdout, named.stderr
    finally:
        stop([worker])
    # rq asks CLIENT INFO for the worker's address (CLIENT LIST, every client's, if refused):
    # it warned "CLIENT LIST command not supported" at every start.
    assert "not supported" not in (tmp_path / "w.log").read_text()
