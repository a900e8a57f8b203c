"""What the power-limit optimizer measures per limit and how a selector picks the limit to keep.

:class:`~protocol.models.PowerLimitMeasurement` is one profiled limit; an :class:`OptimumSelector`
(:class:`Energy`, :class:`Time`, :class:`ZeusCost`, :class:`MaxSlowdownConstraint`) picks the
limit that :class:`~worker_client.power_limit.optimizer.GlobalPowerLimitOptimizer` keeps.
Each selector decides exactly as Zeus's selector of the same name does, ties included: the
measurement listed first wins (profiling lists the highest limit first).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from numbers import Integral, Real

from protocol.exceptions import ConfigError
from protocol.models import PowerLimitMeasurement


def _is_number(value: object) -> bool:
    """A real number (numpy's too) that is not a bool (``True`` is no knob setting)."""
    return isinstance(value, Real) and not isinstance(value, bool)


def _is_integer(value: object) -> bool:
    """An integer (numpy's too) that is not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def _require(measurements: Sequence[PowerLimitMeasurement]) -> None:
    if not measurements:
        raise ValueError("no power limit measurements to select from")


class OptimumSelector(ABC):
    """Chooses the power limit to train with from the profiled measurements."""

    @abstractmethod
    def select(self, measurements: Sequence[PowerLimitMeasurement]) -> int:
        """Return the chosen power limit (W); ``measurements`` is not empty."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class Energy(OptimumSelector):
    """The power limit with the least energy (the first listed among equals)."""

    def select(self, measurements: Sequence[PowerLimitMeasurement]) -> int:
        """Return the power limit (W) with the least energy."""
        _require(measurements)
        return min(measurements, key=lambda m: m.energy).power_limit


class Time(OptimumSelector):
    """The power limit with the shortest time (the first listed among equals).

    Times are noisy, so this is not necessarily the maximum limit; a slightly lower limit
    with an equally short time is a good pick anyway (same speed, less power).
    """

    def select(self, measurements: Sequence[PowerLimitMeasurement]) -> int:
        """Return the power limit (W) with the shortest time."""
        _require(measurements)
        return min(measurements, key=lambda m: m.time).power_limit


class ZeusCost(OptimumSelector):
    """The power limit minimising ``eta * E + (1 - eta) * MaxPower * T``.

    ``MaxPower`` is the largest profiled power limit times ``world_size``: the second term
    prices time as energy drawn at full power by ``world_size`` GPUs, so ``eta`` trades
    energy (1) for time (0). The optimizer's default is ``ZeusCost(0.5, world_size=number of
    GPUs measured)``, every rank's (Zeus counts one rank's monitor while summing all ranks'
    energy).

    Args:
        eta_knob: Weight of energy, in [0, 1].
        world_size: Number of GPUs in the job.

    """

    def __init__(self, eta_knob: float, world_size: int = 1) -> None:
        if not (_is_number(eta_knob) and 0.0 <= eta_knob <= 1.0):  # also rejects NaN
            raise ConfigError(f"eta_knob must be a number in [0, 1], got {eta_knob!r}")
        # An integer: a NaN world size would make every cost NaN and the first limit win.
        if not (_is_integer(world_size) and world_size >= 1):
            raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
        self.eta_knob = eta_knob
        self.world_size = world_size

    def select(self, measurements: Sequence[PowerLimitMeasurement]) -> int:
        """Return the power limit (W) with the least Zeus cost."""
        _require(measurements)
        max_power = max(m.power_limit for m in measurements) * self.world_size
        eta = self.eta_knob
        # One cost per limit, in first-seen order (a repeated limit keeps its first place and
        # its last cost, as Zeus's dict does); the expression's operation order is Zeus's too,
        # so floating-point near-ties round the same way.
        cost: dict[int, float] = {}
        for m in measurements:
            cost[m.power_limit] = eta * m.energy + (1 - eta) * max_power * m.time
        return min(cost, key=cost.__getitem__)


class MaxSlowdownConstraint(OptimumSelector):
    """The lowest power limit whose time is at most ``factor`` x the maximum limit's time.

    The yardstick is the time measured at the highest profiled limit (Zeus's definition), not
    the shortest time measured: noise can make a lower limit look faster than the maximum.

    Args:
        factor: Allowed slowdown, at least 1.0 (1.0: no slower than at the maximum limit).

    """

    def __init__(self, factor: float) -> None:
        if not (_is_number(factor) and factor >= 1.0):  # also rejects NaN
            raise ConfigError(
                f"factor (the slowdown allowed) must be a number, at least 1.0, got {factor!r}"
            )
        self.factor = factor

    def select(self, measurements: Sequence[PowerLimitMeasurement]) -> int:
        """Return the lowest power limit (W) within the allowed slowdown."""
        _require(measurements)
        highest = max(m.power_limit for m in measurements)
        baseline = next(m.time for m in measurements if m.power_limit == highest)
        return min(m.power_limit for m in measurements if m.time <= self.factor * baseline)


def chosen_limit(selector: OptimumSelector, measurements: Sequence[PowerLimitMeasurement]) -> int:
    """``selector``'s pick (W) as an int; a user's selector may return ``250.0`` or numpy's.

    Raises:
        ConfigError: The selector returned no whole number of watts (NVML takes integers).
    """
    value = selector.select(measurements)
    if _is_integer(value):
        return int(value)
    if _is_number(value) and float(value).is_integer():  # NaN and infinities are not
        return int(value)
    raise ConfigError(
        f"optimum_selector {selector!r} returned {value!r}, not a power limit in whole watts"
    )
