"""The training-loop callback interface: every hook is a no-op unless overridden."""

from __future__ import annotations


class Callback:
    """Base class of perseus-mq's training hooks.

    Call the hooks from your training loop; override only the ones you need.
    """

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

    def on_instruction_begin(self, name: str) -> None:
        """A pipeline instruction (e.g. ``forward``, ``backward``) starts."""

    def on_instruction_end(self, name: str) -> None:
        """A pipeline instruction ends."""
