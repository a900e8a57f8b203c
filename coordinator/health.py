"""Coordinator heartbeats in Redis, and the container healthcheck that reads them."""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
from typing import Any

import redis

from coordinator.settings import PerseusSettings
from protocol import keys
from protocol.connection import connect, redact_url
from protocol.exceptions import ConfigError, PerseusError
from protocol.server_clock import ServerClock

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
"""A coordinator records a heartbeat at most this often (after a loop round)."""
DEFAULT_MAX_IDLE_S = 30.0
FORGET_AFTER_S = 3600.0
"""Heartbeats older than this are deleted by the sweep (coordinators that are gone)."""


def beat(
    conn: redis.Redis,
    consumer: str,
    now: float,
    pipeline: redis.client.Pipeline | None = None,
    shared: dict[str, Any] | None = None,
) -> None:
    """Record that coordinator ``consumer`` finished a loop round at server time ``now``.

    Args:
        conn: The Redis.
        consumer: The coordinator.
        now: Server time.
        pipeline: Queue the writes there instead.
        shared: The coordinator's shared settings, recorded again if they are gone (Redis
            lost its data): a coordinator started after that must still agree with them.
    """
    pipe = pipeline if pipeline is not None else conn.pipeline(transaction=False)
    pipe.hset(keys.COORDINATORS, consumer, f"{now:.3f}")
    if shared is not None:
        pipe.hsetnx(keys.COORDINATOR_SETTINGS, consumer, settings_json(shared))
    if pipeline is None:
        pipe.execute()


def settings_json(shared: dict[str, Any]) -> str:
    """How a coordinator's shared settings are recorded (one canonical JSON text)."""
    return json.dumps(shared, sort_keys=True)


def last_beats(conn: redis.Redis) -> dict[str, float]:
    """Consumer name -> unix time of its last heartbeat, for every coordinator seen lately."""
    return {name.decode(): float(t) for name, t in conn.hgetall(keys.COORDINATORS).items()}


def forget_stale(
    conn: redis.Redis,
    now: float,
    older_than: float = FORGET_AFTER_S,
    pipeline: redis.client.Pipeline | None = None,
) -> list[str]:
    """Delete heartbeats older than ``older_than`` seconds; return whose they were.

    A coordinator that beats again after this only re-adds its own field.
    """
    stale = [name for name, t in last_beats(conn).items() if now - t > older_than]
    if stale:
        target = pipeline if pipeline is not None else conn
        target.hdel(keys.COORDINATORS, *stale)
        target.hdel(keys.COORDINATOR_SETTINGS, *stale)
    return stale


def forget(conn: redis.Redis, consumer: str) -> None:
    """Delete a cleanly stopped coordinator's heartbeat and settings (one transaction).

    A restart with other settings is then not refused as if this one still ran. Never
    raises: on a Redis error the heartbeat is left to age out (:data:`LIVE_S`).
    """
    try:
        with conn.pipeline(transaction=True) as pipe:
            pipe.hdel(keys.COORDINATORS, consumer)
            pipe.hdel(keys.COORDINATOR_SETTINGS, consumer)
            pipe.execute()
    except redis.RedisError as exc:
        logger.warning("coordinator %s: heartbeat not removed at stop: %s", consumer, exc)


LIVE_S = 10.0
"""A coordinator that beat within this many seconds is running (its settings must match)."""


def live_coordinators(conn: redis.Redis, now: float, live_s: float = LIVE_S) -> dict[str, float]:
    """Consumer name -> last heartbeat of every coordinator that beat within ``live_s``.

    Args:
        conn: The Redis.
        now: The Redis server's time (heartbeats are stamped with it).
        live_s: Seconds since the last beat that still count as running.
    """
    return {name: at for name, at in last_beats(conn).items() if now - at <= live_s}


def agree_settings(
    conn: redis.Redis, consumer: str, shared: dict[str, Any], now: float, live_s: float = LIVE_S
) -> None:
    """Record ``consumer``'s shared settings, unless a running coordinator has other ones.

    Two coordinators on one Redis serve the same jobs: with different schedulers, jobs would
    get one or the other depending on which coordinator read their registration.

    Raises:
        ConfigError: A coordinator that beat within ``live_s`` seconds runs with other values;
            the message names each setting that differs and both values.
    """
    recorded = {name.decode(): raw for name, raw in conn.hgetall(keys.COORDINATOR_SETTINGS).items()}
    for name, at in live_coordinators(conn, now, live_s).items():
        if name == consumer or name not in recorded:
            continue
        theirs = json.loads(recorded[name])
        differ = [k for k in shared if theirs.get(k) != shared[k]]
        if differ:
            detail = "; ".join(f"{k}: {theirs.get(k)!r} there, {shared[k]!r} here" for k in differ)
            ago = max(0.0, now - at)  # a beat stamped after ``now`` was read: not "-0.0 s"
            raise ConfigError(
                f"coordinator {name} (running: last round {ago:.1f} s ago) has other "
                f"settings; coordinators sharing a Redis must agree. {detail}"
            )
    conn.hset(keys.COORDINATOR_SETTINGS, consumer, settings_json(shared))


def host_idle_s(conn: redis.Redis, hostname: str, now: float) -> float | None:
    """Seconds since a coordinator of ``hostname`` (consumer ``<hostname>-<pid>``) beat.

    None when no coordinator of that host has beaten (none started, or forgotten).
    """
    prefix = f"{hostname}-"
    # A beat stamped after ``now`` was read is 0 s old (not "-0.0 s ago").
    ages = [max(0.0, now - t) for name, t in last_beats(conn).items() if name.startswith(prefix)]
    return min(ages) if ages else None


def check(redis_url: str, hostname: str, max_idle_s: float) -> tuple[bool, str]:
    """Whether a coordinator of ``hostname`` beat within ``max_idle_s``, and a line saying so.

    The line names the Redis URL with its password hidden.
    """
    where = redact_url(redis_url)
    try:
        conn = connect(redis_url, socket_timeout=5.0, ping=True)
        idle = host_idle_s(conn, hostname, ServerClock(conn).sync())  # beats: server time
    except (PerseusError, redis.RedisError) as exc:
        return False, f"unhealthy: redis {where}: {exc}"
    if idle is None:
        return False, f"unhealthy: no coordinator of host {hostname} has run at {where}"
    if idle > max_idle_s:
        return False, (
            f"unhealthy: the coordinator of host {hostname} last ran a round {idle:.1f} s ago "
            f"(limit {max_idle_s:g} s)"
        )
    return True, f"healthy: the coordinator of host {hostname} ran a round {idle:.1f} s ago"


def main(argv: list[str] | None = None) -> int:
    """``python -m coordinator.health``: exit 0 while this host's coordinator is running rounds.

    Reads ``PERSEUS_REDIS_URL`` like the coordinator, and imports no scheduler, so a
    healthcheck every few seconds stays cheap.
    """
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--max-idle",
        type=float,
        default=DEFAULT_MAX_IDLE_S,
        help=f"seconds without a heartbeat that mean unhealthy (default {DEFAULT_MAX_IDLE_S:g})",
    )
    args = parser.parse_args(argv)
    ok, message = check(PerseusSettings().redis_url, socket.gethostname(), args.max_idle)
    print(message)
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
