"""Candidate options, cost models and flow bounds: the same as lowtime's, to the bit.

lowtime is the reference here: each test builds lowtime's own objects from the same inputs and
compares. The lower convex hull (what the planner does with a non-convex interpolation) is
checked against its definition.
"""

from __future__ import annotations

import itertools
import random

import networkx as nx
import pytest

from schedulers.planning.cost_model import (
    FP_ERROR,
    INF_UNITS,
    CostTable,
    ExponentialCost,
    LinearCost,
    candidate_options,
    fit_cost_model,
    fit_exponential,
    lower_convex_hull,
)
from schedulers.planning.synthetic_profile import synthetic_rows


def entries(seed: int, jitter: float) -> list[tuple[int, float, float]]:
    """``(knob, time, cost)`` of one instruction of a jittered synthetic profile."""
    rows = synthetic_rows(1, stride=3, jitter=jitter, seed=seed)
    return [(r.frequency, r.time, r.energy) for r in rows if r.instruction == "backward"]


def lowtime_candidates(items: list[tuple[int, float, float]], unit: float):
    from lowtime.operation import CandidateExecutionOptions, ExecutionOption

    options = [ExecutionOption(real_time=t, unit_time=unit, cost=c, knob=k) for k, t, c in items]
    return CandidateExecutionOptions(options=options)


@pytest.mark.parametrize(
    ("seed", "jitter", "unit"), [(0, 0.0, 0.001), (1, 0.05, 0.002), (2, 0.1, 0.004)]
)
def test_candidate_options_are_lowtimes(seed: int, jitter: float, unit: float) -> None:
    items = entries(seed, jitter)
    ours = candidate_options(items, unit)
    theirs = lowtime_candidates(items, unit).options
    assert [(o.knob, o.quant_time, o.cost) for o in ours] == [
        (o.knob, o.quant_time, o.cost) for o in theirs
    ]
    assert len(ours) < len(items)  # Something was filtered.


@pytest.mark.parametrize(
    ("seed", "jitter", "unit"), [(0, 0.0, 0.001), (1, 0.03, 0.001), (4, 0.02, 0.002)]
)
def test_exponential_fit_is_lowtimes(seed: int, jitter: float, unit: float) -> None:
    from lowtime.cost_model import ExponentialModel

    items = entries(seed, jitter)
    ours = candidate_options(items, unit)
    assert len(ours) >= 4
    coefficients = fit_exponential(ours, unit)
    reference = ExponentialModel(lowtime_candidates(items, unit))
    assert tuple(float(c) for c in coefficients) == tuple(float(c) for c in reference.coefficients)
    model = ExponentialCost(coefficients)
    for o in ours:
        assert model(o.quant_time) == float(reference(o.quant_time))


def test_flow_bounds_are_lowtimes_annotate_capacities() -> None:
    from lowtime.operation import Operation, OperationSpec
    from lowtime.solver import PhillipsDessouky

    unit = 0.001
    items = entries(1, 0.03)
    options = candidate_options(items, unit)
    model, report = fit_cost_model(options, unit)
    assert report["model"] == "exponential"
    table = CostTable(options, model)
    annotate = PhillipsDessouky.__new__(PhillipsDessouky)
    annotate.attr_name = "op"
    op = Operation(spec=OperationSpec(options=lowtime_candidates(items, unit), cost_model=model))
    for d in range(table.min_d, table.max_d + 1):
        op.duration = d
        dag = nx.DiGraph()
        dag.add_edge(0, 1, op=op)
        annotate.annotate_capacities(dag)
        k = d - table.min_d
        assert dag[0][1]["lb"] == table.lb[k] * FP_ERROR
        assert dag[0][1]["ub"] == table.ub[k] * FP_ERROR
        assert options[table.option_at[k]].knob == op.assigned_knob
    assert table.ub[0] == INF_UNITS and table.lb[-1] == 0


def test_lower_convex_hull() -> None:
    rng = random.Random(7)
    for _ in range(200):
        xs = sorted(rng.sample(range(30), rng.randint(1, 8)))
        points = [(x, rng.uniform(0, 10)) for x in xs]
        hull = lower_convex_hull(points)
        assert hull[0] == points[0] and hull[-1] == points[-1] and set(hull) <= set(points)
        slopes = [(y1 - y0) / (x1 - x0) for (x0, y0), (x1, y1) in itertools.pairwise(hull)]
        assert all(a < b for a, b in itertools.pairwise(slopes))  # Strictly convex.
        line = LinearCost(hull)
        assert all(line(x) <= y + 1e-12 for x, y in points)  # Below every point.


def test_non_convex_interpolation_takes_the_hull() -> None:
    # Three quantized times (too few for the exponential fit); the middle point bulges up.
    items = [(1980, 0.0101, 10.0), (1600, 0.0121, 9.8), (1200, 0.0141, 5.0)]
    options = candidate_options(items, 0.002)
    model, report = fit_cost_model(options, 0.002)
    assert report["model"] == "interpolated" and report["hull_dropped"] == 1
    table = CostTable(options, model)
    steps = [b - a for a, b in itertools.pairwise(table.cost)]
    assert all(x <= y for x, y in itertools.pairwise(steps))
    assert all(lb <= ub for lb, ub in zip(table.lb, table.ub, strict=True))
    # The clock above the hull is still a plan's choice at its own duration.
    assert [options[i].knob for i in table.option_at] == [1980, 1600, 1200]
