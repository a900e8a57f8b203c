"""Compute every Pareto-optimal frequency plan of a pipeline with lowtime (Perseus step 2).

Given an instruction profile (time and energy of each stage's forward and backward at each
clock), :func:`plan_frontier`

1. drops Pareto-suboptimal clocks per ``(stage, instruction)``: those that another clock
   matches or beats on both time and effective energy (below),
2. turns the rest into lowtime execution options whose cost is the *effective* energy
   ``energy - p2p_power * time``: while an instruction runs, its GPU would otherwise sit
   blocked on communication at ``p2p_power``, so only the difference is the instruction's own,
3. fits lowtime's exponential cost model per ``(stage, instruction)`` (a straight-line
   interpolation where fewer than four distinct quantized times are left or the fit fails),
4. builds the pipeline DAG of the chosen schedule, synchronous 1F1B or GPipe
   (:mod:`schedulers.planning.pipeline_dag`), and runs lowtime's
   Phillips-Dessouky solver, which starts from every instruction at its slowest option and
   shortens the iteration by one time unit per step at the least added cost, and
5. writes every frontier point as ``freqs_pipeline_%05d.py``: plan ``00000`` is the starting
   (slowest, least-energy) point and the solver's ``k``-th step is plan ``k``, so a larger
   number means a shorter iteration, plus ``frontier.csv``/``frontier.json``
   (see :mod:`schedulers.planning.frontier_files`).

Rounding: lowtime rounds each instruction's time *down* to whole units, so a plan's quantized
iteration time undershoots its real longest path by less than ``L * unit_time``, where ``L``
is the most instructions on any dependency path (``rounding_bound`` in ``frontier.json``).
The same rounding applied to the all-max reference keeps the two comparable.

lowtime is imported inside the functions that need it: importing it costs close to a second,
and the rq worker imports this module for :func:`run_planning_job`.
"""

from __future__ import annotations

import itertools
import time as _time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from protocol.constants import INSTRUCTIONS
from protocol.exceptions import ConfigError
from schedulers.planning.frontier_files import (
    ALLMAX,
    FRONTIER_CSV,
    FRONTIER_JSON,
    PLAN_PATTERN,
    PROFILE_CSV,
    Frontier,
    FrontierPoint,
    plan_file_name,
    plan_id,
    point_dict,
    write_frontier_csv,
    write_frontier_json,
)
from schedulers.planning.pipeline_dag import PipelineShape, build_lowtime_dag
from schedulers.planning.pipeline_schedules import DEFAULT_SCHEDULE, SCHEDULE_HEADER
from schedulers.planning.plan_file import write_plan_file
from schedulers.planning.profile_csv import InstructionProfile, write_profile_rows

#: ``progress(fraction in [0, 1], message)``.
ProgressCallback = Callable[[float, str], None]


def pareto_frequencies(
    entry: Mapping[int, tuple[float, float]], p2p_power: float = 0.0
) -> list[int]:
    """Clocks that no other clock beats on both time and (effective) energy, highest first.

    A clock is dropped when another is at least as fast and uses at most as much energy
    (exact ties keep the higher clock). Energy is the effective ``energy - p2p_power * time``
    that the solver minimises; with ``p2p_power = 0`` it is the profiled energy.

    Args:
        entry: ``frequency -> (time, energy)``.
        p2p_power: Power while blocked on communication, W.

    """
    items = sorted(entry.items(), key=lambda kv: (kv[1][0], -kv[0]))  # Fastest first.
    kept: list[int] = []
    best = float("inf")  # Least effective energy among faster (or tied, higher) clocks.
    for freq, (t, e) in items:
        cost = e - p2p_power * t
        if cost < best:
            kept.append(freq)
            best = cost
    return sorted(kept, reverse=True)


class InterpolatedCostModel:
    """Straight lines between the options' (quantized time, cost) points.

    Used where lowtime's exponential model cannot be fit (fewer than four distinct quantized
    times, or the fit fails or is not decreasing). Durations outside the points take the
    nearest end's cost.
    """

    def __init__(self, points: list[tuple[int, float]]) -> None:
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


def _fit_cost_model(candidates: Any) -> tuple[Any, dict[str, Any]]:
    """Fit a cost model to lowtime candidate options; return it and a fit report."""
    from lowtime.cost_model import ExponentialModel

    points = [(o.quant_time, float(o.cost)) for o in candidates.options]
    report: dict[str, Any] = {"options": len(points)}
    model: Any = None
    if len(points) >= 4:  # Three parameters: lowtime cannot fit three points (no covariance).
        try:
            with warnings.catch_warnings():  # The grid search tries (and warns about) bad guesses.
                warnings.simplefilter("ignore")
                model = ExponentialModel(candidates)
            report["model"] = "exponential"
            report["coefficients"] = [float(c) for c in model.coefficients]
        except (ValueError, RuntimeError, TypeError) as exc:
            report["fit_error"] = str(exc)
            model = None
        if model is not None:
            lo, hi = min(p[0] for p in points), max(p[0] for p in points)
            if not float(model(lo)) >= float(model(hi)):  # Slower must not cost more.
                report["fit_error"] = "fitted model increases with time"
                model = None
    if model is None:
        model = InterpolatedCostModel(points)
        report["model"] = "interpolated"
    errors = [abs(float(model(t)) - c) for t, c in points]
    scale = max(abs(c) for _, c in points) or 1.0
    report["max_abs_error"] = max(errors)
    report["max_rel_error"] = max(errors) / scale
    return model, report


def _emit(progress: ProgressCallback | None, fraction: float, message: str) -> None:
    if progress is not None:
        progress(min(1.0, max(0.0, fraction)), message)


def _quantize(t: float, unit_time: float) -> int:
    return int(t // unit_time)  # Same rounding as lowtime's ExecutionOption.quant_time.


def plan_frontier(
    profile: InstructionProfile,
    num_stages: int,
    num_microbatches: int,
    *,
    out_dir: str | Path,
    p2p_power: float = 0.0,
    unit_time: float = 0.001,
    progress: ProgressCallback | None = None,
    schedule: str = DEFAULT_SCHEDULE,
) -> Frontier:
    """Compute the iteration time-energy frontier and write one plan file per point.

    Args:
        profile: The instruction profile (needs both instructions of every stage).
        num_stages: Pipeline stages.
        num_microbatches: Microbatches per iteration.
        out_dir: Output folder (created; existing plan files in it are replaced).
        p2p_power: GPU power while blocked on P2P communication, W.
        unit_time: Time quantum of the solver, seconds. Smaller is finer but slower: the
            solver takes one step per unit between the slowest and the fastest plan.
        progress: Called with ``(fraction, message)`` as the work advances.
        schedule: The pipeline schedule the training runs, ``"1f1b"`` or ``"gpipe"``
            (:mod:`schedulers.planning.pipeline_schedules`); recorded in every plan's
            ``pipeline_schedule`` header and in ``frontier.json``.

    Returns:
        The frontier, also written to ``out_dir``.

    Raises:
        ConfigError: Bad arguments or a profile that does not cover the pipeline.

    """
    if not unit_time > 0:
        raise ConfigError(f"unit time must be positive, got {unit_time}")
    if not p2p_power >= 0:
        raise ConfigError(f"P2P power must not be negative, got {p2p_power}")
    profile.check_stages(num_stages)
    shape = PipelineShape(num_stages, num_microbatches, schedule)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("freqs_pipeline_*.py"):
        old.unlink()  # A shorter frontier must not leave stale plans from an earlier run.
    timings: dict[str, float] = {}
    started = _time.perf_counter()

    _emit(progress, 0.0, "fitting cost models")
    from lowtime.operation import CandidateExecutionOptions, ExecutionOption, OperationSpec

    specs: dict[tuple[int, str], Any] = {}
    fits: dict[str, dict[str, Any]] = {}
    for stage in range(num_stages):
        for inst in INSTRUCTIONS:
            entry = profile.table[(stage, inst)]
            kept = pareto_frequencies(entry, p2p_power)
            options = [
                ExecutionOption(
                    real_time=entry[f][0],
                    unit_time=unit_time,
                    cost=entry[f][1] - p2p_power * entry[f][0],
                    knob=f,
                )
                for f in kept
            ]
            candidates = CandidateExecutionOptions(options=options)
            model, report = _fit_cost_model(candidates)
            report["pareto_frequencies"] = len(kept)
            report["profiled_frequencies"] = len(entry)
            fits[f"{stage}/{inst}"] = report
            specs[(stage, inst)] = OperationSpec(options=candidates, cost_model=model)
    timings["fit_s"] = _time.perf_counter() - started

    _emit(progress, 0.02, f"building the {schedule} DAG")
    t0 = _time.perf_counter()
    graph, ops = build_lowtime_dag(shape, specs)
    timings["dag_s"] = _time.perf_counter() - t0

    # Reference: every instruction at its highest profiled clock, as without Perseus.
    write_profile_rows(
        out / PROFILE_CSV,
        [
            (s, i, f, t, e)
            for (s, i), tab in sorted(profile.table.items())
            for f, (t, e) in sorted(tab.items(), reverse=True)
        ],
    )
    max_clock = {key: max(tab) for key, tab in profile.table.items()}
    allmax = _evaluate(
        ALLMAX,
        [max_clock[(s, i)] for s, i, _ in shape.nodes],
        None,
        None,
        shape,
        profile,
        p2p_power,
        unit_time,
    )

    def snapshot(index: int, quant_time: int, cost: float) -> FrontierPoint:
        knobs = [int(op.assigned_knob) for op in ops]
        point = _evaluate(
            plan_id(index), knobs, quant_time, cost, shape, profile, p2p_power, unit_time
        )
        stages = [
            [(name, knobs[shape.node(s, k)]) for k, name in enumerate(shape.order[s])]
            for s in range(num_stages)
        ]
        header = {
            "plan": point.plan,
            "iteration_time": repr(point.iteration_time),
            "energy": repr(point.energy),
            "energy_with_p2p": repr(point.energy_with_p2p),
            "unit_time": repr(unit_time),
            "profile_time": repr(point.profile_time),
            "quant_time": point.quant_time,
            "model_cost": repr(cost),
            "p2p_power": repr(p2p_power),
            "num_stages": num_stages,
            "num_microbatches": num_microbatches,
            SCHEDULE_HEADER: schedule,
        }
        notes = [f"perseus-mq frequency plan {point.plan} (a larger number is a shorter iteration)"]
        write_plan_file(out / point.file, stages, header, notes)
        return point

    from lowtime.solver import PhillipsDessouky

    # Operations start at their slowest option; that is the frontier's slow end (plan 0).
    slow_q = int(shape.makespan([op.max_duration for op in ops]))
    fast_q = int(shape.makespan([op.min_duration for op in ops]))
    span = max(1, slow_q - fast_q)
    t0 = _time.perf_counter()
    points = [snapshot(0, slow_q, sum(float(op.get_cost()) for op in ops))]
    _emit(progress, 0.05, f"plan 00000: {points[0].iteration_time:.4f} s")
    for result in PhillipsDessouky(graph).run():
        q = int(result.quant_time)
        points.append(snapshot(len(points), q, float(result.cost)))
        _emit(
            progress,
            0.05 + 0.93 * (slow_q - q) / span,
            f"plan {points[-1].plan}: {points[-1].iteration_time:.4f} s "
            f"(fastest possible {fast_q * unit_time:.4f} s)",
        )
    timings["solve_s"] = _time.perf_counter() - t0

    _emit(progress, 0.99, f"writing {FRONTIER_CSV}")
    longest = shape.max_path_length()
    write_frontier_csv(out / FRONTIER_CSV, points, allmax)
    timings["total_s"] = _time.perf_counter() - started
    meta: dict[str, Any] = {
        "num_stages": num_stages,
        "num_microbatches": num_microbatches,
        SCHEDULE_HEADER: schedule,
        "unit_time": unit_time,
        "p2p_power": p2p_power,
        "profile": profile.path or "",
        "num_plans": len(points),
        "plan_pattern": PLAN_PATTERN,
        "max_path_instructions": longest,
        "rounding_bound": longest * unit_time,
        "allmax": point_dict(allmax),
        "fastest": point_dict(points[-1]),
        "slowest": point_dict(points[0]),
        "fits": fits,
        "timings": timings,
    }
    write_frontier_json(out / FRONTIER_JSON, meta)
    _emit(progress, 1.0, f"{len(points)} plans written to {out}")
    return Frontier(out_dir=out, points=points, allmax=allmax, meta=meta)


def _evaluate(
    plan: str,
    knobs: list[int],
    quant_time: int | None,
    model_cost: float | None,
    shape: PipelineShape,
    profile: InstructionProfile,
    p2p_power: float,
    unit_time: float,
) -> FrontierPoint:
    """Time and energy of a plan (clock per node) from the profile."""
    table = profile.table
    times = [table[(s, i)][k][0] for (s, i, _), k in zip(shape.nodes, knobs, strict=True)]
    energy = sum(table[(s, i)][k][1] for (s, i, _), k in zip(shape.nodes, knobs, strict=True))
    real = shape.makespan(times)
    if quant_time is None:
        quant_time = int(shape.makespan([_quantize(t, unit_time) for t in times]))
    # Each stage idles (blocked on P2P) for the part of the iteration it does not compute.
    blocked = max(0.0, shape.num_stages * real - sum(times))
    return FrontierPoint(
        plan=plan,
        iteration_time=quant_time * unit_time,
        energy=energy,
        energy_with_p2p=energy + p2p_power * blocked,
        profile_time=real,
        quant_time=quant_time,
        model_cost=model_cost,
        file="" if plan == ALLMAX else plan_file_name(int(plan)),
    )


__all__ = [
    "InterpolatedCostModel",
    "ProgressCallback",
    "pareto_frequencies",
    "plan_frontier",
]
