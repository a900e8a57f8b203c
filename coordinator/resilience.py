"""Riding through Redis faults: the server checks at start, and backoff after an error."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis

from protocol import keys, rank_functions
from protocol.connection import SOCKET_TIMEOUT_S, socket_timeout_of
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


def check_read_timeout(conn: redis.Redis, block_s: float, what: str) -> None:
    """Refuse a client whose socket timeout would cut the loop's blocking reads short.

    A read that blocks ``block_s`` for entries needs its reply that long: a URL's
    ``?socket_timeout=`` at or below it timed out every idle read, and the loop only retried
    with backoff (logged once), handling entries seconds late. The minimum leaves
    :data:`STOP_GRACE_S` for the reply to travel.

    Args:
        conn: The loop's client (a URL's ``?socket_timeout=`` wins over the service's 30 s).
        block_s: The loop's longest blocking read, seconds.
        what: The loop, for the message (``coordinator HOST-PID``).

    Raises:
        ConfigError: The timeout is shorter than ``block_s`` + :data:`STOP_GRACE_S`.
    """
    timeout = socket_timeout_of(conn)
    least = block_s + STOP_GRACE_S
    if timeout is not None and timeout < least:
        raise ConfigError(
            f"{what}: socket_timeout={timeout:g} s (the Redis URL's ?socket_timeout=) is too "
            f"short: its reads block up to {block_s:g} s waiting for entries; give at least "
            f"?socket_timeout={least:g}, or leave it out ({SOCKET_TIMEOUT_S:g} s)"
        )


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


def tidy_up_within(
    tidy: Callable[[threading.Event], None],
    conn: redis.Redis,
    seconds: float,
    what: str,
    skipped: str,
) -> None:
    """Run a stop's tidy-up, ``tidy(abandoned)``, in a thread for ``seconds`` at most.

    Redis may hang: each command of the tidy-up would wait its socket timeout (30 s). Past
    ``seconds`` the tidy-up is abandoned: one line says so, ``abandoned`` is set (``tidy``
    then logs and does nothing more) and its command in flight is cut. It is over when this
    returns, so the caller may close ``conn``: the demo did so while it still waited, and
    its failure was logged after the line that said it was skipped.

    Args:
        tidy: The tidy-up; it checks ``abandoned`` before each step and each log line.
        conn: The client it uses.
        seconds: How long the stop waits for it.
        what: Names the stopping component in the log line.
        skipped: What is left undone, for the log line.

    Raises:
        BaseException: What ``tidy`` raised within ``seconds``.
    """
    failed: list[BaseException] = []
    abandoned = threading.Event()

    def run() -> None:
        try:
            tidy(abandoned)
        except BaseException as exc:  # raised by the caller, not printed by the thread's hook
            failed.append(exc)

    thread = threading.Thread(target=run, name="stop-tidy-up", daemon=True)
    thread.start()
    thread.join(seconds)
    if not thread.is_alive():
        if failed:
            raise failed[0]
        return
    abandoned.set()
    logger.warning(
        "%s: redis did not answer the stop's tidy-up within %g s; stopping without %s",
        what,
        seconds,
        skipped,
    )
    conn.connection_pool.disconnect()
    thread.join(STOP_GRACE_S)  # the cut command fails at once
