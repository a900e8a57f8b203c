"""Measure a GPU's power while it is blocked on point-to-point communication.

Perseus's optimizer charges every stage's idle gaps in the 1F1B pipeline at the GPU's *P2P
blocking power* (``perseus optimize --p2p-power``): the power of a GPU that holds its model
and activations but waits in a blocking receive for its neighbour's activation or gradient.

:func:`measure_p2p_power` reproduces that situation with two spawned ranks joined by
``torch.distributed`` (gloo, CPU tensors; on real GPUs too, since the point is the receiving
GPU sitting idle but allocated, not the transfer): for each repeat both ranks meet at a
barrier, rank 1 sleeps ``seconds`` and sends, and rank 0 blocks in ``recv``. Rank 0 measures
its GPU over the blocked interval with an :class:`~worker_client.gpu.energy.EnergyMonitor`
window; energy / interval is the blocking power.

Real GPUs are only read: the ranks hold a :class:`~worker_client.gpu.nvml_readonly.ReadOnlyNVML`
(checked with :func:`~worker_client.gpu.nvml_readonly.assert_read_only`) and no frequency
controller. On real GPUs each rank also allocates a buffer on its GPU, so that the GPU holds a
CUDA context as in training (when torch sees CUDA; otherwise the result carries a note).

The simulated GPU's energy counter grows only when a process accounts energy, so the
receiver accounts its blocking energy itself with :meth:`SimulatedGPU.idle
<worker_client.simulated.gpu.SimulatedGPU.idle>`, in short slices on a side thread for all the
time it spends waiting on communication (it does nothing else). Accounting the whole blocked
time at once after ``recv`` would put the energy after the window's end, where a real GPU's
counter would not have it.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import math
import multiprocessing as mp
import os
import queue
import re
import socket
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from protocol.exceptions import ConfigError, GPUError, PerseusError
from protocol.numbers import is_ascii_digits
from worker_client.gpu.energy import EnergyMonitor
from worker_client.gpu.nvml import REAL_NVML, SIMULATED_NVML
from worker_client.gpu.nvml_readonly import ReadOnlyNVML, assert_read_only

GPUKind = Literal["nvml", "simulated"]
GPU_MODULES: dict[str, str] = {"nvml": REAL_NVML, "simulated": SIMULATED_NVML}
SIM_TICK_S = 0.005  # slice length of the simulated receiver's blocking-energy accounting
_CUDA_BUFFER_BYTES = 64 << 20  # what each rank keeps allocated on a real GPU
_NO_GPU_HINT = "use --gpu simulated to try the measurement without a GPU"


@dataclass(frozen=True)
class BlockedWindow:
    """One blocked interval of the receiver.

    Attributes:
        seconds: Length of the blocked interval (the monitor window), seconds.
        energy_j: GPU energy over the interval, Joules.
        error_bound_j: The monitor's bound on ``|energy_j - true energy|``, Joules.

    """

    seconds: float
    energy_j: float
    error_bound_j: float

    @property
    def watts(self) -> float:
        """Average power over the interval, W."""
        return self.energy_j / self.seconds if self.seconds > 0 else 0.0

    @property
    def watts_error_bound(self) -> float:
        """The monitor's error bound on :attr:`watts`, W."""
        return self.error_bound_j / self.seconds if self.seconds > 0 else math.inf


@dataclass(frozen=True)
class P2PPowerResult:
    """Blocking power measured by :func:`measure_p2p_power`.

    Attributes:
        gpu: ``"nvml"`` (a real GPU, read only) or ``"simulated"``.
        receiver_device: NVML index of the receiving (measured) GPU.
        sender_device: NVML index of the sending rank's GPU.
        device_name: Product name of the receiving GPU.
        energy_source: How the monitor measured energy: ``"counter"`` or ``"power"``.
        requested_seconds: How long the sender waited before each send, seconds.
        windows: One blocked interval per repeat.
        notes: Caveats worth printing (no CUDA context held, shared GPU...).

    """

    gpu: str
    receiver_device: int
    sender_device: int
    device_name: str
    energy_source: str
    requested_seconds: float
    windows: tuple[BlockedWindow, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def watts(self) -> list[float]:
        """Blocking power of each repeat, W."""
        return [w.watts for w in self.windows]

    @property
    def mean_w(self) -> float:
        """Mean blocking power over the repeats, W."""
        return statistics.fmean(self.watts)

    @property
    def std_w(self) -> float:
        """Sample standard deviation over the repeats (0 for one repeat), W."""
        return statistics.stdev(self.watts) if len(self.windows) > 1 else 0.0

    @property
    def range_w(self) -> tuple[float, float]:
        """Lowest and highest repeat, W."""
        return min(self.watts), max(self.watts)

    @property
    def error_bound_w(self) -> float:
        """Bound on the mean's measurement error: the mean of the per-repeat bounds, W."""
        return statistics.fmean(w.watts_error_bound for w in self.windows)

    @property
    def p2p_power_arg(self) -> str:
        """The value to pass as ``perseus optimize --p2p-power`` (W, one decimal)."""
        return f"{self.mean_w:.1f}"


@dataclass(frozen=True)
class _RankConfig:
    """Everything a spawned rank needs (picklable)."""

    gpu: str
    module: str
    devices: tuple[int, int]
    seconds: float
    repeats: int
    sample_interval: float
    port: int
    pg_timeout_s: float
    sim_blocking_power_w: float | None


# --- validation ----------------------------------------------------------------------------------
def parse_devices(text: str) -> tuple[int, int]:
    """Parse ``"RECEIVER,SENDER"`` NVML indices, e.g. ``"0,1"``.

    Raises:
        ConfigError: Not two non-negative integers.

    """
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2 or not all(is_ascii_digits(p) for p in parts):
        raise ConfigError(
            f"devices must be two GPU indices 'RECEIVER,SENDER' such as 0,1; got {text!r}"
        )
    return int(parts[0]), int(parts[1])


def _check_args(gpu: str, seconds: float, repeats: int, sample_interval: float) -> str:
    if gpu not in GPU_MODULES:
        raise ConfigError(f"gpu must be one of {sorted(GPU_MODULES)}, got {gpu!r}")
    if not seconds > 0 or not math.isfinite(seconds):
        raise ConfigError(f"seconds must be a positive number, got {seconds}")
    if repeats < 1:
        raise ConfigError(f"repeats must be at least 1, got {repeats}")
    if not 0 < sample_interval <= seconds:
        raise ConfigError(
            f"sample_interval must be in (0, seconds={seconds}], got {sample_interval}"
        )
    return GPU_MODULES[gpu]


def _probe(gpu: str, module: str, devices: tuple[int, int]) -> str:
    """Check NVML and the devices in this process; return the receiver's product name."""
    if gpu == "simulated":  # its state folder, before a rank's side thread fails in it
        importlib.import_module(SIMULATED_NVML).check_state_dir()
    try:
        nvml = ReadOnlyNVML(module)
    except GPUError as exc:
        if gpu == "nvml":
            raise GPUError(f"no usable NVML GPU here ({exc}); {_NO_GPU_HINT}") from None
        raise
    try:
        count = nvml.device_count()
        if count == 0 and gpu == "simulated":  # its hint would be to use what was used
            raise GPUError("the simulated NVML has no GPU: PERSEUS_SIM_GPU_COUNT=0")
        if count == 0:
            raise GPUError(f"NVML sees no GPU; {_NO_GPU_HINT}")
        bad = [d for d in devices if not 0 <= d < count]
        if bad:
            hint = " (on a single-GPU machine use --devices 0,0)" if count == 1 else ""
            raise GPUError(f"no GPU {bad[0]}: NVML sees {count} GPU(s), 0..{count - 1}{hint}")
        return nvml.name(devices[0])
    finally:
        with contextlib.suppress(GPUError):
            nvml.shutdown()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- the ranks (spawned processes) -------------------------------------------------------------
def cuda_ordinal(nvml_index: int) -> int | None:
    """CUDA ordinal of an NVML index (None if CUDA_VISIBLE_DEVICES hides it)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return nvml_index  # with CUDA_DEVICE_ORDER=PCI_BUS_ID, set by the rank
    entries = [v.strip() for v in visible.split(",") if v.strip()]
    return entries.index(str(nvml_index)) if str(nvml_index) in entries else None


def _hold_cuda(nvml_index: int) -> tuple[Any, str | None]:
    """Allocate a buffer on the GPU so it holds a CUDA context; returns (buffer, note)."""
    import torch

    if not torch.cuda.is_available():
        return None, "torch sees no CUDA: the GPU held no CUDA context while blocked"
    ordinal = cuda_ordinal(nvml_index)
    if ordinal is None or ordinal >= torch.cuda.device_count():
        return None, f"GPU {nvml_index} is not visible to CUDA: it held no CUDA context"
    torch.cuda.set_device(ordinal)
    buffer = torch.ones(_CUDA_BUFFER_BYTES // 4, device=f"cuda:{ordinal}")
    torch.cuda.synchronize()
    return buffer, None


def _receiver(cfg: _RankConfig, dist: Any, torch: Any) -> dict[str, Any]:
    device = cfg.devices[0]
    notes: list[str] = []
    nvml = ReadOnlyNVML(cfg.module)
    assert_read_only(nvml)  # nothing on this path can change the GPU
    held = None
    sim: Any = None
    if cfg.gpu == "nvml":
        held, note = _hold_cuda(device)
        if note:
            notes.append(note)
    else:
        # The simulated GPU module (loaded by name, like NVML) brings its own steady-power
        # accounting: its energy counter does not move unless a process accounts energy.
        steady_power = importlib.import_module(SIMULATED_NVML).SimulatedSteadyPower
        sim = steady_power(device, cfg.sim_blocking_power_w, SIM_TICK_S)
        sim.start()
    monitor = EnergyMonitor(
        [device], nvml=nvml, sample_interval=cfg.sample_interval, index_space="nvml"
    )
    try:
        buf = torch.zeros(1024)
        pending = []
        for i in range(cfg.repeats):
            dist.barrier()
            monitor.begin_window(f"p2p-{i}")
            dist.recv(buf, src=1)
            pending.append(monitor.end_window_deferred(f"p2p-{i}"))
        results = [p.result() for p in pending]
        dist.barrier()
        mode = monitor.modes.get(device) or "unknown"
    finally:
        monitor.close()
        if sim is not None:
            sim.stop()
    if sim is not None and sim.error is not None:
        raise GPUError(f"simulated blocking-energy accounting failed: {sim.error}")
    del held
    windows = [
        asdict(BlockedWindow(m.time, m.gpu_energy[device], m.gpu_energy_error_bound[device]))
        for m in results
    ]
    return {"windows": windows, "mode": mode, "notes": notes}


def _sender(cfg: _RankConfig, dist: Any, torch: Any) -> None:
    held = None
    if cfg.gpu == "nvml":
        held, _ = _hold_cuda(cfg.devices[1])
    buf = torch.ones(1024)
    for _ in range(cfg.repeats):
        dist.barrier()
        time.sleep(cfg.seconds)
        dist.send(buf, dst=0)
    dist.barrier()
    del held


def _rank_main(rank: int, cfg: _RankConfig, out: Any) -> None:
    """Entry point of a spawned rank; reports ``(rank, kind, payload)`` on ``out``."""
    if cfg.gpu == "nvml" and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # CUDA ordinal = NVML index
    try:
        import torch
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{cfg.port}",
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=cfg.pg_timeout_s),
        )
        try:
            if rank == 0:
                out.put((rank, "result", _receiver(cfg, dist, torch)))
            else:
                _sender(cfg, dist, torch)
                out.put((rank, "done", None))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:
        kind = "gpu-error" if isinstance(exc, GPUError) else "error"
        out.put((rank, kind, f"{type(exc).__name__}: {exc}"))


# --- the launcher ---------------------------------------------------------------------------
def measure_p2p_power(
    gpu: GPUKind = "nvml",
    seconds: float = 2.0,
    repeats: int = 3,
    devices: tuple[int, int] = (0, 1),
    *,
    sample_interval: float = 0.02,
    sim_blocking_power_w: float | None = None,
    startup_timeout: float = 120.0,
) -> P2PPowerResult:
    """Measure the receiving GPU's power while blocked in a P2P ``recv`` (module docstring).

    Args:
        gpu: ``"nvml"`` (a real GPU, only read) or ``"simulated"``.
        seconds: How long the sender sleeps before each send (the blocked interval).
        repeats: Number of blocked intervals to measure.
        devices: NVML indices ``(receiver, sender)``; they may be equal on a one-GPU machine.
        sample_interval: Seconds between the energy monitor's NVML reads.
        sim_blocking_power_w: Blocking power of the simulated GPU, W (default: the simulated
            GPU's own default). Only with ``gpu="simulated"``.
        startup_timeout: Seconds allowed for spawning the ranks and joining the process group.

    Returns:
        The per-repeat windows and their summary.

    Raises:
        ConfigError: Invalid arguments.
        GPUError: No NVML or no such GPU (with a hint to use the simulated GPU), or a rank's
            NVML reads failed.
        PerseusError: A rank failed otherwise or did not finish in time.

    """
    module = _check_args(gpu, seconds, repeats, sample_interval)
    if sim_blocking_power_w is not None and gpu != "simulated":
        raise ConfigError("a simulated blocking power only applies to the simulated GPU")
    if sim_blocking_power_w is not None and not sim_blocking_power_w > 0:
        raise ConfigError(f"the simulated blocking power must be positive: {sim_blocking_power_w}")
    name = _probe(gpu, module, devices)
    per_repeat = seconds + 2.0 + 4 * sample_interval  # the sleep, end_timeout, barriers
    cfg = _RankConfig(
        gpu=gpu,
        module=module,
        devices=devices,
        seconds=seconds,
        repeats=repeats,
        sample_interval=sample_interval,
        port=_free_port(),
        pg_timeout_s=startup_timeout + per_repeat * repeats,
        sim_blocking_power_w=sim_blocking_power_w,
    )
    payload = _launch(cfg, deadline=startup_timeout + per_repeat * repeats + 10.0)
    notes = list(payload["notes"])
    if devices[0] == devices[1]:
        notes.append("both ranks shared one GPU (the sender held a CUDA context there too)")
    return P2PPowerResult(
        gpu=gpu,
        receiver_device=devices[0],
        sender_device=devices[1],
        device_name=name,
        energy_source=str(payload["mode"]),
        requested_seconds=seconds,
        windows=tuple(BlockedWindow(**w) for w in payload["windows"]),
        notes=tuple(notes),
    )


# A rank whose peer died fails with this (gloo's words): the peer's own error says why.
_PEER_LOST = re.compile(r"connection (closed|reset) by peer|broken pipe", re.IGNORECASE)
CAUSE_WAIT_S = 2.0  # how long a rank's error waits for the other rank's


def _more_errors(out: Any, first: int, wait: float = CAUSE_WAIT_S) -> list[tuple[int, str, str]]:
    """The other rank's error, if it reports one within ``wait`` seconds of ``first``'s."""
    try:
        rank, kind, data = out.get(timeout=wait)
    except queue.Empty:
        return []
    return [(rank, kind, data)] if rank != first and kind in ("gpu-error", "error") else []


def _cause(errors: list[tuple[int, str, str]]) -> tuple[int, str, str]:
    """The error to raise: a GPU error, else one that is not a lost peer, else the first.

    A receiver that fails kills its sender's gloo connection; that "Connection closed by
    peer" often arrives first, and hid the receiver's reason.
    """
    for wanted in (
        lambda e: e[1] == "gpu-error",
        lambda e: not _PEER_LOST.search(e[2]),
    ):
        for error in errors:
            if wanted(error):
                return error
    return errors[0]


def _launch(cfg: _RankConfig, deadline: float) -> dict[str, Any]:
    """Run both ranks; return the receiver's payload or raise the error that says why."""
    ctx = mp.get_context("spawn")
    out: Any = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(r, cfg, out), name=f"perseus-p2p-rank{r}", daemon=True)
        for r in range(2)
    ]
    for p in procs:
        p.start()
    payload: dict[str, Any] | None = None
    finished: set[int] = set()
    end = time.monotonic() + deadline
    try:
        while len(finished) < 2:
            try:
                rank, kind, data = out.get(timeout=0.5)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise PerseusError(
                        f"rank process {dead[0].name} died (exit code {dead[0].exitcode})"
                    ) from None
                if time.monotonic() > end:
                    raise PerseusError(
                        f"the P2P ranks did not finish within {deadline:.0f} s"
                    ) from None
                continue
            if kind in ("gpu-error", "error"):
                rank, kind, data = _cause([(rank, kind, data), *_more_errors(out, rank)])
                if kind == "gpu-error":
                    raise GPUError(f"rank {rank}: {data}")
                raise PerseusError(f"rank {rank} failed: {data}")
            if kind == "result":
                payload = data
            finished.add(rank)
    finally:
        for p in procs:
            p.join(5 if payload is not None else 0.5)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
        out.close()
        out.cancel_join_thread()
    assert payload is not None
    return payload
