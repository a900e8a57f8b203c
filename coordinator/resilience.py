"""Riding through Redis faults: the server checks at start, and backoff after an error."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from protocol import keys, rank_functions
from protocol.exceptions import ConfigError

logger = logging.getLogger(__name__)

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


def ensure_groups(conn: redis.Redis, consumer: str | None = None) -> None:
    """Create the consumer group on every input stream (from the start, so nothing is missed).

    Args:
        conn: A service user's connection.
        consumer: Also make this coordinator a member on every stream (``XGROUP
            CREATECONSUMER``). A blocking read adds no member until an entry comes, so after
            the group was re-created ``perseus status`` counted no consumer on a stream that
            this coordinator served.
    """
    for stream in keys.INPUT_STREAMS:
        try:
            conn.xgroup_create(stream, keys.COORDINATOR_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        if consumer is not None:
            conn.xgroup_createconsumer(stream, keys.COORDINATOR_GROUP, consumer)


def prepare_server(
    conn: redis.Redis, redis_version: str | None = None, consumer: str | None = None
) -> None:
    """Set up the input streams' consumer groups and, on Redis 7, the ranks' functions.

    The ranks' user on Redis 7 may run no script of its own. Run at start, and again when
    Redis lost them (a restart without persistence).

    Args:
        conn: A service user's connection.
        redis_version: The server's ``redis_version``, if read already.
        consumer: The coordinator's consumer name: a member of the group on every stream.
    """
    ensure_groups(conn, consumer)
    version = redis_version or str(conn.info("server")["redis_version"])
    rank_functions.install(conn, version)


class Backoff:
    """Waits after Redis errors: delays double up to a limit; each kind is logged once.

    An out-of-memory Redis (``noeviction``), a read-only replica during a failover, a lost
    connection: all are waited out, nothing acknowledged meanwhile is lost.

    Args:
        stop: Cuts a wait short.
        what: Names the waiting component in log messages.
        first: First delay (s).
        longest: Longest delay (s).
    """

    def __init__(
        self, stop: threading.Event, what: str, first: float = 0.5, longest: float = 5.0
    ) -> None:
        self.stop, self.what, self.first, self.longest = stop, what, first, longest
        self.delay = first
        self.failing: str | None = None  # the error of the ongoing outage

    def failed(self, exc: redis.RedisError) -> None:
        """Log ``exc`` (once per kind of error) and wait the current delay.

        Once stopped, nothing is retried: the error (often the stop cutting the command in
        flight, see :func:`cut_when_stop_hangs`) is not announced as an outage.
        """
        if self.stop.is_set():
            return
        kind = type(exc).__name__
        if self.failing != kind:
            logger.warning(
                "%s: redis error (%s: %s); retrying with backoff up to %g s",
                self.what,
                kind,
                exc,
                self.longest,
            )
        self.failing = kind
        self.stop.wait(self.delay)
        self.delay = min(self.delay * 2, self.longest)

    def succeeded(self) -> None:
        """Note a round that worked: the next error waits the first delay again."""
        if self.failing is not None:
            logger.warning("%s: redis answers again (after %s)", self.what, self.failing)
        self.failing = None
        self.delay = self.first


STOP_GRACE_S = 1.0
"""How long, past its longest blocking read, a loop's command in flight may hold a stop."""


@contextmanager
def cut_when_stop_hangs(
    conn: redis.Redis, stop: threading.Event, what: str, grace: float
) -> Iterator[None]:
    """Inside the block, a stop that a command in flight holds past ``grace`` s cuts it.

    A loop checks its stop event between commands. Redis that hangs (a stopped server, a
    network that drops packets) answers nothing and closes nothing, so the command in flight
    waited its whole socket timeout (30 s) before the loop saw the stop: past ``docker stop``'s
    grace period of 10 s. Once stopped, a watching thread waits ``grace`` s for the block to
    end (a healthy Redis answers a blocking read within its block time), then disconnects every
    connection of ``conn``'s pool until it ends: the command fails with a ``ConnectionError``.
    Nothing is lost: entries a cut read was handed stay pending for this consumer, and any
    coordinator's claim of stale entries picks them up.

    Args:
        conn: The client whose commands the block runs (its pool's connections are cut).
        stop: The loop's stop event.
        what: Names the loop in the log message.
        grace: Seconds a stopped block may still run before its connections are cut.
    """
    done = threading.Event()

    def watch() -> None:
        while not stop.wait(0.5):  # polled: a block that ends unstopped ends this thread too
            if done.is_set():
                return
        if done.wait(grace):
            return
        logger.warning(
            "%s: redis did not answer within %g s of the stop; cutting its connections",
            what,
            grace,
        )
        # Again and again: another command may begin between the loop's check and the cut.
        while not done.wait(0.1):
            conn.connection_pool.disconnect()

    watcher = threading.Thread(target=watch, name="stop-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        if stop.is_set():  # a cut under way ends first: it must not hit what follows the block
            watcher.join()
