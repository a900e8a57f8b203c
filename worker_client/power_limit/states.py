"""The power-limit optimizer's states (limits in milliwatts, as Zeus's states hold them).

Transitions: :mod:`worker_client.power_limit.optimizer`'s module docstring. Plain dataclasses:
they never cross Redis or a file (the profile does, :class:`protocol.models.PowerLimitProfile`),
and the optimizer counts steps in them in place. Built with keywords and counted as Zeus's are:
``steps`` is how many step begins are left until the next transition, which happens at the
step begin that brings it to 0.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class Ready:
    """Waiting to warm up ``next_power_limit`` (mW).

    ``steps`` step begins are left: the last one sets the limit and is its first warm-up
    step (``wait_steps + 1`` at the start, 1 after an epoch end).
    """

    next_power_limit: int
    steps: int = 1


@dataclass(kw_only=True)
class Warmup:
    """Warming up ``current_power_limit`` (mW); the window begins ``steps`` step begins on.

    ``warmup_steps`` at the step begin that set the limit.
    """

    current_power_limit: int
    steps: int


@dataclass(kw_only=True)
class Profiling:
    """Measuring ``current_power_limit`` (mW); the window ends ``steps`` step begins on.

    ``profile_steps`` at the step begin that began the window.
    """

    current_power_limit: int
    steps: int


@dataclass(kw_only=True)
class Paused:
    """An epoch ended (or ``close()`` ran) mid-limit with ``carry_across_epochs``.

    Attributes:
        current_power_limit: The limit being profiled, mW.
        warmup_steps: Warm-up steps already run at it.
        profile_steps: Steps already measured (their time and energy are kept).

    Counts of steps done, unlike the other states' countdowns: Zeus has no such state.
    """

    current_power_limit: int
    warmup_steps: int
    profile_steps: int


@dataclass(kw_only=True)
class Done:
    """Profiling finished (or skipped); training runs at ``optimal_power_limit`` (mW)."""

    optimal_power_limit: int


State = Ready | Warmup | Profiling | Paused | Done


class StallWatch:
    """Notices epoch ends that keep leaving the optimizer where the previous ones did.

    Epochs too short to finish a limit (Zeus's mode) or to advance one (``carry_across_epochs``
    needs 2 steps) would profile for ever, silently.

    Args:
        ends: Epoch ends in a row with the same state that count as a stall.
    """

    def __init__(self, ends: int = 3) -> None:
        self.ends = ends
        self._last: tuple[str, tuple[int, ...]] | None = None
        self._same = 0
        self.reported = False

    def stalled(self, state: State) -> bool:
        """Record the state an epoch end left; True the first time ``ends`` in a row match."""
        # A copy of the fields: the optimizer counts steps in the state object in place.
        seen = (type(state).__name__, tuple(vars(state).values()))
        self._same = self._same + 1 if seen == self._last else 1
        self._last = seen
        if self._same >= self.ends and not self.reported:
            self.reported = True
            return True
        return False

    def message(self, limit: str, limit_steps: int | None) -> str:
        """The warning for a stall at ``limit`` (e.g. ``"300 W"``).

        Args:
            limit: The limit profiling is stuck at.
            limit_steps: Warm-up plus measured steps of a limit in Zeus's mode; None with
                ``carry_across_epochs``.
        """
        need = (
            "2 steps or more"
            if limit_steps is None
            else f"over {limit_steps} steps, or pass carry_across_epochs=True"
        )
        return (
            f"power-limit profiling is not advancing: {self.ends} epoch ends in a row left "
            f"{limit} where it was; it needs epochs of {need}"
        )
