"""Redis that hangs (a server stopped with SIGSTOP, a network that drops packets) or goes away.

What an operator meets: a stop is honoured within seconds, and no entry is lost.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis

from coordinator.embedded import EmbeddedRedis
from protocol import keys
from protocol.models import ReportResult, encode_message
from tests.helpers import WITH_SIGINT, free_ports, result, start_perseus, stop, wait_for
from tests.silent_proxy import SilentProxy

PASSWORD = "hang-test-secret"
# Well under the 30 s that a stopped Redis held each of these before, with room for a busy CI.
BOUND_S = 20


@pytest.fixture
def private_redis() -> Iterator[EmbeddedRedis]:
    """A redis-server of this test's own, on a free TCP port, with a password."""
    (port,) = free_ports()
    with EmbeddedRedis(port=port, password=PASSWORD) as server:
        yield server


@contextmanager
def stopped(server: EmbeddedRedis) -> Iterator[None]:
    """``server`` stopped with SIGSTOP (it accepts connections and answers nothing) inside."""
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


def members(conn: redis.Redis) -> set[str]:
    """Consumers in the coordinators' group on the results stream."""
    try:
        rows = conn.xinfo_consumers(keys.RESULTS_STREAM, keys.COORDINATOR_GROUP)
    except redis.ResponseError:
        return set()
    return {row["name"].decode() for row in rows}


def coordinator_args(url: str) -> list[str]:
    return ["coordinator", "--redis-url", url, "--scheduler", ""]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_coordinator_stops_within_seconds_while_redis_hangs(private_redis, tmp_path, signum):
    # Its blocking read in flight waited the whole socket timeout (30 s) before the loop saw
    # the stop, past `docker stop`'s 10 s: the stop now cuts it after the read's block time.
    conn = redis.Redis.from_url(private_redis.url)
    args = coordinator_args(private_redis.url)
    proc = start_perseus(["-c", WITH_SIGINT, *args], tmp_path, "coordinator.log", python=True)
    try:
        wait_for(lambda: members(conn), 30, "the coordinator to join the group")
        with stopped(private_redis):
            # Longer than its read's block (1 s): the command it sends next, or the read in
            # flight, waits on the stopped server.
            time.sleep(1.5)
            proc.send_signal(signum)
            assert proc.wait(timeout=BOUND_S) == 0
    finally:
        stop([proc])
    log = (tmp_path / "coordinator.log").read_text()
    assert "cutting its connections" in log, log
    assert "Traceback" not in log and "retrying" not in log, log  # a stop, not an outage


def test_entries_a_hanging_redis_held_stay_pending_and_are_processed_after_a_restart(
    private_redis, tmp_path
):
    # A network that swallows the coordinator's acknowledgements: it had read an entry and
    # sent its outcome (a dead letter, here) with the XACK, and no reply came.
    conn = redis.Redis.from_url(private_redis.url)
    with SilentProxy(private_redis.url) as proxy:
        hidden = proxy.url.replace("redis://", f"redis://:{PASSWORD}@")
        first = start_perseus(coordinator_args(hidden), tmp_path, "first.log")
        try:
            (name,) = wait_for(lambda: members(conn), 30, "the coordinator to join the group")
            proxy.silence_from(b"XACK")
            entry = encode_message(ReportResult(job_id="no-such-job", result=result(0, 1)))
            entry_id = conn.xadd(keys.RESULTS_STREAM, entry).decode()
            wait_for(proxy.silent.is_set, 30, "the coordinator to send the acknowledgement")
            first.terminate()
            assert first.wait(timeout=BOUND_S) == 0
        finally:
            stop([first])
    pending = conn.xpending_range(keys.RESULTS_STREAM, keys.COORDINATOR_GROUP, "-", "+", 10)
    assert [(p["message_id"].decode(), p["consumer"].decode()) for p in pending] == [
        (entry_id, name)
    ]
    assert conn.xlen(keys.DEADLETTER_STREAM) == 0  # the transaction never reached Redis
    second = start_perseus(coordinator_args(private_redis.url), tmp_path, "second.log")
    try:
        wait_for(lambda: conn.xlen(keys.DEADLETTER_STREAM) == 1, 60, "the claimed entry")
        wait_for(
            lambda: conn.xpending(keys.RESULTS_STREAM, keys.COORDINATOR_GROUP)["pending"] == 0,
            10,
            "its acknowledgement",
        )
    finally:
        stop([second])
    (letter,) = conn.xrange(keys.DEADLETTER_STREAM)
    assert entry_id.encode() in letter[1].values(), letter
