"""A job's state in Redis: info, ranks, versioned schedules, results and the replay journal.

Every multi-key update runs as one Lua script or one MULTI, so a crash leaves either the whole
update or none of it; updates are idempotent, so a redelivered stream entry changes nothing
twice. Methods that only write take an optional ``pipeline`` to join a caller's transaction.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import redis
from redis.client import Pipeline

from protocol import keys
from protocol.exceptions import ProtocolError, UnknownJobError
from protocol.models import (
    FrequencySchedule,
    JobConfig,
    JobInfo,
    JournalEntry,
    ProfilingResult,
    RankInfo,
    SetTarget,
    pack,
    unpack,
)

_CREATE_JOB = """
local existing = redis.call('HGET', KEYS[1], 'entry_id')
if existing then return {0, existing} end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
return {1, ARGV[3]}
"""

_ADD_RANK = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1, 0} end
local current = redis.call('HGET', KEYS[2], ARGV[3])
if current and current ~= ARGV[4] then return {-2, 0} end
if not current then redis.call('HSET', KEYS[2], ARGV[3], ARGV[4]) end
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
return {1, redis.call('HLEN', KEYS[2])}
"""

_ADD_RESULT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1, 0, 0} end
if redis.call('HEXISTS', KEYS[2], ARGV[3]) == 0 then return {-3, 0, 0} end
local latest = tonumber(redis.call('GET', KEYS[3]) or '0')
local version = tonumber(ARGV[5])
if version < 1 or version > latest then return {-4, latest, 0} end
local added = redis.call('HSETNX', KEYS[4], ARGV[3], ARGV[4])
redis.call('ZADD', KEYS[5], ARGV[2], ARGV[1])
return {added, latest, redis.call('HLEN', KEYS[4])}
"""

# Compare-and-set on the version number: exactly one writer publishes each version, so no
# version is skipped or published twice even when two workers compute it concurrently.
_PUBLISH = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if current ~= tonumber(ARGV[3]) then return {0, current} end
if ARGV[7] ~= '' and redis.call('LLEN', KEYS[3]) ~= tonumber(ARGV[7]) then
  return {0, current}
end
redis.call('HSET', KEYS[2], unpack(ARGV, 8))
redis.call('SET', KEYS[1], ARGV[4])
redis.call('RPUSH', KEYS[3], ARGV[5])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[6], '*', 'version', ARGV[4])
redis.call('ZADD', KEYS[5], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[6], 'published_at', ARGV[2], 'error', '')
return {1, tonumber(ARGV[4])}
"""

# An observation that produced no new version: appended only if nobody appended meanwhile.
_RECORD = """
if redis.call('LLEN', KEYS[1]) ~= tonumber(ARGV[1]) then return 0 end
redis.call('RPUSH', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[4])
return 1
"""

# Deletes a job's keys, but only if it is still idle: a heartbeat may have come in since the
# sweep listed it. ARGV[2] == '' deletes unconditionally.
_DELETE_JOB = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if ARGV[2] ~= '' and score and tonumber(score) > tonumber(ARGV[2]) then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('DEL', unpack(KEYS, 2))
return 1
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


@dataclass(frozen=True)
class JobRecord:
    """A registered job: its info, how it is served, and bookkeeping fields."""

    info: JobInfo
    config: JobConfig
    fields: dict[str, str]

    @property
    def job_id(self) -> str:
        """The job id."""
        return self.info.job_id

    @property
    def error(self) -> str:
        """The last scheduling error, empty if none."""
        return self.fields.get("error", "")


class JobStore:
    """Read and write jobs in Redis.

    Args:
        conn: A redis-py client (bytes responses, i.e. ``decode_responses=False``).
        stream_maxlen: Approximate cap of the per-job updates stream.
    """

    def __init__(self, conn: redis.Redis, stream_maxlen: int = 10_000) -> None:
        self.conn = conn
        self.stream_maxlen = stream_maxlen
        self._create = conn.register_script(_CREATE_JOB)
        self._add_rank = conn.register_script(_ADD_RANK)
        self._add_result = conn.register_script(_ADD_RESULT)
        self._publish = conn.register_script(_PUBLISH)
        self._record = conn.register_script(_RECORD)
        self._release = conn.register_script(_RELEASE)
        self._delete = conn.register_script(_DELETE_JOB)
        self._renew = conn.register_script(_RENEW)

    # --- jobs ------------------------------------------------------------------------------
    def create_job(
        self, job: JobInfo, config: JobConfig, entry_id: str, now: float | None = None
    ) -> bool:
        """Create ``job`` (its ``job_id`` set) unless it exists; True if created now.

        Raises:
            ProtocolError: A different registration already owns this job id.
        """
        now = time.time() if now is None else now
        fields: dict[str, str] = {
            "job_id": job.job_id,
            "pp_degree": str(job.pp_degree),
            "dp_degree": str(job.dp_degree),
            "tp_degree": str(job.tp_degree),
            "world_size": str(job.world_size),
            "job_metadata": job.job_metadata or "",
            "scheduler": config.scheduler,
            "scheduler_args": json.dumps(config.scheduler_args, sort_keys=True),
            "dump_dir": config.dump_dir,
            "created_at": f"{now:.3f}",
            "entry_id": entry_id,
            "error": "",
        }
        flat = [x for pair in fields.items() for x in pair]
        created, owner = self._create(
            keys=[keys.job_info(job.job_id), keys.JOBS_INDEX],
            args=[job.job_id, now, entry_id, *flat],
        )
        if not created and owner.decode() != entry_id:
            raise ProtocolError(
                f"job id {job.job_id} is already used by registration {owner.decode()}"
            )
        return bool(created)

    def get_job(self, job_id: str) -> JobRecord:
        """Load a job; raise UnknownJobError if it does not exist."""
        raw = self.conn.hgetall(keys.job_info(job_id))
        if not raw:
            raise UnknownJobError(f"unknown job id {job_id!r} (never registered, or expired)")
        fields = {k.decode(): v.decode() for k, v in raw.items()}
        info = JobInfo(
            job_id=fields["job_id"],
            pp_degree=int(fields["pp_degree"]),
            dp_degree=int(fields["dp_degree"]),
            tp_degree=int(fields["tp_degree"]),
            world_size=int(fields["world_size"]),
            job_metadata=fields["job_metadata"] or None,
        )
        config = JobConfig(
            scheduler=fields["scheduler"],
            scheduler_args=json.loads(fields["scheduler_args"]),
            dump_dir=fields["dump_dir"],
        )
        return JobRecord(info=info, config=config, fields=fields)

    def job_error(self, job_id: str) -> str:
        """The job's last scheduling error, empty if none (or if the job does not exist)."""
        raw = self.conn.hget(keys.job_info(job_id), "error")
        return raw.decode() if raw else ""

    def touch(self, job_id: str, now: float) -> bool:
        """Mark the job active (idle-job GC spares it); return whether it still exists.

        Only refreshes a job that exists (``ZADD XX GT``): a deleted job is never revived.
        """
        with self.conn.pipeline(transaction=False) as pipe:
            pipe.zadd(keys.JOBS_INDEX, {job_id: now}, xx=True, gt=True)
            pipe.exists(keys.job_info(job_id))
            _, exists = pipe.execute()
        return bool(exists)

    def set_fields(self, job_id: str, pipeline: Pipeline | None = None, **fields: Any) -> None:
        """Set bookkeeping fields of the job's info hash (e.g. ``error``, ``enqueued_at``)."""
        target = pipeline if pipeline is not None else self.conn
        target.hset(keys.job_info(job_id), mapping={k: str(v) for k, v in fields.items()})

    def fail_job(self, job_id: str, error: str, pipeline: Pipeline | None = None) -> None:
        """Record that the job's scheduler failed, and announce it to the job's ranks.

        One transaction sets the ``error`` field and appends ``error=...`` to the job's updates
        stream, which every rank's watcher follows: training logs it at once.
        """
        pipe = pipeline if pipeline is not None else self.conn.pipeline(transaction=True)
        self.set_fields(job_id, pipeline=pipe, error=error)
        pipe.xadd(
            keys.job_updates(job_id),
            {"error": error},
            maxlen=self.stream_maxlen,
            approximate=True,
        )
        if pipeline is None:
            pipe.execute()

    def list_jobs(self) -> list[tuple[str, float]]:
        """(job id, last activity) of every job, most recent first."""
        rows = self.conn.zrevrange(keys.JOBS_INDEX, 0, -1, withscores=True)
        return [(job_id.decode(), score) for job_id, score in rows]

    def idle_jobs(self, idle_seconds: float, now: float | None = None) -> list[str]:
        """Jobs whose last activity is older than ``idle_seconds``."""
        now = time.time() if now is None else now
        rows = self.conn.zrangebyscore(keys.JOBS_INDEX, "-inf", now - idle_seconds)
        return [job_id.decode() for job_id in rows]

    def delete_job(self, job_id: str, idle_before: float | None = None) -> bool:
        """Delete every key of a job atomically; return whether it was deleted.

        Args:
            job_id: The job.
            idle_before: Delete only if its last activity is not newer than this unix time
                (so a job that a heartbeat refreshed since it was found idle survives).
        """
        latest = self.version(job_id)
        names = [
            keys.job_info(job_id),
            keys.job_ranks(job_id),
            keys.job_version(job_id),
            keys.job_journal(job_id),
            keys.job_updates(job_id),
            keys.job_lease(job_id),
            keys.job_control(job_id),
            keys.job_artifacts(job_id),
        ]
        # Results may exist one version past the latest schedule only if a client misbehaved;
        # they are rejected before being stored, so 1..latest covers everything.
        for version in range(1, latest + 1):
            names += [keys.job_schedule(job_id, version), keys.job_results(job_id, version)]
        cutoff = "" if idle_before is None else repr(float(idle_before))
        return bool(self._delete(keys=[keys.JOBS_INDEX, *names], args=[job_id, cutoff]))

    # --- ranks -----------------------------------------------------------------------------
    def add_rank(self, job: JobInfo, rank: RankInfo, now: float | None = None) -> int:
        """Register ``rank`` with ``job``; return how many ranks are registered.

        Raises:
            UnknownJobError: The job does not exist.
            ProtocolError: The rank does not fit the job, or registered with other info.
        """
        try:
            rank.check_fits(job)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        now = time.time() if now is None else now
        status, count = self._add_rank(
            keys=[keys.job_info(job.job_id), keys.job_ranks(job.job_id), keys.JOBS_INDEX],
            args=[job.job_id, now, rank.rank, pack(rank)],
        )
        if status == -1:
            raise UnknownJobError(f"unknown job id {job.job_id!r}")
        if status == -2:
            raise ProtocolError(
                f"rank {rank.rank} of job {job.job_id} is already registered with other info"
            )
        return int(count)

    def ranks(self, job_id: str) -> list[RankInfo]:
        """Registered ranks, sorted by rank."""
        raw = self.conn.hvals(keys.job_ranks(job_id))
        return sorted((unpack(RankInfo, v) for v in raw), key=lambda r: r.rank)

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
            ProtocolError: Unregistered rank, or a version that was never published.
        """
        now = time.time() if now is None else now
        version = result.schedule_version
        added, latest, count = self._add_result(
            keys=[
                keys.job_info(job.job_id),
                keys.job_ranks(job.job_id),
                keys.job_version(job.job_id),
                keys.job_results(job.job_id, version),
                keys.JOBS_INDEX,
            ],
            args=[job.job_id, now, result.rank, pack(result), version],
        )
        if added == -1:
            raise UnknownJobError(f"unknown job id {job.job_id!r}")
        if added == -3:
            raise ProtocolError(f"rank {result.rank} is not registered with job {job.job_id}")
        if added == -4:
            raise ProtocolError(
                f"result for schedule version {version} of job {job.job_id}, but the latest "
                f"published version is {latest}"
            )
        return bool(added), int(latest), int(count)

    def results(self, job_id: str, version: int) -> list[ProfilingResult]:
        """Results reported for ``version``, sorted by rank."""
        raw = self.conn.hvals(keys.job_results(job_id, version))
        return sorted((unpack(ProfilingResult, v) for v in raw), key=lambda r: r.rank)

    def result_count(self, job_id: str, version: int) -> int:
        """How many ranks reported for ``version``."""
        return int(self.conn.hlen(keys.job_results(job_id, version)))

    # --- control messages ------------------------------------------------------------------
    def add_control(self, message: SetTarget, entry_id: str) -> bool:
        """Append a control message once per source entry; False if it was already there."""
        try:
            self.conn.xadd(keys.job_control(message.job_id), {"data": pack(message)}, id=entry_id)
        except redis.ResponseError as exc:
            # Entry ids only grow, so a redelivered entry's id is "equal or smaller".
            if "equal or smaller" in str(exc):
                return False
            raise
        self.conn.zadd(keys.JOBS_INDEX, {message.job_id: time.time()})
        return True

    def controls(self, job_id: str) -> list[SetTarget]:
        """Control messages of a job, in arrival order."""
        return [
            unpack(SetTarget, fields[b"data"])
            for _, fields in self.conn.xrange(keys.job_control(job_id))
        ]

    # --- schedules -------------------------------------------------------------------------
    def version(self, job_id: str) -> int:
        """Latest published schedule version (0 if none)."""
        raw = self.conn.get(keys.job_version(job_id))
        return int(raw) if raw is not None else 0

    def schedule(self, job_id: str, version: int, rank: int) -> FrequencySchedule | None:
        """One rank's schedule of ``version``, or None if not published."""
        raw = self.conn.hget(keys.job_schedule(job_id, version), str(rank))
        return unpack(FrequencySchedule, raw) if raw is not None else None

    def schedules(self, job_id: str, version: int) -> list[FrequencySchedule]:
        """Every rank's schedule of ``version``, sorted by rank."""
        raw = self.conn.hvals(keys.job_schedule(job_id, version))
        return sorted((unpack(FrequencySchedule, v) for v in raw), key=lambda s: s.rank)

    def journal(self, job_id: str) -> list[JournalEntry]:
        """The replay journal, one entry per published version, in order."""
        return [unpack(JournalEntry, v) for v in self.conn.lrange(keys.job_journal(job_id), 0, -1)]

    def publish(
        self,
        job_id: str,
        schedules: list[FrequencySchedule],
        entry: JournalEntry,
        now: float | None = None,
        journal_length: int | None = None,
    ) -> bool:
        """Publish ``schedules`` as version ``entry.version`` if the latest is the one before.

        Args:
            job_id: The job.
            schedules: One per rank.
            entry: The journal entry of the new version.
            now: Unix time to record (default: now).
            journal_length: Also require the journal to still have this many entries (what
                the caller replayed), so no observation recorded meanwhile is skipped.

        Returns:
            True if this call published it; False if another writer got there first.
        """
        now = time.time() if now is None else now
        flat: list[Any] = []
        for schedule in schedules:
            stamped = schedule.model_copy(update={"version": entry.version})
            flat += [str(schedule.rank), pack(stamped)]
        published, _current = self._publish(
            keys=[
                keys.job_version(job_id),
                keys.job_schedule(job_id, entry.version),
                keys.job_journal(job_id),
                keys.job_updates(job_id),
                keys.JOBS_INDEX,
                keys.job_info(job_id),
            ],
            args=[
                job_id,
                now,
                entry.version - 1,
                entry.version,
                pack(entry),
                self.stream_maxlen,
                "" if journal_length is None else journal_length,
                *flat,
            ],
        )
        return bool(published)

    def save_artifacts(self, job_id: str, artifacts: dict[str, bytes]) -> None:
        """Store what a scheduler produced (same content on every replay, so idempotent)."""
        if artifacts:
            self.conn.hset(keys.job_artifacts(job_id), mapping=artifacts)

    def artifacts(self, job_id: str) -> dict[str, bytes]:
        """Every artifact of a job, by name."""
        raw = self.conn.hgetall(keys.job_artifacts(job_id))
        return {name.decode(): value for name, value in raw.items()}

    def record_unpublished(
        self, job_id: str, entry: JournalEntry, journal_length: int, now: float | None = None
    ) -> bool:
        """Append an unpublished journal entry if the journal still has ``journal_length``."""
        now = time.time() if now is None else now
        return bool(
            self._record(
                keys=[keys.job_journal(job_id), keys.JOBS_INDEX],
                args=[journal_length, pack(entry), now, job_id],
            )
        )

    # --- worker lease ----------------------------------------------------------------------
    def acquire_lease(self, job_id: str, token: str, ttl_ms: int) -> bool:
        """Try to become the one worker advancing ``job_id`` for ``ttl_ms``."""
        return bool(self.conn.set(keys.job_lease(job_id), token, nx=True, px=ttl_ms))

    def renew_lease(self, job_id: str, token: str, ttl_ms: int) -> bool:
        """Extend a held lease; False if it was lost."""
        return bool(self._renew(keys=[keys.job_lease(job_id)], args=[token, ttl_ms]))

    def release_lease(self, job_id: str, token: str) -> None:
        """Release the lease if still held by ``token``."""
        self._release(keys=[keys.job_lease(job_id)], args=[token])

    def lease_holder(self, job_id: str) -> str | None:
        """Token of the current lease holder, if any."""
        raw = self.conn.get(keys.job_lease(job_id))
        return raw.decode() if raw is not None else None

    # --- what is due -----------------------------------------------------------------------
    def due(self, record: JobRecord) -> bool:
        """Whether the job needs its next schedule version computed."""
        job_id = record.job_id
        if self.rank_count(job_id) < record.info.world_size:
            return False
        latest = self.version(job_id)
        if latest == 0:
            return True
        journal_tail = self.conn.lindex(keys.job_journal(job_id), -1)
        tail = unpack(JournalEntry, journal_tail) if journal_tail else None
        observed = tail is not None and tail.observed_version == latest
        if not observed and self.result_count(job_id, latest) >= record.info.world_size:
            return True
        applied = tail.controls_upto if tail is not None else 0
        return int(self.conn.xlen(keys.job_control(job_id))) > applied
