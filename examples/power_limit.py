"""Run the power-limit optimizer on a simulated GPU (no GPU needed) or on a real one.

    python examples/power_limit.py --gpu simulated   # worker_client.simulated's H100
    python examples/power_limit.py --gpu 0           # GPU 0: torch with CUDA, and root or
                                                     # CAP_SYS_ADMIN to set power limits

Both run the same code: an ``EnergyMonitor`` on an NVML facade, the
``GlobalPowerLimitOptimizer`` driven by a training loop, and the same printout (one line per
measured limit, then the profile as ``perseus power-limit show`` prints it). Only the NVML
module and the training step differ: the simulated GPU replays the synthetic H100 profile
(600 W at the maximum clock) and throttles its clock to fit the power limit, as power capping
does; on a real GPU the step is a few bf16 matrix products.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from protocol.exceptions import ConfigError, GPUError
from worker_client.gpu.energy import EnergyMonitor
from worker_client.gpu.nvml import NVML, SIMULATED_NVML
from worker_client.power_limit.arguments import check_arguments
from worker_client.power_limit.optimizer import (
    Done,
    Energy,
    GlobalPowerLimitOptimizer,
    MaxSlowdownConstraint,
    OptimumSelector,
    Time,
    ZeusCost,
)
from worker_client.power_limit.profile import format_profile
from worker_client.simulated.steps import SimulatedSteps


@contextmanager
def simulated_steps(index: int) -> Iterator[Callable[[], object]]:
    """One forward and one backward of the simulated GPU's stage 0, in real time."""
    with SimulatedSteps(index, ["forward", "backward"]) as sim:
        yield sim.step


@contextmanager
def cuda_steps(index: int) -> Iterator[Callable[[], object]]:
    """A few bf16 matrix products on CUDA device ``index``."""
    import torch  # torch with CUDA: only for a real GPU

    device = torch.device(f"cuda:{index}")
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def step() -> None:
        for _ in range(8):
            a @ b
        torch.cuda.synchronize(device)

    yield step


def make_selector(args: argparse.Namespace, gpus: int) -> OptimumSelector:
    """The selector named on the command line."""
    if args.selector == "energy":
        return Energy()
    if args.selector == "time":
        return Time()
    if args.selector == "slowdown":
        return MaxSlowdownConstraint(args.factor)
    return ZeusCost(args.eta, world_size=gpus)


def gpu_choice(value: str) -> str:
    """``--gpu``: ``simulated`` or a CUDA index (an argparse error otherwise, not a traceback)."""
    if value != "simulated" and not value.isdigit():
        raise argparse.ArgumentTypeError(f"'simulated' or a CUDA index, got {value!r}")
    return value


def positive(value: str) -> int:
    """A whole number >= 1 (``--epoch-steps 0`` looped for ever, ``--after-steps 0`` failed)."""
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"a whole number >= 1, got {value!r}")
    return int(value)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--gpu", type=gpu_choice, default="simulated", help="'simulated' or a CUDA index"
    )
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--pl-step", type=int, default=50, help="watts between two limits")
    parser.add_argument(
        "--selector", choices=["zeus-cost", "energy", "time", "slowdown"], default="zeus-cost"
    )
    parser.add_argument("--eta", type=float, default=0.5, help="ZeusCost's eta_knob")
    parser.add_argument("--factor", type=float, default=1.1, help="MaxSlowdownConstraint's")
    parser.add_argument("--epoch-steps", type=positive, default=50, help="steps per epoch")
    parser.add_argument("--carry-across-epochs", action="store_true")
    parser.add_argument("--after-steps", type=positive, default=5, help="steps run once Done")
    parser.add_argument("--profile-path", type=Path, help="profile file to load or write")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    """Profile, choose, train a few steps at the chosen limit; print what happened."""
    # The optimizer's own checks, before the GPU is opened and the header printed: a refused
    # value read "every -5 W down" first, after seconds of waiting for the energy monitor.
    selector = make_selector(args, gpus=1)
    check_arguments(
        selector,
        1,
        args.warmup_steps,
        args.profile_steps,
        args.pl_step,
        args.profile_path,
        None,
        None,
    )
    simulated = args.gpu == "simulated"
    index = 0 if simulated else int(args.gpu)
    nvml = NVML(SIMULATED_NVML) if simulated else NVML()
    # The simulated GPU 0 is NVML's index; a real --gpu is CUDA's, as EnergyMonitor takes it.
    space: Literal["cuda", "nvml"] = "nvml" if simulated else "cuda"
    low, high = nvml.power_limit_constraints_mw(index if simulated else nvml.cuda_to_nvml(index))
    name = f"GPU {index}" + (" (simulated)" if simulated else "")
    print(
        f"{name}: power limits {low // 1000}-{high // 1000} W; {args.warmup_steps} warm-up "
        f"+ {args.profile_steps} measured steps per limit, every {args.pl_step} W down"
    )
    steps = simulated_steps(index) if simulated else cuda_steps(index)
    # Simulated NVML reads are cheap: sample often so that short windows are measured well.
    interval = 0.01 if simulated else 0.1
    # The monitor is built once the steps run (it waits for its first energy samples, and the
    # simulated GPU's counter moves from then on), hence inside this `with`.
    with (
        steps as step,
        EnergyMonitor([index], nvml=nvml, sample_interval=interval, index_space=space) as mon,
    ):
        optimizer = GlobalPowerLimitOptimizer(
            mon,
            selector,
            wait_steps=1,
            warmup_steps=args.warmup_steps,
            profile_steps=args.profile_steps,
            pl_step=args.pl_step,
            profile_path=args.profile_path,
            carry_across_epochs=args.carry_across_epochs,
        )
        try:
            steps_left = args.after_steps
            while steps_left > 0:
                for _ in range(args.epoch_steps):
                    optimizer.on_step_begin()
                    step()
                    optimizer.on_step_end()
                    if isinstance(optimizer.state, Done):
                        steps_left -= 1
                        if steps_left == 0:
                            break
                optimizer.on_epoch_end()
        finally:
            optimizer.close()
    profile = optimizer.profile()
    assert profile is not None
    print(format_profile(name, profile))
    print(f"trained at {profile.optimal_power_limit} W; restored {high // 1000} W at the end")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; the simulated GPU's state lives in a temporary folder unless set."""
    logging.basicConfig(format="%(message)s", stream=sys.stdout)  # in order with print()
    logging.getLogger("worker_client.power_limit").setLevel(logging.INFO)
    args = parse_args(argv)
    try:
        if args.gpu != "simulated":
            try:
                return run(args)
            except GPUError as exc:
                print(f"--gpu {args.gpu}: {exc}", file=sys.stderr)
                print("(without a GPU, run this example with --gpu simulated)", file=sys.stderr)
                return 1
        if os.environ.get("PERSEUS_SIM_GPU_DIR"):
            return run(args)
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None  # tmpfs: fast state files
        with tempfile.TemporaryDirectory(prefix="perseus-sim-gpu-", dir=shm) as state:
            os.environ["PERSEUS_SIM_GPU_DIR"] = state
            return run(args)
    except ConfigError as exc:  # an option the optimizer refuses (it names the argument)
        print(f"power_limit.py: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
