"""Checks of PerseusOptimizer's arguments, made before anything starts."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import ParamSpec

import torch

from protocol.exceptions import ConfigError
from worker_client.hook.clock_requests import Marker, cuda_marker

#: Fewest seconds between a rank's heartbeats: a shorter interval (a value meant in
#: milliseconds, say) made every rank's watcher send one per 1 ms read, flooding Redis.
MIN_HEARTBEAT_INTERVAL_S = 0.1

#: The controller names ``make_controller`` takes (an unknown one raised only once NVML was open).
CONTROLLER_KINDS = ("nvml", "dry-run", "simulated")


_P = ParamSpec("_P")


def refuse_zeus_keywords(owner: str, kwargs: Mapping[str, object]) -> None:
    """Raise ConfigError if ``kwargs`` hold Zeus's ``server_url``, saying what to pass instead.

    Zeus's PerseusOptimizer met its HTTP server at ``server_url``; perseus-mq's ranks meet in
    Redis, at ``redis_url`` in the same positional place. Passed as a keyword, Zeus's name got
    Python's bare "unexpected keyword argument".
    """
    if "server_url" in kwargs:
        raise ConfigError(
            f"{owner} takes no server_url (Zeus's HTTP server): perseus-mq takes redis_url, "
            'the Redis URL `perseus coordinator` uses (e.g. redis_url="redis://host:6379/0"), '
            "in the same place"
        )


def zeus_keywords(init: Callable[_P, None]) -> Callable[_P, None]:
    """Wrap a constructor so that Zeus's ``server_url`` is a clear ConfigError (same signature)."""

    @functools.wraps(init)
    def checked(*args: _P.args, **kwargs: _P.kwargs) -> None:
        refuse_zeus_keywords("PerseusOptimizer", kwargs)
        init(*args, **kwargs)

    return checked


def _shown(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


def whole_number(name: str, value: object, minimum: int) -> int:
    """Return ``value`` if it is an ``int`` (not a bool) of at least ``minimum``.

    Raises:
        ConfigError: Naming the argument: ``2.5``, ``"10"`` or ``True`` failed later, inside
            a step or a thread, or were taken for another number.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be a whole number (int), got {_shown(value)}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


def _seconds(name: str, value: object, minimum: float = 0.0) -> float:
    """``value`` if it is a finite number of seconds above ``minimum`` (at least it)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be a number of seconds, got {_shown(value)}")
    # NaN compares false with everything: a NaN heartbeat interval never beat, a NaN
    # outage_timeout never expired, both silently.
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number of seconds, got {value!r}")
    if minimum > 0 and value < minimum:
        raise ConfigError(f"{name} must be >= {minimum:g} seconds, got {value!r}")
    if value <= 0:
        raise ConfigError(f"{name} must be > 0 seconds, got {value!r}")
    return float(value)


def check_options(
    report_every: int,
    schedule_timeout: float,
    outage_timeout: float | None,
    heartbeat_interval: float,
    clock_sync: str,
    marker_fn: Callable[[], Marker] | None,
) -> Callable[[], Marker] | None:
    """Raise naming the first bad argument; return the marker function ``clock_sync`` uses.

    Raises:
        ConfigError: (a ``ValueError``) A value of the wrong type, a number out of range or
            not finite, an unknown ``clock_sync``, or ``clock_sync="events"`` without CUDA and
            without a ``marker_fn``.
    """
    if clock_sync not in ("wait", "events"):
        raise ConfigError(f"clock_sync must be 'wait' or 'events', got {clock_sync!r}")
    if clock_sync == "events" and marker_fn is None:
        if not torch.cuda.is_available():
            raise ConfigError("clock_sync='events' needs CUDA events (or a marker_fn)")
        marker_fn = cuda_marker
    whole_number("report_every", report_every, 1)
    if outage_timeout is not None:
        _seconds("outage_timeout", outage_timeout)
    _seconds("heartbeat_interval", heartbeat_interval, MIN_HEARTBEAT_INTERVAL_S)
    _seconds("schedule_timeout", schedule_timeout)
    return marker_fn


def check_identity(
    layout: Mapping[str, object],
    redis_url: object,
    job_metadata: object,
    nvml_module: object,
    controller: object,
    flags: Mapping[str, object],
    scheduler: object,
    scheduler_args: object,
) -> None:
    """Raise naming the first argument of the wrong type, before NVML or Redis is touched.

    Args:
        layout: ``rank``, ``dp_rank``, ... ``world_size`` and ``device_id``: ints; the
            degrees and ``world_size`` at least 1, the others at least 0.
        redis_url: A string.
        job_metadata: A string or None.
        nvml_module: A module name.
        controller: A controller name, or an object with ``set_frequency`` and ``stop``.
        flags: Arguments that must be a bool (or None where the name is in ``optional``).
        scheduler: A scheduler name or None.
        scheduler_args: A dict with string keys, or None.

    Raises:
        ConfigError: Naming the argument and what it got (a controller of ``5`` was taken,
            and failed only when the hook closed; ``raise_on_job_error="no"`` meant True).
    """
    for name, value in layout.items():
        whole_number(name, value, 1 if name.endswith(("_degree", "_size")) else 0)
    # Out of range, these reached the coordinator, which registered the job, then refused it.
    for axis in ("dp", "pp", "tp"):
        index, degree = layout[f"{axis}_rank"], layout[f"{axis}_degree"]
        if isinstance(index, int) and isinstance(degree, int) and index >= degree:
            raise ConfigError(
                f"{axis}_rank={index} is out of range: {axis}_degree is {degree} "
                f"(0 to {degree - 1})"
            )
    if not isinstance(redis_url, str):
        raise ConfigError(f"redis_url must be a string (redis://...), got {_shown(redis_url)}")
    for name, text in (("job_metadata", job_metadata), ("scheduler", scheduler)):
        if text is not None and not isinstance(text, str):
            raise ConfigError(f"{name} must be a string or None, got {_shown(text)}")
    if not isinstance(nvml_module, str):
        raise ConfigError(f"nvml_module must be a module name, got {_shown(nvml_module)}")
    if (
        (controller not in CONTROLLER_KINDS)
        if isinstance(controller, str)
        else not all(
            callable(getattr(controller, method, None)) for method in ("set_frequency", "stop")
        )
    ):
        raise ConfigError(
            "controller must be 'nvml', 'dry-run', 'simulated' or an object with "
            f"set_frequency(frequency) and stop(), got {_shown(controller)}"
        )
    for name, flag in flags.items():
        if not isinstance(flag, bool) and not (flag is None and name == "instruction_energy"):
            allowed = "True, False or None" if name == "instruction_energy" else "True or False"
            raise ConfigError(f"{name} must be {allowed}, got {_shown(flag)}")
    if scheduler_args is not None:
        if not isinstance(scheduler_args, dict):
            raise ConfigError(
                f"scheduler_args must be a dict of argument names, got {_shown(scheduler_args)}"
            )
        bad = [key for key in scheduler_args if not isinstance(key, str)]
        if bad:
            raise ConfigError(f"scheduler_args keys must be strings, got {bad[0]!r}")
