"""Where the training hook gets energy from, without NVML calls it cannot afford.

The hook only takes *marks* on the training thread (at step and, optionally, instruction
boundaries) and turns pairs of marks into Joules when it builds a report, on another thread.
What a mark is depends on the source:

* :class:`CounterEnergySource`: the GPU's cumulative energy counter, read at each mark. Exact
  where a read is cheap and the counter is fine-grained (the simulated GPU: ~0.1 ms a read).
  On an H100 a read takes ~3 ms and the counter moves ~10 times a second, so it suits step
  boundaries there, not 12 ms instructions.
* :class:`MonitorEnergySource`: a ``time.perf_counter()`` timestamp (nanoseconds to take);
  the energy comes from an :class:`~worker_client.gpu.energy.EnergyMonitor`'s background samples,
  interpolated at the two timestamps. The choice for per-instruction energy on real GPUs.
* :class:`NullEnergySource`: always 0 J (no energy measurement).

:func:`default_energy_source` picks the counter where a read is cheap and a monitor where it
is not; the hook uses it unless given a source.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol, runtime_checkable

from protocol.exceptions import ConfigError, GPUError
from protocol.models import ProfilingResult
from worker_client.gpu.energy import EnergyMonitor
from worker_client.gpu.nvml import NVML

logger = logging.getLogger(__name__)


Mark = tuple[float, float]  # (start mark, end mark) of an energy source


@runtime_checkable
class EnergySource(Protocol):
    """Marks on the hot path; energies between marks later."""

    def mark(self) -> float:
        """Return a mark for 'now'; cheap, called on the training thread."""
        ...

    def energy(self, start_mark: float, end_mark: float) -> float:
        """Energy used between two marks, Joules; may wait briefly (called off the hot path)."""
        ...


class CounterEnergySource:
    """Marks are readings of the GPU's cumulative energy counter, in Joules.

    A GPU without the counter (or a failing read) gives 0 J, with one warning.

    Args:
        nvml: The NVML facade to read through.
        device: NVML index of the GPU.

    """

    def __init__(self, nvml: NVML, device: int) -> None:
        self.nvml = nvml
        self.device = device
        self._warned = False

    def mark(self) -> float:
        """Read the energy counter, Joules (0.0 if the GPU has none)."""
        try:
            mj = self.nvml.total_energy_mj(self.device)
        except GPUError as exc:
            self._warn(str(exc))
            return 0.0
        if mj is None:
            self._warn("no energy counter")
            return 0.0
        return mj / 1000.0

    def energy(self, start_mark: float, end_mark: float) -> float:
        """Counter difference, Joules (0 if the counter went back, e.g. a driver reload)."""
        return max(0.0, end_mark - start_mark)

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("GPU %d: energy reads as 0 J (%s)", self.device, why)


class MonitorEnergySource:
    """Marks are timestamps; energies are interpolated from an EnergyMonitor's samples.

    Args:
        monitor: A running monitor that samples ``gpu`` (the caller owns and closes it, unless
            ``owned``).
        gpu: The GPU to report, by the monitor's index (CUDA's, unless it was built with
            ``index_space="nvml"``).
        owned: :meth:`close` closes the monitor.

    Raises:
        ConfigError: ``monitor`` does not sample ``gpu``.

    """

    def __init__(self, monitor: EnergyMonitor, gpu: int, owned: bool = False) -> None:
        if gpu not in monitor.gpu_indices:
            raise ConfigError(
                f"the energy monitor samples GPUs {monitor.gpu_indices}, not GPU {gpu}"
            )
        self.monitor = monitor
        self.gpu = gpu
        self.owned = owned

    def close(self) -> None:
        """Stop the monitor's sampler thread if this source started it."""
        if self.owned:
            self.monitor.close()

    def mark(self) -> float:
        """Return ``time.perf_counter()`` (the monitor's time base)."""
        return time.perf_counter()

    def energy(self, start_mark: float, end_mark: float) -> float:
        """Interpolated energy between two timestamps; waits for samples past ``end_mark``."""
        return self.monitor.energy_between(self.gpu, start_mark, end_mark)


SLOW_READ_S = 0.001
"""A counter read slower than this (an H100 takes ~3 ms) is kept off the training thread."""
TIMED_READS = 5
"""Reads timed before a counter counts as slow: the first fast one decides."""


def default_energy_source(nvml: NVML, device: int) -> CounterEnergySource | MonitorEnergySource:
    """The hook's energy source when it is given none: the GPU's counter, read where it is cheap.

    Times a counter read. Where it is fast (the simulated GPU), marks read the counter on the
    training thread: exact, and nearly free. Where it is slow (a real GPU), a sampler thread of
    an :class:`~worker_client.gpu.energy.EnergyMonitor` reads it and marks are timestamps, so
    the training thread never waits on NVML; :meth:`MonitorEnergySource.close` stops it.
    """
    for _ in range(TIMED_READS):
        start = time.perf_counter()
        try:
            nvml.total_energy_mj(device)
        except GPUError:
            return CounterEnergySource(nvml, device)  # Reads 0 J, with one warning.
        if time.perf_counter() - start < SLOW_READ_S:
            # One fast read is proof enough; a slow one may be a busy machine's preemption
            # (a loaded test run once got a monitor for the simulated GPU, whose counter only
            # moves with simulated work, and its first window failed).
            return CounterEnergySource(nvml, device)
    monitor = EnergyMonitor([device], nvml=nvml, sync_cuda=False, index_space="nvml")
    return MonitorEnergySource(monitor, device, owned=True)


class NullEnergySource:
    """No energy measurement: every energy is 0 J."""

    def mark(self) -> float:
        """Return 0.0."""
        return 0.0

    def energy(self, start_mark: float, end_mark: float) -> float:
        """Return 0.0."""
        return 0.0


def measured_result(
    source: EnergySource,
    rank: int,
    version: int,
    iter_time: list[float],
    iter_marks: list[Mark],
    breakdown: dict[str, list[list[float]]],
    mark_breakdown: dict[str, list[list[Mark]]],
) -> ProfilingResult:
    """A rank's result from its timings and the energy between its marks (in Joules).

    Raises:
        pydantic.ValidationError: A figure is unusable (NaN, a counter that went backwards).
    """
    return ProfilingResult(
        rank=rank,
        schedule_version=version,
        iter_time=iter_time,
        iter_energy=[source.energy(a, b) for a, b in iter_marks],
        time_breakdown=breakdown,
        energy_breakdown={
            k: [[source.energy(a, b) for a, b in it] for it in v] for k, v in mark_breakdown.items()
        },
    )
