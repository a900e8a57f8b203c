"""Frequency schedulers that rq workers run; the offline planner lives in schedulers.planning."""
