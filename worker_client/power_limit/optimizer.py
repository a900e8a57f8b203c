"""Pick one GPU power limit for a whole training job by profiling limits during training.

:class:`GlobalPowerLimitOptimizer` is a training callback with Zeus's semantics. The GPUs
start at their maximum limit. Going down ``range(max, min - 1, -pl_step)`` (milliwatts, so the
minimum is profiled only if the ladder lands on it), it runs ``warmup_steps`` training steps at
each limit and then measures ``profile_steps`` steps in one monitor window. Once every limit is
measured, an :class:`OptimumSelector` (default ``ZeusCost(0.5, world_size=number of GPUs
measured)``: the monitored GPUs of every rank, whose energy the measurements sum) picks the
limit that training keeps.

States (``optimizer.state``; limits in milliwatts as in Zeus), driven by the
:meth:`~GlobalPowerLimitOptimizer.on_step_begin` and
:meth:`~GlobalPowerLimitOptimizer.on_epoch_end` hooks::

    Ready(next limit, steps) --steps'th step begin--> Warmup: the limit is set; that step is
        warm-up step 1 (steps = wait_steps + 1 at the start, 1 after an epoch end)
    Warmup(limit, warmup_steps) --steps'th step begin after--> Profiling: the window begins
    Profiling(limit, profile_steps) --steps'th step begin after--> window ends, measurement
        recorded; Warmup of the next lower limit, or Done once the last limit is measured
    Warmup/Profiling --epoch end--> the GPUs go back to the maximum limit (evaluation and
        checkpointing run at full power) and
        - by default (Zeus): Ready(same limit, 1), the partial window is discarded and the
          limit is profiled again from its first warm-up step;
        - with ``carry_across_epochs=True``: Paused, the steps done and the measured part of
          the window are kept (windows are paused over the epoch end).
    Paused --step begin--> the limit is set again; that step is a warm-up step (the first
        step of an epoch includes the data loader's restart), then the window resumes where
        it stopped. Profiling finishes even when epochs are shorter than
        ``warmup_steps + profile_steps`` (at least 2 steps long).
    Done(optimal limit): set on every rank's GPUs (the ranks agree it is, in one more
        all-reduce: where one rank could not, every rank raises, and step begins set it again)

Each state's ``steps`` counts down as Zeus's does: the step begins left until the next
transition. The first ``wait_steps`` step begins are ignored (e.g. a first step that compiles
kernels).
A known profile (``profile_path`` that exists, Zeus's file format or perseus-mq's, or a Redis
``profile_store`` entry for ``workload``) skips profiling: the selector picks from the stored
measurements and the state starts as Done (a ``profile_path`` not there yet is written from the
Redis entry, as profiling would have written it). :meth:`~GlobalPowerLimitOptimizer.close` (also at
interpreter exit) restores the maximum limit; training may go on after it, the next step
resumes where the optimizer was (a limit being profiled starts over, or stays paused with
``carry_across_epochs``).
"""

from __future__ import annotations

import logging
import os
import time
from multiprocessing.util import Finalize
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.exceptions import GPUError
from protocol.models import PowerLimitMeasurement, PowerLimitProfile
from worker_client.callback import Callback
from worker_client.gpu.nvml import NVML
from worker_client.power_limit.arguments import check_arguments
from worker_client.power_limit.limits import (
    agree_on_optimum,
    common_range,
    format_watts,
    limit_to_set,
    monitored_gpus,
    power_limit_ladder,
    ranks_without_profile,
    refuse_to_start,
    set_power_limit,
)
from worker_client.power_limit.monitor import Reducer, WindowMonitor, torch_distributed_reducer
from worker_client.power_limit.profile import (
    describe_reuse,
    load_profile,
    load_profile_file,
    save_or_warn,
    save_profile_file,
)
from worker_client.power_limit.selectors import (
    Energy,
    MaxSlowdownConstraint,
    OptimumSelector,
    Time,
    ZeusCost,
    chosen_limit,
)
from worker_client.power_limit.states import (
    Done,
    Paused,
    Profiling,
    Ready,
    StallWatch,
    State,
    Warmup,
)
from worker_client.power_limit.window import LimitWindows

if TYPE_CHECKING:
    from worker_client.power_limit.store import PowerLimitProfileStore

logger = logging.getLogger(__name__)

# Re-exported: the selectors (selectors.py), monitor.py, limits.py, protocol.models.
__all__ = [
    "Done", "Energy", "GlobalPowerLimitOptimizer", "MaxSlowdownConstraint", "OptimumSelector",
    "Paused", "PowerLimitMeasurement", "PowerLimitProfile", "Profiling", "Ready", "Reducer",
    "State", "Time", "Warmup", "WindowMonitor", "ZeusCost", "load_profile_file",
    "power_limit_ladder", "refuse_to_start", "save_profile_file", "torch_distributed_reducer"
]  # fmt: skip


class GlobalPowerLimitOptimizer(Callback):
    """Profile power limits during training and keep the best one (see the module docstring).

    The first seven arguments are Zeus's, with Zeus's defaults and meaning.

    Args:
        monitor: Measurement windows over the GPUs whose power limit is optimized
            (``monitor.gpu_indices``), e.g. an :class:`~worker_client.gpu.energy.EnergyMonitor`.
        optimum_selector: How to choose the limit (default ``ZeusCost(0.5, world_size=the
            monitored GPUs of all ranks)``, counted with ``reducer`` when the limit is chosen;
            Zeus counts only this rank's ``len(monitor.gpu_indices)``).
        wait_steps: Step begins to ignore before profiling starts (>= 0).
        warmup_steps: Steps run at each limit before its window begins (>= 1).
        profile_steps: Steps measured at each limit (>= 1).
        pl_step: Watts between two profiled limits (>= 1).
        profile_path: An existing JSON profile (Zeus's or perseus-mq's) to use instead of
            profiling, or where to save the profile once profiling finishes.
        carry_across_epochs: Keep a limit's warm-up and measurement across an epoch end
            instead of profiling it again (for epochs shorter than ``warmup_steps +
            profile_steps``); Zeus has no such mode.
        nvml: NVML facade for the power limits (default: ``monitor.nvml`` or the real one).
        profile_store: Redis store of profiles shared across runs (needs ``workload``).
        workload: Name of the workload in ``profile_store``.
        reducer: Combines this rank's (time, energy) with the other ranks' (max of times,
            sum of energies); default :func:`torch_distributed_reducer`. Also called twice at
            construction (the ranks that found no profile, and whether all profile one ladder),
            once as the limit is chosen (the GPUs of all ranks, for the default selector) and
            once as it is set (the ranks that could not).
        restore_on_exit: Register :meth:`close` to run at interpreter exit.

    Raises:
        ConfigError: A bad argument, GPUs whose power limit ranges differ, or an unreadable
            profile file (ConfigError is a ValueError, which Zeus raises for these).
        GPUError: NVML failed (with a hint when the process lacks the privilege to set
            power limits).

    What stops one rank's constructor stops every rank's at once, the others with a
    ConfigError naming it (see :func:`~worker_client.power_limit.limits.ranks_without_profile`);
    a rank that fails before (its monitor) hands its error to :func:`refuse_to_start`. A
    loaded profile's optimum that one rank cannot set is every rank's PerseusError too (see
    :func:`~worker_client.power_limit.limits.agree_on_optimum`).

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
        carry_across_epochs: bool = False,
        nvml: NVML | None = None,
        profile_store: PowerLimitProfileStore | None = None,
        workload: str | None = None,
        reducer: Reducer | None = None,
        restore_on_exit: bool = True,
    ) -> None:
        self.reducer: Reducer = reducer or torch_distributed_reducer
        self._restore_on_exit = restore_on_exit
        self._pid = os.getpid()  # whose exit restores the maximum (see _close_at_exit)
        self._at_exit: Finalize | None = None  # also run in a forked multiprocessing child
        self._closed = False
        self._stall = StallWatch()
        self._windows = LimitWindows(monitor)  # the measured part of the limit being profiled
        self._resume_steps = 0  # measured steps a paused window resumes from
        self._profiled_at = 0.0  # unix time the profile was made (0: unknown)
        self.current_power_limit: int | None = None  # mW, the last one set
        self._optimum_unset = False  # Done, but some rank's GPUs may not be at the optimum

        # One rank's failure here (its arguments, its GPUs, its profile file or folder) is
        # every rank's: the others would otherwise wait for ever in the collectives below.
        failure: Exception | None = None
        profile: PowerLimitProfile | None = None
        self.power_limits: list[int] = []
        try:
            check_arguments(
                optimum_selector, wait_steps, warmup_steps, profile_steps, pl_step, profile_path,
                profile_store, workload,
            )  # fmt: skip
            self.monitor = monitor
            self.gpu_indices, self.nvml, self._nvml_of = monitored_gpus(monitor, nvml)
            # The default's world_size is set to every rank's GPUs when the limit is chosen.
            self._default_selector = optimum_selector is None
            self.optimum_selector = optimum_selector or ZeusCost(
                eta_knob=0.5, world_size=len(self.gpu_indices)
            )
            self.warmup_steps, self.profile_steps = warmup_steps, profile_steps
            self.pl_step = pl_step
            self.carry_across_epochs = carry_across_epochs
            self.profile_path = Path(profile_path) if profile_path is not None else None
            self.profile_store, self.workload = profile_store, workload
            low, high = common_range(self.nvml, self._nvml_of)
            self.min_power_limit_mw, self.max_power_limit_mw = low, high
            self.power_limits = power_limit_ladder(high, low, pl_step)
            profile = load_profile(self.profile_path, self.profile_store, self.workload)
            if profile is None:  # a GPU left low (by a crashed job, say) would run waits low
                self._set_power_limit(self.max_power_limit_mw)
        except Exception as exc:  # whatever it is, the other ranks must hear of it
            failure = exc
        # Every rank takes the same road (profiling's windows are collectives): a profile is
        # used only where every rank found one, and ranks that profile walk one ladder.
        missing = ranks_without_profile(
            self.power_limits, pl_step, profile is not None, self.reducer, failure
        )
        self.measurements: list[PowerLimitMeasurement] = []
        # The first wait_steps step begins are ignored; the next one sets the first limit.
        self.state: State = Ready(next_power_limit=self.power_limits[0], steps=wait_steps + 1)
        if profile is not None and missing > 0:
            logger.warning("another rank found no power-limit profile: every rank profiles")
            profile = None
        if profile is not None:
            self.measurements = list(profile.measurements)
            self._profiled_at = profile.updated_at
            optimal = self._compute_optimal_power_limit(at_start=True)
            logger.info("%s", describe_reuse(profile, optimal, self.optimum_selector))
            self.state = Done(optimal_power_limit=optimal)
            if self.profile_path is not None and not self.profile_path.exists():
                # Found in the Redis store: the file is still written, as profiling writes it.
                self._save_profile(stamp=False, store=False)
            try:
                self._apply_optimum(at_start=True)
            except Exception:  # on every rank; nothing would restore the maximum on this one
                self._restore_maximum()
                raise
        else:  # set above, unless this rank found a profile that another rank lacked
            self._set_profiled(self.max_power_limit_mw, self.power_limits[0])
        if restore_on_exit:
            self._at_exit = Finalize(None, self._close_at_exit, exitpriority=0)

    # --- training hooks ---------------------------------------------------------------------
    def on_step_begin(self) -> None:
        """Mark the beginning of a training step.

        Raises:
            Exception: This rank could not measure the limit just finished: its monitor, or
                NVML setting a limit while profiling it (at a step begin or an epoch end).
            PerseusError: Another rank could not (every rank raises at that step begin; the
                limit is not recorded, and the next step begin profiles it again).
            Exception: This rank could not set the optimum profiling chose (or another rank
                could not: PerseusError). Every rank raises, after saving the profile, and
                the next step begin sets it again.
        """
        if self._closed:
            self._reopen()
        state = self.state
        if isinstance(state, Ready):
            state.steps -= 1
            if state.steps > 0:  # a wait step
                return
            self._set_profiled(state.next_power_limit)
            self.state = Warmup(current_power_limit=state.next_power_limit, steps=self.warmup_steps)
        elif isinstance(state, Paused):
            if state.profile_steps >= self.profile_steps:  # paused right after its last step
                self._finish_limit(state.current_power_limit)
                return
            self._set_profiled(state.current_power_limit)
            warmed = min(state.warmup_steps + 1, self.warmup_steps)
            self.state = Warmup(
                current_power_limit=state.current_power_limit, steps=self.warmup_steps + 1 - warmed
            )
            self._resume_steps = state.profile_steps
        elif isinstance(state, Warmup):
            state.steps -= 1
            if state.steps > 0:
                return
            self._windows.begin(state.current_power_limit)
            self.state = Profiling(
                current_power_limit=state.current_power_limit,
                steps=self.profile_steps - self._resume_steps,
            )
        elif isinstance(state, Profiling):
            state.steps -= 1
            if state.steps > 0:
                return
            self._windows.end(state.current_power_limit)
            self._finish_limit(state.current_power_limit)
        elif isinstance(state, Done) and self._optimum_unset:  # after a failure, or close()
            self._apply_optimum()

    def on_epoch_end(self) -> None:
        """Mark the end of an epoch: interrupt the limit being profiled, back to the maximum."""
        if isinstance(self.state, Warmup | Profiling):
            profiled = self.state.current_power_limit
            limit = format_watts(profiled)
            logger.info(
                "epoch ended while profiling %s (%s)",
                limit,
                "paused" if self.carry_across_epochs else "it starts over",
            )
            self._interrupt(self.state)
            self._set_profiled(self.max_power_limit_mw, profiled)  # raised as it is reduced
            if self._stall.stalled(self.state):
                steps = None if self.carry_across_epochs else self.warmup_steps + self.profile_steps
                logger.warning(self._stall.message(limit, steps))

    def on_train_end(self) -> None:
        """Mark the end of training: :meth:`close` (as the HF callback's ``on_train_end``)."""
        self.close()

    def close(self) -> None:
        """Restore the maximum power limit on every GPU (idempotent; also runs at exit).

        Training may go on afterwards (e.g. Hugging Face ``train()`` called again): the next
        step begin re-applies the optimum (on every rank together: call it on every rank),
        or goes on profiling where it stopped.

        It takes no collective, so it returns at once on a rank that closes alone. The ranks
        that train on wait in their profiling's next all-reduce for it (until it leaves the
        process group, or the group's timeout): call it on every rank, at the same step.
        """
        if self._closed:
            return
        self._closed = True
        if self._at_exit is not None:
            self._at_exit.cancel()
        if isinstance(self.state, Warmup | Profiling):
            self._interrupt(self.state)  # a failure is kept for the limit's reduction
        self._restore_maximum()

    def profile(self) -> PowerLimitProfile | None:
        """The measurements and the chosen limit once Done (what a profile file holds)."""
        if not isinstance(self.state, Done):
            return None
        return PowerLimitProfile(
            measurements=self.measurements,
            optimal_power_limit=self.state.optimal_power_limit // 1000,
            selector=repr(self.optimum_selector),
            updated_at=self._profiled_at,
        )

    # --- internals ----------------------------------------------------------------------------
    def _close_at_exit(self) -> None:
        if os.getpid() == self._pid:  # never in a plain fork: its parent trains on at the limit
            self.close()

    def _reopen(self) -> None:
        self._closed = False
        if self._restore_on_exit:
            self._at_exit = Finalize(None, self._close_at_exit, exitpriority=0)
        # Every rank reopens (close() runs on every rank, as on_train_end): the step begin
        # sets the optimum on all of them, and they agree on whether it was.
        self._optimum_unset = isinstance(self.state, Done)

    def _reset_carried(self) -> None:
        self._windows.reset()
        self._resume_steps = 0

    def _interrupt(self, state: Warmup | Profiling) -> None:
        """Leave Warmup/Profiling for an epoch end or close(): start over, or pause."""
        limit = state.current_power_limit
        if not self.carry_across_epochs:
            self._reset_carried()
            if isinstance(state, Profiling):
                self._windows.cancel(limit)  # a failure is raised as the limit is reduced
            self.state = Ready(next_power_limit=limit)
            return
        # Steps done, from the countdowns: the step begin that counted down to 0 was the
        # first of the phase.
        if isinstance(state, Profiling):
            self._windows.end(limit)  # a failure is raised as the limit is reduced
            self.state = Paused(
                current_power_limit=limit,
                warmup_steps=self.warmup_steps,
                profile_steps=self.profile_steps + 1 - state.steps,
            )
        else:
            self.state = Paused(
                current_power_limit=limit,
                warmup_steps=self.warmup_steps + 1 - state.steps,
                profile_steps=self._resume_steps,
            )

    def _finish_limit(self, power_limit_mw: int) -> None:
        try:
            time_s, energy_j = self._windows.reduce(power_limit_mw, self.reducer)
        except Exception:  # on every rank (a rank's window failed): training that goes on
            self.state = Ready(next_power_limit=power_limit_mw)  # profiles the limit again
            raise
        finally:
            self._resume_steps = 0
        watts = power_limit_mw // 1000  # measurements are in whole watts, as Zeus's
        self.measurements.append(
            PowerLimitMeasurement(power_limit=watts, energy=energy_j, time=time_s)
        )
        logger.info("power limit %d W: %.3f s, %.1f J", watts, time_s, energy_j)
        position = self.power_limits.index(power_limit_mw)
        if position + 1 < len(self.power_limits):
            following = self.power_limits[position + 1]
            self._set_profiled(following)
            self.state = Warmup(current_power_limit=following, steps=self.warmup_steps)
            return
        try:
            optimal = self._compute_optimal_power_limit()
        except Exception:
            # Every limit is measured: a selector that fails (a user's) must not lose that. Kept
            # without an optimum; the next start's selector chooses from it.
            self._save_profile()
            raise
        logger.info("profiling done; optimal power limit %s", format_watts(optimal))
        self.state = Done(optimal_power_limit=optimal)
        self._save_profile()  # by every rank, whether or not every rank can set the optimum
        self._apply_optimum()

    def _apply_optimum(self, at_start: bool = False) -> None:
        """Set the optimum (state Done); every rank raises if some rank could not (a collective).

        Until every rank has set it, each step begin tries again (on every rank, together).
        """
        assert isinstance(self.state, Done)
        optimal = self.state.optimal_power_limit
        failure: Exception | None = None
        try:
            self._set_power_limit(optimal)
        except Exception as exc:  # the other ranks must hear of it
            failure = exc
        self._optimum_unset = True
        agree_on_optimum(optimal, failure, self.reducer, at_start=at_start)
        self._optimum_unset = False

    def _restore_maximum(self) -> None:
        try:
            self._set_power_limit(self.max_power_limit_mw)
        except GPUError as exc:
            logger.warning("could not restore the maximum power limit: %s", exc)

    def _set_power_limit(self, milliwatts: int) -> None:
        set_power_limit(self.nvml, self._nvml_of, milliwatts)
        self.current_power_limit = milliwatts

    def _set_profiled(self, milliwatts: int, profiled: int | None = None) -> None:
        # While ``profiled`` (default: this limit) is profiled: a failure raised on this rank
        # alone left the others waiting in its all-reduce; kept, every rank raises there.
        try:
            self._set_power_limit(milliwatts)
        except Exception as exc:
            self._windows.fail(milliwatts if profiled is None else profiled, exc)

    def _compute_optimal_power_limit(self, at_start: bool = False) -> int:
        # Every rank gets here together (its last window, or the profile all ranks load) and
        # reduces, whatever its selector: a rank given another one left the rest waiting.
        _, gpus = self.reducer(0.0, float(len(self.gpu_indices)))
        if self._default_selector:
            # Energy is summed over the ranks' GPUs, so MaxPower must count all of them: Zeus's
            # len(monitor.gpu_indices) made 2 ranks x 1 GPU choose otherwise than 1 x 2.
            self.optimum_selector = ZeusCost(eta_knob=0.5, world_size=max(1, round(gpus)))
        try:
            watts = chosen_limit(self.optimum_selector, self.measurements)
        except Exception as exc:  # a user's selector that fails on one rank alone: the others
            agree_on_optimum(0, exc, self.reducer, at_start=at_start)  # agree on the optimum
            raise
        return limit_to_set(watts, self.power_limits, self.min_power_limit_mw)

    def _save_profile(self, stamp: bool = True, store: bool = True) -> None:
        """Write the profile to ``profile_path`` and the Redis store (those given).

        Before Done (a selector failed), the measurements without an optimum.

        Args:
            stamp: Date the profile now (it was just measured).
            store: Write the Redis store too (not when the profile came from there).
        """
        if stamp:
            self._profiled_at = time.time()
        profile = self.profile() or PowerLimitProfile(
            measurements=self.measurements,
            selector=repr(self.optimum_selector),
            updated_at=self._profiled_at,
        )
        save_or_warn(
            profile, self.profile_path, self.profile_store if store else None, self.workload
        )
