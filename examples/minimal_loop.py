"""The smallest complete perseus-mq loop: one rank, a private Redis, coordinator and worker.

Runs on a machine without a GPU (simulated GPU, dry-run clocks):

    python examples/minimal_loop.py                         # starts its own Redis and services
    python examples/minimal_loop.py --redis-url URL         # joins a running coordinator + worker

The job names its scheduler and sends its plan's text, so it runs against a coordinator started
with no scheduler settings (`perseus coordinator --redis-url URL`). In real training you run
`perseus coordinator` and `perseus worker` as services and keep only the part between
"--- your training script ---" markers.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import redis
import torch
import torch.distributed as dist

from coordinator.cli_common import stop_signals_interrupt
from coordinator.embedded import EmbeddedRedis
from coordinator.service import Coordinator
from coordinator.settings import PerseusSettings
from protocol.exceptions import PerseusError
from schedulers.planning.plan_file import write_plan_file

ROOT = Path(__file__).resolve().parent.parent


def one_stage_plan(folder: Path) -> str:
    """A one-stage plan's text: two microbatches, forward at 1410 MHz, backward at 1980 MHz."""
    plan = folder / "freqs_pipeline_00000.py"
    steps = [("forward", 1410), ("forward", 1410), ("backward", 1980), ("backward", 1980)]
    write_plan_file(plan, [steps], {"plan": 0})
    return plan.read_text()


def main() -> None:
    """Train against running services (--redis-url) or start private ones around training."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", help="join the coordinator and worker serving this Redis")
    args = parser.parse_args()
    # SIGTERM and SIGHUP stop it as Ctrl-C does: the private Redis and rq worker (sessions of
    # their own) stop too (they were left running).
    with stop_signals_interrupt(), tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("PERSEUS_SIM_GPU_DIR", str(Path(tmp) / "gpu"))
        plan_text = one_stage_plan(Path(tmp))
        if args.redis_url:
            train(args.redis_url, plan_text)
        else:
            with EmbeddedRedis() as server:
                run_services_around_training(server.url, plan_text)


def run_services_around_training(url: str, plan_text: str) -> None:
    """What `perseus coordinator` and `perseus worker` do, in and beside this process."""
    settings = PerseusSettings(redis_url=url)  # no default scheduler: the job names its own
    coordinator = Coordinator(redis.Redis.from_url(url), settings)
    thread = threading.Thread(target=coordinator.run, kwargs={"block_ms": 100})
    worker = None
    try:  # whenever an interrupt comes, what was started stops
        thread.start()
        worker = subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", "worker", "--redis-url", url],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        train(url, plan_text)
    finally:
        # Each stop asked for before any wait, so that a signal that interrupts a wait (it
        # can land here, after training) leaves nothing running.
        coordinator.stop_event.set()
        if worker is not None:
            worker.terminate()
        try:
            if worker is not None:
                worker.wait()
        finally:
            if thread.ident is not None:
                thread.join()


def train(redis_url: str, plan_text: str) -> None:
    """One rank's training loop with the Perseus hook, running the plan ``plan_text``."""
    # --- your training script ---------------------------------------------------------------
    from worker_client.hook.optimizer import PerseusOptimizer

    store = dist.HashStore()  # one process: no rendezvous needed
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    hook = PerseusOptimizer(
        rank=0,
        dp_rank=0,
        pp_rank=0,
        tp_rank=0,
        device_id=0,
        dp_degree=1,
        pp_degree=1,
        tp_degree=1,
        world_size=1,
        redis_url=redis_url,
        job_metadata="example",
        scheduler="PointSolution",  # leave out, with scheduler_args, for the coordinator's own
        scheduler_args={"plan_text": plan_text},
        nvml_module="worker_client.simulated.gpu",  # "pynvml" on a real GPU
        controller="dry-run",  # "nvml" to really lock clocks (needs root)
        report_every=2,
    )
    model = torch.nn.Linear(32, 32)
    batch = torch.randn(4, 32)
    for _step in range(6):
        hook.on_step_begin()
        outputs = []
        for _ in range(2):  # forwards of two microbatches
            hook.on_instruction_begin("forward")
            outputs.append(model(batch).square().mean())
            hook.on_instruction_end("forward")
        for out in outputs:  # then their backwards
            hook.on_instruction_begin("backward")
            out.backward()
            hook.on_instruction_end("backward")
        hook.on_step_end()
    print(f"job {hook.job_id}: ran schedule version {hook.schedule.version}")
    print("clocks requested:", [f for _, f in hook.controller.records][:4], "...")
    hook.on_train_end()
    dist.destroy_process_group()
    # --- end of your training script ---------------------------------------------------------


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit("interrupted: rq worker and private Redis stopped")
    except PerseusError as exc:  # a URL it cannot use, say: the error names it, in one line
        sys.exit(f"minimal_loop.py: error: {exc}")
