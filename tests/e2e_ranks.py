"""Entry point of one training rank in the multi-process tests (spawned, gloo on CPU)."""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import Any


def run_rank(
    rank: int,
    world_size: int,
    pp: int,
    dp: int,
    init_method: str,
    redis_url: str,
    steps: int,
    microbatches: int,
    out_dir: str,
    metadata: str,
    report_every: int = 2,
    scheduler: str | None = None,
    scheduler_args: dict[str, Any] | None = None,
    step_sleep: float = 0.0,
    heartbeat_interval: float = 60.0,
    barrier: bool = True,
    visible_devices: str | None = None,
    hook_options: dict[str, Any] | None = None,
    pg_timeout_s: float | None = None,
) -> None:
    """Run ``steps`` 1F1B iterations under PerseusOptimizer and write what happened to JSON.

    ``scheduler`` (and its arguments) is the one rank 0 names for the job (default: the
    coordinator's); ``step_sleep`` seconds pass in every step, so a job lasts long enough for
    faults injected while it runs. ``barrier=False`` leaves out the barrier after each step,
    so that a rank trains on when another one dies (as one stuck elsewhere would beat on).
    ``visible_devices`` is every rank's ``CUDA_VISIBLE_DEVICES`` (rank r drives CUDA device r).
    ``hook_options`` replace or add PerseusOptimizer arguments (one rank's bad ones, say);
    ``pg_timeout_s`` is the process group's timeout (a rank left waiting fails that soon).
    """
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from schedulers.planning.pipeline_dag import one_f_one_b_order
    from worker_client.gpu.frequency import DryRunFrequencyController
    from worker_client.gpu.nvml import SIMULATED_NVML
    from worker_client.hook.optimizer import PerseusOptimizer

    pp_rank, dp_rank = rank % pp, rank // pp
    record: dict[str, Any] = {"rank": rank, "pp_rank": pp_rank, "dp_rank": dp_rank}
    if visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    try:
        timeout = {} if pg_timeout_s is None else {"timeout": timedelta(seconds=pg_timeout_s)}
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=world_size, **timeout
        )
        controller = DryRunFrequencyController(rank)
        options: dict[str, Any] = {
            "rank": rank,
            "dp_rank": dp_rank,
            "pp_rank": pp_rank,
            "tp_rank": 0,
            "device_id": rank,
            "dp_degree": dp,
            "pp_degree": pp,
            "tp_degree": 1,
            "world_size": world_size,
            "redis_url": redis_url,
            "job_metadata": metadata,
            "nvml_module": SIMULATED_NVML,
            "controller": controller,
            "report_every": report_every,
            "heartbeat_interval": heartbeat_interval,
            "schedule_timeout": 60,
            "scheduler": scheduler,
            "scheduler_args": scheduler_args,
        }
        hook = PerseusOptimizer(**(options | (hook_options or {})))
        record["job_id"] = hook.job_id
        record["gpu_index"] = hook.gpu_index
        record["first_version"] = hook.schedule.version
        x = torch.ones(64, 64)
        for _ in range(steps):
            hook.on_step_begin()
            for name in one_f_one_b_order(pp, microbatches, pp_rank):
                hook.on_instruction_begin(name)
                x = torch.tanh(x @ x / 64)  # a little real work per instruction
                hook.on_instruction_end(name)
            time.sleep(step_sleep)
            hook.on_step_end()
            if barrier:
                dist.barrier()  # ranks of a pipeline move in lockstep, as in real training
        record["frequencies"] = [f for _, f in controller.records]
        record["swaps"] = hook.swaps
        record["final_version"] = hook.schedule.version
        record["reports_sent"] = hook.reporter.sent
        hook.close()
        dist.destroy_process_group()
    except BaseException:
        record["error"] = traceback.format_exc()
    Path(out_dir, f"{metadata}-rank{rank}.json").write_text(json.dumps(record))
    os._exit(0)
