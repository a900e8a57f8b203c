"""Round trips on the path from all ranks' results to the next version: counted, not timed.

A round trip is one command or one pipeline sent on a connection (what waits for Redis).
"""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.client import Pipeline
from redis.retry import Retry
from rq import Queue, SimpleWorker
from rq.job import Job, JobStatus

from coordinator import tasks, worker_loop
from coordinator.advance_queue import enqueue
from coordinator.completion import CompletionGuess
from coordinator.replay import LiveSchedulers
from coordinator.resilience import ensure_groups
from coordinator.service import Coordinator
from coordinator.tasks import LIVE, advance_job
from coordinator.worker_loop import PerseusSimpleWorker
from protocol import keys
from protocol.models import JobInfo, JournalEntry, ReportResult, encode_message
from protocol.store import JobStore
from tests.helpers import RANKS, SENT, SNAPSHOTTING, make_settings, new_job, report_all, result


def started_after() -> int:
    """An rq task: how many round trips this process had made when the task started."""
    return SENT[0]


def test_advancing_a_cached_job_reads_its_results_with_its_state(r, count_round_trips):
    store = JobStore(r)
    new_job(store, "rt", SNAPSHOTTING)
    LIVE.clear()
    try:
        assert advance_job("rt", conn=r, snapshot_every=0) == [1]
        for version in (2, 3):
            report_all(store, "rt")
            before = count_round_trips[0]
            assert advance_job("rt", conn=r, snapshot_every=0) == [version]
            # Lease + state + the results the cached scheduler observes; publish; release.
            assert count_round_trips[0] - before == 3
        assert "rt" in LIVE
    finally:
        LIVE.clear()
    # What it observed is what was reported: the scheduler stepped down once per version.
    assert [s.frequencies[0][1] for s in store.schedules("rt", 3)] == [1980 - 30] * RANKS


def test_a_guessed_version_that_is_not_due_is_read_again(r):
    """The prefetched results are used only when they are the version observed."""
    store = JobStore(r)
    new_job(store, "guess", SNAPSHOTTING)
    cache = LiveSchedulers()
    advance_job("guess", conn=r)  # version 1
    report_all(store, "guess")
    state = store.job_state("guess", prefetch=5)  # a wrong guess: nothing stored there
    assert state.prefetched == (5, [])
    live = cache.get(store, state)
    entry = JournalEntry(version=2, observed_version=1)
    observed = live.apply_inputs(store, "guess", entry, state.prefetched)
    assert observed is not None and [o.rank for o in observed] == list(range(RANKS))


def _run_one_task(r: redis.Redis, worker_class: type[SimpleWorker]) -> tuple[int, int]:
    """Round trips before the task started and in all, for one task in burst mode."""
    queue = Queue(keys.RQ_QUEUE, connection=r)
    job = queue.enqueue(started_after, result_ttl=600)
    SENT[0] = 0
    worker_class([queue], connection=r).work(burst=True)
    job.refresh()
    assert job.get_status() == JobStatus.FINISHED
    started = job.return_value()
    assert isinstance(started, int)
    # rq's bookkeeping is all there: the finished registry has it, nothing is left started.
    assert job.id in queue.finished_job_registry.get_job_ids()
    assert queue.started_job_registry.get_job_ids() == []
    return started, SENT[0]


def test_the_long_lived_worker_starts_a_task_in_fewer_round_trips_than_rq(r, count_round_trips):
    _run_one_task(r, SimpleWorker)  # one-off costs (server version, scripts) out of the way
    rq_started, rq_total = _run_one_task(r, SimpleWorker)
    started, total = _run_one_task(r, PerseusSimpleWorker)
    # Before the task: the heartbeat before the blocking dequeue in one pipeline (2 fewer),
    # none right after it (3 fewer: the task's start beats), and the execution's record sent
    # in the task's start transaction (1 fewer).
    assert started <= rq_started - 6, (started, rq_started)
    assert total <= rq_total - 10, (total, rq_total)


def _advance_in_worker(r: redis.Redis, redis_url: str, job_id: str) -> Any:
    """Enqueue the job's advance task as the coordinator does; run it in a long-lived worker."""
    queue = Queue(keys.RQ_QUEUE, connection=r)
    task = enqueue(queue, JobStore(r), make_settings(redis_url), job_id, record=False)
    SENT[0] = 0
    PerseusSimpleWorker([queue], connection=r).work(burst=True)
    assert task.get_status(refresh=True) == JobStatus.FINISHED, task.latest_result()
    return task.return_value()


def test_an_advance_task_reads_the_job_in_the_transaction_that_starts_it(
    r, redis_url, count_round_trips, monkeypatch
):
    store = JobStore(r)
    new_job(store, "start", SNAPSHOTTING)
    LIVE.clear()
    try:
        assert _advance_in_worker(r, redis_url, "start") == [1]  # one-off costs out of the way
        sent = {}
        for name, start in (("own read", lambda *_: None), ("at start", tasks.queue_start)):
            monkeypatch.setattr(worker_loop, "queue_start", start)
            report_all(store, "start")
            version = store.version("start") + 1
            assert _advance_in_worker(r, redis_url, "start") == [version]
            sent[name] = count_round_trips[0]
        # The lease, the job's state and the results the cached scheduler observes came with
        # rq's start records: the task's own first round trip is gone, nothing else changed.
        assert sent["at start"] == sent["own read"] - 1, sent
        assert not r.exists(keys.job_lease("start")) and tasks._STARTED == {}
    finally:
        LIVE.clear()
    assert [s.frequencies[0][1] for s in store.schedules("start", 3)] == [1980 - 30] * RANKS


def test_a_task_whose_start_finds_the_lease_taken_leaves_it_to_its_holder(r, redis_url):
    store = JobStore(r)
    new_job(store, "held", SNAPSHOTTING)
    assert _advance_in_worker(r, redis_url, "held") == [1]
    report_all(store, "held")
    r.set(keys.job_lease("held"), "another-worker", px=60_000)
    assert _advance_in_worker(r, redis_url, "held") == []  # the holder publishes, not this one
    assert r.get(keys.job_lease("held")) == b"another-worker"
    assert store.version("held") == 1


def test_a_task_whose_start_finds_no_job_ends_without_a_lease_left(r, redis_url):
    assert _advance_in_worker(r, redis_url, "never-registered") == []
    assert not r.exists(keys.job_lease("never-registered"))
    assert not r.exists(keys.job_info("never-registered"))  # nothing of it was written


def test_a_lease_read_sent_again_after_a_lost_reply_is_still_the_callers(r, redis_url, monkeypatch):
    """redis-py sends a transaction again when its reply is lost; the first run took the lease.

    A client made by ``redis.Redis(...)`` retries (10 times by redis-py 8's default; one made
    by ``from_url`` does not).
    """
    store = JobStore(redis.Redis.from_url(redis_url, retry=Retry(NoBackoff(), 1)))
    new_job(store, "lost", SNAPSHOTTING)
    run = Pipeline._execute_transaction
    lost: list[int] = []

    def reply_lost_once(self: Pipeline, *args: Any, **kwargs: Any) -> Any:
        replies = run(self, *args, **kwargs)  # Redis ran it ...
        if not lost:
            lost.append(1)
            raise redis.ConnectionError("reply lost")  # ... and its reply never came
        return replies

    monkeypatch.setattr(Pipeline, "_execute_transaction", reply_lost_once)
    state = store.job_state("lost", lease=("mine", 10_000))
    assert lost and state.leased and r.get(keys.job_lease("lost")) == b"mine"
    monkeypatch.setattr(Pipeline, "_execute_transaction", run)
    assert not store.job_state("lost", lease=("theirs", 10_000)).leased


def test_a_start_read_that_fails_on_a_corrupt_job_fails_the_task_and_releases_the_lease(
    r, redis_url
):
    store = JobStore(r)
    new_job(store, "bad", SNAPSHOTTING)
    assert _advance_in_worker(r, redis_url, "bad") == [1]
    report_all(store, "bad")
    r.rpush(keys.job_journal("bad"), b"not msgpack")  # the journal's tail: read at the start
    queue = Queue(keys.RQ_QUEUE, connection=r)
    task = enqueue(queue, store, make_settings(redis_url), "bad", record=False)
    _run_worker(r)
    assert task.get_status(refresh=True) == JobStatus.FAILED
    assert "not valid msgpack" in (task.latest_result().exc_string or "")
    assert not r.exists(keys.job_lease("bad")) and tasks._STARTED == {}


def _run_worker(r: redis.Redis) -> None:
    PerseusSimpleWorker([Queue(keys.RQ_QUEUE, connection=r)], connection=r).work(burst=True)


def test_a_task_that_fails_before_advancing_leaves_no_lease_from_its_start(r, redis_url):
    """Its start took the lease; the call failed (a newer coordinator's argument, say)."""
    store = JobStore(r)
    new_job(store, "kw", SNAPSHOTTING)
    assert _advance_in_worker(r, redis_url, "kw") == [1]
    report_all(store, "kw")
    queue = Queue(keys.RQ_QUEUE, connection=r)
    bad = queue.enqueue_call(
        tasks.ADVANCE_TASK, args=("kw", 10_000), kwargs={"new_option": 1}, result_ttl=600
    )
    _run_worker(r)
    assert bad.get_status(refresh=True) == JobStatus.FAILED
    assert not r.exists(keys.job_lease("kw")) and tasks._STARTED == {}
    assert _advance_in_worker(r, redis_url, "kw") == [2]  # not held off for the lease's TTL


def test_an_error_in_rqs_start_writes_fails_the_task_and_releases_the_lease(
    r, redis_url, monkeypatch
):
    store = JobStore(r)
    new_job(store, "wr", SNAPSHOTTING)
    assert _advance_in_worker(r, redis_url, "wr") == [1]
    report_all(store, "wr")
    r.set("not-a-list", "x")
    prepare = Job.prepare_for_execution

    def failing(self: Job, worker_name: str, pipeline: Any) -> None:
        prepare(self, worker_name, pipeline)
        pipeline.lpush("not-a-list", "y")  # an rq write that fails inside EXEC

    monkeypatch.setattr(Job, "prepare_for_execution", failing)
    queue = Queue(keys.RQ_QUEUE, connection=r)
    task = enqueue(queue, store, make_settings(redis_url), "wr", record=False)
    _run_worker(r)
    assert task.get_status(refresh=True) == JobStatus.FAILED
    assert "WRONGTYPE" in (task.latest_result().exc_string or "")
    assert not r.exists(keys.job_lease("wr")) and store.version("wr") == 1
    monkeypatch.setattr(Job, "prepare_for_execution", prepare)
    assert _advance_in_worker(r, redis_url, "wr") == [2]


def test_a_task_whose_data_cannot_be_read_still_gets_rqs_start_writes(r):
    queue = Queue(keys.RQ_QUEUE, connection=r)
    task = queue.enqueue_call(tasks.ADVANCE_TASK, args=("x", 1000), result_ttl=600)
    r.hset(task.key, "data", b"garbage")
    _run_worker(r)
    assert task.get_status(refresh=True) == JobStatus.FAILED
    assert r.lrange(queue.intermediate_queue_key, 0, -1) == []  # rq's start took it out


# --- the coordinator ---------------------------------------------------------------------------
def _reports(job_id: str, version: int, ranks: range) -> list[tuple[str, str, dict[bytes, bytes]]]:
    entries = []
    for rank in ranks:
        fields = encode_message(
            ReportResult(job_id=job_id, result=result(rank, version)), token=f"token-{rank}"
        )
        raw = {k.encode(): v.encode() if isinstance(v, str) else v for k, v in fields.items()}
        entries.append((keys.RESULTS_STREAM, f"{version}-{rank}", raw))
    return entries


def test_the_results_that_complete_a_version_are_written_with_its_work_enqueued(
    r, redis_url, count_round_trips, monkeypatch
):
    """The enqueue rides with the writes, not with the acknowledgements a round trip later."""
    store = JobStore(r)
    new_job(store, "guess", SNAPSHOTTING)
    advance_job("guess", conn=r)  # version 1
    queue = Queue(keys.RQ_QUEUE, connection=r)
    coord = Coordinator(r, make_settings(redis_url))
    coord.handle_batch(_reports("guess", 1, range(1)))  # the job's record is cached now
    coord.queue.get_redis_server_version()  # rq asks once per queue
    assert queue.count == 0
    finishes: list[int] = []
    monkeypatch.setattr(coord, "_finish", lambda outcome: finishes.append(count_round_trips[0]))
    before = count_round_trips[0]
    coord.handle_batch(_reports("guess", 1, range(1, RANKS)))
    # A guess (1 counted before + 3 here = all): one round trip wrote them and enqueued.
    assert finishes == [before + 1]
    assert queue.count == 1 and store.due("guess")
    # The next version, all ranks in one batch: the same.
    assert advance_job("guess", conn=r) == [2]
    queue.empty()
    coord.handle_batch(_reports("guess", 2, range(RANKS)))
    assert queue.count == 1


def test_a_wrong_guess_costs_a_task_and_loses_no_work(r, redis_url):
    store = JobStore(r)
    new_job(store, "wrong", SNAPSHOTTING)
    advance_job("wrong", conn=r)
    queue = Queue(keys.RQ_QUEUE, connection=r)
    coord = Coordinator(r, make_settings(redis_url))
    coord.handle_batch(_reports("wrong", 1, range(2)))  # ranks 0, 1: 2 of 4 counted
    # Ranks 1 (again) and 2: the guess says 4 of 4, the store counts 3.
    coord.handle_batch(_reports("wrong", 1, range(1, 3)))
    assert queue.count == 1 and not store.due("wrong")
    assert advance_job("wrong", conn=r) == []  # the wasted task: nothing due
    queue.empty()
    # Another coordinator (or the hook's retry) stores rank 3: this one has nothing to
    # guess from, and enqueues the work once the store says the version is complete.
    coord.handle_batch(_reports("wrong", 1, range(3, 4)))
    assert queue.count == 1 and store.due("wrong")


def test_completion_guess_rules():
    guess = CompletionGuess()
    job = JobInfo(job_id="j", pp_degree=4, dp_degree=1, tp_degree=1, world_size=4)
    batch = [(job, result(rank, 3)) for rank in range(4)]
    assert guess.completed(batch) == ["j"]  # nothing known: a whole version in one batch
    assert guess.completed(batch[:3]) == []
    guess.record("j", 3, 3)
    assert guess.completed(batch[3:]) == ["j"]  # 3 counted + the last one
    guess.record("j", 3, 4)
    assert guess.completed(batch) == []  # complete already: its work was enqueued
    assert guess.completed([(job, result(r, 4)) for r in range(4)]) == ["j"]  # a newer one
    assert guess.completed([(job, result(r, 2)) for r in range(4)]) == []  # an older one


def test_a_guess_for_a_job_that_is_gone_leaves_nothing_of_it(r, redis_url):
    """The guessed enqueue does not touch the job's keys: a deleted job stays deleted."""
    store = JobStore(r)
    new_job(store, "gone", SNAPSHOTTING)
    advance_job("gone", conn=r)
    coord = Coordinator(r, make_settings(redis_url))
    coord.handle_batch(_reports("gone", 1, range(2)))  # its record and counts are cached
    assert store.delete_job("gone")
    coord.handle_batch(_reports("gone", 1, range(2, RANKS)))  # guessed complete
    assert not r.exists(keys.job_info("gone"))
    reasons = [f[b"reason"] for _, f in r.xrange(keys.DEADLETTER_STREAM)]
    assert len(reasons) == RANKS - 2 and all(b"unknown job" in x for x in reasons)


def test_a_burst_that_completes_its_version_takes_no_read_that_finds_nothing(
    r, redis_url, monkeypatch
):
    store = JobStore(r)
    new_job(store, "burst", SNAPSHOTTING)
    advance_job("burst", conn=r)  # version 1
    ensure_groups(r)
    coord = Coordinator(r, make_settings(redis_url), claim_idle_ms=60_000)
    reads: list[int] = []

    def counting(read: Any) -> Any:
        def counted(*args: object, **kwargs: object) -> object:
            reads.append(1)
            return read(*args, **kwargs)

        return counted

    # The loop's first read goes through its InputReader; the burst's top-ups do not.
    monkeypatch.setattr(coord.conn, "xreadgroup", counting(coord.conn.xreadgroup))
    monkeypatch.setattr(coord.reader, "read", counting(coord.reader.read))
    for version, expected in ((1, 2), (2, 1)):
        for _stream, _id, fields in _reports("burst", version, range(RANKS)):
            r.xadd(keys.RESULTS_STREAM, fields)
        reads.clear()
        assert coord.step(block_ms=100) == RANKS
        # Version 1: the job's size is not known before its first batch, so the coordinator
        # reads once more and finds nothing. Version 2: the first read holds every rank's
        # result, and that is known.
        assert len(reads) == expected, version
        assert store.due("burst")
        assert advance_job("burst", conn=r) == [version + 1]
    # A version still short of a rank: it reads on (up to its top-ups) for the rest.
    for _stream, _id, fields in _reports("burst", 3, range(RANKS - 1)):
        r.xadd(keys.RESULTS_STREAM, fields)
    reads.clear()
    assert coord.step(block_ms=100) == RANKS - 1
    assert len(reads) == 2 and not store.due("burst")
