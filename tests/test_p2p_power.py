"""`perseus profile-p2p` and worker_client.gpu.p2p_power, on the simulated GPU only."""

from __future__ import annotations

import csv
import queue
import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from protocol.exceptions import ConfigError, GPUError
from worker_client.gpu.cli import format_report, profile_p2p_command, write_csv
from worker_client.gpu.nvml import NVML
from worker_client.gpu.nvml_readonly import (
    WRITE_FUNCTIONS,
    ReadOnlyNVML,
    assert_read_only,
    is_read_function,
)
from worker_client.gpu.p2p_power import (
    BlockedWindow,
    P2PPowerResult,
    _cause,
    _more_errors,
    cuda_ordinal,
    measure_p2p_power,
    parse_devices,
)
from worker_client.simulated import gpu as sim


def _invoke(*args: str):
    return CliRunner().invoke(profile_p2p_command, list(args), catch_exceptions=False)


# --- the measurement (real spawned ranks, simulated GPU) ----------------------------------------
def test_measured_watts_match_the_simulated_blocking_power(sim_dir: Path, tmp_path: Path) -> None:
    out_csv = tmp_path / "p2p.csv"
    true_w = 137.0
    result = _invoke(
        "--gpu", "simulated", "--seconds", "1.5", "--repeats", "2", "--sample-interval", "0.01",
        "--sim-blocking-power", str(true_w), "--csv", str(out_csv),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    arg = re.search(r"perseus optimize --p2p-power ([0-9.]+)", result.output)
    assert arg is not None, result.output
    assert abs(float(arg.group(1)) - true_w) / true_w < 0.05
    for section in ("repeat", "mean:", "spread:", "error bound:"):
        assert section in result.output
    with open(out_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    for row in rows:
        watts, bound = float(row["watts"]), float(row["watts_error_bound"])
        assert abs(watts - true_w) / true_w < 0.05
        assert abs(watts - true_w) <= bound + 0.02 * true_w  # the monitor's bound holds
        assert abs(float(row["seconds"]) - 1.5) < 0.2
        assert row["gpu"] == "simulated"


def test_api_default_power_and_shared_device(sim_dir: Path) -> None:
    # Windows of 1.5 s: under a loaded CPU the simulated accounting thread runs late at times,
    # which shifts energy across a window's ends by a few tens of milliseconds' worth.
    result = measure_p2p_power(
        "simulated", seconds=1.5, repeats=1, devices=(2, 2), sample_interval=0.01
    )
    expected = sim.InstructionTable([]).blocking_power_w
    assert result.receiver_device == result.sender_device == 2
    assert result.energy_source == "counter"
    assert len(result.windows) == 1
    assert abs(result.mean_w - expected) / expected < 0.05
    assert result.std_w == 0.0
    assert any("shared one GPU" in n for n in result.notes)


# --- bad arguments (nothing spawned) ------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--seconds", "0"], "--seconds"),
        (["--seconds", "-1"], "--seconds"),
        (["--repeats", "0"], "--repeats"),
        (["--devices", "0"], "RECEIVER,SENDER"),
        (["--devices", "a,b"], "RECEIVER,SENDER"),
        (["--devices", "0,1,2"], "RECEIVER,SENDER"),
        (["--gpu", "tpu"], "--gpu"),
        (["--sim-blocking-power", "50"], "--gpu simulated"),
        (["--gpu", "simulated", "--sim-blocking-power", "0"], "--sim-blocking-power"),
        (["--gpu", "simulated", "--seconds", "0.01", "--sample-interval", "0.5"], "longer"),
    ],
)
def test_bad_arguments(sim_dir: Path, args: list[str], message: str) -> None:
    result = _invoke(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_a_csv_that_cannot_be_written_is_refused_before_measuring(
    sim_dir: Path, tmp_path: Path
) -> None:
    # It failed only after the measurement ("cannot write ..."), the seconds spent for nothing.
    (tmp_path / "file").write_text("x")
    for path, words in (
        (tmp_path / "none" / "p2p.csv", f"its folder '{tmp_path / 'none'}' does not exist"),
        (tmp_path / "file" / "p2p.csv", f"its folder '{tmp_path / 'file'}' is not a folder"),
    ):
        result = _invoke("--gpu", "simulated", "--seconds", "0.05", "--csv", str(path))
        assert result.exit_code == 2, result.output
        assert "Invalid value for '--csv'" in result.output and words in result.output
        assert "P2P blocking power" not in result.output  # nothing was measured
    assert not sim_dir.exists()


def test_device_out_of_range(sim_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERSEUS_SIM_GPU_COUNT", "2")
    result = _invoke("--gpu", "simulated", "--devices", "0,5")
    assert result.exit_code == 1
    assert "no GPU 5" in result.output and "sees 2" in result.output
    monkeypatch.setenv("PERSEUS_SIM_GPU_COUNT", "1")
    result = _invoke("--gpu", "simulated")
    assert result.exit_code == 1
    assert "--devices 0,0" in result.output


def test_a_bad_simulated_gpu_count_is_one_line_naming_the_variable(
    sim_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 'abc' ended the command with a traceback (a ValueError out of the simulated NVML).
    monkeypatch.setenv("PERSEUS_SIM_GPU_COUNT", "abc")
    result = CliRunner().invoke(profile_p2p_command, ["--gpu", "simulated"])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "PERSEUS_SIM_GPU_COUNT must be a whole number" in result.output
    assert "got 'abc'" in result.output
    # 0 simulated GPUs was told to "use --gpu simulated", which it had used.
    monkeypatch.setenv("PERSEUS_SIM_GPU_COUNT", "0")
    result = _invoke("--gpu", "simulated")
    assert result.exit_code == 1, result.output
    assert "PERSEUS_SIM_GPU_COUNT=0" in result.output
    assert "use --gpu simulated" not in result.output


def test_a_simulated_gpu_folder_that_cannot_be_written_is_named(
    sim_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A folder under a file ended in the sender's "Connection closed by peer" (the receiver
    # had died of a NotADirectoryError); one under /proc in "its energy counter has not
    # changed since sampling started". Both are found before any rank starts.
    (tmp_path / "file").write_text("x")
    for bad in (tmp_path / "file" / "sim", Path("/proc/perseus-sim")):
        monkeypatch.setenv("PERSEUS_SIM_GPU_DIR", str(bad))
        result = _invoke("--gpu", "simulated", "--seconds", "0.05", "--repeats", "1")
        assert result.exit_code == 1, result.output
        assert f"cannot make the simulated GPUs' state folder {bad} (PERSEUS_SIM_GPU_DIR)" in (
            result.output
        )
        assert "rank" not in result.output  # no rank was started


def test_no_nvml_hints_at_simulated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    result = _invoke("--gpu", "nvml")
    assert result.exit_code == 1
    assert "--gpu simulated" in result.output
    with pytest.raises(GPUError, match="--gpu simulated"):
        measure_p2p_power("nvml", seconds=1.0, repeats=1)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"seconds": 0.0},
        {"seconds": float("nan")},
        {"repeats": 0},
        {"gpu": "tpu"},
        {"sample_interval": 0.0},
        {"gpu": "nvml", "sim_blocking_power_w": 10.0},
        {"sim_blocking_power_w": -1.0},
    ],
)
def test_api_rejects_bad_arguments(sim_dir: Path, kwargs: dict) -> None:
    kwargs = {"gpu": "simulated", **kwargs}
    with pytest.raises(ConfigError):
        measure_p2p_power(**kwargs)


def test_parse_devices() -> None:
    assert parse_devices("0,1") == (0, 1)
    assert parse_devices(" 3 , 3 ") == (3, 3)
    for bad in ("", "1", "-1,0", "0;1", "x,1"):
        with pytest.raises(ConfigError):
            parse_devices(bad)


# --- report ------------------------------------------------------------------------------------
def test_summary_report_and_csv(tmp_path: Path) -> None:
    windows = (BlockedWindow(2.0, 200.0, 2.0), BlockedWindow(2.0, 210.0, 4.0))
    result = P2PPowerResult("simulated", 0, 1, "GPU", "counter", 2.0, windows)
    assert result.watts == [100.0, 105.0]
    assert result.mean_w == pytest.approx(102.5)
    assert result.std_w == pytest.approx(3.5355, rel=1e-3)
    assert result.range_w == (100.0, 105.0)
    assert result.error_bound_w == pytest.approx(1.5)
    assert result.p2p_power_arg == "102.5"
    text = format_report(result)
    assert "perseus optimize --p2p-power 102.5" in text
    assert "+-1.50 W" in text and "std 3.54 W" in text
    write_csv(result, tmp_path / "x.csv")
    rows = list(csv.DictReader(open(tmp_path / "x.csv")))
    assert [float(r["watts"]) for r in rows] == [100.0, 105.0]


# --- read-only NVML ----------------------------------------------------------------------------
def test_read_only_nvml_refuses_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests import fake_nvml

    log = tmp_path / "nvml.log"
    monkeypatch.setenv("FAKE_NVML_LOG", str(log))
    nvml = ReadOnlyNVML("tests.fake_nvml")
    assert_read_only(nvml)
    assert nvml.graphics_clocks(0)[0] == 1980
    assert nvml.total_energy_mj(0) == 123_456
    for write in (
        lambda: nvml.lock_gpu_clocks(0, 1980),
        lambda: nvml.reset_gpu_clocks(0),
        lambda: nvml.lock_memory_clocks(0, 2619),
        lambda: nvml.reset_memory_clocks(0),
        lambda: nvml.set_power_limit_mw(0, 300_000),
        lambda: nvml._call("nvmlDeviceSetGpuLockedClocks", nvml._handle(0), 1980, 1980),
    ):
        with pytest.raises(GPUError, match="read-only"):
            write()
    calls = [name for name, _ in fake_nvml.read_log(log)]
    assert calls and all(is_read_function(c) for c in calls), calls
    assert all(not is_read_function(w) for w in WRITE_FUNCTIONS)


def test_assert_read_only_catches_writable_facades() -> None:
    with pytest.raises(AssertionError):
        assert_read_only(NVML("tests.fake_nvml"))

    class Sneaky(ReadOnlyNVML):
        def lock_gpu_clocks(self, index: int, mhz: int) -> None:
            pass

    with pytest.raises(AssertionError, match="overrides"):
        Sneaky("tests.fake_nvml")


def test_cuda_ordinal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert cuda_ordinal(3) == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert cuda_ordinal(3) == 0
    assert cuda_ordinal(1) == 1
    assert cuda_ordinal(0) is None


def test_registered_read_only_module_serves_name_based_callers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Code that takes an NVML module by name (the hook) reads through the proxy, never writes."""
    from tests import fake_nvml
    from worker_client.gpu.nvml_readonly import register_read_only_module

    log = tmp_path / "nvml.log"
    monkeypatch.setenv("FAKE_NVML_LOG", str(log))
    name = register_read_only_module("tests.fake_nvml")
    assert register_read_only_module("tests.fake_nvml") == name  # registered once
    nvml = NVML(name)
    assert nvml.graphics_clocks(0)[0] == 1980
    with pytest.raises(GPUError, match="read-only NVML: nvmlDeviceSetGpuLockedClocks"):
        nvml.lock_gpu_clocks(0, 1980)
    with pytest.raises(GPUError, match="cannot import NVML module 'no_such_nvml'"):
        register_read_only_module("no_such_nvml")
    calls = [call for call, _ in fake_nvml.read_log(log)]
    assert calls and all(is_read_function(c) for c in calls), calls


def test_a_lost_peer_does_not_hide_the_error_that_killed_it():
    # The receiver failed; its sender's "Connection closed by peer" arrived first and was
    # the one reported, which said nothing of why.
    lost = (1, "error", "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:29500")
    why = (0, "error", "OSError: [Errno 28] No space left on device: '/sim/gpu0'")
    out: queue.Queue = queue.Queue()
    out.put(why)
    errors = [lost, *_more_errors(out, first=1, wait=1.0)]
    assert _cause(errors) == why
    assert _cause([lost]) == lost  # alone, the only one there is
    assert _cause([lost, (0, "gpu-error", "GPUError: NVML gone")])[1] == "gpu-error"
    assert _more_errors(queue.Queue(), first=1, wait=0.01) == []  # the other never reports
    done: queue.Queue = queue.Queue()
    done.put((0, "done", None))
    assert _more_errors(done, first=1, wait=0.01) == []
