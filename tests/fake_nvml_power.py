"""In-process fake of the pynvml functions used by energy monitoring and power limits.

Each fake GPU has a piecewise-constant power profile over ``time.perf_counter()``; its
energy counter reports the exact integral as of its last update (updates every
``update_period`` seconds, like the H100's ~10 Hz counter), so tests know the true energy of
any interval. Every call is recorded with the calling thread's id; power-limit writes are
recorded separately. State is module-level: call :func:`reset` at the start of each test.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

# One error type and one set of codes for both fakes (the NVML facade catches NVMLError by
# looking it up on whichever module it was given).
from tests.fake_nvml import (
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_SUPPORTED,
    NVMLError,
)
from worker_client.gpu.nvml import NVML
from worker_client.power_limit.states import Done, Paused, Profiling, Ready, Warmup

NVML_SUCCESS = 0


@dataclass
class FakeGPU:
    starts: list[float]  # perf_counter time where each power segment begins
    watts: list[float]
    counter_supported: bool = True
    update_period: float = 0.1
    min_limit_mw: int = 100_000
    max_limit_mw: int = 300_000
    limit_mw: int = 300_000

    def power_at(self, t: float) -> float:
        return self.watts[max(0, bisect.bisect_right(self.starts, t) - 1)]

    def energy_between(self, t0: float, t1: float) -> float:
        """Exact energy (J) drawn in [t0, t1]."""
        if t1 <= t0:
            return 0.0
        total = 0.0
        bounds = [*self.starts[1:], math.inf]
        for start, end, w in zip(self.starts, bounds, self.watts, strict=True):
            lo, hi = max(start, t0), min(end, t1)
            if hi > lo:
                total += w * (hi - lo)
        return total

    def counter_mj(self, t: float) -> int:
        origin = self.starts[0]
        last_update = origin + math.floor((t - origin) / self.update_period) * self.update_period
        return 10**9 + int(self.energy_between(origin, last_update) * 1000)


@dataclass
class State:
    gpus: list[FakeGPU] = field(default_factory=list)
    calls: list[tuple[str, int, tuple[object, ...]]] = field(default_factory=list)
    set_calls: list[tuple[int, int]] = field(default_factory=list)
    permission_denied: bool = False
    call_latency: float = 0.0


STATE = State()
_lock = threading.Lock()


def reset(
    num_gpus: int = 1,
    watts: float | list[float] = 300.0,
    counter_supported: bool = True,
    update_period: float = 0.1,
    min_limit_mw: int = 100_000,
    max_limit_mw: int = 300_000,
    call_latency: float = 0.0,
) -> State:
    """Fresh fake GPUs drawing constant power from now on."""
    now = time.perf_counter() - 1.0  # a second of history, so counters are non-trivial
    per_gpu = watts if isinstance(watts, list) else [watts] * num_gpus
    STATE.gpus = [
        FakeGPU(
            [now],
            [per_gpu[i]],
            counter_supported,
            update_period,
            min_limit_mw,
            max_limit_mw,
            max_limit_mw,
        )
        for i in range(num_gpus)
    ]
    STATE.calls = []
    STATE.set_calls = []
    STATE.permission_denied = False
    STATE.call_latency = call_latency
    return STATE


def set_power_profile(index: int, segments: list[tuple[float, float]]) -> None:
    """Append ``(start time, watts)`` segments (absolute perf_counter times) to a GPU.

    Call it before the sampler starts reading (readers do not lock).
    """
    gpu = STATE.gpus[index]
    with _lock:
        for start, w in segments:
            gpu.starts.append(start)
            gpu.watts.append(w)


def _record(name: str, *args: object) -> None:
    with _lock:
        STATE.calls.append((name, threading.get_ident(), args))


def _gpu(handle: object) -> FakeGPU:
    assert isinstance(handle, int)
    return STATE.gpus[handle]


def nvmlInit() -> None:
    _record("nvmlInit")


def nvmlShutdown() -> None:
    _record("nvmlShutdown")


def nvmlDeviceGetCount() -> int:
    _record("nvmlDeviceGetCount")
    return len(STATE.gpus)


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    _record("nvmlDeviceGetHandleByIndex", index)
    return index


def nvmlDeviceGetTotalEnergyConsumption(handle: int) -> int:
    t = time.perf_counter()  # the value is latched at the start of the call
    _record("nvmlDeviceGetTotalEnergyConsumption", handle)
    gpu = _gpu(handle)
    if not gpu.counter_supported:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    value = gpu.counter_mj(t)
    if STATE.call_latency:
        time.sleep(STATE.call_latency)
    return value


def nvmlDeviceGetPowerUsage(handle: int) -> int:
    t = time.perf_counter()
    _record("nvmlDeviceGetPowerUsage", handle)
    value = int(_gpu(handle).power_at(t) * 1000)
    if STATE.call_latency:
        time.sleep(STATE.call_latency)
    return value


def nvmlDeviceGetPowerManagementLimitConstraints(handle: int) -> tuple[int, int]:
    _record("nvmlDeviceGetPowerManagementLimitConstraints", handle)
    gpu = _gpu(handle)
    return gpu.min_limit_mw, gpu.max_limit_mw


def nvmlDeviceGetPowerManagementLimit(handle: int) -> int:
    _record("nvmlDeviceGetPowerManagementLimit", handle)
    return _gpu(handle).limit_mw


def nvmlDeviceSetPowerManagementLimit(handle: int, limit_mw: int) -> None:
    _record("nvmlDeviceSetPowerManagementLimit", handle, limit_mw)
    if STATE.permission_denied:
        raise NVMLError(NVML_ERROR_NO_PERMISSION)
    gpu = _gpu(handle)
    if not gpu.min_limit_mw <= limit_mw <= gpu.max_limit_mw:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    gpu.limit_mw = limit_mw
    with _lock:
        STATE.set_calls.append((handle, limit_mw))


# --- power-limit optimizer fakes ----------------------------------------------------------------
# Zeus's own window result shape: time and energy per GPU (total_energy sums them).
@dataclass(frozen=True)
class WindowResult:
    time: float
    gpu_energy: dict[int, float]

    @property
    def total_energy(self) -> float:
        return sum(self.gpu_energy.values())


class ReplayTraining:
    """Training steps on the fake GPUs, on a virtual clock, replaying a table per power limit.

    ``table`` maps a power limit (W) to ``(step time s, power per GPU W)``. :meth:`step` runs
    one step at the limit the fake GPUs are at *now* (all monitored GPUs must agree; a limit
    missing from the table is a KeyError, so a test notices a limit nobody should have set).
    :meth:`idle` accounts work outside training steps (evaluation at an epoch end) at
    ``idle_power_w``. Each GPU's energy counter and the clock only grow.
    """

    def __init__(
        self,
        table: dict[int, tuple[float, float]],
        gpu_indices: list[int],
        idle_power_w: float = 50.0,
    ) -> None:
        self.table = table
        self.gpu_indices = list(gpu_indices)
        self.idle_power_w = idle_power_w
        self.now = 0.0
        self.energy = {i: 0.0 for i in self.gpu_indices}
        self.step_limits: list[int] = []  # the limit (W) each step ran at

    def limit_w(self) -> int:
        limits = {STATE.gpus[i].limit_mw for i in self.gpu_indices}
        assert len(limits) == 1, f"GPUs at different limits: {limits}"
        (limit_mw,) = limits
        assert limit_mw % 1000 == 0, f"replay tables are in whole watts, got {limit_mw} mW"
        return limit_mw // 1000

    def step(self) -> None:
        limit = self.limit_w()
        seconds, watts = self.table[limit]
        self.step_limits.append(limit)
        self.now += seconds
        for i in self.gpu_indices:
            self.energy[i] += watts * seconds

    def idle(self, seconds: float) -> None:
        self.now += seconds
        for i in self.gpu_indices:
            self.energy[i] += self.idle_power_w * seconds


class ReplayMonitor:
    """Window monitor over a :class:`ReplayTraining`'s virtual clock and energy counters.

    Behaves like the GPU layer's ``EnergyMonitor``: a window name can be open once, ending or
    cancelling a window that is not open is a ValueError.
    """

    def __init__(self, training: ReplayTraining) -> None:
        self.training = training
        self.gpu_indices = list(training.gpu_indices)
        self.nvml = NVML(__name__)
        self.open: dict[str, tuple[float, dict[int, float]]] = {}
        self.events: list[tuple[str, str]] = []

    def begin_window(self, name: str) -> None:
        if name in self.open:
            raise ValueError(f"measurement window {name!r} is already open")
        self.open[name] = (self.training.now, dict(self.training.energy))
        self.events.append(("begin", name))

    def end_window(self, name: str) -> WindowResult:
        if name not in self.open:
            raise ValueError(f"no open measurement window {name!r}")
        t0, e0 = self.open.pop(name)
        self.events.append(("end", name))
        energy = {i: self.training.energy[i] - e0[i] for i in self.gpu_indices}
        return WindowResult(time=self.training.now - t0, gpu_energy=energy)

    def cancel_window(self, name: str) -> None:
        if name not in self.open:
            raise ValueError(f"no open measurement window {name!r}")
        del self.open[name]
        self.events.append(("cancel", name))


def limits_set(gpu: int = 0) -> list[int]:
    """Power limits written to ``gpu`` (W), in order."""
    return [mw // 1000 for index, mw in STATE.set_calls if index == gpu]


def limits_now() -> list[int]:
    """Every fake GPU's current power limit (W)."""
    return [gpu.limit_mw // 1000 for gpu in STATE.gpus]


def run_steps(
    optimizer: Any,
    training: ReplayTraining,
    steps: int,
    epoch_steps: int | None = None,
    eval_seconds: float = 5.0,
) -> None:
    """Train ``steps`` steps; after every ``epoch_steps`` steps, end an epoch and evaluate."""
    for n in range(1, steps + 1):
        optimizer.on_step_begin()
        training.step()
        optimizer.on_step_end()
        if epoch_steps is not None and n % epoch_steps == 0:
            optimizer.on_epoch_end()
            training.idle(eval_seconds)


def describe_state(state: object) -> str:
    """A power-limit optimizer state with its limits in watts, e.g. ``Warmup(250,2)``."""
    if isinstance(state, Ready):
        return f"Ready({state.next_power_limit // 1000},{state.steps})"
    if isinstance(state, Warmup | Profiling):
        return f"{type(state).__name__}({state.current_power_limit // 1000},{state.steps})"
    if isinstance(state, Paused):
        return (
            f"Paused({state.current_power_limit // 1000},{state.warmup_steps},"
            f"{state.profile_steps})"
        )
    assert isinstance(state, Done)
    return f"Done({state.optimal_power_limit // 1000})"
