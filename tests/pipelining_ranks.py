"""One rank of the torch.distributed.pipelining tests (spawned, gloo on CPU).

Each rank trains a small MLP split into stages twice from the same seed: first with the bare
schedule, then with the schedule under :class:`PerseusPipeline` (dry-run clocks), and writes
what happened to JSON.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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


@dataclass(frozen=True)
class PipelineRank:
    """One spawned rank of a pipeline: where it joins, what it runs, where it writes its record."""

    rank: int
    world_size: int
    init_method: str
    redis_url: str
    schedule_name: str  # "1f1b" or "gpipe"
    microbatches: int
    out_dir: str

    def join(self, pg_timeout_s: float | None = None) -> None:
        """Join the gloo process group (``pg_timeout_s``: its timeout, else torch's default)."""
        from datetime import timedelta

        import torch.distributed as dist  # torch: only in the spawned rank processes

        timeout = {} if pg_timeout_s is None else {"timeout": timedelta(seconds=pg_timeout_s)}
        dist.init_process_group(
            "gloo",
            init_method=self.init_method,
            rank=self.rank,
            world_size=self.world_size,
            **timeout,
        )

    def schedule(self, loss: bool = True) -> tuple[Any, Any]:
        """A fresh ``(schedule, stage)`` of this rank's stage (``loss=False``: no ``loss_fn``)."""
        import torch  # torch: only in the spawned rank processes
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        classes = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
        module = _stage_module(self.rank, self.world_size)
        stage = PipelineStage(module, self.rank, self.world_size, torch.device("cpu"))
        loss_fn = torch.nn.MSELoss() if loss else None
        return classes[self.schedule_name](stage, self.microbatches, loss_fn=loss_fn), stage

    @contextmanager
    def recording(self) -> Iterator[dict[str, Any]]:
        """This rank's record to fill; then written (with what the block raised) and exit."""
        record: dict[str, Any] = {"rank": self.rank}
        try:
            yield record
        except BaseException:
            record["error"] = traceback.format_exc()
        Path(self.out_dir, f"rank{self.rank}.json").write_text(json.dumps(record))
        os._exit(0)


def run_rank(spec: PipelineRank, bare_steps: int, max_steps: int, report_every: int = 2) -> None:
    """Bare run, then hooked run until every rank runs version 2 for ``report_every`` steps."""
    import torch
    import torch.distributed as dist

    from worker_client.gpu.frequency import DryRunFrequencyController
    from worker_client.gpu.nvml import SIMULATED_NVML
    from worker_client.integrations.torch_pipelining import PerseusPipeline

    with spec.recording() as record:
        spec.join()
        schedule, stage = spec.schedule()
        record["bare_losses"] = _train(schedule, stage, lambda done: done < bare_steps)

        schedule, stage = spec.schedule()
        controller = DryRunFrequencyController(spec.rank)
        perseus = PerseusPipeline(
            schedule,
            redis_url=spec.redis_url,
            device_id=spec.rank,
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


def start_rank(
    spec: PipelineRank,
    loss: bool = True,
    pg_timeout_s: float = 20.0,
    hook_options: dict[str, Any] | None = None,
) -> None:
    """Wrap this rank's schedule and train one step; write the error, if any, to JSON.

    ``loss=False`` builds the schedule without a ``loss_fn`` (a script that gave it to the
    last stage only); ``pg_timeout_s`` is the process group's timeout, so that a rank left
    waiting in a collective fails soon; ``hook_options`` go to the hook (a scheduler, say).
    """
    import torch.distributed as dist

    from worker_client.gpu.nvml import SIMULATED_NVML
    from worker_client.integrations.torch_pipelining import PerseusPipeline

    with spec.recording():
        spec.join(pg_timeout_s)
        schedule, stage = spec.schedule(loss)
        with PerseusPipeline(
            schedule,
            redis_url=spec.redis_url,
            device_id=spec.rank,
            nvml_module=SIMULATED_NVML,
            controller="dry-run",
            schedule_timeout=30,
            **(hook_options or {}),
        ):
            _train(schedule, stage, lambda done: False)
        dist.destroy_process_group()
