"""The coordinator's next read rides with a registration's write, and no entry it brings is lost."""

from __future__ import annotations

from coordinator.service import Coordinator
from protocol import keys
from protocol.models import Reply, encode_message, unpack
from tests.helpers import job_through, make_settings, rank_request


def _answered(r, request_id: str) -> Reply:
    reply = r.lpop(keys.reply_key(request_id))
    assert reply is not None, "no reply"
    return unpack(Reply, reply)


def test_a_registration_costs_one_write_once_the_loop_reads_ahead(r, redis_url, count_round_trips):
    coord = Coordinator(r, make_settings(redis_url))
    job_id = job_through(coord, r, world=4)
    per_step = []
    for rank in range(3):
        message = rank_request(job_id, rank)
        r.xadd(keys.REGISTRATIONS_STREAM, encode_message(message))
        before = count_round_trips[0]
        assert coord.step(block_ms=1000) == 1
        per_step.append(count_round_trips[0] - before)
        assert _answered(r, message.request_id).ok
        assert coord.reader.read_pending
    # The first step also claims, beats and sweeps, reads, then writes with the next read.
    # The later ones only write: their read went with the previous write and found the
    # request waiting (without the read ahead: a read and a write each).
    assert per_step[1:] == [1, 1]
    assert r.xpending(keys.REGISTRATIONS_STREAM, keys.COORDINATOR_GROUP)["pending"] == 0


def test_an_entry_the_read_ahead_brings_at_stop_is_handled(r, redis_url):
    coord = Coordinator(r, make_settings(redis_url))
    job_id = job_through(coord, r, world=2)
    first, second = rank_request(job_id, 0), rank_request(job_id, 1)
    r.xadd(keys.REGISTRATIONS_STREAM, encode_message(first))
    coord.step(block_ms=1000)
    assert coord.reader.read_pending
    r.xadd(keys.REGISTRATIONS_STREAM, encode_message(second))  # handed to the pending read
    coord.stop_event.set()
    coord.run()  # stops at once, and handles what the pending read holds
    assert _answered(r, first.request_id).ok and _answered(r, second.request_id).ok
    assert not coord.reader.read_pending
    assert r.xpending(keys.REGISTRATIONS_STREAM, keys.COORDINATOR_GROUP)["pending"] == 0


def test_entries_a_dropped_read_was_handed_are_claimed_by_a_coordinator(r, redis_url):
    coord = Coordinator(r, make_settings(redis_url), consumer="lost")
    job_id = job_through(coord, r, world=2)
    first, second = rank_request(job_id, 0), rank_request(job_id, 1)
    r.xadd(keys.REGISTRATIONS_STREAM, encode_message(first))
    coord.step(block_ms=1000)
    r.xadd(keys.REGISTRATIONS_STREAM, encode_message(second))
    coord.reader.reset()  # its connection is lost with the entry it had been handed
    pending = r.xpending(keys.REGISTRATIONS_STREAM, keys.COORDINATOR_GROUP)
    assert pending["pending"] == 1 and pending["consumers"][0]["name"] == b"lost"
    other = Coordinator(r, make_settings(redis_url), consumer="other", claim_idle_ms=0)
    other.step(block_ms=None)  # claims the stale entry and handles it
    assert _answered(r, second.request_id).ok
    assert r.xpending(keys.REGISTRATIONS_STREAM, keys.COORDINATOR_GROUP)["pending"] == 0


def test_a_write_that_finds_its_script_gone_is_sent_again_and_the_read_kept(r, redis_url):
    coord = Coordinator(r, make_settings(redis_url))
    job_id = job_through(coord, r, world=3)
    r.script_flush()  # as after a Redis restart: the store's scripts are unknown
    for rank in range(3):
        message = rank_request(job_id, rank)
        r.xadd(keys.REGISTRATIONS_STREAM, encode_message(message))
        assert coord.step(block_ms=1000) == 1
        assert _answered(r, message.request_id).ok
    assert r.hlen(keys.job_ranks(job_id)) == 3
