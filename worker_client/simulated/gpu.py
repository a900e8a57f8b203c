"""A simulated GPU that is also an importable NVML-like module.

``NVML("worker_client.simulated.gpu")`` works wherever the real ``pynvml`` does: this module
exposes the ``nvml*`` functions perseus-mq uses, an :class:`NVMLError` with ``.value`` and
the ``NVML_ERROR_*`` codes. Defaults mimic a measured H100: graphics clocks 1980 down to
345 MHz in 15 MHz steps (110 clocks), memory clocks 2619 and 1593 MHz, power limit 200-700 W.

Device state is shared between processes, because the clock is set from the frequency
controller's side process while the training process runs instructions. Each device is one
small JSON file ``gpu<index>.json`` in the state directory, replaced atomically (temp file +
``os.replace``) so readers never see half a file; read-modify-writes (energy counter, locks)
hold an ``fcntl`` lock on ``gpu<index>.lock``.

Environment:
    ``PERSEUS_SIM_GPU_DIR``: state directory. Default: ``/dev/shm/perseus-sim-gpu-<pgid>``
        (or under the system temp dir where there is no writable ``/dev/shm``),
        keyed by the process group, so a launcher and every process it starts (torchrun
        workers, spawned side processes) see the same GPUs while unrelated runs do not.
        Set it explicitly when processes live in different process groups.
    ``PERSEUS_SIM_GPU_COUNT``: number of devices (default 8).
    ``PERSEUS_SIM_GPU_DENY``: ``1`` makes every NVML write fail with NO_PERMISSION; ``0`` or
        unset allows them (any other value is a :class:`ConfigError`).

The training side uses :class:`SimulatedGPU`, which replays an
:class:`~worker_client.simulated.instruction_table.InstructionTable` (time and energy per stage,
instruction and frequency) at the currently locked clock.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.constants import H100_GRAPHICS_CLOCKS
from protocol.exceptions import ConfigError

# Also importable from here, where they used to live.
from worker_client.simulated.instruction_table import InstructionTable, synthetic_instruction_table

# --- constants (values match pynvml so code comparing codes behaves the same) ----------------
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_UNKNOWN = 999
NVML_CLOCK_GRAPHICS = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2

GRAPHICS_CLOCKS: tuple[int, ...] = H100_GRAPHICS_CLOCKS
MEMORY_CLOCKS: tuple[int, ...] = (2619, 1593)
POWER_LIMIT_RANGE_MW: tuple[int, int] = (200_000, 700_000)
IDLE_POWER_W = 70.0
DEFAULT_DEVICE_COUNT = 8

_ERROR_TEXT = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


class NVMLError(Exception):
    """An NVML failure; ``value`` is one of the ``NVML_ERROR_*`` codes."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _ERROR_TEXT.get(self.value, f"NVML Error with code {self.value}")


# --- shared device state -------------------------------------------------------------------------
def resolve_state_dir(explicit: str | Path | None = None) -> Path:
    """Return the state directory in use (see module docs).

    Only a write creates it (:func:`_update_state`): a run that only reads (a dry-run
    controller, an energy monitor) leaves nothing behind in ``/dev/shm``.
    """
    if explicit is None:
        # tmpfs when there is one: on a disk, creating and renaming a file costs ~0.5 ms.
        base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
        explicit = os.environ.get("PERSEUS_SIM_GPU_DIR") or (
            Path(base) / f"perseus-sim-gpu-{os.getpgrp()}"
        )
    return Path(explicit)


def check_state_dir(directory: str | Path | None = None) -> Path:
    """Make the state folder now, where a failure can still name it; return it.

    A folder that cannot be made (``PERSEUS_SIM_GPU_DIR`` under a file, or under ``/proc``)
    otherwise failed only in a side thread's first write, and what a user then read was that
    the energy counter never moved.

    Raises:
        ConfigError: The folder cannot be made or is no folder (named, with the reason).
    """
    path = resolve_state_dir(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot make the simulated GPUs' state folder {path} (PERSEUS_SIM_GPU_DIR): "
            f"{exc.strerror or exc}"
        ) from None
    return path


def reset_state(directory: str | Path | None = None) -> None:
    """Forget every simulated device's clocks, limits and energy (delete the state files)."""
    shutil.rmtree(resolve_state_dir(directory), ignore_errors=True)


def device_count() -> int:
    """Return the number of simulated devices (``PERSEUS_SIM_GPU_COUNT``, default 8).

    Raises:
        ConfigError: The variable is no whole number >= 0 (named, with what it holds); a
            ValueError, which a command's error handling turns into one line.
    """
    raw = os.environ.get("PERSEUS_SIM_GPU_COUNT", str(DEFAULT_DEVICE_COUNT))
    if not (
        raw.strip().isascii() and raw.strip().isdigit()
    ):  # int() said "invalid literal", naming no variable
        raise ConfigError(
            f"PERSEUS_SIM_GPU_COUNT must be a whole number of simulated GPUs (>= 0), got {raw!r}"
        )
    return int(raw)


def writes_denied() -> bool:
    """Return whether ``PERSEUS_SIM_GPU_DENY`` makes NVML writes fail (``1``; ``0``/unset: no).

    Raises:
        ConfigError: The variable holds anything else (named, with what it holds): ``true``
            used to allow every write without a word.
    """
    raw = os.environ.get("PERSEUS_SIM_GPU_DENY", "0")
    if raw not in ("0", "1"):
        raise ConfigError(f"PERSEUS_SIM_GPU_DENY must be 1 (deny NVML writes) or 0, got {raw!r}")
    return raw == "1"


def _default_state() -> dict[str, Any]:
    return {
        "gpu_locked": None,  # [min, max] MHz, or None when unlocked
        "mem_locked": None,
        "power_limit_mw": POWER_LIMIT_RANGE_MW[1],
        "energy_mj": 0.0,
        "power_mw": IDLE_POWER_W * 1000,
    }


def _read_state(directory: Path, index: int) -> dict[str, Any]:
    try:
        with open(directory / f"gpu{index}.json") as f:
            return {**_default_state(), **json.load(f)}
    except FileNotFoundError:
        return _default_state()


def _update_state(
    directory: Path, index: int, change: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """Apply ``change`` to one device's state under its lock; return the new state."""
    try:
        lock = open(directory / f"gpu{index}.lock", "a")
    except FileNotFoundError:  # the first write, or reset_state() removed the directory
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(directory / f"gpu{index}.lock", "a")
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        state = _read_state(directory, index)
        change(state)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".gpu{index}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(state, f)
        os.replace(tmp, directory / f"gpu{index}.json")
    return state


# --- the NVML-like module surface ---------------------------------------------------------------
@dataclass(frozen=True)
class _Handle:
    index: int


_init_count = 0


def _require_init() -> None:
    if _init_count <= 0:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)


def _writable(handle: _Handle) -> Path:
    _require_init()
    if writes_denied():
        raise NVMLError(NVML_ERROR_NO_PERMISSION)
    return resolve_state_dir()


def nvmlInit() -> None:
    """Initialize (reference-counted, like the real library)."""
    global _init_count
    writes_denied()  # a wrong value fails here, not first in a side thread's write
    _init_count += 1


def nvmlShutdown() -> None:
    """Release one :func:`nvmlInit`."""
    global _init_count
    _require_init()
    _init_count -= 1


def nvmlDeviceGetCount() -> int:
    """Return the number of simulated devices."""
    _require_init()
    return device_count()


def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
    """Handle of device ``index``."""
    _require_init()
    if not 0 <= index < device_count():
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return _Handle(index)


def nvmlDeviceGetUUID(handle: _Handle) -> str:
    """UUID, as ``CUDA_VISIBLE_DEVICES`` may name the device."""
    _require_init()
    return f"GPU-5e000000-0000-4000-8000-{handle.index:012d}"


def nvmlDeviceGetName(handle: _Handle) -> str:
    """Product name."""
    _require_init()
    return "NVIDIA H100 80GB HBM3 (simulated)"


def nvmlDeviceGetSupportedMemoryClocks(handle: _Handle) -> list[int]:
    """Supported memory clocks, MHz."""
    _require_init()
    return list(MEMORY_CLOCKS)


def nvmlDeviceGetSupportedGraphicsClocks(handle: _Handle, memory_clock: int) -> list[int]:
    """Supported graphics clocks at ``memory_clock``, MHz (the same list for both)."""
    _require_init()
    if memory_clock not in MEMORY_CLOCKS:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return list(GRAPHICS_CLOCKS)


def nvmlDeviceGetClockInfo(handle: _Handle, clock_type: int) -> int:
    """Return the current graphics/SM or memory clock, MHz."""
    _require_init()
    state = _read_state(resolve_state_dir(), handle.index)
    if clock_type == NVML_CLOCK_MEM:
        return int(state["mem_locked"][1]) if state["mem_locked"] else MEMORY_CLOCKS[0]
    return int(state["gpu_locked"][1]) if state["gpu_locked"] else GRAPHICS_CLOCKS[0]


def nvmlDeviceGetTotalEnergyConsumption(handle: _Handle) -> int:
    """Energy counter, millijoules (grows only with simulated work and idle time)."""
    _require_init()
    return int(_read_state(resolve_state_dir(), handle.index)["energy_mj"])


def nvmlDeviceGetPowerUsage(handle: _Handle) -> int:
    """Average power of the last simulated instruction or idle period, milliwatts."""
    _require_init()
    return int(_read_state(resolve_state_dir(), handle.index)["power_mw"])


def nvmlDeviceGetPowerManagementLimitConstraints(handle: _Handle) -> list[int]:
    """``[min, max]`` settable power limit, milliwatts."""
    _require_init()
    return list(POWER_LIMIT_RANGE_MW)


def nvmlDeviceGetPowerManagementLimit(handle: _Handle) -> int:
    """Return the current power limit, milliwatts."""
    _require_init()
    return int(_read_state(resolve_state_dir(), handle.index)["power_limit_mw"])


def nvmlDeviceSetPowerManagementLimit(handle: _Handle, limit_mw: int) -> None:
    """Set the power limit; outside the constraints -> INVALID_ARGUMENT."""
    directory = _writable(handle)
    low, high = POWER_LIMIT_RANGE_MW
    if not low <= limit_mw <= high:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    _update_state(directory, handle.index, lambda s: s.update(power_limit_mw=int(limit_mw)))


def _set_lock(handle: _Handle, field: str, supported: Sequence[int], low: int, high: int) -> None:
    directory = _writable(handle)
    # Stricter than the driver (which clamps): a clock the GPU lacks is a bug in the caller.
    if low not in supported or high not in supported or low > high:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    _update_state(directory, handle.index, lambda s: s.update({field: [int(low), int(high)]}))


def nvmlDeviceSetGpuLockedClocks(handle: _Handle, min_mhz: int, max_mhz: int) -> None:
    """Lock the graphics clock to ``[min, max]`` (both must be supported clocks)."""
    _set_lock(handle, "gpu_locked", GRAPHICS_CLOCKS, min_mhz, max_mhz)


def nvmlDeviceResetGpuLockedClocks(handle: _Handle) -> None:
    """Unlock the graphics clock."""
    _update_state(_writable(handle), handle.index, lambda s: s.update(gpu_locked=None))


def nvmlDeviceSetMemoryLockedClocks(handle: _Handle, min_mhz: int, max_mhz: int) -> None:
    """Lock the memory clock to ``[min, max]`` (both must be supported clocks)."""
    _set_lock(handle, "mem_locked", MEMORY_CLOCKS, min_mhz, max_mhz)


def nvmlDeviceResetMemoryLockedClocks(handle: _Handle) -> None:
    """Unlock the memory clock."""
    _update_state(_writable(handle), handle.index, lambda s: s.update(mem_locked=None))


# --- the training side -------------------------------------------------------------------------
class SimulatedGPU:
    """One simulated device, as seen by a (simulated) training process.

    Under load the GPU runs at the upper end of its locked range, or at the max clock when
    unlocked. If the replayed power at that clock exceeds the power limit, it throttles to
    the highest supported clock whose power fits, as a real GPU's power capping would. The
    memory clock lock is recorded but does not change the replay (profiles are taken at the
    max memory clock, which the frequency controller locks).

    Args:
        index: Device index.
        state_dir: State directory (default: see module docs).
        table: Replay profile. Default: :func:`synthetic_instruction_table` for
            ``num_stages`` stages.
        num_stages: Stages of the default synthetic profile.

    """

    def __init__(
        self,
        index: int,
        state_dir: str | Path | None = None,
        table: InstructionTable | None = None,
        num_stages: int = 1,
    ) -> None:
        if not 0 <= index < device_count():
            raise ValueError(f"no simulated GPU {index} (PERSEUS_SIM_GPU_COUNT={device_count()})")
        self.index = index
        self.state_dir = resolve_state_dir(state_dir)
        self.table = table if table is not None else synthetic_instruction_table(num_stages)

    def state(self) -> dict[str, Any]:
        """Return a snapshot of the shared state (clocks, limit, energy counter, power)."""
        return _read_state(self.state_dir, self.index)

    def current_clock(self) -> int:
        """Return the clock the GPU runs at under load (locked max, else the max), MHz."""
        locked = self.state()["gpu_locked"]
        return int(locked[1]) if locked else GRAPHICS_CLOCKS[0]

    def energy_mj(self) -> float:
        """Return the energy counter, millijoules."""
        return float(self.state()["energy_mj"])

    def _effective_clock(self, stage: int, instruction: str, clock: int, limit_w: float) -> int:
        for f in (c for c in GRAPHICS_CLOCKS if c <= clock):
            t, e = self.table.expected(stage, instruction, f)
            if t > 0 and e / t <= limit_w:
                return f
        return GRAPHICS_CLOCKS[-1]

    def run(self, stage: int, instruction: str, time_scale: float = 1.0) -> tuple[float, float]:
        """Replay one instruction at the current clock.

        Sleeps ``time * time_scale`` and adds the instruction's energy to the counter.

        Args:
            stage: Pipeline stage whose profile to replay.
            instruction: Instruction name, e.g. ``"forward"``.
            time_scale: Factor on the sleep only (0 = do not sleep); the returned time and
                the counted energy are unscaled.

        Returns:
            ``(time_s, energy_j)`` of the instruction.

        """
        state = self.state()
        clock = int(state["gpu_locked"][1]) if state["gpu_locked"] else GRAPHICS_CLOCKS[0]
        limit_w = state["power_limit_mw"] / 1000
        t, e = self.table.expected(stage, instruction, clock)
        if t > 0 and e / t > limit_w:
            clock = self._effective_clock(stage, instruction, clock, limit_w)
        t, e = self.table.lookup(stage, instruction, clock)
        if time_scale > 0:
            time.sleep(t * time_scale)
        self._add_energy(e, t)
        return t, e

    def idle(self, seconds: float) -> float:
        """Count ``seconds`` blocked on communication at the table's blocking power.

        Does not sleep: the caller has already waited (e.g. for a P2P receive).

        Returns:
            The energy added, Joules.

        """
        energy = self.table.blocking_power_w * max(0.0, seconds)
        self._add_energy(energy, seconds)
        return energy

    def _add_energy(self, energy_j: float, seconds: float) -> None:
        def change(s: dict[str, Any]) -> None:
            s["energy_mj"] += energy_j * 1000
            if seconds > 0:
                s["power_mw"] = energy_j / seconds * 1000

        _update_state(self.state_dir, self.index, change)


class SimulatedSteadyPower:
    """Side thread that accounts a steady power on a simulated GPU, one slice per ``tick``.

    The simulated GPU's energy counter grows only when some process accounts energy; this
    makes it grow like a real GPU's counter drawing ``power_w`` (see the module docstring).

    Args:
        index: Simulated device index.
        power_w: Power to account, W (default: the simulated GPU's blocking power).
        tick: Seconds between two accountings (a real counter's update period, or less).

    """

    def __init__(self, index: int, power_w: float | None = None, tick: float = 0.005) -> None:
        table = InstructionTable([])
        if power_w is not None:
            table = InstructionTable([], blocking_power_w=power_w)
        self.gpu = SimulatedGPU(index, table=table)
        self.tick = tick
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="perseus-sim-power", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        """Start accounting."""
        self._thread.start()

    def _run(self) -> None:
        last = time.perf_counter()
        try:
            while not self._stop.wait(self.tick):
                now = time.perf_counter()
                self.gpu.idle(now - last)
                last = now
        except BaseException as exc:
            self.error = exc

    def stop(self) -> None:
        """Stop accounting (the time since the last tick is not counted)."""
        self._stop.set()
        self._thread.join(5)
