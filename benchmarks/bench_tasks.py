"""Tasks the coordinator benchmark enqueues (importable by rq workers)."""

from __future__ import annotations


def import_planner() -> bool:
    """What a planning scheduler's first rq task pays in imports: the planner and its fit.

    Every ``perseus`` process imports the planner module already (the CLI does), so what a
    forked task without preloading pays is scipy.optimize, which the cost-model fit imports
    on first use (``schedulers/planning/cost_model.py``).
    """
    from scipy.optimize import curve_fit  # noqa: F401

    import schedulers.planning.planner  # noqa: F401

    return True
