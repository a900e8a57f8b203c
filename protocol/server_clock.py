"""The Redis server's clock as seen from this process: the one clock perseus-mq times things by."""

from __future__ import annotations

import time

import redis

REFRESH_S = 10.0
"""A clock not synchronized for this long asks the server again before answering."""
STEP_S = 1.0
"""A local clock that moved this much more (or less) than elapsed time was stepped: resync."""


class ServerClock:
    """Redis ``TIME``, read once in a while and followed with the local clock in between.

    Heartbeats are stamped by the server (a Lua script calls ``TIME``); every other activity
    stamp and every comparison with them (idle GC, stall detection, ``perseus status``) uses
    this clock, so that a coordinator, worker or rank whose clock is off by days neither
    deletes live jobs nor keeps dead ones. The offset to the local clock is measured with one
    ``TIME`` round trip (half of it is the error bound), again every ``refresh_s`` and as soon
    as the local clock is stepped (NTP, an operator).

    Args:
        conn: The Redis whose clock counts.
        refresh_s: Seconds after which :meth:`now` measures the offset again.
    """

    def __init__(self, conn: redis.Redis, refresh_s: float = REFRESH_S) -> None:
        self.conn = conn
        self.refresh_s = refresh_s
        self._offset: float | None = None
        self._synced_mono = 0.0  # time.monotonic() at the last measurement
        self._synced_wall = 0.0  # time.time() then

    @classmethod
    def of(cls, conn: redis.Redis) -> ServerClock:
        """The clock shared by every user of the client ``conn`` (kept on it: one sync each)."""
        clock = getattr(conn, "_perseus_clock", None)
        if not isinstance(clock, cls):
            clock = cls(conn)
            conn._perseus_clock = clock
        return clock

    def sync(self) -> float:
        """Ask the server for its time (one round trip); return it, in unix seconds."""
        before = time.time()
        seconds, micros = self.conn.time()
        after = time.time()
        server = seconds + micros / 1e6
        self._offset = server - (before + after) / 2
        self._synced_mono, self._synced_wall = time.monotonic(), after
        return server

    def now(self) -> float:
        """The server's time now, in unix seconds (a round trip only when due for a refresh)."""
        wall, mono = time.time(), time.monotonic()
        elapsed = mono - self._synced_mono
        if (
            self._offset is None
            or elapsed >= self.refresh_s
            or abs((wall - self._synced_wall) - elapsed) > STEP_S
        ):
            return self.sync()
        return wall + self._offset
