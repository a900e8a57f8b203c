"""The hook's profiling windows turned into results, in report order, off the training thread."""

from __future__ import annotations

import logging
import threading
from typing import NamedTuple

from pydantic import ValidationError

from protocol.models import ProfilingResult
from worker_client.hook.build_thread import BuildThread
from worker_client.hook.energy_source import EnergySource, Mark, measured_result
from worker_client.hook.watchers import ResultReporter

# The hook's logger: what it says of results keeps the name it had before this module split off.
logger = logging.getLogger("worker_client.hook.optimizer")


class Window(NamedTuple):
    """One schedule version's profiling window as the training thread measured it."""

    iter_time: list[float]
    iter_marks: list[Mark]
    breakdown: dict[str, list[list[float]]]
    mark_breakdown: dict[str, list[list[Mark]]]


class ResultBuilder:
    """Turns a window's marks into Joules and its result, then hands it to the reporter.

    Runs on its own daemon thread (:class:`BuildThread`), so an energy source that must wait
    for samples never stalls a step. What the training thread must hear of (a build that
    failed, a window to measure again) waits in :meth:`take` for the next step end.

    Args:
        energy_source: Turns the window's marks into Joules.
        rank: The hook's global rank.
        reporter: Sends the results built.
    """

    def __init__(self, energy_source: EnergySource, rank: int, reporter: ResultReporter) -> None:
        self._source = energy_source
        self._rank = rank
        self._reporter = reporter
        self._thread = BuildThread("perseus-result")
        self._lock = threading.Lock()
        self._error: Exception | None = None
        self._error_version = 0  # the schedule version whose result _error lost
        self._remeasure = False  # set when a window must be measured again
        self.last_result: ProfilingResult | None = None  # the last result handed on

    def submit(self, n: int, version: int, window: Window) -> None:
        """Build the result of ``version``'s window from its first ``n`` steps, in turn.

        The window's lists must not change afterwards (a new window gets new ones).
        """
        self._thread.submit(self._build, n, version, window)

    def take(self) -> tuple[Exception | None, bool]:
        """The build error to raise (or None) and whether to measure the window again; cleared."""
        with self._lock:
            error, self._error = self._error, None
            remeasure, self._remeasure = self._remeasure, False
        return error, remeasure

    def flush(self) -> None:
        """Let the results being built reach the reporter; say one whose building failed."""
        self._thread.shutdown(wait=True)
        if self._error is not None:  # no step end follows to raise it
            logger.error(
                "rank %d: the profiling result of schedule version %d was not sent: building "
                "it failed: %s: %s",
                self._rank,
                self._error_version,
                type(self._error).__name__,
                self._error,
            )

    def _build(self, n: int, version: int, window: Window) -> None:
        """Builder thread: marks -> Joules, then hand the result to the reporter."""
        try:
            result = measured_result(
                self._source,
                self._rank,
                version,
                window.iter_time[:n],
                window.iter_marks[:n],
                {k: v[:n] for k, v in window.breakdown.items()},
                {k: v[:n] for k, v in window.mark_breakdown.items()},
            )
        except ValidationError as exc:
            # A glitch of the energy source (NaN, a counter that went backwards) must not stop
            # training, and a result the coordinator would refuse must not be sent: measure
            # this version again.
            logger.warning(
                "rank %d: measurements of schedule version %d are unusable, measuring again: %s",
                self._rank,
                version,
                exc.errors()[0].get("msg", exc) if exc.errors() else exc,
            )
            with self._lock:
                self._remeasure = True
            return
        except Exception as exc:  # Raised on the training thread at the next step end.
            with self._lock:
                self._error, self._error_version = exc, version
                # Nothing was sent for the version: should training go on, it is measured
                # again (its job waits for this rank's result).
                self._remeasure = True
            return
        self.last_result = result
        self._reporter.submit(result)
