"""Pick one plan from a planner output folder (Perseus step 3).

Policies choose among the Pareto-optimal plans only (``dominated`` 0 in ``frontier.csv``).
Iteration times are the planner's ``iteration_time`` column (the real longest path at the
plan's clocks, the one time shown everywhere); energy is ``energy_with_p2p``, which equals the
computation energy when no P2P power was given:

* ``no-slowdown``: least energy among plans no slower than running every instruction at its
  highest clock (``allmax``). The solver works in whole time units, so its fastest point can
  land a little above ``allmax``; the limit then grows by that gap, never by more than the
  run's reported rounding bound.
* ``min-energy``: least energy overall (the slow end of the frontier).
* ``max-slowdown FACTOR``: least energy within ``FACTOR`` (>= 1) times the ``allmax`` time
  (plus the same rounding allowance as ``no-slowdown``); ``1`` is ``no-slowdown``.
* ``deadline SECONDS``: least energy within ``SECONDS``; an error if no plan is that fast.
* ``straggler SECONDS``: another pipeline (the straggler) takes ``SECONDS`` per iteration, so
  there is no point in being faster: least energy within ``SECONDS``. If the straggler is
  slower than every plan this is the least-energy (slowest) plan; if it is faster than every
  plan, the fastest plan.

Ties in energy go to the faster plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from protocol.exceptions import ConfigError
from protocol.numbers import ascii_float
from schedulers.planning.frontier_files import (
    FRONTIER_CSV,
    Frontier,
    FrontierPoint,
    load_frontier,
)

POLICIES = ("no-slowdown", "min-energy", "max-slowdown", "deadline", "straggler")
_NEEDS_VALUE = {"max-slowdown": "FACTOR", "deadline": "SECONDS", "straggler": "SECONDS"}
# Iteration times are integer multiples of the unit time, stored as floats.
_EPS = 1e-9


@dataclass(frozen=True)
class ChosenPlan:
    """The outcome of :func:`choose_plan`.

    Attributes:
        policy: The policy name.
        value: The policy's argument, if any.
        plan: Plan id (e.g. ``"00412"``).
        file: The plan file.
        iteration_time: The plan's iteration time, seconds.
        energy: The plan's computation energy per iteration, J.
        energy_with_p2p: Energy including P2P blocking, J (what the policies minimise).
        allmax_time: The all-max-clock iteration time, seconds.
        allmax_energy: The all-max-clock energy including P2P blocking, J.
        saving_j: ``allmax_energy - energy_with_p2p``, J.
        saving_pct: The saving as a percentage of ``allmax_energy``.
        slowdown_pct: Iteration time relative to all-max, percent (<= 0 is no slowdown).
        limit: The iteration time limit the policy applied, seconds (None for min-energy).
        note: Anything worth telling the user (e.g. a fallback), else "".

    """

    policy: str
    value: float | None
    plan: str
    file: Path
    iteration_time: float
    energy: float
    energy_with_p2p: float
    allmax_time: float
    allmax_energy: float
    saving_j: float
    saving_pct: float
    slowdown_pct: float
    limit: float | None
    note: str = ""


def parse_policy(policy: str, value: float | None = None) -> tuple[str, float | None]:
    """Normalise a policy and its value.

    ``policy`` may carry the value itself: ``"max-slowdown 1.1"`` or ``"deadline=2.5"``.

    Raises:
        ConfigError: Unknown policy, a missing, extra or non-numeric value, or a value out of
            range.

    """
    # The name is normalised, the value is read as typed: its '_' was shown as '-'.
    name, _, rest = policy.strip().replace("=", " ").partition(" ")
    name = name.lower().replace("_", "-")
    rest = rest.strip()
    if rest:
        if value is not None:
            raise ConfigError(f"policy {policy!r} has a value and --value {value} was given too")
        try:
            value = ascii_float(rest)  # float() read Arabic-Indic digits
        except ValueError:
            raise ConfigError(f"policy {policy!r}: {rest!r} is not a number") from None
    if name not in POLICIES:
        raise ConfigError(f"unknown policy {name!r}; use one of {', '.join(POLICIES)}")
    if name in _NEEDS_VALUE:
        if value is None:
            raise ConfigError(f"policy {name} needs a value: {name} {_NEEDS_VALUE[name]}")
        if not math.isfinite(value):  # a limit of inf s (or nan) is none
            raise ConfigError(f"{name} {_NEEDS_VALUE[name]} must be a finite number, got {value}")
        if name == "max-slowdown" and not value >= 1.0:
            raise ConfigError(f"max-slowdown FACTOR must be >= 1 (1.1 = 10% slower), got {value}")
        if name != "max-slowdown" and not value > 0:
            raise ConfigError(f"{name} SECONDS must be positive, got {value}")
    elif value is not None:
        raise ConfigError(f"policy {name} takes no value (got {value})")
    return name, value


def _least_energy(points: list[FrontierPoint], limit: float) -> FrontierPoint | None:
    fit = [p for p in points if p.iteration_time <= limit + _EPS * max(1.0, limit)]
    if not fit:
        return None
    return min(fit, key=lambda p: (p.energy_with_p2p, p.iteration_time))


def rounding_allowance(frontier: Frontier) -> float:
    """How far above ``allmax`` the no-slowdown limit may go (see the module docstring)."""
    fastest = min(p.iteration_time for p in frontier.pareto)
    gap = max(0.0, fastest - frontier.allmax.iteration_time)
    bound = frontier.rounding_bound
    return min(gap, bound) if bound > 0 else 0.0


def select_point(
    frontier: Frontier, policy: str, value: float | None = None
) -> tuple[FrontierPoint, float | None, str]:
    """Apply a policy to a frontier.

    Returns:
        ``(point, limit, note)``: the chosen plan, the time limit applied (None for
        min-energy) and a note for the user ("" if none).

    Raises:
        ConfigError: Bad policy or value, or an infeasible deadline or slowdown factor.

    """
    name, value = parse_policy(policy, value)
    points = frontier.pareto
    if not points:  # load_frontier refuses such a file; a Frontier built in code may be one.
        raise ConfigError(f"{frontier.out_dir / FRONTIER_CSV}: no plan that is not dominated")
    fastest = min(points, key=lambda p: (p.iteration_time, p.energy_with_p2p))
    base = frontier.allmax.iteration_time
    if name == "min-energy":
        return min(points, key=lambda p: (p.energy_with_p2p, p.iteration_time)), None, ""
    if name in ("no-slowdown", "max-slowdown"):
        factor = 1.0 if value is None else value
        limit = base * factor + rounding_allowance(frontier)
        point = _least_energy(points, limit)
        if point is None:
            raise ConfigError(
                f"{frontier.out_dir}: no plan within {limit:.6f} s ({name}); the fastest plan "
                f"{fastest.plan} takes {fastest.iteration_time:.6f} s, all-max {base:.6f} s"
            )
        note = ""
        if limit > base * factor + _EPS:
            note = (
                f"limit includes {limit - base * factor:.6f} s of time-quantization rounding "
                f"(bound {frontier.rounding_bound:.6f} s)"
            )
        return point, limit, note
    assert value is not None
    point = _least_energy(points, value)
    if point is not None:
        return point, value, ""
    if name == "deadline":
        raise ConfigError(
            f"deadline {value:.6f} s is infeasible: the fastest plan ({fastest.plan}) takes "
            f"{fastest.iteration_time:.6f} s"
        )
    return (
        fastest,
        value,
        f"the straggler ({value:.6f} s) is faster than every plan: using the fastest plan",
    )


def choose_plan(
    frontier_dir: str | Path | Frontier, policy: str, value: float | None = None
) -> ChosenPlan:
    """Choose a plan from a planner output folder.

    Args:
        frontier_dir: The folder ``perseus optimize`` wrote (or an already loaded Frontier).
        policy: One of :data:`POLICIES`, optionally with its value (``"max-slowdown 1.05"``).
        value: The policy's value, if not in ``policy``.

    Raises:
        ConfigError: Missing ``frontier.csv``, bad policy or value, infeasible deadline or
            slowdown factor.

    """
    frontier = frontier_dir if isinstance(frontier_dir, Frontier) else load_frontier(frontier_dir)
    name, value = parse_policy(policy, value)
    point, limit, note = select_point(frontier, name, value)
    ref = frontier.allmax
    saving = ref.energy_with_p2p - point.energy_with_p2p
    return ChosenPlan(
        policy=name,
        value=value,
        plan=point.plan,
        file=frontier.path(point),
        iteration_time=point.iteration_time,
        energy=point.energy,
        energy_with_p2p=point.energy_with_p2p,
        allmax_time=ref.iteration_time,
        allmax_energy=ref.energy_with_p2p,
        saving_j=saving,
        saving_pct=100.0 * saving / ref.energy_with_p2p if ref.energy_with_p2p else 0.0,
        slowdown_pct=100.0 * (point.iteration_time / ref.iteration_time - 1.0)
        if ref.iteration_time
        else 0.0,
        limit=limit,
        note=note,
    )
