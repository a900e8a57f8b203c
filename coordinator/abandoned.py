"""rq's registry maintenance with a task called abandoned by Redis's clock, not the cleaner's.

rq scores each entry of a queue's StartedJobRegistry with the time its execution expires, on
the clock of the worker that runs it, and its cleanup (which every rq worker runs every ten
minutes, and the coordinator's sweep runs too) compares that with the cleaner's own clock: a
worker or coordinator a few minutes ahead moved other workers' running tasks to the failed
ones as abandoned. Here a task is abandoned once its execution key expired in Redis
(:func:`schedulers.planning.plan_runs.expired_executions`), whatever the machines' clocks say.
"""

from __future__ import annotations

from typing import Any

from rq import Queue
from rq import registry as rq_registry
from rq.registry import StartedJobRegistry
from rq.timeouts import TimerDeathPenalty

from schedulers.planning.plan_runs import expired_executions


class _ExpiredInRedis(StartedJobRegistry):
    """rq's StartedJobRegistry whose expired tasks are those whose execution Redis let expire.

    :attr:`expired` keeps the registry entries found so, for the caller to remove.
    """

    expired: tuple[str, ...] = ()

    def get_expired_job_ids(self, timestamp: float | None = None) -> list[str]:
        """Ids of the started tasks whose execution expired in Redis (``timestamp`` unused)."""
        self.expired = tuple(expired_executions(self.connection, self.name))
        return [self.parse_job_id(entry) for entry in self.expired]


def fail_abandoned(queue: Queue, exception_handlers: list[Any] | None = None) -> None:
    """Handle ``queue``'s started tasks whose worker died, as rq's cleanup does.

    Each is retried if it has retries left, else moved to the failed tasks, its failure
    callback called (bounded by a timer, not a signal: the caller may not be on the main
    thread). Call it under rq's maintenance lock of the queue.

    Args:
        queue: The rq queue.
        exception_handlers: rq's exception handlers to call for each task (a worker's).
    """
    registry = _ExpiredInRedis(
        queue.name,
        connection=queue.connection,
        job_class=queue.job_class,
        serializer=queue.serializer,
        death_penalty_class=TimerDeathPenalty,
    )
    # rq removes the entries scored up to the timestamp, on the workers' clocks: none here;
    # the entries whose execution expired go below.
    registry.cleanup(timestamp=-1, exception_handlers=exception_handlers)
    if registry.expired:
        queue.connection.zrem(registry.key, *registry.expired)


def clean_registries(queue: Queue, exception_handlers: list[Any] | None = None) -> None:
    """``rq.registry.clean_registries`` of ``queue``, with :func:`fail_abandoned` for its tasks.

    The other registries are cleaned as rq cleans them (the rq version's own set).

    Args:
        queue: The rq queue.
        exception_handlers: rq's exception handlers to call for each abandoned task.
    """
    fail_abandoned(queue, exception_handlers)
    names = ("finished_job_registry", "failed_job_registry", "deferred_job_registry")
    registries = [getattr(queue, name) for name in names]
    ready = getattr(queue, "ready_job_registry", None)  # rq 3
    if ready is not None:
        registries.append(ready)
    for registry in registries:
        registry.cleanup()
    rate_limits = getattr(rq_registry, "RateLimitRegistry", None)  # rq 3
    if rate_limits is not None:
        for registry in rate_limits.all(queue.connection):
            registry.cleanup()
