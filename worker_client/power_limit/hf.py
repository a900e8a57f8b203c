"""Hugging Face ``Trainer`` callback around :class:`GlobalPowerLimitOptimizer`.

Importing this module never needs ``transformers``: the callback subclasses
``transformers.TrainerCallback`` when that is importable and a plain class otherwise (the
``Trainer`` only calls the ``on_*`` methods, so either works)::

    trainer = Trainer(..., callbacks=[HFGlobalPowerLimitOptimizer(EnergyMonitor())])
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from worker_client.power_limit.optimizer import (
    GlobalPowerLimitOptimizer,
    OptimumSelector,
    WindowMonitor,
)

try:
    from transformers import TrainerCallback as _CallbackBase
except ImportError:  # transformers is optional

    class _CallbackBase:  # type: ignore[no-redef]
        """Stand-in for ``transformers.TrainerCallback``."""


class HFGlobalPowerLimitOptimizer(_CallbackBase):
    """Power-limit optimizer as a Hugging Face ``TrainerCallback``.

    Takes the arguments of :class:`~worker_client.power_limit.optimizer.GlobalPowerLimitOptimizer`
    (extra keyword arguments such as ``profile_store`` are passed through) and forwards the
    Trainer's step and epoch events to it as :attr:`optimizer`.
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
        **kwargs: Any,
    ) -> None:
        self.optimizer = GlobalPowerLimitOptimizer(
            monitor,
            optimum_selector=optimum_selector,
            wait_steps=wait_steps,
            warmup_steps=warmup_steps,
            profile_steps=profile_steps,
            pl_step=pl_step,
            profile_path=profile_path,
            **kwargs,
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
