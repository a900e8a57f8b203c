"""Hugging Face ``Trainer`` callback around :class:`GlobalPowerLimitOptimizer`.

Importing this module never needs ``transformers``: the callback subclasses
``transformers.TrainerCallback`` when that is importable and a plain class otherwise (the
``Trainer`` only calls the ``on_*`` methods, so either works)::

    trainer = Trainer(..., callbacks=[HFGlobalPowerLimitOptimizer(EnergyMonitor())])
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker_client.gpu.nvml import NVML
from worker_client.power_limit.monitor import Reducer, WindowMonitor
from worker_client.power_limit.optimizer import GlobalPowerLimitOptimizer, OptimumSelector

if TYPE_CHECKING:
    from worker_client.power_limit.store import PowerLimitProfileStore

try:
    from transformers import TrainerCallback as _CallbackBase
except ImportError:  # transformers is optional

    class _CallbackBase:  # type: ignore[no-redef]
        """Stand-in for ``transformers.TrainerCallback``: every event, doing nothing."""

        def _ignore(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            """An event this callback does not use."""

        on_init_end = on_train_begin = on_train_end = on_epoch_begin = on_epoch_end = _ignore
        on_step_begin = on_step_end = on_substep_end = on_pre_optimizer_step = _ignore
        on_optimizer_step = on_evaluate = on_predict = on_save = on_log = _ignore
        on_prediction_step = _ignore


class HFGlobalPowerLimitOptimizer(_CallbackBase):
    """Power-limit optimizer as a Hugging Face ``TrainerCallback``.

    Takes exactly the arguments of
    :class:`~worker_client.power_limit.optimizer.GlobalPowerLimitOptimizer` (a misspelt one is
    a TypeError here) and forwards the Trainer's step and epoch events to it as
    :attr:`optimizer`. ``on_train_end`` restores the maximum power limit; a later ``train()``
    goes on where the optimizer stopped.
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
        self.optimizer = GlobalPowerLimitOptimizer(
            monitor,
            optimum_selector,
            wait_steps,
            warmup_steps,
            profile_steps,
            pl_step,
            profile_path,
            carry_across_epochs=carry_across_epochs,
            nvml=nvml,
            profile_store=profile_store,
            workload=workload,
            reducer=reducer,
            restore_on_exit=restore_on_exit,
        )

    def on_step_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        """Forward the beginning of a training step."""
        self.optimizer.on_step_begin()

    def on_step_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        """Forward the end of a training step."""
        self.optimizer.on_step_end()

    def on_epoch_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        """Forward the end of an epoch."""
        self.optimizer.on_epoch_end()

    def on_train_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        """Restore the maximum power limit when training ends."""
        self.optimizer.close()
