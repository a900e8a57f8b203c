"""FrequencyController, its dry-run twin, and the simulated GPU (never a real GPU's clocks)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from protocol.exceptions import GPUError
from tests.fake_nvml import read_log
from tests.helpers import ROOT, subprocess_env, wait_for
from worker_client.gpu.frequency import (
    DryRunFrequencyController,
    FrequencyController,
    make_controller,
)
from worker_client.gpu.nvml import NVML
from worker_client.simulated import gpu as sim

FAKE = "tests.fake_nvml"
SIM = "worker_client.simulated.gpu"
WRITES = (
    "nvmlDeviceSetGpuLockedClocks",
    "nvmlDeviceResetGpuLockedClocks",
    "nvmlDeviceSetMemoryLockedClocks",
    "nvmlDeviceResetMemoryLockedClocks",
    "nvmlDeviceSetPowerManagementLimit",
)


def writes(log: Path) -> list[tuple[str, list[int]]]:
    return [(name, args) for name, args in read_log(log) if name in WRITES]


@pytest.fixture
def fake_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Route the fake NVML's call log to a temp file; spawned children inherit the env."""
    log = tmp_path / "nvml.jsonl"
    monkeypatch.setenv("FAKE_NVML_LOG", str(log))
    monkeypatch.delenv("FAKE_NVML_DENY", raising=False)
    monkeypatch.setenv("PYTHONPATH", subprocess_env()["PYTHONPATH"])
    return log


@pytest.fixture
def sim_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private state directory for the simulated GPUs."""
    directory = tmp_path / "simgpu"
    monkeypatch.setenv("PERSEUS_SIM_GPU_DIR", str(directory))
    monkeypatch.delenv("PERSEUS_SIM_GPU_DENY", raising=False)
    monkeypatch.delenv("PERSEUS_SIM_GPU_COUNT", raising=False)
    monkeypatch.setenv("PYTHONPATH", subprocess_env()["PYTHONPATH"])
    return directory


# --- FrequencyController against the recording fake -----------------------------------------------
def test_call_sequence(fake_log: Path) -> None:
    ctrl = FrequencyController(2, FAKE)
    assert ctrl.memory_clock == 2619
    assert ctrl.graphics_clocks[0] == 1980 and ctrl.graphics_clocks[-1] == 345
    assert writes(fake_log) == [("nvmlDeviceSetMemoryLockedClocks", [2, 2619, 2619])]
    ctrl.set_frequency(1980)
    ctrl.flush()
    ctrl.set_frequency(1500)
    ctrl.flush()
    ctrl.set_frequency(1500)
    ctrl.flush()
    ctrl.stop()
    assert writes(fake_log) == [
        ("nvmlDeviceSetMemoryLockedClocks", [2, 2619, 2619]),
        ("nvmlDeviceSetGpuLockedClocks", [2, 1980, 1980]),
        ("nvmlDeviceSetGpuLockedClocks", [2, 1500, 1500]),
        ("nvmlDeviceResetGpuLockedClocks", [2]),
        ("nvmlDeviceResetMemoryLockedClocks", [2]),
    ]
    calls = read_log(fake_log)
    assert calls[0][0] == "nvmlInit" and calls[-1][0] == "nvmlShutdown"
    # NVML is owned by the side process, never by the trainer.
    pids = {line["pid"] for line in map(json.loads, fake_log.read_text().splitlines())}
    assert os.getpid() not in pids and len(pids) == 1
    assert not ctrl._process.is_alive()
    ctrl.stop()  # idempotent


def test_side_process_skips_repeats_and_coalesces(fake_log: Path) -> None:
    with FrequencyController(0, FAKE) as ctrl:
        # Bypass the parent's own de-duplication to exercise the side process's.
        for freq in (1200, 1200, 1305, 1410, 1410):
            ctrl._commands.send(freq)
        ctrl.flush()
        sets = [a for n, a in writes(fake_log) if n == "nvmlDeviceSetGpuLockedClocks"]
        assert sets[-1] == [0, 1410, 1410]
        assert len(sets) == len({tuple(s) for s in sets}) <= 3
        assert [s[1] for s in sets] == sorted(s[1] for s in sets)  # order kept


def test_permission_error_surfaces_in_parent(
    fake_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_NVML_DENY", "1")
    with pytest.raises(GPUError, match=r"Insufficient Permissions.*no permission"):
        FrequencyController(0, FAKE)
    # Nothing was locked, so nothing is reset.
    assert writes(fake_log) == [("nvmlDeviceSetMemoryLockedClocks", [0, 2619, 2619])]


def test_set_error_surfaces_on_next_call(fake_log: Path) -> None:
    ctrl = FrequencyController(0, FAKE)
    ctrl.set_frequency(1234)  # not a supported clock: the side process's call fails
    wait_for(lambda: any(a == [0, 1234, 1234] for _, a in writes(fake_log)), timeout=15)
    wait_for(lambda: ctrl._status.poll(), timeout=15)
    with pytest.raises(GPUError, match=r"Invalid Argument"):
        ctrl.set_frequency(1500)
    ctrl.set_frequency(1500)  # the controller still works after reporting
    ctrl.flush()
    ctrl.set_frequency(1234)
    with pytest.raises(GPUError, match=r"GPU 0.*Invalid Argument"):
        ctrl.flush()
    ctrl.stop()
    assert writes(fake_log)[-2:] == [
        ("nvmlDeviceResetGpuLockedClocks", [0]),
        ("nvmlDeviceResetMemoryLockedClocks", [0]),
    ]


def test_killed_side_process_resets_and_is_reported(fake_log: Path) -> None:
    ctrl = FrequencyController(0, FAKE)
    ctrl.set_frequency(1500)
    ctrl.flush()
    ctrl._process.terminate()  # SIGTERM: the side process still resets on its way out
    ctrl._process.join(10)
    assert writes(fake_log)[-2:] == [
        ("nvmlDeviceResetGpuLockedClocks", [0]),
        ("nvmlDeviceResetMemoryLockedClocks", [0]),
    ]
    with pytest.raises(GPUError, match="exited"):
        ctrl.set_frequency(1200)
    ctrl.stop()


@pytest.mark.parametrize("ending", ["atexit", "parent-killed"])
def test_side_process_resets_when_parent_goes(fake_log: Path, ending: str) -> None:
    script = (
        "import os\n"
        "from worker_client.gpu.frequency import FrequencyController\n"
        f"c = FrequencyController(1, {FAKE!r})\n"
        "c.set_frequency(1500)\n"
        "c.flush()\n" + ("os._exit(0)\n" if ending == "parent-killed" else "")
    )
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True, timeout=60)
    wait_for(
        lambda: writes(fake_log)[-1:] == [("nvmlDeviceResetMemoryLockedClocks", [1])], timeout=15
    )
    assert [n for n, _ in writes(fake_log)] == [
        "nvmlDeviceSetMemoryLockedClocks",
        "nvmlDeviceSetGpuLockedClocks",
        "nvmlDeviceResetGpuLockedClocks",
        "nvmlDeviceResetMemoryLockedClocks",
    ]


def test_a_plain_fork_that_exits_leaves_the_parents_side_process_alone(fake_log: Path) -> None:
    # multiprocessing counted the parent's side process among a plain fork's children: the
    # fork leaving through sys.exit terminated it (a daemon) and failed to join it, with
    # tracebacks, and the parent's next request raised "has exited".
    script = (
        "import os, sys\n"
        "from worker_client.gpu.frequency import FrequencyController\n"
        f"c = FrequencyController(0, {FAKE!r})\n"
        "c.set_frequency(1500)\n"
        "c.flush()\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    sys.exit(0)\n"
        "os.waitpid(child, 0)\n"
        "c.set_frequency(1200)\n"
        "c.flush()\n"
        "c.stop()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert writes(fake_log)[1:] == [
        ("nvmlDeviceSetGpuLockedClocks", [0, 1500, 1500]),
        ("nvmlDeviceSetGpuLockedClocks", [0, 1200, 1200]),
        ("nvmlDeviceResetGpuLockedClocks", [0]),
        ("nvmlDeviceResetMemoryLockedClocks", [0]),
    ]


def test_a_trainer_that_ends_with_os_exit_leaks_no_semaphore(fake_log: Path) -> None:
    # Simulated ranks end with os._exit (torch's threads can hang interpreter teardown): a
    # multiprocessing.Queue's named semaphores outlived them, and the resource tracker warned.
    script = (
        "import os\n"
        "from worker_client.gpu.frequency import FrequencyController\n"
        f"c = FrequencyController(0, {FAKE!r})\n"
        "c.set_frequency(1500)\n"
        "c.flush()\n"
        "c.stop()\n"
        "os._exit(0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "leaked" not in done.stderr, done.stderr


def test_a_stuck_side_process_never_blocks_a_request(fake_log: Path) -> None:
    ctrl = FrequencyController(0, FAKE)
    try:
        os.kill(ctrl._process.pid, signal.SIGSTOP)  # as if stuck in a driver call
        clocks = itertools.cycle((1980, 1500))
        requests = threading.Thread(
            # Far more than a pipe holds (64 KiB of ~10-byte requests).
            target=lambda: [ctrl.set_frequency(next(clocks)) for _ in range(30_000)],
            daemon=True,
        )
        requests.start()
        requests.join(60)
        assert not requests.is_alive(), "set_frequency blocked on a full pipe"
        ctrl.set_frequency(1410)  # the newest: kept back until the pipe drains
        os.kill(ctrl._process.pid, signal.SIGCONT)
        ctrl.flush(timeout=30)
        sets = [a for n, a in writes(fake_log) if n == "nvmlDeviceSetGpuLockedClocks"]
        assert sets[-1] == [0, 1410, 1410]
    finally:
        os.kill(ctrl._process.pid, signal.SIGCONT)
        ctrl.stop()
    assert writes(fake_log)[-1] == ("nvmlDeviceResetMemoryLockedClocks", [0])


def test_stopped_controller_refuses(fake_log: Path) -> None:
    ctrl = FrequencyController(0, FAKE)
    ctrl.stop()
    with pytest.raises(GPUError, match="stopped"):
        ctrl.set_frequency(1500)


def test_bad_module_fails_at_start(fake_log: Path) -> None:
    with pytest.raises(GPUError, match="cannot import NVML module"):
        FrequencyController(0, "no_such_nvml_module")


# --- dry run -------------------------------------------------------------------------------------
def test_a_side_process_that_never_starts_names_the_likely_cause(
    fake_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_NVML_INIT_DELAY", "30")
    with pytest.raises(GPUError, match=r"did not start in 1.0s.*if __name__ == \"__main__\":"):
        FrequencyController(0, FAKE, start_timeout=1.0)


def test_a_side_process_that_exits_at_start_names_the_likely_cause(tmp_path: Path) -> None:
    """A script without the ``__main__`` guard: its side process re-runs it and exits at once.

    The error said only "side process exited unexpectedly (exit code 1)".
    """
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from worker_client.gpu.frequency import FrequencyController\n"
        f"FrequencyController(0, {SIM!r}, start_timeout=60)\n"
    )
    run = subprocess.run(
        [sys.executable, str(script)],
        env=subprocess_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert "side process exited unexpectedly (exit code 1)" in last, run.stderr
    assert 'if __name__ == "__main__":' in last, last


def test_dry_run_records_and_changes_nothing(fake_log: Path, tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    with DryRunFrequencyController(3, log_path=path) as ctrl:
        for freq in (1980, 1500, 1500, 1200):
            ctrl.set_frequency(freq)
        ctrl.flush()
    assert [f for _, f in ctrl.records] == [1980, 1500, 1500, 1200]
    assert all(t0 <= t1 for (t0, _), (t1, _) in itertools.pairwise(ctrl.records))
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(d["device"], d["frequency"]) for d in lines] == [
        (3, 1980),
        (3, 1500),
        (3, 1500),
        (3, 1200),
    ]
    assert not fake_log.exists()  # no NVML at all
    assert ctrl.graphics_clocks[0] == 1980 and len(ctrl.graphics_clocks) == 110
    with pytest.raises(GPUError):
        ctrl.set_frequency(1500)


def test_dry_run_reads_clocks_only(fake_log: Path) -> None:
    ctrl = DryRunFrequencyController(0, nvml_module=FAKE)
    ctrl.set_frequency(1500)
    ctrl.stop()
    assert ctrl.memory_clock == 2619
    assert writes(fake_log) == []


def test_make_controller(fake_log: Path, sim_dir: Path) -> None:
    assert isinstance(make_controller("dry-run", 0), DryRunFrequencyController)
    ctrl = make_controller("simulated", 0)
    assert isinstance(ctrl, FrequencyController) and ctrl.nvml_module == SIM
    ctrl.stop()
    with pytest.raises(ValueError):
        make_controller("bogus", 0)  # type: ignore[arg-type]


# --- simulated GPU -------------------------------------------------------------------------------
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


def test_no_nvidia_driver_says_what_to_use_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_NVML_NO_DRIVER", "1")
    with pytest.raises(GPUError, match="NVML nvmlInit failed: NVML Shared Library Not Found") as e:
        NVML("tests.fake_nvml")
    assert "controller='dry-run'" in str(e.value)
    assert "nvml_module='worker_client.simulated.gpu'" in str(e.value)
