"""Pick one GPU power limit for a whole training job by profiling limits during training.

:class:`GlobalPowerLimitOptimizer` is a training callback. Starting at the GPUs' maximum power
limit and going down in ``pl_step`` watt steps to the minimum, it runs ``warmup_steps``
training steps at each limit and then measures ``profile_steps`` steps in one monitor window.
Once every limit is measured, an :class:`OptimumSelector` picks the limit that training keeps
(the selectors and the measurement models live in :mod:`worker_client.power_limit.selectors`).

States (``optimizer.state``), driven by :meth:`~GlobalPowerLimitOptimizer.on_step_begin` and
:meth:`~GlobalPowerLimitOptimizer.on_epoch_end`::

    Ready(next limit) --step begin--> Warmup: the limit is set; that step is warm-up step 1
    Warmup --step begin after warmup_steps steps--> Profiling: the window begins
    Profiling --step begin after profile_steps steps--> window ends, measurement recorded;
        Warmup of the next lower limit, or Done once the minimum limit is measured
    Warmup/Profiling --epoch end--> Ready(same limit): the partial window is discarded, the
        limit is profiled again from its first warm-up step (epoch boundaries run evaluation,
        checkpointing and data loader restarts, which would distort the measurement)
    Done(optimal limit): nothing more happens

The first ``wait_steps`` step begins are ignored (e.g. a first step that compiles kernels).
A known profile (``profile_path`` that exists, or a Redis ``profile_store`` entry for
``workload``) skips profiling: the selector picks from the stored measurements and the state
starts as Done. The maximum limit is restored by :meth:`~GlobalPowerLimitOptimizer.close` and
at interpreter exit.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from pydantic import BaseModel, ValidationError

from protocol.exceptions import ConfigError, CoordinatorUnavailableError, GPUError
from worker_client.gpu.nvml import NVML
from worker_client.power_limit.selectors import (
    Energy,
    MaxSlowdownConstraint,
    OptimumSelector,
    PowerLimitMeasurement,
    PowerLimitProfile,
    Time,
    ZeusCost,
)

if TYPE_CHECKING:
    from worker_client.power_limit.store import PowerLimitProfileStore

logger = logging.getLogger(__name__)

__all__ = [  # The selectors and measurement models live in power_limit_selectors.
    "Done",
    "Energy",
    "GlobalPowerLimitOptimizer",
    "MaxSlowdownConstraint",
    "OptimumSelector",
    "PowerLimitMeasurement",
    "PowerLimitProfile",
    "Profiling",
    "Ready",
    "Reducer",
    "State",
    "Time",
    "Warmup",
    "WindowMonitor",
    "ZeusCost",
    "power_limit_ladder",
    "save_profile_file",
    "torch_distributed_reducer",
]

Reducer = Callable[[float, float], tuple[float, float]]
"""(local time s, local energy J) -> (job time, job energy) across ranks."""


# --- states -----------------------------------------------------------------------------------
class Ready(BaseModel):
    """Waiting for the next step to start warming up ``next_power_limit``."""

    next_power_limit: int


class Warmup(BaseModel):
    """Running warm-up steps at ``current_power_limit``; ``steps`` begun so far."""

    current_power_limit: int
    steps: int = 1


class Profiling(BaseModel):
    """Measuring ``current_power_limit`` in a monitor window; ``steps`` begun so far."""

    current_power_limit: int
    steps: int = 1


class Done(BaseModel):
    """Profiling finished (or skipped); training runs at ``optimal_power_limit``."""

    optimal_power_limit: int


State = Ready | Warmup | Profiling | Done


# --- monitor interface --------------------------------------------------------------------------
class _WindowResult(Protocol):
    @property
    def time(self) -> float: ...

    @property
    def total_energy(self) -> float: ...


class WindowMonitor(Protocol):
    """What the optimizer needs of a window monitor, e.g. the GPU layer's ``EnergyMonitor``."""

    gpu_indices: list[int]

    def begin_window(self, name: str) -> None:
        """Start a named window."""

    def end_window(self, name: str) -> _WindowResult:
        """End a named window; return its time and energy."""

    def cancel_window(self, name: str) -> None:
        """Discard a named window."""


def torch_distributed_reducer(time_s: float, energy_j: float) -> tuple[float, float]:
    """Max of time and sum of energy over ranks if torch.distributed is initialized."""
    torch = sys.modules.get("torch")  # a job that has not imported torch is not distributed
    if torch is None:
        return time_s, energy_j
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return time_s, energy_j
    device = "cpu"
    if dist.get_backend() == "nccl":  # NCCL reduces CUDA tensors only
        device = f"cuda:{torch.cuda.current_device()}"
    t = torch.tensor([time_s], dtype=torch.float64, device=device)
    e = torch.tensor([energy_j], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.all_reduce(e, op=dist.ReduceOp.SUM)
    return float(t.item()), float(e.item())


def power_limit_ladder(max_w: int, min_w: int, pl_step: int) -> list[int]:
    """Power limits from ``max_w`` down by ``pl_step``; the last one is exactly ``min_w``."""
    limits = list(range(max_w, min_w, -pl_step))
    limits.append(min_w)  # clamp: never below the minimum, always including it
    return limits


def _is_permission_error(exc: GPUError) -> bool:
    text = str(exc).lower()
    return "no permission" in text or "insufficient permission" in text


class GlobalPowerLimitOptimizer:
    """Profile power limits during training and keep the best one (see the module docstring).

    Args:
        monitor: Measurement windows over the GPUs whose power limit is optimized
            (``monitor.gpu_indices``), e.g. an :class:`~worker_client.gpu.energy.EnergyMonitor`.
        optimum_selector: How to choose the limit (default :class:`Time`).
        wait_steps: Step begins to ignore before profiling starts (>= 0).
        warmup_steps: Steps run at each limit before its window begins (>= 1).
        profile_steps: Steps measured at each limit (>= 1).
        pl_step: Watts between two profiled limits (>= 1).
        profile_path: An existing JSON profile to use instead of profiling, or where to save
            the profile once profiling finishes.
        nvml: NVML facade for the power limits (default: ``monitor.nvml`` or the real one).
        profile_store: Redis store of profiles shared across runs (needs ``workload``).
        workload: Name of the workload in ``profile_store``.
        reducer: Combines this rank's (time, energy) with the other ranks'; default
            :func:`torch_distributed_reducer`.
        restore_on_exit: Register :meth:`close` to run at interpreter exit.

    Raises:
        ConfigError: A bad argument, or an unreadable profile file.
        GPUError: NVML failed (with a hint when the process lacks the privilege to set
            power limits).

    """

    def __init__(
        self,
        monitor: WindowMonitor,
        optimum_selector: OptimumSelector | None = None,
        wait_steps: int = 1,
        warmup_steps: int = 10,
        profile_steps: int = 40,
        pl_step: int = 25,
        profile_path: str | Path | None = None,
        *,
        nvml: NVML | None = None,
        profile_store: PowerLimitProfileStore | None = None,
        workload: str | None = None,
        reducer: Reducer | None = None,
        restore_on_exit: bool = True,
    ) -> None:
        for name, value, low in (
            ("wait_steps", wait_steps, 0),
            ("warmup_steps", warmup_steps, 1),
            ("profile_steps", profile_steps, 1),
            ("pl_step", pl_step, 1),
        ):
            if not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        if (profile_store is None) != (workload is None):
            raise ConfigError("profile_store and workload must be given together")
        self.monitor = monitor
        self.gpu_indices = list(monitor.gpu_indices)
        if not self.gpu_indices:
            raise ConfigError("the monitor has no GPUs")
        self.nvml: NVML = nvml or getattr(monitor, "nvml", None) or NVML()
        self.optimum_selector = optimum_selector if optimum_selector is not None else Time()
        self.warmup_steps = warmup_steps
        self.profile_steps = profile_steps
        self.pl_step = pl_step
        self.profile_path = Path(profile_path) if profile_path is not None else None
        self.profile_store = profile_store
        self.workload = workload
        self.reducer: Reducer = reducer or torch_distributed_reducer
        self._wait_left = wait_steps
        self._restore_on_exit = restore_on_exit
        self._touched = False  # whether we ever set a limit (then close() restores the max)
        self._closed = False
        self.current_power_limit: int | None = None

        self.min_power_limit, self.max_power_limit = self._limit_range()
        self.power_limits = power_limit_ladder(self.max_power_limit, self.min_power_limit, pl_step)
        self.measurements: list[PowerLimitMeasurement] = []
        self.state: State = Ready(next_power_limit=self.power_limits[0])
        if restore_on_exit:
            atexit.register(self.close)

        profile = self._load_profile()
        if profile is not None:
            self.measurements = list(profile.measurements)
            optimal = self._compute_optimal_power_limit()
            logger.info("using a stored power-limit profile: %d W", optimal)
            self.state = Done(optimal_power_limit=optimal)
            self._set_power_limit(optimal)

    # --- training hooks ---------------------------------------------------------------------
    def on_step_begin(self) -> None:
        """Mark the beginning of a training step."""
        if self._wait_left > 0:
            self._wait_left -= 1
            return
        state = self.state
        if isinstance(state, Ready):
            self._set_power_limit(state.next_power_limit)
            self.state = Warmup(current_power_limit=state.next_power_limit)
        elif isinstance(state, Warmup):
            if state.steps < self.warmup_steps:
                state.steps += 1
                return
            self.monitor.begin_window(self._window(state.current_power_limit))
            self.state = Profiling(current_power_limit=state.current_power_limit)
        elif isinstance(state, Profiling):
            if state.steps < self.profile_steps:
                state.steps += 1
                return
            self._finish_limit(state.current_power_limit)

    def on_step_end(self) -> None:
        """Mark the end of a training step (nothing to do)."""

    def on_epoch_begin(self) -> None:
        """Mark the beginning of an epoch (nothing to do)."""

    def on_epoch_end(self) -> None:
        """Mark the end of an epoch: restart a limit that was warming up or being profiled."""
        state = self.state
        if isinstance(state, Profiling):
            self.monitor.cancel_window(self._window(state.current_power_limit))
        if isinstance(state, Warmup | Profiling):
            logger.info(
                "epoch ended while profiling %d W; restarting it", state.current_power_limit
            )
            self.state = Ready(next_power_limit=state.current_power_limit)

    def close(self) -> None:
        """Restore the maximum power limit on every GPU (idempotent; also runs at exit).

        Training may go on afterwards; the next limit set re-arms the restore.
        """
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if isinstance(self.state, Profiling):
            try:
                self.monitor.cancel_window(self._window(self.state.current_power_limit))
            except ValueError:
                pass
        if self._touched:
            try:
                self._set_power_limit(self.max_power_limit, restoring=True)
            except GPUError as exc:
                logger.warning("could not restore the maximum power limit: %s", exc)

    # --- internals ----------------------------------------------------------------------------
    @staticmethod
    def _window(power_limit: int) -> str:
        return f"__perseus_power_limit_{power_limit}"

    def _finish_limit(self, power_limit: int) -> None:
        result = self.monitor.end_window(self._window(power_limit))
        time_s, energy_j = self.reducer(float(result.time), float(result.total_energy))
        self.measurements.append(
            PowerLimitMeasurement(power_limit=power_limit, energy=energy_j, time=time_s)
        )
        logger.info("power limit %d W: %.3f s, %.1f J", power_limit, time_s, energy_j)
        position = self.power_limits.index(power_limit)
        if position + 1 < len(self.power_limits):
            following = self.power_limits[position + 1]
            self.state = Warmup(current_power_limit=following)
            self._set_power_limit(following)
            return
        optimal = self._compute_optimal_power_limit()
        logger.info("profiling done; optimal power limit %d W", optimal)
        self.state = Done(optimal_power_limit=optimal)
        self._set_power_limit(optimal)
        self._save_profile(optimal)

    def _limit_range(self) -> tuple[int, int]:
        lows, highs = [], []
        for i in self.gpu_indices:
            low_mw, high_mw = self.nvml.power_limit_constraints_mw(i)
            lows.append(math.ceil(low_mw / 1000))
            highs.append(high_mw // 1000)
        low, high = max(lows), min(highs)  # limits every GPU accepts
        if low > high:
            raise GPUError(f"the GPUs {self.gpu_indices} share no settable power limit")
        return low, high

    def _set_power_limit(self, watts: int, restoring: bool = False) -> None:
        if self._closed and not restoring:  # used again after close(): re-arm the restore
            self._closed = False
            if self._restore_on_exit:
                atexit.register(self.close)
        for i in self.gpu_indices:
            # Reading needs no privilege: write (root or CAP_SYS_ADMIN) only what changes, so
            # a job whose optimum is the current limit never needs the privilege at all.
            if self.nvml.power_limit_mw(i) == watts * 1000:
                continue
            try:
                self.nvml.set_power_limit_mw(i, watts * 1000)
            except GPUError as exc:
                if not _is_permission_error(exc):
                    raise
                raise GPUError(
                    f"not allowed to set GPU {i}'s power limit to {watts} W: "
                    "nvmlDeviceSetPowerManagementLimit needs root or the CAP_SYS_ADMIN "
                    "capability (run training as root, or grant CAP_SYS_ADMIN, e.g. "
                    f"`docker run --cap-add SYS_ADMIN`); NVML said: {exc}"
                ) from None
            self._touched = True
        self.current_power_limit = watts

    def _compute_optimal_power_limit(self) -> int:
        chosen = self.optimum_selector.select(self.measurements)
        clamped = min(max(chosen, self.min_power_limit), self.max_power_limit)
        if clamped != chosen:
            logger.warning("profile's limit %d W is outside this GPU's range", chosen)
        return clamped

    def _load_profile(self) -> PowerLimitProfile | None:
        if self.profile_path is not None and self.profile_path.exists():
            try:
                return PowerLimitProfile.model_validate_json(self.profile_path.read_bytes())
            except (OSError, ValidationError) as exc:
                raise ConfigError(f"bad power-limit profile {self.profile_path}: {exc}") from None
        if self.profile_store is not None and self.workload is not None:
            try:
                return self.profile_store.load(self.workload)
            except CoordinatorUnavailableError as exc:  # Redis only saves time: go on without
                logger.warning("cannot load the stored power-limit profile: %s", exc)
        return None

    def _save_profile(self, optimal: int) -> None:
        profile = PowerLimitProfile(
            measurements=self.measurements,
            optimal_power_limit=optimal,
            selector=repr(self.optimum_selector),
            updated_at=time.time(),
        )
        if self.profile_path is not None:
            save_profile_file(profile, self.profile_path)
        if self.profile_store is not None and self.workload is not None:
            try:
                self.profile_store.save(self.workload, profile)
            except CoordinatorUnavailableError as exc:
                logger.warning("cannot store the power-limit profile: %s", exc)


def save_profile_file(profile: PowerLimitProfile, path: str | Path) -> None:
    """Write ``profile`` as JSON, atomically (ranks sharing a path never see half a file)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(profile.model_dump_json(indent=2))
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
