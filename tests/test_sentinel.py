"""High availability through Redis Sentinel: master, replica, three sentinels, failover mid-job.

Every component takes a ``redis+sentinel://`` URL. The master is SIGKILLed while a job trains;
the sentinels promote the replica, and training, the coordinator and the rq worker carry on with
it: the hook never raises, and the job reaches versions published after the failover.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest
import redis

from coordinator.embedded import EmbeddedRedis
from protocol.connection import connect, parse_sentinel_url, redact_url
from protocol.exceptions import CoordinatorUnavailableError
from tests.helpers import FAST_RECOVERY, TOY_SCHEDULER, free_ports, start_perseus, wait_for
from tests.helpers import stop as stop_procs
from tests.rank_helpers import make_hook, step_until
from tests.sentinel_server import SENTINEL_SERVICE, start_sentinel
from worker_client.gpu.frequency import DryRunFrequencyController


@pytest.fixture
def sentinel_cluster(tmp_path) -> Iterator[tuple[str, EmbeddedRedis, EmbeddedRedis]]:
    """(sentinel URL, master, replica) with three sentinels watching the master."""
    p_master, p_replica, *p_sentinels = free_ports(5)
    master = EmbeddedRedis(port=p_master)
    replica = EmbeddedRedis(port=p_replica, extra_args=("--replicaof", "127.0.0.1", str(p_master)))
    sentinels: list[subprocess.Popen] = []
    try:
        wait_for(
            lambda: (
                redis.Redis.from_url(replica.url).info("replication")["master_link_status"] == "up"
            ),
            20,
            "the replica to sync",
        )
        sentinels = [
            start_sentinel(tmp_path / f"sentinel{i}", port, p_master)
            for i, port in enumerate(p_sentinels)
        ]

        def all_see_the_replica() -> bool:
            for port in p_sentinels:
                try:
                    peer = redis.Redis(port=port, socket_timeout=1)
                    if not peer.sentinel_slaves(SENTINEL_SERVICE):
                        return False
                except redis.RedisError:
                    return False
            return True

        wait_for(all_see_the_replica, 30, "sentinels to discover the replica", poll=0.2)
        hosts = ",".join(f"127.0.0.1:{port}" for port in p_sentinels)
        yield f"redis+sentinel://{hosts}/{SENTINEL_SERVICE}/0", master, replica
    finally:
        for proc in sentinels:
            proc.terminate()
        for proc in sentinels:
            proc.wait(timeout=10)
        master.stop()
        replica.stop()


def test_sentinel_urls_are_parsed_and_redacted():
    parsed = parse_sentinel_url("redis+sentinel://u:s3cret@a:26379,b:26380/mymaster/2")
    assert parsed.hosts == (("a", 26379), ("b", 26380))
    assert (parsed.service, parsed.db, parsed.username, parsed.password) == (
        "mymaster",
        2,
        "u",
        "s3cret",
    )
    assert "s3cret" not in redact_url("redis+sentinel://u:s3cret@a:26379,b:26380/mymaster/2")
    for bad in ("redis+sentinel://a:1", "redis+sentinel:///svc", "redis+sentinel://a:x/svc"):
        with pytest.raises(ValueError):
            parse_sentinel_url(bad)


def test_training_rides_through_a_sentinel_failover(gloo, sentinel_cluster, tmp_path):
    url, master, replica = sentinel_cluster
    args = ["--redis-url", url]
    coordinator = start_perseus(
        [
            "coordinator",
            *args,
            "--scheduler",
            TOY_SCHEDULER,
            "--scheduler-args",
            json.dumps({"microbatches": 2}),
        ],
        tmp_path,
        "coordinator.log",
        FAST_RECOVERY,
    )
    worker = start_perseus(["worker", "--simple", *args], tmp_path, "worker.log", FAST_RECOVERY)
    hook = None
    try:
        hook = make_hook(url, DryRunFrequencyController(0), report_every=1, schedule_timeout=60)
        step_until(hook, lambda: hook.schedule.version >= 2, 60, "version 2 before the failover")
        before = hook.schedule.version
        assert connect(url).connection_pool.get_master_address()[1] == master.port

        master._proc.send_signal(signal.SIGKILL)
        master._proc.wait(timeout=10)
        started = time.monotonic()
        # Training goes on through the failover (the hook raises nothing) and reaches
        # versions that were computed and published on the promoted replica.
        step_until(
            hook, lambda: hook.schedule.version >= before + 2, 90, "versions after the failover"
        )
        failover_s = time.monotonic() - started
        promoted = connect(url)
        promoted.ping()
        assert promoted.connection_pool.get_master_address()[1] == replica.port
        assert redis.Redis.from_url(replica.url).info("replication")["role"] == "master"
        assert coordinator.poll() is None and worker.poll() is None
        print(f"failover: next versions reached {failover_s:.1f} s after the master died")
    finally:
        if hook is not None:
            hook.close()
        stop_procs([coordinator, worker], timeout=10)


def test_no_sentinel_answering_is_one_short_line():
    """redis-py's own message appends the repr of every sentinel client (kilobytes)."""
    with pytest.raises(CoordinatorUnavailableError) as caught:
        connect("redis+sentinel://:secret@127.0.0.1:1/mymaster", ping=True, connect_timeout=1)
    message = str(caught.value)
    assert "no sentinel at 127.0.0.1:1 answered with a master for 'mymaster'" in message
    assert len(message) < 200 and "secret" not in message


def test_a_sentinel_url_parameter_that_is_not_used_is_refused_by_name():
    # Only sentinel_password and socket_timeout are read: ?ssl_cert_reqs=none did nothing,
    # unsaid, and a misspelt sentinel_pasword sent no password.
    url = "redis+sentinel://a:26379/mymaster?sentinel_password=pw"
    assert parse_sentinel_url(url).sentinel_password == "pw"
    for query, named in (
        ("socket_timeot=5", "socket_timeot"),
        ("sentinel_pasword=pw", "sentinel_pasword"),
        ("ssl_cert_reqs=none&sentinel_password=pw", "ssl_cert_reqs"),
        ("verbose", "verbose"),
    ):
        with pytest.raises(ValueError, match=named) as caught:
            parse_sentinel_url(f"rediss+sentinel://a:26379/mymaster?{query}")
        assert "pw" not in str(caught.value).replace("sentinel_pasword", "")


def test_a_sentinel_urls_socket_timeout_is_a_number_of_seconds():
    # It was refused, so an operator command's 5 s could not be changed (the hint for a
    # redis:// URL says to add it).
    url = "redis+sentinel://a:26379/mymaster"
    assert parse_sentinel_url(f"{url}?socket_timeout=2.5").socket_timeout == 2.5
    assert parse_sentinel_url(url).socket_timeout is None
    for value in ("", "abc", "0", "-1", "nan", "inf"):
        with pytest.raises(ValueError, match=f"socket_timeout='{value}' is not a number"):
            parse_sentinel_url(f"{url}?socket_timeout={value}")
