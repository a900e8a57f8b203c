"""Pydantic models shared by the training hook, the coordinator, the schedulers and the power limit.

Everything that crosses Redis is one of these models, encoded with msgpack by
:func:`~protocol.codec.pack` and decoded (and validated) by :func:`~protocol.codec.unpack`
(re-exported here); the power-limit profile is also a JSON file in Zeus's format
(:mod:`worker_client.power_limit.profile`). Validators raise ``ValueError`` so that pydantic
reports the field that is wrong.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

# The codec, re-exported: code written before protocol.codec imports it from here.
from protocol.codec import pack as pack
from protocol.codec import pack_plain as pack_plain
from protocol.codec import pack_rank_reply as pack_rank_reply
from protocol.codec import unpack as unpack
from protocol.codec import unpack_raw
from protocol.codec import validate as validate
from protocol.codec import validation_text as validation_text
from protocol.constants import (
    MAX_CLOCK_MHZ,
    MAX_ENTRY_FIELDS,
    MAX_RANK_CLOCKS,
    MAX_TARGET_ITERATION_S,
    MAX_UNIX_TIME,
    MIN_TARGET_ITERATION_S,
)
from protocol.exceptions import ProtocolError
from protocol.tokens import sign

# Job ids and metadata end up inside Redis key names: keep them free of ':' and spaces.
_METADATA_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_INSTRUCTION_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Instruction names already matched: a schedule repeats a few names many times.
_GOOD_NAMES: set[str] = set()


class _Model(BaseModel):
    # No NaN or infinity anywhere: one NaN in a measurement makes every later comparison false.
    model_config = ConfigDict(extra="forbid", frozen=False, allow_inf_nan=False)


class JobInfo(_Model):
    """A training job, as registered by rank 0.

    Attributes:
        job_id: Set by the coordinator; must be empty when rank 0 registers the job.
        pp_degree: Pipeline parallel degree (number of stages).
        dp_degree: Data parallel degree.
        tp_degree: Tensor parallel degree.
        world_size: Number of ranks; must equal ``pp_degree * dp_degree * tp_degree``.
        job_metadata: Optional short tag appended to the job id (letters, digits, ``._-``).
    """

    job_id: str = ""
    pp_degree: int = Field(ge=1)
    dp_degree: int = Field(ge=1)
    tp_degree: int = Field(ge=1)
    world_size: int = Field(ge=1)
    job_metadata: str | None = None

    @model_validator(mode="after")
    def _check(self) -> JobInfo:
        product = self.pp_degree * self.dp_degree * self.tp_degree
        if product != self.world_size:
            raise ValueError(
                f"world_size={self.world_size} but pp_degree*dp_degree*tp_degree = "
                f"{self.pp_degree}*{self.dp_degree}*{self.tp_degree} = {product}"
            )
        if self.job_metadata is not None and not _METADATA_RE.fullmatch(self.job_metadata):
            raise ValueError(
                f"job_metadata={self.job_metadata!r} must be 1-64 characters of "
                "letters, digits, '.', '_' or '-' (it becomes part of Redis key names)"
            )
        return self


class RankInfo(_Model):
    """What each rank reports about itself when it registers.

    Attributes:
        rank: Global rank.
        dp_rank: Data parallel rank.
        pp_rank: Pipeline parallel rank (the pipeline stage).
        tp_rank: Tensor parallel rank.
        available_frequencies: Supported GPU graphics clocks in MHz, highest first: at most
            :data:`~protocol.constants.MAX_RANK_CLOCKS` of them, each at most
            :data:`~protocol.constants.MAX_CLOCK_MHZ`.
    """

    rank: int = Field(ge=0)
    dp_rank: int = Field(ge=0)
    pp_rank: int = Field(ge=0)
    tp_rank: int = Field(ge=0)
    # Checked by pydantic-core, item by item (the error names the index). The length first,
    # before any item: ten million clocks were validated and deduplicated whole before the
    # coordinator's max_frequencies refused them, and a clock of 10**15 MHz was swept and
    # failed the planner (which takes up to MAX_CLOCK_MHZ) after the sweep.
    available_frequencies: list[Annotated[int, Field(gt=0, le=MAX_CLOCK_MHZ)]] = Field(
        min_length=1, max_length=MAX_RANK_CLOCKS
    )

    @model_validator(mode="after")
    def _check(self) -> RankInfo:
        if len(set(self.available_frequencies)) != len(self.available_frequencies):
            raise ValueError("available_frequencies has duplicates")
        return self

    def check_fits(self, job: JobInfo) -> None:
        """Raise ``ValueError`` if this rank's coordinates do not fit the job's degrees."""
        for name, value, bound in (
            ("rank", self.rank, job.world_size),
            ("pp_rank", self.pp_rank, job.pp_degree),
            ("dp_rank", self.dp_rank, job.dp_degree),
            ("tp_rank", self.tp_rank, job.tp_degree),
        ):
            if value >= bound:
                raise ValueError(f"{name}={value} is out of range for job {job.job_id} (< {bound})")


class FrequencySchedule(_Model):
    """One iteration's worth of (instruction, frequency) pairs for one rank.

    Attributes:
        rank: The rank this schedule is for.
        frequencies: ``(instruction name, frequency in MHz)`` in execution order.
        version: The schedule version it was published as (0 before publication).
    """

    rank: int = Field(ge=0)
    frequencies: list[tuple[str, int]]
    version: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> FrequencySchedule:
        for i, (name, freq) in enumerate(self.frequencies):
            if name not in _GOOD_NAMES:
                if not _INSTRUCTION_RE.fullmatch(name):
                    raise ValueError(f"frequencies[{i}]: bad instruction name {name!r}")
                if len(_GOOD_NAMES) < 1024:
                    _GOOD_NAMES.add(name)
            if freq <= 0:
                raise ValueError(f"frequencies[{i}]: frequency must be positive, got {freq}")
        return self


Measurement = Annotated[float, Field(ge=0, allow_inf_nan=False)]
"""A measured time or energy. A NaN would compare as neither smaller nor larger than anything,
so the planner and the schedulers would go on with nonsense: finite and not negative only
(checked by pydantic's core, which names the field and index; the coordinator validates every
value of every result)."""


class ProfilingResult(_Model):
    """What one rank measured while running one schedule version.

    Attributes:
        rank: Global rank of the reporting client.
        schedule_version: The schedule version in use for every measured iteration.
        iter_time: Time of each profiled iteration, seconds.
        iter_energy: Energy of each profiled iteration, Joules.
        time_breakdown: ``time_breakdown["forward"][i]`` lists the durations of all forward
            instructions of the ``i``-th profiled iteration.
        energy_breakdown: Same structure as ``time_breakdown``, in Joules (may be empty).
    """

    rank: int = Field(ge=0)
    schedule_version: int = Field(default=0, ge=0)
    iter_time: list[Measurement]
    iter_energy: list[Measurement]
    time_breakdown: dict[str, list[list[Measurement]]] = Field(default_factory=dict)
    energy_breakdown: dict[str, list[list[Measurement]]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> ProfilingResult:
        if len(self.iter_time) != len(self.iter_energy):
            raise ValueError(
                f"iter_time has {len(self.iter_time)} entries but iter_energy has "
                f"{len(self.iter_energy)}"
            )
        return self


class OfflineProfilingResult(_Model):
    """Per-frequency averages of one rank's forward and backward instructions.

    Attributes:
        rank: Global rank.
        dp_rank: Data parallel rank.
        pp_rank: Pipeline parallel rank (also the stage).
        tp_rank: Tensor parallel rank.
        forward_time: frequency -> average forward time (s).
        forward_energy: frequency -> average forward energy (J).
        backward_time: frequency -> average backward time (s).
        backward_energy: frequency -> average backward energy (J).
    """

    rank: int = Field(ge=0)
    dp_rank: int = Field(ge=0)
    pp_rank: int = Field(ge=0)
    tp_rank: int = Field(ge=0)
    forward_time: dict[int, float]
    forward_energy: dict[int, float]
    backward_time: dict[int, float]
    backward_energy: dict[int, float]

    @model_validator(mode="after")
    def _check(self) -> OfflineProfilingResult:
        for inst in ("forward", "backward"):
            times: dict[int, float] = getattr(self, f"{inst}_time")
            energies: dict[int, float] = getattr(self, f"{inst}_energy")
            if set(times) != set(energies):
                raise ValueError(f"{inst}_time and {inst}_energy cover different frequencies")
        return self


class JobConfig(_Model):
    """How the coordinator serves a job, fixed when the job is registered.

    Stored with the job so that any rq worker, whatever its own environment, schedules the
    job the same way.
    """

    scheduler: str
    scheduler_args: dict[str, Any] = Field(default_factory=dict)
    dump_dir: str = ""


class JournalEntry(_Model):
    """What went into computing one schedule version; replaying these rebuilds a scheduler.

    Attributes:
        version: The schedule version this entry produced (or, unpublished, kept serving).
        observed_version: Results of this version were observed first (None: none were).
        controls_upto: Number of the job's control messages applied so far (cumulative).
        published: False when a converged scheduler produced the same schedules again: the
            observation is recorded, but no new version is published.
    """

    version: int = Field(ge=1)
    observed_version: int | None = None
    controls_upto: int = Field(default=0, ge=0)
    published: bool = True


# ---------------------------------------------------------------------------------------------
# The power-limit optimizer's profile of a workload: a JSON file in Zeus's format, or msgpack in
# Redis (``keys.power_limit_profile``). Unknown keys are ignored, as Zeus ignores them.


MAX_POWER_LIMIT_W = (2**32 - 1) // 1000
"""The largest limit NVML can express (an unsigned 32-bit count of milliwatts), in Watts. A
larger one in a profile file passed validation, then failed to pack for Redis (msgpack takes
64 bits at most) with a traceback."""


class PowerLimitMeasurement(BaseModel):
    """Time and energy of ``profile_steps`` training steps at one power limit.

    Attributes:
        power_limit: The power limit, whole Watts (a limit in milliwatts, truncated).
        energy: Energy of all measured GPUs (of all ranks), Joules.
        time: Wall time of the profiled steps (slowest rank), seconds.
    """

    model_config = ConfigDict(extra="ignore")

    power_limit: int = Field(ge=1, le=MAX_POWER_LIMIT_W)
    energy: float = Field(ge=0, allow_inf_nan=False)
    time: float = Field(ge=0, allow_inf_nan=False)


class PowerLimitProfile(BaseModel):
    """A workload's power-limit profile.

    Attributes:
        measurements: One entry per profiled power limit, in profiling order (highest first).
        optimal_power_limit: The limit the selector chose, W (None in a file Zeus wrote).
        selector: Description of the selector that chose it (informative).
        updated_at: Unix time the profile was produced or stored (0: unknown).
    """

    model_config = ConfigDict(extra="ignore")

    measurements: list[PowerLimitMeasurement] = Field(min_length=1)
    optimal_power_limit: int | None = Field(default=None, ge=1, le=MAX_POWER_LIMIT_W)
    selector: str = ""
    updated_at: float = Field(default=0.0, ge=0, le=MAX_UNIX_TIME, allow_inf_nan=False)

    @model_validator(mode="after")
    def _one_per_limit(self) -> PowerLimitProfile:
        # Two measurements of one limit: which one a selector weighed would be an accident.
        seen: set[int] = set()
        for i, m in enumerate(self.measurements):
            if m.power_limit in seen:
                raise ValueError(
                    f"measurements[{i}]: power_limit {m.power_limit} W is measured twice"
                )
            seen.add(m.power_limit)
        return self


# ---------------------------------------------------------------------------------------------
# Messages on the input streams. Each has a ``kind`` so one decoder handles every stream.


# A request id names its reply list (``perseus:reply:<request id>``): a readable key, so no
# spaces, colons or control characters (the hook sends a uuid4's hex).
REQUEST_ID_PATTERN = r"^[A-Za-z0-9_.-]+$"
# A coordinator's job ids are a few hundred characters at most (time, degrees, scheduler,
# metadata): a longer one is garbage, which error messages and logs would repeat whole.
MAX_JOB_ID_LENGTH = 512


class RegisterJob(_Model):
    """Rank 0 asks the coordinator to create a job; the reply carries the job id.

    ``scheduler`` optionally picks a built-in scheduler for this job instead of the
    coordinator's default (``scheduler_args`` then replace the default arguments).
    """

    kind: Literal["register_job"] = "register_job"
    request_id: str = Field(min_length=1, max_length=128, pattern=REQUEST_ID_PATTERN)
    job: JobInfo
    scheduler: str | None = None
    scheduler_args: dict[str, Any] = Field(default_factory=dict)


class RegisterRank(_Model):
    """A rank joins a registered job."""

    kind: Literal["register_rank"] = "register_rank"
    request_id: str = Field(min_length=1, max_length=128, pattern=REQUEST_ID_PATTERN)
    job_id: str = Field(min_length=1, max_length=MAX_JOB_ID_LENGTH)
    rank_info: RankInfo


class ReportResult(_Model):
    """A rank's profiling result for the schedule version it ran."""

    kind: Literal["report_result"] = "report_result"
    job_id: str = Field(min_length=1, max_length=MAX_JOB_ID_LENGTH)
    result: ProfilingResult


class SetTarget(_Model):
    """Ask a job's scheduler to aim at a new iteration time (e.g. a straggler's), seconds.

    The time lies in ``[MIN_TARGET_ITERATION_S, MAX_TARGET_ITERATION_S]`` (a microsecond to a
    day): 1e300 or 1e-300 is a typo, and an entry that holds one is dead-lettered.
    """

    kind: Literal["set_target"] = "set_target"
    job_id: str = Field(min_length=1, max_length=MAX_JOB_ID_LENGTH)
    iteration_time: float = Field(ge=MIN_TARGET_ITERATION_S, le=MAX_TARGET_ITERATION_S)


class LoggedTarget(SetTarget):
    """A target as a job's control log holds it: checked when it was appended, not now.

    Every worker that rebuilds a job's scheduler replays the log, and must feed it what the
    scheduler got then. A target appended before :class:`SetTarget` had its bounds (only
    > 0 was checked: 1e-9 or 1e300 s, which the scheduler refused or planned for) is
    replayed as it stands, not taken for a corrupt entry that fails the job.
    """

    iteration_time: float = Field(gt=0)


Message = Annotated[
    RegisterJob | RegisterRank | ReportResult | SetTarget, Field(discriminator="kind")
]
_MESSAGE_ADAPTER: TypeAdapter[Message] = TypeAdapter(Message)


class Reply(_Model):
    """The coordinator's answer to a registration request."""

    ok: bool
    job_id: str = ""
    error: str = ""
    # To a rank's registration: the job's scheduler needs per-instruction energy.
    instruction_energy: bool = False
    # To a rank's registration: its secret (protocol.tokens); results and heartbeats prove it.
    # Kept out of repr, so a logged or raised reply never shows it.
    token: str = Field(default="", repr=False)


# ---------------------------------------------------------------------------------------------
# The stream messages' encoding (the codec itself: protocol.codec)


def encode_message(
    message: RegisterJob | RegisterRank | ReportResult | SetTarget,
    token: str | None = None,
    wait_s: float | None = None,
) -> dict[str, Any]:
    """Stream-entry fields for a message (``kind`` and ``job_id`` stay readable in redis-cli).

    Args:
        message: The message.
        token: The reporting rank's token: a ``report_result`` entry then carries the MAC of
            its data (``mac``), which the coordinator checks (the token itself is not sent).
        wait_s: A registration's sender waits this long for the reply (field ``wait_s``):
            a coordinator that reads it later dead-letters it (see
            :func:`coordinator.registration.check_still_awaited`). A field of its own, not
            in ``data``: coordinators that predate it ignore it.
    """
    if isinstance(message, RegisterRank):
        # The rank waits for its reply: its fields are plain, so no model_dump (same bytes).
        plain = dict(message.__dict__, rank_info=dict(message.rank_info.__dict__))
        data = msgpack.packb(plain, use_bin_type=True)
    else:
        data = pack(message)
    fields: dict[str, Any] = {"kind": message.kind, "data": data}
    job_id = getattr(message, "job_id", "")
    if job_id:
        fields["job_id"] = job_id
    if token is not None:
        fields["mac"] = sign(token, fields["data"])
    if wait_s is not None:
        fields["wait_s"] = repr(float(wait_s))
    return fields


def decode_message(
    fields: dict[bytes, bytes],
) -> RegisterJob | RegisterRank | ReportResult | SetTarget:
    """Decode a stream entry's fields; raise ProtocolError with a reason on any problem."""
    if len(fields) > MAX_ENTRY_FIELDS:
        raise ProtocolError(
            f"entry has {len(fields)} fields; at most {MAX_ENTRY_FIELDS} (a message has kind, "
            "data and, by kind, job_id, mac and wait_s)"
        )
    data = fields.get(b"data")
    if data is None:
        names = sorted(k.decode("utf-8", "replace") for k in fields)
        raise ProtocolError(f"entry has no 'data' field (fields: {names})")
    raw = unpack_raw(data)
    try:
        # Strict: a number must arrive as a number ("1.0" is no time, true no rank). A result
        # is stored as it arrived and read back unvalidated (``stored_result(trusted=True)``),
        # so what lax validation would coerce reached the scheduler as a string and failed
        # the job.
        return _MESSAGE_ADAPTER.validate_python(raw, strict=True)
    except ValidationError as exc:
        raise ProtocolError(f"invalid message: {validation_text(exc)}") from None
