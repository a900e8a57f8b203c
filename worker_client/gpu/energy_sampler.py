"""The energy monitor's background NVML sampling and energy-curve interpolation.

:class:`PowerSampler` is the thread behind :class:`~worker_client.gpu.energy.EnergyMonitor`: it
reads every GPU every ``sample_interval`` seconds and keeps a short
history of *knots*: points of the cumulative energy curve, each with a timestamp and a timing
uncertainty. A window's energy is the curve interpolated at its two ends
(:func:`window_energy`).

Knots come from one of two sources per GPU, picked on the first sample:

* **counter** (``nvmlDeviceGetTotalEnergyConsumption``): a knot is placed where the counter
  value changed, half-way between the start of the last read that still saw the old value and
  the end of the first read that saw the new one. Its timing uncertainty is half of that span.
  Reads that see an unchanged value add no knot (the true energy did rise meanwhile).
* **power** (``nvmlDeviceGetPowerUsage``, for GPUs without the counter): every read is a knot;
  the energy between reads is the trapezoid of the two power readings.

Error bound (``Measurement.gpu_energy_error_bound``, Joules, per GPU), the sum of

* timing: ``P_max x (eps_start + eps_end)``, with ``eps`` the timing uncertainty of the knots
  around each end and ``P_max`` the largest power observed so far (average power between knots
  for the counter, readings for polling). When both ends fall between the same two knots the
  term is ``2 x P_max x eps x w / h`` (``w`` window length, ``h`` knot spacing);
* shape: linear interpolation between exact knots is off by at most ``band x h / 4`` at each
  end (and by ``band x w`` in all), where ``band`` is the spread of the power observed around
  that end (the knot interval, its neighbours);
* integration (power polling only): the trapezoid rule between two readings is off by at most
  ``|p_i - p_(i-1)| x h / 2``; these are summed over the window;

capped at ``max(estimate, P_max x w)`` because both the estimate and the truth lie in
``[0, P_max x w]``. Assumptions: power never exceeds ``P_max`` and stays within ``band`` between
knots (no spikes shorter than one counter update period, which the counter cannot see either),
and the counter value equals the energy at the moment it changed. With a 100 ms counter and
``sample_interval=0.01`` a steady 300 W, 12 ms window reads about 3.6 J with a bound below
1 J; a 10 s window's bound is a fraction of a percent.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from protocol.exceptions import ConfigError, GPUError
from worker_client.gpu.nvml import NVML

logger = logging.getLogger(__name__)

COUNTER = "counter"
POWER = "power"


@dataclass(frozen=True)
class _Knot:
    seq: int  # increases by one per knot of a GPU, survives history trimming
    t: float  # perf_counter seconds
    energy: float  # Joules since the sampler started
    eps: float  # the energy value belongs to some time within t +- eps
    err: float  # accumulated integration error bound up to here (power polling), Joules
    power: float | None  # W: average since the previous knot (counter) or the reading (power)


@dataclass(frozen=True)
class Anchor:
    """The cumulative energy curve of one GPU evaluated at one instant."""

    t: float
    energy: float
    err: float
    eps: float
    band: float  # spread of the power around t, W
    h: float  # spacing of the bracketing knots (0 when extrapolated)
    seq: int  # seq of the left bracketing knot, -1 when extrapolated
    p_max: float


class _Track:
    """Knot history and read state of one GPU (guarded by the sampler's lock)."""

    def __init__(self, index: int, maxlen: int) -> None:
        self.index = index
        self.mode: str | None = None
        self.knots: deque[_Knot] = deque(maxlen=maxlen)
        self.seq = 0
        self.p_max = 0.0
        # counter mode
        self.base_mj: int | None = None
        self.last_value: int | None = None
        self.last_before = 0.0
        self.offset_j = 0.0
        # power mode
        self.last_power: float | None = None
        self.last_t = 0.0
        self.energy = 0.0
        self.err = 0.0

    def add(self, t: float, energy: float, eps: float, err: float, power: float | None) -> None:
        self.knots.append(_Knot(self.seq, t, energy, eps, err, power))
        self.seq += 1
        if power is not None:
            self.p_max = max(self.p_max, power)


class Pin:
    """A request for every GPU's curve at time ``t``, filled in by the sampler thread."""

    def __init__(self, t: float) -> None:
        self.t = t
        self.anchors: dict[int, Anchor] = {}


class PowerSampler:
    """Background thread that reads NVML energy (or power) and answers interpolation queries.

    Args:
        nvml: The NVML facade to read through (only this thread calls it after construction).
        gpu_indices: NVML indices of the GPUs to sample.
        sample_interval: Seconds between two reads of every GPU. Smaller than the counter's
            update period (about 0.1 s on H100) localises counter updates better.
        history_seconds: How much knot history to keep per GPU.
        interpolate: Interpolate the cumulative curve (True) or report the raw counter
            staircase, which reads 0 J for windows between two counter updates (False).

    """

    def __init__(
        self,
        nvml: NVML,
        gpu_indices: list[int],
        sample_interval: float = 0.1,
        history_seconds: float = 60.0,
        interpolate: bool = True,
    ) -> None:
        if sample_interval <= 0:
            raise ConfigError(f"sample_interval must be positive, got {sample_interval}")
        self.nvml = nvml
        self.gpu_indices = list(gpu_indices)
        self.sample_interval = sample_interval
        self.interpolate = interpolate
        maxlen = max(64, int(history_seconds / sample_interval) + 8)
        self._tracks = {i: _Track(i, maxlen) for i in self.gpu_indices}
        self._pins: set[Pin] = set()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the sampling thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="perseus-energy", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the sampling thread."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the sampling thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def modes(self) -> dict[int, str | None]:
        """GPU index -> ``"counter"`` or ``"power"`` (None before the first read)."""
        with self._cond:
            return {i: tr.mode for i, tr in self._tracks.items()}

    def knots(self, index: int) -> list[tuple[float, float]]:
        """``(time, cumulative energy J)`` knots of one GPU, oldest first (for inspection)."""
        with self._cond:
            return [(k.t, k.energy) for k in self._tracks[index].knots]

    def wait_ready(self, timeout: float) -> bool:
        """Wait until every GPU has two knots (so that a slope exists); False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: all(len(tr.knots) >= 2 for tr in self._tracks.values()) or not self.alive,
                timeout,
            ) and all(len(tr.knots) >= 2 for tr in self._tracks.values())

    # --- queries (any thread; no NVML calls) ---------------------------------------------------
    def pin(self, t: float) -> Pin:
        """Ask for every GPU's cumulative energy at ``t``; resolved as knots after ``t`` arrive."""
        p = Pin(t)
        with self._cond:
            self._resolve(p, force=False)
            if len(p.anchors) < len(self._tracks):
                self._pins.add(p)
        return p

    def release(self, p: Pin) -> None:
        """Forget a pin that will not be waited on."""
        with self._cond:
            self._pins.discard(p)

    def wait(self, p: Pin, timeout: float) -> dict[int, Anchor]:
        """Wait (at most ``timeout`` s) for a pin; extrapolate the GPUs still missing then."""
        n = len(self._tracks)
        with self._cond:
            self._cond.wait_for(lambda: len(p.anchors) == n or not self.alive, timeout)
            self._pins.discard(p)
            if len(p.anchors) < n:
                if self.error is not None:
                    raise GPUError(f"the energy sampler thread failed: {self.error}")
                missing = [i for i in self._tracks if i not in p.anchors]
                logger.debug("no knot after t=%.3f for GPUs %s; extrapolating", p.t, missing)
                self._resolve(p, force=True)
            return dict(p.anchors)

    # --- sampler thread ------------------------------------------------------------------------
    def _run(self) -> None:
        due = time.perf_counter()
        try:
            while not self._stop.is_set():
                for track in self._tracks.values():
                    self._sample(track)
                with self._cond:
                    for p in list(self._pins):
                        self._resolve(p, force=False)
                    self._cond.notify_all()
                due += self.sample_interval
                now = time.perf_counter()
                if due < now:  # fell behind (slow NVML, GIL): do not burst to catch up
                    due = now
                self._stop.wait(due - now)
        except BaseException as exc:
            self.error = exc
            logger.exception("energy sampler thread stopped")
        finally:
            with self._cond:
                self._cond.notify_all()

    def _sample(self, track: _Track) -> None:
        i = track.index
        before = time.perf_counter()
        value: int | None = None
        reading = 0
        if track.mode is None:
            value = self.nvml.total_energy_mj(i)
            mode = COUNTER if value is not None else POWER
            if mode == POWER:
                reading = self.nvml.power_mw(i)
        elif track.mode == COUNTER:
            value = self.nvml.total_energy_mj(i)
            if value is None:
                raise GPUError(f"GPU {i}: the energy counter stopped being supported")
            mode = COUNTER
        else:
            reading = self.nvml.power_mw(i)
            mode = POWER
        after = time.perf_counter()
        with self._cond:
            track.mode = mode
            if value is not None:
                self._add_counter(track, before, after, value)
            else:
                self._add_power(track, before, after, reading)

    @staticmethod
    def _add_counter(track: _Track, before: float, after: float, value: int) -> None:
        if track.last_value is None or track.base_mj is None or value < track.last_value:
            # First read, or the counter went back (driver reload): the time of this value's
            # update is unknown, so it is only a baseline for the next change.
            if track.knots:
                track.offset_j = track.knots[-1].energy
            track.base_mj, track.last_value, track.last_before = value, value, before
            return
        if value == track.last_value:
            track.last_before = before  # the update is still to come, after this read began
            return
        energy = track.offset_j + (value - track.base_mj) / 1000.0
        t = (track.last_before + after) / 2
        eps = (after - track.last_before) / 2
        prev = track.knots[-1] if track.knots else None
        power = (energy - prev.energy) / (t - prev.t) if prev and t > prev.t else None
        track.add(t, energy, eps, 0.0, power)
        track.last_value, track.last_before = value, before

    @staticmethod
    def _add_power(track: _Track, before: float, after: float, reading_mw: int) -> None:
        p = reading_mw / 1000.0
        t = (before + after) / 2
        if track.last_power is not None:
            dt = t - track.last_t
            track.energy += (p + track.last_power) / 2 * dt
            track.err += abs(p - track.last_power) * dt / 2
        track.last_power, track.last_t = p, t
        track.add(t, track.energy, (after - before) / 2, track.err, p)

    # --- interpolation (caller holds the lock) -------------------------------------------------
    def _resolve(self, p: Pin, force: bool) -> None:
        for i, track in self._tracks.items():
            if i not in p.anchors:
                anchor = self._anchor(track, p.t, force)
                if anchor is not None:
                    p.anchors[i] = anchor

    def _anchor(self, track: _Track, t: float, force: bool) -> Anchor | None:
        knots = track.knots
        if not knots:
            if not force:
                return None
            if track.mode == COUNTER:  # read, but a knot comes only when the counter moves
                raise GPUError(
                    f"GPU {track.index}: its energy counter has not changed since sampling "
                    "started (a GPU that runs nothing, such as an idle simulated one?)"
                )
            raise GPUError(f"GPU {track.index}: no energy samples yet (is NVML responding?)")
        last = knots[-1]
        if t >= last.t:
            if not force:
                return None
            # No knot after t: continue the last slope; the energy since the last knot is
            # unknown within [0, P_max x dt], which the widened eps covers.
            slope = (last.power or 0.0) if self.interpolate else 0.0
            dt = t - last.t
            energy = last.energy + slope * dt
            return Anchor(t, energy, last.err, last.eps + dt, 0.0, 0.0, -1, track.p_max)
        first = knots[0]
        if t < first.t:  # older than the history (or before the first knot)
            slope = next((k.power for k in knots if k.power is not None), 0.0)
            dt = first.t - t
            energy = first.energy - slope * dt if self.interpolate else first.energy
            return Anchor(t, energy, first.err, first.eps + dt, 0.0, 0.0, -1, track.p_max)
        times = [k.t for k in knots]
        j = bisect.bisect_right(times, t) - 1
        a, b = knots[j], knots[j + 1]
        if not self.interpolate:
            return Anchor(t, a.energy, a.err, a.eps + (t - a.t), 0.0, 0.0, -1, track.p_max)
        h = b.t - a.t
        frac = (t - a.t) / h if h > 0 else 0.0
        powers = [
            k.power
            for k in (knots[x] for x in range(max(0, j - 1), min(len(knots), j + 3)))
            if k.power is not None
        ]
        band = max(powers) - min(powers) if powers else track.p_max
        return Anchor(
            t=t,
            energy=a.energy + frac * (b.energy - a.energy),
            err=a.err + frac * (b.err - a.err),
            eps=max(a.eps, b.eps),
            band=band,
            h=h,
            seq=a.seq,
            p_max=track.p_max,
        )


def window_energy(a0: Anchor, a1: Anchor) -> tuple[float, float]:
    """Energy between two anchors of one GPU and its error bound (see module docs), Joules."""
    w = max(0.0, a1.t - a0.t)
    estimate = max(0.0, a1.energy - a0.energy)
    p_max = max(a0.p_max, a1.p_max)
    integration = max(0.0, a1.err - a0.err)
    band = max(a0.band, a1.band)
    if a0.seq >= 0 and a0.seq == a1.seq and a0.h > 0:  # both ends between the same two knots
        timing = 2 * p_max * max(a0.eps, a1.eps) * w / a0.h
        shape = band * w
    else:
        timing = p_max * (a0.eps + a1.eps)
        shape = min(band * w, (a0.band * a0.h + a1.band * a1.h) / 4)
    bound = min(timing + shape + integration, max(estimate, p_max * w))
    return estimate, bound
