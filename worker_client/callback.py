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


class CallbackSet(Callback):
    """Calls several callbacks in order, so a loop needs only one object."""

    def __init__(self, callbacks: list[Callback]) -> None:
        self.callbacks = list(callbacks)

    def on_train_begin(self) -> None:
        """Forward to every callback."""
        for cb in self.callbacks:
            cb.on_train_begin()

    def on_train_end(self) -> None:
        """Forward to every callback."""
        for cb in self.callbacks:
            cb.on_train_end()

    def on_epoch_begin(self) -> None:
        """Forward to every callback."""
        for cb in self.callbacks:
            cb.on_epoch_begin()

    def on_epoch_end(self) -> None:
        """Forward to every callback."""
        for cb in self.callbacks:
            cb.on_epoch_end()

    def on_step_begin(self) -> None:
        """Forward to every callback."""
        for cb in self.callbacks:
            cb.on_step_begin()

    def on_step_end(self) -> None:
        """Forward to every callback."""
        for cb in self.callbacks:
            cb.on_step_end()

    def on_instruction_begin(self, name: str) -> None:
        """Forward to every callback."""
        for cb in self.callbacks:
            cb.on_instruction_begin(name)

    def on_instruction_end(self, name: str) -> None:
        """Forward to every callback."""
        for cb in self.callbacks:
            cb.on_instruction_end(name)
