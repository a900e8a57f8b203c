"""The coordinator against wrong entries, jobs, ranks and schedules: refused or dead-lettered."""

from __future__ import annotations

import msgpack
import pytest

from coordinator.service import Coordinator
from coordinator.tasks import advance_job
from protocol import keys
from protocol.exceptions import (
    PerseusError,
    ProtocolError,
    UnknownJobError,
)
from protocol.models import (
    FrequencySchedule,
    JobInfo,
    RankInfo,
    RegisterJob,
    ReportResult,
    encode_message,
    pack,
)
from protocol.store import JobStore
from tests.helpers import (
    FREQS,
    drain,
    make_settings,
    register,
    result,
    running,
    wait_for,
)
from worker_client.hook.session import CoordinatorClient


def test_redelivered_entries_change_nothing_twice(r, redis_url):
    coord = Coordinator(r, make_settings(redis_url))
    job = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    fields = {
        k.encode(): (v.encode() if isinstance(v, str) else v)
        for k, v in encode_message(RegisterJob(request_id="req1", job=job)).items()
    }
    coord.handle(keys.REGISTRATIONS_STREAM, "1700000000000-0", fields)
    coord.handle(keys.REGISTRATIONS_STREAM, "1700000000000-0", fields)
    store = JobStore(r)
    assert len(store.list_jobs()) == 1
    job_id = store.list_jobs()[0][0]
    assert r.llen(keys.reply_key("req1")) == 2  # answered twice, identically
    replies = r.lrange(keys.reply_key("req1"), 0, -1)
    assert replies[0] == replies[1]

    store.add_rank(
        store.get_job(job_id).info,
        RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=FREQS),
        token="t0",
    )
    advance_job(job_id, conn=r)
    message = ReportResult(job_id=job_id, result=result(0, 1))
    report = {
        k.encode(): (v.encode() if isinstance(v, str) else v)
        for k, v in encode_message(message, token="t0").items()
    }
    coord.handle(keys.RESULTS_STREAM, "1700000000001-0", report)
    coord.handle(keys.RESULTS_STREAM, "1700000000001-0", report)
    assert store.result_count(job_id, 1) == 1
    # Two enqueued tasks, but the version moves exactly once.
    drain(r)
    assert store.version(job_id) == 2
    assert [e.version for e in store.journal(job_id)] == [1, 2]


def test_malformed_entries_go_to_dead_letter_and_loop_continues(r, redis_url):
    coord = Coordinator(r, make_settings(redis_url))
    bad = [
        {"data": b"\xc1\xff\x00garbage"},
        {"foo": "bar"},
        {
            "data": msgpack.packb(
                {"kind": "register_job", "request_id": "x", "job": {"pp_degree": 0}}
            )
        },
        {"data": msgpack.packb({"kind": "launch_rockets"})},
    ]
    for fields in bad:
        r.xadd(keys.REGISTRATIONS_STREAM, fields)
    good = encode_message(
        RegisterJob(
            request_id="ok", job=JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
        )
    )
    r.xadd(keys.REGISTRATIONS_STREAM, good)
    from coordinator.resilience import ensure_groups

    ensure_groups(r)
    coord.step(block_ms=None)
    dead = r.xrange(keys.DEADLETTER_STREAM)
    assert len(dead) == 4
    reasons = [fields[b"reason"].decode() for _, fields in dead]
    assert "not valid msgpack" in reasons[0]
    assert "no 'data' field" in reasons[1] and "foo" in reasons[1]
    assert "job.pp_degree" in reasons[2]
    assert "kind" in reasons[3]
    # Nothing lost: every original field is kept byte for byte.
    assert dead[0][1][b"orig:data"] == b"\xc1\xff\x00garbage"
    assert dead[1][1][b"orig:foo"] == b"bar"
    # The valid entry after them was still processed, and everything was acknowledged.
    assert len(JobStore(r).list_jobs()) == 1
    pending = r.xpending(keys.REGISTRATIONS_STREAM, keys.COORDINATOR_GROUP)
    assert pending["pending"] == 0


def test_unknown_job_id_is_a_clear_error(service, r, redis_url):
    client = CoordinatorClient(redis_url, reply_timeout=5)
    with pytest.raises(UnknownJobError, match="no-such-job"):
        client.register_rank(
            "no-such-job",
            RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=FREQS),
        )
    dead = r.xrange(keys.DEADLETTER_STREAM)
    assert b"unknown job id" in dead[-1][1][b"reason"]


def test_invalid_job_info_is_rejected_on_both_sides(service, r, redis_url):
    with pytest.raises(ValueError, match="world_size=7"):
        JobInfo(pp_degree=4, dp_degree=2, tp_degree=1, world_size=7)
    # A client that skips validation still gets a clear answer from the coordinator.
    raw = {
        "kind": "register_job",
        "request_id": "bad1",
        "job": {"pp_degree": 4, "dp_degree": 2, "tp_degree": 1, "world_size": 7},
    }
    r.xadd(keys.REGISTRATIONS_STREAM, {"kind": "register_job", "data": msgpack.packb(raw)})
    answer = r.blpop([keys.reply_key("bad1")], timeout=5)
    assert answer is not None
    assert b"world_size=7" in answer[1]


def test_rank_out_of_range_and_result_for_unpublished_version(service, r, redis_url):
    client = CoordinatorClient(redis_url, reply_timeout=5)
    job_id = client.register_job(JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2))
    with pytest.raises(ProtocolError, match="pp_rank=5"):
        client.register_rank(
            job_id, RankInfo(rank=1, dp_rank=0, pp_rank=5, tp_rank=0, available_frequencies=FREQS)
        )
    client.register_rank(
        job_id, RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=FREQS)
    )
    client.report(job_id, result(0, 3))
    reason = wait_for(
        lambda: [
            f[b"reason"]
            for _, f in r.xrange(keys.DEADLETTER_STREAM)
            if b"version 3" in f[b"reason"]
        ]
    )
    assert b"latest published version is 0" in reason[0]


def test_schedule_for_another_rank_is_refused(service, r, redis_url):
    client = CoordinatorClient(redis_url, reply_timeout=5)
    job_id = register(client)
    drain(r)
    # Tamper with the stored schedule: rank 1's slot now holds rank 0's schedule.
    bad = FrequencySchedule(rank=0, version=1, frequencies=[("forward", 1980)])
    r.hset(keys.job_schedule(job_id, 1), "1", pack(bad))
    with pytest.raises(ProtocolError, match="schedule for rank 0 to rank 1"):
        client.fetch_schedule(job_id, 1, 1)


def test_invalid_scheduler_output_reaches_clients(r, redis_url):
    for name, message in (("WrongRank", "ranks \\[0\\]"), ("Broken", "broken on purpose")):
        r.flushdb()
        coord = Coordinator(r, make_settings(redis_url, scheduler=f"tests.toy_schedulers:{name}"))
        with running(coord):
            client = CoordinatorClient(redis_url, reply_timeout=5)
            job_id = register(client)
            with pytest.raises((PerseusError, RuntimeError)):
                advance_job(job_id, conn=r)
            with pytest.raises(PerseusError, match=message):
                client.wait_schedule(job_id, rank=0, timeout=2)
            # A deterministic failure is not re-enqueued forever.
            assert (
                not JobStore(r).due(JobStore(r).get_job(job_id))
                or JobStore(r).get_job(job_id).error
            )


def test_unexpected_error_dead_letters_instead_of_crashing(r, redis_url, monkeypatch):
    from coordinator.resilience import ensure_groups

    coord = Coordinator(r, make_settings(redis_url))
    ensure_groups(r)

    def boom(*args):
        raise KeyError("bug")

    monkeypatch.setattr(coord, "_dispatch", boom)
    r.xadd(
        keys.REGISTRATIONS_STREAM,
        encode_message(
            RegisterJob(
                request_id="b1", job=JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
            )
        ),
    )
    coord.step(block_ms=None)
    dead = r.xrange(keys.DEADLETTER_STREAM)
    assert len(dead) == 1 and b"internal error KeyError" in dead[0][1][b"reason"]
    assert r.xpending(keys.REGISTRATIONS_STREAM, keys.COORDINATOR_GROUP)["pending"] == 0
    answer = r.blpop([keys.reply_key("b1")], timeout=1)
    assert answer is not None and b"internal error" in answer[1]
