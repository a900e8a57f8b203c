"""lowtime's Phillips-Dessouky solver on a :class:`CoreProblem`: the reference solver.

``perseus optimize --solver lowtime`` and the tests run lowtime 0.3 on exactly the problem the
project's core solves (same candidate options, same cost model objects), and convert its
iterations into a :class:`CoreResult`. It is slow (its cost grows as the square of the number
of instructions), so the planner uses it only when asked.

lowtime's max-flow is Rust; when it fails (an infeasible flow, e.g. from a non-convex cost
model) it raises ``pyo3_runtime.PanicException``, which derives from ``BaseException`` and so
escapes ``except Exception``. :func:`solve_lowtime` turns it into :class:`LowtimePanicError`, a
:class:`~protocol.exceptions.ConfigError`.
"""

from __future__ import annotations

from typing import Any

from protocol.exceptions import ConfigError
from schedulers.planning.core_problem import CoreProblem, CoreResult
from schedulers.planning.pd_core import CoreProgress
from schedulers.planning.pipeline_dag import build_lowtime_dag
from schedulers.planning.plan_eval import PlanEvaluator


class LowtimePanicError(ConfigError):
    """lowtime's Rust code panicked (it does so when no feasible flow exists)."""


def _specs(problem: CoreProblem) -> dict[tuple[int, str], Any]:
    from lowtime.operation import (  # lowtime: ~1 s to import, only for the reference solver
        CandidateExecutionOptions,
        ExecutionOption,
        OperationSpec,
    )

    specs = {}
    for key, table in zip(problem.keys, problem.tables, strict=True):
        options = [
            ExecutionOption(
                real_time=o.real_time, unit_time=problem.unit_time, cost=o.cost, knob=o.knob
            )
            for o in table.options
        ]
        # lowtime only calls its cost model; ours computes the same values.
        model: Any = table.model
        specs[key] = OperationSpec(
            options=CandidateExecutionOptions(options=options), cost_model=model
        )
    return specs


def solve_lowtime(problem: CoreProblem, progress: CoreProgress | None = None) -> CoreResult:
    """Run lowtime's solver to the fastest point; return every point.

    Raises:
        LowtimePanicError: lowtime panicked.

    """
    from lowtime.solver import PhillipsDessouky  # lowtime: only for the reference solver

    graph, ops = build_lowtime_dag(problem.shape, _specs(problem))
    n = problem.num_nodes
    index = [
        {o.knob: k for k, o in enumerate(problem.tables[problem.node_table[v]].options)}
        for v in range(n)
    ]

    def options_now() -> list[int]:
        return [index[v][int(ops[v].assigned_knob)] for v in range(n)]

    current = options_now()
    evaluator = PlanEvaluator(problem, current)
    result = CoreResult([], [], [], [], [], list(current), [])

    def record(quant_time: int, cost: float, moves: list[tuple[int, int]]) -> None:
        evaluator.change(moves)
        point = result.add_point(quant_time, cost, evaluator.figures(), moves)
        if progress is not None:
            progress(point, quant_time)

    slow = int(problem.shape.makespan([op.duration for op in ops]))
    record(slow, sum(float(op.get_cost()) for op in ops), [])
    try:
        for step in PhillipsDessouky(graph).run():
            now = options_now()
            moves = [(v, o) for v, o in enumerate(now) if o != current[v]]
            current = now
            record(int(step.quant_time), float(step.cost), moves)
    except BaseException as exc:
        if type(exc).__name__ != "PanicException":
            raise
        raise LowtimePanicError(
            f"lowtime panicked after {len(result.quant_times)} frontier points: {exc} "
            "(an instruction's cost model is probably not convex)"
        ) from exc
    result.stop = "lowtime finished"
    result.stats = {"steps": len(result.quant_times) - 1}
    return result
