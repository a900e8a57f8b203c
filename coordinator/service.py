"""The coordinator: consumes the input streams, keeps job state, enqueues scheduler work.

It reads registrations, profiling results and control messages through one consumer group,
so several coordinators can share the load and a restarted one claims what a dead one left
pending. Each entry is validated, applied to Redis idempotently, answered (registrations get a
reply) and acknowledged; an entry that cannot be processed goes to the dead-letter stream with
the reason and every original field, and the loop goes on. Redis errors are not acknowledged:
the entry is retried. A periodic sweep re-enqueues stalled work and deletes idle jobs.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import msgpack
import redis
from rq import Queue
from rq.job import Job, JobStatus

from coordinator.health import HEARTBEAT_INTERVAL_S, beat, forget_stale
from coordinator.settings import PerseusSettings
from protocol import deadletter, keys
from protocol.exceptions import ConfigError, PerseusError, ProtocolError
from protocol.models import (
    JobConfig,
    RegisterJob,
    RegisterRank,
    Reply,
    ReportResult,
    SetTarget,
    decode_message,
    make_job_id,
    pack,
)
from protocol.scheduler import BUILTIN, check_scheduler_args, resolve_scheduler
from protocol.store import JobStore

logger = logging.getLogger(__name__)

_WAITING = {JobStatus.QUEUED, JobStatus.DEFERRED, JobStatus.SCHEDULED}


# XAUTOCLAIM (coordinator) and ZADD ... GT (hook heartbeats) arrived in Redis 6.2.
MIN_REDIS_VERSION = (6, 2)


def check_redis_version(version: str) -> None:
    """Raise ConfigError if the ``redis_version`` string is older than perseus-mq needs."""
    try:
        found = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        raise ConfigError(f"cannot parse the Redis server version {version!r}") from None
    if found < MIN_REDIS_VERSION:
        need = ".".join(map(str, MIN_REDIS_VERSION))
        raise ConfigError(f"perseus-mq needs Redis >= {need}; this server runs {version}")


def ensure_groups(conn: redis.Redis) -> None:
    """Create the consumer group on every input stream (from the start, so nothing is missed)."""
    for stream in keys.INPUT_STREAMS:
        try:
            conn.xgroup_create(stream, keys.COORDINATOR_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise


def _request_reply_key(fields: dict[bytes, bytes]) -> str | None:
    """Reply key of a registration request, found even when the rest of it is invalid.

    So that a client whose request is rejected gets the reason instead of a time-out.
    """
    try:
        raw = msgpack.unpackb(fields[b"data"], raw=False, strict_map_key=False)
        request_id = raw["request_id"]
    except Exception:
        return None
    if isinstance(request_id, str) and 0 < len(request_id) <= 128:
        return keys.reply_key(request_id)
    return None


class Coordinator:
    """Consume the input streams and drive jobs.

    Args:
        conn: redis-py client (bytes responses).
        settings: Coordinator settings.
        consumer: Consumer name in the group (default: host-pid).
        claim_idle_ms: Entries pending this long with another consumer are claimed.

    Raises:
        ConfigError: The scheduler does not exist or does not accept its arguments.
    """

    def __init__(
        self,
        conn: redis.Redis,
        settings: PerseusSettings,
        consumer: str | None = None,
        claim_idle_ms: int = 5_000,
    ) -> None:
        settings.check_scheduler()
        self.conn = conn
        self.settings = settings
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.claim_idle_ms = claim_idle_ms
        self.store = JobStore(conn, stream_maxlen=settings.stream_maxlen)
        self.queue = Queue(keys.RQ_QUEUE, connection=conn)
        self.stop_event = threading.Event()
        self._last_sweep = 0.0
        self._last_beat = 0.0
        self.processed = 0
        self.dead_lettered = 0

    # --- main loop -------------------------------------------------------------------------
    def run(self, block_ms: int = 1000) -> None:
        """Process entries until :attr:`stop_event` is set.

        Raises:
            ConfigError: The Redis server is too old.
        """
        check_redis_version(str(self.conn.info("server")["redis_version"]))
        ensure_groups(self.conn)
        logger.info("coordinator %s consuming %s", self.consumer, ", ".join(keys.INPUT_STREAMS))
        # Our own unacknowledged entries first (we may be a restart under the same name).
        self._consume("0", block_ms=None)
        while not self.stop_event.is_set():
            try:
                self.step(block_ms)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                logger.warning("redis unavailable (%s); retrying in 1 s", exc)
                self.stop_event.wait(1.0)
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                # The streams are gone: Redis restarted without persistence (or someone
                # deleted them). Jobs registered before are lost; new ones must still work.
                logger.error(
                    "input streams or their consumer group vanished (%s); re-creating them. "
                    "Was Redis restarted without persistence?",
                    exc,
                )
                ensure_groups(self.conn)

    def step(self, block_ms: int | None = 1000) -> int:
        """One round: claim stale entries, read new ones, maybe sweep. Returns entries handled."""
        handled = self._claim_stale()
        handled += self._consume(">", block_ms=block_ms)
        if time.monotonic() - self._last_beat >= HEARTBEAT_INTERVAL_S:
            self._last_beat = time.monotonic()
            beat(self.conn, self.consumer, time.time())  # the container healthcheck reads it
        if time.monotonic() - self._last_sweep >= self.settings.reconcile_interval:
            self._last_sweep = time.monotonic()
            self.sweep()
        return handled

    def _consume(self, start: str, block_ms: int | None) -> int:
        streams = {s: start for s in keys.INPUT_STREAMS}
        reply = self.conn.xreadgroup(
            keys.COORDINATOR_GROUP, self.consumer, streams, count=100, block=block_ms
        )
        handled = 0
        for stream, entries in reply or []:
            for entry_id, fields in entries:
                if fields is None:  # Trimmed away while pending: nothing left to process.
                    self.conn.xack(stream, keys.COORDINATOR_GROUP, entry_id)
                    continue
                self.handle(stream.decode(), entry_id.decode(), fields)
                handled += 1
        return handled

    def _claim_stale(self) -> int:
        handled = 0
        for stream in keys.INPUT_STREAMS:
            _next, claimed, *_ = self.conn.xautoclaim(
                stream,
                keys.COORDINATOR_GROUP,
                self.consumer,
                self.claim_idle_ms,
                start_id="0-0",
                count=100,
            )
            for entry_id, fields in claimed:
                if fields is None:  # Deleted by MAXLEN trimming while pending.
                    self.conn.xack(stream, keys.COORDINATOR_GROUP, entry_id)
                    continue
                logger.info("claimed stale entry %s %s", stream, entry_id.decode())
                self.handle(stream, entry_id.decode(), fields)
                handled += 1
        return handled

    # --- one entry -------------------------------------------------------------------------
    def handle(self, stream: str, entry_id: str, fields: dict[bytes, bytes]) -> None:
        """Process one stream entry, then acknowledge it (or dead-letter it)."""
        reply_to = _request_reply_key(fields)
        try:
            message = decode_message(fields)
            reply = self._dispatch(message, entry_id)
        except redis.RedisError:
            raise  # Transient: leave the entry pending, it is retried.
        except (PerseusError, ValueError) as exc:
            reason = str(exc) or type(exc).__name__
            logger.warning("dead-lettering %s %s: %s", stream, entry_id, reason)
            self._dead_letter(stream, entry_id, fields, reason, reply_to)
            return
        except Exception as exc:
            # A bug must not turn one entry into a crash loop of every coordinator.
            logger.exception("unexpected error on %s %s; dead-lettering it", stream, entry_id)
            reason = f"internal error {type(exc).__name__}: {exc}"
            self._dead_letter(stream, entry_id, fields, reason, reply_to)
            return
        with self.conn.pipeline(transaction=True) as pipe:
            if reply is not None and reply_to is not None:
                pipe.lpush(reply_to, pack(reply))
                pipe.expire(reply_to, self.settings.reply_ttl)
            pipe.xack(stream, keys.COORDINATOR_GROUP, entry_id)
            pipe.execute()
        self.processed += 1

    def _dead_letter(
        self,
        stream: str,
        entry_id: str,
        fields: dict[bytes, bytes],
        reason: str,
        reply_to: str | None,
    ) -> None:
        entry = deadletter.entry_fields(stream, entry_id, fields, reason, time.time())
        with self.conn.pipeline(transaction=True) as pipe:
            pipe.xadd(
                keys.DEADLETTER_STREAM,
                entry,
                maxlen=self.settings.stream_maxlen,
                approximate=True,
            )
            if reply_to is not None:
                pipe.lpush(reply_to, pack(Reply(ok=False, error=reason)))
                pipe.expire(reply_to, self.settings.reply_ttl)
            pipe.xack(stream, keys.COORDINATOR_GROUP, entry_id)
            pipe.execute()
        self.dead_lettered += 1

    def _dispatch(
        self, message: RegisterJob | RegisterRank | ReportResult | SetTarget, entry_id: str
    ) -> Reply | None:
        if isinstance(message, RegisterJob):
            return self._register_job(message, entry_id)
        if isinstance(message, RegisterRank):
            return self._register_rank(message)
        if isinstance(message, ReportResult):
            self._report_result(message)
            return None
        self._set_target(message, entry_id)
        return None

    def _job_config(self, message: RegisterJob) -> JobConfig:
        dump_dir = self.settings.dump_dir if self.settings.dump_data else ""
        if message.scheduler is None:
            if not self.settings.scheduler:
                raise ProtocolError(
                    "this coordinator has no default scheduler (PERSEUS_SCHEDULER is empty): "
                    "the job must choose one when it registers"
                )
            return JobConfig(
                scheduler=self.settings.scheduler,
                scheduler_args=self.settings.scheduler_args,
                dump_dir=dump_dir,
            )
        # A job may pick a built-in scheduler only: a `module:Class` sent by a client would let
        # any rank make the workers import arbitrary code.
        if message.scheduler not in BUILTIN:
            raise ProtocolError(
                f"job asked for scheduler {message.scheduler!r}; a job may choose one of "
                f"{', '.join(sorted(BUILTIN))} (others only through the coordinator's settings)"
            )
        given = {k for k, v in message.scheduler_args.items() if v is not None}
        paths = sorted(resolve_scheduler(message.scheduler).server_path_args & given)
        if paths:
            raise ProtocolError(
                f"scheduler argument(s) {', '.join(paths)} of {message.scheduler} name paths on "
                "the server; only the coordinator's settings may set them (a job may send "
                "data: plan_text, policies, numbers)"
            )
        check_scheduler_args(message.scheduler, message.scheduler_args)
        return JobConfig(
            scheduler=message.scheduler, scheduler_args=message.scheduler_args, dump_dir=dump_dir
        )

    def _register_job(self, message: RegisterJob, entry_id: str) -> Reply:
        job = message.job
        if job.job_id:
            raise ProtocolError(
                "job_id must be empty when registering a job; the coordinator sets it"
            )
        config = self._job_config(message)
        name = config.scheduler.rpartition(":")[2] or config.scheduler
        job = job.model_copy(update={"job_id": make_job_id(job, name, entry_id)})
        if self.store.create_job(job, config, entry_id):
            logger.info("registered job %s", job.job_id)
        return Reply(ok=True, job_id=job.job_id)

    def _register_rank(self, message: RegisterRank) -> Reply:
        record = self.store.get_job(message.job_id)
        count = self.store.add_rank(record.info, message.rank_info)
        logger.info(
            "job %s: rank %d registered (%d/%d)",
            record.job_id,
            message.rank_info.rank,
            count,
            record.info.world_size,
        )
        if count == record.info.world_size:
            self.enqueue_advance(record.job_id)
        needs = resolve_scheduler(record.config.scheduler).needs_instruction_energy
        return Reply(ok=True, job_id=record.job_id, instruction_energy=needs)

    def _report_result(self, message: ReportResult) -> None:
        record = self.store.get_job(message.job_id)
        result = message.result
        if result.rank >= record.info.world_size:
            raise ProtocolError(f"rank {result.rank} is out of range for job {record.job_id}")
        _added, latest, count = self.store.add_result(record.info, result)
        if result.schedule_version == latest and count >= record.info.world_size:
            self.enqueue_advance(record.job_id)

    def _set_target(self, message: SetTarget, entry_id: str) -> None:
        self.store.get_job(message.job_id)
        self.store.add_control(message, entry_id)
        self.enqueue_advance(message.job_id)

    # --- scheduler work --------------------------------------------------------------------
    def enqueue_advance(self, job_id: str) -> Job:
        """Enqueue the rq job that computes ``job_id``'s next schedule version."""
        lease_ms = max(1000, int(self.settings.stall_timeout * 1000))
        job = self.queue.enqueue(
            "coordinator.tasks.advance_job",
            job_id,
            lease_ms,
            description=f"advance {job_id}",
            job_timeout=self.settings.job_timeout,
            result_ttl=600,
            failure_ttl=24 * 3600,
        )
        self.store.set_fields(job_id, enqueued_at=f"{time.time():.3f}", rq_job=job.id)
        return job

    def sweep(self) -> None:
        """Re-enqueue due work nobody is doing, and delete jobs idle too long."""
        now = time.time()
        cutoff = now - self.settings.max_job_idle_time
        forget_stale(self.conn, now)
        for job_id in self.store.idle_jobs(self.settings.max_job_idle_time, now):
            if self.store.delete_job(job_id, idle_before=cutoff):
                logger.info(
                    "deleted job %s: idle for more than %d s",
                    job_id,
                    self.settings.max_job_idle_time,
                )
        for job_id, _ in self.store.list_jobs():
            try:
                record = self.store.get_job(job_id)
            except PerseusError:
                continue
            if record.error or not self.store.due(record):
                continue
            if self.store.lease_holder(job_id) is not None:
                continue
            enqueued_at = float(record.fields.get("enqueued_at", 0) or 0)
            if now - enqueued_at < self.settings.stall_timeout:
                continue
            rq_id = record.fields.get("rq_job", "")
            if rq_id and self._rq_waiting(rq_id):
                continue  # Still in the queue: a worker will get to it.
            logger.warning(
                "job %s: due work unclaimed for %.1f s; enqueueing again", job_id, now - enqueued_at
            )
            self.enqueue_advance(job_id)

    def _rq_waiting(self, rq_id: str) -> bool:
        try:
            status = Job.fetch(rq_id, connection=self.conn).get_status()
        except Exception:  # rq raises NoSuchJobError and friends: treat as gone.
            return False
        if status == JobStatus.QUEUED:
            # A worker killed between taking the job and starting it leaves it "queued" but
            # out of the queue (in rq's intermediate list) until rq's maintenance, 10+ minutes
            # later: only a job still in the queue is waiting.
            return self.conn.lpos(self.queue.key, rq_id) is not None
        return status in _WAITING
