"""Compute every Pareto-optimal frequency plan of a pipeline (Perseus step 2).

Given an instruction profile (time and energy of each stage's forward and backward at each
clock), :func:`plan_frontier`

1. lays out the problem (:func:`~schedulers.planning.core_problem.build_problem`): per
   ``(stage, instruction)`` the Pareto-optimal clocks, lowtime's candidate options and cost
   model (exponential, or straight lines over the lower convex hull; see
   :mod:`schedulers.planning.cost_model`), on the DAG of the pipeline schedule (synchronous
   1F1B or GPipe, :mod:`schedulers.planning.pipeline_dag`);
2. runs the Phillips-Dessouky solver, which starts from every instruction at its slowest
   option and shortens the iteration by one time unit per step at the least added cost
   (``solver``: ``native``, ``python``, ``lowtime`` or ``auto``; see
   :mod:`schedulers.planning.frontier_compute`);
3. writes ``frontier.csv``/``frontier.json`` (see :mod:`schedulers.planning.frontier_files`),
   ``plans.delta`` (every plan's clocks as changes from the previous plan) and the plan files
   ``freqs_pipeline_%05d.py``: every one (``plans="all"``), or only those the ``no-slowdown``
   and ``min-energy`` policies choose (``plans="chosen"``; ``perseus choose`` writes any other
   from ``plans.delta`` when asked). Plan ``00000`` is the starting (slowest, least-energy)
   point and the solver's ``k``-th step is plan ``k``, so a larger number means a shorter
   iteration.

Times: the solver rounds each instruction's time *down* to whole units, so the real longest
path exceeds its quantized iteration time (``quant_time``) by less than ``L * unit_time``,
where ``L`` is the most instructions on any dependency path (``rounding_bound`` in
``frontier.json``). The other way there is no such bound: the solver's durations fall between
clocks, and each instruction runs at the slowest clock that fits its duration (lowtime's
``get_knob_for``), which can be much faster. Users see one time per plan, ``iteration_time``:
the real longest path with the profile's times at the plan's clocks (also for ``allmax``).
"""

from __future__ import annotations

import time as _time
from pathlib import Path
from typing import Any

from protocol.exceptions import ConfigError
from protocol.pipeline_schedules import DEFAULT_SCHEDULE
from schedulers.planning.choose import select_point
from schedulers.planning.core_problem import pareto_frequencies as pareto_frequencies
from schedulers.planning.cost_model import LinearCost
from schedulers.planning.frontier_compute import (
    SOLVERS,
    ComputedFrontier,
    ProgressCallback,
    compute_frontier,
    emit,
    resolve_solver,
    solve_problem,
)
from schedulers.planning.frontier_files import (
    ALLMAX_CSV,
    FRONTIER_CSV,
    FRONTIER_JSON,
    PLAN_PATTERN,
    PROFILE_CSV,
    Frontier,
    point_dict,
    remove_stale_outputs,
    write_allmax_csv,
    write_frontier_csv,
    write_frontier_json,
)
from schedulers.planning.frontier_plans import (
    PLAN_LOG,
    PlanWriter,
    plan_header,
    plan_note,
    write_plan_log,
)
from schedulers.planning.pipeline_dag import MAX_INSTRUCTIONS
from schedulers.planning.profile_csv import InstructionProfile
from schedulers.planning.profile_writer import write_profile_rows

#: Which plan files :func:`plan_frontier` writes.
PLAN_FILES = ("all", "chosen")
#: The policies whose plans ``plans="chosen"`` writes.
CHOSEN_POLICIES = ("no-slowdown", "min-energy")

#: Straight lines between points (the old name of :class:`~cost_model.LinearCost`).
InterpolatedCostModel = LinearCost


def plan_frontier(
    profile: InstructionProfile,
    num_stages: int,
    num_microbatches: int,
    *,
    out_dir: str | Path,
    p2p_power: float = 0.0,
    unit_time: float = 0.001,
    progress: ProgressCallback | None = None,
    solver: str = "auto",
    plans: str = "all",
    schedule: str = DEFAULT_SCHEDULE,
    max_instructions: int = MAX_INSTRUCTIONS,
) -> Frontier:
    """Compute the iteration time-energy frontier and write it (and plan files) to a folder.

    Args:
        profile: The instruction profile (needs both instructions of every stage).
        num_stages: Pipeline stages.
        num_microbatches: Microbatches per iteration.
        out_dir: Output folder (created; existing plan files in it are replaced).
        p2p_power: GPU power while blocked on P2P communication, W.
        unit_time: Time quantum of the solver, seconds. Smaller is finer but slower: the
            solver takes one step per unit between the slowest and the fastest plan.
        progress: Called with ``(fraction, message)`` as the work advances.
        solver: ``auto``, ``native``, ``python`` or ``lowtime``.
        plans: ``all`` plan files, or only the ``chosen`` ones (the rest stay in
            ``plans.delta``).
        schedule: The pipeline schedule the training runs, ``"1f1b"`` or ``"gpipe"``
            (:mod:`protocol.pipeline_schedules`); recorded in every plan's
            ``pipeline_schedule`` header and in ``frontier.json``.
        max_instructions: Refuse a pipeline of more instructions (``2 * S * M``), before
            anything is built or written: the planner's time grows about with their square.

    Returns:
        The frontier, also written to ``out_dir``.

    Raises:
        ConfigError: Bad arguments, a pipeline of more than ``max_instructions``
            instructions, a profile that does not cover the pipeline, or a solver failure.

    """
    if plans not in PLAN_FILES:
        raise ConfigError(f"plans must be one of {', '.join(PLAN_FILES)}, got {plans!r}")
    started = _time.perf_counter()
    computed = compute_frontier(
        profile,
        num_stages,
        num_microbatches,
        p2p_power=p2p_power,
        unit_time=unit_time,
        solver=solver,
        progress=progress,
        schedule=schedule,
        max_instructions=max_instructions,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Nothing of an earlier run may survive: a shorter frontier's missing plans, old pictures.
    remove_stale_outputs(out)
    write_profile_rows(
        out / PROFILE_CSV,
        [
            (s, i, f, t, e)
            for (s, i), tab in sorted(profile.table.items())
            for f, (t, e) in sorted(tab.items(), reverse=True)
        ],
    )
    points, allmax = computed.points, computed.allmax
    timings = dict(computed.timings)
    meta: dict[str, Any] = computed.base_meta()
    meta.update(
        {
            "profile": profile.path or "",
            "plan_pattern": PLAN_PATTERN,
            "plan_files": plans,
            "plan_log": PLAN_LOG,
            "allmax": point_dict(allmax),
            "fastest": point_dict(points[-1]),
            "slowest": point_dict(points[0]),
            "fits": computed.problem.fits,
            "timings": timings,
        }
    )
    frontier = computed.frontier(out, meta)
    t0 = _time.perf_counter()
    emit(progress, 0.9, f"writing {len(points) if plans == 'all' else 'chosen'} plan files")
    _write_plans(out, computed, frontier, plans, progress)
    write_frontier_csv(out / FRONTIER_CSV, points)
    write_allmax_csv(out / ALLMAX_CSV, allmax)
    timings["write_s"] = _time.perf_counter() - t0
    timings["total_s"] = _time.perf_counter() - started
    write_frontier_json(out / FRONTIER_JSON, meta)
    emit(progress, 1.0, f"{len(points)} plans written to {out}")
    return frontier


def _write_plans(
    out: Path,
    computed: ComputedFrontier,
    frontier: Frontier,
    plans: str,
    progress: ProgressCallback | None,
) -> None:
    """Write ``plans.delta`` and the plan files (every one, or the chosen ones)."""
    problem, result = computed.problem, computed.result
    shape = problem.shape
    first = [problem.knob(v, o) for v, o in enumerate(result.initial)]
    deltas = [[(v, problem.knob(v, o)) for v, o in moves] for moves in result.deltas]
    write_plan_log(out / PLAN_LOG, shape, first, deltas)
    if plans == "all":
        wanted = set(range(result.num_points))
    else:
        wanted = {select_point(frontier, policy)[0].index for policy in CHOSEN_POLICIES}
    writer = PlanWriter(shape, first)
    last = max(wanted)
    for k, point in enumerate(frontier.points[: last + 1]):
        writer.change(deltas[k])
        if k not in wanted:
            continue
        header = plan_header(
            point, unit_time=problem.unit_time, p2p_power=computed.p2p_power, shape=shape
        )
        writer.write(out / point.file, header, plan_note(point.plan))
        if k % 256 == 0:
            emit(progress, 0.9 + 0.09 * k / max(1, last), f"wrote {point.file}")


__all__ = [
    "CHOSEN_POLICIES",
    "PLAN_FILES",
    "SOLVERS",
    "InterpolatedCostModel",
    "ProgressCallback",
    "pareto_frequencies",
    "plan_frontier",
    "resolve_solver",
    "solve_problem",
]
