"""Settings of the coordinator and the rq workers, read from ``PERSEUS_*`` environment variables.

Built once in the CLI entry point (never at import time), so tests and library users can pass
values directly: ``PerseusSettings(redis_url=..., scheduler="PointSolution3D")``.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from protocol.constants import MAX_CLOCK_MHZ, MAX_RANK_CLOCKS
from protocol.exceptions import ConfigError
from protocol.json_text import DuplicateKeyError, loads_unique
from protocol.scheduler import check_scheduler_args, resolve_scheduler
from protocol.suggest import did_you_mean
from schedulers.profiler_args import check_writable

# The longest time a setting may name: Redis refuses an EXPIRE past about 2**63 ms, and a
# sweep or time-out a year away is a typo.
_YEAR = 60 * 60 * 24 * 366
# The shortest interval a setting may name: 1e-300 s made a sweep loop that never slept.
_MS = 0.001
# Counts that reach Redis commands (XADD MAXLEN, XTRIM): Redis's integers are 64-bit signed,
# and a larger one failed every write ("value is out of range") after the start.
_REDIS_INT = 2**63 - 1
# The most a rank's clock list may be: every whole MHz up to 10 GHz (an H100 has 110 clocks).
# Past it the limit guards nothing: 10**18 let a rank register a list of any length.
MAX_FREQUENCIES_LIMIT = MAX_RANK_CLOCKS
# The most ranks a job may have: ten times the default, past any training run yet (the largest
# use about 100,000 GPUs). Each rank costs Redis a registration and a result per version.
MAX_WORLD_SIZE_LIMIT = 1_000_000
# The longest profiling sweep: one version per clock swept, so no longer than the clocks a
# rank may register.
MAX_SWEEP_VERSIONS_LIMIT = MAX_FREQUENCIES_LIMIT
# The largest entry the coordinator decodes, 64 MiB: a result of 65,536 microbatches (the most
# InstructionProfiler takes) over a few steps is about 12 MB, and decoding takes up to about
# 65 times an entry's size in memory (msgpack's one-byte empty lists).
MAX_ENTRY_BYTES_LIMIT = 64 * 1024 * 1024
# Each ceiling with why it is there, for the error.
_CEILINGS: dict[str, tuple[int, str]] = {
    "max_frequencies": (
        MAX_FREQUENCIES_LIMIT,
        f"every whole MHz up to {MAX_CLOCK_MHZ // 1000} GHz; an H100 has 110 clocks",
    ),
    "max_world_size": (
        MAX_WORLD_SIZE_LIMIT,
        "ranks per job, past any training run: the largest use about 100,000 GPUs",
    ),
    "max_sweep_versions": (
        MAX_SWEEP_VERSIONS_LIMIT,
        "one version per clock swept, and a rank registers at most as many clocks",
    ),
    "max_entry_bytes": (
        MAX_ENTRY_BYTES_LIMIT,
        "64 MiB; the coordinator decodes an entry whole, into many times its size",
    ),
}


class PerseusSettings(BaseSettings):
    """Coordinator settings; every field can be set as ``PERSEUS_<FIELD>``.

    Attributes:
        redis_url: Redis to coordinate through, e.g. ``redis://localhost:6379/0`` or
            ``unix:///tmp/redis.sock``.
        scheduler: Name of the frequency scheduler for jobs that do not name one (see
            ``perseus schedulers``), or ``package.module:ClassName`` for your own. Empty (the
            default): every job names its scheduler when it registers.
        scheduler_args: Extra keyword arguments for the scheduler's constructor, as JSON in the
            environment, e.g. ``PERSEUS_SCHEDULER_ARGS='{"solution_path": "plan.py"}'``.
        plan: A plan file (``perseus choose``'s output) for a scheduler that takes a
            ``solution_path`` (``PointSolution``, ``PointSolution3D``), used when
            ``scheduler_args`` are empty: ``PERSEUS_PLAN=plan.py`` is then
            ``PERSEUS_SCHEDULER_ARGS='{"solution_path": "plan.py"}'``. Unused otherwise (with no
            scheduler, or one without that argument): docker-compose.yml always sets it.
        log_level: Logging level name.
        dump_data: Also write ranks, schedules and profiling results of each job to files.
        dump_dir: Where dumps go, one folder per job.
        max_job_idle_time: Seconds without activity (registrations, stamped at most once a
            second per job; results; the hook's heartbeats) after which a job's state is
            deleted.
        finished_retention: Seconds a finished job (every rank's hook closed, or ``perseus
            jobs finish``) is kept before it is deleted.
        start_retention: Seconds without activity after which a job that never got its first
            schedule version (a rank failed before registering, or its scheduler failed at
            once) is deleted.
        stream_maxlen: Approximate cap (XADD MAXLEN ~) of each job's updates stream (a
            version's announcement: a client that missed it reads the version key). The
            input streams are trimmed by acknowledgement instead (see ``stream_hard_cap``).
        stream_hard_cap: Most entries an input stream, or the dead-letter stream, keeps.
            Coordinators trim what their group acknowledged at each sweep (dead letters go
            when replayed or purged); only past this cap do they remove unread entries
            (oldest first), each counted as lost, logged and shown by ``perseus status``.
        reconcile_interval: Seconds between the coordinator's sweeps for stalled jobs and GC.
        stall_timeout: Seconds a due schedule computation may go unclaimed before it is
            enqueued again (covers rq workers killed mid-job).
        reply_ttl: Seconds a registration reply waits in Redis for its client.
        job_timeout: Seconds one rq scheduler task may run (planning a large pipeline inside
            a scheduler takes minutes; rq's own default is 180 s).
        max_entry_bytes: Largest stream entry the coordinator decodes; a larger one is
            dead-lettered with its first bytes and size only. At most
            :data:`MAX_ENTRY_BYTES_LIMIT` (64 MiB).
        max_world_size: Most ranks a job may register with; at most
            :data:`MAX_WORLD_SIZE_LIMIT` (1,000,000).
        max_frequencies: Most clocks a rank may register (an H100 has 110); at most
            :data:`MAX_FREQUENCIES_LIMIT` (10,000).
        max_sweep_versions: Most schedule versions a job's profiling sweep may take (one per
            clock swept, e.g. ``InstructionProfiler``); a rank whose clocks would make it
            longer is refused when it registers. At most :data:`MAX_SWEEP_VERSIONS_LIMIT`
            (10,000).
        snapshot_every: Schedule versions between snapshots of a job's scheduler state
            (schedulers that support them); each snapshot deletes the profiling results it
            consumed, so a long job's Redis memory stays flat. 0: never.
    """

    # Finite numbers only: an interval of inf would never sweep, a TTL of nan never expire.
    model_config = SettingsConfigDict(env_prefix="PERSEUS_", extra="forbid", allow_inf_nan=False)

    redis_url: str = "redis://localhost:6379/0"
    scheduler: str = ""
    # Parsed here, not by pydantic-settings' json.loads: a key given twice is refused.
    scheduler_args: Annotated[dict[str, Any], NoDecode] = Field(default_factory=dict)
    plan: str = ""
    log_level: str = "INFO"
    dump_data: bool = False
    dump_dir: str = "./dump"
    max_job_idle_time: int = Field(default=60 * 60 * 24 * 7, ge=1, le=_YEAR)
    finished_retention: float = Field(default=60 * 60 * 24, ge=0, le=_YEAR)
    start_retention: float = Field(default=60 * 60, ge=_MS, le=_YEAR)
    stream_maxlen: int = Field(default=100_000, ge=100, le=_REDIS_INT)
    stream_hard_cap: int = Field(default=1_000_000, ge=10, le=_REDIS_INT)
    reconcile_interval: float = Field(default=2.0, ge=_MS, le=_YEAR)
    stall_timeout: float = Field(default=10.0, ge=_MS, le=_YEAR)
    reply_ttl: int = Field(default=300, ge=1, le=_YEAR)
    job_timeout: int = Field(default=3600, ge=1, le=_YEAR)
    max_entry_bytes: int = Field(default=1_048_576, ge=1024)
    max_world_size: int = Field(default=100_000, ge=1)
    max_frequencies: int = Field(default=1024, ge=1)
    max_sweep_versions: int = Field(default=256, ge=1)
    snapshot_every: int = Field(default=10, ge=0)

    @field_validator("scheduler_args", mode="before")
    @classmethod
    def _scheduler_args(cls, value: Any) -> Any:
        if isinstance(value, str | bytes):
            try:
                return loads_unique(value)
            except RecursionError:
                raise ValueError("not JSON: nested too deeply") from None
            except DuplicateKeyError:
                raise
            except ValueError as exc:
                raise ValueError(f"not JSON: {exc}") from None
        return value

    @field_validator(*_CEILINGS)
    @classmethod
    def _at_most_ceiling(cls, value: int, info: ValidationInfo) -> int:
        # A limit past its ceiling guards nothing: 10**18 was taken, and then used.
        ceiling, why = _CEILINGS[str(info.field_name)]
        if value > ceiling:
            raise ValueError(f"must be at most {ceiling} ({why}), got {value}")
        return value

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, value: str) -> str:
        upper = value.upper()
        if not isinstance(logging.getLevelName(upper), int):
            raise ValueError(f"unknown log level {value!r} (use DEBUG, INFO, WARNING, ERROR)")
        return upper

    # Settings that decide what a job gets or when it is deleted: coordinators that share a
    # Redis (and so share jobs) must agree on these.
    SHARED: ClassVar[tuple[str, ...]] = (
        "scheduler",
        "scheduler_args",
        "max_job_idle_time",
        "finished_retention",
        "start_retention",
        "stall_timeout",
        "reply_ttl",
        "job_timeout",
        "stream_maxlen",
        "stream_hard_cap",
        "max_entry_bytes",
        "max_world_size",
        "max_frequencies",
        "max_sweep_versions",
    )

    def shared(self) -> dict[str, Any]:
        """The settings in :attr:`SHARED`, as JSON-compatible values."""
        return {name: getattr(self, name) for name in self.SHARED}

    def check_scheduler(self) -> None:
        """Raise ConfigError unless the scheduler exists and accepts ``scheduler_args``.

        Called when a coordinator starts. Not a field validator, because rq workers and
        the inspection commands share these settings but never construct a scheduler.
        Relative paths in the arguments (``solution_path``, ``frontier_dir``, ...) are made
        absolute against this process's working directory first, so that jobs get the
        files checked here whatever the rq workers' working directory.
        """
        if not self.scheduler:
            if self.scheduler_args:
                # Zeus's server takes a solution_path alone (PointSolution was its default):
                # silently dropped, the arguments would leave every job refused.
                raise ConfigError(
                    f"scheduler_args {sorted(self.scheduler_args)} are set but no scheduler "
                    "(PERSEUS_SCHEDULER / --scheduler is empty): name the scheduler they are "
                    "for, e.g. --scheduler PointSolution"
                )
            return  # No default: every job must name its scheduler when it registers.
        scheduler = resolve_scheduler(self.scheduler)
        takes_plan = "solution_path" in inspect.signature(scheduler).parameters
        if self.plan and not self.scheduler_args and takes_plan:
            self.scheduler_args = {"solution_path": self.plan}
        try:
            check_scheduler_args(self.scheduler, self.scheduler_args)
        except ConfigError as exc:
            if self.plan and takes_plan and "solution_path" not in self.scheduler_args:
                # The plan is set but was passed over: say so, or it reads as missing.
                raise ConfigError(
                    f"{exc} (plan={self.plan!r} is not used: it stands for solution_path only "
                    "when scheduler_args are empty; add it to them)"
                ) from None
            if self.plan and not takes_plan:
                # PERSEUS_SCHEDULER=FrontierScheduler beside a plan: not what the user meant.
                raise ConfigError(
                    f"{exc} (plan={self.plan!r} is not used: {self.scheduler} takes no "
                    "solution_path; give it its own scheduler_args)"
                ) from None
            raise
        self.scheduler_args = scheduler.absolute_paths(self.scheduler_args)
        scheduler.check_files(self.scheduler_args)

    def check_dump_dir(self, name: str = "dump_dir") -> None:
        """With dumps on, ``dump_dir`` must be a folder this process can make and write in.

        Called when a coordinator starts: the rq workers write the dumps, and a file or an
        unwritable folder there failed every dump later, in a worker's log only. A relative
        folder is made absolute against this process's working directory, as the scheduler's
        paths are, so that workers started elsewhere write where was checked.

        Args:
            name: How the user gave it, for the message (``--dump-dir``, ``PERSEUS_DUMP_DIR``).

        Raises:
            ConfigError: The folder is empty, a file, or under a file or an unwritable folder.
        """
        if not self.dump_data:
            return
        if not self.dump_dir.strip():  # JobConfig's "" means no dumps: dump_data did nothing
            raise ConfigError(f"{name} is empty while dumps are on: name a folder")
        check_writable(name, Path(self.dump_dir), folder=True)
        self.dump_dir = os.path.abspath(self.dump_dir)


OTHER_VARIABLES = frozenset(
    {
        # The simulated GPU (worker_client/simulated, worker_client/gpu/nvml.py).
        "PERSEUS_SIM_GPU_DIR",
        "PERSEUS_SIM_GPU_COUNT",
        "PERSEUS_SIM_GPU_DENY",
        # Read by docker-compose.yml and benchmarks/device_h100.sh, not by the services.
        "PERSEUS_REDIS_PASSWORD",
        "PERSEUS_REDIS_PORT",
        "PERSEUS_DEVICE_SIMULATE",
        # `perseus acl`'s passwords.
        "PERSEUS_ACL_RANK_PASSWORD",
        "PERSEUS_ACL_SERVICE_PASSWORD",
        "PERSEUS_ACL_OPERATOR_PASSWORD",
    }
)
"""``PERSEUS_*`` variables that are not settings but are read elsewhere."""


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """Messages for ``PERSEUS_*`` variables that nothing reads (a typo would go unnoticed).

    pydantic-settings ignores prefixed variables that match no field, so ``extra="forbid"``
    alone does not catch ``PERSEUS_SCHEDULR``. It reads the settings whatever their case
    (``perseus_scheduler`` too, as Zeus's server read ``zeus_pfo_scheduler``), so they are
    checked whatever the case; the other variables are read only as written in
    :data:`OTHER_VARIABLES`, and a setting spelt two ways (either of which pydantic-settings
    might take) is refused.
    """
    fields = {f"PERSEUS_{name.upper()}" for name in PerseusSettings.model_fields}
    known = fields | OTHER_VARIABLES
    prefix = len("PERSEUS_")
    messages = []
    spellings: dict[str, list[str]] = {}
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith("PERSEUS_"):
            continue
        if upper in fields:
            spellings.setdefault(upper, []).append(name)
            continue
        if name in OTHER_VARIABLES:
            continue
        # Compared without the prefix, which every name shares: PERSEUS_FOO is not
        # close to PERSEUS_PLAN.
        hint = did_you_mean(upper[prefix:], (k[prefix:] for k in known), prefix="PERSEUS_")
        messages.append(f"unknown environment variable {name}{hint}")
    for names in spellings.values():
        if len(names) > 1:
            messages.append(f"{' and '.join(names)} are one setting spelt two ways: keep one")
    return messages


#: The prefix of Zeus's server settings (``PFOServerSettings``), which perseus does not read.
ZEUS_PREFIX = "ZEUS_PFO_"
#: Zeus's server settings (``PFOServerSettings``' fields), each one of ours too.
ZEUS_SETTINGS = frozenset(
    {"SCHEDULER", "SCHEDULER_ARGS", "LOG_LEVEL", "DUMP_DATA", "DUMP_DIR", "MAX_JOB_IDLE_TIME"}
)


def zeus_variables(environ: Mapping[str, str]) -> list[str]:
    """Notes for Zeus's ``ZEUS_PFO_*`` variables: a Zeus deployment's settings, not read here.

    Without them a coordinator set up as Zeus's server was (``ZEUS_PFO_SCHEDULER``, its args)
    started with no default scheduler, unsaid.
    """
    fields = {name.upper() for name in PerseusSettings.model_fields}
    # Zeus's settings read their variables whatever the case (pydantic v1), and so do ours.
    present = {name.upper() for name in environ}
    notes = []
    for name in sorted(environ):
        if not name.upper().startswith(ZEUS_PREFIX):
            continue
        field = name[len(ZEUS_PREFIX) :].upper()
        ours = f"PERSEUS_{field}"
        state = "set: that value is used" if ours in present else "not set"
        if field in ZEUS_SETTINGS:
            notes.append(
                f"{name} is Zeus's server variable, not read here: set {ours} instead ({state})"
            )
        elif field in fields:
            notes.append(
                f"{name} has the prefix of Zeus's server variables, but Zeus has no setting "
                f"{field}; not read here: set {ours} instead ({state})"
            )
        else:
            notes.append(
                f"{name} has the prefix of Zeus's server variables, but neither Zeus nor "
                f"perseus has a setting {field}; not read here"
            )
    return notes
