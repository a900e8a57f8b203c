"""rq job functions: compute and publish a job's next schedule version.

A worker rebuilds the job's scheduler from Redis alone, by constructing it and replaying the
journal (observations and control messages, in the order they were applied), then computes
the next version and publishes it with a compare-and-set. Any worker can therefore continue a
job after another worker, or the coordinator, was killed.
"""

from __future__ import annotations

import logging
import threading
import uuid

import redis

from coordinator.dump import dump_version
from protocol.exceptions import ProtocolError
from protocol.models import FrequencySchedule, JournalEntry, RankInfo
from protocol.scheduler import FrequencyScheduler, build_scheduler
from protocol.store import JobRecord, JobStore

logger = logging.getLogger(__name__)

DEFAULT_LEASE_TTL_MS = 10_000
_MAX_ROUNDS = 100  # Versions one task may publish before handing over (keeps tasks short).


def _connection() -> redis.Redis:
    from rq import get_current_job

    job = get_current_job()
    if job is None:
        raise RuntimeError("advance_job needs a Redis connection when not run by an rq worker")
    return job.connection


class _LeaseKeeper:
    """Renews a job lease in a background thread while the scheduler computes."""

    def __init__(self, store: JobStore, job_id: str, token: str, ttl_ms: int) -> None:
        self._store, self._job_id, self._token, self._ttl = store, job_id, token, ttl_ms
        self._stop = threading.Event()
        self.lost = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="perseus-lease")
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._ttl / 3000):
            if not self._store.renew_lease(self._job_id, self._token, self._ttl):
                self.lost = True
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def check_schedules(
    schedules: list[FrequencySchedule], ranks: list[RankInfo], scheduler: str
) -> list[FrequencySchedule]:
    """Check a scheduler's output: exactly one schedule per rank, allowed frequencies only."""
    by_rank = {s.rank: s for s in schedules}
    expected = {r.rank for r in ranks}
    if len(by_rank) != len(schedules) or set(by_rank) != expected:
        got = sorted(s.rank for s in schedules)
        raise ProtocolError(
            f"scheduler {scheduler} returned schedules for ranks {got}, "
            f"expected one for each of {sorted(expected)}"
        )
    for rank in ranks:
        allowed = set(rank.available_frequencies)
        for i, (name, freq) in enumerate(by_rank[rank.rank].frequencies):
            if freq not in allowed:
                raise ProtocolError(
                    f"scheduler {scheduler} gave rank {rank.rank} frequency {freq} MHz for "
                    f"instruction {i} ({name}), which its GPU does not support"
                )
    return [by_rank[r] for r in sorted(by_rank)]


def rebuild_scheduler(
    store: JobStore, record: JobRecord
) -> tuple[FrequencyScheduler, list[JournalEntry]]:
    """Construct the job's scheduler and replay its journal; return it and the journal."""
    job_id = record.job_id
    ranks = store.ranks(job_id)
    scheduler = build_scheduler(
        record.config.scheduler, record.info, ranks, record.config.scheduler_args
    )
    controls = store.controls(job_id)
    applied = 0
    journal = store.journal(job_id)
    for entry in journal:
        _apply_inputs(store, job_id, scheduler, entry, controls, applied)
        applied = entry.controls_upto
        replayed = scheduler.next_schedule()
        if entry.published:
            _warn_if_diverged(store, job_id, entry.version, replayed)
    return scheduler, journal


def _apply_inputs(
    store: JobStore,
    job_id: str,
    scheduler: FrequencyScheduler,
    entry: JournalEntry,
    controls: list,
    applied: int,
) -> None:
    if entry.observed_version is not None:
        scheduler.observe(store.results(job_id, entry.observed_version))
    for message in controls[applied : entry.controls_upto]:
        scheduler.set_target(message.iteration_time)


def _warn_if_diverged(
    store: JobStore, job_id: str, version: int, replayed: list[FrequencySchedule]
) -> None:
    stored = {s.rank: s.frequencies for s in store.schedules(job_id, version)}
    if stored and stored != {s.rank: s.frequencies for s in replayed}:
        logger.error(
            "job %s: replaying version %d gave a different schedule; the scheduler is not "
            "deterministic, later versions may not match what clients ran",
            job_id,
            version,
        )


def _by_rank(schedules: list[FrequencySchedule]) -> dict[int, list[tuple[str, int]]]:
    return {s.rank: s.frequencies for s in schedules}


def advance_once(store: JobStore, job_id: str) -> int | None:
    """Compute and publish the next version if one is due; return it (None if none was).

    A converged scheduler that returns the schedules in force again only has the observation
    recorded in the journal: clients keep their version, and report no more results for it.

    Raises:
        UnknownJobError: The job is gone.
        ProtocolError: The scheduler returned an invalid schedule.
    """
    record = store.get_job(job_id)
    if not store.due(record):
        return None
    scheduler, journal = rebuild_scheduler(store, record)
    version = sum(e.published for e in journal)
    latest = store.version(job_id)
    if latest != version:
        raise ProtocolError(f"job {job_id}: journal has {version} versions but version is {latest}")
    controls = store.controls(job_id)
    tail = journal[-1] if journal else None
    fresh_results = (
        version > 0
        and (tail is None or tail.observed_version != version)
        and store.result_count(job_id, version) >= record.info.world_size
    )
    entry = JournalEntry(
        version=version + 1,
        observed_version=version if fresh_results else None,
        controls_upto=len(controls),
    )
    _apply_inputs(store, job_id, scheduler, entry, controls, tail.controls_upto if tail else 0)
    schedules = check_schedules(
        scheduler.next_schedule(), store.ranks(job_id), record.config.scheduler
    )
    if (
        version
        and scheduler.converged
        and _by_rank(schedules) == _by_rank(store.schedules(job_id, version))
    ):
        unpublished = entry.model_copy(update={"version": version, "published": False})
        if store.record_unpublished(job_id, unpublished, len(journal)):
            logger.info("job %s: observed version %d; schedule unchanged", job_id, version)
        return None
    if not store.publish(job_id, schedules, entry, journal_length=len(journal)):
        logger.info("job %s: version %d was published by another worker", job_id, entry.version)
        return None
    logger.info("job %s: published schedule version %d", job_id, entry.version)
    store.save_artifacts(job_id, scheduler.artifacts())
    if record.config.dump_dir:
        dump_version(store, record, entry.version)
    return entry.version


def advance_job(
    job_id: str,
    lease_ttl_ms: int = DEFAULT_LEASE_TTL_MS,
    conn: redis.Redis | None = None,
) -> list[int]:
    """Rq entry point: publish every version that is due for ``job_id``.

    Holds a lease so that only one worker computes a job at a time. A worker that finds the
    lease taken returns at once: the holder re-checks for due work after releasing it.

    Returns:
        The versions this call published.
    """
    store = JobStore(conn if conn is not None else _connection())
    token = uuid.uuid4().hex
    published: list[int] = []
    while True:
        if not store.acquire_lease(job_id, token, lease_ttl_ms):
            return published
        keeper = _LeaseKeeper(store, job_id, token, lease_ttl_ms)
        try:
            for _ in range(_MAX_ROUNDS):
                version = advance_once(store, job_id)
                if version is None or keeper.lost:
                    break
                published.append(version)
        except redis.RedisError:
            raise  # Transient: the coordinator's sweep enqueues the work again.
        except Exception as exc:
            # Recorded on the job: clients waiting for a schedule report it, running ranks'
            # watchers log it, and the coordinator stops re-enqueueing a job whose scheduler
            # fails deterministically.
            store.fail_job(job_id, f"{type(exc).__name__}: {exc}")
            logger.error("job %s: %s", job_id, exc)
            raise
        finally:
            keeper.stop()
            store.release_lease(job_id, token)
        # Work that arrived while the lease was held may have been skipped by another task.
        if not store.due(store.get_job(job_id)) or len(published) >= _MAX_ROUNDS:
            return published
