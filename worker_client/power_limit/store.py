"""Power-limit profiles in Redis, shared by every run (and rank) of the same workload.

Layout: ``keys.power_limit_profile(workload)`` holds the msgpack-encoded
:class:`~protocol.models.PowerLimitProfile`; the sorted set
``keys.POWER_LIMIT_INDEX`` maps each stored workload name to the unix time it was last
written. Both change in one MULTI/EXEC, so the index never names a profile that is not there
(or the other way round).

Redis errors become :class:`~protocol.exceptions.CoordinatorUnavailableError` and
undecodable values :class:`~protocol.exceptions.ProtocolError`.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import redis
from pydantic import ValidationError

from protocol import keys
from protocol.codec import pack
from protocol.connection import connect, redact_url
from protocol.exceptions import ConfigError, CoordinatorUnavailableError, ProtocolError
from protocol.models import PowerLimitProfile

# Workload names become part of a key name (perseus:powerlimit:profile:<workload>): no ':'.
_WORKLOAD_RE = re.compile(r"^[A-Za-z0-9._+/-]{1,128}$")


def check_workload(workload: str) -> str:
    """Return ``workload`` if it is a valid name, else raise ConfigError."""
    if not _WORKLOAD_RE.fullmatch(workload):
        raise ConfigError(
            f"workload name {workload!r} must be 1-128 characters of letters, digits and '._+/-'"
        )
    return workload


@dataclass(frozen=True)
class StoredProfileSummary:
    """One line of the index: a workload and what is stored for it.

    Attributes:
        workload: The workload name.
        updated_at: Unix time of the last write (the index score).
        optimal_power_limit: Chosen limit, W (None if the profile is missing or unreadable).
        num_measurements: Number of profiled limits (0 if missing or unreadable).

    """

    workload: str
    updated_at: float
    optimal_power_limit: int | None
    num_measurements: int


#: Highest limit a profile may hold, W. No GPU's power limit comes near 10 kW, but a limit
#: written in milliwatts (NVML's unit; Zeus's profile holds watts) does: 300000 for 300 W.
MAX_PLAUSIBLE_POWER_LIMIT_W = 10_000


def implausible_limit(profile: PowerLimitProfile) -> str | None:
    """Why a limit of ``profile`` cannot be watts (the first one over the ceiling), if one is.

    Returns:
        ``measurements[0].power_limit is 300000 W, ...: divide by 1000 (300 W)``, or None.
    """
    entries = [
        (f"measurements[{i}].power_limit", m.power_limit)
        for i, m in enumerate(profile.measurements)
    ]
    entries.append(("optimal_power_limit", profile.optimal_power_limit or 0))
    over = [(where, limit) for where, limit in entries if limit > MAX_PLAUSIBLE_POWER_LIMIT_W]
    if not over:
        return None
    where, limit = over[0]
    more = f"; {len(over)} of its limits are above it" if len(over) > 1 else ""
    return (
        f"{where} is {limit} W, above {MAX_PLAUSIBLE_POWER_LIMIT_W} W (no GPU's limit comes "
        f"near{more}): it looks like milliwatts, NVML's unit, but the profile holds watts "
        f"as Zeus's does: divide by 1000 ({limit / 1000:g} W)"
    )


def _decode(workload: str, raw: Any) -> PowerLimitProfile:
    if not isinstance(raw, bytes):
        raise ProtocolError(
            f"power-limit profile of {workload!r} is not bytes: use a client with "
            "decode_responses=False"
        )
    try:
        profile = PowerLimitProfile.model_validate(msgpack.unpackb(raw, raw=False), strict=True)
    except (ValueError, ValidationError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"bad stored power-limit profile of {workload!r}: {exc}") from None
    why = implausible_limit(profile)  # imported before `import` checked it
    if why is not None:
        raise ProtocolError(f"bad stored power-limit profile of {workload!r}: {why}")
    return profile


class PowerLimitProfileStore:
    """Save, load, list and delete power-limit profiles in Redis.

    Args:
        client: A redis-py client with ``decode_responses=False`` (values are msgpack).

    """

    def __init__(self, client: redis.Redis, where: str = "") -> None:
        self.client = client
        self.where = where  # the server, for messages (never its password)

    @classmethod
    def from_url(cls, url: str, timeout: float = 5.0) -> PowerLimitProfileStore:
        """Connect to the Redis at ``url`` (any URL :func:`protocol.connection.connect` takes)."""
        return cls(connect(url, socket_timeout=timeout, connect_timeout=timeout), redact_url(url))

    def _unavailable(self, exc: redis.RedisError) -> CoordinatorUnavailableError:
        at = f" at {self.where}" if self.where else ""
        return CoordinatorUnavailableError(f"Redis{at} failed on power-limit profiles: {exc}")

    def save(
        self,
        workload: str,
        profile: PowerLimitProfile,
        pipeline: redis.client.Pipeline | None = None,
    ) -> None:
        """Store ``profile`` for ``workload`` and index it, in one MULTI.

        Args:
            workload: The workload name (see :func:`check_workload`).
            profile: The profile; a zero ``updated_at`` is set to now.
            pipeline: Queue the commands on this (transactional) pipeline instead of running
                them now; the caller executes it.

        """
        check_workload(workload)
        if not profile.updated_at:
            profile = profile.model_copy(update={"updated_at": time.time()})
        packed = pack(profile)
        pipe = pipeline if pipeline is not None else self.client.pipeline(transaction=True)
        pipe.set(keys.power_limit_profile(workload), packed)
        pipe.zadd(keys.POWER_LIMIT_INDEX, {workload: profile.updated_at})
        if pipeline is None:
            try:
                pipe.execute()
            except redis.RedisError as exc:
                raise self._unavailable(exc) from None

    def load(self, workload: str) -> PowerLimitProfile | None:
        """Return the stored profile of ``workload``, or None if there is none."""
        check_workload(workload)
        try:
            raw = self.client.get(keys.power_limit_profile(workload))
        except redis.RedisError as exc:
            raise self._unavailable(exc) from None
        return None if raw is None else _decode(workload, raw)

    def delete(self, workload: str, pipeline: redis.client.Pipeline | None = None) -> bool:
        """Remove ``workload``'s profile and index entry, in one MULTI.

        Returns:
            Whether a profile was stored (always False when queued on ``pipeline``).

        """
        check_workload(workload)
        pipe = pipeline if pipeline is not None else self.client.pipeline(transaction=True)
        pipe.delete(keys.power_limit_profile(workload))
        pipe.zrem(keys.POWER_LIMIT_INDEX, workload)
        if pipeline is not None:
            return False
        try:
            deleted, unindexed = pipe.execute()
        except redis.RedisError as exc:
            raise self._unavailable(exc) from None
        return bool(deleted or unindexed)

    def list_profiles(self) -> list[StoredProfileSummary]:
        """Every indexed workload, least recently updated first."""
        try:
            entries: list[tuple[bytes | str, float]] = list(
                self.client.zrange(keys.POWER_LIMIT_INDEX, 0, -1, withscores=True)
            )
            pipe = self.client.pipeline(transaction=False)
            for name, _ in entries:
                pipe.get(keys.power_limit_profile(_text(name)))
            raws = pipe.execute() if entries else []
        except redis.RedisError as exc:
            raise self._unavailable(exc) from None
        summaries = []
        for (name, score), raw in zip(entries, raws, strict=True):
            workload = _text(name)
            try:
                profile = None if raw is None else _decode(workload, raw)
            except ProtocolError:
                profile = None  # listed anyway, so that it can be seen and deleted
            summaries.append(
                StoredProfileSummary(
                    workload=workload,
                    updated_at=float(score),
                    optimal_power_limit=profile.optimal_power_limit if profile else None,
                    num_measurements=len(profile.measurements) if profile else 0,
                )
            )
        return summaries


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
