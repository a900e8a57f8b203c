"""Execution options and cost models of one ``(stage, instruction)``, as lowtime defines them.

The planner core (:mod:`schedulers.planning.pd_core`) and the lowtime reference both take their
inputs from here, so that the two solve exactly the same problem:

* :func:`candidate_options` keeps the options lowtime's ``CandidateExecutionOptions`` keeps:
  drop an option when another is strictly faster *and* strictly cheaper, then keep one option
  per quantized time (the costliest, whose real time is nearest the rounded one), slowest first.
  Quantized time is ``int(real_time // unit_time)``.
* :func:`fit_cost_model` fits lowtime's exponential model ``a * exp(b * q) + c`` with the same
  grid of initial guesses, in the same order, through ``scipy.optimize.curve_fit`` (so the
  coefficients are lowtime's to the bit), and falls back to straight lines between the options
  where fewer than four quantized times are left or the fit fails or increases with time.
* **Non-convex costs.** The straight-line model takes the *lower convex hull* of the options'
  ``(quantized time, cost)`` points: an option above the hull (a measurement that makes the
  curve bend the wrong way, e.g. a noisy profile) is still a clock the plan may use, but the
  model passes below it. A non-convex model would give the solver an edge whose lower flow
  bound exceeds its upper one, which lowtime answers with a Rust panic. The exponential model
  is convex by construction (``a >= 0``). ``report["hull_dropped"]`` counts the options off
  the hull.
* :class:`CostTable` tabulates a model at every whole duration between the fastest and the
  slowest option, with the flow bounds of lowtime's ``annotate_capacities`` as exact integers
  in units of ``FP_ERROR`` (lowtime rounds them down to multiples of it before its max-flow).
"""

from __future__ import annotations

import bisect
import itertools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: lowtime's ``FP_ERROR``: flow bounds are multiples of it; a smaller step ends the solver.
FP_ERROR = 1e-6
#: lowtime's stand-in for an unbounded flow capacity (``annotate_capacities``), J.
INF_COST = 10000.0
#: :data:`INF_COST` in units of :data:`FP_ERROR`, as lowtime rounds it.
INF_UNITS = int(INF_COST // FP_ERROR)


@dataclass(frozen=True)
class ExecOption:
    """One way to run an instruction: a clock and what it costs.

    Attributes:
        knob: The clock, MHz.
        real_time: Measured time, s.
        cost: Effective energy, J (what the solver minimises).
        quant_time: ``int(real_time // unit_time)``.

    """

    knob: int
    real_time: float
    cost: float
    quant_time: int


def candidate_options(
    entries: Sequence[tuple[int, float, float]], unit_time: float
) -> list[ExecOption]:
    """Filter ``(knob, real_time, cost)`` entries as lowtime does; slowest option first.

    Raises:
        ValueError: No entry.

    """
    if not entries:
        raise ValueError("an instruction needs at least one execution option")
    options = [ExecOption(k, t, c, int(t // unit_time)) for k, t, c in entries]
    by_time = sorted(options, key=lambda o: o.real_time, reverse=True)
    pareto = [
        o
        for o in by_time
        if not any(p.real_time < o.real_time and p.cost < o.cost for p in by_time)
    ]
    pareto.sort(key=lambda o: o.cost, reverse=True)
    kept: list[ExecOption] = []
    seen: set[int] = set()
    for o in pareto:
        if o.quant_time not in seen:
            seen.add(o.quant_time)
            kept.append(o)
    kept.sort(key=lambda o: o.quant_time, reverse=True)
    return kept


class ExponentialCost:
    """``a * exp(b * q) + c``, evaluated exactly as lowtime's ``ExponentialModel`` does."""

    def __init__(self, coefficients: Sequence[Any]) -> None:
        self.coefficients = tuple(coefficients)

    def __call__(self, quant_time: int) -> float:
        """Cost at ``quant_time`` (numpy scalar arithmetic, as lowtime)."""
        import numpy as np  # numpy's scalar exp, not math.exp: the same bits as lowtime

        a, b, c = self.coefficients
        return float(a * np.exp(b * quant_time) + c)


class LinearCost:
    """Straight lines between ``(quantized time, cost)`` points; the end values outside them."""

    def __init__(self, points: Sequence[tuple[int, float]]) -> None:
        self.points = sorted(points)

    def __call__(self, quant_time: int) -> float:
        """Cost at ``quant_time``."""
        pts = self.points
        if quant_time <= pts[0][0]:
            return pts[0][1]
        for (t0, c0), (t1, c1) in itertools.pairwise(pts):
            if quant_time <= t1:
                return c0 + (c1 - c0) * (quant_time - t0) / (t1 - t0)
        return pts[-1][1]


def lower_convex_hull(points: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """The points on the lower convex hull, by increasing time (collinear points dropped).

    Args:
        points: ``(time, cost)`` with distinct times.

    """
    hull: list[tuple[int, float]] = []
    for p in sorted(points):
        # Pop the last point while it lies on or above the segment from its predecessor to p.
        while len(hull) >= 2:
            (x0, y0), (x1, y1) = hull[-2], hull[-1]
            if (y1 - y0) * (p[0] - x0) >= (p[1] - y0) * (x1 - x0):
                hull.pop()
            else:
                break
        hull.append(p)
    return hull


def _l2_error(fn: Callable[..., Any], times: Any, costs: Any, coefficients: Any) -> float:
    import numpy as np  # lowtime computes its fit error with numpy

    preds = np.array([fn(t, *coefficients) for t in times])
    return float(np.mean(np.square(costs - preds)).item())


def fit_exponential(options: Sequence[ExecOption], unit_time: float) -> tuple[Any, Any, Any]:
    """Fit ``a * exp(b * q) + c`` with lowtime's grid search (strategy "first").

    Raises:
        ValueError: No initial guess fits.
        RuntimeError: ``curve_fit`` gave up (as lowtime, this is not caught per guess).

    """
    import numpy as np
    from scipy.optimize import curve_fit  # scipy: only when fitting

    def fn(t: Any, a: Any, b: Any, c: Any) -> Any:
        return a * np.exp(b * t) + c

    times = np.array([o.quant_time for o in options])
    costs = np.array([o.cost for o in options])
    a_grid = [1e1, 1e2, 1e3]
    b_grid = [-c * unit_time / 0.001 for c in (0.01, 0.02, 0.03, 0.04, 0.05, 0.1)]
    c_grid = [1e1, 1e2, 1e3]
    for guess in itertools.product(a_grid, b_grid, c_grid):
        coefficients, pcov = curve_fit(fn, times, costs, p0=list(guess), maxfev=50000)
        if np.inf in pcov:
            continue
        if _l2_error(fn, times, costs, coefficients) == np.inf or coefficients[0] < 0.0:
            continue
        return coefficients[0], coefficients[1], coefficients[2]
    raise ValueError("Nothing in the grid search space was able to fit.")


def fit_cost_model(
    options: Sequence[ExecOption], unit_time: float
) -> tuple[Callable[[int], float], dict[str, Any]]:
    """Fit the cost model of one instruction's candidate options; return it and a report.

    The report holds ``model`` (``exponential`` or ``interpolated``), ``options``, the
    ``coefficients`` or the ``fit_error``, ``hull_dropped`` and the largest errors of the model
    at the options.
    """
    points = [(o.quant_time, o.cost) for o in options]
    report: dict[str, Any] = {"options": len(points)}
    model: Callable[[int], float] | None = None
    if len(points) >= 4:  # Three parameters: three points leave no covariance.
        try:
            with warnings.catch_warnings():  # The grid search tries (and warns about) bad guesses.
                warnings.simplefilter("ignore")
                coefficients = fit_exponential(options, unit_time)
            model = ExponentialCost(coefficients)
            report["model"] = "exponential"
            report["coefficients"] = [float(c) for c in coefficients]
        except (ValueError, RuntimeError, TypeError) as exc:
            report["fit_error"] = str(exc)
        if model is not None:
            lo, hi = min(p[0] for p in points), max(p[0] for p in points)
            if not model(lo) >= model(hi):  # Slower must not cost more.
                report["fit_error"] = "fitted model increases with time"
                model = None
    if model is None:
        hull = lower_convex_hull(points)
        model = LinearCost(hull)
        report["model"] = "interpolated"
        report["hull_dropped"] = len(points) - len(hull)
    errors = [abs(model(t) - c) for t, c in points]
    scale = max(abs(c) for _, c in points) or 1.0
    report["max_abs_error"] = max(errors)
    report["max_rel_error"] = max(errors) / scale
    return model, report


def _units(value: float) -> int:
    """``value // FP_ERROR`` as an integer: lowtime's rounding of a flow bound."""
    return int(value // FP_ERROR)


class CostTable:
    """A cost model tabulated at every duration from the fastest to the slowest option.

    Attributes:
        options: The candidate options, slowest first.
        model: The cost model.
        min_d: Fastest quantized duration.
        max_d: Slowest quantized duration.
        cost: ``cost[d - min_d]``: the model's cost at duration ``d``.
        option_at: ``option_at[d - min_d]``: index in ``options`` of the slowest option that
            fits in ``d`` (lowtime's ``get_knob_for``).
        lb: ``lb[d - min_d]``: lower flow bound at ``d`` in ``FP_ERROR`` units.
        ub: ``ub[d - min_d]``: upper flow bound at ``d`` in ``FP_ERROR`` units.

    """

    def __init__(self, options: Sequence[ExecOption], model: Callable[[int], float]) -> None:
        self.options = list(options)
        self.model = model
        times = [o.quant_time for o in self.options]
        self.min_d, self.max_d = min(times), max(times)
        span = range(self.min_d, self.max_d + 1)
        self.cost = [float(model(d)) for d in span]
        ascending = sorted(times)
        self.option_at = []
        for d in span:
            i = max(1, bisect.bisect_right(ascending, d))
            self.option_at.append(times.index(ascending[i - 1]))
        self.lb: list[int] = []
        self.ub: list[int] = []
        for d in span:
            lb, ub = self._bounds(d, model)
            self.lb.append(lb)
            self.ub.append(ub)

    def _bounds(self, d: int, model: Callable[[int], float]) -> tuple[int, int]:
        """Flow bounds at duration ``d`` (lowtime's ``annotate_capacities``)."""
        if d == self.min_d == self.max_d:
            return _units(0.0), _units(INF_COST)
        if d - 1 < self.min_d:  # Cannot be sped up.
            return _units(abs(model(d) - model(d + 1))), _units(INF_COST)
        if d + 1 > self.max_d:  # Cannot be slowed down.
            return _units(0.0), _units(abs(model(d - 1) - model(d)))
        # As lowtime: give an (almost) linear model some room.
        lb = abs(model(d) - model(d + 1))
        ub = abs(model(d - 1) - model(d)) + FP_ERROR
        return _units(lb), _units(ub)
