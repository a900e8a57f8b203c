"""The measurement of the limit being profiled: its monitor windows and their reduction."""

from __future__ import annotations

import contextlib
import logging
import math

from worker_client.power_limit.limits import format_watts, refuse_failed_window
from worker_client.power_limit.monitor import Reducer, WindowMonitor

logger = logging.getLogger(__name__)


class LimitWindows:
    """Time and energy of the limit being profiled, over one window or several.

    Windows paused over epoch ends (``carry_across_epochs``) add up until :meth:`reduce`. A
    window that fails on one rank (an NVML read, the monitor, its cancel at an epoch end), or a
    power limit that rank could not set while profiling (see :meth:`fail`), does not raise
    there alone, which left the other ranks waiting in the limit's all-reduce: it is kept,
    nothing more of the limit is measured on that rank, and :meth:`reduce` carries it as NaN
    energy so that every rank raises together.

    Args:
        monitor: The optimizer's window monitor.
    """

    def __init__(self, monitor: WindowMonitor) -> None:
        self.monitor = monitor
        self.time = self.energy = 0.0
        self.failure: Exception | None = None

    @staticmethod
    def name(power_limit_mw: int) -> str:
        """The monitor window of a limit."""
        return f"__perseus_power_limit_{power_limit_mw // 1000}"

    def begin(self, power_limit_mw: int) -> None:
        """Begin the limit's window (not after a failure: the limit is not measured on)."""
        if self.failure is None:
            try:
                self.monitor.begin_window(self.name(power_limit_mw))
            except Exception as exc:  # kept for the reduction every rank joins
                self._failed(power_limit_mw, exc)

    def end(self, power_limit_mw: int) -> None:
        """End the limit's window and add what it measured."""
        if self.failure is None:
            try:
                result = self.monitor.end_window(self.name(power_limit_mw))
                self.time += float(result.time)
                self.energy += float(result.total_energy)
            except Exception as exc:  # kept for the reduction every rank joins
                self._failed(power_limit_mw, exc)

    def cancel(self, power_limit_mw: int) -> None:
        """Discard the limit's open window (none is open after a failure)."""
        if self.failure is None:
            try:
                self._cancel(self.name(power_limit_mw))
            except Exception as exc:  # kept for the reduction every rank joins
                self._failed(power_limit_mw, exc, "cancel the window of")

    def fail(self, power_limit_mw: int, exc: Exception) -> None:
        """Keep ``exc``, which stopped this rank profiling the limit, for its reduction.

        For a power limit this rank could not set while it profiles the limit. The first
        failure kept counts; no window of the limit is open then (it is set before one begins,
        and restored after one ends or is cancelled).
        """
        logger.warning(
            "could not set a power limit while profiling %s (every rank raises as the limit is "
            "reduced): %s",
            format_watts(power_limit_mw),
            exc,
        )
        if self.failure is None:
            self.failure = exc

    def reset(self) -> None:
        """Forget what was measured, and a failure (the limit starts over on every rank)."""
        self.time = self.energy = 0.0
        self.failure = None

    def reduce(self, power_limit_mw: int, reducer: Reducer) -> tuple[float, float]:
        """Every rank's (slowest time, summed energy) of the limit; then start afresh.

        Every rank calls this once per limit. A failed rank reduces NaN energy, which makes
        the sum NaN on every rank.

        Raises:
            Exception: This rank's window failed: its error.
            PerseusError: Another rank's window failed (named with the default reducer).
        """
        failure = self.failure
        energy = math.nan if failure is not None else self.energy
        time_s, energy_j = reducer(self.time, energy)
        self.reset()
        if math.isnan(energy_j):
            refuse_failed_window(power_limit_mw, failure, reducer)
        return time_s, energy_j

    def _failed(self, power_limit_mw: int, exc: Exception, what: str = "measure") -> None:
        logger.warning(
            "could not %s %s (every rank raises as the limit is reduced): %s",
            what,
            format_watts(power_limit_mw),
            exc,
        )
        self.failure = exc
        # The limit is profiled again after the error: no window of its name may stay open.
        # It may be closed already; the monitor's first error is the one that counts.
        with contextlib.suppress(Exception):
            self._cancel(self.name(power_limit_mw))

    def _cancel(self, name: str) -> None:
        cancel = getattr(self.monitor, "cancel_window", None)
        if cancel is not None:
            cancel(name)
        else:  # Zeus's ZeusMonitor
            self.monitor.end_window(name, cancel=True)  # type: ignore[call-arg]
