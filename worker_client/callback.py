"""The training-loop callback interface (Zeus's ``zeus.callback.Callback``): every event a no-op.

``PerseusOptimizer`` and ``GlobalPowerLimitOptimizer`` both subclass it, as Zeus's do: a loop
written for Zeus (through a ``CallbackSet``, say) calls every event on every callback, including
those a callback has nothing to do at.
"""

from __future__ import annotations


class Callback:
    """Training events; a subclass overrides those it acts on."""

    def on_train_begin(self) -> None:
        """Training starts."""

    def on_train_end(self) -> None:
        """Training ends (release resources here)."""

    def on_epoch_begin(self) -> None:
        """An epoch starts."""

    def on_epoch_end(self) -> None:
        """An epoch ends."""

    def on_step_begin(self) -> None:
        """A training step (one pipeline iteration) starts."""

    def on_step_end(self) -> None:
        """A training step ends."""

    def on_evaluate(self, metric: float) -> None:
        """The model was evaluated and scored ``metric``."""

    def on_instruction_begin(self, name: str) -> None:
        """A pipeline instruction (e.g. ``forward``, ``backward``) starts."""

    def on_instruction_end(self, name: str) -> None:
        """A pipeline instruction ends."""
