"""Scheduler lookup by name, and checking scheduler arguments before any job starts."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from coordinator.exceptions import ConfigError
from coordinator.models import JobInfo, RankInfo
from schedulers.base import FrequencyScheduler

# Name -> "module:attribute". Imported lazily so that picking one scheduler does not import
# every other scheduler's dependencies.
BUILTIN: dict[str, str] = {
    "PointSolution": "schedulers.point_solution:PointSolution",
    "PointSolution3D": "schedulers.point_solution:PointSolution3D",
    "FrontierScheduler": "schedulers.frontier:FrontierScheduler",
    "FrontierScheduler3D": "schedulers.frontier:FrontierScheduler3D",
    "InstructionProfiler": "schedulers.instruction_profiler:InstructionProfiler",
}


def register(name: str, target: str) -> None:
    """Make ``target`` (``"module:Class"``) available as scheduler ``name``."""
    BUILTIN[name] = target


def resolve_scheduler(name: str) -> type[FrequencyScheduler]:
    """Return the scheduler class for a builtin name or a ``module:Class`` path.

    Raises:
        ConfigError: unknown name, import failure, or not a FrequencyScheduler subclass.
    """
    target = BUILTIN.get(name, name)
    module_name, sep, attr = target.partition(":")
    if not sep:
        known = ", ".join(sorted(BUILTIN))
        raise ConfigError(f"unknown scheduler {name!r}; use one of {known} or 'module:Class'")
    try:
        module = importlib.import_module(module_name)
        cls = getattr(module, attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load scheduler {name!r} from {target!r}: {exc}") from None
    if not (inspect.isclass(cls) and issubclass(cls, FrequencyScheduler)):
        raise ConfigError(f"scheduler {name!r} ({target}) is not a FrequencyScheduler subclass")
    return cls


def check_scheduler_args(name: str, args: dict[str, Any]) -> None:
    """Check that ``args`` fit the scheduler's constructor, with a clear error if not."""
    cls = resolve_scheduler(name)
    try:
        inspect.signature(cls).bind(job_info=None, rank_infos=None, **args)
    except TypeError as exc:
        params = [
            p for p in inspect.signature(cls).parameters if p not in ("job_info", "rank_infos")
        ]
        raise ConfigError(
            f"invalid scheduler_args {sorted(args)} for scheduler {name}: {exc} "
            f"(it takes: {', '.join(params) or 'nothing'})"
        ) from None
    cls.check_args(args)


def build_scheduler(
    name: str, job_info: JobInfo, rank_infos: list[RankInfo], args: dict[str, Any]
) -> FrequencyScheduler:
    """Construct scheduler ``name`` for a job."""
    cls = resolve_scheduler(name)
    return cls(job_info=job_info, rank_infos=rank_infos, **args)
