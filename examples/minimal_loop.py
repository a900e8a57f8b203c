"""The smallest complete perseus-mq loop: one rank, a private Redis, coordinator and worker.

Runs on a machine without a GPU (simulated GPU, dry-run clocks):

    python examples/minimal_loop.py

In real training you would run `perseus coordinator` and `perseus worker` as services and
keep only the part between "--- your training script ---" markers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import redis
import torch
import torch.distributed as dist

from coordinator.embedded import EmbeddedRedis
from coordinator.service import Coordinator
from coordinator.settings import PerseusSettings
from schedulers.planning.plan_file import write_plan_file

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    """Start the services, train, stop the services."""
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as tmp:
        os.environ["PERSEUS_SIM_GPU_DIR"] = str(Path(tmp) / "gpu")
        # A one-stage plan: two microbatches, forward at 1410 MHz, backward at 1980 MHz.
        plan = Path(tmp) / "freqs_pipeline_00000.py"
        steps = [("forward", 1410), ("forward", 1410), ("backward", 1980), ("backward", 1980)]
        write_plan_file(plan, [steps], {"plan": 0})
        settings = PerseusSettings(
            redis_url=server.url,
            scheduler="PointSolution",
            scheduler_args={"solution_path": str(plan)},
        )
        coordinator = Coordinator(redis.Redis.from_url(server.url), settings)
        thread = threading.Thread(target=coordinator.run, kwargs={"block_ms": 100})
        thread.start()
        worker = subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", "worker", "--redis-url", server.url],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            train(server.url)
        finally:
            worker.terminate()
            worker.wait()
            coordinator.stop_event.set()
            thread.join()


def train(redis_url: str) -> None:
    """One rank's training loop with the Perseus hook."""
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
    main()
