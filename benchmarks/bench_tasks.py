"""Tasks the coordinator benchmark enqueues (importable by rq workers)."""

from __future__ import annotations


def import_planner() -> bool:
    """What a planning scheduler's rq task pays first: importing the planner and lowtime."""
    import schedulers.planning.planner  # noqa: F401

    return True
