"""Simulated training through torch's own pipeline schedules (``engine="torch-pipelining"``).

Each rank builds a small real ``nn.Module`` stage, runs ``Schedule1F1B`` or ``ScheduleGPipe``
over gloo, and wraps the schedule in
:class:`~worker_client.integrations.torch_pipelining.PerseusPipeline` exactly as a user would.
:class:`SimulatedPerseusPipeline` adds the simulated GPU through the integration's extension
points: inside every action's hook window the GPU replays the instruction at the clock the
controller locked, and the rank's clock advances by the replayed time.

Virtual timing (:mod:`worker_client.simulated.step_account`) needs each message to carry the
sender's clock. Torch sends the activations and gradients itself, so the stage's
``get_{fwd,bwd}_{send,recv}_ops`` are wrapped to add one more point-to-point op to each batch:
a float64 tensor with the sender's clock, on a tag of its own. Torch waits for a batch before
it runs the action that needs it, so the receiver catches up with the sender's clock before
its action's window opens, and iteration times are the pipeline DAG's, as with the loop engine.

torch is imported at module level: only rank processes import this module.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from worker_client.integrations.torch_pipelining import PerseusPipeline
from worker_client.simulated.step_account import SimClock, StepAccount

#: The torch schedule class of each planner schedule name.
TORCH_SCHEDULES: dict[str, type] = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
# Tags of the clock messages; torch's own ops use tag 0.
_CLOCK_TAGS = {"forward": 7101, "backward": 7102}
_WIDTH, _ROWS_PER_MICROBATCH = 8, 2


class SimulatedPerseusPipeline(PerseusPipeline):
    """PerseusPipeline whose actions also run on a simulated GPU, with the clock sent along.

    Args:
        schedule: The rank's torch schedule.
        hook: The rank's hook (simulated NVML and controller).
        gpu: The rank's simulated GPU.
        controller: The hook's frequency controller (flushed before each replay).
        clock: The rank's clock (also the hook's).
        account: Where the step's figures go.
        time_scale: Real seconds slept per replayed second.

    """

    def __init__(
        self,
        schedule: Any,
        hook: Any,
        gpu: Any,
        controller: Any,
        clock: SimClock,
        account: StepAccount,
        time_scale: float,
    ) -> None:
        super().__init__(schedule, hook)
        self.gpu, self.controller, self.clock = gpu, controller, clock
        self.account, self.time_scale = account, time_scale
        self._inbox: dict[tuple[str, int], torch.Tensor] = {}
        stage = self.stage
        for kind, fetch, send in (
            ("forward", "get_fwd_recv_ops", "get_fwd_send_ops"),
            ("backward", "get_bwd_recv_ops", "get_bwd_send_ops"),
        ):
            self._patch(stage, fetch, self._with_clock_recv(kind, getattr(stage, fetch)))
            self._patch(stage, send, self._with_clock_send(kind, getattr(stage, send)))

    def _peer(self, stage_index: int) -> int | None:
        """Global rank of a neighbouring stage, or None past either end of the pipeline."""
        if not 0 <= stage_index < self.num_stages:
            return None
        group = self.stage.group
        return stage_index if group is None else dist.get_global_rank(group, stage_index)

    def _with_clock_recv(self, kind: str, fetch: Any) -> Any:
        upstream = -1 if kind == "forward" else 1

        def recv_ops(chunk: int) -> list[dist.P2POp]:
            ops = list(fetch(chunk))
            peer = self._peer(self.stage_index + upstream)
            if peer is not None and self._in_step:
                box = torch.zeros(1, dtype=torch.float64)
                self._inbox[(kind, chunk)] = box
                ops.append(dist.P2POp(dist.irecv, box, peer, self.stage.group, _CLOCK_TAGS[kind]))
            return ops

        return recv_ops

    def _with_clock_send(self, kind: str, fetch: Any) -> Any:
        downstream = 1 if kind == "forward" else -1

        def send_ops(chunk: int) -> list[dist.P2POp]:
            ops = list(fetch(chunk))
            peer = self._peer(self.stage_index + downstream)
            if peer is not None and self._in_step:
                box = torch.tensor([self.clock.now()], dtype=torch.float64)
                ops.append(dist.P2POp(dist.isend, box, peer, self.stage.group, _CLOCK_TAGS[kind]))
            return ops

        return send_ops

    def before_instruction(self, name: str, microbatch: int) -> None:
        """The input has arrived: so has its sender's clock."""
        box = self._inbox.pop((name, microbatch), None)
        if box is not None:
            self.clock.catch_up(float(box[0]))

    def during_instruction(self, name: str, microbatch: int) -> None:
        """Replay the instruction on the simulated GPU at the clock just requested."""
        self.controller.flush()  # The clock must be applied before the instruction runs.
        t, e = self.gpu.run(self.stage_index, name, self.time_scale)
        self.clock.advance(t)
        self.account.add(t, e)

    def before_step_end(self) -> None:
        """The iteration ends for every rank together (see :meth:`StepAccount.sync`)."""
        self.account.sync()


def _stage_group(cfg: Any) -> Any:
    """This rank's pipeline group (one per data-parallel replica), or None for the world."""
    dp = cfg.world_size // cfg.num_stages
    if dp == 1:
        return None
    groups = [
        dist.new_group([d * cfg.num_stages + s for s in range(cfg.num_stages)]) for d in range(dp)
    ]  # Every rank creates every group, in the same order.
    return groups[cfg.dp_rank]


def train_torch_pipelining(
    cfg: Any, hook: Any, gpu: Any, controller: Any, clock: SimClock
) -> dict[str, Any]:
    """Train one simulated rank with torch's schedule (``cfg``: a ``SimulatedRankConfig``).

    The model is one ``Linear + Tanh`` per stage (weights from one seed, so every replica
    matches), trained with SGD on one fixed batch; its loss is recorded (last stage).

    Returns:
        The step figures (:meth:`StepAccount.record`) plus ``losses`` (last stage only).

    """
    torch.manual_seed(0)
    modules = [
        torch.nn.Sequential(torch.nn.Linear(_WIDTH, _WIDTH), torch.nn.Tanh())
        for _ in range(cfg.num_stages)
    ]
    module = modules[cfg.pp_rank]
    group = _stage_group(cfg)
    stage = PipelineStage(module, cfg.pp_rank, cfg.num_stages, torch.device("cpu"), group=group)
    schedule = TORCH_SCHEDULES[cfg.schedule](stage, cfg.microbatches, loss_fn=torch.nn.MSELoss())
    account = StepAccount(gpu, clock, cfg.stop_file, cfg.steps_after_stop)
    gen = torch.Generator().manual_seed(1)
    rows = _ROWS_PER_MICROBATCH * cfg.microbatches
    x, y = torch.randn(rows, _WIDTH, generator=gen), torch.randn(rows, _WIDTH, generator=gen)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
    perseus = SimulatedPerseusPipeline(
        schedule, hook, gpu, controller, clock, account, cfg.time_scale
    )
    losses: list[float] = []
    try:
        for _ in range(cfg.steps):
            account.begin(hook)
            if stage.is_first:
                schedule.step(x)
            elif stage.is_last:
                step_losses: list[Any] = []
                schedule.step(target=y, losses=step_losses)
                losses.append(float(sum(loss.item() for loss in step_losses)))
            else:
                schedule.step()
            optimizer.step()
            optimizer.zero_grad()
            if account.end():
                break
    finally:
        perseus.close()  # Restores the stage and schedule; the caller closes the hook.
    return {**account.record(hook), "losses": losses}
