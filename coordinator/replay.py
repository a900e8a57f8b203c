"""Schedulers kept alive in a worker between versions, and rebuilt from Redis when they are not.

A job's scheduler is a pure function of its journal (observations and control messages, in
order). A long-lived rq worker keeps the scheduler it computed the last version with and only
feeds it what is new, so a version costs the same at version 200 as at version 2. Whenever
that cached one cannot be trusted (another worker advanced the job further than its snapshot,
the worker restarted, a publish lost its compare-and-set), the scheduler is rebuilt from Redis:
constructed, restored from the newest snapshot if the scheduler supports snapshots, then fed
the journal entries after it. Only the newest replayed version is checked against what clients
were sent (a non-deterministic scheduler is reported once, not at every step of every replay).
"""

from __future__ import annotations

import logging
import statistics
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgpack

from protocol.exceptions import ConfigError, ProtocolError
from protocol.models import FrequencySchedule, JournalEntry, ProfilingResult, RankInfo
from protocol.scheduler import FrequencyScheduler, build_scheduler
from protocol.store import JobRecord, JobState, JobStore

logger = logging.getLogger(__name__)

ByRank = dict[int, list[tuple[str, int]]]


def by_rank(schedules: list[FrequencySchedule]) -> ByRank:
    """Schedules keyed by rank, for comparing two versions."""
    return {s.rank: s.frequencies for s in schedules}


def summarize(results: list[ProfilingResult]) -> bytes:
    """What stays of a version's results once they expire: ranks, iteration time and energy.

    The iteration time is the slowest rank's mean (ranks of a pipeline wait for each other);
    the energy is the sum over ranks of each rank's mean iteration energy.
    """
    times = [statistics.fmean(r.iter_time) for r in results if r.iter_time]
    energies = [statistics.fmean(r.iter_energy) for r in results if r.iter_energy]
    summary = {
        "ranks": len(results),
        "iter_time": max(times) if times else None,
        "iter_energy": sum(energies) if energies else None,
    }
    return msgpack.packb(summary, use_bin_type=True)


@dataclass
class LiveScheduler:
    """A scheduler fed the first ``journal_length`` entries of its job's journal."""

    identity: str  # see identity(): a re-created job is another job
    scheduler: FrequencyScheduler
    ranks: list[RankInfo]
    journal_length: int = 0
    version: int = 0  # published versions among those entries
    controls_applied: int = 0
    observed_upto: int = 0  # newest version whose results were observed
    snapshot_length: int = 0  # journal entries the newest stored snapshot covers
    results_floor: int = 1  # results of older versions are deleted
    snapshots: bool = True  # False once the scheduler declined to give a snapshot
    latest: ByRank | None = None  # schedules of the newest published version, when known
    artifacts_saved: dict[str, bytes] = field(default_factory=dict)
    allowed: dict[int, set[int]] = field(default_factory=dict)  # rank -> its clocks

    def __post_init__(self) -> None:
        self.allowed = {r.rank: set(r.available_frequencies) for r in self.ranks}

    def apply_inputs(
        self,
        store: JobStore,
        job_id: str,
        entry: JournalEntry,
        prefetched: tuple[int, list[bytes]] | None = None,
    ) -> list[ProfilingResult] | None:
        """Feed the entry's observation and control messages; return the observed results.

        Args:
            store: The job store.
            job_id: The job.
            entry: The journal entry whose inputs to feed.
            prefetched: (version, stored results) already read with the job's state; used if
                that is the version the entry observes.
        """
        results = None
        if entry.observed_version is not None:
            if prefetched is not None and prefetched[0] == entry.observed_version:
                results = store.decode_results(prefetched[1], trusted=True)
            else:
                results = store.results(job_id, entry.observed_version, trusted=True)
            self.scheduler.observe(results)
            self.observed_upto = entry.observed_version
        if entry.controls_upto > self.controls_applied:
            messages = store.controls(job_id, self.controls_applied)
            for message in messages[: entry.controls_upto - self.controls_applied]:
                try:
                    self.scheduler.set_target(message.iteration_time)
                except ConfigError as exc:
                    # Any rank may send a target: one the scheduler refuses must not fail the
                    # job. Refused the same way on every replay, so the journal still decides.
                    if not self.scheduler.replaying:
                        logger.warning(
                            "job %s: target of %g s refused, the job goes on: %s",
                            job_id,
                            message.iteration_time,
                            exc,
                        )
            self.controls_applied = entry.controls_upto
        return results

    def latest_schedules(self, store: JobStore, job_id: str) -> ByRank:
        """Schedules of the newest published version (read from Redis once)."""
        if self.latest is None:
            self.latest = by_rank(store.schedules(job_id, self.version))
        return self.latest

    def catch_up(self, store: JobStore, state: JobState) -> None:
        """Replay the journal entries this scheduler has not seen."""
        job_id = state.record.job_id
        missing = state.journal_length - self.journal_length
        if missing <= 0:
            return
        entries = store.journal(job_id, self.journal_length)[:missing]
        published = [i for i, e in enumerate(entries) if e.published]
        newest = published[-1] if published else -1
        for i, entry in enumerate(entries):
            self.scheduler.replaying = True
            try:
                self.apply_inputs(store, job_id, entry)
                replayed = self.scheduler.next_schedule()
            finally:
                self.scheduler.replaying = False
            self.journal_length += 1
            if not entry.published:
                continue
            self.version = entry.version
            self.latest = None
            if i == newest:
                stored = by_rank(store.schedules(job_id, entry.version))
                if stored and stored != by_rank(replayed):
                    logger.error(
                        "job %s: replaying version %d gave a different schedule; the scheduler "
                        "is not deterministic, later versions may not match what clients ran",
                        job_id,
                        entry.version,
                    )
                self.latest = stored or None

    def maybe_snapshot(self, store: JobStore, job_id: str, every: int) -> bool:
        """Store a snapshot if ``every`` entries passed since the last; delete what it consumed."""
        if not self.snapshots or every <= 0 or self.journal_length - self.snapshot_length < every:
            return False
        state = self.scheduler.snapshot()
        if state is None:
            self.snapshots = False
            return False
        data = msgpack.packb(
            {
                "journal_length": self.journal_length,
                "version": self.version,
                "controls_applied": self.controls_applied,
                "observed_upto": self.observed_upto,
                "state": state,
            },
            use_bin_type=True,
        )
        consumed = range(self.results_floor, self.observed_upto + 1)
        if not store.save_snapshot(job_id, data, self.journal_length, consumed):
            return False
        self.snapshot_length = self.journal_length
        self.results_floor = max(self.results_floor, consumed.stop)
        return True

    def save_artifacts(self, store: JobStore, job_id: str) -> None:
        """Store the scheduler's artifacts when they changed since this worker last saved."""
        artifacts = self.scheduler.artifacts()
        changed = {k: v for k, v in artifacts.items() if self.artifacts_saved.get(k) != v}
        if changed:
            store.save_artifacts(job_id, changed)
            self.artifacts_saved.update(changed)


def identity(record: JobRecord) -> str:
    """What tells a job from an earlier one that had the same id (Redis lost or flushed)."""
    return f"{record.fields.get('entry_id', '')}@{record.fields.get('created_at', '')}"


def rebuild(store: JobStore, state: JobState) -> LiveScheduler:
    """Construct a job's scheduler from Redis: newest snapshot, then the journal after it.

    Raises:
        ProtocolError: The job's snapshot is missing or was written by a scheduler that cannot
            restore it.
    """
    record = state.record
    job_id = record.job_id
    ranks = store.ranks(job_id)
    scheduler = build_scheduler(
        record.config.scheduler, record.info, ranks, record.config.scheduler_args
    )
    live = LiveScheduler(
        identity=identity(record),
        scheduler=scheduler,
        ranks=ranks,
        results_floor=record.number("results_floor", 1),
    )
    if record.number("snapshot_len") > 0:
        _restore(store, job_id, live)
    live.catch_up(store, state)
    return live


def _restore(store: JobStore, job_id: str, live: LiveScheduler) -> None:
    data = store.snapshot(job_id)
    if data is None:
        raise ProtocolError(f"job {job_id}: its info names a snapshot, but none is stored")
    snap: dict[str, Any] = msgpack.unpackb(data, raw=False, strict_map_key=False)
    try:
        live.scheduler.restore(snap["state"])
    except Exception as exc:
        raise ProtocolError(
            f"job {job_id}: scheduler {type(live.scheduler).__name__} cannot restore its "
            f"snapshot ({type(exc).__name__}: {exc}); the results before it are gone"
        ) from exc
    live.journal_length = live.snapshot_length = int(snap["journal_length"])
    live.version = int(snap["version"])
    live.controls_applied = int(snap["controls_applied"])
    live.observed_upto = int(snap["observed_upto"])


class LiveSchedulers:
    """The schedulers one worker process keeps between tasks, least recently used evicted.

    Args:
        capacity: Jobs kept at most.
    """

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._jobs: OrderedDict[str, LiveScheduler] = OrderedDict()
        self.rebuilds = 0  # schedulers built from Redis (tests and benchmarks read this)

    def get(self, store: JobStore, state: JobState) -> LiveScheduler:
        """The job's scheduler, fed every entry of its journal as ``state`` saw it."""
        job_id = state.record.job_id
        live = self._jobs.pop(job_id, None)
        if live is not None and (
            live.identity != identity(state.record)
            or live.journal_length > state.journal_length
            # Another worker snapshotted past this one: the results it lacks may be gone.
            or state.record.number("snapshot_len") > live.journal_length
        ):
            live = None
        if live is None:
            live = rebuild(store, state)
            self.rebuilds += 1
        else:
            live.catch_up(store, state)
        self._jobs[job_id] = live
        while len(self._jobs) > self.capacity:
            self._jobs.popitem(last=False)
        return live

    def drop(self, job_id: str) -> None:
        """Forget a job's scheduler (its state may have taken inputs nobody recorded)."""
        self._jobs.pop(job_id, None)

    def clear(self) -> None:
        """Forget every scheduler (what a worker restart does)."""
        self._jobs.clear()

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._jobs

    def expected_observation(self, job_id: str) -> int | None:
        """The version whose results the job's cached scheduler would observe next, if cached.

        The newest version it published: worth reading with the job's state, in one round trip.
        """
        live = self._jobs.get(job_id)
        return live.version if live is not None and live.version > 0 else None
