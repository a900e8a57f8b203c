"""Coordinator: Redis protocol, job state, rq tasks, settings and the perseus CLI."""
