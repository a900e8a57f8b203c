"""The rank side of the Redis protocol: register, wait for schedules, report results.

:class:`CoordinatorClient` does request/reply over streams (registrations get an answer on a
short-lived list) and reads published schedules. The threads that use it in the background,
so that the training thread never waits on Redis, are in :mod:`worker_client.hook.watchers`.
"""

from __future__ import annotations

import logging
import numbers
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from pydantic import ValidationError
from redis.backoff import NoBackoff
from redis.retry import Retry

from protocol import keys
from protocol.acl import refused
from protocol.codec import unpack, validation_text
from protocol.connection import (
    SENTINEL_SCHEMES,
    SOCKET_TIMEOUT_S,
    connect,
    longest_block,
    no_such_database,
    redact_url,
)
from protocol.exceptions import (
    ConfigError,
    CoordinatorUnavailableError,
    PerseusError,
    ProtocolError,
    UnknownJobError,
)
from protocol.models import (
    FrequencySchedule,
    JobInfo,
    ProfilingResult,
    RankInfo,
    RegisterJob,
    RegisterRank,
    Reply,
    ReportResult,
    SetTarget,
    encode_message,
)
from protocol.store import JobStore

logger = logging.getLogger(__name__)


class CoordinatorClient:
    """Talks to the coordinator through Redis.

    Args:
        redis_url: The Redis the coordinator uses.
        reply_timeout: Seconds to wait for a registration reply.
        tokens: Where to keep the ranks' tokens, shared with other clients of this process
            (say, one per thread); default: this client's own.
        conn: The Redis client to use instead of one made here (see
            :meth:`background_client`).
    """

    def __init__(
        self,
        redis_url: str,
        reply_timeout: float = 60.0,
        tokens: dict[tuple[str, int], str] | None = None,
        *,
        conn: redis.Redis | None = None,
    ) -> None:
        if not reply_timeout > 0:
            raise ValueError(f"reply_timeout must be > 0 seconds, got {reply_timeout}")
        self.redis_url = redis_url
        self.where = redact_url(redis_url)  # for messages: never the password
        self.reply_timeout = reply_timeout
        # BLPOP waits up to reply_timeout for a registration's answer: the socket must wait longer.
        if conn is None:
            conn = connect(redis_url, socket_timeout=reply_timeout + SOCKET_TIMEOUT_S)
        self.conn = conn
        self.store = JobStore(self.conn)
        # (job, rank) -> the token its registration reply gave: results and heartbeats prove
        # it. Never logged, never sent as such (results carry a MAC, see protocol.tokens).
        self._tokens: dict[tuple[str, int], str] = {} if tokens is None else tokens
        # Replies read and not yet removed (see _discard_reply).
        self._replies_read: list[str] = []
        self._kept: redis.Redis | None = None  # see _registrations
        self._kept_lock = threading.Lock()  # threads' first registrations make one

    def _registrations(self) -> redis.Redis:
        """The client a registration's XADD and read go over: one connection, kept.

        redis-py's pool checkout, which every command on :attr:`conn` pays (a poll of the
        socket, metrics), took 5-8% of one client's registration rate (two commands each;
        ``benchmarks/bench_registration_ab.py --own-clients``). Made on the first
        registration, not with the client: a client is made while Redis may be down, and a
        registration rides through that (see :meth:`_request`). Threads registering over one
        client at once take turns. A sentinel URL's registrations use :attr:`conn`: redis-py
        finds a new master only for connections its pool hands out.
        """
        if self.redis_url.startswith(SENTINEL_SCHEMES):
            return self.conn
        kept = self._kept
        if kept is not None:
            return kept
        with self._kept_lock:
            if self._kept is None:
                kept = redis.Redis(
                    connection_pool=self.conn.connection_pool, single_connection_client=True
                )
                kept.auto_close_connection_pool = False  # the pool is conn's to close
                self._kept = kept
            return self._kept

    def _release_kept(self) -> None:
        """Give the kept connection back to the pool (a later registration takes one again)."""
        with self._kept_lock:
            if self._kept is not None:
                self._kept.close()
                self._kept = None

    def background_client(self, socket_timeout: float = SOCKET_TIMEOUT_S) -> CoordinatorClient:
        """A client of the same Redis and tokens, on connections of its own, for a thread.

        Its commands (heartbeats, reads, results: never a registration's long ``BLPOP``) time
        out after ``socket_timeout``, not ``reply_timeout`` + 30 s, and redis-py does not
        retry them: the thread retries itself, and its ``stop()`` ends a command in flight,
        even one whose reply a silent network dropped, by disconnecting the pool (a retry
        would send it again). Closing it leaves this client's connections alone.

        Args:
            socket_timeout: Seconds a command may wait for its reply.
        """
        conn = connect(self.redis_url, socket_timeout=socket_timeout)
        conn.set_retry(Retry(NoBackoff(), 0))
        return CoordinatorClient(self.redis_url, self.reply_timeout, self._tokens, conn=conn)

    def _request(self, message: RegisterJob | RegisterRank) -> Reply:
        """Send a registration request and wait up to ``reply_timeout`` for its reply.

        A Redis error on the way (a restart, a failover, a full Redis) is retried until then:
        the request waits in the stream, and the coordinator answers it once Redis is back.
        The request is sent again only if sending it failed; should that first send have
        reached Redis after all, the coordinator answers a job's request once (the same job)
        and dead-letters a rank's second one without a reply.
        """
        deadline = time.monotonic() + self.reply_timeout
        entry = encode_message(message, wait_s=self.reply_timeout)
        key = keys.reply_key(message.request_id)
        retry = _Retry(self, f"registration ({message.kind})", deadline)
        answer = self._read_reply(
            key,
            deadline,
            retry,
            lambda: self._registrations().xadd(keys.REGISTRATIONS_STREAM, entry),
        )
        if answer is None:
            raise CoordinatorUnavailableError(
                f"no coordinator answered {message.kind} within {self.reply_timeout:.0f} s; "
                f"is a `perseus coordinator` running on this Redis ({self.where})?"
            )
        self._discard_reply(key)
        reply = unpack(Reply, answer)
        if not reply.ok:
            if "unknown job id" in reply.error:
                raise UnknownJobError(reply.error)
            raise ProtocolError(f"coordinator rejected {message.kind}: {reply.error}")
        return reply

    def _read_reply(
        self,
        key: str,
        deadline: float,
        retry: _Retry,
        send: Callable[[], object] | None = None,
    ) -> bytes | None:
        """Call ``send`` (until it succeeds), then wait for the reply at ``key`` until ``deadline``.

        Redis errors are retried with ``retry``. Returns the reply, or None at the deadline.

        The reply is read without taking it (BRPOPLPUSH of the list onto itself), and
        :meth:`_discard_reply` removes it once read. Redis drops the answers to the commands
        it ran just before it shuts down (a restart's SIGTERM), and a connection may break
        after Redis ran a command: a BLPOP had taken the reply for good, and the rank waited
        out ``reply_timeout`` for a reply that was gone. Read again, it is still there.
        """
        # Waits of at most this long: a URL's ?socket_timeout= may be shorter than the wait.
        longest = longest_block(self.conn, self.reply_timeout)
        while True:
            try:
                if retry.since is not None:
                    # Back? Said when Redis answers, not once the reply came (seconds later,
                    # or at the deadline, where it read as Redis back only then).
                    self.conn.time()
                    retry.done()
                if send is not None:
                    send()
                    send = None  # sent: never again (see _request)
                wait = max(min(deadline - time.monotonic(), longest), 0.01)
                answer = self._registrations().brpoplpush(key, key, timeout=wait)
                if answer is not None:
                    return answer
                if time.monotonic() >= deadline:
                    return None
            except redis.RedisError as exc:
                retry.after(exc)

    def _discard_reply(self, key: str) -> None:
        """Have a reply that was read removed: a rank's carries its token (Redis keeps digests).

        Removed by :meth:`release_idle` (the hook calls it once its first schedule came) or
        :meth:`close`, or with a thousand others read meanwhile: no round trip of its own
        on the registration's path, whose rate ``benchmarks/bench_coordinator.py`` measures
        against the raw limit (a pipelined delete per registration cost 5% of it). At the
        latest it expires after the coordinator's ``reply_ttl``.
        """
        self._replies_read.append(key)
        if len(self._replies_read) >= _REPLIES_KEPT:
            self._remove_replies()

    def _remove_replies(self) -> None:
        """Remove the replies read (best effort: otherwise they expire after ``reply_ttl``)."""
        if not self._replies_read:
            return
        try:
            with self.conn.pipeline(transaction=False) as pipe:
                for key in self._replies_read:
                    pipe.ltrim(key, 1, 0)
                pipe.execute()
        except redis.RedisError as exc:
            logger.debug("registration replies left to expire: %s", exc)
        self._replies_read.clear()

    def register_job(
        self,
        job: JobInfo,
        scheduler: str | None = None,
        scheduler_args: dict[str, Any] | None = None,
    ) -> str:
        """Register a job; return the job id the coordinator assigned.

        Args:
            job: The job.
            scheduler: A built-in scheduler for this job (default: the coordinator's).
            scheduler_args: Its arguments.
        """
        request = RegisterJob(
            request_id=_request_id(),
            job=job,
            scheduler=scheduler,
            scheduler_args=scheduler_args or {},
        )
        return self._request(request).job_id

    def register_rank(self, job_id: str, rank: RankInfo) -> Reply:
        """Register one rank with a job; the reply says what the job's scheduler needs.

        The reply's token is kept by this client: its results and heartbeats for the rank
        carry the proof of it.
        """
        reply = self._request(RegisterRank(request_id=_request_id(), job_id=job_id, rank_info=rank))
        self._tokens[(job_id, rank.rank)] = reply.token
        return reply

    def token(self, job_id: str, rank: int) -> str | None:
        """The token ``rank`` got when this client registered it (None: it did not).

        For callers that build result entries themselves (``encode_message(..., token=)``).
        """
        return self._tokens.get((job_id, rank))

    def report(self, job_id: str, result: ProfilingResult) -> None:
        """Publish a profiling result (fire and forget), with its rank's MAC."""
        token = self._tokens.get((job_id, result.rank))
        self.conn.xadd(
            keys.RESULTS_STREAM,
            encode_message(ReportResult(job_id=job_id, result=result), token=token),
        )

    def set_target(self, job_id: str, iteration_time: float) -> None:
        """Ask the job's scheduler for a new target iteration time.

        Raises:
            ConfigError: ``iteration_time`` is not a number of seconds from
                ``MIN_TARGET_ITERATION_S`` to ``MAX_TARGET_ITERATION_S`` (True is no time).

        """
        fields = {"job_id": job_id, "iteration_time": iteration_time}
        if isinstance(iteration_time, numbers.Real) and not isinstance(iteration_time, bool):
            fields["iteration_time"] = float(iteration_time)  # 2 or numpy's 2.0 is 2.0 s
        try:
            message = SetTarget.model_validate(fields, strict=True)
        except ValidationError as exc:
            raise ConfigError(
                f"bad target for job {job_id!r}: {validation_text(exc)} (got {iteration_time!r})"
            ) from None
        self.conn.xadd(keys.CONTROL_STREAM, encode_message(message))

    def heartbeat(self, job_id: str, rank: int) -> bool:
        """Mark the job and ``rank`` active; return whether Redis still has the job.

        Timed by the Redis server's clock: idle-job GC spares the job, and ``perseus status``
        sees when each rank was last heard from, whatever this machine's clock says.

        Raises:
            WrongTokenError: This client did not register ``rank`` (or another process did).
        """
        return self.store.touch(job_id, rank, self._tokens.get((job_id, rank), ""))

    def latest_version(self, job_id: str) -> int:
        """Latest published schedule version (0 if none yet)."""
        return self.store.version(job_id)

    def job_error(self, job_id: str) -> str:
        """The job's scheduling error, if the scheduler failed."""
        return self.store.job_error(job_id)

    def unavailable(self, exc: redis.RedisError) -> CoordinatorUnavailableError:
        """The error a training script gets for a Redis failure (the server, not redis-py's)."""
        why = no_such_database(self.redis_url, self.conn, exc)  # the URL's ?db=, not Redis
        return CoordinatorUnavailableError(why or f"redis at {self.where}: {exc}")

    def fetch_schedule(self, job_id: str, version: int, rank: int) -> FrequencySchedule:
        """Read and check one rank's schedule of ``version``."""
        schedule = self.store.schedule(job_id, version, rank)
        if schedule is None:
            raise ProtocolError(f"job {job_id} has no schedule version {version} for rank {rank}")
        if schedule.rank != rank:
            raise ProtocolError(
                f"coordinator returned a schedule for rank {schedule.rank} to rank {rank} "
                f"(job {job_id}, version {version})"
            )
        if schedule.version != version:
            raise ProtocolError(
                f"schedule stored as version {version} says it is version {schedule.version}"
            )
        return schedule

    def wait_schedule(
        self, job_id: str, rank: int, newer_than: int = 0, timeout: float = 120.0
    ) -> FrequencySchedule:
        """Block until a version newer than ``newer_than`` is published; return it.

        A Redis error is retried until ``timeout`` has passed (a restart or a failover while
        a rank waits for its first schedule).

        Raises:
            CoordinatorUnavailableError: No version in ``timeout`` seconds, or Redis failed
                until then.
            UnknownJobError: The job is gone (Redis lost it, or it was deleted).
            PerseusError: The job's scheduler failed.
        """
        deadline = time.monotonic() + timeout
        retry = _Retry(self, f"rank {rank} waiting for a schedule", deadline)
        while True:
            try:
                schedule = self._wait_schedule(job_id, rank, newer_than, timeout, deadline)
            except redis.RedisError as exc:
                retry.after(exc)
                continue
            retry.done()
            return schedule

    def _wait_schedule(
        self, job_id: str, rank: int, newer_than: int, timeout: float, deadline: float
    ) -> FrequencySchedule:
        last_id = "0"
        while True:
            version = self.latest_version(job_id)
            if version > newer_than:
                return self.fetch_schedule(job_id, version, rank)
            with self.conn.pipeline(transaction=False) as pipe:  # commands a rank's ACL grants
                pipe.exists(keys.job_info(job_id))
                pipe.hget(keys.job_info(job_id), "error")
                exists, error = pipe.execute()
            if not exists:
                # No schedule will ever come: Redis lost the job (restarted without its data)
                # or it was deleted; waiting on would end in a message about workers.
                raise UnknownJobError(
                    f"job {job_id} is gone from redis at {self.where} (restarted without "
                    f"persistence, or deleted) while rank {rank} waited for a schedule newer "
                    f"than version {newer_than}; restart training to register a new job"
                )
            if error:
                raise PerseusError(f"the scheduler of job {job_id} failed: {error.decode()}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CoordinatorUnavailableError(
                    f"no schedule for rank {rank} of job {job_id} after {timeout:.0f} s "
                    f"(latest version {version}); are `perseus worker` processes running?"
                )
            block = max(1, int(min(remaining, longest_block(self.conn, 1.0)) * 1000))
            reply = self.conn.xread({keys.job_updates(job_id): last_id}, block=block, count=100)
            for _stream, entries in reply or []:
                last_id = entries[-1][0].decode()

    def release_idle(self) -> None:
        """Close the connections this client holds but is not using; it reconnects if used.

        A rank's hook joins over this client, then talks to Redis only from its threads,
        over connections of their own: kept open, this one would idle for the whole run.
        """
        self._remove_replies()
        self._release_kept()
        self.conn.connection_pool.disconnect(inuse_connections=False)

    def close(self) -> None:
        """Close the connection pool (after removing the replies read)."""
        self._remove_replies()
        self._release_kept()
        self.conn.close()


def _request_id() -> str:
    """A fresh registration request id: 32 hex digits, 128 random bits.

    ``uuid.uuid4().hex`` costs 1.8 us against 0.4 us, on the path a rank waits on.
    """
    return os.urandom(16).hex()


# Replies read that a client removes in one round trip, before release_idle() or close().
_REPLIES_KEPT = 1024

# The hook's waits between tries on a Redis error (here and in its threads): doubling from
# the first to the last.
FIRST_RETRY_S, LAST_RETRY_S = 0.5, 5.0

# What a Redis that is restarting, failing over or full answers; any other error (a login or
# an ACL refused, a command the server lacks) is raised at once: waiting cannot cure it.
_OUTAGE_ERRORS = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,
)


class _Retry:
    """Backoff for a client call that rides through Redis errors until a deadline.

    Args:
        client: Names the server in messages, and builds the error raised at the deadline.
        what: Names the call in log messages.
        deadline: ``time.monotonic()`` after which the last error is raised.
    """

    def __init__(self, client: CoordinatorClient, what: str, deadline: float) -> None:
        self.client, self.what, self.deadline = client, what, deadline
        self.since: float | None = None
        self._delay = FIRST_RETRY_S

    def after(self, exc: redis.RedisError) -> None:
        """Wait before the next try (doubling from 0.5 s up to 5 s), logging the first error.

        Raises:
            CoordinatorUnavailableError: The deadline comes before the next try would, or
                ``exc`` is no outage (a refused login or command).
        """
        now = time.monotonic()
        outage = isinstance(exc, _OUTAGE_ERRORS) and not refused(exc)
        if not outage or now + self._delay >= self.deadline:
            raise self.client.unavailable(exc) from None
        if self.since is None:
            self.since = now
            logger.warning(
                "%s: redis at %s unavailable (%s); retrying for up to %.0f s",
                self.what,
                self.client.where,
                exc,
                self.deadline - now,
            )
        time.sleep(self._delay)
        self._delay = min(self._delay * 2, LAST_RETRY_S)

    def done(self) -> None:
        """Log the end of an outage, if there was one (a later error begins another)."""
        if self.since is not None:
            logger.warning(
                "%s: redis at %s is back after %.1f s",
                self.what,
                self.client.where,
                time.monotonic() - self.since,
            )
            self.since = None
