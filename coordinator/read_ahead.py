"""The coordinator's stream reads on a connection of their own; the next read rides with a write."""

from __future__ import annotations

from typing import Any

import redis
from redis.connection import AbstractConnection

from protocol import keys


class InputReader:
    """Reads the input streams for one consumer, and can send the next blocking read early.

    A rank that registers waits for the script that stores and answers its request. The
    coordinator then settles the batch (bookkeeping, acknowledgements, rq work) and reads
    again; sent only then, its read reaches Redis after the rank's next request, and that
    request waits a whole round trip more. :meth:`send_with_read` puts the next blocking read
    in the same write as the script: Redis runs the script, answers the rank, and holds the
    read until the next request arrives. :meth:`read` collects it.

    The reader keeps one connection of ``conn``'s pool for itself (its commands must not
    interleave with others'); after an error it gives it back, and the next read takes one
    again (a sentinel pool then finds the current master). Entries that a dropped read had
    been handed stay pending for this consumer: any coordinator's claim of stale entries
    (:func:`protocol.streams.claim_stale`) picks them up, as after a crash.

    Args:
        conn: A client on the coordinator's Redis: its pool lends the connection and its
            response callbacks parse the replies.
        consumer: The consumer name in :data:`protocol.keys.COORDINATOR_GROUP`.
        count: Most entries per stream in one read.
    """

    def __init__(self, conn: redis.Redis, consumer: str, count: int) -> None:
        self.conn = conn
        self.consumer = consumer
        self.count = count
        self._connection: AbstractConnection | None = None
        self._ahead = False  # a read was sent with a write and not collected yet

    @property
    def read_pending(self) -> bool:
        """Whether a read sent with a write waits to be collected by :meth:`read`."""
        return self._ahead

    def _command(self, start: str, block_ms: int | None) -> tuple[Any, ...]:
        streams = keys.INPUT_STREAMS
        block = () if block_ms is None else ("BLOCK", block_ms)
        return (
            "XREADGROUP",
            "GROUP",
            keys.COORDINATOR_GROUP,
            self.consumer,
            "COUNT",
            self.count,
            *block,
            "STREAMS",
            *streams,
            *[start] * len(streams),
        )

    def _link(self) -> AbstractConnection:
        if self._connection is None:
            self._connection = self.conn.connection_pool.get_connection()
        return self._connection

    def read(self, start: str, block_ms: int | None) -> list[tuple[str, str, dict[bytes, bytes]]]:
        """Read every input stream from ``start`` (``>``: new entries; ``0``: our pending ones).

        A read sent early by :meth:`send_with_read` is collected instead, whatever the
        arguments (it was sent with the loop's own ``>`` and block time).

        Returns:
            ``(stream, entry id, fields)`` of each entry read.

        Raises:
            redis.RedisError: Redis failed; the reader has dropped its connection.
        """
        try:
            link = self._link()
            if not self._ahead:
                link.send_command(*self._command(start, block_ms))
            self._ahead = False
            reply = self.conn.parse_response(link, "XREADGROUP")
        except redis.ResponseError:
            raise  # The reply was an error: the connection is still in step.
        except BaseException:
            self.reset()
            raise
        return [(s.decode(), e.decode(), f) for s, entries in reply or [] for e, f in entries]

    def send_with_read(self, command: tuple[Any, ...], block_ms: int) -> Any:
        """Send ``command`` and, in the same write, the next blocking read of new entries.

        Args:
            command: A command's arguments, e.g. ``("EVALSHA", sha, 2, key1, key2, arg)``.
            block_ms: How long the read may block.

        Returns:
            ``command``'s reply, or the ``redis.ResponseError`` Redis answered (as a
            pipeline with ``raise_on_error=False`` returns it); the read stays pending.

        Raises:
            RuntimeError: A read is pending already (collect it with :meth:`read` first).
            redis.RedisError: The connection failed; the reader has dropped it.
        """
        if self._ahead:
            raise RuntimeError("a read is pending already: collect it before sending another")
        try:
            link = self._link()
            link.send_packed_command(link.pack_commands([command, self._command(">", block_ms)]))
            self._ahead = True
            try:
                return self.conn.parse_response(link, str(command[0]))
            except redis.ResponseError as exc:
                return exc
        except BaseException:
            self.reset()
            raise

    def reset(self) -> None:
        """Drop the connection (and any read pending on it); the next read takes another."""
        link, self._connection, self._ahead = self._connection, None, False
        if link is not None:
            link.disconnect()
            self.conn.connection_pool.release(link)
