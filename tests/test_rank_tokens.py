"""Per-rank tokens: results and heartbeats count only from the process that registered the rank."""

from __future__ import annotations

import logging

import pytest

from coordinator.service import Coordinator
from protocol import keys
from protocol.deadletter import list_dead_letters
from protocol.exceptions import ProtocolError, WrongTokenError
from protocol.models import (
    JobInfo,
    RankInfo,
    RegisterJob,
    RegisterRank,
    Reply,
    ReportResult,
    encode_message,
)
from protocol.store import JobStore
from protocol.tokens import sign
from tests.helpers import (
    FREQS,
    drain,
    drain_until,
    make_settings,
    register,
    result,
    running,
    wait_for,
)
from worker_client.hook.session import CoordinatorClient
from worker_client.hook.watchers import ScheduleWatcher


def _reasons(r) -> list[str]:
    return [letter.reason for letter in list_dead_letters(r)]


def test_an_impostors_result_is_dead_lettered_and_the_genuine_one_counts(
    service, r, redis_url, caplog
):
    caplog.set_level(logging.DEBUG)
    genuine = CoordinatorClient(redis_url)
    job_id = register(genuine, pp=2)
    drain(r)
    token = genuine.token(job_id, 0)
    assert token
    # The impostor knows the job id, and has a token of its own (its own job's rank 0).
    impostor = CoordinatorClient(redis_url)
    other_job = register(impostor, pp=1)
    forged = result(0, 1).model_copy(update={"iter_time": [99.0]})
    impostor.report(job_id, forged)  # signed with the other job's token: the wrong one
    entry = encode_message(ReportResult(job_id=job_id, result=forged))  # no MAC at all
    r.xadd(keys.RESULTS_STREAM, entry)
    made_up = encode_message(ReportResult(job_id=job_id, result=forged), token="guess")
    r.xadd(keys.RESULTS_STREAM, made_up)
    wait_for(lambda: len(_reasons(r)) == 3, 10, "three dead letters")
    reasons = _reasons(r)
    assert all(f"wrong token for rank 0 of job {job_id}" in reason for reason in reasons), reasons
    assert "no mac field" in reasons[1]
    assert JobStore(r).result_count(job_id, 1) == 0  # the slot is still free
    # The genuine results afterwards take their slots, and the job moves on.
    for rank in (0, 1):
        genuine.report(job_id, result(rank, 1))
    wait_for(lambda: JobStore(r).result_count(job_id, 1) == 2, 10, "the genuine results")
    (stored,) = JobStore(r).results(job_id, 1)[:1]
    assert stored.iter_time == [1.0]
    drain_until(r, job_id, 2)
    assert JobStore(r).version(job_id) == 2
    # No token in the dead letters, the logs or anywhere in Redis (digests only).
    tokens = [token, impostor.token(other_job, 0)]
    dump = b"".join(
        repr(letter.original).encode() + letter.reason.encode() for letter in list_dead_letters(r)
    )
    for name in r.scan_iter(match="perseus:*", count=1000):
        kind = r.type(name)
        if kind == b"hash":
            dump += repr(r.hgetall(name)).encode()
        elif kind == b"stream":
            dump += repr(r.xrange(name)).encode()
        elif kind == b"string":
            dump += r.get(name) or b""
    for secret in tokens:
        assert secret and secret.encode() not in dump
        assert secret not in caplog.text


def test_a_heartbeat_with_a_wrong_token_is_not_liveness(service, r, redis_url):
    genuine = CoordinatorClient(redis_url)
    job_id = register(genuine, pp=2)
    store = JobStore(r)
    before = r.zscore(keys.JOBS_INDEX, job_id)
    with pytest.raises(WrongTokenError, match="wrong token for rank 1"):
        store.touch(job_id, 1, "not-the-token")
    with pytest.raises(WrongTokenError):
        CoordinatorClient(redis_url).heartbeat(job_id, 1)  # a client that did not register it
    assert store.ranks_heard(job_id) == {}  # not counted as alive
    assert r.zscore(keys.JOBS_INDEX, job_id) == before  # nor as job activity
    assert genuine.heartbeat(job_id, 1)
    assert set(store.ranks_heard(job_id)) == {1}


def test_a_rank_registers_once_and_a_redelivered_registration_gets_no_second_reply(r, redis_url):
    coord = Coordinator(r, make_settings(redis_url))
    store = JobStore(r)
    job = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    info = RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=FREQS)

    def handle(entry_id: str, request_id: str) -> None:
        fields = encode_message(RegisterRank(request_id=request_id, job_id=job_id, rank_info=info))
        raw = {k.encode(): v.encode() if isinstance(v, str) else v for k, v in fields.items()}
        coord.handle(keys.REGISTRATIONS_STREAM, entry_id, raw)

    fields = encode_message(RegisterJob(request_id="job", job=job))
    raw = {k.encode(): v.encode() if isinstance(v, str) else v for k, v in fields.items()}
    coord.handle(keys.REGISTRATIONS_STREAM, "1-0", raw)
    (job_id, _), *_ = store.list_jobs()
    handle("2-0", "first")
    handle("2-0", "first")  # delivered again: dead-lettered, no second reply
    handle("3-0", "second")  # the same rank again, from another request: refused
    assert r.llen(keys.reply_key("first")) == 1
    reasons = _reasons(r)
    assert "was already answered" in reasons[0]
    assert "rank 0 of job" in reasons[1] and "already registered" in reasons[1]
    assert b"already registered" in r.lindex(keys.reply_key("second"), 0)
    with pytest.raises(ProtocolError, match="already registered"):
        store.add_rank(store.get_job(job_id).info, info)


def test_a_sweep_over_max_sweep_versions_is_refused_at_registration(r, redis_url):
    coord = Coordinator(r, make_settings(redis_url, max_sweep_versions=8))
    with running(coord):
        client = CoordinatorClient(redis_url, reply_timeout=10)
        job = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
        profiled = client.register_job(job, "InstructionProfiler", {"microbatches": 1})
        clocks = list(range(1000, 1020))
        many = RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=clocks)
        with pytest.raises(ProtocolError, match=r"20 versions, over max_sweep_versions=8 "):
            client.register_rank(profiled, many)
        assert "PERSEUS_MAX_SWEEP_VERSIONS" in _reasons(r)[-1]
        # Restricting the sweep to a few clocks fits; a scheduler that does not sweep too.
        few = client.register_job(
            job, "InstructionProfiler", {"microbatches": 1, "frequencies": [1000, 1005]}
        )
        assert client.register_rank(few, many).ok
        plain = client.register_job(job)
        assert client.register_rank(plain, many).ok


def test_the_reply_never_shows_its_token():
    reply = Reply(ok=True, job_id="j", token="s3cret-token")
    assert "s3cret-token" not in repr(reply) and "s3cret-token" not in str(reply)
    assert sign("s3cret-token", b"data") != sign("other", b"data")


def test_a_refused_heartbeat_is_logged_once_and_training_goes_on(service, r, redis_url, caplog):
    job_id = register(CoordinatorClient(redis_url), pp=1)
    stranger = CoordinatorClient(redis_url)  # it did not register rank 0
    watcher = ScheduleWatcher(stranger, job_id, rank=0, version=0)
    try:
        watcher._beat()
        watcher._beat()
    finally:
        watcher._conn.close()
    assert watcher.error is None and watcher.token_refused and not watcher.job_lost
    assert caplog.text.count(f"wrong token for rank 0 of job {job_id}") == 1
    assert JobStore(r).ranks_heard(job_id) == {}


def test_a_rank_whose_clocks_lack_the_profilers_frequencies_is_refused_when_it_registers(
    r, redis_url
):
    # The job's `frequencies` could only be matched with the ranks' clocks once the first
    # schedule was built, after every rank had registered: the job then failed.
    coord = Coordinator(r, make_settings(redis_url))
    with running(coord):
        client = CoordinatorClient(redis_url, reply_timeout=10)
        job = JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2)
        wanted = [FREQS[0], 1600]
        assert 1600 not in FREQS
        job_id = client.register_job(
            job, "InstructionProfiler", {"microbatches": 1, "frequencies": wanted}
        )
        has_it = RankInfo(
            rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=[*FREQS, 1600]
        )
        assert client.register_rank(job_id, has_it).ok
        lacks = RankInfo(rank=1, dp_rank=0, pp_rank=1, tp_rank=0, available_frequencies=FREQS)
        with pytest.raises(ProtocolError) as info:
            client.register_rank(job_id, lacks)
        words = str(info.value)
        assert "rank 1" in words and "[1600]" in words, words
        assert "InstructionProfiler" in words and "frequencies" in words, words
        assert "frequencies" in _reasons(r)[-1]
        assert [info.rank for info in JobStore(r).ranks(job_id)] == [0]
