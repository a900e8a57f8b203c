"""The measurements that ``benchmarks/h100_measure.py`` runs and prints.

NVML counter probes (read cost, update period), a power poller, the MLP workload with its
batch calibration, and energy windows over it. Read-only: nothing here writes to NVML.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker_client.gpu.energy import EnergyMonitor
    from worker_client.gpu.nvml_readonly import ReadOnlyNVML


class PowerPoller:
    """Reads nvmlDeviceGetPowerUsage every ``interval`` s between start() and stop()."""

    def __init__(self, nvml: ReadOnlyNVML, index: int, interval: float) -> None:
        self.nvml, self.index, self.interval = nvml, index, interval
        self.readings: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.readings, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self.readings.append(self.nvml.power_mw(self.index) / 1000.0)
            if self._stop.wait(self.interval):
                return

    def stop(self) -> float:
        """Stop; return the mean reading, W."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        return statistics.fmean(self.readings) if self.readings else float("nan")


def stats(values: list[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


# --- NVML facts ----------------------------------------------------------------------------
def counter_read_cost(nvml: ReadOnlyNVML, index: int, calls: int) -> dict[str, float]:
    costs = []
    for _ in range(calls):
        t0 = time.perf_counter()
        nvml.total_energy_mj(index)
        costs.append((time.perf_counter() - t0) * 1000)
    return {
        "median_ms": statistics.median(costs),
        **{f"{k}_ms": v for k, v in stats(costs).items() if k != "n"},
        "calls": calls,
    }


def counter_update_period(nvml: ReadOnlyNVML, index: int, seconds: float) -> dict[str, float]:
    """Poll the counter back to back; the time between value changes is its update period."""
    changes: list[float] = []
    reads = 0
    last = nvml.total_energy_mj(index)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        before = time.perf_counter()
        value = nvml.total_energy_mj(index)
        reads += 1
        if value != last:
            changes.append((before + time.perf_counter()) / 2)
            last = value
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(changes)]
    out: dict[str, float] = {"seconds": seconds, "reads": reads, "changes": len(changes)}
    if gaps:
        out.update(
            period_median_ms=statistics.median(gaps),
            period_min_ms=min(gaps),
            period_max_ms=max(gaps),
            updates_per_s=len(changes) / seconds,
        )
    return out


# --- workload ---------------------------------------------------------------------------------
def build_model(args: argparse.Namespace, device: str, dtype: Any) -> Any:
    """``--layers`` blocks of LayerNorm, Linear(w, 4w), GELU, Linear(4w, w) with a residual."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.up = nn.Linear(width, 4 * width)
            self.act = nn.GELU()
            self.down = nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(self.act(self.up(self.norm(x))))

    torch.manual_seed(0)
    return nn.Sequential(*[Block(args.width) for _ in range(args.layers)]).to(device, dtype)


def timed(fn: Callable[[], Any], sync: Callable[[], None], reps: int) -> list[float]:
    """Seconds of each of ``reps`` calls, synchronized before and after each."""
    out = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def calibrate_batch(
    model: Any, args: argparse.Namespace, device: str, dtype: Any, sync: Callable[[], None]
) -> int:
    """Grow the batch until one forward takes about ``--target-ms`` (capped by --max-batch)."""
    import torch

    if args.batch:
        return int(args.batch)
    target, batch = args.target_ms / 1000, 64
    while True:
        x = torch.randn(batch, args.width, device=device, dtype=dtype)
        fwd = statistics.median(timed(functools.partial(model, x), sync, 3))
        if fwd >= target / 2 or batch >= args.max_batch:
            break
        batch = min(args.max_batch, batch * 2)
    return max(8, min(args.max_batch, int(batch * target / max(fwd, 1e-9)) // 8 * 8))


def long_window(
    monitor: EnergyMonitor,
    poller: PowerPoller,
    index: int,
    fn: Callable[[], Any],
    reps: int,
    name: str,
) -> dict[str, float]:
    """One window over ``reps`` back-to-back calls (synchronized only at the window's ends)."""
    poller.start()
    monitor.begin_window(name)
    for _ in range(reps):
        fn()
    m = monitor.end_window(name)
    mean_power = poller.stop()
    energy, bound = m.gpu_energy[index], m.gpu_energy_error_bound[index]
    return {
        "reps": reps,
        "window_s": m.time,
        "energy_j": energy,
        "bound_j": bound,
        "time_per_call_s": m.time / reps,
        "energy_per_call_j": energy / reps,
        "bound_per_call_j": bound / reps,
        "mean_power_w": mean_power,
        "power_x_time_j": mean_power * m.time,
        "power_samples": len(poller.readings),
    }


def single_windows(
    monitor: EnergyMonitor, index: int, fn: Callable[[], Any], count: int
) -> list[tuple[float, float, float]]:
    """``count`` windows of one call each: (seconds, energy J, bound J)."""
    pending = []
    for i in range(count):
        monitor.begin_window(f"one-{i}")
        fn()
        pending.append(monitor.end_window_deferred(f"one-{i}"))
    out = []
    for p in pending:
        m = p.result()
        out.append((m.time, m.gpu_energy[index], m.gpu_energy_error_bound[index]))
    return out


def compare_singles(
    singles: list[tuple[float, float, float]], long_power_w: float
) -> dict[str, float]:
    """Single windows against the long window's mean power x each window's own length."""
    refs = [t * long_power_w for t, _, _ in singles]
    errors = [abs(e - r) / r for (_, e, _), r in zip(singles, refs, strict=True) if r > 0]
    energies = [e for _, e, _ in singles]
    return {
        "windows": len(singles),
        "mean_time_s": statistics.fmean(t for t, _, _ in singles),
        "mean_j": statistics.fmean(energies),
        "rel_std": statistics.stdev(energies) / statistics.fmean(energies)
        if len(energies) > 1 and statistics.fmean(energies) > 0
        else 0.0,
        "mean_rel_error": statistics.fmean(errors) if errors else float("nan"),
        "max_rel_error": max(errors) if errors else float("nan"),
        "mean_rel_bound": statistics.fmean(
            b / r for (_, _, b), r in zip(singles, refs, strict=True) if r > 0
        )
        if errors
        else float("nan"),
        "zero_readings": sum(1 for e in energies if e == 0.0),
    }
