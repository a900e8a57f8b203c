"""One rank of the torch.distributed.pipelining tests (spawned, gloo on CPU).

Each rank trains a small MLP split into stages twice from the same seed: first with the bare
schedule, then with the schedule under :class:`PerseusPipeline` (dry-run clocks), and writes
what happened to JSON.
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import Any

WIDTH, BATCH = 8, 16


def _stage_module(stage: int, num_stages: int) -> Any:
    """This stage's part of one MLP; every rank builds the same weights from one seed."""
    import torch  # torch: only in the spawned rank processes

    torch.manual_seed(0)
    parts = [
        torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())
        for _ in range(num_stages)
    ]
    return parts[stage]


def _train(schedule: Any, stage: Any, keep_going: Any) -> list[float]:
    """Run SGD steps while ``keep_going(steps done)``; return the last stage's loss per step."""
    import torch  # torch: only in the spawned rank processes

    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)
    opt = torch.optim.SGD(stage.submod.parameters(), lr=0.1)
    losses_per_step: list[float] = []
    done = 0
    while True:
        losses: list[Any] = []
        if stage.is_first:
            schedule.step(x)
        elif stage.is_last:
            schedule.step(target=y, losses=losses)
            losses_per_step.append(float(sum(loss.item() for loss in losses)))
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()
        done += 1
        if not keep_going(done):
            return losses_per_step


def run_rank(
    rank: int,
    world_size: int,
    init_method: str,
    redis_url: str,
    schedule_name: str,
    microbatches: int,
    bare_steps: int,
    max_steps: int,
    out_dir: str,
    report_every: int = 2,
) -> None:
    """Bare run, then hooked run until every rank runs version 2 for ``report_every`` steps."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from worker_client.gpu.frequency import DryRunFrequencyController
    from worker_client.gpu.nvml import SIMULATED_NVML
    from worker_client.integrations.torch_pipelining import PerseusPipeline

    classes = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
    record: dict[str, Any] = {"rank": rank}
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)

        def build() -> tuple[Any, Any]:
            module = _stage_module(rank, world_size)
            stage = PipelineStage(module, rank, world_size, torch.device("cpu"))
            loss_fn = torch.nn.MSELoss()
            return classes[schedule_name](stage, microbatches, loss_fn=loss_fn), stage

        schedule, stage = build()
        record["bare_losses"] = _train(schedule, stage, lambda done: done < bare_steps)

        schedule, stage = build()
        controller = DryRunFrequencyController(rank)
        perseus = PerseusPipeline(
            schedule,
            redis_url=redis_url,
            device_id=rank,
            nvml_module=SIMULATED_NVML,
            controller=controller,
            report_every=report_every,
            schedule_timeout=60,
        )
        record["first_version"] = perseus.hook.schedule.version
        actions: list[list[tuple[str, int]]] = []
        on_v2_steps = [0]

        def keep_going(done: int) -> bool:
            actions.append(list(perseus.last_step_actions))
            # Every rank stops after the same step: once all run version 2, a few more.
            on_v2 = torch.tensor([float(perseus.hook.schedule.version >= 2)])
            dist.all_reduce(on_v2, op=dist.ReduceOp.MIN)
            on_v2_steps[0] += int(on_v2.item())
            return on_v2_steps[0] <= report_every and done < max_steps

        record["losses"] = _train(schedule, stage, keep_going)
        record["job_id"] = perseus.hook.job_id
        record["actions"] = actions
        record["frequencies"] = [f for _, f in controller.records]
        record["swaps"] = perseus.hook.swaps
        perseus.close()
        record["reports_sent"] = perseus.hook.reporter.sent
        record["restored"] = not {"step", "_maybe_compute_loss"} & set(vars(schedule)) and not {
            "forward_one_chunk",
            "backward_one_chunk",
        } & set(vars(stage))
        dist.destroy_process_group()
    except BaseException:
        record["error"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    os._exit(0)


def start_rank(
    rank: int,
    world_size: int,
    init_method: str,
    redis_url: str,
    schedule_name: str,
    microbatches: int,
    out_dir: str,
    loss: bool = True,
    pg_timeout_s: float = 20.0,
    hook_options: dict[str, Any] | None = None,
) -> None:
    """Wrap this rank's schedule and train one step; write the error, if any, to JSON.

    ``loss=False`` builds the schedule without a ``loss_fn`` (a script that gave it to the
    last stage only); ``pg_timeout_s`` is the process group's timeout, so that a rank left
    waiting in a collective fails soon; ``hook_options`` go to the hook (a scheduler, say).
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from worker_client.gpu.nvml import SIMULATED_NVML
    from worker_client.integrations.torch_pipelining import PerseusPipeline

    classes = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
    record: dict[str, Any] = {"rank": rank}
    try:
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        stage = PipelineStage(
            _stage_module(rank, world_size), rank, world_size, torch.device("cpu")
        )
        loss_fn = torch.nn.MSELoss() if loss else None
        schedule = classes[schedule_name](stage, microbatches, loss_fn=loss_fn)
        with PerseusPipeline(
            schedule,
            redis_url=redis_url,
            device_id=rank,
            nvml_module=SIMULATED_NVML,
            controller="dry-run",
            schedule_timeout=30,
            **(hook_options or {}),
        ):
            _train(schedule, stage, lambda done: False)
        dist.destroy_process_group()
    except BaseException:
        record["error"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    os._exit(0)
