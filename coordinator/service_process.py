"""What a long-running service process does once at start: preload schedulers, tune the GC."""

from __future__ import annotations

import gc
import importlib
import logging

from protocol.scheduler import BUILTIN

logger = logging.getLogger(__name__)

# Imported by `perseus worker` before it forks: scipy.optimize (the planner's cost-model fit)
# costs ~0.5-1 s per forked job otherwise (the planner runs inside InstructionProfiler's and
# FrontierScheduler's rq tasks). lowtime is imported only for `--solver lowtime`.
PRELOAD_MODULES = ("coordinator.tasks", "schedulers.planning.planner", "scipy.optimize")


def tune_gc() -> None:
    """Set a service's cyclic garbage collector for many short-lived objects and a big heap.

    A service imports much (rq, redis, pydantic; a worker preloads the schedulers and scipy)
    and then keeps little new for long. Each full collection walked that heap again: pauses
    of 35-60 ms in 1-2% of versions (`benchmarks/bench_coordinator.py`'s p99; about 15 ms
    with the collector off). ``gc.freeze`` is Python's remedy (also before a fork). Decoding
    a batch of results allocates thousands of containers that reference counting frees: a
    young-generation round every 700 (Python's default) cost 0.6-0.8 ms of a 64-rank
    version's 14 ms (`benchmarks/bench_gc.py`); every 20,000 leaves little to collect.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 10, 10)


def preload_schedulers() -> None:
    """Import scheduler modules (and scipy.optimize) once, before rq forks a job's process."""
    targets = [t.partition(":")[0] for t in BUILTIN.values()] + list(PRELOAD_MODULES)
    for module in targets:
        try:
            importlib.import_module(module)
        except ImportError as exc:  # A missing optional module must not stop the worker.
            logger.warning("not preloaded: %s (%s)", module, exc)
