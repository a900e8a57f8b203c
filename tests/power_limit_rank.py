"""Run by tests/test_power_limit.py: one rank of a two-rank job under the power-limit optimizer.

Usage: python -m tests.power_limit_rank RANK INIT_FILE PROFILE_PATH [MAX_LIMIT_W [OPTION]].
Each rank drives its own fake GPU (tests/fake_nvml_power.py, 200-300 W unless MAX_LIMIT_W
lowers its maximum) and reduces over a gloo group. OPTION ``energy`` passes ``Energy()``
(default: none, the optimizer's own selector); ``fail-window`` gives this rank a monitor that
fails to end the 250 W window; ``fail-window-carry`` does too, with ``carry_across_epochs`` and
3-step epochs (the window then fails at an epoch end); ``fail-monitor`` makes this rank's
``EnergyMonitor`` fail to start and hands its error to ``refuse_to_start``. With 5-step epochs
(Zeus's default mode): ``fail-cancel``, a monitor that fails to cancel the 250 W window at the
epoch end; ``fail-set-epoch``, NVML fails to set 250 W again after the epoch end; ``fail-max``,
NVML fails to restore 300 W at the epoch end. Without epochs, ``fail-set``: NVML fails to set
250 W once 300 W is measured; ``fail-start``, NVML fails to raise a GPU left at 250 W to
300 W as the optimizer starts. ``fail-set-carry``: with ``carry_across_epochs`` and 4-step
epochs, NVML fails to set 250 W again as its paused warm-up resumes. ``fail-optimum``: once
every limit is measured, NVML fails to set the optimum it chose (250 W), once; training then
goes on for one step more (so does ``go-on``, on a rank that fails in nothing).
``fail-optimum-loaded``: the profile PROFILE_PATH holds is loaded, and NVML fails to set its
optimum (250 W) as the optimizer starts. ``fail-selector``: a selector that raises once every
limit is measured. Prints its final state, or the error that refused
the optimizer, or the error training raised and the state then (and the GPU's limit, in W,
after the step more).
:func:`run_two_ranks` starts two of them.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from protocol.exceptions import ConfigError, GPUError, PerseusError
from protocol.models import PowerLimitMeasurement
from tests import fake_nvml_power as fake
from worker_client.gpu.energy import EnergyMonitor
from worker_client.gpu.nvml import NVML
from worker_client.power_limit.optimizer import Energy, GlobalPowerLimitOptimizer, refuse_to_start

TABLE = {300: (0.100, 280.0), 250: (0.104, 245.0), 200: (0.115, 198.0)}


class FailingMonitor(fake.ReplayMonitor):
    """Its energy sampler dies in the 250 W window: ending it raises, as EnergyMonitor's does."""

    def end_window(self, name: str) -> fake.WindowResult:
        result = super().end_window(name)
        if name.endswith("_250"):
            raise GPUError("the energy sampler thread failed: GPU is lost")
        return result


class FailingCancelMonitor(fake.ReplayMonitor):
    """Its energy sampler dies in the 250 W window: cancelling it raises."""

    def cancel_window(self, name: str) -> None:
        if name.endswith("_250"):
            raise GPUError("the energy sampler thread failed: GPU is lost")
        super().cancel_window(name)


class RefusingNVML(NVML):
    """The fake GPUs' NVML, failing the ``first``-th to ``last``-th writes of ``watts``."""

    def __init__(self, watts: int, first: int, last: int | None = None) -> None:
        super().__init__(fake.__name__)
        self.watts, self.first, self.last, self.writes = watts, first, last, 0

    def set_power_limit_mw(self, index: int, milliwatts: int) -> None:
        if milliwatts == self.watts * 1000:
            self.writes += 1
            if self.first <= self.writes <= (self.last or self.writes):
                raise GPUError(
                    f"NVML nvmlDeviceSetPowerManagementLimit on GPU {index} failed: lost"
                )
        super().set_power_limit_mw(index, milliwatts)


class FailingSelector(Energy):
    """A user's selector that fails on this rank (it reads a file this node lacks, say)."""

    def select(self, measurements: Sequence[PowerLimitMeasurement]) -> int:
        raise ConfigError("the selector's table is missing on this node")


REFUSALS = {
    "fail-set": (250, 1),
    "fail-set-epoch": (250, 2),
    "fail-set-carry": (250, 2),
    "fail-max": (300, 1),
    "fail-start": (300, 1),
    "fail-optimum": (250, 2, 2),  # the first write of 250 W is the one that profiles it
    "fail-optimum-loaded": (250, 1),
}
GO_ON = ("go-on", "fail-optimum")
EPOCH_STEPS = {
    "fail-window-carry": 3,
    "fail-set-carry": 4,
    "fail-cancel": 5,
    "fail-set-epoch": 5,
    "fail-max": 5,
}


# close-early: past 300 W's all-reduce (steps 1-4, with the ranks' wait 0, warm-up 1, profile
# 2 steps), in 250 W's profiling.
CLOSE_AFTER_STEPS = 6


def main() -> None:
    rank, init, profile_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    # A rank left waiting in a collective fails in seconds, not after gloo's 30 minutes.
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=2, timeout=timedelta(seconds=30)
    )
    max_w = int(sys.argv[4]) if len(sys.argv) > 4 else 300
    fake.reset(num_gpus=1, min_limit_mw=200_000, max_limit_mw=max_w * 1000)
    training = fake.ReplayTraining(TABLE, [0])
    option = sys.argv[5] if len(sys.argv) > 5 else ""
    selector = {"energy": Energy(), "fail-selector": FailingSelector()}.get(option)
    monitor_type = fake.ReplayMonitor
    if option.startswith("fail-window"):
        monitor_type = FailingMonitor
    elif option == "fail-cancel":
        monitor_type = FailingCancelMonitor
    nvml = RefusingNVML(*REFUSALS[option]) if option in REFUSALS else None
    carry = option.endswith("-carry")
    epoch_steps = EPOCH_STEPS.get(option)
    if option == "fail-start":
        fake.STATE.gpus[0].limit_mw = 250_000  # left low by a crashed job
    if option == "fail-monitor":
        try:  # as README's usage, on a node whose GPU 0 is this rank's only one
            EnergyMonitor(gpu_indices=[1], nvml=NVML(fake.__name__))
        except ConfigError as exc:
            try:
                refuse_to_start(exc)
            except ConfigError as again:
                print(f"ConfigError: {again}", flush=True)
                dist.destroy_process_group()
                return
    try:
        opt = GlobalPowerLimitOptimizer(
            monitor_type(training),
            optimum_selector=selector,
            wait_steps=0,
            warmup_steps=1,
            profile_steps=2,
            pl_step=50,
            profile_path=profile_path,
            restore_on_exit=False,
            carry_across_epochs=carry,
            nvml=nvml,
        )
    except PerseusError as exc:  # its ConfigError or GPUError, or another rank's
        print(f"{type(exc).__name__}: {exc}", flush=True)
        dist.destroy_process_group()
        return
    if option == "close-early":  # this rank stops training mid-profiling; the others go on
        fake.run_steps(opt, training, CLOSE_AFTER_STEPS)
        opt.close()
        print("closed", fake.describe_state(opt.state), fake.STATE.gpus[0].limit_mw // 1000)
        dist.destroy_process_group()
        return
    try:
        fake.run_steps(opt, training, 20 if carry else 12, epoch_steps=epoch_steps)
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}", flush=True)
        if option in GO_ON:  # training goes on, and so does the optimizer
            opt.on_step_begin()
    print(fake.describe_state(opt.state), len(opt.measurements), flush=True)
    if option in GO_ON:
        print(fake.STATE.gpus[0].limit_mw // 1000, flush=True)
    dist.destroy_process_group()


def run_two_ranks(tmp_path: Path, *rank_args: list[str], stderr: bool = False) -> list[str]:
    """Run this script as ranks 0 and 1 of a gloo group; their outputs (``stderr``: and logs)."""
    from tests.helpers import subprocess_env  # the ranks need none of its imports

    init = tmp_path / "pg"
    root = Path(__file__).resolve().parent.parent
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.power_limit_rank", str(rank), str(init), *args],
            cwd=root,
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, args in enumerate(rank_args)
    ]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
            outputs.append(out + err if stderr else out)
    finally:
        for proc in procs:
            proc.kill()
    return outputs


if __name__ == "__main__":
    main()
