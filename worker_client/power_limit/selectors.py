"""What the power-limit optimizer measures and how it picks a limit from the measurements.

:class:`PowerLimitMeasurement` and :class:`PowerLimitProfile` (also the JSON profile file's and
the Redis store's format) are the data; an :class:`OptimumSelector` (:class:`Energy`,
:class:`Time`, :class:`ZeusCost`, :class:`MaxSlowdownConstraint`) picks the limit that
:class:`~worker_client.power_limit.optimizer.GlobalPowerLimitOptimizer` keeps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from protocol.exceptions import ConfigError


class PowerLimitMeasurement(BaseModel):
    """Time and energy of ``profile_steps`` training steps at one power limit.

    Attributes:
        power_limit: The power limit, Watts.
        energy: Energy of all measured GPUs (of all ranks), Joules.
        time: Wall time of the profiled steps (slowest rank), seconds.

    """

    model_config = ConfigDict(extra="forbid")

    power_limit: int = Field(ge=1)
    energy: float = Field(ge=0)
    time: float = Field(ge=0)


class PowerLimitProfile(BaseModel):
    """A workload's profiling result; also the JSON profile file's format.

    Attributes:
        measurements: One entry per profiled power limit, highest limit first.
        optimal_power_limit: The limit the selector chose, Watts.
        selector: Description of the selector that chose it (informative).
        updated_at: Unix time the profile was produced or stored.

    """

    model_config = ConfigDict(extra="forbid")

    measurements: list[PowerLimitMeasurement] = Field(min_length=1)
    optimal_power_limit: int = Field(ge=1)
    selector: str = ""
    updated_at: float = 0.0


class OptimumSelector(ABC):
    """Chooses the power limit to train with from the profiled measurements."""

    @abstractmethod
    def select(self, measurements: Sequence[PowerLimitMeasurement]) -> int:
        """Return the chosen power limit (W); ``measurements`` is not empty."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


def _argmin(measurements: Sequence[PowerLimitMeasurement], key: Callable[..., float]) -> int:
    if not measurements:
        raise ValueError("no power limit measurements to select from")
    # Ties go to the lower power limit: same objective, less power.
    best = min(measurements, key=lambda m: (key(m), m.power_limit))
    return best.power_limit


class Energy(OptimumSelector):
    """The power limit with the least energy."""

    def select(self, measurements: Sequence[PowerLimitMeasurement]) -> int:
        """Return the power limit (W) with the least energy."""
        return _argmin(measurements, lambda m: m.energy)


class Time(OptimumSelector):
    """The power limit with the shortest time.

    Times are noisy, so this is not necessarily the maximum limit; a slightly lower limit
    with an equally short time is a good pick anyway (same speed, less power).
    """

    def select(self, measurements: Sequence[PowerLimitMeasurement]) -> int:
        """Return the power limit (W) with the shortest time."""
        return _argmin(measurements, lambda m: m.time)


class ZeusCost(OptimumSelector):
    """The power limit minimising ``eta * E + (1 - eta) * MaxPower * world_size * T``.

    ``MaxPower`` is the largest profiled power limit: the second term prices time as energy
    drawn at full power by all ``world_size`` GPUs, so ``eta`` trades energy (1) for time (0).

    Args:
        eta_knob: Weight of energy, in [0, 1].
        world_size: Number of GPUs in the job.

    """

    def __init__(self, eta_knob: float, world_size: int = 1) -> None:
        if not 0.0 <= eta_knob <= 1.0:
            raise ConfigError(f"eta_knob must be in [0, 1], got {eta_knob}")
        if world_size < 1:
            raise ConfigError(f"world_size must be at least 1, got {world_size}")
        self.eta_knob = eta_knob
        self.world_size = world_size

    def select(self, measurements: Sequence[PowerLimitMeasurement]) -> int:
        """Return the power limit (W) with the least Zeus cost."""
        if not measurements:
            raise ValueError("no power limit measurements to select from")
        max_power = max(m.power_limit for m in measurements)
        eta = self.eta_knob
        return _argmin(
            measurements,
            lambda m: eta * m.energy + (1 - eta) * max_power * self.world_size * m.time,
        )


class MaxSlowdownConstraint(OptimumSelector):
    """The lowest power limit whose time is at most ``factor`` x the shortest time.

    Args:
        factor: Allowed slowdown, at least 1.0 (1.0: as fast as the fastest limit).

    """

    def __init__(self, factor: float) -> None:
        if not factor >= 1.0:  # also rejects NaN
            raise ConfigError(f"slowdown factor must be at least 1.0, got {factor}")
        self.factor = factor

    def select(self, measurements: Sequence[PowerLimitMeasurement]) -> int:
        """Return the lowest power limit (W) within the allowed slowdown."""
        if not measurements:
            raise ValueError("no power limit measurements to select from")
        shortest = min(m.time for m in measurements)
        return min(m.power_limit for m in measurements if m.time <= self.factor * shortest)
