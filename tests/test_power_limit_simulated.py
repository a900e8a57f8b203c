"""The power-limit optimizer on the simulated GPU: examples/power_limit.py --gpu simulated.

The example runs the code a real GPU runs (EnergyMonitor on an NVML facade, the optimizer, the
same printout); the simulated GPU throttles its clock to fit the power limit. The expected
figures come from the simulated GPU's own replay table.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from worker_client.power_limit.profile import load_profile_file
from worker_client.simulated.gpu import GRAPHICS_CLOCKS, POWER_LIMIT_RANGE_MW
from worker_client.simulated.instruction_table import synthetic_instruction_table

ROOT = Path(__file__).resolve().parent.parent
PL_STEP, WARMUP, PROFILE = 100, 1, 8


def model_window(limit_w: int) -> tuple[float, float]:
    """(time, energy) of PROFILE steps (forward + backward) at ``limit_w`` with no overhead."""
    table = synthetic_instruction_table(1)
    time_s = energy_j = 0.0
    for name in ("forward", "backward"):
        # The simulated GPU runs at the highest clock whose power fits under the limit.
        clock = next(
            f
            for f in GRAPHICS_CLOCKS
            if table.expected(0, name, f)[1] / table.expected(0, name, f)[0] <= limit_w
        )
        t, e = table.expected(0, name, clock)
        time_s, energy_j = time_s + t, energy_j + e
    return PROFILE * time_s, PROFILE * energy_j


def test_example_profiles_the_simulated_gpu(tmp_path: Path) -> None:
    profile_path = tmp_path / "profile.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PERSEUS_SIM_GPU_DIR=str(tmp_path / "gpus"))
    # The simulated GPU is not a CUDA device: a host's CUDA_VISIBLE_DEVICES must not remap it.
    env["CUDA_VISIBLE_DEVICES"] = "1"
    args = [
        "--gpu=simulated",
        f"--pl-step={PL_STEP}",
        f"--warmup-steps={WARMUP}",
        f"--profile-steps={PROFILE}",
        "--selector=energy",
        f"--profile-path={profile_path}",
        "--epoch-steps=12",  # a limit that straddles an epoch end starts over
        "--after-steps=2",
    ]
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "power_limit.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout + out.stderr
    low, high = (v // 1000 for v in POWER_LIMIT_RANGE_MW)
    ladder = list(range(high, low - 1, -PL_STEP))
    assert f"GPU 0 (simulated): power limits {low}-{high} W" in text
    assert "no energy samples" not in text  # the monitor starts once the GPU's counter moves

    measured = {
        int(pl): (float(t), float(e))
        for pl, t, e in re.findall(r"^power limit (\d+) W: ([\d.]+) s, ([\d.]+) J$", text, re.M)
    }
    assert list(measured) == ladder
    for pl, (t, e) in measured.items():
        model_t, model_e = model_window(pl)
        # Sleeps are never shorter than asked; Python overhead and a loaded machine only add
        # time (and the GPU's waiting power meanwhile); NVML sampling is within a few percent.
        assert model_t * 0.98 <= t <= model_t * 2, (pl, t, model_t)
        assert e == pytest.approx(model_e, rel=0.1), (pl, e, model_e)

    best = min(ladder, key=lambda pl: model_window(pl)[1])
    assert low < best < high  # the synthetic H100 wastes energy at both ends
    assert f"profiling done; optimal power limit {best} W" in text
    assert re.search(rf"^\* {best} ", text, re.M)  # the table marks it
    assert f"trained at {best} W; restored {high} W at the end" in text
    assert "epoch ended while profiling" in text  # short epochs restarted some limits
    saved = load_profile_file(profile_path)
    assert saved.optimal_power_limit == best
    assert [m.power_limit for m in saved.measurements] == ladder
