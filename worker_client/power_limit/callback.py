"""Zeus's training callback interface (``zeus.callback.Callback``), every event a no-op.

:class:`~worker_client.power_limit.optimizer.GlobalPowerLimitOptimizer` subclasses it, as
Zeus's optimizer subclasses Zeus's ``Callback``: a training loop written for Zeus (e.g. through
a ``CallbackSet``) calls all seven events on every callback, including those the optimizer has
nothing to do at.
"""

from __future__ import annotations


class Callback:
    """Training events; a subclass overrides those it acts on."""

    def on_train_begin(self) -> None:
        """Mark the beginning of training."""

    def on_train_end(self) -> None:
        """Mark the end of training."""

    def on_epoch_begin(self) -> None:
        """Mark the beginning of an epoch."""

    def on_epoch_end(self) -> None:
        """Mark the end of an epoch."""

    def on_step_begin(self) -> None:
        """Mark the beginning of a training step."""

    def on_step_end(self) -> None:
        """Mark the end of a training step."""

    def on_evaluate(self, metric: float) -> None:
        """Mark an evaluation of the model, which scored ``metric``."""
