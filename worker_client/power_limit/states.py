"""The power-limit optimizer's states (limits in milliwatts, as Zeus's states hold them).

Transitions: :mod:`worker_client.power_limit.optimizer`'s module docstring.
"""

from __future__ import annotations

from pydantic import BaseModel


class Ready(BaseModel):
    """Waiting for the next step to start warming up ``next_power_limit`` (mW)."""

    next_power_limit: int


class Warmup(BaseModel):
    """Running warm-up steps at ``current_power_limit`` (mW); ``steps`` begun so far."""

    current_power_limit: int
    steps: int = 1


class Profiling(BaseModel):
    """Measuring ``current_power_limit`` (mW); ``steps`` measured so far, this one included."""

    current_power_limit: int
    steps: int = 1


class Paused(BaseModel):
    """An epoch ended (or ``close()`` ran) mid-limit with ``carry_across_epochs``.

    Attributes:
        current_power_limit: The limit being profiled, mW.
        warmup_steps: Warm-up steps already run at it.
        profile_steps: Steps already measured (their time and energy are kept).

    """

    current_power_limit: int
    warmup_steps: int
    profile_steps: int


class Done(BaseModel):
    """Profiling finished (or skipped); training runs at ``optimal_power_limit`` (mW)."""

    optimal_power_limit: int


State = Ready | Warmup | Profiling | Paused | Done
