"""The power-limit optimizer's states (limits in milliwatts, as Zeus's states hold them).

Transitions: :mod:`worker_client.power_limit.optimizer`'s module docstring. Plain dataclasses:
they never cross Redis or a file (the profile does, :class:`protocol.models.PowerLimitProfile`),
and the optimizer counts steps in them in place. Built with keywords, as Zeus's are.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class Ready:
    """Waiting for the next step to start warming up ``next_power_limit`` (mW)."""

    next_power_limit: int


@dataclass(kw_only=True)
class Warmup:
    """Running warm-up steps at ``current_power_limit`` (mW); ``steps`` begun so far."""

    current_power_limit: int
    steps: int = 1


@dataclass(kw_only=True)
class Profiling:
    """Measuring ``current_power_limit`` (mW); ``steps`` measured so far, this one included."""

    current_power_limit: int
    steps: int = 1


@dataclass(kw_only=True)
class Paused:
    """An epoch ended (or ``close()`` ran) mid-limit with ``carry_across_epochs``.

    Attributes:
        current_power_limit: The limit being profiled, mW.
        warmup_steps: Warm-up steps already run at it.
        profile_steps: Steps already measured (their time and energy are kept).

    """

    current_power_limit: int
    warmup_steps: int
    profile_steps: int


@dataclass(kw_only=True)
class Done:
    """Profiling finished (or skipped); training runs at ``optimal_power_limit`` (mW)."""

    optimal_power_limit: int


State = Ready | Warmup | Profiling | Paused | Done
