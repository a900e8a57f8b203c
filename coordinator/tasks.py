"""rq job functions: compute and publish a job's next schedule version.

A worker takes the job's scheduler from its process cache (:mod:`coordinator.replay`), or
rebuilds it from Redis alone (snapshot, then journal), feeds it the new observation, computes
the next version and publishes it with a compare-and-set. Any worker can therefore continue a
job after another worker, or the coordinator, was killed; a long-lived worker pays only for
what is new.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from redis.client import Pipeline
from rq import get_current_job
from rq.job import Job

from coordinator.dump import dump_observed, dump_version
from coordinator.replay import LiveScheduler, LiveSchedulers, by_rank, rebuild, summarize
from coordinator.schedule_checks import check_schedules
from protocol.exceptions import ProtocolError, UnknownJobError
from protocol.models import JournalEntry
from protocol.scheduler import FrequencyScheduler
from protocol.store import JobRecord, JobState, JobStore

logger = logging.getLogger(__name__)

DEFAULT_LEASE_TTL_MS = 10_000
_MAX_ROUNDS = 100  # Steps one task may take before handing over (keeps tasks short).
SNAPSHOT_EVERY = 10
"""Default journal entries between scheduler snapshots (schedulers that support them)."""

LIVE = LiveSchedulers()
"""This process's schedulers: a long-lived worker keeps them from one task to the next."""

ADVANCE_TASK = "coordinator.tasks.advance_job"
"""The rq function name of :func:`advance_job`, as the coordinator enqueues it."""

# rq task id -> (job id, lease token, the job's state or the error reading it), for a task
# whose first read went with the transaction that started it (queue_start). advance_job takes
# its entry; the worker drops one left unused once the task ends (forget_start).
_STARTED: dict[str, tuple[str, str, JobState | Exception]] = {}
# rq task id -> (job id, lease token), chosen by a forking worker before it forks the task's
# work horse (lease_before_fork): the horse's advance_job leases with that token, so that the
# worker, which outlives a killed horse, can release the lease (release_after_horse).
_FORKED: dict[str, tuple[str, str]] = {}


@dataclasses.dataclass(frozen=True)
class StartRead:
    """An advance task's first read, queued on the transaction that starts the task."""

    count: int  # commands queued: their replies are the transaction's last
    keep: Callable[[list[Any]], None]  # takes those replies, for the task to find


def queue_start(task: Job, pipe: Pipeline) -> StartRead | None:
    """Queue an advance task's first read (the lease and the job's state) on its start.

    The long-lived worker records a task's start in one transaction; the task's own first
    round trip (take the job's lease, read its state and the results its cached scheduler
    expects) goes in it too. That round trip lies between the coordinator's enqueue and the
    next version (measured side by side: ``benchmarks/bench_ab.py``).

    Args:
        task: The rq task about to start.
        pipe: Its start transaction, not executed yet.

    Returns:
        None for a task that is not :func:`advance_job`.
    """
    advance = _advance_args(task)
    if advance is None:
        return None
    job_id, lease_ms = advance
    token = uuid.uuid4().hex
    lease, prefetch = (token, lease_ms), LIVE.expected_observation(job_id)
    count = JobStore.queue_job_state(pipe, job_id, lease=lease, prefetch=prefetch)

    def keep(replies: list[Any]) -> None:
        try:
            state = JobStore.read_job_state(replies, job_id, lease, prefetch)
        except Exception as exc:  # A Redis error, no such job, a job hash it cannot read:
            _STARTED[task.id] = (job_id, token, exc)  # advance_job meets it as its own read's
        else:
            _STARTED[task.id] = (job_id, token, state)

    return StartRead(count, keep)


def _advance_args(task: Job) -> tuple[str, int] | None:
    """The job id and lease TTL (ms) of an :func:`advance_job` task; None for any other task."""
    try:
        if task.func_name != ADVANCE_TASK or len(task.args) < 2:
            return None
        return str(task.args[0]), int(task.args[1])
    except Exception:  # An undecodable task: rq's own start writes must go on; rq fails
        return None  # the task when it calls it.


def lease_before_fork(task: Job) -> None:
    """Choose the lease token of an advance task that a forked work horse is about to run.

    The horse inherits it (a fork copies this process), and :func:`release_after_horse` in the
    worker can then release a lease the horse left behind.
    """
    advance = _advance_args(task)
    if advance is not None:
        _FORKED[task.id] = (advance[0], uuid.uuid4().hex)


def release_after_horse(conn: redis.Redis, task: Job, clean: bool) -> None:
    """Once ``task``'s work horse has ended: release the lease it held, unless it exited cleanly.

    A horse killed (rq's cold stop, its time-out, the OOM killer) could not release its lease:
    the job waited for the lease to expire (``stall_timeout``, 10 s by default) before another
    worker could compute it. The horse is gone, so nobody computes under that token any more;
    a horse that exited by itself released it (or never took it) already.

    Args:
        conn: The worker's Redis client.
        task: The rq task the horse ran.
        clean: The horse exited with status 0.
    """
    left = _FORKED.pop(task.id, None)
    if left is None or clean:
        return
    job_id, token = left
    try:
        JobStore(conn).release_lease(job_id, token)  # only if that token still holds it
    except redis.RedisError as exc:  # it expires by itself
        logger.warning("job %s: lease of a killed work horse not released: %s", job_id, exc)


def forget_start(conn: redis.Redis, task: Job) -> None:
    """Once ``task`` has ended: release a lease its start took that advance_job never used.

    A task can fail between its start and :func:`advance_job`'s first line (arguments its
    function does not take, a shutdown, an error in rq's own start writes). Without this its
    lease would hold the job for the lease's time to live (10 s by default) before the sweep
    could enqueue the job again.
    """
    left = _STARTED.pop(task.id, None)
    if left is not None:
        job_id, token, _ = left
        with contextlib.suppress(redis.RedisError):  # the lease then expires by itself
            JobStore(conn).release_lease(job_id, token)


def _read_at_start(job_id: str) -> tuple[str, JobState | Exception] | None:
    """What the running rq task's start transaction read for ``job_id`` (None: nothing)."""
    task = get_current_job()
    if task is None or task.id not in _STARTED or _STARTED[task.id][0] != job_id:
        return None
    _, token, read = _STARTED.pop(task.id)
    return token, read


def _forked_token(job_id: str) -> str | None:
    """The lease token the forking worker chose for the running task (None: none chosen)."""
    task = get_current_job()
    forked = _FORKED.get(task.id) if task is not None else None
    return forked[1] if forked is not None and forked[0] == job_id else None


def _connection() -> redis.Redis:
    job = get_current_job()
    if job is None:
        raise RuntimeError("advance_job needs a Redis connection when not run by an rq worker")
    return job.connection


class _LeaseRenewer:
    """One thread per process renews the leases its tasks hold while their schedulers compute.

    Started on first use (and again in a forked child, which inherits no threads), so a task
    costs a dictionary update rather than a thread of its own.
    """

    def __init__(self) -> None:
        self._reset()
        # A forking worker forks while this thread may hold the lock: the child starts afresh.
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._held: dict[tuple[str, str], tuple[JobStore, int, float]] = {}
        self._cond = threading.Condition()
        self._pid = 0

    def hold(self, store: JobStore, job_id: str, token: str, ttl_ms: int) -> None:
        """Renew ``job_id``'s lease every third of its TTL until :meth:`release`."""
        with self._cond:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                self._held.clear()
                thread = threading.Thread(target=self._loop, daemon=True, name="perseus-lease")
                thread.start()
            self._held[(job_id, token)] = (store, ttl_ms, time.monotonic() + ttl_ms / 3000)
            self._cond.notify()

    def release(self, job_id: str, token: str) -> None:
        """Stop renewing (the caller releases the lease itself)."""
        with self._cond:
            self._held.pop((job_id, token), None)

    def _loop(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = [(key, held) for key, held in self._held.items() if held[2] <= now]
                for key, (store, ttl_ms, _) in due:
                    self._held[key] = (store, ttl_ms, now + ttl_ms / 3000)
                if not due:
                    nearest = min((held[2] for held in self._held.values()), default=now + 60)
                    self._cond.wait(max(0.0, nearest - now))
                    continue
            for (job_id, token), (store, ttl_ms, _) in due:
                try:
                    renewed = store.renew_lease(job_id, token, ttl_ms)
                except redis.RedisError:
                    renewed = True  # Try again next time; the compare-and-set guards publishing.
                if not renewed:
                    logger.warning("job %s: lease lost while computing", job_id)
                    self.release(job_id, token)


_RENEWER = _LeaseRenewer()


def rebuild_scheduler(
    store: JobStore, record: JobRecord
) -> tuple[FrequencyScheduler, list[JournalEntry]]:
    """Build the job's scheduler from Redis alone (snapshot, then journal), and its journal."""
    state = store.job_state(record.job_id)
    return rebuild(store, state).scheduler, store.journal(record.job_id)


def advance_once(
    store: JobStore,
    job_id: str,
    cache: LiveSchedulers | None = None,
    snapshot_every: int = SNAPSHOT_EVERY,
    state: JobState | None = None,
) -> int | None:
    """Compute and publish the next version if one is due; return it (None if none was).

    A converged scheduler that returns the schedules in force again only has the observation
    recorded in the journal: clients keep their version, and report no more results for it.

    Args:
        store: The job store.
        job_id: The job.
        cache: Schedulers kept between calls (default: this process's).
        snapshot_every: Journal entries between scheduler snapshots (0: none).
        state: The job's state, if just read (default: read it).

    Raises:
        UnknownJobError: The job is gone.
        ProtocolError: The scheduler returned an invalid schedule.
    """
    cache = LIVE if cache is None else cache
    state = store.job_state(job_id) if state is None else state
    if not state.due:
        return None
    record = state.record
    live = cache.get(store, state)
    version = state.version
    if live.version != version:
        cache.drop(job_id)
        raise ProtocolError(
            f"job {job_id}: journal has {live.version} versions but version is {version}"
        )
    entry = JournalEntry(
        version=version + 1,
        observed_version=version if state.fresh_results else None,
        controls_upto=state.control_length,
    )
    try:
        # From here the cached scheduler has taken inputs that only a publish records.
        observed = live.apply_inputs(store, job_id, entry, state.prefetched)
        schedules = check_schedules(
            live.scheduler.next_schedule(), live.ranks, record.config.scheduler, live.allowed
        )
        summary = summarize(observed) if observed is not None else None
        if (
            version
            and live.scheduler.converged
            and by_rank(schedules) == live.latest_schedules(store, job_id)
        ):
            unpublished = entry.model_copy(update={"version": version, "published": False})
            if not store.record_unpublished(
                job_id, unpublished, state.journal_length, summary=summary
            ):
                cache.drop(job_id)
                return None
            live.journal_length += 1
            logger.info("job %s: observed version %d; schedule unchanged", job_id, version)
            _after_recording(live, store, record, None, snapshot_every, observed=version)
            return None
        if not store.publish(
            job_id, schedules, entry, journal_length=state.journal_length, summary=summary
        ):
            cache.drop(job_id)
            logger.info("job %s: version %d was published by another worker", job_id, entry.version)
            return None
    except BaseException:
        cache.drop(job_id)
        raise
    live.journal_length += 1
    live.version = entry.version
    live.latest = by_rank(schedules)
    logger.info("job %s: published schedule version %d", job_id, entry.version)
    _after_recording(live, store, record, entry.version, snapshot_every)
    return entry.version


def _after_recording(
    live: LiveScheduler,
    store: JobStore,
    record: JobRecord,
    published: int | None,
    snapshot_every: int,
    observed: int | None = None,
) -> None:
    """Save what follows a journal entry: artifacts and dump of a published version, snapshot.

    ``observed``: the version whose results an entry that published nothing observed (dumped
    before a snapshot can delete them).

    The entry is in Redis and clients may already run its version: an error here (a full disk
    under ``dump_dir``, a scheduler whose ``artifacts`` or ``snapshot`` raises) is logged, and
    does not fail the job. Redis errors still end the task (rq records it; the sweep retries).
    """
    job_id = record.job_id
    try:
        if published is not None:
            live.save_artifacts(store, job_id)
            if record.config.dump_dir:
                dump_version(store, record, published)
        elif observed is not None and record.config.dump_dir:
            dump_observed(store, record, observed)
        live.maybe_snapshot(store, job_id, snapshot_every)
    except (redis.RedisError, UnknownJobError):
        raise
    except Exception:
        logger.exception(
            "job %s: journal entry %d is recorded, but saving its artifacts, dump or snapshot "
            "failed (the job goes on)",
            job_id,
            live.journal_length,
        )


def advance_job(
    job_id: str,
    lease_ttl_ms: int = DEFAULT_LEASE_TTL_MS,
    conn: redis.Redis | None = None,
    snapshot_every: int = SNAPSHOT_EVERY,
    stream_maxlen: int | None = None,
) -> list[int]:
    """Rq entry point: publish every version that is due for ``job_id``.

    Holds a lease so that only one worker computes a job at a time. A worker that finds the
    lease taken returns at once: the holder re-checks for due work after releasing it. A job
    with nothing left due leaves the due set that the coordinator's sweep watches. In the
    long-lived worker the first lease and state come from the transaction that started the
    task (:func:`queue_start`), not from a read of its own.

    Args:
        job_id: The job.
        lease_ttl_ms: Lease time-to-live, renewed while computing.
        conn: Redis client (default: the rq job's).
        snapshot_every: Journal entries between scheduler snapshots (0: none).
        stream_maxlen: Cap of the job's updates stream (the enqueuing coordinator's
            ``stream_maxlen``; default: :class:`JobStore`'s).

    Returns:
        The versions this call published.
    """
    conn = conn if conn is not None else _connection()
    store = JobStore(conn) if stream_maxlen is None else JobStore(conn, stream_maxlen)
    started = _read_at_start(job_id)
    token = started[0] if started is not None else _forked_token(job_id) or uuid.uuid4().hex
    published: list[int] = []
    for _ in range(_MAX_ROUNDS):
        # Taking the lease and reading the job's state is one round trip, and so is reading
        # the results a cached scheduler expects to observe with them; the first round's
        # may have gone with the rq task's start (queue_start).
        try:
            if started is not None:
                first, started = started[1], None
                if isinstance(first, Exception):
                    raise first
                state = first
            else:
                state = store.job_state(
                    job_id, lease=(token, lease_ttl_ms), prefetch=LIVE.expected_observation(job_id)
                )
        except UnknownJobError:
            store.release_lease(job_id, token)
            logger.info("job %s is gone (deleted as idle?): nothing to advance", job_id)
            return published
        except BaseException:
            # The read may have taken the lease before another of its commands failed (or a
            # shutdown interrupted it).
            with contextlib.suppress(redis.RedisError):
                store.release_lease(job_id, token)
            raise
        if not state.leased:
            return published
        _RENEWER.hold(store, job_id, token, lease_ttl_ms)
        try:
            # One step per lease: what is due after it (results come much later, a control
            # message may be waiting) is found when the lease is released, one round trip.
            version = advance_once(store, job_id, snapshot_every=snapshot_every, state=state)
            if version is not None:
                published.append(version)
        except redis.RedisError:
            with contextlib.suppress(redis.RedisError):
                store.release_lease(job_id, token)
            raise  # Transient: the coordinator's sweep enqueues the work again.
        except UnknownJobError:
            store.release_lease(job_id, token)  # Deleted meanwhile: nothing to record.
            return published
        except Exception as exc:
            store.release_lease(job_id, token)
            # Recorded on the job: clients waiting for a schedule report it, running ranks'
            # watchers log it, and the coordinator stops re-enqueueing a job whose scheduler
            # fails deterministically.
            store.fail_job(job_id, f"{type(exc).__name__}: {exc}")
            logger.error("job %s: %s", job_id, exc)
            raise
        except BaseException:
            # A shutdown mid-computation (rq's cold stop raises SystemExit from its signal
            # handler; Ctrl+C): hand the job over now, not once the lease expires.
            with contextlib.suppress(redis.RedisError):
                store.release_lease(job_id, token)
            raise
        finally:
            _RENEWER.release(job_id, token)
        # Work that arrived while the lease was held may have been skipped by another task.
        if not store.release_and_settle(job_id, token):
            break
    return published
