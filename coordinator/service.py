"""The coordinator: consumes the input streams, keeps job state, enqueues scheduler work.

One consumer group, so coordinators share the load and a restarted one claims what a dead one
left pending. Each entry is validated, applied idempotently, answered (registrations) and
acknowledged; one that cannot be processed is dead-lettered with the reason and its fields, and
the loop goes on. Redis errors are not acknowledged: the entry is retried after a backoff. A
periodic sweep re-enqueues stalled work, deletes idle jobs and trims the input streams. Results
count only with their rank's MAC (:mod:`coordinator.trust`); a batch whose writes are one
script call sends the next blocking read with it (:mod:`coordinator.read_ahead`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

import redis
from redis.client import Pipeline
from rq import Queue
from rq.job import Job

from coordinator.advance_queue import enqueue, new_task_id, record_enqueued
from coordinator.completion import CompletionGuess
from coordinator.dispatch import MessageHandler
from coordinator.envelope import Message
from coordinator.health import HEARTBEAT_INTERVAL_S, agree_settings, beat, forget
from coordinator.intake import Decoded, Entry, Pending, decode_ahead, screen
from coordinator.outcome import Outcome, log_lost
from coordinator.read_ahead import InputReader
from coordinator.records import RecordCache
from coordinator.registration import RankRegistrar
from coordinator.resilience import (
    STOP_GRACE_S,
    Backoff,
    check_read_timeout,
    check_redis_version,
    cut_when_stop_hangs,
    prepare_server,
    tidy_up_within,
)
from coordinator.settings import PerseusSettings
from coordinator.sweep import Sweeper
from coordinator.trust import ResultKeys
from protocol import keys, streams
from protocol.acl import wrong_user
from protocol.codec import pack
from protocol.consumers import GroupMembers
from protocol.exceptions import DuplicateEntryError, PerseusError
from protocol.models import (
    RegisterJob,
    RegisterRank,
    ReportResult,
)
from protocol.store import JobRecord, JobStore
from protocol.store_batch import StoreBatch

logger = logging.getLogger(__name__)

_BATCH = 100  # entries read per stream at a time
_TOP_UPS = 3  # non-blocking reads that gather a burst of results into one batch
STOP_WAIT_S = 3.0  # longest a stop waits to leave the group and forget its record


class Coordinator:
    """Consume the input streams and drive jobs.

    Args:
        conn: redis-py client (bytes responses).
        settings: Coordinator settings.
        consumer: Consumer name in the group (default: host-pid).
        claim_idle_ms: Entries pending this long with another consumer are claimed.

    Raises:
        ConfigError: The scheduler or its arguments, or (dumps on) ``dump_dir``, are unusable.
    """

    def __init__(
        self,
        conn: redis.Redis,
        settings: PerseusSettings,
        consumer: str | None = None,
        claim_idle_ms: int = 5_000,
    ) -> None:
        settings.check_scheduler()
        settings.check_dump_dir()
        self.conn = conn
        self.settings = settings
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.claim_idle_ms = claim_idle_ms
        self.store = JobStore(conn, stream_maxlen=settings.stream_maxlen)
        self.queue = Queue(keys.RQ_QUEUE, connection=conn)
        self.stop_event = threading.Event()
        self._last_sweep = 0.0
        self._last_beat = 0.0
        self._last_claim = float("-inf")
        self.records = RecordCache(self.store)
        self.result_keys = ResultKeys(self.store)
        self._guess = CompletionGuess()
        self.registrar = RankRegistrar(settings)
        self.reader = InputReader(conn, self.consumer, _BATCH)
        self.sweeper = Sweeper(self.store)
        self.messages = MessageHandler(self.registrar, self.result_keys, self.records, self._guess)
        self.processed = 0
        self.dead_lettered = 0
        self.lost = 0  # entries removed from their stream before they were processed

    # --- main loop -------------------------------------------------------------------------
    def run(self, block_ms: int = 1000) -> None:
        """Process entries until :attr:`stop_event` is set.

        Raises:
            ConfigError: The client's socket timeout is too short for ``block_ms``, the
                Redis server is too old, a running coordinator has other shared settings (see
                :func:`coordinator.health.agree_settings`), or the Redis user may not do what
                a coordinator does (not the service role's user).
        """
        what = f"coordinator {self.consumer}"
        check_read_timeout(self.conn, block_ms / 1000, what)
        # A healthy Redis answers the read in flight within its block time.
        grace = block_ms / 1000 + STOP_GRACE_S
        with cut_when_stop_hangs(self.conn, self.stop_event, what, grace):
            self._loop(block_ms, Backoff(self.stop_event, what))
        # Left undone, the tidy-up is what a killed coordinator leaves: the others claim its
        # pending entries and the sweep removes its consumer.
        tidy_up_within(
            self._tidy_up,
            self.conn,
            STOP_WAIT_S,
            what,
            "leaving the consumer group (the others claim what it held)",
        )

    def _loop(self, block_ms: int, backoff: Backoff) -> None:
        """Start, then process entries, riding through Redis errors, until stopped."""
        while not self.stop_event.is_set():
            try:
                self._start()
                break
            except redis.exceptions.NoPermissionError as exc:
                raise wrong_user(f"coordinator {self.consumer}", exc) from None
            except redis.RedisError as exc:  # Down, out of memory, read-only replica...
                backoff.failed(exc)
        while not self.stop_event.is_set():
            try:
                self.step(block_ms)
                backoff.succeeded()
                continue
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    backoff.failed(exc)  # Out of memory, say: nothing was acknowledged.
                    continue
                # The streams are gone: Redis restarted without persistence (or someone
                # deleted them). Jobs registered before are lost; new ones must still work.
                logger.error(
                    "input streams or their consumer group vanished (%s); re-creating them. "
                    "Was Redis restarted without persistence?",
                    exc,
                )
            except redis.RedisError as exc:
                backoff.failed(exc)
                continue
            try:
                prepare_server(self.conn, consumer=self.consumer)
            except redis.RedisError as exc:
                backoff.failed(exc)

    def _tidy_up(self, abandoned: threading.Event) -> None:
        """Handle the last read, leave the group, forget the record; until ``abandoned``."""
        self._drain(abandoned)
        if not abandoned.is_set():
            GroupMembers(self.conn).leave_on_stop(self.consumer, quiet=abandoned)
        if not abandoned.is_set():
            forget(self.conn, self.consumer)

    def _drain(self, abandoned: threading.Event) -> None:
        """Handle what the read sent ahead with the last write brings (it is ours now)."""
        if not self.reader.read_pending:
            return
        try:
            self.handle_batch(list(self.reader.read(">", None)))
        except redis.RedisError as exc:
            # Left pending for this consumer: a coordinator's claim of stale entries takes them.
            if not abandoned.is_set():
                logger.warning(
                    "coordinator %s: last read not handled at stop (%s)", self.consumer, exc
                )
        finally:
            self.reader.reset()

    def _start(self) -> None:
        version = str(self.conn.info("server")["redis_version"])
        check_redis_version(version)
        agree_settings(self.conn, self.consumer, self.settings.shared(), self.store.server_time())
        prepare_server(self.conn, version, self.consumer)
        logger.info("coordinator %s consuming %s", self.consumer, ", ".join(keys.INPUT_STREAMS))
        # Our own unacknowledged entries first (we may be a restart under the same name).
        self._consume("0", block_ms=None)

    def step(self, block_ms: int | None = 1000) -> int:
        """One round: maybe claim stale entries, read new ones, maybe sweep; return how many."""
        handled = 0
        now = time.monotonic()
        if now - self._last_claim >= self.claim_idle_ms / 2000:
            self._last_claim = now
            handled += self._claim_stale()
        handled += self._consume(">", block_ms=block_ms)
        # While the clients that were answered send their next requests.
        self.registrar.prepare()
        if time.monotonic() - self._last_beat >= HEARTBEAT_INTERVAL_S:
            self._last_beat = time.monotonic()
            # The container healthcheck reads it; timed by the server, like every stamp.
            beat(self.conn, self.consumer, self.store.clock.now(), shared=self.settings.shared())
        if time.monotonic() - self._last_sweep >= self.settings.reconcile_interval:
            self._last_sweep = time.monotonic()
            self.sweep()
        return handled

    def _consume(self, start: str, block_ms: int | None) -> int:
        batch: list[Entry]
        batch = list(self.reader.read(start, block_ms))
        decoded: Decoded = {}
        results = sum(s == keys.RESULTS_STREAM for s, _, _ in batch)
        for _ in range(_TOP_UPS if block_ms is not None and results else 0):
            # A blocked read returns with the first result of a burst (every rank reports at
            # the end of the same step): take what else arrived, so that they form one batch.
            if results >= _BATCH:
                break  # A full batch already (and XREADGROUP refuses a count of 0).
            # Decoded while Redis still takes in the rest of the burst, not after all of it.
            decode_ahead(batch, decoded, self.settings.max_entry_bytes)
            if self._guess.completes_all(decoded.values(), self.records):
                break  # Nothing more of this burst can come: no read that finds nothing.
            more = self.conn.xreadgroup(
                keys.COORDINATOR_GROUP,
                self.consumer,
                {keys.RESULTS_STREAM: start},
                count=_BATCH - results,
            )
            got = [(keys.RESULTS_STREAM, e.decode(), f) for _s, es in more or [] for e, f in es]
            batch += got
            results += len(got)
            if not got or results >= _BATCH:
                break
        # A blocking loop's next read goes with this batch's write (see InputReader).
        ahead = block_ms if start == ">" and block_ms is not None else None
        return self.handle_batch(batch, decoded, read_ahead=ahead)

    def _claim_stale(self) -> int:
        handled = 0
        for stream in keys.INPUT_STREAMS:
            claimed = streams.claim_stale(
                self.conn, stream, keys.COORDINATOR_GROUP, self.consumer, self.claim_idle_ms
            )
            for entry_id, _fields in claimed.entries:
                logger.info("claimed stale entry %s %s", stream, entry_id)
            log_lost(stream, claimed.deleted)  # Redis 7; the claim counted them
            self.lost += len(claimed.deleted)
            batch: list[Entry]
            batch = [(stream, e, f) for e, f in claimed.entries]
            # Redis 6.2: pending but trimmed away; counted and logged as lost, and acknowledged.
            batch += [(stream, e, None) for e in claimed.gone]
            handled += self.handle_batch(batch) + len(claimed.deleted)
        return handled

    # --- entries ---------------------------------------------------------------------------
    def handle(self, stream: str, entry_id: str, fields: dict[bytes, bytes]) -> None:
        """Process one stream entry, then acknowledge it (or dead-letter it)."""
        self.handle_batch([(stream, entry_id, fields)])

    def handle_batch(
        self,
        entries: list[Entry],
        decoded: Decoded | None = None,
        read_ahead: int | None = None,
    ) -> int:
        """Process entries read together, in at most four round trips whatever their number.

        Job records and results' keys of jobs not cached yet (degrees and keys never change),
        each in one pipeline; every store write in one pipeline; then replies, dead letters, rq
        enqueues and one XACK per stream in one transaction. An entry that cannot be processed
        is dead-lettered with the reason; a Redis error leaves every entry pending, to be
        retried (all writes are idempotent). Entries trimmed away while pending (no fields)
        are acknowledged, counted in :data:`protocol.keys.STREAM_LOSSES` and logged.

        Args:
            entries: (stream, entry id, fields) as read.
            decoded: Messages (or decoding errors) of some entries, decoded already; an
                entry in it counts as within ``max_entry_bytes`` (:func:`decode_ahead`
                decodes no larger one).
            read_ahead: A lone store write (one script call: a registration, say) is sent
                with the next blocking read of new entries, which blocks this long
                (:meth:`InputReader.send_with_read`); None: never.

        Returns:
            Entries processed or dead-lettered.
        """
        if not entries:
            return 0
        # Activity stamps and dead letters: the server's clock, like heartbeats.
        outcome = Outcome(now=self.store.clock.now())
        pending = screen(entries, decoded, outcome, self.settings.max_entry_bytes)
        jobs = self.records.load(m.job_id for *_, m in pending if not isinstance(m, RegisterJob))
        self.result_keys.load(
            [(m.job_id, m.result.rank) for *_, m in pending if isinstance(m, ReportResult)]
        )
        batch = self.store.batch()
        queued: list[Pending] = []
        now = outcome.now
        for stream, entry_id, fields, message in pending:
            try:
                self._dispatch(batch, message, stream, entry_id, fields, jobs, now)
            except (PerseusError, ValueError) as exc:
                outcome.dead(stream, entry_id, fields, str(exc) or type(exc).__name__)
                continue
            except Exception as exc:
                # A bug must not turn one entry into a crash loop of every coordinator.
                logger.exception("unexpected error on %s %s; dead-lettering it", stream, entry_id)
                outcome.dead(
                    stream, entry_id, fields, f"internal error {type(exc).__name__}: {exc}"
                )
                continue
            queued.append((stream, entry_id, fields, message))
        # The scheduler work of versions these results complete goes in the same round trip.
        reports = []
        for *_, message in queued:
            if isinstance(message, ReportResult) and (record := jobs.get(message.job_id)):
                reports.append((record.info, message.result))
        guessed = self._guess.completed(reports)

        # The script storing a job's results records the task if they complete its version
        # (a write to the info hash of a job that is gone would leave a partial one).
        rq_jobs = {job_id: new_task_id() for job_id in guessed}
        for job_id, task_id in rq_jobs.items():
            batch.note_task(job_id, task_id)

        def enqueue_guessed(pipe: Pipeline) -> None:
            for job_id, task_id in rq_jobs.items():
                self.enqueue_advance(job_id, pipeline=pipe, record=False, task_id=task_id)

        carry = None
        if read_ahead is not None and not guessed and not self.reader.read_pending:

            def carry(command: tuple[Any, ...]) -> Any:
                return self.reader.send_with_read(command, read_ahead)

        replies = batch.execute(enqueue_guessed if guessed else None, carry)
        if batch.then_ok:
            outcome.enqueued.update(rq_jobs)
        for (stream, entry_id, fields, message), result in zip(queued, replies, strict=True):
            if isinstance(result, Exception):
                # A registration answered before gets no second (error) reply.
                first = not isinstance(result, DuplicateEntryError)
                reason = str(result) or type(result).__name__
                outcome.dead(stream, entry_id, fields, reason, reply=first)
                continue
            if isinstance(message, RegisterRank | ReportResult) or (
                isinstance(message, RegisterJob) and result is True
            ):
                outcome.answered(stream, entry_id)  # by the script that stored it
            self.messages.settle(message, result, jobs, outcome, now)
        self._finish(outcome)
        return sum(len(ids) for ids in outcome.acks.values()) + outcome.self_acked

    def _dispatch(
        self,
        batch: StoreBatch,
        message: Message,
        stream: str,
        entry_id: str,
        fields: dict[bytes, bytes],
        jobs: dict[str, JobRecord | None],
        now: float,
    ) -> None:
        """Queue ``message``'s store write (see :meth:`MessageHandler.dispatch`)."""
        self.messages.dispatch(self.settings, batch, message, stream, entry_id, fields, jobs, now)

    def _finish(self, outcome: Outcome) -> None:
        """Replies, dead letters, rq enqueues and acknowledgements: one transaction."""
        ttl = self.settings.reply_ttl
        self.processed += outcome.self_acked
        # A task enqueued with the results that completed its version is recorded already.
        advance = [
            job_id
            for job_id in sorted(outcome.advance)
            if not (job_id in outcome.enqueued and job_id in outcome.completed)
        ]
        if not (outcome.replies or outcome.dead_letters or advance) and not any(
            outcome.acks.values()
        ):
            return
        with self.conn.pipeline(transaction=True) as pipe:
            pipe.multi()  # explicit, so that rq queues its enqueue in this transaction
            for reply_key, reply in outcome.replies.items():
                pipe.lpush(reply_key, pack(reply))
                pipe.expire(reply_key, ttl)
            for entry in outcome.dead_letters:
                # Kept until replayed or purged; the sweep caps the stream, counting what it cuts.
                pipe.xadd(keys.DEADLETTER_STREAM, entry)
            for job_id in advance:
                if job_id in outcome.enqueued:
                    record_enqueued(self.store, job_id, outcome.enqueued[job_id], pipe)
                else:
                    self.enqueue_advance(job_id, pipeline=pipe)
            for stream, ids in outcome.acks.items():
                if ids:
                    pipe.xack(stream, keys.COORDINATOR_GROUP, *ids)
            for stream, ids in outcome.lost.items():
                streams.count_lost(self.conn, stream, len(ids), pipeline=pipe)
            pipe.execute()
        lost = sum(len(ids) for ids in outcome.lost.values())
        self.dead_lettered += len(outcome.dead_letters)
        self.lost += lost
        self.processed += (
            sum(len(ids) for ids in outcome.acks.values()) - len(outcome.dead_letters) - lost
        )
        for reason in outcome.reasons:
            logger.warning("dead-lettered %s", reason)
        for stream, ids in outcome.lost.items():
            log_lost(stream, ids)

    # --- scheduler work --------------------------------------------------------------------
    def enqueue_advance(
        self,
        job_id: str,
        pipeline: Pipeline | None = None,
        record: bool = True,
        task_id: str | None = None,
    ) -> Job:
        """Enqueue the rq task that computes ``job_id``'s next version (see :func:`enqueue`)."""
        return enqueue(self.queue, self.store, self.settings, job_id, pipeline, record, task_id)

    def sweep(self) -> None:
        """Re-enqueue due work nobody is doing, and delete jobs idle too long (see Sweeper)."""
        for job_id in self.sweeper.run(self.settings, self.enqueue_advance):
            self.records.forget(job_id)
            self.result_keys.forget(job_id)
            self._guess.forget(job_id)
