"""What both Perseus rq workers add to rq's: stops kept, heartbeats batched, records restored."""

from __future__ import annotations

import logging
import threading
from typing import Any

import redis
from rq import Queue, worker_registration
from rq.exceptions import StopRequested
from rq.utils import now

from coordinator.abandoned import clean_registries
from coordinator.worker_names import PROCESS_FIELD, process_identity
from coordinator.worker_outage import OutageLog
from coordinator.worker_suspend import SuspendAwareQueue, TakenWhileSuspended

# The worker loop's logger: what a worker says keeps the name it had before this split off.
logger = logging.getLogger("coordinator.worker_loop")

TEARDOWN_WAIT_S = 3.0


class StopAware:
    """Remembers that a warm shutdown was asked for (rq's hook for exactly that)."""

    stop_requested = False
    # Workers of the same loop whose death Redis did not take (see :meth:`register_birth`).
    earlier_deaths: list[Any] = []  # noqa: RUF012 - the loop gives each worker its own list
    # rq doubles its reconnect wait up to 60 s: after a long outage a worker could sleep up to
    # a minute with Redis back. Schedules should follow within seconds.
    max_connection_wait_time = 5.0

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        if self.queue_class is Queue:  # type: ignore[has-type]  # a caller's own is kept
            # Its dequeue reads rq's suspension with each task it takes (set after rq's
            # __init__, which wants the queues it is given to be of this class).
            self.queue_class = SuspendAwareQueue
        # rq logs an ERROR per failed reconnect (each 1-5 s, and each 2 s from its pubsub
        # thread): one line per outage instead, and one when Redis answers again.
        self.log: Any = OutageLog(self.log, self.name)  # type: ignore[attr-defined]

    def serialize(self) -> dict[str, Any]:
        """The record rq keeps of the worker, and which process it is (see :func:`claim_name`)."""
        record: dict[str, Any] = super().serialize()  # type: ignore[misc]
        identity = process_identity(self.pid)  # type: ignore[attr-defined]
        if identity is not None:
            record[PROCESS_FIELD] = identity
        return record

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        """Send rq's heartbeat (worker hash and TTLs): its three commands in one round trip.

        rq sends them one by one when given no pipeline, twice around every task: on the
        path from dequeuing a task to running it, that is two round trips for nothing. The
        same round trip checks that Redis still has the worker's record (see
        :meth:`_register_again`).
        """
        if pipeline is not None:
            super().heartbeat(timeout, pipeline=pipeline)  # type: ignore[misc]
            return
        with self.connection.pipeline(transaction=False) as pipe:  # type: ignore[attr-defined]
            pipe.hexists(self.key, "birth")  # type: ignore[attr-defined]
            # rq's heartbeats of a forked task rebuild the whole hash, but not the registry.
            pipe.sismember(worker_registration.REDIS_WORKER_KEYS, self.key)  # type: ignore[attr-defined]
            super().heartbeat(timeout, pipeline=pipe)  # type: ignore[misc]
            born, listed = pipe.execute()[:2]
        self.log.answered()
        if not (born and listed):
            self._register_again()

    def clean_registries(self) -> None:
        """Run rq's registry maintenance (every ten minutes), judging tasks by Redis's clock.

        rq's own compares the expiry each task's worker stamped with this worker's clock: a
        worker minutes ahead failed the others' running tasks as abandoned. See
        :mod:`coordinator.abandoned`; the rest is rq's maintenance as rq does it.
        """
        for queue in self.queues:  # type: ignore[attr-defined]
            if not queue.acquire_maintenance_lock():
                continue  # another worker (or a coordinator's sweep) is at it
            try:
                logger.info("rq worker %s: cleaning registries of queue %s", self.name, queue.name)  # type: ignore[attr-defined]
                clean_registries(queue, self._exc_handlers)  # type: ignore[attr-defined]
                worker_registration.clean_worker_registry(queue)
                intermediate = getattr(queue, "intermediate_queue", None)
                if intermediate is not None:
                    intermediate.cleanup(self, queue)
            finally:
                queue.release_maintenance_lock()
        self.last_cleaned_at = now()

    def _register_again(self) -> None:
        """Write the worker's record and registry entries again: Redis lost them.

        After Redis comes back without its data (no persistence, a failover to an empty
        replica), rq's heartbeat only recreates a partial worker hash: ``rq info`` and
        ``perseus status`` would count no worker while this one serves.
        """
        logger.warning(
            "rq worker %s: its record was gone from Redis (restarted without its data?); "
            "registering it again",
            self.name,  # type: ignore[attr-defined]
        )
        with self.connection.pipeline() as pipe:  # type: ignore[attr-defined]
            pipe.hset(self.key, mapping=self.serialize())  # type: ignore[attr-defined]
            worker_registration.register(self, pipe)
            pipe.expire(self.key, self.worker_ttl + 60)  # type: ignore[attr-defined]
            pipe.execute()

    def register_birth(self) -> None:
        """Register as rq does, then record the deaths Redis refused (out of memory, read-only).

        Such an earlier worker of this loop stayed in rq's registry: ``rq info`` and ``perseus
        status`` counted it beside this one until its key expired, minutes later.
        """
        super().register_birth()  # type: ignore[misc]
        for earlier in list(self.earlier_deaths):
            try:
                if earlier.key != self.key:  # type: ignore[attr-defined]  # same name: replaced
                    earlier.register_death()
            except redis.RedisError as exc:
                logger.debug("rq worker %s: death still not recorded: %s", earlier.name, exc)
            else:
                self.earlier_deaths.remove(earlier)

    def handle_warm_shutdown_request(self) -> None:
        """Remember that a stop was asked for, then handle it as rq does."""
        # rq stops an idle worker by raising StopRequested from its signal handler, wherever
        # the main thread is. Inside a log call (rq logs each task it takes) logging swallows
        # it ("--- Logging error ---") and the worker went on for ever. rq's loop also checks
        # this flag before each dequeue: the stop then happens after the task at hand.
        self.stop_requested = True
        self._stop_requested = True
        super().handle_warm_shutdown_request()  # type: ignore[misc]

    def dequeue_job_and_maintain_ttl(self, timeout: int | None, *args: Any, **kw: Any) -> Any:
        """Take a task as rq does, unless a stop was asked for (its StopRequested may be lost).

        A task that arrives while workers are suspended stays queued; the worker waits for
        ``rq resume`` (:mod:`coordinator.worker_suspend`).
        """
        while True:
            if self.stop_requested:
                raise StopRequested()
            try:
                return super().dequeue_job_and_maintain_ttl(timeout, *args, **kw)  # type: ignore[misc]
            except TakenWhileSuspended:
                self.check_for_suspension(timeout is None)  # type: ignore[attr-defined]

    def teardown(self) -> None:
        """Run rq's teardown (record the worker's death, unsubscribe), for at most a few seconds.

        Right after a Redis restart or failover it can hang: redis-py retries a lost connection
        with backoff (seen: 11 s), and rq's pubsub thread and its unsubscribe can race on the
        reconnected connection and wait a whole socket timeout (seen: 30 s). A stopping worker
        must not outlive ``docker stop``'s grace period for a record that is best effort anyway:
        rq's registry cleanup drops a worker whose key has expired.
        """
        rq_teardown = super().teardown  # type: ignore[misc]

        def record() -> None:
            try:
                rq_teardown()
            except redis.RedisError as exc:  # Redis is down: one line, not a thread's traceback
                logger.warning("rq worker %s: exit not recorded in Redis (%s)", self.name, exc)  # type: ignore[attr-defined]

        thread = threading.Thread(target=record, name="rq-teardown", daemon=True)
        thread.start()
        thread.join(TEARDOWN_WAIT_S)
        if thread.is_alive():
            logger.warning(
                "rq worker %s: recording its exit in Redis took over %.0f s; exiting without it",
                self.name,  # type: ignore[attr-defined]
                TEARDOWN_WAIT_S,
            )
