"""``perseus worker``'s loop: rq workers back to back, so that a Redis outage does not end it.

rq's work loop retries a lost connection only while it waits for a job. A Redis error anywhere
else (saving a job's outcome, updating its own state, a socket time-out, Redis out of memory)
makes it log "found an unhandled exception, quitting" and return or raise, and the process
would exit with the outage. This loop waits until Redis answers again and starts a fresh
worker instead, backing off (1 s doubling to 10 s) while workers keep quitting at once. It
ends when a stop is requested (SIGINT or SIGTERM, as rq handles them) or, in burst mode, when
rq's loop ends.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from rq import SimpleWorker, Worker

logger = logging.getLogger(__name__)

TEARDOWN_WAIT_S = 3.0
MAX_PAUSE_S = 10.0


class _StopAware:
    """Remembers that a warm shutdown was asked for (rq's hook for exactly that)."""

    stop_requested = False
    # rq doubles its reconnect wait up to 60 s: after a long outage a worker could sleep up to
    # a minute with Redis back. Schedules should follow within seconds.
    max_connection_wait_time = 5.0

    def handle_warm_shutdown_request(self) -> None:
        self.stop_requested = True
        super().handle_warm_shutdown_request()  # type: ignore[misc]

    def teardown(self) -> None:
        """Run rq's teardown (record the worker's death, unsubscribe), for at most a few seconds.

        Right after a Redis restart or failover it can hang: redis-py retries a lost connection
        with backoff (seen: 11 s), and rq's pubsub thread and its unsubscribe can race on the
        reconnected connection and wait a whole socket timeout (seen: 30 s). A stopping worker
        must not outlive ``docker stop``'s grace period for a record that is best effort anyway:
        rq's registry cleanup drops a worker whose key has expired.
        """
        thread = threading.Thread(
            target=super().teardown,  # type: ignore[misc]
            name="rq-teardown",
            daemon=True,
        )
        thread.start()
        thread.join(TEARDOWN_WAIT_S)
        if thread.is_alive():
            logger.warning(
                "rq worker %s: recording its exit in Redis took over %.0f s; exiting without it",
                self.name,  # type: ignore[attr-defined]
                TEARDOWN_WAIT_S,
            )


class PerseusWorker(_StopAware, Worker):
    """rq's forking worker that knows whether it was asked to stop."""


class PerseusSimpleWorker(_StopAware, SimpleWorker):
    """rq's in-process worker that knows whether it was asked to stop."""


def wait_for_redis(
    conn: redis.Redis, stop: threading.Event, first_delay: float = 0.5, max_delay: float = 5.0
) -> bool:
    """Ping ``conn`` with backoff until it answers (True) or ``stop`` is set (False)."""
    delay = first_delay
    while not stop.is_set():
        try:
            conn.ping()
            return True
        except redis.RedisError:
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
    """
    restarts = 0
    pause = 0.0
    stop = threading.Event()

    def request_stop(signum: int, frame: Any) -> None:
        stop.set()

    while True:
        worker = make_worker()
        started = time.monotonic()
        try:
            worker.work(burst=burst, logging_level=logging_level)
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
        # Its death may not have been recorded during the outage; without it, rq refuses a
        # new worker of the same name.
        with contextlib.suppress(redis.RedisError):
            worker.register_death()
