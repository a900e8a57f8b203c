"""`perseus deadletter list/replay` against a real Redis and a running coordinator."""

from __future__ import annotations

import json
import logging
import time

import msgpack
import pytest
from click.testing import CliRunner

from coordinator.cli import main
from coordinator.service import Coordinator
from coordinator.sweep import trim_inputs
from protocol import deadletter, keys
from protocol.deadletter import list_dead_letters
from protocol.models import ReportResult, unpack
from protocol.store import JobStore
from protocol.streams import lost_counts
from tests.helpers import drain, drain_until, make_settings, register, result, wait_for
from worker_client.hook.session import CoordinatorClient


def cli(*args: str) -> tuple[int, str]:
    outcome = CliRunner().invoke(main, list(args))
    return outcome.exit_code, outcome.output


@pytest.mark.usefixtures("service")
def test_a_result_that_became_valid_is_replayed_and_counted(r, redis_url):
    client = CoordinatorClient(redis_url, reply_timeout=5)
    job_id = register(client)
    drain(r)
    # A result for version 2 before version 2 exists is refused...
    client.report(job_id, result(0, 2))
    wait_for(lambda: r.xlen(keys.DEADLETTER_STREAM) == 1)
    code, out = cli("deadletter", "list", "--redis-url", redis_url)
    assert code == 0, out
    [letter] = list_dead_letters(r)
    assert letter.entry_id in out and "report_result" in out and job_id in out
    assert f"{keys.RESULTS_STREAM} {letter.source_id}" in out  # where it came from
    assert "version 2" in out  # the reason, on its own line
    code, out = cli("deadletter", "list", "--json", "--redis-url", redis_url)
    [row] = json.loads(out)
    assert row["kind"] == "report_result" and row["replayable"] and row["job_id"] == job_id

    # ...replaying it too early dead-letters it again, with nothing lost...
    code, out = cli("deadletter", "replay", letter.entry_id, "--redis-url", redis_url)
    assert code == 0 and f"{letter.entry_id} -> {keys.RESULTS_STREAM}" in out, out
    wait_for(lambda: list_dead_letters(r) and list_dead_letters(r)[0].entry_id != letter.entry_id)
    [again] = list_dead_letters(r)
    assert again.original == letter.original

    # ...and once version 2 is published, the replay counts.
    for rank in range(2):
        client.report(job_id, result(rank, 1))
    store = JobStore(r)
    wait_for(lambda: store.result_count(job_id, 1) == 2)
    drain_until(r, job_id, 2)
    assert store.version(job_id) == 2
    code, out = cli("deadletter", "replay", "--all", "--redis-url", redis_url)
    assert code == 0 and again.entry_id in out, out
    wait_for(lambda: store.result_count(job_id, 2) == 1)
    assert r.xlen(keys.DEADLETTER_STREAM) == 0
    # The replayed entry is the original, byte for byte.
    [(_id, fields)] = r.xrange(keys.RESULTS_STREAM)[-1:]
    assert unpack(ReportResult, fields[b"data"]).result == result(0, 2)


@pytest.mark.usefixtures("service")
def test_registrations_and_unknown_ids_are_refused_clearly(r, redis_url):
    r.xadd(keys.REGISTRATIONS_STREAM, {"kind": "register_job", "data": b"\x00garbage"})
    wait_for(lambda: r.xlen(keys.DEADLETTER_STREAM) == 1)
    [letter] = list_dead_letters(r)
    assert not letter.replayable
    code, out = cli("deadletter", "replay", letter.entry_id, "--redis-url", redis_url)
    assert code == 1 and "only entries of perseus:stream:results" in out, out
    code, out = cli("deadletter", "replay", "--all", "--redis-url", redis_url)
    assert code == 0 and "no replayable dead letters" in out
    # What --all left alone is said, with why.
    assert "left alone: 1 dead letter(s) from perseus:stream:registrations" in out, out
    assert r.xlen(keys.DEADLETTER_STREAM) == 1  # still there
    code, out = cli("deadletter", "replay", "1-0", "--redis-url", redis_url)
    assert code == 1 and "no dead letter 1-0" in out, out
    code, out = cli("deadletter", "replay", "nonsense", "--redis-url", redis_url)
    assert code == 1 and "not a stream entry id" in out, out
    code, out = cli("deadletter", "replay", "--redis-url", redis_url)
    assert code == 2 and "give dead-letter ids, or --all" in out
    # Both at once was told to give one of them, as if it had given neither.
    code, out = cli("deadletter", "replay", "1-0", "--all", "--redis-url", redis_url)
    assert code == 2 and "give dead-letter ids or --all, not both" in out


def test_purge_by_id_by_age_and_all(r, redis_url):
    now_ms = int(time.time() * 1000)
    old = [
        r.xadd(keys.DEADLETTER_STREAM, {"reason": "x"}, id=f"{now_ms - 3_600_000 + i}-0")
        for i in range(3)
    ]
    new = [r.xadd(keys.DEADLETTER_STREAM, {"reason": "y"}) for _ in range(2)]
    code, out = cli("deadletter", "purge", "--redis-url", redis_url)
    assert code == 2 and "give dead-letter ids, --older-than SECONDS, or --all" in out
    code, out = cli("deadletter", "purge", "--all", "--older-than", "5", "--redis-url", redis_url)
    assert code == 2 and "give one of dead-letter ids, --older-than SECONDS and --all" in out
    assert r.xlen(keys.DEADLETTER_STREAM) == 5  # nothing deleted
    # A wrong id is an error, as replay's is, and nothing is deleted.
    code, out = cli("deadletter", "purge", old[0].decode(), "999-0", "--redis-url", redis_url)
    assert code == 1 and "no dead letter 999-0" in out
    code, out = cli("deadletter", "purge", "abc", "--redis-url", redis_url)
    assert code == 1 and "'abc' is not a stream entry id" in out
    assert r.xlen(keys.DEADLETTER_STREAM) == 5
    code, out = cli("deadletter", "purge", old[0].decode(), "--redis-url", redis_url)
    assert code == 0 and "deleted 1 dead letter(s)" in out
    code, out = cli("deadletter", "purge", "--older-than", "600", "--redis-url", redis_url)
    assert code == 0 and "deleted 2 dead letter(s)" in out
    assert [e[0] for e in r.xrange(keys.DEADLETTER_STREAM)] == new
    code, out = cli("deadletter", "purge", "--all", "--redis-url", redis_url)
    assert code == 0 and "deleted 2 dead letter(s)" in out
    assert not r.exists(keys.DEADLETTER_STREAM)


def test_only_a_registration_gets_its_rejection_as_a_reply(r, redis_url):
    """A bad result or control entry carrying someone's request id pushes nothing to them."""
    coord = Coordinator(r, make_settings(redis_url))
    data = msgpack.packb({"kind": "report_result", "request_id": "victim", "job_id": "x"})
    for stream in (keys.RESULTS_STREAM, keys.CONTROL_STREAM):
        coord.handle(stream, "1-1", {b"kind": b"report_result", b"data": data})
    assert r.xlen(keys.DEADLETTER_STREAM) == 2
    assert not r.exists(keys.reply_key("victim"))
    coord.handle(keys.REGISTRATIONS_STREAM, "1-1", {b"kind": b"register_rank", b"data": data})
    assert r.llen(keys.reply_key("victim")) == 1  # the rejected registration's client hears why


def test_dead_letters_stay_until_handled_and_the_hard_cap_counts_what_it_cuts(r, redis_url, caplog):
    """No MAXLEN on dead letters (nobody may have read them); past the cap, each cut counts."""
    coord = Coordinator(r, make_settings(redis_url, stream_maxlen=100, stream_hard_cap=220))
    for i in range(250):
        coord.handle(keys.RESULTS_STREAM, f"1-{i + 1}", {b"kind": b"x", b"data": b"\xc1"})
    assert r.xlen(keys.DEADLETTER_STREAM) == 250
    newest_cut = r.xrange(keys.DEADLETTER_STREAM, count=30)[-1][0].decode()
    with caplog.at_level(logging.WARNING, logger="coordinator.sweep"):
        assert trim_inputs(r, 220) == 30
    assert r.xlen(keys.DEADLETTER_STREAM) == 220
    assert lost_counts(r)[keys.DEADLETTER_STREAM] == 30
    assert f"LOST 30 dead letters, the oldest (up to {newest_cut})" in caplog.text
    assert trim_inputs(r, 220) == 0  # nothing more to cut


def test_replay_all_reads_every_page_up_to_the_newest_at_its_start(r, redis_url):
    """No coordinator runs: replayed entries wait in the results stream, in order."""
    fields = {b"kind": b"report_result", b"data": b"x", b"job_id": b"j"}
    with r.pipeline(transaction=False) as pipe:
        for i in range(25):
            pipe.xadd(
                keys.DEADLETTER_STREAM,
                deadletter.entry_fields(keys.RESULTS_STREAM, f"{i + 1}-0", fields, "late", 0.0),
            )
        pipe.execute()
    pages = deadletter.iter_dead_letters(r, page=7)
    first = next(pages)
    r.xadd(keys.DEADLETTER_STREAM, {"reason": "added meanwhile"})  # after the start: not read
    assert [first.source_id, *(d.source_id for d in pages)] == [f"{i}-0" for i in range(1, 26)]
    r.xdel(keys.DEADLETTER_STREAM, r.xrevrange(keys.DEADLETTER_STREAM, count=1)[0][0])
    code, out = cli("deadletter", "replay", "--all", "--redis-url", redis_url)
    assert code == 0 and out.count(f"-> {keys.RESULTS_STREAM}") == 25, out
    assert r.xlen(keys.RESULTS_STREAM) == 25 and r.xlen(keys.DEADLETTER_STREAM) == 0


def test_an_oversize_dead_letter_says_why_it_cannot_be_replayed(r, redis_url):
    big = {b"kind": b"report_result", b"data": b"\x00" * 5000}
    letter = deadletter.entry_fields(keys.RESULTS_STREAM, "1-0", big, "too big", 0.0, True)
    entry_id = r.xadd(keys.DEADLETTER_STREAM, letter).decode()
    code, out = cli("deadletter", "replay", entry_id, "--redis-url", redis_url)
    assert code == 1, out
    assert f"dead letter {entry_id} was an entry of 5021 bytes, over max_entry_bytes" in out
    assert "only entries of" not in out  # it did come from a replayable stream


def test_purge_older_than_refuses_nan_and_infinity_and_keeps_what_is_younger(r, redis_url):
    # NaN and infinity passed click's range check and ended in a traceback (int() of them);
    # 1e300 s made a negative MINID, which Redis refused, in a traceback too.
    r.xadd(keys.DEADLETTER_STREAM, {"reason": "x"})
    for value in ("nan", "inf", "-inf"):
        code, out = cli("deadletter", "purge", "--older-than", value, "--redis-url", redis_url)
        assert code == 2, out
        assert "Traceback" not in out and "--older-than" in out and "finite" in out, out
    code, out = cli("deadletter", "purge", "--older-than", "1e300", "--redis-url", redis_url)
    assert code == 0 and "deleted 0 dead letter(s)" in out, out
    assert r.xlen(keys.DEADLETTER_STREAM) == 1


@pytest.mark.parametrize("dead_at", ["1e999", "nan", "-inf", "1e300", "-1e12"])
def test_a_dead_letter_whose_time_cannot_be_shown_is_listed_at_an_unknown_time(
    r, redis_url, dead_at
):
    """A dead letter added by hand with such a ``dead_at`` ended `perseus deadletter list`
    with datetime's OverflowError (or ValueError) traceback, so no dead letter could be read;
    ``--json`` printed ``Infinity`` or ``NaN``, which is no JSON."""
    fields = {"reason": "by hand", "source_stream": keys.RESULTS_STREAM, "source_id": "1-1"}
    entry_id = r.xadd(keys.DEADLETTER_STREAM, {**fields, "dead_at": dead_at}).decode()
    code, out = cli("deadletter", "list", "--redis-url", redis_url)
    assert code == 0, out
    assert f"{entry_id}  ?  {keys.RESULTS_STREAM} 1-1" in out and "by hand" in out
    code, out = cli("deadletter", "list", "--json", "--redis-url", redis_url)
    assert code == 0, out
    [row] = json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} in {out}"))
    assert row["dead_at"] == 0.0


def test_replay_all_passes_over_a_dead_letter_without_original_fields(r, redis_url):
    """A dead letter of the results stream without ``orig:`` fields (added by hand) counted
    as replayable: `replay --all` stopped at it with an error and left the letters after it."""
    source = {"source_stream": keys.RESULTS_STREAM, "source_id": "1-1", "dead_at": "1"}
    empty = r.xadd(keys.DEADLETTER_STREAM, {"reason": "by hand", **source}).decode()
    whole = r.xadd(keys.DEADLETTER_STREAM, {"reason": "r", **source, "orig:data": b"x"}).decode()
    code, out = cli("deadletter", "list", "--redis-url", redis_url)
    assert f"{empty}  1970-01-01 00:00:01  {keys.RESULTS_STREAM} 1-1  ?  -  (not replayable)" in out
    code, out = cli("deadletter", "replay", "--all", "--redis-url", redis_url)
    assert code == 0 and f"{whole} -> {keys.RESULTS_STREAM}" in out, out
    assert [i.decode() for i, _ in r.xrange(keys.DEADLETTER_STREAM)] == [empty]
    code, out = cli("deadletter", "replay", empty, "--redis-url", redis_url)
    assert code == 1 and f"dead letter {empty} has no original fields to replay" in out, out


def test_show_prints_one_dead_letter_whole_with_its_data_decoded(r, redis_url):
    """`list` names a dead letter and its reason; what the client sent was readable only as
    raw msgpack (`redis-cli XRANGE`), and not at all for an entry of thousands of fields (one
    packed blob): `show` decodes it, as text or as JSON."""
    result = {"rank": 3, "iter_time": [0.5], "iter_energy": [float("nan")]}
    data = msgpack.packb({"kind": "report_result", "result": result})
    sent = {b"kind": b"report_result", b"data": data, b"job_id": b"j1", b"mac": b"\xff\x00"}
    many = {**sent, **{f"junk{i}".encode(): b"x" for i in range(5000)}}
    ids = []
    for fields in (sent, many):
        letter = deadletter.entry_fields(keys.RESULTS_STREAM, "1-1", fields, "bad rank", 1.0)
        ids.append(r.xadd(keys.DEADLETTER_STREAM, letter).decode())
    code, out = cli("deadletter", "show", ids[0], "--redis-url", redis_url)
    assert code == 0, out
    assert ids[0] in out and "bad rank" in out and f"{keys.RESULTS_STREAM} 1-1" in out
    assert '"iter_time": [0.5]' in out and "job_id: j1" in out and "mac: (hex) ff00" in out
    code, out = cli("deadletter", "show", ids[1], "--json", "--redis-url", redis_url)
    assert code == 0, out
    shown = json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} is no JSON"))
    assert shown["id"] == ids[1] and not shown["replayable"] and len(shown["fields"]) == 5004
    assert shown["fields"]["data"]["result"] == {**result, "iter_energy": ["nan"]}
    assert shown["fields"]["junk4999"] == "x" and shown["fields"]["mac"] == {"hex": "ff00"}
    broken = {b"kind": b"report_result", b"data": b"\xc1"}
    letter = deadletter.entry_fields(keys.RESULTS_STREAM, "1-2", broken, "not msgpack", 1.0)
    broken_id = r.xadd(keys.DEADLETTER_STREAM, letter).decode()
    code, out = cli("deadletter", "show", broken_id, "--redis-url", redis_url)
    assert code == 0 and "data: (hex, not valid msgpack" in out and ") c1" in out, out
    code, out = cli("deadletter", "show", "9-9", "--redis-url", redis_url)
    assert code == 1 and "no dead letter 9-9" in out, out
