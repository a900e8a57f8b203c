"""The few errors perseus-mq raises; redis and NVML errors are converted at the boundary."""

from __future__ import annotations


class PerseusError(Exception):
    """Base class of every perseus-mq error."""


class ConfigError(PerseusError, ValueError):
    """Settings, scheduler arguments or an input file are invalid."""


class ProtocolError(PerseusError):
    """A message or a stored value does not follow the protocol (bad entry, wrong rank, ...)."""


class UnknownJobError(ProtocolError):
    """A job id that the coordinator does not know (never registered, or garbage-collected)."""


class DuplicateEntryError(ProtocolError):
    """A request that was already answered arrived again (redelivered or replayed).

    Dead-lettered without a reply: the first reply is the one its client waits for.
    """


class WrongTokenError(ProtocolError):
    """A result or heartbeat does not carry the token its rank got when it registered."""


class ScheduleError(PerseusError, RuntimeError):
    """The schedule and the training loop disagree (wrong instruction, too few or many).

    A ``RuntimeError`` too, as Zeus raises: a loop written against Zeus still catches it.
    """


class JobFailedError(PerseusError):
    """The job's scheduler failed; the ranks keep their last schedule (see ``job_error``)."""


class CoordinatorUnavailableError(PerseusError):
    """Redis or the coordinator did not answer in time."""


class GPUError(PerseusError):
    """An NVML call failed (no permission, unsupported, no such device).

    Attributes:
        code: The NVML error code when the error came from NVML, else None.
    """

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code
