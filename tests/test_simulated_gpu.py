"""The simulated GPU: its NVML module, its replayed instructions and their tables."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest

from protocol.exceptions import ConfigError, GPUError
from tests.helpers import wait_for
from worker_client.gpu.frequency import FrequencyController
from worker_client.gpu.nvml import NVML
from worker_client.simulated import gpu as sim

SIM = "worker_client.simulated.gpu"


def test_simulated_nvml_reads(sim_dir: Path) -> None:
    nvml = NVML(SIM)
    assert nvml.device_count() == 8
    assert nvml.memory_clocks(0) == [2619, 1593]
    clocks = nvml.graphics_clocks(0)
    assert len(clocks) == 110 and clocks[0] == 1980 and clocks[-1] == 345
    assert all(a - b == 15 for a, b in itertools.pairwise(clocks))
    assert nvml.power_limit_constraints_mw(0) == (200_000, 700_000)
    assert nvml.power_limit_mw(0) == 700_000
    assert nvml.total_energy_mj(0) == 0
    nvml.set_power_limit_mw(0, 300_000)
    assert nvml.power_limit_mw(0) == 300_000
    with pytest.raises(GPUError):
        nvml.set_power_limit_mw(0, 100_000)
    with pytest.raises(GPUError):
        nvml.memory_clocks(8)
    nvml.shutdown()


def test_simulated_nvml_creates_its_state_folder_only_when_written(sim_dir: Path) -> None:
    # A dry-run hook on the simulated GPU only reads: it left an empty folder in /dev/shm.
    nvml = NVML(SIM)
    assert nvml.graphics_clocks(0)[0] == 1980 and nvml.total_energy_mj(0) == 0
    assert nvml.power_limit_mw(0) == 700_000 and sim.SimulatedGPU(0).current_clock() == 1980
    assert not sim_dir.exists()
    nvml.set_power_limit_mw(0, 300_000)
    assert (sim_dir / "gpu0.json").is_file()
    sim.reset_state()
    assert not sim_dir.exists() and nvml.power_limit_mw(0) == 700_000
    nvml.shutdown()


def test_simulated_invalid_clock(sim_dir: Path) -> None:
    nvml = NVML(SIM)
    with pytest.raises(GPUError, match="Invalid Argument"):
        nvml.lock_gpu_clocks(0, 1234)
    with pytest.raises(GPUError, match="Invalid Argument"):
        nvml.lock_memory_clocks(0, 2000)
    with pytest.raises(sim.NVMLError) as info:
        sim.nvmlDeviceSetGpuLockedClocks(sim.nvmlDeviceGetHandleByIndex(0), 1500, 1234)
    assert info.value.value == sim.NVML_ERROR_INVALID_ARGUMENT
    assert sim.SimulatedGPU(0).current_clock() == 1980  # unchanged
    nvml.shutdown()


def test_simulated_denied_writes(sim_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERSEUS_SIM_GPU_DENY", "1")
    nvml = NVML(SIM)
    assert nvml.graphics_clocks(0)[0] == 1980  # reads still work
    with pytest.raises(GPUError, match="no permission"):
        nvml.lock_gpu_clocks(0, 1500)
    nvml.shutdown()


@pytest.mark.parametrize("deny", ["true", "yes", "", " 1"])
def test_a_simulated_gpu_deny_that_is_no_0_or_1_is_named(
    sim_dir: Path, monkeypatch: pytest.MonkeyPatch, deny: str
) -> None:
    # "true" was ignored without a word: every write went through.
    monkeypatch.setenv("PERSEUS_SIM_GPU_DENY", deny)
    with pytest.raises(ConfigError, match=rf"PERSEUS_SIM_GPU_DENY must be 1 .* got '{deny}'"):
        NVML(SIM)
    with pytest.raises(ConfigError, match="PERSEUS_SIM_GPU_DENY"):
        sim.writes_denied()


def test_simulated_deny_0_allows_writes(sim_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERSEUS_SIM_GPU_DENY", "0")
    nvml = NVML(SIM)
    nvml.lock_gpu_clocks(0, 1500)
    assert sim.SimulatedGPU(0).current_clock() == 1500
    nvml.shutdown()


@pytest.mark.parametrize("count", ["abc", "2.5", "-1"])
def test_a_simulated_gpu_count_that_is_no_count_is_named(
    sim_dir: Path, monkeypatch: pytest.MonkeyPatch, count: str
) -> None:
    # "abc" was "invalid literal for int() with base 10: 'abc'", naming no variable; "-1" an
    # NVML "Invalid Argument" for GPU 0.
    monkeypatch.setenv("PERSEUS_SIM_GPU_COUNT", count)
    with pytest.raises(ValueError, match=rf"PERSEUS_SIM_GPU_COUNT must be .* got '{count}'"):
        sim.device_count()


def test_controller_drives_simulated_gpu(sim_dir: Path) -> None:
    gpu = sim.SimulatedGPU(1)
    assert gpu.current_clock() == 1980
    with FrequencyController(1, SIM) as ctrl:
        assert gpu.state()["mem_locked"] == [2619, 2619]
        ctrl.set_frequency(1500)
        ctrl.flush()
        assert gpu.current_clock() == 1500  # set in the side process, read here
        ctrl.set_frequency(1005)
        wait_for(lambda: gpu.current_clock() == 1005, timeout=15)
        assert sim.SimulatedGPU(0).current_clock() == 1980  # other devices untouched
    assert gpu.current_clock() == 1980
    assert gpu.state()["mem_locked"] is None


def test_run_adds_exactly_the_replayed_energy(sim_dir: Path) -> None:
    table = sim.InstructionTable(
        [
            (0, "forward", 1980, 0.010, 6.0),
            (0, "forward", 1500, 0.012, 5.0),
            (0, "backward", 1980, 0.02, 12.0),
        ],
        blocking_power_w=80.0,
    )
    gpu = sim.SimulatedGPU(0, state_dir=sim_dir, table=table)
    assert gpu.run(0, "forward", time_scale=0) == (0.010, 6.0)
    assert gpu.energy_mj() == pytest.approx(6000.0)
    nvml = NVML(SIM)
    nvml.lock_gpu_clocks(0, 1500)
    start = time.monotonic()
    assert gpu.run(0, "forward") == (0.012, 5.0)
    assert time.monotonic() - start >= 0.012  # it slept the instruction's time
    assert gpu.energy_mj() == pytest.approx(11000.0)
    assert nvml.power_mw(0) == pytest.approx(5.0 / 0.012 * 1000, abs=1)
    assert gpu.idle(0.5) == pytest.approx(40.0)
    assert nvml.total_energy_mj(0) == 51000
    nvml.shutdown()


def test_power_limit_throttles(sim_dir: Path) -> None:
    table = sim.synthetic_instruction_table(1)
    gpu = sim.SimulatedGPU(0, table=table)
    t_free, _ = gpu.run(0, "forward", time_scale=0)
    nvml = NVML(SIM)
    nvml.set_power_limit_mw(0, 300_000)
    t_capped, e_capped = gpu.run(0, "forward", time_scale=0)
    assert t_capped > t_free
    assert e_capped / t_capped <= 300.0
    nvml.shutdown()


def test_instruction_table_lookup() -> None:
    table = sim.InstructionTable(
        [
            {
                "stage": "0",
                "instruction": "forward",
                "frequency": "1000",
                "time": "2.0",
                "energy": "20",
            },
            {
                "stage": "0",
                "instruction": "forward",
                "frequency": "2000",
                "time": "1.0",
                "energy": "30",
            },
            {
                "stage": "0",
                "instruction": "forward",
                "frequency": "2000",
                "time": "1.0",
                "energy": "40",
                "rank": "4",
            },
        ]
    )
    assert table[(0, "forward", 2000)] == (1.0, 35.0)  # duplicates averaged
    assert table.lookup(0, "forward", 1500) == pytest.approx((1.5, 27.5))  # interpolated
    assert table.lookup(0, "forward", 500) == (2.0, 20.0)  # nearest below the range
    assert table.lookup(0, "forward", 2500) == (1.0, 35.0)
    assert len(table) == 2 and table.frequencies(0, "forward") == [1000, 2000]
    with pytest.raises(KeyError):
        table.lookup(1, "forward", 1000)


def test_instruction_table_noise_is_seeded(tmp_path: Path) -> None:
    rows = [(0, "forward", 1980, 0.01, 5.0)]
    a = sim.InstructionTable(rows, noise=0.05, seed=7)
    b = sim.InstructionTable(rows, noise=0.05, seed=7)
    draws = [a.lookup(0, "forward", 1980) for _ in range(2000)]
    assert draws[:5] == [b.lookup(0, "forward", 1980) for _ in range(5)]
    mean_t = sum(t for t, _ in draws) / len(draws)
    assert mean_t == pytest.approx(0.01, rel=0.01)
    assert len({t for t, _ in draws}) > 1000
    path = tmp_path / "profile.csv"
    a.to_csv(path)
    assert dict(sim.InstructionTable.from_csv(path)) == dict(a)


def test_synthetic_energy_minimum_inside_range() -> None:
    clocks = sorted(sim.GRAPHICS_CLOCKS, reverse=True)
    table = sim.synthetic_instruction_table(4, clocks, imbalance=[1.0, 0.9, 1.0, 1.3])
    for stage in range(4):
        for inst in ("forward", "backward"):
            energies = [table[(stage, inst, f)][1] for f in clocks]
            best = energies.index(min(energies))
            assert 0 < best < len(clocks) - 1
            # A high-to-low scan that stops after 5 consecutive rises stops inside the range.
            rises, stop = 0, None
            for i in range(1, len(energies)):
                rises = rises + 1 if energies[i] > energies[i - 1] else 0
                if rises == 5:
                    stop = clocks[i]
                    break
            assert stop is not None and stop > 345
    fwd = table[(0, "forward", 1980)][0]
    assert table[(0, "backward", 1980)][0] == pytest.approx(2 * fwd)
    assert table[(3, "forward", 1980)][0] == pytest.approx(1.3 * fwd)
    # H100-like magnitude: hundreds of Watts at the max clock, and slower at lower clocks.
    t, e = table[(0, "forward", 1980)]
    assert 400 < e / t <= 700
    assert table[(0, "forward", 990)][0] > t
    with pytest.raises(ValueError):
        sim.synthetic_instruction_table(2, imbalance=[1.0])
