"""Coordinators that stop leave the consumer group; the sweep removes those that died."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis

from coordinator.embedded import EmbeddedRedis
from coordinator.resilience import STOP_GRACE_S, ensure_groups
from coordinator.service import STOP_WAIT_S, Coordinator
from protocol import keys
from protocol.connection import SOCKET_TIMEOUT_S, connect
from protocol.models import ReportResult, encode_message
from tests.helpers import (
    WITH_SIGINT,
    coordinator_thread,
    make_settings,
    result,
    running,
    start_perseus,
    stop,
    wait_for,
)


def consumers(r: redis.Redis) -> set[str]:
    """Members of the coordinators' group on any input stream."""
    names = set()
    for stream in keys.INPUT_STREAMS:
        try:
            rows = r.xinfo_consumers(stream, keys.COORDINATOR_GROUP)
        except redis.ResponseError:
            continue
        names |= {row["name"].decode() for row in rows}
    return names


@contextmanager
def consuming_when_redis_hangs() -> Iterator[tuple[Coordinator, threading.Thread, redis.Redis]]:
    """A coordinator thread (reads block 0.1 s) whose redis-server then stops (SIGSTOP).

    Inside, its next read is in flight on the stopped server, which answers nothing and
    closes nothing, as a stalled network does; the server goes on (SIGCONT) after the block.

    Yields:
        The coordinator, its thread and its connection.
    """
    with EmbeddedRedis() as server:
        conn = connect(server.url, socket_timeout=SOCKET_TIMEOUT_S, dedicated=True)
        coord = Coordinator(conn, make_settings(server.url))
        with coordinator_thread(coord, block_ms=100) as thread:
            wait_for(
                lambda: coord.consumer in consumers(redis.Redis.from_url(server.url)), 10, "it"
            )
            os.kill(server.pid, signal.SIGSTOP)
            try:
                time.sleep(0.5)  # its next read is in flight
                yield coord, thread, conn
            finally:
                os.kill(server.pid, signal.SIGCONT)


@pytest.mark.parametrize(
    "signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["SIGTERM", "Ctrl-C", "SIGHUP"]
)
def test_a_coordinator_stopped_cleanly_leaves_the_consumer_group(r, redis_url, tmp_path, signum):
    """A real `perseus coordinator` process, stopped by a service manager or by Ctrl-C.

    Ctrl-C used to end the loop with a KeyboardInterrupt: no consumer left the group and the
    coordinator's record stayed, so one restarted with other settings was refused.
    """
    args = ["coordinator", "--redis-url", redis_url, "--scheduler", "tests.toy_schedulers:StepDown"]
    proc = start_perseus(["-c", WITH_SIGINT, *args], tmp_path, "coordinator.log", python=True)
    try:
        (name,) = wait_for(lambda: consumers(r), 30, "the coordinator to join the group")
        assert name.endswith(f"-{proc.pid}")
        proc.send_signal(signum)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert consumers(r) == set(), (tmp_path / "coordinator.log").read_text()[-2000:]
    assert "left the consumer group" in (tmp_path / "coordinator.log").read_text()
    assert not r.hexists(keys.COORDINATORS, name)
    # So a coordinator with other settings starts at once.
    args = ["coordinator", "--redis-url", redis_url, "--scheduler", "tests.toy_schedulers:Broken"]
    other = start_perseus(args, tmp_path, "other.log")
    try:
        wait_for(lambda: consumers(r), 30, "a coordinator with other settings to start")
    finally:
        stop([other])


def test_the_sweep_removes_a_dead_coordinators_consumer_once_nothing_is_pending(r, redis_url):
    ensure_groups(r)
    entry = encode_message(ReportResult(job_id="nope", result=result(0, 1)))
    r.xadd(keys.RESULTS_STREAM, entry)
    # A coordinator read the entry and died before acknowledging it.
    r.xreadgroup(keys.COORDINATOR_GROUP, "dead-1", {keys.RESULTS_STREAM: ">"})
    live = Coordinator(r, make_settings(redis_url), consumer="live-1", claim_idle_ms=200)
    live.sweeper.consumer_gone_after = 0.1
    time.sleep(0.15)
    live.sweep()
    assert "dead-1" in consumers(r)  # its entry is still pending: deleting it would lose it
    from protocol.consumers import GroupMembers

    assert GroupMembers(r).leave("dead-1") == 1  # nor does leaving on its behalf

    time.sleep(0.25)
    live.step(block_ms=10)  # claims the entry (XAUTOCLAIM) and handles it: dead-lettered
    assert r.xpending(keys.RESULTS_STREAM, keys.COORDINATOR_GROUP)["pending"] == 0
    assert r.xlen(keys.DEADLETTER_STREAM) == 1
    live.sweep()
    assert consumers(r) == {"live-1"}  # the one whose coordinator beats stays


def members(r: redis.Redis, stream: str) -> set[str]:
    """Members of the coordinators' group on ``stream`` (none while it has no group)."""
    try:
        rows = r.xinfo_consumers(stream, keys.COORDINATOR_GROUP)
    except redis.ResponseError:
        return set()
    return {row["name"].decode() for row in rows}


def test_a_coordinator_rejoins_every_stream_after_redis_lost_its_group(r, redis_url):
    """Redis restarted without persistence: `perseus status` counted no consumer on the
    registrations and control streams, while the coordinator served them, until an entry came.
    """
    with running(Coordinator(r, make_settings(redis_url), consumer="c-1")):
        wait_for(lambda: all(members(r, s) == {"c-1"} for s in keys.INPUT_STREAMS), 10, "join")
        r.delete(*keys.INPUT_STREAMS)  # what a restart without persistence leaves
        # An entry on one stream only: its read finds the group gone, and it is re-created.
        r.xadd(keys.RESULTS_STREAM, encode_message(ReportResult(job_id="x", result=result(0, 1))))
        wait_for(lambda: r.xlen(keys.DEADLETTER_STREAM) == 1, 10, "the entry's dead letter")
        for stream in keys.INPUT_STREAMS:
            assert members(r, stream) == {"c-1"}, stream


def test_a_coordinator_stopped_while_redis_hangs_stops_within_seconds():
    # A stalled network (here: redis-server stopped with SIGSTOP) answers nothing and closes
    # nothing. The stop's tidy-up (leave the group on three streams, forget the record) waited
    # a whole socket timeout per command (90 s more with the default 30 s), and the read in
    # flight at the stop its own: 30 s. That read is cut once its block time is long past.
    with consuming_when_redis_hangs() as (coord, thread, _):
        stopped = time.monotonic()
        coord.stop_event.set()
        thread.join(20)
        took = time.monotonic() - stopped
    assert not thread.is_alive()
    # The read's block (0.1 s) and STOP_GRACE_S, then the tidy-up's STOP_WAIT_S; not 30 s.
    assert took < 0.1 + STOP_GRACE_S + STOP_WAIT_S + 3.0, took


def test_a_stop_that_skips_the_tidy_up_says_so_once_and_leaves_nothing_running(caplog):
    # run() returned while its tidy-up still waited on the hanging Redis: the demo then
    # closed the client, and the tidy-up logged "could not leave the group: Bad file
    # descriptor" after run() had said it stopped without leaving.
    before = set(threading.enumerate())
    with consuming_when_redis_hangs() as (coord, thread, conn), caplog.at_level(logging.INFO):
        coord.stop_event.set()
        thread.join(20)
        assert not thread.is_alive()
        conn.close()  # as the demo does once its coordinator's thread returned
        wait_for(lambda: set(threading.enumerate()) <= before, 10, "no thread of it")
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 2, warned
    assert "cutting its connections" in warned[0]
    assert "stopping without leaving the consumer group" in warned[1]


def test_an_error_in_the_stops_tidy_up_is_raised_by_run_not_printed_by_a_thread(
    r, redis_url, monkeypatch, capsys
):
    # The tidy-up runs in a thread of its own (a hanging Redis may not hold a stop): what it
    # raises still ends run() as before, not as a traceback from threading's hook.
    coord = Coordinator(r, make_settings(redis_url))

    def refused(self: Coordinator, abandoned: threading.Event) -> None:
        raise redis.exceptions.NoPermissionError("this user has no permissions")

    monkeypatch.setattr(Coordinator, "_drain", refused)
    coord.stop_event.set()
    with pytest.raises(redis.exceptions.NoPermissionError):
        coord.run(block_ms=10)
    assert "Traceback" not in capsys.readouterr().err
