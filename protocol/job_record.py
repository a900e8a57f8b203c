"""A job as the store reads it: its record (info hash) and the state that decides what is due."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone

import msgpack
import redis

from protocol.codec import validate
from protocol.exceptions import ProtocolError, UnknownJobError
from protocol.models import JobConfig, JobInfo, JournalEntry, ProfilingResult


@dataclass(frozen=True)
class JobRecord:
    """A registered job: its info, how it is served, and bookkeeping fields."""

    info: JobInfo
    config: JobConfig
    fields: dict[str, str]

    @property
    def job_id(self) -> str:
        """The job id."""
        return self.info.job_id

    @property
    def error(self) -> str:
        """The last scheduling error, empty if none."""
        return self.fields.get("error", "")

    def number(self, field: str, default: int = 0) -> int:
        """An integer bookkeeping field (``default`` when absent or empty)."""
        raw = self.fields.get(field, "")
        return int(raw) if raw else default

    @classmethod
    def from_hash(cls, raw: dict[bytes, bytes]) -> JobRecord:
        """Build a record from the job's info hash as HGETALL returns it.

        Raises:
            ProtocolError: A field is missing or unreadable (the hash was written by someone
                else: on Redis 6.2 a rank can replace what it reads); the error names it.
        """
        fields = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in raw.items()}
        name = "job_id"
        try:
            info = JobInfo(
                job_id=fields[name],
                pp_degree=int(fields[(name := "pp_degree")]),
                dp_degree=int(fields[(name := "dp_degree")]),
                tp_degree=int(fields[(name := "tp_degree")]),
                world_size=int(fields[(name := "world_size")]),
                job_metadata=fields[(name := "job_metadata")] or None,
            )
            config = JobConfig(
                scheduler=fields[(name := "scheduler")],
                scheduler_args=json.loads(fields[(name := "scheduler_args")]),
                dump_dir=fields[(name := "dump_dir")],
            )
        except KeyError:
            raise ProtocolError(
                f"job info of {fields.get('job_id', '?')!r} has no {name!r}"
            ) from None
        except ValueError as exc:  # int(), JSON, or the models' own checks
            raise ProtocolError(
                f"job info of {fields.get('job_id', '?')!r}: field {name!r} is unreadable "
                f"({str(exc).splitlines()[0]})"
            ) from None
        return cls(info=info, config=config, fields=fields)


def parse_version(job_id: str, raw: bytes | None) -> int:
    """A job's version key as stored (0 if absent).

    Raises:
        ProtocolError: It holds no version (written by someone else: on Redis 6.2 a rank can
            replace the keys it reads).
    """
    if raw is None:
        return 0
    if raw.isdigit() and len(raw) < 19:  # ASCII digits only: bytes.isdigit
        return int(raw)
    raise ProtocolError(f"job {job_id}: its version key holds {raw[:40]!r}, not a version")


@dataclass(frozen=True)
class JobState:
    """What deciding and computing a job's next version needs, read in one round trip."""

    record: JobRecord
    rank_count: int
    version: int
    journal_length: int
    control_length: int
    tail: JournalEntry | None  # the journal's last entry
    leased: bool = False  # the lease was taken with this read (JobStore.job_state)
    # (version, stored results) read in the same MULTI when the caller guessed the version
    prefetched: tuple[int, list[bytes]] | None = None

    @property
    def fresh_results(self) -> bool:
        """Every rank reported the latest version, and no journal entry observed it yet."""
        return (
            self.version > 0
            and self.record.number("complete") == self.version
            and (self.tail is None or self.tail.observed_version != self.version)
        )

    @property
    def due(self) -> bool:
        """Whether the next version must be computed (same rule as the DUE script)."""
        if self.rank_count < self.record.info.world_size:
            return False
        if self.version == 0 or self.fresh_results:
            return True
        applied = self.tail.controls_upto if self.tail is not None else 0
        return self.control_length > applied


def unknown_job(job_id: str) -> UnknownJobError:
    """The error for a job id that Redis does not have."""
    return UnknownJobError(f"unknown job id {job_id!r} (never registered, or expired)")


def stored_result(data: bytes, trusted: bool = False) -> ProfilingResult:
    """Decode a stored result: a msgpack ProfilingResult, or the report message that carried it.

    Args:
        data: The stored value.
        trusted: Skip validation: the coordinator validated it before storing it (numbers
            keep the type they were sent with).

    Raises:
        ProtocolError: Not a valid result (only without ``trusted``).
    """
    raw = msgpack.unpackb(data, raw=False)
    if isinstance(raw, dict) and raw.get("kind") == "report_result":
        raw = raw["result"]
    if trusted:
        return ProfilingResult.model_construct(**raw)
    return validate(ProfilingResult, raw)


def make_job_id(job: JobInfo, scheduler_name: str, entry_id: str) -> str:
    """Build a readable, unique job id from the registration's stream entry id.

    Stream entry ids (``<ms>-<seq>``) are unique and increasing within a stream, so two jobs
    registered in the same second (or millisecond) still get different ids. Zeus's ids
    (second resolution only) collide in that case.

    Example: ``2026-11-23-00-05-12.345+dp2+pp4+tp1+PointSolution3D+bert``.
    """
    ms_text, _, seq_text = entry_id.partition("-")
    ms, seq = int(ms_text), int(seq_text or 0)
    stamp = datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%Y-%m-%d-%H-%M-%S")
    stamp += f".{ms % 1000:03d}" + (f".{seq}" if seq else "")
    parts = [stamp, f"dp{job.dp_degree}", f"pp{job.pp_degree}", f"tp{job.tp_degree}"]
    parts.append(scheduler_name)
    if job.job_metadata:
        parts.append(job.job_metadata)
    return "+".join(parts)


def wrong_type(exc: BaseException) -> bool:
    """Whether Redis refused a command because a key holds another type (WRONGTYPE).

    Services write a job's keys with their types; on Redis 6.2 a rank may replace those it
    reads (SET, see :mod:`protocol.acl`). Readers that must go on past one job (the sweep,
    ``perseus status``) treat this as that job's problem; any other refusal is theirs.
    """
    return isinstance(exc, redis.ResponseError) and str(exc).startswith("WRONGTYPE")
