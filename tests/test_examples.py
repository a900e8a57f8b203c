"""The README's runnable example really runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from protocol.exceptions import GPUError
from tests.helpers import ROOT, start_perseus, stop, subprocess_env, wait_for
from tests.pipes import Output, piped
from worker_client.gpu.nvml import NVML


def run_example(
    tmp_path: Path, script: str, *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``examples/<script>`` to its end in ``tmp_path`` (simulated GPUs private to it)."""
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        env=subprocess_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
    )


def test_minimal_loop_example_runs(tmp_path):
    out = run_example(tmp_path, "minimal_loop.py")
    assert out.returncode == 0, out.stderr
    assert "+dp1+pp1+tp1+PointSolution+example: ran schedule version" in out.stdout
    assert "clocks requested: [1410, 1410, 1980, 1980]" in out.stdout


def test_minimal_loop_joins_running_services(redis_url, tmp_path):
    # A coordinator started with no scheduler settings, as the README's start without Docker.
    services = [
        start_perseus(["coordinator", "--redis-url", redis_url], tmp_path, "coordinator.log"),
        start_perseus(["worker", "--simple", "--redis-url", redis_url], tmp_path, "worker.log"),
    ]
    try:
        out = run_example(tmp_path, "minimal_loop.py", "--redis-url", redis_url)
        assert out.returncode == 0, out.stderr
        assert "clocks requested: [1410, 1410, 1980, 1980]" in out.stdout
    finally:
        stop(services)
    assert "scheduler=none" in (tmp_path / "coordinator.log").read_text()


def test_torch_pipelining_example_runs(tmp_path):
    out = run_example(tmp_path, "torch_pipelining.py", "--schedule", "gpipe", timeout=240)
    assert out.returncode == 0, out.stderr
    assert "+dp1+pp4+tp1+PointSolution+example-pipelining, clocks requested" in out.stdout
    # GPipe: every stage runs its 8 forwards (1410 MHz) first.
    assert out.stdout.count("clocks requested [1410, 1410, 1410, 1410]") == 4
    assert "step 5: loss" in out.stdout


def _processes_with(marker: str) -> list[str]:
    """Command lines of processes whose command line or environment holds ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline or marker.encode() in environ:
            found.append(cmdline.replace(b"\0", b" ").decode(errors="replace"))
    return found


def _cmdline(pid: int) -> bytes:
    """The command line of process ``pid`` (empty once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _children(parent: int) -> list[int]:
    """Processes whose parent is ``parent``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            found.append(int(pid))
    return found


@contextmanager
def _example(script: str, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Output, str]]:
    """``examples/<script>`` running inside the block, output unbuffered; the process, its
    output and its marker (stopped after the block if it still runs).

    The marker (its simulated GPUs' folder) is in the environment of all it starts: what
    :func:`_processes_with` finds of it once it stopped was left running.
    """
    marker = str(tmp_path / "gpu")
    env = dict(os.environ, PYTHONPATH=str(ROOT), PERSEUS_SIM_GPU_DIR=marker, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / script)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    with piped(proc) as output:
        yield proc, output, marker


def test_torch_pipelining_example_stops_everything_on_sigterm(tmp_path):
    """SIGTERM (kill, timeout) left its private Redis, rq worker and 4 waiting ranks running."""
    with _example("torch_pipelining.py", tmp_path) as (proc, output, marker):
        first = output.readline(120)
        assert "started a private Redis at unix://" in first, first
        redis_dir = str(Path(first.split("unix://", 1)[1].strip()).parent)
        second = output.readline(120)
        assert "coordinator and rq worker running" in second, first + second
        time.sleep(1.0)  # the ranks are spawned (and wait for their schedule)
        proc.send_signal(signal.SIGTERM)
        out = output.rest(60)
    assert proc.returncode == 1 and "interrupted" in out, out
    left: list[str] = []

    def nothing_left() -> bool:
        left[:] = _processes_with(redis_dir) + _processes_with(marker)
        return not left

    try:
        wait_for(nothing_left, 20, "the example's processes to stop")
    except AssertionError:
        raise AssertionError(f"left running: {left}") from None


@pytest.mark.parametrize("when", ["starting", "after training"])
def test_minimal_loop_example_stops_everything_on_sigterm(tmp_path, when):
    """SIGTERM (kill, timeout) left its private Redis and rq worker running.

    As its Redis starts, the server was left; after training, in the clean-up, the
    coordinator's thread (never told to stop) kept the process alive for ever.
    """
    with _example("minimal_loop.py", tmp_path) as (proc, output, marker):

        def its_redis() -> list[int]:
            # Redis overwrites its environment with its process title: found as the child.
            return [pid for pid in _children(proc.pid) if b"redis-server" in _cmdline(pid)]

        (redis_pid,) = wait_for(its_redis, 60, "the example's private Redis")
        if when == "after training":
            first = output.readline(120)
            assert "ran schedule version 1" in first, first
        proc.send_signal(signal.SIGTERM)
        out = output.rest(60)
    if when == "starting":
        assert proc.returncode == 1 and "interrupted" in out, out
    else:  # in the clean-up, or once it was done and the default handler was back
        assert proc.returncode in (1, -signal.SIGTERM), out
    left: list[str] = []

    def nothing_left() -> bool:
        left[:] = _processes_with(marker)
        if _cmdline(redis_pid):
            left.append(f"redis-server {redis_pid}")
        return not left

    try:
        wait_for(nothing_left, 20, "the example's processes to stop")
    except AssertionError:
        raise AssertionError(f"left running: {left}") from None


def test_power_limit_example_without_a_driver_says_to_use_the_simulated_gpu(tmp_path):
    try:  # read only: whether this machine has an NVIDIA driver at all
        NVML().shutdown()
    except GPUError:
        pass
    else:
        pytest.skip("an NVIDIA driver is here: the example would change a real power limit")
    out = run_example(tmp_path, "power_limit.py", "--gpu", "0")
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert "--gpu 0: NVML nvmlInit failed" in out.stderr
    assert "--gpu simulated" in out.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--warmup-steps", "0"], "power_limit.py: error: warmup_steps must be an integer >= 1"),
        (["--eta", "2"], "power_limit.py: error: eta_knob must be a number in [0, 1], got 2.0"),
        (["--profile-path", "no/such/folder/p.json"], "its folder 'no/such/folder' does not"),
        (["--gpu", "first"], "argument --gpu: 'simulated' or a CUDA index, got 'first'"),
        (["--epoch-steps", "0"], "argument --epoch-steps: a whole number >= 1, got '0'"),
        (["--after-steps", "0"], "argument --after-steps: a whole number >= 1, got '0'"),
        (["--pl-step", "-5"], "power_limit.py: error: pl_step must be an integer >= 1, got -5"),
    ],
    ids=["warmup-steps", "eta", "profile-path", "gpu", "epoch-steps", "after-steps", "pl-step"],
)
def test_power_limit_example_refuses_a_bad_option_in_one_line(tmp_path, args, says):
    # A refused option was a ConfigError traceback; --epoch-steps 0 looped for ever and
    # --after-steps 0 failed an assertion.
    out = run_example(tmp_path, "power_limit.py", "--gpu", "simulated", *args, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert says in out.stderr.strip().splitlines()[-1]
    # Refused before anything starts: no plan of limits printed with the refused value in it
    # ("every -5 W down"), no GPU opened, no steps run waiting for the monitor's samples.
    assert "power limits" not in out.stdout, out.stdout


@pytest.mark.parametrize(
    ("script", "url", "says"),
    [
        (
            "minimal_loop.py",
            "redis://127.0.0.1:notaport/0",
            "minimal_loop.py: error: invalid Redis URL 'redis://127.0.0.1:notaport/0'",
        ),
        (
            "torch_pipelining.py",
            "unix:///nonexistent/redis.sock",
            "torch_pipelining.py: error: cannot reach Redis at unix:///nonexistent/redis.sock",
        ),
    ],
)
def test_an_example_given_a_redis_url_it_cannot_use_says_so_in_one_line(
    tmp_path, script, url, says
):
    # README: `python examples/minimal_loop.py --redis-url URL`. A mistyped URL was a traceback
    # (torch's [rank0]: lines around it, for minimal_loop.py), as power_limit.py's options were.
    out = run_example(tmp_path, script, "--redis-url", url)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert says in out.stderr.strip().splitlines()[-1]
