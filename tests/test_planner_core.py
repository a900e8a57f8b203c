"""The planner's own core against lowtime 0.3, against brute force, and python against native.

Equality with lowtime: both solvers take the same :class:`CoreProblem` (same candidate options,
same cost model objects), so each frontier must have as many points, the same quantized
iteration times and the same model energy (the cost the solver minimises) within 1e-9
relative. Clocks may differ where two minimum cuts tie: lowtime's max-flow runs in floating
point and treats a residual of exactly one ``FP_ERROR`` unit sometimes as zero, while the core's
integer flow always takes the smallest minimum cut. Such a tie costs the same model energy at
that point (checked), but the plans run different clocks, so their *profiled* energies differ;
the test counts those points, says so when there are any, and compares profiled energies where
the clocks agree.

Brute force: with exact profiles (one option per whole time unit, costs on a convex curve), each
frontier point's model energy equals the least total cost of any assignment of durations whose
longest path is at most that point's time.
"""

from __future__ import annotations

import itertools
import math

import pytest

from protocol.exceptions import ConfigError
from schedulers.planning import native, pd_core
from schedulers.planning.core_problem import CoreProblem, CoreResult, build_problem
from schedulers.planning.cost_model import FP_ERROR, CostTable, LinearCost
from schedulers.planning.frontier_compute import compute_frontier, resolve_solver
from schedulers.planning.lowtime_ref import LowtimePanicError, solve_lowtime
from schedulers.planning.maxflow import InfeasibleFlowError
from schedulers.planning.pipeline_dag import PipelineShape
from schedulers.planning.profile_csv import ProfileRow, build_profile
from schedulers.planning.synthetic_profile import synthetic_profile

needs_native = pytest.mark.skipif(not native.available(), reason="C kernel not built")


def problem_of(
    stages: int, micro: int, *, unit: float, p2p: float = 0.0, schedule: str = "1f1b", **synth
) -> CoreProblem:
    profile = synthetic_profile(stages, **synth)
    shape = PipelineShape(stages, micro, schedule)
    return build_problem(profile, shape, unit_time=unit, p2p_power=p2p)


def compare_with_lowtime(core: CoreResult, ref: CoreResult) -> int:
    """Assert the frontiers agree (module docstring); return the points whose clocks differ."""
    assert core.num_points == ref.num_points
    assert core.quant_times == ref.quant_times
    ties = 0
    for k in range(ref.num_points):
        assert core.model_costs[k] == pytest.approx(ref.model_costs[k], rel=1e-9, abs=0), k
        if core.options_at(k) == ref.options_at(k):
            assert core.energies[k] == pytest.approx(ref.energies[k], rel=1e-9, abs=0), k
            assert core.makespans[k] == pytest.approx(ref.makespans[k], rel=1e-9, abs=0), k
        else:
            ties += 1
    return ties


CASES = {
    "2x2 synthetic": dict(stages=2, micro=2, unit=0.001, stride=20),
    "3x4 jitter 5%": dict(stages=3, micro=4, unit=0.003, stride=4, jitter=0.05, seed=3),
    "4x6 P2P 40 W": dict(stages=4, micro=6, unit=0.002, p2p=40.0, stride=4, jitter=0.03),
    "4x8 synthetic 1 ms": dict(stages=4, micro=8, unit=0.001, stride=4),
    "5x5 jitter 8% 6 ms": dict(stages=5, micro=5, unit=0.006, stride=6, jitter=0.08, seed=2),
    "4x6 GPipe jitter 3%": dict(stages=4, micro=6, unit=0.002, schedule="gpipe", jitter=0.03),
    # The profile: non-convex interpolated models, on which raw lowtime panics.
    "8x16 jitter 3% 4 ms": dict(stages=8, micro=16, unit=0.004, stride=4, jitter=0.03),
}


@pytest.mark.parametrize("case", list(CASES))
def test_frontier_equals_lowtime(case: str, record_property) -> None:
    spec = dict(CASES[case])
    problem = problem_of(spec.pop("stages"), spec.pop("micro"), **spec)
    ref = solve_lowtime(problem)
    core = pd_core.solve(problem)
    ties = compare_with_lowtime(core, ref)
    record_property("points_with_other_clocks_at_equal_model_energy", ties)
    if ties:  # Shown with -s; GPipe's symmetric stages tie most often.
        print(f"{case}: {ties} of {ref.num_points} points tie in model energy with other clocks")
    assert core.stop == "a dependency or the source/sink is on the cut"
    assert ref.num_points > 10


@needs_native
@pytest.mark.parametrize(
    "case", ["3x4 jitter 5%", "4x6 P2P 40 W", "4x6 GPipe jitter 3%", "8x16 jitter 3% 4 ms"]
)
def test_native_equals_python_exactly(case: str) -> None:
    spec = dict(CASES[case])
    problem = problem_of(spec.pop("stages"), spec.pop("micro"), **spec)
    a, b = pd_core.solve(problem), native.solve_native(problem)
    for name in ("quant_times", "model_costs", "energies", "time_sums", "makespans"):
        assert getattr(a, name) == getattr(b, name), name
    assert a.initial == b.initial and a.deltas == b.deltas and a.stop == b.stop


@needs_native
def test_native_reports_progress_and_releases_nothing_on_error() -> None:
    problem = problem_of(3, 4, unit=0.002, stride=4)
    seen: list[tuple[int, int]] = []
    result = native.solve_native(problem, lambda k, q: seen.append((k, q)))
    assert seen[0] == (0, result.quant_times[0]) and seen[-1][0] == result.num_points - 1

    def boom(k: int, q: int) -> None:
        if k:
            raise KeyError("stop here")

    with pytest.raises(KeyError, match="stop here"):
        native.solve_native(problem, boom)


# ---- brute force on exact profiles ----

U = 0.01
CLOCKS = [1980, 1800, 1600, 1400]


def exact_problem(spec: dict, stages: int, micro: int) -> CoreProblem:
    rows = []
    for (stage, inst), (qs, a, b, c) in spec.items():
        for k, q in enumerate(qs):
            energy = a * math.exp(b * q) + c
            rows.append(ProfileRow(stage, inst, CLOCKS[k], (q + 0.5) * U, energy))
    return build_problem(build_profile(rows), PipelineShape(stages, micro), unit_time=U)


def brute_force(problem: CoreProblem) -> dict[int, float]:
    """Least model cost per longest path, over every assignment of whole durations."""
    shape = problem.shape
    tables = [problem.tables[t] for t in problem.node_table]
    best: dict[int, float] = {}
    for durations in itertools.product(*(range(t.min_d, t.max_d + 1) for t in tables)):
        time = int(shape.makespan(durations))
        cost = sum(t.cost[d - t.min_d] for t, d in zip(tables, durations, strict=True))
        if cost < best.get(time, math.inf):
            best[time] = cost
    return best


EXACT = {
    "2x2": (
        {
            (0, "forward"): (range(10, 14), 30.0, -0.25, 2.0),
            (0, "backward"): (range(20, 23), 60.0, -0.15, 4.0),
            (1, "forward"): (range(14, 18), 40.0, -0.2, 3.0),
            (1, "backward"): (range(28, 31), 80.0, -0.1, 5.0),
        },
        2,
        2,
    ),
    "3x2": (
        {
            (0, "forward"): (range(10, 12), 20.0, -0.3, 1.0),
            (0, "backward"): (range(18, 20), 30.0, -0.2, 2.0),
            (1, "forward"): (range(13, 15), 25.0, -0.3, 1.0),
            (1, "backward"): (range(25, 27), 40.0, -0.2, 2.0),
            (2, "forward"): (range(8, 10), 15.0, -0.3, 1.0),
            (2, "backward"): (range(16, 18), 20.0, -0.2, 2.0),
        },
        3,
        2,
    ),
}


@pytest.mark.parametrize("name", list(EXACT))
@pytest.mark.parametrize("solver", ["python", "native"])
def test_exact_frontier_matches_brute_force(name: str, solver: str) -> None:
    if solver == "native" and not native.available():
        pytest.skip("C kernel not built")
    problem = exact_problem(*EXACT[name])
    result = pd_core.solve(problem) if solver == "python" else native.solve_native(problem)
    best = brute_force(problem)
    assert result.quant_times[0] == max(best) and result.quant_times[-1] == min(best)
    assert result.quant_times == list(range(max(best), min(best) - 1, -1))
    for q, cost in zip(result.quant_times, result.model_costs, strict=True):
        assert cost == pytest.approx(min(c for t, c in best.items() if t <= q), rel=1e-9)


def plateau_problem(stages: int, micro: int) -> CoreProblem:
    """Energy flattens at the slow end: the first speed-ups cost under FP_ERROR (1e-6 J)."""
    rows = [
        ProfileRow(stage, inst, clock, (q + 0.5) * U, energy)
        for stage in range(stages)
        for inst in ("forward", "backward")
        for clock, q, energy in ((1980, 2, 10.0), (1500, 4, 2.0), (1000, 6, 2.0 - 1e-6))
    ]
    return build_problem(build_profile(rows), PipelineShape(stages, micro), unit_time=U)


@pytest.mark.parametrize("solver", ["python", "native"])
@pytest.mark.parametrize("shape", [(1, 1), (2, 2)])
def test_nearly_free_speed_ups_do_not_end_the_frontier(shape: tuple, solver: str) -> None:
    # Speeding up from the slowest clock saves time for 5e-7 J per unit; the solver stopped
    # there ("cost change below FP_ERROR", as lowtime), so the frontier was its slowest plan.
    if solver == "native" and not native.available():
        pytest.skip("C kernel not built")
    problem = plateau_problem(*shape)
    result = pd_core.solve(problem) if solver == "python" else native.solve_native(problem)
    best = brute_force(problem)
    assert result.quant_times == list(range(max(best), min(best) - 1, -1)), result.stop
    # Flow bounds are whole FP_ERROR units: slopes below one unit cannot be told apart.
    slack = problem.num_nodes * FP_ERROR
    for q, cost in zip(result.quant_times, result.model_costs, strict=True):
        assert cost == pytest.approx(min(c for t, c in best.items() if t <= q), abs=slack)


# ---- non-convex cost models ----


def without_hull(problem: CoreProblem) -> tuple[CoreProblem, int]:
    """The same problem with straight lines through *every* option (not the hull)."""
    changed = 0
    for t, table in enumerate(problem.tables):
        if problem.fits[f"{problem.keys[t][0]}/{problem.keys[t][1]}"].get("hull_dropped"):
            points = [(o.quant_time, o.cost) for o in table.options]
            problem.tables[t] = CostTable(table.options, LinearCost(points))
            changed += 1
    return problem, changed


def test_non_convex_profile_uses_the_hull_and_raw_lowtime_panic_is_a_config_error() -> None:
    spec = dict(CASES["8x16 jitter 3% 4 ms"])
    problem = problem_of(spec.pop("stages"), spec.pop("micro"), **spec)
    hulled = [k for k, fit in problem.fits.items() if fit.get("hull_dropped")]
    assert hulled, "the issue's profile has non-convex interpolations"
    for table in problem.tables:
        steps = [b - a for a, b in itertools.pairwise(table.cost)]
        assert all(x <= y + 1e-12 for x, y in itertools.pairwise(steps)), "convex"
    raw, changed = without_hull(problem)
    assert changed == len(hulled)
    with pytest.raises(LowtimePanicError, match="panicked") as info:
        solve_lowtime(raw)
    assert isinstance(info.value, ConfigError)
    with pytest.raises(InfeasibleFlowError, match="not convex"):
        pd_core.solve(raw)


def test_solver_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_solver("python") == "python" and resolve_solver("lowtime") == "lowtime"
    with pytest.raises(ConfigError, match="unknown solver"):
        resolve_solver("rust")
    monkeypatch.setattr(native, "_kernel", None)
    assert resolve_solver("auto") == "python"
    with pytest.raises(ConfigError, match="not built"):
        resolve_solver("native")


@pytest.mark.parametrize("unit_time", [1e-12, 1e-300])
def test_a_unit_time_past_the_cores_integers_is_refused_with_one_that_fits(unit_time) -> None:
    # One clock per instruction passes the table-width check at any unit; 0.01 s in 1e-12 s
    # units (1e10) or in 1e-300 s units ended the native core in OverflowError.
    rows = [ProfileRow(0, "forward", 1500, 0.01, 5.0), ProfileRow(0, "backward", 1500, 3.0, 9.0)]
    profile = build_profile(rows)
    for solver in ("auto", "python"):
        with pytest.raises(ConfigError, match="is too fine: stage 0 forward") as refused:
            compute_frontier(profile, 1, 2, unit_time=unit_time, solver=solver)
    suggested = float(str(refused.value).rsplit("at least ", 1)[1].split()[0])
    frontier = compute_frontier(profile, 1, 2, unit_time=suggested)
    assert frontier.points[-1].iteration_time == pytest.approx(2 * 3.01)  # The longest fits too
