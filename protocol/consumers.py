"""Consumers of the coordinators' group: a stopped coordinator leaves it, a gone one is removed.

``XGROUP DELCONSUMER`` drops the consumer's pending entries with it, so a consumer is only
deleted by a script that first checks it has none: entries a coordinator left pending are
claimed by the others (XAUTOCLAIM) first, and nothing is lost.
"""

from __future__ import annotations

import logging
import threading

import redis

from protocol import keys

logger = logging.getLogger(__name__)

# Deletes a consumer from a stream's group if it has no pending entries (atomically, so no
# entry can be delivered to it between the check and the delete).
# KEYS[1] the stream. ARGV[1] consumer group, ARGV[2] consumer.
# Returns 1 deleted (or was no member), 0 kept (it has pending entries), -1 no stream or group.
LEAVE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local pending = redis.pcall('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if pending.err then return -1 end
if #pending > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


class GroupMembers:
    """The coordinators' memberships of the input streams' consumer group.

    Args:
        conn: redis-py client.
    """

    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn
        self._leave = conn.register_script(LEAVE)

    def leave(self, consumer: str) -> int:
        """Leave every input stream's group where ``consumer`` has nothing pending.

        Returns:
            Streams where it stays a member: its pending entries wait there for another
            coordinator to claim them, and a later sweep removes it.
        """
        stays = 0
        for stream in keys.INPUT_STREAMS:
            left = int(self._leave(keys=[stream], args=[keys.COORDINATOR_GROUP, consumer]))
            stays += left == 0
        return stays

    def leave_on_stop(self, consumer: str, quiet: threading.Event | None = None) -> None:
        """:meth:`leave`, as a coordinator stops cleanly: logs what it did, never raises.

        Entries still pending stay for the other coordinators to claim (XAUTOCLAIM); a later
        sweep removes the consumer once they have.

        Args:
            consumer: The coordinator's consumer name.
            quiet: Once set, a failure is not logged: the stop went on without this and said
                so, and the failure is its cut.
        """
        try:
            stays = self.leave(consumer)
        except redis.RedisError as exc:
            if quiet is None or not quiet.is_set():
                logger.warning("coordinator %s: could not leave the group: %s", consumer, exc)
            return
        if stays:
            logger.info(
                "coordinator %s stopped with entries pending in %d stream(s): other "
                "coordinators claim them, and the sweep then removes this consumer",
                consumer,
                stays,
            )
        else:
            logger.info("coordinator %s stopped and left the consumer group", consumer)

    def consumers(self) -> dict[str, tuple[int, float]]:
        """Consumer -> (entries pending, seconds since it last read), over the input streams.

        A consumer in several streams' groups gets its total pending and its least idle time.
        """
        found: dict[str, tuple[int, float]] = {}
        for stream in keys.INPUT_STREAMS:
            try:
                rows = self.conn.xinfo_consumers(stream, keys.COORDINATOR_GROUP)
            except redis.ResponseError:  # No stream or no group yet.
                continue
            for row in rows:
                name = row["name"].decode() if isinstance(row["name"], bytes) else row["name"]
                pending, idle = int(row["pending"]), int(row["idle"]) / 1000
                had_pending, had_idle = found.get(name, (0, idle))
                found[name] = (had_pending + pending, min(had_idle, idle))
        return found

    def forget_gone(self, alive: set[str], gone_after: float) -> list[str]:
        """Remove consumers that are not in ``alive``, idle ``gone_after`` s, nothing pending.

        Args:
            alive: Consumers of coordinators that beat lately (these are never removed).
            gone_after: Seconds a consumer must have been idle.

        Returns:
            The consumers removed from every stream's group.
        """
        removed = []
        for name, (pending, idle) in self.consumers().items():
            if name in alive or pending or idle < gone_after:
                continue
            if self.leave(name) == 0:
                removed.append(name)
                logger.info("removed consumer %s (its coordinator stopped beating)", name)
        return removed
