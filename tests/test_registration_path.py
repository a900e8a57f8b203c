"""The registration path's shortcuts: the same bytes as the models, fresh tokens, fewer writes."""

from __future__ import annotations

import base64
import os
import threading
import time
import uuid

import msgpack
import pytest

from coordinator.resilience import ensure_groups
from coordinator.service import Coordinator
from protocol import keys
from protocol.exceptions import CoordinatorUnavailableError
from protocol.models import (
    JobConfig,
    JobInfo,
    RankInfo,
    RegisterJob,
    RegisterRank,
    Reply,
    encode_message,
    pack,
    pack_plain,
    pack_rank_reply,
    unpack,
)
from protocol.store import JobStore
from protocol.tokens import TOKEN_BYTES, TokenSupply, beat_digest, result_key
from tests.helpers import TOY_SCHEDULER, job_through, make_settings, rank_request
from worker_client.hook.session import CoordinatorClient

RANK = RankInfo(rank=3, dp_rank=1, pp_rank=1, tp_rank=0, available_frequencies=[1980, 1500, 210])


@pytest.mark.parametrize("needs", [True, False])
def test_a_rank_reply_is_packed_as_the_model_packs_it(needs):
    token = "t" * 43
    model = Reply(ok=True, job_id="job-1", instruction_energy=needs, token=token)
    data = pack_rank_reply("job-1", needs, token)
    assert data == pack(model)
    assert unpack(Reply, data) == model


def test_plain_packing_of_rank_info_and_a_registration_matches_the_models():
    assert pack_plain(RANK) == pack(RANK)
    message = RegisterRank(request_id=uuid.uuid4().hex, job_id="job-1", rank_info=RANK)
    assert encode_message(message)["data"] == pack(message)
    # Decoded, it is the same message.
    raw = msgpack.unpackb(encode_message(message)["data"], raw=False)
    assert RegisterRank.model_validate(raw) == message


def test_a_clock_that_is_not_positive_is_named_by_its_index():
    with pytest.raises(ValueError, match=r"available_frequencies\.1\n.*greater than 0"):
        RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=[1980, 0])
    with pytest.raises(ValueError, match="available_frequencies has duplicates"):
        RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=[1980, 1980])


def test_the_token_supply_hands_out_each_token_once_with_its_digests():
    supply = TokenSupply(batch=8)
    seen = set()
    for _ in range(30):  # several refills, from take() alone
        fresh = supply.take()
        assert fresh.token not in seen
        seen.add(fresh.token)
        # As secrets.token_urlsafe(TOKEN_BYTES) makes them: URL-safe base64, no padding.
        assert base64.urlsafe_b64decode(fresh.token + "=") and len(fresh.token) == 43
        assert len(base64.urlsafe_b64decode(fresh.token + "=")) == TOKEN_BYTES
        assert fresh.result_key == result_key(fresh.token)
        assert fresh.beat_digest == beat_digest(fresh.token)
        assert fresh.token not in repr(fresh) and fresh.token not in str(fresh)
    supply.top_up()
    assert len(supply) == 8
    supply.take()
    supply.top_up()  # 7 of 8 ready: not yet worth a refill
    assert len(supply) == 7
    with pytest.raises(ValueError, match="batch=0"):
        TokenSupply(batch=0)


def test_a_forked_process_never_hands_out_its_parents_tokens():
    supply = TokenSupply(batch=8)
    supply.top_up()
    ready = {supply.take().token for _ in range(4)} | {c.token for c in supply._ready}
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report the token it gets, then leave at once, whatever happens
        try:
            os.write(write, supply.take().token.encode())
        finally:
            os._exit(0)
    os.close(write)
    child_token = os.read(read, 100).decode()
    os.waitpid(pid, 0)
    os.close(read)
    assert len(child_token) == 43
    assert child_token not in ready
    assert supply.take().token in ready  # the parent's own are still good here


def _register(coord: Coordinator, r, job_id: str, rank: int) -> None:
    message = rank_request(job_id, rank, RANK.available_frequencies)
    r.xadd(keys.REGISTRATIONS_STREAM, encode_message(message))
    coord.step(block_ms=None)
    reply = unpack(Reply, r.lpop(keys.reply_key(message.request_id)))
    assert reply.ok, reply.error


def test_a_registration_burst_stamps_the_jobs_activity_once_per_interval(r, redis_url):
    # Defaults: a stamp at most every second.
    coord = Coordinator(r, make_settings(redis_url))
    job_id = job_through(coord, r, world=4)
    r.zadd(keys.JOBS_INDEX, {job_id: 1.0})  # an old stamp, to see which registration moves it
    _register(coord, r, job_id, 0)
    first = r.zscore(keys.JOBS_INDEX, job_id)
    assert first > 1.0
    r.zadd(keys.JOBS_INDEX, {job_id: 1.0})
    _register(coord, r, job_id, 1)  # a moment later: no stamp
    assert r.zscore(keys.JOBS_INDEX, job_id) == 1.0
    # Still registered, with its token's digests, like a stamped one.
    assert r.hexists(keys.job_ranks(job_id), "1")
    assert r.hexists(keys.job_tokens(job_id), "1") and r.hexists(keys.job_beatcheck(job_id), "1")
    coord.registrar._stamped[job_id] -= 1.0  # as if a second had passed
    _register(coord, r, job_id, 2)
    assert r.zscore(keys.JOBS_INDEX, job_id) > first


def test_a_refused_registration_does_not_count_as_a_stamp(r, redis_url):
    coord = Coordinator(r, make_settings(redis_url))
    job_id = job_through(coord, r, world=2)
    _register(coord, r, job_id, 0)
    coord.registrar._stamped.clear()  # as if long ago
    r.zadd(keys.JOBS_INDEX, {job_id: 1.0})
    # Rank 0 again, with other clocks: refused by the script, so nothing was stamped ...
    other = RANK.model_copy(update={"rank": 0, "pp_rank": 0, "dp_rank": 0, "tp_rank": 0})
    other = other.model_copy(update={"available_frequencies": [1410]})
    refused = RegisterRank(request_id=uuid.uuid4().hex, job_id=job_id, rank_info=other)
    r.xadd(keys.REGISTRATIONS_STREAM, encode_message(refused))
    coord.step(block_ms=None)
    assert not unpack(Reply, r.lpop(keys.reply_key(refused.request_id))).ok
    assert r.zscore(keys.JOBS_INDEX, job_id) == 1.0
    # ... and the next registration stamps.
    _register(coord, r, job_id, 1)
    assert r.zscore(keys.JOBS_INDEX, job_id) > 1.0


def test_the_stamp_interval_follows_the_shortest_limit_that_reads_it(r, redis_url):
    settings = make_settings(redis_url, max_job_idle_time=100, start_retention=2.0)
    coord = Coordinator(r, settings)
    registrar = coord.registrar
    assert registrar.stamp_due("j", 50.0)
    registrar.stamped("j", 50.0)
    assert not registrar.stamp_due("j", 50.19)  # a tenth of start_retention: 0.2 s
    assert registrar.stamp_due("j", 50.2)


def test_the_store_stamps_every_registration_it_is_given(r):
    store = JobStore(r)
    job = JobInfo(job_id="stamp-job", pp_degree=2, dp_degree=1, tp_degree=1, world_size=2)
    store.create_job(job, JobConfig(scheduler=TOY_SCHEDULER), "1-0", now=5.0)
    for rank, now in ((0, 7.0), (1, 7.5)):
        info = RANK.model_copy(update={"rank": rank, "dp_rank": 0, "pp_rank": rank})
        store.add_rank(job, info, now=now)
        assert r.zscore(keys.JOBS_INDEX, "stamp-job") == now


def test_the_coordinator_that_created_a_job_reads_no_record_for_its_ranks(
    r, redis_url, monkeypatch
):
    loads: list[tuple[str, list[str]]] = []

    def counting(coord: Coordinator) -> Coordinator:
        get_jobs = coord.store.get_jobs

        def counted(job_ids):
            loads.append((coord.consumer, list(job_ids)))
            return get_jobs(loads[-1][1])

        monkeypatch.setattr(coord.store, "get_jobs", counted)
        return coord

    creator = counting(Coordinator(r, make_settings(redis_url), consumer="creator"))
    other = counting(Coordinator(r, make_settings(redis_url), consumer="other"))
    job_id = job_through(creator, r, world=2)
    _register(creator, r, job_id, 0)
    assert loads == []  # cached when it stored the job
    _register(other, r, job_id, 1)
    assert loads == [("other", [job_id])]  # one that did not create it reads it once


def test_registrations_nobody_waits_for_any_more_are_dead_lettered_not_served(r, redis_url):
    ensure_groups(r)  # as a coordinator that ran before: what is sent now is new to the group
    # No coordinator runs now: the requests time out and their senders give up.
    gone = CoordinatorClient(redis_url, reply_timeout=0.5)
    with pytest.raises(CoordinatorUnavailableError, match="no coordinator answered"):
        gone.register_job(ONE_RANK_JOB)
    with pytest.raises(CoordinatorUnavailableError, match="no coordinator answered"):
        gone.register_rank("some-job", rank_request("some-job", 0).rank_info)
    gone.close()
    # A client that predates wait_s (no such field) and one whose field is junk.
    old = RegisterJob(request_id="old-client", job=ONE_RANK_JOB)
    r.xadd(keys.REGISTRATIONS_STREAM, encode_message(old))
    junk = RegisterJob(request_id="junk-wait", job=ONE_RANK_JOB)
    r.xadd(keys.REGISTRATIONS_STREAM, {**encode_message(junk), "wait_s": "soon"})
    time.sleep(0.6)  # the first two requests are now older than their senders waited
    coord = Coordinator(r, make_settings(redis_url))
    coord.step(block_ms=None)
    # Only the request without a deadline made a job: none that nobody trains.
    assert len(JobStore(r).list_jobs()) == 1
    reasons = sorted(f[b"reason"].decode() for _id, f in r.xrange(keys.DEADLETTER_STREAM))
    assert len(reasons) == 3, reasons
    assert reasons[0].startswith("register_job request") and "wait_s=0.5 s only" in reasons[0]
    assert reasons[1].startswith("register_rank request") and "wait_s=0.5 s only" in reasons[1]
    assert "wait_s must be a positive number" in reasons[2] and "soon" in reasons[2]
    # A sender that still waits is served as before.
    waiting = CoordinatorClient(redis_url, reply_timeout=30)
    assert registered_while_serving(coord, waiting) in {j for j, _ in JobStore(r).list_jobs()}
    waiting.close()


ONE_RANK_JOB = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)


def registered_while_serving(coord: Coordinator, client: CoordinatorClient) -> str:
    """The job id ``client`` registers while ``coord`` serves it from this thread's steps."""
    box: list[str] = []
    thread = threading.Thread(target=lambda: box.append(client.register_job(ONE_RANK_JOB)))
    thread.start()
    while thread.is_alive():
        coord.step(block_ms=20)
    thread.join()
    return box[0]


def test_a_reply_timeout_that_is_not_positive_is_refused_naming_it(redis_url):
    with pytest.raises(ValueError, match="reply_timeout must be > 0"):
        CoordinatorClient(redis_url, reply_timeout=0)


def _calls(r, command: str) -> int:
    """How many times Redis ran ``command`` (INFO commandstats; 0 if never)."""
    return int(r.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def _job_sent(r, redis_url: str) -> tuple[Coordinator, RegisterJob]:
    """A coordinator (not stepped yet) and a two-stage job's registration sent to it."""
    coord = Coordinator(r, make_settings(redis_url), consumer="one")
    ensure_groups(r)
    job = RegisterJob(
        request_id=uuid.uuid4().hex,
        job=JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2),
    )
    r.xadd(keys.REGISTRATIONS_STREAM, encode_message(job))
    return coord, job


def test_a_job_is_answered_and_acknowledged_by_the_script_that_creates_it(r, redis_url):
    coord, job = _job_sent(r, redis_url)
    before = _calls(r, "exec")
    coord.step(block_ms=None)
    assert _calls(r, "exec") == before  # no transaction of its own for the reply and the ack
    reply = unpack(Reply, r.lindex(keys.reply_key(job.request_id), 0))
    assert reply.ok and r.exists(keys.job_info(reply.job_id))
    assert r.xpending(keys.REGISTRATIONS_STREAM, keys.COORDINATOR_GROUP)["pending"] == 0
    assert coord.processed == 1


def test_a_job_registration_delivered_again_gets_the_same_job_as_its_reply(r, redis_url):
    coord, job = _job_sent(r, redis_url)
    coord.step(block_ms=None)
    first = unpack(Reply, r.lpop(keys.reply_key(job.request_id)))
    r.xadd(keys.REGISTRATIONS_STREAM, encode_message(job))  # a client's retry of its send
    coord.step(block_ms=None)
    again = unpack(Reply, r.lpop(keys.reply_key(job.request_id)))
    assert again.ok and again.job_id == first.job_id
    assert r.xpending(keys.REGISTRATIONS_STREAM, keys.COORDINATOR_GROUP)["pending"] == 0
