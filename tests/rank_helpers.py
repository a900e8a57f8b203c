"""Helpers that play the training side: a hook stepped in this process, rank processes of a job."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from schedulers.planning.pipeline_dag import one_f_one_b_order
from schedulers.planning.plan_file import write_plan_file
from tests.e2e_ranks import run_rank
from tests.helpers import free_ports
from worker_client.gpu.nvml import SIMULATED_NVML
from worker_client.hook.optimizer import PerseusOptimizer


def make_hook(
    redis_url: str, controller: Any, world_size: int = 1, rank: int = 0, **kw: Any
) -> PerseusOptimizer:
    """A one-rank PerseusOptimizer on the simulated GPU."""
    return PerseusOptimizer(
        rank=rank,
        dp_rank=0,
        pp_rank=0,
        tp_rank=0,
        device_id=0,
        dp_degree=1,
        pp_degree=1,
        tp_degree=1,
        world_size=world_size,
        redis_url=redis_url,
        nvml_module=SIMULATED_NVML,
        controller=controller,
        **kw,
    )


def run_step(
    hook: PerseusOptimizer,
    names: Iterable[str] = ("forward", "backward") * 2,
    between: Callable[[], None] | None = None,
) -> None:
    """One training step through the hook (``between`` runs after the first instruction)."""
    hook.on_step_begin()
    for i, name in enumerate(names):
        hook.on_instruction_begin(name)
        hook.on_instruction_end(name)
        if between is not None and i == 0:
            between()
    hook.on_step_end()


def step_until(
    hook: PerseusOptimizer, predicate: Callable[[], Any], timeout: float, what: str
) -> int:
    """Run steps (as training would) until ``predicate()``; return how many ran."""
    deadline, steps = time.monotonic() + timeout, 0
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        run_step(hook)
        steps += 1
        time.sleep(0.02)
    return steps


def write_1f1b_plan(
    path: Path, pp: int, microbatches: int, stage_clocks: list[tuple[int, int]]
) -> list[list[tuple[str, int]]]:
    """Write a plan file: stage s runs forwards at ``stage_clocks[s][0]``, backwards at [1]."""
    stages = []
    for stage, (fwd, bwd) in enumerate(stage_clocks):
        names = one_f_one_b_order(pp, microbatches, stage)
        stages.append([(n, fwd if n == "forward" else bwd) for n in names])
    write_plan_file(path, stages, {"plan": 1, "iteration_time": 1.0})
    return stages


def spawn_ranks(
    world: int,
    pp: int,
    redis_url: str,
    out: Path,
    meta: str,
    steps: int,
    microbatches: int,
    rank_options: dict[int, dict[str, Any]] | None = None,
    **kw: Any,
) -> list[mp.process.BaseProcess]:
    """Start ``world`` rank processes of one job (tests/e2e_ranks.py; gloo, dry-run clocks).

    ``kw`` goes to :func:`tests.e2e_ranks.run_rank` (scheduler, step_sleep, ...);
    ``rank_options[r]`` are rank r's own ``hook_options`` (PerseusOptimizer arguments).
    """
    ctx = mp.get_context("spawn")
    init = f"tcp://127.0.0.1:{free_ports()[0]}"
    dp = world // pp
    procs = [
        ctx.Process(
            target=run_rank,
            args=(rank, world, pp, dp, init, redis_url, steps, microbatches, str(out), meta),
            kwargs=kw | {"hook_options": (rank_options or {}).get(rank)},
        )
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    return procs


def join_ranks(procs: list[mp.process.BaseProcess], timeout: float = 240) -> None:
    """Wait for the rank processes; fail if one did not end cleanly.

    A rank still running at the deadline (stuck in a collective, say) is killed, so that it
    fails this test instead of hanging pytest at exit.
    """
    deadline = time.monotonic() + timeout
    try:
        for rank, p in enumerate(procs):
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            assert p.exitcode == 0, f"rank {rank} did not end cleanly (exit code {p.exitcode})"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


def collect_ranks(
    procs: list[mp.process.BaseProcess], out: Path, meta: str, timeout: float = 240
) -> list[dict[str, Any]]:
    """Wait for the rank processes and return their records; fail on a rank's error."""
    join_ranks(procs, timeout)
    records = [json.loads((out / f"{meta}-rank{r}.json").read_text()) for r in range(len(procs))]
    # Every rank's error: the first rank to fail is often not rank 0 (its peers then fail in a
    # collective with "connection closed by peer").
    errors = [f"rank {r}: {rec['error']}" for r, rec in enumerate(records) if "error" in rec]
    assert not errors, "\n".join(errors)
    return records
