"""Hook overhead per step: PerseusPipeline vs the bare torch schedule, in the same run (CPU).

Rank processes (gloo on CPU) each build two identical stages of a small MLP with the same
schedule: one bare, one under :class:`PerseusPipeline` (a PointSolution plan served by a
private coordinator and rq worker, dry-run clocks, energy from the simulated GPU's counter,
results reported every 10 steps). Blocks of ``--block`` steps alternate between the two, so
drift of the machine's load hits both alike; the first round is a warm-up and is dropped.
Every step starts after a barrier and its time is the slowest rank's (all-reduce MAX).

Two set-ups: 1 rank holding the whole (1-stage) pipeline, where nothing but the hook differs
and the figure is stable, and 4 ranks (one stage each), where process scheduling on a small
machine adds noise to both columns.

    python benchmarks/bench_pipelining.py [--rounds 40] [--block 2] [--width 256]

Prints, per set-up and schedule, the median step time of each, the overhead per step and per
action (each rank runs 2 x microbatches actions per step) and the ratio hooked / bare.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MICROBATCHES = 8


def _plan_text(schedule: str, stages: int, folder: Path) -> str:
    """An all-max plan in the schedule's order."""
    from protocol.pipeline_schedules import stage_order
    from schedulers.planning.plan_file import write_plan_file

    lines = [
        [(n, 1980) for n in stage_order(schedule, stages, MICROBATCHES, s)] for s in range(stages)
    ]
    path = folder / f"{schedule}-{stages}.py"
    write_plan_file(path, lines, {"pipeline_schedule": schedule})
    return path.read_text()


def _rank(rank: int, world: int, init: str, url: str, args: dict[str, Any], out: str) -> None:
    """One rank: alternate bare and hooked blocks for each schedule; write step times."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from worker_client.gpu.nvml import SIMULATED_NVML
    from worker_client.integrations.torch_pipelining import PerseusPipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    width = args["width"]
    x = torch.randn(4 * MICROBATCHES, width)
    y = torch.randn(4 * MICROBATCHES, width)
    results: dict[str, dict[str, list[float]]] = {}
    for name, cls in (("1f1b", Schedule1F1B), ("gpipe", ScheduleGPipe)):
        runs = {}
        for kind in ("bare", "hooked"):
            torch.manual_seed(rank)
            model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
            stage = PipelineStage(model, rank, world, torch.device("cpu"))
            runs[kind] = (stage, cls(stage, MICROBATCHES, loss_fn=torch.nn.MSELoss()))
        perseus = PerseusPipeline(
            runs["hooked"][1],
            redis_url=url,
            job_metadata=f"bench-{name}-{world}",
            scheduler="PointSolution",
            scheduler_args={"plan_text": args["plans"][name]},
            nvml_module=SIMULATED_NVML,
            controller="dry-run",
            report_every=10,
        )
        times: dict[str, list[float]] = {"bare": [], "hooked": []}
        for round_ in range(args["rounds"] + 1):
            for kind in ("bare", "hooked"):
                stage, schedule = runs[kind]
                inputs = (x,) if stage.is_first else ()
                targets = {"target": y} if stage.is_last else {}
                for _ in range(args["block"]):
                    dist.barrier()
                    start = time.perf_counter()
                    schedule.step(*inputs, **targets)
                    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                    dist.all_reduce(took, op=dist.ReduceOp.MAX)
                    if round_ > 0:  # Round 0 warms up both (shape inference, caches).
                        times[kind].append(float(took[0]))
        perseus.close()
        results[name] = times
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    """Start private services, spawn the ranks, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40, help="measured rounds (after 1 warm-up)")
    parser.add_argument("--block", type=int, default=2, help="steps per block")
    parser.add_argument("--width", type=int, default=256, help="MLP width per stage")
    args = parser.parse_args()

    import torch.multiprocessing as mp

    from coordinator.demo import services

    with tempfile.TemporaryDirectory() as tmp, services(None, lambda line: None) as url:
        os.environ.setdefault("PERSEUS_SIM_GPU_DIR", str(Path(tmp) / "gpu"))
        started = time.perf_counter()
        results = {}
        for world in (1, 4):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                init = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
            spec = {
                "rounds": args.rounds,
                "block": args.block,
                "width": args.width,
                "plans": {n: _plan_text(n, world, Path(tmp)) for n in ("1f1b", "gpipe")},
            }
            out = str(Path(tmp) / f"times-{world}.json")
            mp.spawn(_rank, args=(world, init, url, spec, out), nprocs=world)
            results[world] = json.loads(Path(out).read_text())
    steps = args.rounds * args.block
    print(
        f"gloo on CPU ({os.cpu_count()} cores), {MICROBATCHES} microbatches, MLP width "
        f"{args.width} per stage, {steps} measured steps of each, "
        f"{time.perf_counter() - started:.0f} s"
    )
    print(
        f"{'ranks':<6}{'schedule':<9}{'bare ms':>10}{'hooked ms':>11}{'overhead/step':>15}"
        f"{'per action':>12}{'ratio':>8}"
    )
    for world, by_schedule in results.items():
        for name, times in by_schedule.items():
            bare, hooked = statistics.median(times["bare"]), statistics.median(times["hooked"])
            extra = hooked - bare
            print(
                f"{world:<6}{name:<9}{bare * 1e3:>10.2f}{hooked * 1e3:>11.2f}"
                f"{extra * 1e3:>12.3f} ms{extra / (2 * MICROBATCHES) * 1e6:>9.1f} us"
                f"{hooked / bare:>8.3f}"
            )


if __name__ == "__main__":
    main()
