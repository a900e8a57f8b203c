"""The job store's versions side: schedules, journal, snapshots, lease, what is due, deletion.

A mixin of :class:`protocol.store.JobStore` (which sets the attributes declared here), kept in
its own module so that each stays readable; callers use ``JobStore``.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import msgpack
import redis

from protocol import keys
from protocol.codec import pack, unpack
from protocol.exceptions import ProtocolError
from protocol.job_record import JobRecord, parse_version, unknown_job, wrong_type
from protocol.models import FrequencySchedule, JournalEntry
from protocol.server_clock import ServerClock
from protocol.store_batch import StoreBatch
from protocol.store_scripts import HSET_IF_JOB, Scripts

INLINE_SCHEDULES = 1000
"""Most ranks whose schedules go to the publish script as its arguments; a wider version's are
written to a draft first, :data:`DRAFT_CHUNK` ranks a command, so that Redis serves other
clients between them (100,000 ranks in one script call blocked it for 316 ms)."""
DRAFT_CHUNK = 1000
DRAFT_TTL_MS = 60_000  # a draft whose worker died before its script expires


logger = logging.getLogger(__name__)


def _glob_escape(text: str) -> str:
    """``text`` for a SCAN ``MATCH`` pattern that matches it literally (glob characters escaped)."""
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


class WorkerStore:
    """Schedules, journal, snapshots, lease and due set of jobs (see :class:`JobStore`)."""

    conn: redis.Redis
    scripts: Scripts
    clock: ServerClock
    stream_maxlen: int
    keep_schedules: int

    def batch(self) -> StoreBatch:
        """A batch of writes sent in one round trip."""
        return StoreBatch(self.scripts)

    # --- deletion --------------------------------------------------------------------------
    def delete_job(self, job_id: str, idle_before: float | None = None) -> bool:
        """Delete every key of a job atomically; return whether it was deleted.

        The same script takes it out of the jobs, due, finished and starting indexes.

        Args:
            job_id: The job.
            idle_before: Delete only if its last activity is not newer than this server time
                (so a job that a heartbeat refreshed since it was found idle survives).
        """
        while True:
            try:
                raw = self.conn.get(keys.job_version(job_id))
            except redis.ResponseError as exc:
                if not wrong_type(exc):
                    raise
                raw = b"?"  # Not a string (see DELETE_JOB).
            names = [
                keys.job_version(job_id),
                keys.job_info(job_id),
                keys.job_ranks(job_id),
                keys.job_journal(job_id),
                keys.job_updates(job_id),
                keys.job_lease(job_id),
                keys.job_control(job_id),
                keys.job_artifacts(job_id),
                keys.job_summaries(job_id),
                keys.job_snapshot(job_id),
                keys.job_alive(job_id),
                keys.job_finished(job_id),
                keys.job_tokens(job_id),
                keys.job_beatcheck(job_id),
            ]
            try:
                # Results are rejected before being stored unless their version is published,
                # so 1..latest covers them all.
                latest = parse_version(job_id, raw)
                for version in range(1, latest + 1):
                    names += [keys.job_schedule(job_id, version), keys.job_results(job_id, version)]
            except ProtocolError:
                names += self._versioned_keys(job_id)  # the version says nothing: look for them
            cutoff = "" if idle_before is None else repr(float(idle_before))
            deleted = self.scripts.delete_job(
                keys=[
                    keys.JOBS_INDEX,
                    keys.DUE_JOBS,
                    keys.FINISHED_JOBS,
                    keys.STARTING_JOBS,
                    *names,
                ],
                args=[job_id, cutoff, b"0" if raw is None else raw],
            )
            if int(deleted) >= 0:  # -1: a version was published meanwhile; its keys too
                return bool(deleted)

    def _versioned_keys(self, job_id: str) -> list[str]:
        """The job's schedule and results keys, found by SCAN (its version key is garbage)."""
        found = []
        for part in ("schedule", "results"):
            prefix = keys.job_key(job_id, part, "")
            pattern = _glob_escape(prefix) + "*"
            for key in self.conn.scan_iter(match=pattern, count=1000):
                name = key.decode(errors="replace")
                if name[len(prefix) :].isdigit():  # not another job's "<id>:schedule:..." key
                    found.append(name)
        return found

    # --- schedules -------------------------------------------------------------------------
    def version(self, job_id: str) -> int:
        """Latest published schedule version (0 if none)."""
        return parse_version(job_id, self.conn.get(keys.job_version(job_id)))

    def schedule(self, job_id: str, version: int, rank: int) -> FrequencySchedule | None:
        """One rank's schedule of ``version``, or None if not published (or no longer kept)."""
        raw = self.conn.hget(keys.job_schedule(job_id, version), str(rank))
        return unpack(FrequencySchedule, raw) if raw is not None else None

    def schedules(self, job_id: str, version: int) -> list[FrequencySchedule]:
        """Every rank's schedule of ``version``, sorted by rank (empty if not kept)."""
        raw = self.conn.hvals(keys.job_schedule(job_id, version))
        return sorted((unpack(FrequencySchedule, v) for v in raw), key=lambda s: s.rank)

    def journal(self, job_id: str, start: int = 0) -> list[JournalEntry]:
        """The replay journal from its ``start``-th entry on, in order."""
        raw = self.conn.lrange(keys.job_journal(job_id), start, -1)
        return [unpack(JournalEntry, v) for v in raw]

    def publish(
        self,
        job_id: str,
        schedules: list[FrequencySchedule],
        entry: JournalEntry,
        now: float | None = None,
        journal_length: int | None = None,
        summary: bytes | None = None,
    ) -> bool:
        """Publish ``schedules`` as version ``entry.version`` if the latest is the one before.

        Args:
            job_id: The job.
            schedules: One per rank.
            entry: The journal entry of the new version.
            now: Unix time to record (default: now).
            journal_length: Also require the journal to still have this many entries (what
                the caller replayed), so no observation recorded meanwhile is skipped.
            summary: Summary of the results the entry observed (kept after they expire).

        Returns:
            True if this call published it; False if another writer got there first.

        Raises:
            UnknownJobError: The job is gone (deleted while its version was computed).
        """
        now = self.clock.now() if now is None else now
        flat: list[Any] = []
        for schedule in schedules:
            # Validated fields are plain data: packed as the model would be, without a copy.
            stamped = dict(schedule.__dict__, version=entry.version)
            flat += [str(schedule.rank), msgpack.packb(stamped, use_bin_type=True)]
        old = entry.version - self.keep_schedules
        names = [
            keys.job_version(job_id),
            keys.job_schedule(job_id, entry.version),
            keys.job_journal(job_id),
            keys.job_updates(job_id),
            keys.JOBS_INDEX,
            keys.job_info(job_id),
            keys.job_summaries(job_id),
            keys.job_schedule(job_id, max(old, 0)),
        ]
        args = [
            job_id,
            now,
            entry.version - 1,
            entry.version,
            pack(entry),
            self.stream_maxlen,
            "" if journal_length is None else journal_length,
            *_summary_args(entry, summary),
            "1" if old >= 1 else "0",
        ]
        if len(schedules) <= INLINE_SCHEDULES:
            status, _current = self.scripts.publish(keys=names, args=[*args, *flat])
        else:
            status = self._publish_drafted(job_id, entry.version, names, args, flat)
        if status == -1:
            raise unknown_job(job_id)
        return status == 1

    def _publish_drafted(
        self, job_id: str, version: int, names: list[str], args: list[Any], flat: list[Any]
    ) -> int:
        """Write a wide version's schedules to a draft in chunks, then publish it (one pipeline).

        Returns the publish script's status; -2 (its draft expired before the script ran) is
        logged and publishes nothing, like a version another worker published first.
        """
        draft = keys.job_schedule_draft(job_id, version, uuid.uuid4().hex)
        with self.conn.pipeline(transaction=False) as pipe:
            step = 2 * DRAFT_CHUNK
            for i in range(0, len(flat), step):
                pipe.execute_command("HSET", draft, *flat[i : i + step])
                pipe.pexpire(draft, DRAFT_TTL_MS)
            self.scripts.publish(keys=[*names, draft], args=args, client=pipe)
            status, _current = pipe.execute()[-1]
        if status == -2:
            logger.warning(
                "job %s: the draft of version %d expired before it was published", job_id, version
            )
        return int(status)

    def record_unpublished(
        self,
        job_id: str,
        entry: JournalEntry,
        journal_length: int,
        now: float | None = None,
        summary: bytes | None = None,
    ) -> bool:
        """Append an unpublished journal entry if the journal still has ``journal_length``.

        Raises:
            UnknownJobError: The job is gone.
        """
        now = self.clock.now() if now is None else now
        appended = self.scripts.record(
            keys=[
                keys.job_journal(job_id),
                keys.JOBS_INDEX,
                keys.job_summaries(job_id),
                keys.job_info(job_id),
                keys.job_updates(job_id),
            ],
            args=[
                journal_length,
                pack(entry),
                now,
                job_id,
                *_summary_args(entry, summary),
                self.stream_maxlen,
            ],
        )
        if appended == -1:
            raise unknown_job(job_id)
        return bool(appended)

    def save_artifacts(self, job_id: str, artifacts: dict[str, bytes]) -> None:
        """Store what a scheduler produced (same content on every replay, so idempotent)."""
        if artifacts:
            flat = [x for item in artifacts.items() for x in item]
            self.conn.eval(HSET_IF_JOB, 2, keys.job_info(job_id), keys.job_artifacts(job_id), *flat)

    def artifacts(self, job_id: str) -> dict[str, bytes]:
        """Every artifact of a job, by name."""
        raw = self.conn.hgetall(keys.job_artifacts(job_id))
        return {name.decode(): value for name, value in raw.items()}

    # --- scheduler snapshots ---------------------------------------------------------------
    def save_snapshot(self, job_id: str, data: bytes, journal_length: int, consumed: range) -> bool:
        """Store a snapshot taken after ``journal_length`` entries; delete consumed results.

        Args:
            job_id: The job.
            data: The msgpack snapshot.
            journal_length: Journal entries it covers (stored only if the journal has exactly
                these, and no snapshot covers more).
            consumed: Versions whose results the snapshot consumed: deleted, and refused from
                now on.

        Returns:
            True if stored.
        """
        doomed = [keys.job_results(job_id, v) for v in consumed]
        return bool(
            self.scripts.snapshot(
                keys=[
                    keys.job_snapshot(job_id),
                    keys.job_journal(job_id),
                    keys.job_info(job_id),
                    *doomed,
                ],
                args=[journal_length, data, consumed.stop],
            )
        )

    def snapshot(self, job_id: str) -> bytes | None:
        """The latest stored snapshot, if any."""
        raw = self.conn.get(keys.job_snapshot(job_id))
        return bytes(raw) if raw is not None else None

    # --- worker lease ----------------------------------------------------------------------
    def renew_lease(self, job_id: str, token: str, ttl_ms: int) -> bool:
        """Extend a held lease; False if it was lost."""
        return bool(self.scripts.renew(keys=[keys.job_lease(job_id)], args=[token, ttl_ms]))

    def release_lease(self, job_id: str, token: str) -> None:
        """Release the lease if still held by ``token``."""
        self.scripts.release(keys=[keys.job_lease(job_id)], args=[token])

    def release_and_settle(self, job_id: str, token: str) -> bool:
        """:meth:`release_lease` and :meth:`settle` in one round trip; return whether due."""
        batch = self.batch()
        batch.call(self.scripts.release, [keys.job_lease(job_id)], [token])
        batch.call(self.scripts.due, self._due_keys(job_id), [job_id, "settle", self.clock.now()])
        _released, due = batch.execute()
        return bool(due == 1)

    def lease_holder(self, job_id: str) -> str | None:
        """Token of the current lease holder, if any."""
        raw = self.conn.get(keys.job_lease(job_id))
        return raw.decode() if raw is not None else None

    # --- what is due -----------------------------------------------------------------------
    def _due_keys(self, job_id: str) -> list[str]:
        return [
            keys.job_info(job_id),
            keys.job_ranks(job_id),
            keys.job_version(job_id),
            keys.job_journal(job_id),
            keys.job_control(job_id),
            keys.DUE_JOBS,
            keys.FINISHED_JOBS,
        ]

    def _due_call(self, job_id: str, mode: str) -> int:
        return int(
            self.scripts.due(keys=self._due_keys(job_id), args=[job_id, mode, self.clock.now()])
        )

    def due(self, job: JobRecord | str) -> bool:
        """Whether the job needs its next schedule version computed (one round trip)."""
        return self._due_call(job if isinstance(job, str) else job.job_id, "") == 1

    def settle(self, job_id: str) -> bool:
        """Like :meth:`due`, and a job with nothing due leaves the due set (atomically)."""
        return self._due_call(job_id, "settle") == 1

    def mark_due(self, job_ids: list[str]) -> list[str]:
        """Put those of ``job_ids`` with work due into the due set (one round trip); return them.

        Reconciles the due set with the jobs themselves, e.g. after Redis lost the write that
        had put a job there.
        """
        batch = self.batch()
        now = self.clock.now()
        for job_id in job_ids:
            batch.call(self.scripts.due, self._due_keys(job_id), [job_id, "mark", now])
        return [j for j, due in zip(job_ids, batch.execute(), strict=True) if due == 1]

    def jobs_page(self, start: int, count: int) -> list[str]:
        """Jobs ``start`` to ``start + count - 1`` of the jobs index (for a sweep in pages)."""
        return [j.decode() for j in self.conn.zrange(keys.JOBS_INDEX, start, start + count - 1)]

    def forget_due(self, job_id: str) -> None:
        """Take a job out of the due set (its next input puts it back)."""
        self.conn.zrem(keys.DUE_JOBS, job_id)

    def due_jobs(self, limit: int = 1000) -> list[str]:
        """Jobs that may have work due, longest waiting first (the sweep's worklist)."""
        return [j.decode() for j in self.conn.zrange(keys.DUE_JOBS, 0, limit - 1)]


def _summary_args(entry: JournalEntry, summary: bytes | None) -> list[Any]:
    if summary is None or entry.observed_version is None:
        return ["", b""]
    return [str(entry.observed_version), summary]
