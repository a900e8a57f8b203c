"""The frontier in memory: fit, solve, and turn the solver's steps into frontier points.

:func:`compute_frontier` is everything :func:`~schedulers.planning.planner.plan_frontier` does
except writing files; ``FrontierScheduler`` uses it directly to plan from a profile inside an
rq task. The solvers (``solver=``) compute the same frontier:

* ``native``: the C kernel (:mod:`schedulers.planning.native`), built at install when a C
  compiler is present;
* ``python``: the same algorithm in pure Python (:mod:`schedulers.planning.pd_core`);
* ``lowtime``: lowtime 0.3 itself (:mod:`schedulers.planning.lowtime_ref`), the reference,
  much slower (its cost grows as the square of the number of instructions);
* ``auto`` (default): ``native`` if built, else ``python``.
"""

from __future__ import annotations

import time as _time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.exceptions import ConfigError
from protocol.pipeline_schedules import DEFAULT_SCHEDULE, SCHEDULE_HEADER
from schedulers.planning import native, pd_core
from schedulers.planning.core_problem import CoreProblem, CoreResult, build_problem
from schedulers.planning.frontier_files import (
    ALLMAX,
    Frontier,
    FrontierPoint,
    mark_dominated,
    plan_file_name,
    plan_id,
)
from schedulers.planning.frontier_plans import PlanWriter, plan_header, plan_note
from schedulers.planning.pipeline_dag import MAX_INSTRUCTIONS, PipelineShape, check_instructions
from schedulers.planning.plan_file import PlanFile
from schedulers.planning.profile_csv import InstructionProfile

#: ``progress(fraction in [0, 1], message)``.
ProgressCallback = Callable[[float, str], None]
#: The solvers :func:`compute_frontier` takes.
SOLVERS = ("auto", "native", "python", "lowtime")


def emit(progress: ProgressCallback | None, fraction: float, message: str) -> None:
    """Report progress, clamped to ``[0, 1]``, if anyone listens."""
    if progress is not None:
        progress(min(1.0, max(0.0, fraction)), message)


def p2p_unset_note(option: str) -> str:
    """The warning for a plan made with the P2P blocking power left out (0 W).

    Zeus's ``run_optimization.py`` assumed 70 W there; 0 W is no measurement.

    Args:
        option: Where the power is set, as the user would write it (``--p2p-power``).
    """
    return (
        f"{option} not given: planning with 0 W while a GPU waits on its neighbour stage, so "
        "waiting counts as free and slower plans look cheaper than they are (Zeus's example "
        "assumed 70 W); measure it with `perseus profile-p2p`"
    )


def _quantize(t: float, unit_time: float) -> int:
    return int(t // unit_time)  # Same rounding as lowtime's ExecutionOption.quant_time.


#: What every ``iteration_time`` shown to users is (``frontier.json`` records it).
ITERATION_TIME_NOTE = (
    "longest dependency path with the profile's unrounded instruction times at the plan's "
    "clocks, seconds; the solver works in whole unit_time steps (quant_time): iteration_time "
    "exceeds quant_time * unit_time by less than rounding_bound, and may be well below it "
    "(each instruction runs at the slowest clock that fits its solver duration)"
)


@dataclass
class ComputedFrontier:
    """A frontier held in memory.

    Attributes:
        problem: The problem solved.
        result: The solver's answer.
        points: One frontier point per solver step, slowest first (``file`` names where the
            planner writes its plan).
        allmax: Every instruction at its highest profiled clock.
        solver: The solver that ran.
        p2p_power: P2P power the energies include, W.
        timings: ``fit_s`` and ``solve_s``.

    """

    problem: CoreProblem
    result: CoreResult
    points: list[FrontierPoint]
    allmax: FrontierPoint
    solver: str
    p2p_power: float
    timings: dict[str, float] = field(default_factory=dict)

    def frontier(self, out_dir: Path, meta: dict[str, Any] | None = None) -> Frontier:
        """The points as a :class:`Frontier` of folder ``out_dir``."""
        return Frontier(out_dir=out_dir, points=self.points, allmax=self.allmax, meta=meta or {})

    def base_meta(self) -> dict[str, Any]:
        """What ``frontier.json`` says about the run (what the choice policies read)."""
        shape = self.problem.shape
        longest = shape.max_path_length()
        return {
            "num_stages": shape.num_stages,
            "num_microbatches": shape.num_microbatches,
            SCHEDULE_HEADER: shape.schedule_name,
            "unit_time": self.problem.unit_time,
            "p2p_power": self.p2p_power,
            "num_plans": len(self.points),
            "num_dominated": sum(p.dominated for p in self.points),
            "iteration_time": ITERATION_TIME_NOTE,
            "solver": self.solver,
            "solver_stop": self.result.stop,
            "solver_stats": self.result.stats,
            "max_path_instructions": longest,
            "rounding_bound": longest * self.problem.unit_time,
        }

    def clocks(self, index: int) -> list[int]:
        """Clock per node of point ``index``."""
        options = self.result.options_at(index)
        return [self.problem.knob(v, o) for v, o in enumerate(options)]

    def plan(self, index: int, path: Path | None = None) -> PlanFile:
        """Point ``index`` as a plan (with the header its file would have)."""
        shape = self.problem.shape
        point = self.points[index]
        header = plan_header(
            point, unit_time=self.problem.unit_time, p2p_power=self.p2p_power, shape=shape
        )
        return PlanFile(
            stages=PlanWriter(shape, self.clocks(index)).stages(),
            header={k: str(v) for k, v in header.items()},
            notes=[plan_note(point.plan)],
            path=path,
        )


def resolve_solver(solver: str) -> str:
    """The solver ``solver`` names (``auto`` becomes ``native`` or ``python``).

    Raises:
        ConfigError: Unknown solver, or ``native`` without the compiled kernel.

    """
    if solver not in SOLVERS:
        raise ConfigError(f"unknown solver {solver!r}; use one of {', '.join(SOLVERS)}")
    if solver == "auto":
        return "native" if native.available() else "python"
    if solver == "native" and not native.available():
        raise ConfigError(
            "the compiled planner core is not built (no C compiler when perseus-mq was "
            "installed); reinstall with gcc present, or use --solver python"
        )
    return solver


def solve_problem(
    problem: CoreProblem, solver: str = "auto", progress: pd_core.CoreProgress | None = None
) -> CoreResult:
    """Run one solver on a problem (see the module docstring for the solvers).

    Raises:
        ConfigError: Unknown or unavailable solver, or no feasible flow (lowtime's panic
            included).

    """
    name = resolve_solver(solver)
    if name == "native":
        return native.solve_native(problem, progress)
    if name == "lowtime":
        from schedulers.planning.lowtime_ref import solve_lowtime  # lowtime: ~1 s to import

        return solve_lowtime(problem, progress)
    return pd_core.solve(problem, progress)


def compute_frontier(
    profile: InstructionProfile,
    num_stages: int,
    num_microbatches: int,
    *,
    p2p_power: float = 0.0,
    unit_time: float = 0.001,
    solver: str = "auto",
    progress: ProgressCallback | None = None,
    schedule: str = DEFAULT_SCHEDULE,
    max_instructions: int = MAX_INSTRUCTIONS,
) -> ComputedFrontier:
    """Fit the cost models and compute every frontier point (progress from 0 to 0.9).

    ``max_instructions`` bounds ``2 * num_stages * num_microbatches``, checked first
    (:func:`~schedulers.planning.pipeline_dag.check_instructions`).

    Raises:
        ConfigError: Bad arguments, a pipeline of more than ``max_instructions``
            instructions, a profile that does not cover the pipeline, or a solver failure.

    """
    check_instructions(num_stages, num_microbatches, max_instructions)
    if not unit_time > 0:
        raise ConfigError(f"unit time must be positive, got {unit_time}")
    if not p2p_power >= 0:
        raise ConfigError(f"P2P power must not be negative, got {p2p_power}")
    solver_name = resolve_solver(solver)
    profile.check_stages(num_stages)
    shape = PipelineShape(num_stages, num_microbatches, schedule)
    timings: dict[str, float] = {}
    started = _time.perf_counter()
    emit(progress, 0.0, "fitting cost models")
    problem = build_problem(profile, shape, unit_time=unit_time, p2p_power=p2p_power)
    timings["fit_s"] = _time.perf_counter() - started

    slow_q = int(shape.makespan([problem.tables[t].max_d for t in problem.node_table]))
    fast_q = int(shape.makespan([problem.tables[t].min_d for t in problem.node_table]))
    span = max(1, slow_q - fast_q)

    def on_step(index: int, quant_time: int) -> None:
        emit(
            progress,
            0.05 + 0.85 * (slow_q - quant_time) / span,
            f"solver step {index}: {quant_time * unit_time:.4f} s in whole units "
            f"(fastest possible {fast_q * unit_time:.4f} s)",
        )

    emit(progress, 0.05, f"solving ({solver_name})")
    t0 = _time.perf_counter()
    result = solve_problem(problem, solver_name, on_step)
    timings["solve_s"] = _time.perf_counter() - t0
    points = [
        FrontierPoint(
            plan=plan_id(k),
            iteration_time=result.makespans[k],
            energy=result.energies[k],
            energy_with_p2p=result.energies[k]
            + p2p_power * max(0.0, num_stages * result.makespans[k] - result.time_sums[k]),
            quant_time=result.quant_times[k],
            model_cost=result.model_costs[k],
            file=plan_file_name(k),
        )
        for k in range(result.num_points)
    ]
    points = mark_dominated(points, repeated_plans(problem, result, points))
    # Reference: every instruction at its highest profiled clock, as without Perseus.
    max_clock = {key: max(tab) for key, tab in profile.table.items()}
    allmax = _evaluate(
        ALLMAX,
        [max_clock[(s, i)] for s, i, _ in shape.nodes],
        shape,
        profile,
        p2p_power,
        unit_time,
    )
    return ComputedFrontier(problem, result, points, allmax, solver_name, p2p_power, timings)


def repeated_plans(
    problem: CoreProblem, result: CoreResult, points: list[FrontierPoint]
) -> set[int]:
    """Indices of points whose clocks are an earlier point's, exactly.

    The solver's steps are in whole time units; two steps can round to the same clocks (and so
    the same time and energies, with different ``quant_time``). Only points equal in time and
    energies are compared, by clocks.
    """

    def same(p: FrontierPoint) -> tuple[float, float, float]:
        return (p.iteration_time, p.energy, p.energy_with_p2p)

    counts = Counter(same(p) for p in points)
    seen: dict[tuple[float, float, float], set[tuple[int, ...]]] = {}
    out: set[int] = set()
    options = list(result.initial)
    for k, point in enumerate(points):
        for node, option in result.deltas[k]:
            options[node] = option
        if counts[same(point)] > 1:
            clocks = tuple(problem.knob(v, o) for v, o in enumerate(options))
            earlier = seen.setdefault(same(point), set())
            if clocks in earlier:
                out.add(k)
            earlier.add(clocks)
    return out


def _evaluate(
    plan: str,
    knobs: list[int],
    shape: PipelineShape,
    profile: InstructionProfile,
    p2p_power: float,
    unit_time: float,
) -> FrontierPoint:
    """Time and energy of a plan (clock per node) from the profile (the ``allmax`` row)."""
    table = profile.table
    times = [table[(s, i)][k][0] for (s, i, _), k in zip(shape.nodes, knobs, strict=True)]
    energy = sum(table[(s, i)][k][1] for (s, i, _), k in zip(shape.nodes, knobs, strict=True))
    real = shape.makespan(times)
    quant_time = int(shape.makespan([_quantize(t, unit_time) for t in times]))
    # Each stage idles (blocked on P2P) for the part of the iteration it does not compute.
    blocked = max(0.0, shape.num_stages * real - sum(times))
    return FrontierPoint(
        plan=plan,
        iteration_time=real,
        energy=energy,
        energy_with_p2p=energy + p2p_power * blocked,
        quant_time=quant_time,
        model_cost=None,
        file="" if plan == ALLMAX else plan_file_name(int(plan)),
    )
