"""Run by tests/test_power_limit.py: one rank of a two-rank job under the power-limit optimizer.

Usage: python -m tests.power_limit_rank RANK INIT_FILE PROFILE_PATH [MAX_LIMIT_W [SELECTOR]].
Each rank drives its own fake GPU (tests/fake_nvml_power.py, 200-300 W unless MAX_LIMIT_W
lowers its maximum) and reduces over a gloo group; SELECTOR ``energy`` passes ``Energy()``
(default: none, the optimizer's own). Prints its final state, or the ConfigError that refused
the optimizer.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch.distributed as dist

from protocol.exceptions import ConfigError
from tests import fake_nvml_power as fake
from worker_client.power_limit.optimizer import Energy, GlobalPowerLimitOptimizer

TABLE = {300: (0.100, 280.0), 250: (0.104, 245.0), 200: (0.115, 198.0)}


def main() -> None:
    rank, init, profile_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    # A rank left waiting in a collective fails in seconds, not after gloo's 30 minutes.
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=2, timeout=timedelta(seconds=30)
    )
    max_w = int(sys.argv[4]) if len(sys.argv) > 4 else 300
    fake.reset(num_gpus=1, min_limit_mw=200_000, max_limit_mw=max_w * 1000)
    training = fake.ReplayTraining(TABLE, [0])
    selector = Energy() if len(sys.argv) > 5 and sys.argv[5] == "energy" else None
    try:
        opt = GlobalPowerLimitOptimizer(
            fake.ReplayMonitor(training),
            optimum_selector=selector,
            wait_steps=0,
            warmup_steps=1,
            profile_steps=2,
            pl_step=50,
            profile_path=profile_path,
            restore_on_exit=False,
        )
    except ConfigError as exc:
        print(f"ConfigError: {exc}", flush=True)
        dist.destroy_process_group()
        return
    fake.run_steps(opt, training, 12)
    print(fake.describe_state(opt.state), len(opt.measurements), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
