"""Checks of PerseusOptimizer's arguments, made before anything starts."""

from __future__ import annotations

from collections.abc import Callable

import torch

from protocol.exceptions import ConfigError
from worker_client.hook.clock_requests import Marker, cuda_marker


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
        ValueError: A number out of range or an unknown ``clock_sync``.
        ConfigError: ``clock_sync="events"`` without CUDA and without a ``marker_fn``.
    """
    if clock_sync not in ("wait", "events"):
        raise ValueError(f"clock_sync must be 'wait' or 'events', got {clock_sync!r}")
    if clock_sync == "events" and marker_fn is None:
        if not torch.cuda.is_available():
            raise ConfigError("clock_sync='events' needs CUDA events (or a marker_fn)")
        marker_fn = cuda_marker
    if report_every < 1:
        raise ValueError(f"report_every must be >= 1, got {report_every}")
    if outage_timeout is not None and outage_timeout <= 0:
        raise ValueError(f"outage_timeout must be > 0 seconds or None, got {outage_timeout}")
    if heartbeat_interval <= 0:
        raise ValueError(f"heartbeat_interval must be > 0 seconds, got {heartbeat_interval}")
    if not schedule_timeout > 0:
        raise ValueError(f"schedule_timeout must be > 0 seconds, got {schedule_timeout}")
    return marker_fn
