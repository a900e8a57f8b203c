"""Run by tests/test_power_limit.py: one rank of a two-rank job under the power-limit optimizer.

Usage: python -m tests.power_limit_rank RANK INIT_FILE PROFILE_PATH. Each rank drives its own
fake GPU (tests/fake_nvml_power.py) and reduces over a gloo group; prints its final state.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from tests import fake_nvml_power as fake
from worker_client.power_limit.optimizer import GlobalPowerLimitOptimizer

TABLE = {300: (0.100, 280.0), 250: (0.104, 245.0), 200: (0.115, 198.0)}


def main() -> None:
    rank, init, profile_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    fake.reset(num_gpus=1, min_limit_mw=200_000, max_limit_mw=300_000)
    training = fake.ReplayTraining(TABLE, [0])
    opt = GlobalPowerLimitOptimizer(
        fake.ReplayMonitor(training),
        wait_steps=0,
        warmup_steps=1,
        profile_steps=2,
        pl_step=50,
        profile_path=profile_path,
        restore_on_exit=False,
    )
    fake.run_steps(opt, training, 12)
    print(fake.describe_state(opt.state), len(opt.measurements), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
