"""Entries of thousands of fields: dead-lettered whole but packed, and refused clearly at replay.

Lua's ``unpack`` takes at most about 8,000 values, so the replay script could not send back an
entry of more than about 4,000 fields, and said so with a Lua error.
"""

from __future__ import annotations

import json

import msgpack
import pytest
from click.testing import CliRunner

from coordinator.cli import main
from protocol import keys
from protocol.constants import MAX_ENTRY_FIELDS
from protocol.deadletter import DeadLetter, get_dead_letter, list_dead_letters
from protocol.models import JobInfo, RegisterJob, Reply, ReportResult, encode_message, unpack
from protocol.store import JobStore
from tests.helpers import drain_until, register, result, wait_for
from worker_client.hook.session import CoordinatorClient

JUNK = 5_000  # fields beside a message's own: more than Lua's unpack takes in the replay


def cli(*args: str) -> tuple[int, str]:
    outcome = CliRunner().invoke(main, list(args))
    return outcome.exit_code, outcome.output


def _junk(count: int = JUNK) -> dict[bytes, bytes]:
    return {f"junk{i}".encode(): str(i).encode() for i in range(count)}


def _new_letter(r, seen: set[str]) -> DeadLetter:
    def new() -> list[DeadLetter]:
        return [d for d in list_dead_letters(r) if d.entry_id not in seen]

    [letter] = wait_for(new, 10, "the dead letter")
    return letter


def _refused_whole_and_not_replayed(r, redis_url, stream: str, sent: dict[bytes, bytes]) -> str:
    """Send ``sent`` to ``stream``; check its dead letter and that replaying it fails clearly."""
    seen = {d.entry_id for d in list_dead_letters(r)}
    source_id = r.xadd(stream, sent).decode()
    letter = _new_letter(r, seen)
    assert letter.source_stream == stream and letter.source_id == source_id
    assert f"entry has {len(sent)} fields; at most {MAX_ENTRY_FIELDS}" in letter.reason
    assert letter.original == sent  # nothing lost, byte for byte
    # Bounded: a few fields, the original ones packed into one.
    raw = r.xrange(keys.DEADLETTER_STREAM, letter.entry_id, letter.entry_id)[0][1]
    assert len(raw) < 10, sorted(raw)[:20]
    assert not letter.replayable

    code, out = cli("deadletter", "list", "--json", "--redis-url", redis_url)
    assert code == 0, out
    [row] = [row for row in json.loads(out) if row["id"] == letter.entry_id]
    assert row["kind"] == sent[b"kind"].decode() and not row["replayable"]
    code, out = cli("deadletter", "replay", letter.entry_id, "--redis-url", redis_url)
    assert code == 1, out
    assert f"{len(sent)} fields" in out and str(MAX_ENTRY_FIELDS) in out, out
    assert "unpack" not in out and "Lua" not in out and "script" not in out, out
    code, out = cli("deadletter", "replay", "--all", "--redis-url", redis_url)
    assert code == 0, out
    assert f"with more than {MAX_ENTRY_FIELDS} fields" in out, out
    get_dead_letter(r, letter.entry_id)  # still there
    return letter.entry_id


@pytest.mark.usefixtures("service")
def test_a_result_of_5000_fields_is_dead_lettered_and_the_next_one_counts(r, redis_url):
    client = CoordinatorClient(redis_url, reply_timeout=5)
    job_id = register(client)
    drain_until(r, job_id, 1)
    token = client.token(job_id, 0)
    good = encode_message(ReportResult(job_id=job_id, result=result(0, 1)), token=token)
    sent = {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in good.items()}
    _refused_whole_and_not_replayed(r, redis_url, keys.RESULTS_STREAM, sent | _junk())
    store = JobStore(r)
    assert store.result_count(job_id, 1) == 0  # not stored, junk and all
    client.report(job_id, result(0, 1))
    wait_for(lambda: store.result_count(job_id, 1) == 1, 10, "the next result")


@pytest.mark.usefixtures("service")
def test_a_registration_of_5000_fields_gets_the_reason_and_the_next_one_its_job(r, redis_url):
    job = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    fields = encode_message(RegisterJob(request_id="wide", job=job))
    sent = {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in fields.items()}
    _refused_whole_and_not_replayed(r, redis_url, keys.REGISTRATIONS_STREAM, sent | _junk())
    reply = unpack(Reply, r.lpop(keys.reply_key("wide")))
    assert not reply.ok and f"at most {MAX_ENTRY_FIELDS}" in reply.error
    assert JobStore(r).list_jobs() == []
    client = CoordinatorClient(redis_url, reply_timeout=5)
    assert client.register_job(job)


@pytest.mark.usefixtures("service")
def test_garbage_of_5000_fields_on_the_control_stream_is_kept_whole(r, redis_url):
    sent = {b"kind": b"set_target", b"data": b"\xc1"} | _junk()
    _refused_whole_and_not_replayed(r, redis_url, keys.CONTROL_STREAM, sent)


@pytest.mark.usefixtures("service")
def test_an_entry_of_the_most_fields_keeps_the_usual_format_and_replays(r, redis_url):
    """At the limit: every field as ``orig:<name>``, and the replay script takes them all."""
    sent = {b"kind": b"report_result", b"data": b"\xc1"} | _junk(MAX_ENTRY_FIELDS - 2)
    r.xadd(keys.RESULTS_STREAM, sent)
    letter = _new_letter(r, set())
    assert "not valid msgpack" in letter.reason and letter.replayable
    raw = r.xrange(keys.DEADLETTER_STREAM)[0][1]
    assert {k for k in raw if k.startswith(b"orig:")} == {b"orig:" + k for k in sent}
    code, out = cli("deadletter", "replay", letter.entry_id, "--redis-url", redis_url)
    assert code == 0 and f"{letter.entry_id} -> {keys.RESULTS_STREAM}" in out, out
    again = _new_letter(r, {letter.entry_id})  # refused again, with every field
    assert again.original == sent


def test_a_dead_letter_of_5000_original_fields_written_by_hand_is_refused_clearly(r, redis_url):
    """One in the ``orig:<name>`` format (an older coordinator wrote them so): no Lua error."""
    fields = {"reason": "r", "source_stream": keys.RESULTS_STREAM, "source_id": "1-1"}
    orig = {b"orig:" + k: v for k, v in ({b"kind": b"report_result"} | _junk()).items()}
    entry_id = r.xadd(keys.DEADLETTER_STREAM, {**fields, **orig}).decode()
    letter = get_dead_letter(r, entry_id)
    assert len(letter.original) == JUNK + 1 and not letter.replayable
    code, out = cli("deadletter", "replay", entry_id, "--redis-url", redis_url)
    assert code == 1 and f"{JUNK + 1} fields" in out and "unpack" not in out, out
    code, out = cli("deadletter", "list", "--redis-url", redis_url)
    assert code == 0 and "(not replayable)" in out, out
    assert r.xlen(keys.DEADLETTER_STREAM) == 1


def test_a_packed_dead_letter_that_does_not_unpack_shows_no_fields(r):
    """Written by hand: read as having no original fields (not replayable), not an error."""
    fields = {"reason": "r", "source_stream": keys.RESULTS_STREAM, "orig_packed": b"\xc1"}
    entry_id = r.xadd(keys.DEADLETTER_STREAM, fields).decode()
    letter = get_dead_letter(r, entry_id)
    assert letter.original == {} and not letter.replayable
    odd = msgpack.packb([b"only-a-name"])
    entry_id = r.xadd(keys.DEADLETTER_STREAM, {**fields, "orig_packed": odd}).decode()
    assert get_dead_letter(r, entry_id).original == {}
