"""Perseus on torch.distributed.pipelining: 4 ranks (gloo, CPU) train a small MLP with Schedule1F1B.

Runs on a machine without a GPU (simulated GPU, dry-run clocks):

    python examples/torch_pipelining.py                      # starts its own Redis and services
    python examples/torch_pipelining.py --schedule gpipe     # ScheduleGPipe instead
    python examples/torch_pipelining.py --redis-url URL      # on that Redis (the service user)

The job names its scheduler (PointSolution) and sends a plan made for the schedule it runs.
In real training you run `perseus coordinator` and `perseus worker` as services, plan with
`perseus optimize --schedule 1f1b|gpipe`, and keep only the part between the
"--- your training script ---" markers: it differs from plain torch by two lines.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from coordinator.cli_common import stop_signals_interrupt
from coordinator.demo import services
from protocol.exceptions import PerseusError
from protocol.pipeline_schedules import stage_order
from schedulers.planning.plan_file import write_plan_file

STAGES, MICROBATCHES, WIDTH = 4, 8, 16
SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


def make_plan(folder: Path, schedule: str) -> str:
    """A plan's text: each stage's forwards at 1410 MHz, backwards at 1980 MHz."""
    stages = [
        [
            (name, 1410 if name == "forward" else 1980)
            for name in stage_order(schedule, STAGES, MICROBATCHES, s)
        ]
        for s in range(STAGES)
    ]
    path = folder / "freqs_pipeline_00000.py"
    write_plan_file(path, stages, {"plan": 0, "pipeline_schedule": schedule})
    return path.read_text()


def main() -> None:
    """Start services (unless --redis-url), then spawn one process per pipeline stage."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--redis-url",
        help="run on this Redis: a coordinator and an rq worker are started there beside any "
        "running ones, so with ACL users give the service user's URL",
    )
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    args = parser.parse_args()
    # SIGTERM and SIGHUP stop it as Ctrl-C does: the private Redis and rq worker (sessions of
    # their own) and the ranks stop too (they were left running, the ranks waiting).
    with (
        stop_signals_interrupt(),
        tempfile.TemporaryDirectory() as tmp,
        services(args.redis_url, print) as url,
    ):
        os.environ.setdefault("PERSEUS_SIM_GPU_DIR", str(Path(tmp) / "gpu"))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        plan_text = make_plan(Path(tmp), args.schedule)
        ranks = mp.spawn(
            train, args=(init, url, args.schedule, plan_text), nprocs=STAGES, join=False
        )
        try:
            while not ranks.join():
                pass
        finally:  # interrupted: the ranks go first, then the services they use
            for proc in ranks.processes:
                if proc.is_alive():
                    proc.terminate()
            for proc in ranks.processes:
                proc.join()


def train(rank: int, init_method: str, redis_url: str, schedule_name: str, plan_text: str) -> None:
    """One rank: a plain torch pipeline-parallel training loop, plus two lines for Perseus."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=STAGES)
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())  # this stage
    x, y = torch.randn(4 * MICROBATCHES, WIDTH), torch.randn(4 * MICROBATCHES, WIDTH)
    # --- your training script ---------------------------------------------------------------
    from worker_client.integrations.torch_pipelining import PerseusPipeline

    stage = PipelineStage(model, rank, STAGES, torch.device("cpu"))
    schedule = SCHEDULES[schedule_name](stage, MICROBATCHES, loss_fn=torch.nn.MSELoss())
    perseus = PerseusPipeline(  # added: every forward/backward now runs at its planned clock
        schedule,
        redis_url=redis_url,
        job_metadata="example-pipelining",
        scheduler="PointSolution",  # leave out, with scheduler_args, for the coordinator's own
        scheduler_args={"plan_text": plan_text},
        nvml_module="worker_client.simulated.gpu",  # "pynvml" on a real GPU
        controller="dry-run",  # "nvml" to really lock clocks (needs root)
        report_every=2,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        losses: list[torch.Tensor] = []
        if stage.is_first:
            schedule.step(x)
        elif stage.is_last:
            schedule.step(target=y, losses=losses)
            print(f"step {step}: loss {sum(loss.item() for loss in losses):.4f}")
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad()
    clocks = [f for _, f in perseus.hook.controller.records][:4]  # type: ignore[attr-defined]
    print(f"rank {rank}: job {perseus.hook.job_id}, clocks requested {clocks} ...", flush=True)
    perseus.close()  # added: flushes results, stops the hook
    dist.destroy_process_group()
    # --- end of your training script ---------------------------------------------------------


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit("interrupted: ranks, rq worker and private Redis stopped")
    except PerseusError as exc:  # a URL it cannot use, say: the error names it, in one line
        sys.exit(f"torch_pipelining.py: error: {exc}")
