"""A fake NVML module that records every call, for tests that must not touch a real GPU.

Import it by name (``NVML("tests.fake_nvml")``) so that a spawned side process loads it too.
Each call is appended as one JSON line ``{"call": name, "args": [...], "pid": pid}`` to the
file named by ``FAKE_NVML_LOG`` (handles are written as their device index), so calls made in
another process are visible to the test. ``FAKE_NVML_DENY=1`` makes every setter and reset
fail with NO_PERMISSION; ``FAKE_NVML_COUNT`` sets the number of devices (default 4);
``FAKE_NVML_NO_DRIVER=1`` makes ``nvmlInit`` fail as on a machine without the NVIDIA driver.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_LIBRARY_NOT_FOUND = 12

GRAPHICS_CLOCKS = list(range(1980, 344, -15))
MEMORY_CLOCKS = [2619, 1593]
POWER_LIMITS_MW = (200_000, 700_000)

_TEXT = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
}


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _TEXT.get(self.value, f"NVML Error with code {self.value}")


@dataclass(frozen=True)
class Handle:
    index: int


def _log(name: str, *args: Any) -> None:
    path = os.environ.get("FAKE_NVML_LOG")
    if not path:
        return
    rendered = [a.index if isinstance(a, Handle) else a for a in args]
    with open(path, "a") as f:
        f.write(json.dumps({"call": name, "args": rendered, "pid": os.getpid()}) + "\n")


def _write(name: str, *args: Any) -> None:
    _log(name, *args)
    if os.environ.get("FAKE_NVML_DENY") == "1":
        raise NVMLError(NVML_ERROR_NO_PERMISSION)


def read_log(path: str | Path) -> list[tuple[str, list[Any]]]:
    """The recorded calls as ``(name, args)``, oldest first."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    return [(d["call"], d["args"]) for d in map(json.loads, lines)]


def nvmlInit() -> None:
    _log("nvmlInit")
    # A side process that never comes up (as one whose parent script has no main guard).
    time.sleep(float(os.environ.get("FAKE_NVML_INIT_DELAY", "0")))
    if os.environ.get("FAKE_NVML_NO_DRIVER") == "1":
        raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)


def nvmlShutdown() -> None:
    _log("nvmlShutdown")


def nvmlDeviceGetCount() -> int:
    _log("nvmlDeviceGetCount")
    return int(os.environ.get("FAKE_NVML_COUNT", "4"))


def nvmlDeviceGetHandleByIndex(index: int) -> Handle:
    if not 0 <= index < int(os.environ.get("FAKE_NVML_COUNT", "4")):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return Handle(index)


def nvmlDeviceGetUUID(handle: Handle) -> str:
    _log("nvmlDeviceGetUUID", handle)
    return f"GPU-{handle.index:08x}-fake-{handle.index}"


def nvmlDeviceGetSupportedMemoryClocks(handle: Handle) -> list[int]:
    _log("nvmlDeviceGetSupportedMemoryClocks", handle)
    return list(MEMORY_CLOCKS)


def nvmlDeviceGetSupportedGraphicsClocks(handle: Handle, memory_clock: int) -> list[int]:
    _log("nvmlDeviceGetSupportedGraphicsClocks", handle, memory_clock)
    return list(GRAPHICS_CLOCKS)


def nvmlDeviceGetTotalEnergyConsumption(handle: Handle) -> int:
    _log("nvmlDeviceGetTotalEnergyConsumption", handle)
    return 123_456


def nvmlDeviceGetPowerUsage(handle: Handle) -> int:
    _log("nvmlDeviceGetPowerUsage", handle)
    return 300_000


def nvmlDeviceGetPowerManagementLimitConstraints(handle: Handle) -> tuple[int, int]:
    _log("nvmlDeviceGetPowerManagementLimitConstraints", handle)
    return POWER_LIMITS_MW


def nvmlDeviceGetPowerManagementLimit(handle: Handle) -> int:
    _log("nvmlDeviceGetPowerManagementLimit", handle)
    return POWER_LIMITS_MW[1]


def nvmlDeviceSetPowerManagementLimit(handle: Handle, limit_mw: int) -> None:
    _write("nvmlDeviceSetPowerManagementLimit", handle, limit_mw)


def nvmlDeviceSetGpuLockedClocks(handle: Handle, min_mhz: int, max_mhz: int) -> None:
    _write("nvmlDeviceSetGpuLockedClocks", handle, min_mhz, max_mhz)
    if min_mhz not in GRAPHICS_CLOCKS or max_mhz not in GRAPHICS_CLOCKS:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)


def nvmlDeviceResetGpuLockedClocks(handle: Handle) -> None:
    _write("nvmlDeviceResetGpuLockedClocks", handle)


def nvmlDeviceSetMemoryLockedClocks(handle: Handle, min_mhz: int, max_mhz: int) -> None:
    _write("nvmlDeviceSetMemoryLockedClocks", handle, min_mhz, max_mhz)
    if min_mhz not in MEMORY_CLOCKS or max_mhz not in MEMORY_CLOCKS:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)


def nvmlDeviceResetMemoryLockedClocks(handle: Handle) -> None:
    _write("nvmlDeviceResetMemoryLockedClocks", handle)
