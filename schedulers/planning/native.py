"""The compiled planner core (``_pd_native``, a C extension), and whether it is built.

``pip install -e .`` compiles ``schedulers/planning/_pd_native.c`` with the machine's C compiler
(an optional setuptools extension: without a compiler the install still succeeds, and the
planner falls back to :mod:`schedulers.planning.pd_core`). :func:`solve_native` lays the
:class:`CoreProblem` out as flat arrays, runs the kernel and returns the same
:class:`CoreResult` as the pure-Python core.
"""

from __future__ import annotations

from array import array
from typing import Any

from schedulers.planning.core_problem import CoreProblem, CoreResult
from schedulers.planning.cost_model import FP_ERROR, INF_UNITS
from schedulers.planning.maxflow import _INFEASIBLE, InfeasibleFlowError
from schedulers.planning.pd_core import CoreProgress

try:
    from schedulers.planning import _pd_native as _kernel  # type: ignore[attr-defined]
except ImportError:  # Not compiled (no C compiler at install time).
    _kernel = None

#: Progress is reported (and the GIL taken back) every this many solver steps.
PROGRESS_EVERY = 64


def available() -> bool:
    """Whether the C kernel is built."""
    return _kernel is not None


def _arrays(problem: CoreProblem) -> list[Any]:
    shape = problem.shape
    preds_ptr = array("i", [0])
    preds = array("i")
    for ps in shape.preds:
        preds.extend(ps)
        preds_ptr.append(len(preds))
    t_min, t_max, t_doff, t_ooff = array("i"), array("i"), array("i"), array("i", [0])
    lb, ub, cost, option_at = array("q"), array("q"), array("d"), array("i")
    o_time, o_energy = array("d"), array("d")
    for t, table in enumerate(problem.tables):
        t_min.append(table.min_d)
        t_max.append(table.max_d)
        t_doff.append(len(lb))
        lb.extend(table.lb)
        ub.extend(table.ub)
        cost.extend(table.cost)
        option_at.extend(table.option_at)
        o_time.extend(problem.option_time[t])
        o_energy.extend(problem.option_energy[t])
        t_ooff.append(len(o_time))
    return [
        preds_ptr,
        preds,
        array("i", shape.topo),
        array("i", problem.node_table),
        t_min,
        t_max,
        t_doff,
        t_ooff,
        lb,
        ub,
        cost,
        option_at,
        o_time,
        o_energy,
    ]


def solve_native(problem: CoreProblem, progress: CoreProgress | None = None) -> CoreResult:
    """Run the compiled core to the fastest point; return every point.

    Raises:
        RuntimeError: The kernel is not built (see :func:`available`).
        InfeasibleFlowError: No feasible flow (a non-convex cost model).

    """
    if _kernel is None:
        raise RuntimeError("the compiled planner core is not built (no C compiler at install)")
    out = _kernel.solve(
        problem.num_nodes,
        len(problem.tables),
        *_arrays(problem),
        INF_UNITS,
        FP_ERROR,
        progress,
        PROGRESS_EVERY,
    )
    quants, costs, energies, time_sums, spans, ends, nodes, options, initial, stop, paths = out
    if stop == "infeasible":
        raise InfeasibleFlowError(_INFEASIBLE)
    deltas: list[list[tuple[int, int]]] = []
    begin = 0
    for end in ends:
        deltas.append(list(zip(nodes[begin:end], options[begin:end], strict=True)))
        begin = end
    return CoreResult(
        quant_times=quants,
        model_costs=costs,
        energies=energies,
        time_sums=time_sums,
        makespans=spans,
        initial=initial,
        deltas=deltas,
        stop=stop,
        stats={"steps": len(quants) - 1, "augmenting_paths": paths},
    )
