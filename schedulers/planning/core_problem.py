"""The planner's problem and answer as plain arrays, shared by every solver.

:func:`build_problem` turns an instruction profile and a pipeline shape into a
:class:`CoreProblem`: the pipeline DAG (predecessor lists and a topological order) and, per
``(stage, instruction)``, the candidate options and the tabulated cost model
(:mod:`schedulers.planning.cost_model`). The pure-Python core, the C kernel and the lowtime
reference all solve this one object, and all return a :class:`CoreResult`: one frontier point
per solver step, and the clocks of each point as changes from the previous one.

Option choice: clocks that another clock beats on both time and *effective* energy
``energy - p2p_power * time`` are dropped first (:func:`pareto_frequencies`); while an
instruction runs its GPU would otherwise sit blocked on communication at ``p2p_power``, so only
the difference is the instruction's own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from protocol.constants import INSTRUCTIONS
from protocol.exceptions import ConfigError
from schedulers.planning.cost_model import (
    CostTable,
    ExecOption,
    candidate_options,
    fit_cost_model,
)
from schedulers.planning.pipeline_dag import PipelineShape
from schedulers.planning.profile_csv import InstructionProfile


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


@dataclass
class CoreProblem:
    """A pipeline's frontier problem.

    Attributes:
        shape: The pipeline.
        unit_time: Time quantum, s.
        tables: One :class:`CostTable` per ``(stage, instruction)``, in ``keys`` order.
        keys: ``(stage, instruction)`` of each table.
        node_table: ``node_table[i]``: the table of node ``i``.
        option_time: ``option_time[t][o]``: profiled time of option ``o`` of table ``t``, s.
        option_energy: ``option_energy[t][o]``: profiled energy of that option, J.
        fits: Cost model fit report per ``"stage/instruction"``.

    """

    shape: PipelineShape
    unit_time: float
    tables: list[CostTable]
    keys: list[tuple[int, str]]
    node_table: list[int]
    option_time: list[list[float]]
    option_energy: list[list[float]]
    fits: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def num_nodes(self) -> int:
        """Instructions in the pipeline."""
        return self.shape.num_nodes

    def knob(self, node: int, option: int) -> int:
        """Clock (MHz) of option ``option`` of node ``node``."""
        return self.tables[self.node_table[node]].options[option].knob


@dataclass
class CoreResult:
    """The frontier as a solver returns it, slowest point first.

    Attributes:
        quant_times: Iteration time of each point, in time units.
        model_costs: The cost models' total at each point, J.
        energies: Profiled energy of each point's clocks, J.
        time_sums: Sum of the profiled instruction times, s.
        makespans: Longest path with profiled times, s.
        initial: Option index per node at point 0.
        deltas: ``deltas[k]``: ``(node, option)`` changes from point ``k - 1`` to ``k``
            (``deltas[0]`` is empty).
        stop: Why the solver stopped.
        stats: Counters (iterations, augmenting paths, ...).

    """

    quant_times: list[int]
    model_costs: list[float]
    energies: list[float]
    time_sums: list[float]
    makespans: list[float]
    initial: list[int]
    deltas: list[list[tuple[int, int]]]
    stop: str = ""
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def num_points(self) -> int:
        """Frontier points."""
        return len(self.quant_times)

    def add_point(
        self,
        quant_time: int,
        model_cost: float,
        figures: tuple[float, float, float],
        moves: list[tuple[int, int]],
    ) -> int:
        """Append a point (the solvers' one way to grow the frontier).

        Args:
            quant_time: Its iteration time, in time units.
            model_cost: The cost models' total, J.
            figures: ``(energy J, sum of instruction times s, longest path s)`` of its clocks,
                as :meth:`~schedulers.planning.plan_eval.PlanEvaluator.figures` gives them.
            moves: Its ``(node, option)`` changes from the previous point.

        Returns:
            The new point's index.

        """
        energy, time_sum, makespan = figures
        self.quant_times.append(quant_time)
        self.model_costs.append(model_cost)
        self.energies.append(energy)
        self.time_sums.append(time_sum)
        self.makespans.append(makespan)
        self.deltas.append(moves)
        return len(self.quant_times) - 1

    def options_at(self, index: int) -> list[int]:
        """Option index per node at point ``index`` (replays the changes)."""
        current = list(self.initial)
        for k in range(1, index + 1):
            for node, option in self.deltas[k]:
                current[node] = option
        return current


def build_problem(
    profile: InstructionProfile,
    shape: PipelineShape,
    *,
    unit_time: float,
    p2p_power: float = 0.0,
) -> CoreProblem:
    """Fit the cost models and lay out the problem for the solvers.

    Raises:
        ConfigError: The profile does not cover the pipeline's stages.

    """
    profile.check_stages(shape.num_stages)
    keys = [(s, i) for s in range(shape.num_stages) for i in INSTRUCTIONS]
    tables: list[CostTable] = []
    option_time: list[list[float]] = []
    option_energy: list[list[float]] = []
    fits: dict[str, dict[str, Any]] = {}
    kept = {key: pareto_frequencies(profile.table[key], p2p_power) for key in keys}
    spans = {key: [profile.table[key][f][0] for f in kept[key]] for key in keys}
    finest = _finest_unit(spans)
    longest = max(max(t) for t in spans.values())
    for stage, inst in keys:
        entry = profile.table[(stage, inst)]
        _check_unit_time(profile, stage, inst, spans[(stage, inst)], unit_time, finest, longest)
        options = candidate_options(
            [(f, entry[f][0], entry[f][1] - p2p_power * entry[f][0]) for f in kept[(stage, inst)]],
            unit_time,
        )
        _check_table_width(profile, stage, inst, options, unit_time, finest)
        model, report = fit_cost_model(options, unit_time)
        report["pareto_frequencies"] = len(kept[(stage, inst)])
        report["profiled_frequencies"] = len(entry)
        fits[f"{stage}/{inst}"] = report
        tables.append(CostTable(options, model))
        option_time.append([entry[o.knob][0] for o in options])
        option_energy.append([entry[o.knob][1] for o in options])
    index = {key: t for t, key in enumerate(keys)}
    node_table = [index[(s, name)] for s, name, _ in shape.nodes]
    return CoreProblem(
        shape=shape,
        unit_time=unit_time,
        tables=tables,
        keys=keys,
        node_table=node_table,
        option_time=option_time,
        option_energy=option_energy,
        fits=fits,
    )


#: Most whole time units between an instruction's fastest and slowest option. The cost table
#: (and the solver's steps) hold one entry per unit: 1e-9 s units of a 0.1 s instruction made
#: tens of millions and the planner ran for ever; 1e-300 s never ended.
MAX_TABLE_UNITS = 1_000_000
#: Most whole time units one instruction may take: the compiled core holds durations as C ints
#: (a single clock of 0.01 s in 1e-12 s units, 1e10, ended in OverflowError; the width check
#: above passes a single clock whatever the unit).
MAX_QUANT_UNITS = 2**31 - 1


def _finest_unit(times: dict[tuple[int, str], list[float]]) -> float:
    """The finest unit time that keeps every instruction's table within ``MAX_TABLE_UNITS``.

    From the instructions' candidate times (the options kept at any unit time are among
    them): a table spans at most ``span / unit + 1`` units, 1% spare covers the ``+ 1``.
    """
    return max(1.01 * (max(t) - min(t)) / MAX_TABLE_UNITS for t in times.values())


def _check_unit_time(
    profile: InstructionProfile,
    stage: int,
    inst: str,
    times: list[float],
    unit_time: float,
    finest: float,
    longest: float,
) -> None:
    """Raise ConfigError if ``unit_time`` makes an instruction's time no finite number of units.

    Checked before the times are quantized: ``int(t // 1e-320)`` raises OverflowError. A time
    of more than :data:`MAX_QUANT_UNITS` units is refused too.
    """
    units = max(times) / unit_time
    if math.isfinite(units) and units <= MAX_QUANT_UNITS:
        return
    # At least one that counts the longest time of any instruction in MAX_TABLE_UNITS (finest
    # is 0 for one clock), so that no other instruction is refused next.
    works = max(finest, 1.01 * longest / MAX_TABLE_UNITS)
    count = f"{units:.3g} units, at most {MAX_QUANT_UNITS}" if math.isfinite(units) else ""
    raise ConfigError(
        f"{profile.path or 'profile'}: unit time {unit_time:g} s is too fine: stage {stage} "
        f"{inst}'s time of {max(times):g} s is {count or 'no finite number of units'}; use a "
        f"unit time of at least {works:.3g} s"
    )


def _check_table_width(
    profile: InstructionProfile,
    stage: int,
    inst: str,
    options: list[ExecOption],
    unit_time: float,
    finest: float,
) -> None:
    """Raise ConfigError if ``unit_time`` splits one instruction's times into too many units.

    The unit time it names (``finest``, from :func:`_finest_unit`) fits every instruction,
    not only this one: another one's wider times would be refused next.
    """
    quant = [o.quant_time for o in options]
    width = max(quant) - min(quant)
    if width <= MAX_TABLE_UNITS:
        return
    times = [o.real_time for o in options]
    raise ConfigError(
        f"{profile.path or 'profile'}: unit time {unit_time:g} s is too fine: stage {stage} "
        f"{inst}'s times ({min(times):g} to {max(times):g} s) span {float(width):.3g} units, "
        f"at most {MAX_TABLE_UNITS} are planned; use a unit time of at least {finest:.3g} s"
    )
