"""The hook's background threads: a schedule watcher and a result reporter, riding out outages.

:class:`ScheduleWatcher` and :class:`ResultReporter` run so that the training thread never
waits on Redis: it only picks up what they left at step boundaries.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import redis

from protocol import keys
from protocol.connection import longest_block
from protocol.exceptions import ProtocolError, WrongTokenError
from protocol.models import FrequencySchedule, ProfilingResult
from worker_client.hook.outage import Outage
from worker_client.hook.session import CoordinatorClient

logger = logging.getLogger(__name__)

MAX_BLOCK_S = 20.0
"""Longest blocking read of an idle schedule watcher (below the socket time-out)."""
STOP_TIMEOUT_S = 2.0
"""Longest wait of :meth:`ScheduleWatcher.stop` for its thread to end."""
# Every Redis error is an outage to ride through: a restart, a failover, but also a full
# Redis (OOM under noeviction) or a replica in the middle of a failover (READONLY).
TRANSIENT_ERRORS = (redis.RedisError,)


def _interrupt(thread: threading.Thread, client: CoordinatorClient, timeout: float) -> bool:
    """Disconnect ``client`` under ``thread`` until it ends (``timeout`` s at most), close it.

    Returns whether the thread ended. Its command in flight fails at once (the clients of
    :meth:`CoordinatorClient.background_client` do not retry), again and again: another may
    begin between the thread's last check of its stop flag and its command.
    """
    deadline = time.monotonic() + timeout
    while thread.is_alive() and time.monotonic() < deadline:
        client.conn.connection_pool.disconnect()
        thread.join(timeout=0.1)
    client.close()
    return not thread.is_alive()


class ScheduleWatcher(threading.Thread):
    """Follows a job's published versions and keeps the newest schedule for one rank.

    The training thread calls :meth:`take` at step boundaries; it never blocks. A Redis
    outage does not stop training: the watcher retries. Every ``heartbeat_interval`` seconds,
    and right after an outage, it marks the job active, so that a long run on a converged
    schedule (which reports nothing new) is not deleted as idle, and checks that Redis still
    has the job (one restarted without persistence has forgotten it: see :attr:`job_lost`).
    The scheduler's failures and recoveries it logs as they come (:attr:`job_error`); of those
    from before the rank joined, only the job's state then (a failure that still lasts).

    Its commands go over connections of its own (:meth:`CoordinatorClient.background_client`),
    which :meth:`stop` disconnects to end the one in flight: a heartbeat whose reply a silent
    network dropped does not keep the thread alive past :meth:`stop`.

    Args:
        client: Reads schedules.
        job_id: The job.
        rank: Whose schedule to keep.
        version: The version the rank runs now.
        outage_timeout: Seconds of Redis outage after which :attr:`error` is set (and the hook
            raises it); ``None`` retries forever.
        heartbeat_interval: Seconds between heartbeats.
    """

    def __init__(
        self,
        client: CoordinatorClient,
        job_id: str,
        rank: int,
        version: int,
        outage_timeout: float | None = None,
        heartbeat_interval: float = 60.0,
    ) -> None:
        super().__init__(daemon=True, name=f"perseus-watch-{rank}")
        self.client, self.job_id, self.rank = client, job_id, rank
        self._version = version
        self._lock = threading.Lock()
        self._pending: FrequencySchedule | None = None
        self._seen: set[int] = set()  # versions announced on the updates stream so far
        self._republished: int | None = None
        self.error: BaseException | None = None
        self.outage = Outage(f"rank {rank} schedule watcher", client.where, outage_timeout)
        self.job_lost = False
        self.token_refused = False  # a heartbeat was refused: this client did not register
        self.job_error = ""  # the scheduler's failure while it lasts (its start, end logged)
        self.heartbeat_interval = heartbeat_interval
        self._next_beat = time.monotonic()  # the first heartbeat at once: the rank is alive
        self._stop_event = threading.Event()
        # Connections of its own: blocking reads must not hold up other callers' commands, and
        # stop() ends a command in flight by disconnecting them.
        self._client = client.background_client()
        self._conn = self._client.conn
        self._max_block = longest_block(self._conn, MAX_BLOCK_S)  # a URL's time-out may be shorter

    def run(self) -> None:
        """Follow the updates stream until stopped (thread body)."""
        last_id = "0"
        caught_up = False  # the first read returns the stream so far: from before this rank
        while not self._stop_event.is_set():
            try:
                # Block until the next heartbeat is due: an idle watcher costs one command
                # per MAX_BLOCK_S, and stop() interrupts the read by closing the connection.
                # In an outage, barely: the heartbeat that ends it (or finds the job gone)
                # must not wait out a long read on a Redis that is back.
                wait = min(self._max_block, max(0.001, self._next_beat - time.monotonic()))
                if self.outage.since is not None:
                    wait = 0.001
                updates = {keys.job_updates(self.job_id): last_id}
                reply = self._conn.xread(updates, block=max(1, int(wait * 1000)))
                if self._stop_event.is_set():
                    return
                # After an outage (or when due) a heartbeat; the outage ends once it went
                # through: a full Redis (OOM) still serves reads, but refuses the heartbeat.
                if self.outage.since is not None or time.monotonic() >= self._next_beat:
                    self._beat()
                    if self._stop_event.is_set():
                        return
                self.outage.recovered()
                for _stream, entries in reply or []:
                    last_id = entries[-1][0].decode()
                    versions = self._announced(entries)
                    errors = [
                        f[b"error"].decode(errors="replace") for _, f in entries if b"error" in f
                    ]
                    # Of the stream so far, only the last says the job's state now: failures and
                    # recoveries before it are history, not news for a rank that just joined.
                    for error in errors if caught_up else errors[-1:]:
                        self._note_error(error)
                    if not versions:
                        continue
                    self._note_announcements(versions)
                    newest = max(versions)
                    if newest > self._version:
                        self._take_newest(newest)
                caught_up = True
            except TRANSIENT_ERRORS as exc:
                if self._stop_event.is_set():
                    return
                self.error = self.outage.failed(exc)
                if self.error is not None:
                    return
                self._stop_event.wait(self.outage.backoff())
            except Exception as exc:  # Surfaced to the training thread at the next step end.
                if not self._stop_event.is_set():
                    self.error = exc
                return

    def _announced(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> list[int]:
        """The versions the updates stream's ``entries`` announce; a malformed one is skipped.

        Only services write the stream (on Redis 7; on 6.2 a rank's ACL user can too): an
        entry whose version is no positive integer is logged and passed over, not allowed to
        end the watcher and, with it, training. The schedule itself is read and checked
        from its own key.
        """
        versions = []
        for entry_id, fields in entries:
            if b"version" not in fields:
                continue
            raw = fields[b"version"]
            try:
                version = int(raw)
            except ValueError:
                version = 0
            if version < 1:
                logger.warning(
                    "rank %d: skipped entry %s of %s: 'version' is %r, not a positive integer",
                    self.rank,
                    entry_id.decode(),
                    keys.job_updates(self.job_id),
                    raw[:40],
                )
                continue
            versions.append(version)
        return versions

    def _take_newest(self, announced: int) -> None:
        # Only the newest few versions are kept in Redis: a watcher that fell behind fetches
        # the latest one rather than one that may be gone.
        newest = self._client.latest_version(self.job_id)
        if announced > newest:
            # A publish sets the version and announces it in one script: this entry was
            # written otherwise (on Redis 6.2 a rank's user can) and has no schedule.
            logger.warning(
                "rank %d: %s announces version %d, never published (the job's version is %d); "
                "skipped",
                self.rank,
                keys.job_updates(self.job_id),
                announced,
                newest,
            )
            if newest <= self._version:
                return
        try:
            schedule = self._client.fetch_schedule(self.job_id, newest, self.rank)
        except ProtocolError:
            # Gone since its version was read: the job was deleted or Redis lost it (the next
            # heartbeat says so), or a newer version replaced it (announced next).
            if self._client.latest_version(self.job_id) != newest:
                return
            raise
        with self._lock:
            if self._stop_event.is_set():  # stopped while it was read: no longer wanted
                return
            self._pending = schedule
            self._version = newest

    def _beat(self) -> None:
        self._next_beat = time.monotonic() + self.heartbeat_interval
        try:
            exists = self._client.heartbeat(self.job_id, self.rank)
        except WrongTokenError as exc:
            if self._stop_event.is_set():
                return
            # Training goes on (as for a lost job); said once, loudly.
            if not self.token_refused:
                self.token_refused = True
                logger.error("%s; this rank does not count as alive in `perseus status`", exc)
            return
        if exists or self.job_lost or self._stop_event.is_set():
            return
        self.job_lost = True
        logger.error(
            "job %s is gone from redis at %s (restarted without persistence, or deleted): "
            "rank %d keeps running schedule version %d, and its results go to %s. Restart "
            "training to register a new job.",
            self.job_id,
            self.client.where,
            self.rank,
            self._version,
            keys.DEADLETTER_STREAM,
        )

    def _note_error(self, error: str) -> None:
        # The stream says when a failure ends too: error='' once the scheduler computed again
        # (a new version, or an observation recorded by a requeued task that succeeded).
        if error == self.job_error:
            return
        failed, self.job_error = self.job_error, error
        if not error:
            logger.warning(
                "job %s: its scheduler computes again; the failure (%s) is over. Rank %d runs "
                "schedule version %d and takes new versions as they come.",
                self.job_id,
                failed,
                self.rank,
                self._version,
            )
            return
        logger.error(
            "job %s: its scheduler failed: %s. Rank %d keeps running schedule version %d; no "
            "new version comes until it computes again. Fix the cause, then run `rq requeue "
            "--queue perseus --all` or restart training (pass raise_on_job_error=True to "
            "PerseusOptimizer to stop training here instead).",
            self.job_id,
            error,
            self.rank,
            self._version,
        )

    def _note_announcements(self, versions: list[int]) -> None:
        # A version is announced once, unless Redis lost it (a crash within its fsync window)
        # and a worker published it again: results sent for it in between were refused.
        for version in versions:
            if version in self._seen and version == self._version:
                with self._lock:
                    self._republished = version
            self._seen.add(version)

    def take_republished(self) -> int | None:
        """The version this rank runs, if it was announced again since the last call."""
        with self._lock:
            republished, self._republished = self._republished, None
        return republished

    def take(self) -> FrequencySchedule | None:
        """The newest schedule published since the last call, if any."""
        with self._lock:
            pending, self._pending = self._pending, None
        return pending

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> bool:
        """Stop following; return whether the thread ended within ``timeout`` seconds.

        A command in flight (a blocked read, a heartbeat waiting for a reply that a silent
        network dropped) ends at once: its connection is closed under it, and it is not
        retried. The thread then takes nothing more: no schedule, no heartbeat, no log line.
        Only a thread caught inside a TCP connect to an unreachable host can outlive
        ``timeout`` (by the connect time-out, then its command's socket time-out); it is a
        daemon, which neither keeps the process alive nor acts once it wakes.
        """
        self._stop_event.set()
        if not _interrupt(self, self._client, timeout):
            logger.warning(
                "rank %d schedule watcher: still in a Redis call %.0f s after stop; left to "
                "end by itself (it does nothing more)",
                self.rank,
                timeout,
            )
            return False
        return True


class ResultReporter(threading.Thread):
    """Publishes profiling results from a queue; rides through Redis outages.

    Results wait in the queue while Redis is unreachable (one result per schedule version,
    so the queue stays short) and are sent once it is back, oldest first. A result is sent
    or counted in :attr:`unsent`, and said: once the thread has ended (stopped, past
    ``outage_timeout``, or an unexpected error, kept in :attr:`error`), what it held and
    every later :meth:`submit` are counted and logged, never dropped silently. Results go
    over connections of its own (:meth:`CoordinatorClient.background_client`), which
    :meth:`stop` cuts once ``flush_timeout`` has passed.

    Args:
        client: Sends the results.
        job_id: The job.
        outage_timeout: Seconds of Redis outage after which :attr:`error` is set (and the hook
            raises it); ``None`` retries forever.
        flush_timeout: At :meth:`stop`, seconds to keep trying to send what is queued.
    """

    def __init__(
        self,
        client: CoordinatorClient,
        job_id: str,
        outage_timeout: float | None = None,
        flush_timeout: float = 10.0,
    ) -> None:
        super().__init__(daemon=True, name="perseus-report")
        self.client, self.job_id = client, job_id
        self.flush_timeout = flush_timeout
        self._queue: queue.Queue[ProfilingResult | None] = queue.Queue()
        self.error: BaseException | None = None
        self.outage = Outage("result reporter", client.where, outage_timeout)
        self.sent = 0
        self.unsent = 0  # results not sent: given up on at stop, or after the thread ended
        self._stopping = threading.Event()
        self._flush_deadline = float("inf")
        self._ended = ""  # why the thread ended, once it has: later results are counted
        self._ending = threading.Lock()  # orders submit() against the thread's end
        self._client = client.background_client()

    def submit(self, result: ProfilingResult) -> None:
        """Queue a result; returns at once (counted in :attr:`unsent` if the thread ended)."""
        with self._ending:
            if not self._ended:
                self._queue.put(result)
                return
            self.unsent += 1
            unsent = self.unsent
        logger.warning(
            "result reporter: profiling result of schedule version %d (rank %d) of job %s not "
            "sent: the reporter has stopped (%s); %d result(s) not sent so far",
            result.schedule_version,
            result.rank,
            self.job_id,
            self._ended,
            unsent,
        )

    def run(self) -> None:
        """Send queued results until stopped (thread body)."""
        held = 0  # the result being sent when the thread ends, if any
        why = "stopped"
        try:
            while (result := self._queue.get()) is not None:
                held = 1
                if not self._deliver(result):
                    why = self._why_given_up()
                    return
                held = 0
        except Exception as exc:  # Raised on the training thread at the next step end.
            self.error = exc
            why = f"{type(exc).__name__}: {exc}"
        finally:
            self._end(held, why)

    def _why_given_up(self) -> str:
        state = "refusing this client" if self.outage.refused else "unreachable"
        if self.error is not None:
            return f"redis at {self.client.where} {state} past outage_timeout"
        return f"redis at {self.client.where} still {state} {self.flush_timeout:.0f} s after close"

    def _deliver(self, result: ProfilingResult) -> bool:
        """Send one result, retrying with backoff; False when this thread must end."""
        delay = 0.2
        while True:
            try:
                self._client.report(self.job_id, result)
            except TRANSIENT_ERRORS as exc:
                self.error = self.outage.failed(exc)
                if self.error is not None:
                    return False
                remaining = self._flush_deadline - time.monotonic()
                if remaining <= 0:
                    return False
                # Back off up to 5 s; stop() cuts a wait short, then the flush deadline rules.
                if not self._stopping.wait(delay):
                    delay = min(delay * 2, 5.0)
                else:
                    time.sleep(min(delay, remaining))
                continue
            self.sent += 1
            self.outage.recovered()
            return True

    def _end(self, count: int, why: str) -> None:
        """Count what the thread held and what is queued as unsent; later results likewise."""
        with self._ending:
            self._ended = why
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                count += item is not None
            self.unsent += count
        if count:
            logger.error(
                "result reporter: %d profiling result(s) of job %s not sent: %s",
                count,
                self.job_id,
                why,
            )

    def stop(self) -> None:
        """Send what is queued (for up to ``flush_timeout`` seconds), then stop.

        Returns within ``flush_timeout`` + :data:`STOP_TIMEOUT_S` seconds: a result still in
        flight then (its reply lost on a silent network, say) is cut off, and counted in
        :attr:`unsent` with what is queued behind it. Only a thread caught inside a TCP
        connect to an unreachable host outlives that (by the connect time-out); it counts
        and logs what it held when it ends.
        """
        self._flush_deadline = time.monotonic() + self.flush_timeout
        self._stopping.set()
        self._queue.put(None)
        if self.is_alive():
            self.join(timeout=self.flush_timeout)
        if not _interrupt(self, self._client, STOP_TIMEOUT_S):
            logger.warning(
                "result reporter: still in a Redis call %.0f s after close; what it holds is "
                "counted and logged when the call fails",
                self.flush_timeout + STOP_TIMEOUT_S,
            )
