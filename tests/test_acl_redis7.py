"""On Redis 7 the ACL users go further: read-only job keys, no Lua of a rank's own, functions.

These tests need a Redis 7 server (the system's, or REDIS7_BINARY); they skip without one.
"""

from __future__ import annotations

import logging
import subprocess

import pytest
import redis

from coordinator.embedded import EmbeddedRedis
from coordinator.sweep import Sweeper
from protocol import keys, rank_functions
from protocol.exceptions import WrongTokenError
from protocol.job_lifecycle import JobLifecycle
from protocol.models import JobConfig, JobInfo, RankInfo
from protocol.store import JobStore
from protocol.tokens import new_token
from tests.acl_users import SYSTEM_REDIS, answers, refused, system_major, url_of, write_acl
from tests.helpers import (
    FREQS,
    REDIS7_BINARY,
    TOY_SCHEDULER,
    free_ports,
    make_settings,
    wait_for,
)


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


def test_on_redis_7_an_append_only_restart_keeps_transactions_of_the_acl_users(tmp_path):
    # Redis 7.0 replays the append-only file as the default user: with no permissions, it
    # refused every MULTI/EXEC on reload, and a restart lost the jobs (seen on 7.0.15).
    if system_major() < 7:
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
        wait_for(lambda: answers(svc), timeout=10, what="redis-server")
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
