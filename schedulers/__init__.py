"""Frequency schedulers, plan files and the Perseus planner."""
