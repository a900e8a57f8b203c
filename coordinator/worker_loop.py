"""``perseus worker``'s loop: rq workers back to back, so that a Redis outage does not end it.

rq's work loop retries a lost connection only while it waits for a job. A Redis error anywhere
else (saving a job's outcome, updating its own state, a socket time-out, Redis out of memory)
makes it log "found an unhandled exception, quitting" and return or raise, and the process
would exit with the outage. This loop waits until Redis answers again and starts a fresh
worker instead, backing off (1 s doubling to 10 s) while workers keep quitting at once. It
ends when a stop is requested (SIGINT or SIGTERM, as rq handles them; SIGHUP as SIGTERM) or,
in burst mode, when rq's loop ends.

The worker classes also trim rq's round trips around a task (the same writes, fewer waits):
heartbeats in one pipeline, and for the long-lived worker none between taking a task and
starting it, whose transaction also records the execution and makes an advance task's first
read. The long-lived worker sends rq's heartbeats during a task from a thread, as rq's forking
worker does, so that rq notices a killed worker within a minute and a half
(:mod:`coordinator.task_beats`).

A worker named on the command line whose name is still registered by a dead worker takes the
name over when it can tell that worker is dead (same machine and PID namespace, process gone:
:func:`coordinator.worker_names.claim_name`); otherwise it stops with an error that says
what to do.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from rq import Queue, SimpleWorker, Worker
from rq.executions import Execution
from rq.job import Job
from rq.utils import now
from rq.version import VERSION as RQ_VERSION
from rq.worker import BaseWorker, WorkerStatus

from coordinator.task_beats import TaskBeats
from coordinator.tasks import (
    forget_start,
    lease_before_fork,
    queue_start,
    release_after_horse,
)
from coordinator.worker_base import StopAware
from coordinator.worker_names import claim_name
from coordinator.worker_outage import OutageLog
from protocol.acl import refused, wrong_user
from protocol.exceptions import ConfigError

logger = logging.getLogger(__name__)

MAX_PAUSE_S = 10.0


class PerseusWorker(StopAware, Worker):
    """rq's forking worker that knows whether it was asked to stop.

    It chooses an advance task's lease token before forking the task's work horse, and
    releases the lease once it has reaped a horse that did not exit by itself (rq's cold stop
    kills it with SIGKILL): the job no longer waits for the lease to expire.
    """

    _horse_task: Job | None = None  # the task of the horse being waited for

    def execute_job(self, job: Job, queue: Queue) -> None:
        """Run the task in a work horse as rq does, its lease token chosen first."""
        lease_before_fork(job)
        self._horse_task = job
        try:
            super().execute_job(job, queue)
        finally:
            self._horse_task = None
            release_after_horse(self.connection, job, clean=True)  # forget the token

    def wait_for_horse(self) -> tuple[int | None, int | None, Any]:
        """Reap the horse as rq does; release the lease of one that was killed or failed."""
        pid, stat, rusage = super().wait_for_horse()
        task = self._horse_task
        if pid is not None and stat is not None and task is not None:
            clean = os.WIFEXITED(stat) and os.WEXITSTATUS(stat) == 0
            release_after_horse(self.connection, task, clean)
        return pid, stat, rusage


# rq 3's worker records an execution, then the job's start, each in its own transaction.
_ONE_PREPARE = int(RQ_VERSION.split(".")[0]) >= 3


class PerseusSimpleWorker(StopAware, SimpleWorker):
    """rq's in-process worker that knows whether it was asked to stop.

    With rq 3 it also records a task's execution and its start in one transaction (rq sends
    two, one after the other): the same writes, one round trip less before every task. An
    advance task's first read (the job's lease and state) goes in that transaction too
    (:func:`coordinator.tasks.queue_start`).
    """

    _prepared: Any = None  # the pipeline holding a task's execution record, not sent yet
    _dequeued = False  # a task was just taken, and rq's next heartbeat is the one after that
    _beats: TaskBeats | None = None

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        """The forking worker's TTL (a minute past the next beat), not the task's time-out.

        :class:`TaskBeats` beats during the task, so rq's records of the worker and the task
        expire a minute and a half after the worker dies, not an hour or a day.
        """
        return BaseWorker.get_heartbeat_ttl(self, job, working_time)

    def reorder_queues(self, reference_queue: Queue) -> None:
        """Note that a task was taken (rq calls this then, right before a heartbeat)."""
        self._dequeued = _ONE_PREPARE
        super().reorder_queues(reference_queue)

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        """Send rq's heartbeat, except the one right after taking a task.

        That one would delay the task by a round trip for nothing: the task's start, a moment
        later, beats in its transaction, and the beat before the blocking dequeue left the
        worker's key minutes to live (its TTL is rq's dequeue time-out plus a minute).
        """
        if pipeline is None and self._dequeued:
            self._dequeued = False
            return
        super().heartbeat(timeout, pipeline)

    def prepare_execution(self, job: Job) -> Execution:
        """Queue rq's ``prepare_execution`` writes for :meth:`prepare_job_execution` to send."""
        if not _ONE_PREPARE:
            return super().prepare_execution(job)
        pipe = self.connection.pipeline()
        execution = Execution.create(
            job, self.get_heartbeat_ttl(job), pipeline=pipe, worker_name=self.name
        )
        self.executions[execution.id] = execution
        self.set_state(WorkerStatus.BUSY, pipeline=pipe)
        self._prepared = pipe
        return execution

    def prepare_job_execution(self, job: Job, remove_from_intermediate_queue: bool = False) -> None:
        """Send rq's ``prepare_job_execution`` writes with the execution's record, one MULTI."""
        pipe, self._prepared = self._prepared, None
        self._dequeued = False
        if pipe is None:
            super().prepare_job_execution(job, remove_from_intermediate_queue)
            return
        with pipe:
            ttl = self.get_heartbeat_ttl(job)
            self.heartbeat(ttl, pipeline=pipe)
            job.heartbeat(now(), ttl, pipeline=pipe)
            job.prepare_for_execution(self.name, pipeline=pipe)
            pipe.persist(job.key)
            if remove_from_intermediate_queue:
                queue = Queue(job.origin, connection=self.connection)
                pipe.lrem(queue.intermediate_queue_key, 1, job.id)
            read = queue_start(job, pipe)
            replies = pipe.execute(raise_on_error=read is None)
        if read is not None:
            # An error in rq's writes fails the task as rq's own would (perform_job then
            # releases the lease the read took); one in the task's read is the task's to meet
            # (advance_job handles it as its own read's).
            ours = len(replies) - read.count
            read.keep(replies[ours:])
            if errors := [r for r in replies[:ours] if isinstance(r, Exception)]:
                raise errors[0]

    def perform_job(self, job: Job, queue: Queue, execution: Execution) -> bool:
        """Run the task as rq does, with heartbeats, then release a lease its start left unused."""
        if self._beats is None:
            self._beats = TaskBeats(self)
        self._beats.start(job, execution)
        try:
            return bool(super().perform_job(job, queue, execution))
        finally:
            self._beats.stop()
            forget_start(self.connection, job)

    def teardown(self) -> None:
        """Stop the task heartbeats' thread, then tear down as :class:`StopAware` does."""
        if self._beats is not None:
            self._beats.close()
        super().teardown()


def wait_for_redis(
    conn: redis.Redis, stop: threading.Event, first_delay: float = 0.5, max_delay: float = 5.0
) -> bool:
    """Ping ``conn`` with backoff until it answers (True) or ``stop`` is set (False).

    A refusal (a wrong password, a disabled user: its operator must act, waiting alone does
    not help) is logged once as an error that says so; the pings go on, for the operator's fix.
    """
    delay = first_delay
    said = False
    while not stop.is_set():
        try:
            conn.ping()
            return True
        except redis.RedisError as exc:
            if refused(exc) and not said:
                said = True
                logger.error(
                    "redis refuses this worker (%s): not an outage; check the user name, "
                    "password and ACL of its --redis-url. Trying again until it answers",
                    exc,
                )
            stop.wait(delay)
            delay = min(delay * 2, max_delay)
    return False


def run_workers(
    make_worker: Callable[[], PerseusWorker | PerseusSimpleWorker],
    *,
    burst: bool = False,
    logging_level: str | None = None,
) -> int:
    """Run rq workers from ``make_worker`` until one is asked to stop; return the restarts.

    Args:
        make_worker: Builds a fresh worker (same queues, connection and name each time).
        burst: rq's burst mode: return when the queue is empty (no restart either).
        logging_level: Passed to rq.

    Raises:
        ConfigError: The first worker was refused a command (NOPERM): not the service user; or
            its name is registered by a worker that may be alive (:func:`claim_name`).
    """
    found = {sig: signal.getsignal(sig) for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)}
    if found[signal.SIGHUP] is not signal.SIG_IGN:  # the terminal closed (not under nohup)
        signal.signal(signal.SIGHUP, _hangup_as_terminate)
    try:
        return _run_workers(make_worker, burst, logging_level)
    finally:  # a caller's own handlers (run in-process)
        for sig, handler in found.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def _hangup_as_terminate(signum: int, frame: Any) -> None:
    """SIGHUP (the terminal closed) does what SIGTERM does now: rq's warm stop.

    Python's default ended the process with its task unfinished and its record left in Redis.
    """
    handler = signal.getsignal(signal.SIGTERM)
    if callable(handler):
        handler(signal.SIGTERM, frame)
    else:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGHUP)


def _run_workers(
    make_worker: Callable[[], PerseusWorker | PerseusSimpleWorker],
    burst: bool,
    logging_level: str | None,
) -> int:
    restarts = 0
    pause = 0.0
    stop = threading.Event()
    claimed = False  # the name is ours: later workers of this loop re-register it
    worker: PerseusWorker | PerseusSimpleWorker | None = None
    unrecorded: list[PerseusWorker | PerseusSimpleWorker] = []  # deaths Redis did not take

    def request_stop(signum: int, frame: Any) -> None:
        # Also the next worker's, until its work() installs rq's handlers: a stop asked for
        # between the wait for Redis and then was lost, and that worker served on.
        stop.set()
        if worker is not None:
            worker.stop_requested = True
            worker._stop_requested = True  # rq's flag, checked before each wait for a task

    # The first worker's too: a stop before its work() installed rq's handlers killed it.
    signal.signal(signal.SIGTERM, request_stop)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # not under `&` in a script
        signal.signal(signal.SIGINT, request_stop)
    while True:
        worker = make_worker()
        worker.earlier_deaths = unrecorded
        if stop.is_set():  # asked for while it was being made
            return restarts
        started = time.monotonic()
        try:
            if not claimed:
                claim_name(worker)
                claimed = True
            worker.work(burst=burst, logging_level=logging_level)
        except ValueError as exc:
            # rq's own check of the name: another worker registered it since we looked, or an
            # outage kept this loop's previous worker from recording its death.
            if isinstance(exc, ConfigError):
                raise
            try:
                claim_name(worker)  # raises the error that names the key and what to do
            except redis.RedisError as err:
                # Redis still refuses writes (OOM, read-only): take the name back once it
                # takes them, as after any other outage, rather than end the process.
                logger.warning("rq worker %s could not take back its name: %s", worker.name, err)
            else:
                # Taken over (the record was this process's own): start a fresh worker at once.
                continue
        except redis.exceptions.NoPermissionError as exc:
            if restarts == 0:  # Never ran: not an outage that ended it.
                raise wrong_user(f"rq worker {worker.name}", exc) from None
            logger.warning("rq worker %s quit on a redis error: %s", worker.name, exc)
        except redis.RedisError as exc:
            # rq's teardown (recording the worker's death) needs Redis as well; or Redis is
            # full (OOM) or read-only: wait and start again.
            logger.warning("rq worker %s quit on a redis error: %s", worker.name, exc)
        if burst or worker.stop_requested:
            return restarts
        restarts += 1
        # A pause, so that a loop that quits at once (Redis full, say) does not spin.
        quick = time.monotonic() - started < MAX_PAUSE_S
        pause = min(max(pause * 2, 1.0), MAX_PAUSE_S) if quick else 1.0
        logger.warning(
            "rq worker %s left its work loop (see the error above); starting a new rq worker "
            "once redis answers (restart %d, in %.0f s)",
            worker.name,
            restarts,
            pause,
        )
        # rq's handlers belong to the old worker, whose Redis calls would fail now.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, request_stop)
        if stop.wait(pause) or not wait_for_redis(worker.connection, stop):
            return restarts
        # An outage that this worker logged (its pubsub thread, its wait for a task) ends
        # here: the next worker's log knows nothing of it.
        if isinstance(worker.log, OutageLog):
            worker.log.answered()
        # Its death may not have been recorded during the outage; without it, rq refuses a
        # new worker of the same name. Redis may answer and still refuse writes (out of
        # memory): the next worker's birth records it then.
        try:
            worker.register_death()
        except redis.RedisError:
            unrecorded.append(worker)
