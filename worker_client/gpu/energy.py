"""GPU energy measurement windows whose NVML reads happen on a background thread.

Why a sampler thread: on an H100, ``nvmlDeviceGetTotalEnergyConsumption`` takes about 3 ms and
its value changes only about 10 times a second, so reading the counter at the start and end
of a 12 ms forward pass costs 6 ms of the training thread and reports 0 J. Here a
:class:`PowerSampler` thread reads every GPU every ``sample_interval`` seconds and keeps a short
history of *knots*: points of the cumulative energy curve, each with a timestamp and a
timing uncertainty. :meth:`EnergyMonitor.begin_window` and :meth:`EnergyMonitor.end_window` only
take timestamps; the window's energy is the cumulative curve interpolated at its two ends.

How knots are placed and how each window's error bound is derived:
:mod:`worker_client.gpu.energy_sampler`.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

from protocol.exceptions import ConfigError, GPUError
from worker_client.gpu.energy_sampler import COUNTER, POWER, Pin, PowerSampler, window_energy
from worker_client.gpu.nvml import NVML

logger = logging.getLogger(__name__)

__all__ = [
    "COUNTER",
    "POWER",
    "EnergyMonitor",
    "Measurement",
    "PendingMeasurement",
    "PowerSampler",
]


@dataclass(frozen=True)
class Measurement:
    """Time and energy of one measurement window.

    Attributes:
        time: Window length, seconds.
        gpu_energy: GPU index -> energy estimate, Joules.
        gpu_energy_error_bound: GPU index -> bound on ``|estimate - true energy|``, Joules
            (derived as :mod:`worker_client.gpu.energy_sampler` explains).
        start: ``time.perf_counter()`` at the window's start.
        end: ``time.perf_counter()`` at the window's end.

    """

    time: float
    gpu_energy: dict[int, float]
    gpu_energy_error_bound: dict[int, float] = field(default_factory=dict)
    start: float = 0.0
    end: float = 0.0

    @property
    def total_energy(self) -> float:
        """Energy summed over all GPUs, Joules."""
        return sum(self.gpu_energy.values())

    @property
    def energy_error_bound(self) -> float:
        """Bound on the error of :attr:`total_energy` (sum of the per-GPU bounds), Joules."""
        return sum(self.gpu_energy_error_bound.values())


def _sync_cuda() -> None:
    """Wait for queued CUDA work, so that timestamps mean 'the GPU finished'."""
    torch = sys.modules.get("torch")  # only if the program already uses torch
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class PendingMeasurement:
    """A window that has ended and whose energy awaits the sampler's next data."""

    def __init__(self, monitor: EnergyMonitor, t0: float, t1: float, p0: Pin, p1: Pin) -> None:
        self._monitor, self._t0, self._t1, self._pins = monitor, t0, t1, (p0, p1)
        self._result: Measurement | None = None

    def done(self) -> bool:
        """Whether :meth:`result` would return without waiting."""
        n = len(self._monitor.gpu_indices)
        return self._result is not None or all(len(p.anchors) == n for p in self._pins)

    def result(self) -> Measurement:
        """Return the measurement (waits at most ``end_timeout``, then extrapolates)."""
        if self._result is None:
            sampler, timeout = self._monitor.sampler, self._monitor.end_timeout
            starts, ends = (sampler.wait(p, timeout) for p in self._pins)
            energy: dict[int, float] = {}
            bound: dict[int, float] = {}
            for i, n in self._monitor._nvml_of.items():
                energy[i], bound[i] = window_energy(starts[n], ends[n])
            self._result = Measurement(self._t1 - self._t0, energy, bound, self._t0, self._t1)
        return self._result


class EnergyMonitor:
    """Named, possibly overlapping, time and energy measurement windows over some GPUs.

    Only the constructor talks to NVML on the calling thread; sampling runs on a
    :class:`PowerSampler` thread and windows are computed from its history (see the module
    docstring for the estimate and its error bound).

    Args:
        gpu_indices: The GPUs to measure, by CUDA index as for Zeus's ``ZeusMonitor``
            (default: every visible one); measurements are keyed by them.
        nvml: NVML facade (default: the real ``pynvml``).
        sample_interval: Seconds between two sampler reads of every GPU.
        approx_instant_energy: Interpolate the cumulative energy curve (True), so that windows
            shorter than the counter's update period get an estimate; False reports the raw
            counter staircase (0 J within one update period) with a correspondingly wide bound.
        history_seconds: Seconds of sample history kept per GPU.
        end_timeout: At most this many seconds :meth:`end_window` waits for a sample after the
            window's end before extrapolating (with a wider bound).
        start_timeout: At most this many seconds the constructor waits for first samples.
        sync_cuda: Call ``torch.cuda.synchronize()`` (if torch and CUDA are in use) before
            taking the begin and end timestamps.
        index_space: ``"cuda"`` (default), or ``"nvml"``: ``gpu_indices`` are NVML's indices
            (:attr:`nvml_indices` always are; they differ where ``CUDA_VISIBLE_DEVICES`` is set).

    """

    def __init__(
        self,
        gpu_indices: list[int] | None = None,
        nvml: NVML | None = None,
        sample_interval: float = 0.1,
        approx_instant_energy: bool = True,
        history_seconds: float = 60.0,
        end_timeout: float = 2.0,
        start_timeout: float = 2.0,
        sync_cuda: bool = True,
        index_space: Literal["cuda", "nvml"] = "cuda",
    ) -> None:
        self.nvml = nvml if nvml is not None else NVML()
        cuda = index_space == "cuda"
        count = self.nvml.visible_count() if cuda else self.nvml.device_count()
        indices = list(range(count)) if gpu_indices is None else list(gpu_indices)
        if not indices:
            raise ConfigError("EnergyMonitor needs at least one GPU")
        bad = [i for i in indices if not 0 <= i < count]
        if bad or len(set(indices)) != len(indices):
            raise ConfigError(
                f"gpu_indices {indices} must be distinct {index_space.upper()} indices < {count}"
            )
        self.gpu_indices = indices
        self.nvml_indices = [self.nvml.cuda_to_nvml(i) for i in indices] if cuda else indices
        self._nvml_of = dict(zip(indices, self.nvml_indices, strict=True))
        self.end_timeout = end_timeout
        self.sync_cuda = sync_cuda
        self._windows: dict[str, tuple[float, Pin]] = {}
        self._lock = threading.Lock()
        self.sampler = PowerSampler(
            self.nvml, self.nvml_indices, sample_interval, history_seconds, approx_instant_energy
        )
        self.sampler.start()
        if not self.sampler.wait_ready(start_timeout):
            if self.sampler.error is not None:
                raise GPUError(f"energy sampling failed to start: {self.sampler.error}")
            logger.warning("no energy samples after %.1f s; estimates start wide", start_timeout)

    @property
    def modes(self) -> dict[int, str | None]:
        """GPU index -> how its energy is measured: ``"counter"`` or ``"power"`` (polling)."""
        modes = self.sampler.modes()
        return {i: modes.get(n) for i, n in self._nvml_of.items()}

    @property
    def open_windows(self) -> list[str]:
        """Names of the windows begun and not yet ended or cancelled."""
        with self._lock:
            return list(self._windows)

    def begin_window(self, name: str, sync_execution: bool = True) -> None:
        """Start the window ``name`` (ValueError if a window of that name is open)."""
        if sync_execution and self.sync_cuda:
            _sync_cuda()
        t0 = time.perf_counter()
        with self._lock:
            if name in self._windows:
                raise ValueError(f"measurement window {name!r} is already open")
            self._windows[name] = (t0, self.sampler.pin(t0))

    def end_window(
        self, name: str, sync_execution: bool = True, cancel: bool = False
    ) -> Measurement:
        """End the window ``name`` and return its time and energy.

        Blocks until the sampler has data past the window's end: with the counter, until its
        next update (up to one update period plus ``sample_interval``, at most
        ``end_timeout``). Use :meth:`end_window_deferred` to not block. ``cancel=True``
        discards it as :meth:`cancel_window` does and returns zeros (Zeus's way).

        Raises:
            ValueError: No open window is called ``name``.
            GPUError: The sampler thread failed.

        """
        if cancel:
            self.cancel_window(name)
            zeros = dict.fromkeys(self.gpu_indices, 0.0)
            now = time.perf_counter()
            return Measurement(0.0, zeros, dict(zeros), now, now)
        return self.end_window_deferred(name, sync_execution).result()

    def end_window_deferred(self, name: str, sync_execution: bool = True) -> PendingMeasurement:
        """End the window ``name`` now; compute its measurement later, on ``.result()``."""
        if sync_execution and self.sync_cuda:
            _sync_cuda()
        t1 = time.perf_counter()
        with self._lock:
            entry = self._windows.pop(name, None)
            open_names = list(self._windows)
        if entry is None:
            raise ValueError(f"no open measurement window {name!r} (open: {open_names})")
        t0, start_pin = entry
        return PendingMeasurement(self, t0, t1, start_pin, self.sampler.pin(t1))

    def measure_between(self, t0: float, t1: float) -> Measurement:
        """Time and energy of every GPU between two ``time.perf_counter()`` timestamps.

        For callers that keep their own timestamps (e.g. marks taken on a training thread and
        turned into energies later); waits like :meth:`end_window` when ``t1`` is recent.
        Timestamps older than the sample history are extrapolated (wider bound).

        Raises:
            GPUError: The sampler thread failed.

        """
        if t1 < t0:
            t0, t1 = t1, t0
        pending = PendingMeasurement(self, t0, t1, self.sampler.pin(t0), self.sampler.pin(t1))
        return pending.result()

    def energy_between(self, gpu: int, t0: float, t1: float) -> float:
        """Energy of GPU ``gpu`` between two ``time.perf_counter()`` timestamps, Joules.

        Raises:
            ValueError: ``gpu`` is not one of the monitored GPUs.
            GPUError: The sampler thread failed.

        """
        if gpu not in self.gpu_indices:
            raise ValueError(f"GPU {gpu} is not monitored (monitored: {self.gpu_indices})")
        return self.measure_between(t0, t1).gpu_energy[gpu]

    def cancel_window(self, name: str) -> None:
        """Discard the open window ``name`` (ValueError if there is none)."""
        with self._lock:
            entry = self._windows.pop(name, None)
            open_names = list(self._windows)
        if entry is None:
            raise ValueError(f"no open measurement window {name!r} (open: {open_names})")
        self.sampler.release(entry[1])

    def close(self) -> None:
        """Stop the sampler thread."""
        self.sampler.stop()

    def __enter__(self) -> EnergyMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
