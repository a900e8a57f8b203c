"""The maximum power limit comes back when a process ends, in a forked child too (not a plain fork).

NVML is the in-process fake (tests/fake_nvml_power.py): no real GPU setting is ever written.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_max_restored_at_interpreter_exit() -> None:
    script = """
import atexit
from tests import fake_nvml_power as fake
# Before multiprocessing's exit function (imported below), whose finalizers restore: runs last.
atexit.register(lambda: print("limits", [mw for _, mw in fake.STATE.set_calls]))
from worker_client.power_limit.optimizer import GlobalPowerLimitOptimizer
fake.reset(num_gpus=1, min_limit_mw=160_000, max_limit_mw=300_000)
training = fake.ReplayTraining({300: (0.1, 280.0), 250: (0.1, 240.0)}, [0])
opt = GlobalPowerLimitOptimizer(fake.ReplayMonitor(training), wait_steps=0, warmup_steps=1,
                                profile_steps=1, pl_step=50)
fake.run_steps(opt, training, 3)
"""
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "limits [250000, 300000]"


def test_max_restored_at_the_end_of_a_forked_multiprocessing_child() -> None:
    # A rank in a child forked by multiprocessing ends without atexit: the optimizer's atexit
    # handler never ran there, and the GPU stayed at the optimum after training.
    script = """
import multiprocessing as mp
from multiprocessing.util import Finalize
from tests import fake_nvml_power as fake
from worker_client.power_limit.optimizer import GlobalPowerLimitOptimizer
def train():
    fake.reset(num_gpus=1, min_limit_mw=160_000, max_limit_mw=300_000)
    training = fake.ReplayTraining({300: (0.1, 280.0), 250: (0.1, 240.0)}, [0])
    opt = GlobalPowerLimitOptimizer(fake.ReplayMonitor(training), wait_steps=0,
                                    warmup_steps=1, profile_steps=1, pl_step=50)
    fake.run_steps(opt, training, 3)
    show = lambda: print("limits", [mw for _, mw in fake.STATE.set_calls])
    Finalize(None, show, exitpriority=-1)  # after the exit finalizers of priority >= 0
if __name__ == "__main__":
    child = mp.get_context("fork").Process(target=train)
    child.start()
    child.join()
"""
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "limits [250000, 300000]"


def test_a_plain_fork_that_exits_leaves_the_power_limit_alone() -> None:
    # A plain fork leaving through sys.exit runs the exit handlers it inherited: the
    # optimizer's restored the maximum limit there, under its parent training at the optimum.
    script = """
import atexit, os, sys
from tests import fake_nvml_power as fake
atexit.register(lambda: print(os.getpid() == parent, [mw for _, mw in fake.STATE.set_calls]))
from worker_client.power_limit.optimizer import GlobalPowerLimitOptimizer
fake.reset(num_gpus=1, min_limit_mw=160_000, max_limit_mw=300_000)
training = fake.ReplayTraining({300: (0.1, 280.0), 250: (0.1, 240.0)}, [0])
opt = GlobalPowerLimitOptimizer(fake.ReplayMonitor(training), wait_steps=0, warmup_steps=1,
                                profile_steps=1, pl_step=50)
fake.run_steps(opt, training, 3)
parent = os.getpid()
if os.fork() == 0:
    sys.exit(0)
os.wait()
"""
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, check=True
    )
    # The fork's NVML calls (a copy of the fake's record) first, then the parent's at its exit.
    assert out.stdout.splitlines() == ["False [250000]", "True [250000, 300000]"]
