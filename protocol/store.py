"""A job's state in Redis: info, ranks, versioned schedules, results and the replay journal.

Every multi-key update runs as one Lua script (:mod:`protocol.store_scripts`) or one MULTI,
so a crash leaves either the whole update or none of it; updates are idempotent, so a
redelivered stream entry changes nothing twice. Writes whose outcome matters can be queued on
a :class:`StoreBatch` (one round trip for many); other writes take an optional ``pipeline``.

Only the newest schedule versions are kept (clients fetch the latest), and a scheduler
snapshot lets the results it has consumed be deleted; per-version summaries of them remain.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Collection, Iterable
from typing import Any

import msgpack
import redis
from redis.client import Pipeline

from protocol import keys
from protocol.codec import unpack
from protocol.exceptions import ProtocolError, WrongTokenError
from protocol.job_record import JobRecord, JobState, stored_result, unknown_job, wrong_type
from protocol.models import (
    JobConfig,
    JobInfo,
    JournalEntry,
    LoggedTarget,
    ProfilingResult,
    RankInfo,
    SetTarget,
)
from protocol.rank_functions import HEARTBEAT_FUNCTION, RankScript
from protocol.server_clock import ServerClock
from protocol.store_batch import single
from protocol.store_scripts import FAIL_JOB, HEARTBEAT, HSET_IF_JOB, Scripts
from protocol.store_worker import WorkerStore
from protocol.tokens import alive_proof, credentials, new_token, proof_marks, result_key

logger = logging.getLogger(__name__)

KEEP_SCHEDULES = 4
"""Schedule versions kept per job: the latest and a few before it, for slow readers."""


class JobStore(WorkerStore):
    """Read and write jobs in Redis.

    Args:
        conn: A redis-py client (bytes responses, i.e. ``decode_responses=False``).
        stream_maxlen: Approximate cap of the per-job updates stream.
        keep_schedules: Schedule versions kept per job (older ones are deleted on publish).
    """

    def __init__(
        self, conn: redis.Redis, stream_maxlen: int = 10_000, keep_schedules: int = KEEP_SCHEDULES
    ) -> None:
        if keep_schedules < 2:
            raise ValueError(f"keep_schedules must be >= 2, got {keep_schedules}")
        self.conn = conn
        self.stream_maxlen = stream_maxlen
        self.keep_schedules = keep_schedules
        self.results_decoded = 0  # results decoded by this store: tests check advancing cost
        self.scripts = Scripts(conn)
        self._heartbeat = RankScript(conn, HEARTBEAT_FUNCTION, HEARTBEAT)  # run by ranks
        self.clock = ServerClock.of(conn)  # activity stamps: the server's clock, like heartbeats

    # --- jobs ------------------------------------------------------------------------------
    def create_job(
        self, job: JobInfo, config: JobConfig, entry_id: str, now: float | None = None
    ) -> bool:
        """Create ``job`` (its ``job_id`` set) unless it exists; True if created now.

        Raises:
            ProtocolError: A different registration already owns this job id.
        """
        batch = self.batch()
        batch.create_job(job, config, entry_id, self.clock.now() if now is None else now)
        return bool(single(batch))

    def get_job(self, job_id: str) -> JobRecord:
        """Load a job; raise UnknownJobError if it does not exist."""
        raw = self.conn.hgetall(keys.job_info(job_id))
        if not raw:
            raise unknown_job(job_id)
        return JobRecord.from_hash(raw)

    def get_jobs(
        self, job_ids: Iterable[str], problems: dict[str, str] | None = None
    ) -> dict[str, JobRecord | None]:
        """Load several jobs in one round trip (None for those that do not exist).

        Args:
            job_ids: The jobs.
            problems: Where to put, instead of raising, why a job's record is unreadable
                (keys someone else overwrote: on Redis 6.2 ranks may); its value is None.
        """
        ids = list(dict.fromkeys(job_ids))
        if not ids:
            return {}
        with self.conn.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hgetall(keys.job_info(job_id))
            raws = pipe.execute(raise_on_error=problems is None)
        records: dict[str, JobRecord | None] = {}
        for job_id, raw in zip(ids, raws, strict=True):
            try:
                if isinstance(raw, Exception):
                    raise ProtocolError(f"job info of {job_id!r}: {raw}")
                records[job_id] = JobRecord.from_hash(raw) if raw else None
            except ProtocolError as exc:
                if problems is None:
                    raise
                problems[job_id], records[job_id] = str(exc), None
        return records

    def job_state(
        self,
        job_id: str,
        lease: tuple[str, int] | None = None,
        prefetch: int | None = None,
    ) -> JobState:
        """Info, rank count, version, journal and control lengths, consistent (one MULTI).

        Args:
            job_id: The job.
            lease: (token, ttl_ms): also try to take the job's lease in the same round trip;
                :attr:`JobState.leased` tells whether it was taken.
            prefetch: Also read the stored results of this version (the one a caller
                expects to observe next) into :attr:`JobState.prefetched`: the round trip
                that :meth:`results` would take afterwards.

        Raises:
            UnknownJobError: The job does not exist.
        """
        with self.conn.pipeline(transaction=True) as pipe:
            count = self.queue_job_state(pipe, job_id, lease, prefetch)
            replies = pipe.execute()
        return self.read_job_state(replies[-count:], job_id, lease, prefetch)

    @staticmethod
    def queue_job_state(
        pipe: Pipeline,
        job_id: str,
        lease: tuple[str, int] | None = None,
        prefetch: int | None = None,
    ) -> int:
        """Queue :meth:`job_state`'s commands on a caller's transaction; return how many.

        The caller hands their replies (the transaction's last that many) to
        :meth:`read_job_state`.
        """
        if prefetch is not None:
            pipe.hvals(keys.job_results(job_id, prefetch))
        if lease is not None:
            pipe.set(keys.job_lease(job_id), lease[0], nx=True, px=lease[1])
            # The holder too: a transaction that redis-py sent again after a lost reply finds
            # the lease its first run took, which is still this caller's.
            pipe.get(keys.job_lease(job_id))
        pipe.hgetall(keys.job_info(job_id))
        pipe.hlen(keys.job_ranks(job_id))
        pipe.get(keys.job_version(job_id))
        pipe.llen(keys.job_journal(job_id))
        pipe.lindex(keys.job_journal(job_id), -1)
        pipe.xlen(keys.job_control(job_id))
        return 6 + 2 * (lease is not None) + (prefetch is not None)

    @staticmethod
    def read_job_state(
        replies: list[Any],
        job_id: str,
        lease: tuple[str, int] | None = None,
        prefetch: int | None = None,
    ) -> JobState:
        """The :class:`JobState` in the replies of :meth:`queue_job_state`'s commands.

        Raises:
            UnknownJobError: The job does not exist.
            redis.RedisError: A reply is an error (a caller's transaction that does not
                raise on errors hands them over as they are).
        """
        replies = list(replies)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        prefetched = (prefetch, replies.pop(0)) if prefetch is not None else None
        leased = False
        if lease is not None:
            taken, holder = replies.pop(0), replies.pop(0)
            leased = bool(taken) or holder == lease[0].encode()
        raw, ranks, version, journal, tail, control = replies
        if not raw:
            raise unknown_job(job_id)
        return JobState(
            record=JobRecord.from_hash(raw),
            rank_count=int(ranks),
            version=int(version or 0),
            journal_length=int(journal),
            control_length=int(control),
            tail=unpack(JournalEntry, tail) if tail is not None else None,
            leased=leased,
            prefetched=prefetched,
        )

    def job_fields(self, job_id: str, *names: str) -> dict[str, str]:
        """Some fields of the job's info hash ('' for those absent)."""
        raw = self.conn.hmget(keys.job_info(job_id), list(names))
        return {n: v.decode() if v is not None else "" for n, v in zip(names, raw, strict=True)}

    def job_error(self, job_id: str) -> str:
        """The job's last scheduling error, empty if none (or if the job does not exist)."""
        raw = self.conn.hget(keys.job_info(job_id), "error")
        return raw.decode() if raw else ""

    def touch(self, job_id: str, rank: int, token: str) -> bool:
        """Mark the job and ``rank`` active at the server's time; return whether it exists.

        Only refreshes a job that exists (``ZADD XX GT``): a deleted job is never revived.

        Raises:
            WrongTokenError: ``token`` is not the one ``rank`` got when it registered
                (nothing is refreshed).
        """
        proof = alive_proof(result_key(token))
        args = [job_id, rank, token, proof, keys.job_info(job_id), keys.job_beatcheck(job_id)]
        names = [keys.JOBS_INDEX, keys.job_alive(job_id)]
        status = int(self._heartbeat(keys=names, args=args))
        if status == -1:
            raise WrongTokenError(f"wrong token for rank {rank} of job {job_id}: heartbeat refused")
        return status == 1

    def ranks_heard(self, job_id: str) -> dict[int, float]:
        """Rank -> server time of its last heartbeat (ranks never heard from are absent).

        Only heartbeats that carry the rank's proof count: the alive set is writable by every
        rank (ACL patterns cannot tell jobs apart), so an entry another rank wrote is ignored.
        """
        marks = proof_marks(self.conn.hgetall(keys.job_tokens(job_id)))
        if not marks:
            return {}
        ranks = sorted(marks)
        try:
            at = self.conn.zmscore(keys.job_alive(job_id), [marks[r] for r in ranks])
        except redis.ResponseError as exc:  # WRONGTYPE: a rank replaced the set
            logger.warning("job %s: its alive set is unreadable (%s); no rank counts", job_id, exc)
            return {}
        return {rank: float(t) for rank, t in zip(ranks, at, strict=True) if t is not None}

    def verified_activity(self, job_id: str) -> float | None:
        """Server time of the job's last activity that no rank can set back (None: no job).

        The jobs index, by which the sweep finds idle jobs, is writable by every rank: before
        deleting a job as idle the sweep asks this instead. It is the newest of the stamps
        only services write (``created_at``, ``active_at``, ``published_at`` of the job info)
        and of the heartbeats that carry their rank's proof (:meth:`ranks_heard`).
        """
        names = ("created_at", "active_at", "published_at")
        try:
            stamps = self.conn.hmget(keys.job_info(job_id), list(names))
        except redis.ResponseError as exc:
            if not wrong_type(exc):
                raise
            return None  # Replaced by something else (see wrong_type): no job left to keep.
        if stamps[0] is None:  # every job has its creation time
            return None
        times = [float(t) for t in stamps if t]
        try:
            times += self.ranks_heard(job_id).values()
        except redis.ResponseError as exc:  # heartbeats replaced by something else: no proof
            if not wrong_type(exc):
                raise
        return max(times, default=0.0)

    def server_time(self) -> float:
        """The Redis server's clock, in seconds (the one clock heartbeats are timed by).

        Asks the server (one round trip) and resynchronizes :attr:`clock` with it.
        """
        return self.clock.sync()

    def set_fields(self, job_id: str, pipeline: Pipeline | None = None, **fields: Any) -> None:
        """Set bookkeeping fields of the job's info hash (e.g. ``enqueued_at``), if it exists.

        A job deleted meanwhile stays deleted: a bare write would leave an info hash without
        the job's degrees behind.
        """
        target = pipeline if pipeline is not None else self.conn
        flat = [x for name, value in fields.items() for x in (name, str(value))]
        info = keys.job_info(job_id)
        target.eval(HSET_IF_JOB, 2, info, info, *flat)

    def fail_job(self, job_id: str, error: str, pipeline: Pipeline | None = None) -> None:
        """Record that the job's scheduler failed, and announce it to the job's ranks.

        One script sets the ``error`` field and appends ``error=...`` to the job's updates
        stream, which every rank's watcher follows: training logs it at once. A job deleted
        meanwhile is left alone.
        """
        target = pipeline if pipeline is not None else self.conn
        names = (keys.job_info(job_id), keys.job_updates(job_id))
        target.eval(FAIL_JOB, 2, *names, error, self.stream_maxlen)

    def list_jobs(self) -> list[tuple[str, float]]:
        """(job id, last activity) of every job, most recent first."""
        rows = self.conn.zrevrange(keys.JOBS_INDEX, 0, -1, withscores=True)
        return [(job_id.decode(), score) for job_id, score in rows]

    def idle_jobs(
        self, idle_seconds: float, now: float | None = None, limit: int | None = None
    ) -> list[str]:
        """Jobs whose last activity is older than ``idle_seconds`` (the ``limit`` oldest).

        ``now`` defaults to the Redis server's clock (activity is stamped by it).
        """
        now = self.clock.now() if now is None else now
        page = {} if limit is None else {"start": 0, "num": limit}
        rows = self.conn.zrangebyscore(keys.JOBS_INDEX, "-inf", now - idle_seconds, **page)
        return [job_id.decode() for job_id in rows]

    # --- ranks -----------------------------------------------------------------------------
    def add_rank(
        self,
        job: JobInfo,
        rank: RankInfo,
        now: float | None = None,
        token: str | None = None,
        request_id: str | None = None,
    ) -> int:
        """Register ``rank`` with ``job``; return how many ranks are registered.

        Args:
            job: The job.
            rank: The rank.
            now: Unix time of the activity (default: now).
            token: The rank's token (default: a new one nobody knows; the coordinator passes
                the one its reply carries).
            request_id: The registration request (default: a new one).

        Raises:
            UnknownJobError: The job does not exist.
            ProtocolError: The rank does not fit the job, or is already registered.
        """
        batch = self.batch()
        batch.add_rank(
            job,
            rank,
            self.clock.now() if now is None else now,
            credentials(token if token is not None else new_token()),
            request_id if request_id is not None else uuid.uuid4().hex,
        )
        return int(single(batch))

    def result_keys(
        self, wanted: Iterable[tuple[str, int]], cached: Collection[str] = ()
    ) -> dict[tuple[str, int], str | None]:
        """The results' HMAC keys of (job, rank) pairs, in one round trip.

        Every registered rank of each job named comes back too, so that a cache holds a job's
        keys after its first batch; but of the jobs in ``cached`` (whose keys the caller
        holds), only the ranks named: reading them all again for a rank not registered cost
        55 ms a batch at 50,000 ranks. '' for a rank not registered, None for a job that does
        not exist.
        """
        pairs = list(dict.fromkeys(wanted))
        if not pairs:
            return {}
        jobs = list(dict.fromkeys(job_id for job_id, _ in pairs))
        named: dict[str, list[int]] = {job_id: [] for job_id in jobs}
        for job_id, rank in pairs:
            named[job_id].append(rank)
        with self.conn.pipeline(transaction=False) as pipe:
            for job_id in jobs:
                pipe.exists(keys.job_info(job_id))
                if job_id in cached:
                    pipe.hmget(keys.job_tokens(job_id), named[job_id])
                else:
                    pipe.hgetall(keys.job_tokens(job_id))
            replies = pipe.execute()
        exists = dict(zip(jobs, replies[::2], strict=True))
        out: dict[tuple[str, int], str | None] = {}
        for job_id, tokens in zip(jobs, replies[1::2], strict=True):
            if isinstance(tokens, list):  # HMGET of the ranks named
                tokens = {r: t for r, t in zip(named[job_id], tokens, strict=True) if t}
            for rank, raw in tokens.items():
                out[(job_id, int(rank))] = raw[:64].decode()
        for job_id, rank in pairs:
            if (job_id, rank) not in out:
                out[(job_id, rank)] = "" if exists[job_id] else None
        return out

    def ranks(self, job_id: str) -> list[RankInfo]:
        """Registered ranks, sorted by rank.

        Read with HSCAN, about a thousand a command: one HVALS of 100,000 ranks held Redis for
        50-96 ms (a job of a few hundred comes in one reply all the same).
        """
        found = dict(self.conn.hscan_iter(keys.job_ranks(job_id), count=1000))  # once each
        return sorted((unpack(RankInfo, v) for v in found.values()), key=lambda r: r.rank)

    def rank_count(self, job_id: str) -> int:
        """How many ranks are registered."""
        return int(self.conn.hlen(keys.job_ranks(job_id)))

    # --- results ---------------------------------------------------------------------------
    def add_result(
        self, job: JobInfo, result: ProfilingResult, now: float | None = None
    ) -> tuple[bool, int, int]:
        """Store a rank's result; return (newly added, latest version, results for its version).

        Raises:
            UnknownJobError: The job does not exist.
            ProtocolError: Rank out of range or unregistered, a version never published, or
                one whose results the scheduler already consumed (deleted after a snapshot).
        """
        batch = self.batch()
        batch.add_result(job, result, self.clock.now() if now is None else now)
        added, latest, count = single(batch)
        return bool(added), int(latest), int(count)

    def results(self, job_id: str, version: int, trusted: bool = False) -> list[ProfilingResult]:
        """Results reported for ``version``, sorted by rank.

        Args:
            job_id: The job.
            version: The schedule version they were measured under.
            trusted: Skip re-validation (the coordinator validated them before storing).
        """
        return self.decode_results(self.conn.hvals(keys.job_results(job_id, version)), trusted)

    def decode_results(self, raw: list[bytes], trusted: bool = False) -> list[ProfilingResult]:
        """Decode stored results (as HVALS of a results hash returns them), sorted by rank."""
        self.results_decoded += len(raw)
        decoded = [stored_result(v, trusted) for v in raw]
        return sorted(decoded, key=lambda r: r.rank)

    def reported_ranks(self, job_id: str, version: int) -> list[int]:
        """The ranks whose results for ``version`` are stored, in order."""
        return sorted(int(r) for r in self.conn.hkeys(keys.job_results(job_id, version)))

    def result_count(self, job_id: str, version: int) -> int:
        """How many ranks reported for ``version``."""
        return int(self.conn.hlen(keys.job_results(job_id, version)))

    def summaries(self, job_id: str) -> dict[int, dict[str, Any]]:
        """Per-version summaries of the observed results (kept after results expire)."""
        raw = self.conn.hgetall(keys.job_summaries(job_id))
        return {int(v): msgpack.unpackb(s, raw=False) for v, s in sorted(raw.items())}

    # --- control messages ------------------------------------------------------------------
    def add_control(self, message: SetTarget, entry_id: str) -> bool:
        """Append a control message once per source entry; False if it was already there.

        Raises:
            UnknownJobError: The job does not exist.
            ProtocolError: A newer control message of the job was applied already.
        """
        batch = self.batch()
        batch.add_control(message, entry_id, self.clock.now())
        return bool(single(batch))

    def controls(self, job_id: str, start: int = 0) -> list[SetTarget]:
        """Control messages of a job from the ``start``-th on, in arrival order.

        Read with the checks they passed when appended (see :class:`LoggedTarget`).
        """
        entries = self.conn.xrange(keys.job_control(job_id))
        return [unpack(LoggedTarget, fields[b"data"]) for _, fields in entries[start:]]
