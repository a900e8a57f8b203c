"""Input streams: trimmed by acknowledgement only, every lost entry counted, on Redis 6.2 and 7."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import redis

from coordinator.resilience import ensure_groups
from coordinator.service import Coordinator
from coordinator.status import format_snapshot, snapshot
from coordinator.sweep import trim_inputs
from protocol import keys, streams
from protocol.models import JobInfo, RegisterJob, Reply, ReportResult, encode_message, unpack
from tests.helpers import make_settings, result, running, wait_for
from worker_client.hook.session import CoordinatorClient

GROUP = keys.COORDINATOR_GROUP


@pytest.fixture
def conn(any_redis: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(any_redis)
    ensure_groups(client)
    yield client
    client.close()


def add_results(conn: redis.Redis, count: int) -> list[str]:
    """``count`` valid results of jobs that do not exist (each one dead-lettered if read)."""
    ids = []
    for i in range(count):
        message = ReportResult(job_id=f"no-such-job-{i}", result=result(0, 1))
        ids.append(conn.xadd(keys.RESULTS_STREAM, encode_message(message)).decode())
    return ids


def test_pending_entries_trimmed_away_are_counted_logged_and_shown(conn, any_redis, caplog):
    ids = add_results(conn, 5)
    # A coordinator read them and died; then the stream was trimmed under its feet.
    conn.xreadgroup(GROUP, "dead-coordinator", {keys.RESULTS_STREAM: ">"}, count=5)
    conn.xtrim(keys.RESULTS_STREAM, maxlen=0, approximate=False)
    coord = Coordinator(conn, make_settings(any_redis), consumer="alive", claim_idle_ms=0)
    with caplog.at_level(logging.WARNING, logger="coordinator.outcome"):
        coord.step(block_ms=None)  # used to raise DataError on 6.2 (xack of None)
    assert coord.lost == 5
    assert streams.lost_counts(conn)[keys.RESULTS_STREAM] == 5
    assert conn.xpending(keys.RESULTS_STREAM, GROUP)["pending"] == 0
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert all(f"LOST entry {keys.RESULTS_STREAM} {i}" in logged for i in ids)
    text = format_snapshot(snapshot(conn))
    assert "LOST=5" in text
    assert snapshot(conn)["streams"][1]["lost"] == 5


def test_a_restarted_coordinators_own_trimmed_entries_are_counted(conn, any_redis):
    add_results(conn, 3)
    conn.xreadgroup(GROUP, "same-name", {keys.RESULTS_STREAM: ">"}, count=3)
    conn.xtrim(keys.RESULTS_STREAM, maxlen=0, approximate=False)
    # Restarted under the same consumer name: it reads its own pending entries first.
    coord = Coordinator(conn, make_settings(any_redis), consumer="same-name", claim_idle_ms=60_000)
    with running(coord):
        wait_for(lambda: coord.lost == 3, what="3 lost entries counted")
    assert streams.lost_counts(conn)[keys.RESULTS_STREAM] == 3
    assert conn.xpending(keys.RESULTS_STREAM, GROUP)["pending"] == 0


def test_trim_keeps_whatever_is_pending_or_undelivered(conn):
    ids = add_results(conn, 10)
    got = conn.xreadgroup(GROUP, "c", {keys.RESULTS_STREAM: ">"}, count=5)[0][1]
    assert [e.decode() for e, _ in got] == ids[:5]
    conn.xack(keys.RESULTS_STREAM, GROUP, ids[0], ids[2])  # ids[1] still pending
    done = streams.trim_acknowledged(conn, keys.RESULTS_STREAM, GROUP, hard_cap=1000)
    assert done.trimmed == 1 and not done.cut and done.gap == 0
    assert [e.decode() for e, _ in conn.xrange(keys.RESULTS_STREAM)] == ids[1:]
    conn.xack(keys.RESULTS_STREAM, GROUP, *ids[1:5])
    done = streams.trim_acknowledged(conn, keys.RESULTS_STREAM, GROUP, hard_cap=1000)
    assert done.trimmed == 4
    assert [e.decode() for e, _ in conn.xrange(keys.RESULTS_STREAM)] == ids[5:]  # undelivered
    assert streams.lost_counts(conn)[keys.RESULTS_STREAM] == 0


def test_a_flood_while_the_coordinator_is_stopped_loses_nothing(conn, any_redis):
    # Clients used to add with MAXLEN ~ 100000, silently trimming what nobody had read.
    client = CoordinatorClient(any_redis, reply_timeout=5)
    flood = 1500
    for i in range(flood):
        client.report(f"no-such-job-{i}", result(0, 1))
    client.close()
    assert conn.xlen(keys.RESULTS_STREAM) == flood
    settings = make_settings(any_redis, reconcile_interval=0.2, stream_hard_cap=flood)
    coord = Coordinator(conn, settings, claim_idle_ms=60_000)
    with running(coord):
        # Every result is accounted for: each one's job is unknown, so each is dead-lettered.
        wait_for(lambda: coord.dead_lettered == flood, timeout=60, what="every result read")
        # Acknowledged entries go at the next sweep.
        wait_for(lambda: conn.xlen(keys.RESULTS_STREAM) == 0, what="the stream trimmed")
    assert conn.xlen(keys.DEADLETTER_STREAM) == flood
    assert streams.lost_counts(conn)[keys.RESULTS_STREAM] == 0


def test_the_hard_cap_counts_and_logs_every_unread_entry_it_cuts(conn, any_redis, caplog):
    ids = add_results(conn, 120)
    with caplog.at_level(logging.WARNING, logger="coordinator.sweep"):
        assert trim_inputs(conn, hard_cap=50) == 70
    assert conn.xlen(keys.RESULTS_STREAM) == 50
    assert [e.decode() for e, _ in conn.xrange(keys.RESULTS_STREAM)] == ids[70:]
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert all(f"LOST entry {keys.RESULTS_STREAM} {i}" in logged for i in ids[:70])
    assert streams.lost_counts(conn)[keys.RESULTS_STREAM] == 70
    assert trim_inputs(conn, hard_cap=50) == 0  # counted once
    coord = Coordinator(conn, make_settings(any_redis), claim_idle_ms=60_000)
    coord.step(block_ms=None)
    assert coord.dead_lettered == 50  # the rest is processed
    assert "LOST=70" in format_snapshot(snapshot(conn))


def test_a_gap_made_by_someone_else_is_counted_on_redis_7(conn, any_redis):
    if "6.2" in str(conn.info("server")["redis_version"]):
        pytest.skip("Redis 6.2 reports no consumer-group lag: such a gap goes unseen there")
    add_results(conn, 10)
    conn.xtrim(keys.RESULTS_STREAM, maxlen=4, approximate=False)  # an operator, an old client
    assert trim_inputs(conn, hard_cap=1000) == 6
    assert trim_inputs(conn, hard_cap=1000) == 0  # counted once
    coord = Coordinator(conn, make_settings(any_redis), claim_idle_ms=60_000)
    coord.step(block_ms=None)
    assert coord.dead_lettered == 4
    assert trim_inputs(conn, hard_cap=1000) == 0
    # Again, once the group has read entries (Redis counts what it read from then on).
    add_results(conn, 10)
    conn.xtrim(keys.RESULTS_STREAM, maxlen=3, approximate=False)
    assert trim_inputs(conn, hard_cap=1000) == 7
    coord.step(block_ms=None)
    assert coord.dead_lettered == 7
    assert trim_inputs(conn, hard_cap=1000) == 0
    assert streams.lost_counts(conn)[keys.RESULTS_STREAM] == 13


def test_a_repeated_register_job_gets_the_same_job(conn, any_redis):
    request = RegisterJob(
        request_id="retry-1", job=JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2)
    )
    coord = Coordinator(conn, make_settings(any_redis), claim_idle_ms=60_000)
    replies = []
    for _ in range(2):  # The client's retry comes after it took (and lost) the first reply.
        conn.xadd(keys.REGISTRATIONS_STREAM, encode_message(request))
        coord.step(block_ms=None)
        answer = conn.blpop([keys.reply_key("retry-1")], timeout=1)
        assert answer is not None
        replies.append(unpack(Reply, answer[1]))
    # Twice in one batch as well (one reply: the client waits for one).
    conn.xadd(keys.REGISTRATIONS_STREAM, encode_message(request))
    conn.xadd(keys.REGISTRATIONS_STREAM, encode_message(request))
    coord.step(block_ms=None)
    answer = conn.blpop([keys.reply_key("retry-1")], timeout=1)
    assert answer is not None
    replies.append(unpack(Reply, answer[1]))
    assert all(r.ok for r in replies)
    assert len({r.job_id for r in replies}) == 1
    assert conn.zcard(keys.JOBS_INDEX) == 1
    assert 0 < conn.ttl(keys.request_job("retry-1")) <= 24 * 3600


def test_a_stream_trimmed_empty_after_everything_was_read_is_caught_up(conn):
    ids = add_results(conn, 3)

    def results_stream() -> dict:
        (info,) = [s for s in snapshot(conn)["streams"] if s["stream"] == keys.RESULTS_STREAM]
        return info

    assert results_stream()["caught_up"] is False  # three entries nobody read
    conn.xreadgroup(GROUP, "c", {keys.RESULTS_STREAM: ">"}, count=10)
    conn.xack(keys.RESULTS_STREAM, GROUP, *ids)
    streams.trim_acknowledged(conn, keys.RESULTS_STREAM, GROUP, hard_cap=1000)
    info = results_stream()
    assert (info["length"], info["pending"], info["lag"], info["caught_up"]) == (0, 0, 0, True)
