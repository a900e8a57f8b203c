"""Run by tests/test_hook_threads.py: a training script that ends without calling close().

Usage: python -m tests.exit_without_close REDIS_URL PORT MODE. MODE ``main``: the hook runs in
this process; ``mp-fork``: in a child started by multiprocessing's fork (which skips atexit);
``os-fork``: here, and a plain fork of this process exits through ``sys.exit`` (with a copy
of the hook) before this one does; ``events-nvml``: here, with ``clock_sync="events"`` and a
FrequencyController on ``tests.fake_nvml``, ending with clock requests still waiting for
slow markers. Prints the job id and the schedule version of the result
built last (``os-fork``: also whether the fork's exit marked the rank finished), then ends
as a script that forgot ``close()`` does.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

import redis
import torch.distributed as dist

from protocol import keys
from tests.rank_helpers import make_hook, run_step, step_until, write_1f1b_plan
from worker_client.gpu.frequency import DryRunFrequencyController, FrequencyController


class SlowMarker:
    """A marker the 'GPU' reaches 0.3 s after the side thread starts waiting on it."""

    def synchronize(self) -> None:
        time.sleep(0.3)


def events_options() -> dict[str, object]:
    """A plan whose forward and backward clocks differ, so each instruction requests one."""
    with tempfile.TemporaryDirectory() as folder:
        plan = Path(folder) / "plan.py"
        write_1f1b_plan(plan, 1, 2, [(1980, 1965)])
        plan_text = plan.read_text()
    return {
        "scheduler": "PointSolution",
        "scheduler_args": {"plan_text": plan_text},
        "clock_sync": "events",
        "marker_fn": SlowMarker,
    }


def train(url: str, port: str, fork_after: bool = False, events: bool = False) -> None:
    """Join a one-rank job, train until a result is built, print it; no close()."""
    logging.basicConfig(level=logging.INFO)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if events:
        controller = FrequencyController(0, "tests.fake_nvml")
        hook = make_hook(url, controller, report_every=1, **events_options())
    else:
        hook = make_hook(url, DryRunFrequencyController(0), report_every=1)
    step_until(hook, lambda: hook._results.last_result is not None, 60, "a result built")
    last = hook._results.last_result
    assert last is not None
    if events:
        run_step(hook)  # not measured: its four clocks wait for their markers at exit
    print(hook.job_id, last.schedule_version, end="", flush=True)
    if fork_after:
        child = os.fork()
        if child == 0:
            sys.exit(0)  # runs the exit handlers this process inherited
        os.waitpid(child, 0)
        marked = redis.Redis.from_url(url).exists(keys.job_finished(hook.job_id))
        print(f" fork-marked-finished={bool(marked)}", end="", flush=True)
    print(flush=True)


def main() -> None:
    url, port, mode = sys.argv[1:4]
    if mode == "mp-fork":
        child = mp.get_context("fork").Process(target=train, args=(url, port))
        child.start()
        child.join()
        sys.exit(child.exitcode)
    train(url, port, fork_after=mode == "os-fork", events=mode == "events-nvml")


if __name__ == "__main__":
    main()
