"""benchmarks/h100_measure.py --simulate: the real code path against the simulated GPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from worker_client.simulated import gpu as sim

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "h100_measure.py"
NUM = r"[-+]?[0-9]+(?:\.[0-9]+)?"

SECTIONS = [
    "== device ==",
    "== clocks ==",
    "== energy counter ==",
    "== workload ==",
    "== per-instruction time and energy ==",
    "== monitor vs power x time ==",
    "== single-instruction windows vs long windows ==",
    "== read-only check ==",
]


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PERSEUS_SIM_GPU_DIR"] = str(tmp_path / "simgpu")
    env.pop("PERSEUS_SIM_GPU_COUNT", None)
    env.pop("PERSEUS_SIM_GPU_DENY", None)
    return env


def test_simulate_prints_every_section_with_numbers(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    args = ["--simulate", "--reps", "20", "--singles", "8", "--counter-calls", "50"]
    args += ["--probe-seconds", "1.0", "--sim-power", "250", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=_env(tmp_path),
    )
    text = proc.stdout
    assert proc.returncode == 0, text + proc.stderr
    positions = [text.find(s) for s in SECTIONS]
    assert all(p >= 0 for p in positions), text
    assert positions == sorted(positions), text

    clocks = sim.GRAPHICS_CLOCKS
    assert (
        f"graphics clocks: {len(clocks)} supported, min {min(clocks)} MHz, max {max(clocks)} MHz"
        in text
    )
    assert f"Perseus would lock {max(clocks)} MHz first" in text
    assert re.search(rf"read cost: {NUM} ms/call", text)
    assert re.search(rf"update period: {NUM} ms median", text)
    for inst in ("forward", "backward"):
        assert re.search(rf"{inst}: time {NUM} ms \(std {NUM}", text), text
        assert re.search(rf"{inst}: energy {NUM} J \+- {NUM} J per call", text), text
        assert re.search(rf"{inst} window: monitor {NUM} J .* difference {NUM} J", text), text
    assert re.search(rf"interpolated: 8 one-forward windows .* {NUM}% mean", text), text
    assert re.search(r"raw counter: 8 one-forward windows .* [0-9]+ read 0 J", text), text
    assert "NVML writes unreachable" in text

    figures = json.loads(out.read_text())
    assert figures["simulated"] is True
    assert figures["clocks"]["dry_run_requests"] == [max(clocks)]
    assert figures["clocks"]["current"] == figures["clock_after"]
    period = figures["counter"]["update"]["period_median_ms"]
    assert 50 < period < 250  # the simulated counter ticks every 100 ms
    for inst in ("forward", "backward"):
        lw = figures["long_windows"][inst]
        assert lw["energy_per_call_j"] > 0 and lw["bound_per_call_j"] >= 0
        assert lw["mean_power_w"] == pytest.approx(250, rel=0.02)
        # The monitor and power x time agree within the monitor's bound (plus slack for
        # the power poller's own start/stop offsets).
        assert abs(lw["energy_j"] - lw["power_x_time_j"]) <= lw["bound_j"] + 0.05 * lw["energy_j"]
    assert figures["singles_raw_counter"]["windows"] == 8


def _run_without_nvml(*args: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import runpy, sys; sys.modules['pynvml'] = None; "
        f"sys.argv = ['h100_measure.py', *{list(args)!r}]; "
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_no_nvml_exits_cleanly_with_a_message() -> None:
    proc = _run_without_nvml()
    assert proc.returncode == 0, proc.stderr
    assert "nothing measured" in proc.stdout and "--simulate" in proc.stdout
    assert "Traceback" not in proc.stderr
    assert _run_without_nvml("--require-gpu").returncode == 1


def test_bad_arguments_are_rejected() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--simulate", "--reps", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "--reps" in proc.stderr
