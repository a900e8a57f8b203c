"""The one boundary between perseus-mq and NVML.

Everything that reads or writes GPU state goes through :class:`NVML`, which wraps a module
with the ``pynvml`` function names (the real one from ``nvidia-ml-py``, the simulated GPU in
:mod:`worker_client.simulated_gpu`, or a recording fake in the tests) and turns every NVML
error into :class:`~coordinator.exceptions.GPUError` with the call and device named.

Modules are chosen by import name (``"pynvml"``) so that a side process can load the same one.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from coordinator.exceptions import GPUError

REAL_NVML = "pynvml"


def _is_nvml_error(module: ModuleType, exc: BaseException) -> bool:
    error_cls = getattr(module, "NVMLError", None)
    return isinstance(error_cls, type) and isinstance(exc, error_cls)


class NVML:
    """Thin, error-converting facade over an NVML-like module.

    Args:
        module: Import name of the NVML module (default: the real ``pynvml``).
    """

    def __init__(self, module: str = REAL_NVML) -> None:
        self.module_name = module
        try:
            self._nvml = importlib.import_module(module)
        except ImportError as exc:
            raise GPUError(f"cannot import NVML module {module!r}: {exc}") from None
        self._call("nvmlInit")

    def _call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self._nvml, name)(*args)
        except Exception as exc:
            if not _is_nvml_error(self._nvml, exc):
                raise
            hint = ""
            no_permission = getattr(self._nvml, "NVML_ERROR_NO_PERMISSION", None)
            if getattr(exc, "value", None) == no_permission:
                hint = " (no permission: run as root or grant the capability, see README)"
            raise GPUError(f"NVML {name}{args[1:] if args else ''} failed: {exc}{hint}") from None

    def _handle(self, index: int) -> Any:
        return self._call("nvmlDeviceGetHandleByIndex", index)

    def shutdown(self) -> None:
        """Release NVML."""
        self._call("nvmlShutdown")

    # --- reads -----------------------------------------------------------------------------
    def device_count(self) -> int:
        """Number of visible GPUs."""
        return int(self._call("nvmlDeviceGetCount"))

    def memory_clocks(self, index: int) -> list[int]:
        """Supported memory clocks (MHz), highest first."""
        clocks = self._call("nvmlDeviceGetSupportedMemoryClocks", self._handle(index))
        return sorted((int(c) for c in clocks), reverse=True)

    def graphics_clocks(self, index: int, memory_clock: int | None = None) -> list[int]:
        """Supported graphics clocks (MHz) at ``memory_clock`` (default: the max), highest first."""
        if memory_clock is None:
            memory_clock = self.memory_clocks(index)[0]
        clocks = self._call(
            "nvmlDeviceGetSupportedGraphicsClocks", self._handle(index), memory_clock
        )
        return sorted({int(c) for c in clocks}, reverse=True)

    def total_energy_mj(self, index: int) -> int | None:
        """Energy since the driver loaded, millijoules; None if the GPU has no counter."""
        try:
            return int(self._call("nvmlDeviceGetTotalEnergyConsumption", self._handle(index)))
        except GPUError as exc:
            if "Not Supported" in str(exc) or "not supported" in str(exc):
                return None
            raise

    def power_mw(self, index: int) -> int:
        """Current power draw, milliwatts."""
        return int(self._call("nvmlDeviceGetPowerUsage", self._handle(index)))

    def power_limit_constraints_mw(self, index: int) -> tuple[int, int]:
        """(min, max) settable power limit, milliwatts."""
        low, high = self._call("nvmlDeviceGetPowerManagementLimitConstraints", self._handle(index))
        return int(low), int(high)

    def power_limit_mw(self, index: int) -> int:
        """Current power limit, milliwatts."""
        return int(self._call("nvmlDeviceGetPowerManagementLimit", self._handle(index)))

    # --- writes (never call these against a real GPU on a lent device machine) ---------------
    def lock_gpu_clocks(self, index: int, mhz: int) -> None:
        """Lock the graphics clock to exactly ``mhz``."""
        self._call("nvmlDeviceSetGpuLockedClocks", self._handle(index), mhz, mhz)

    def reset_gpu_clocks(self, index: int) -> None:
        """Undo :meth:`lock_gpu_clocks`."""
        self._call("nvmlDeviceResetGpuLockedClocks", self._handle(index))

    def lock_memory_clocks(self, index: int, mhz: int) -> None:
        """Lock the memory clock to exactly ``mhz``."""
        self._call("nvmlDeviceSetMemoryLockedClocks", self._handle(index), mhz, mhz)

    def reset_memory_clocks(self, index: int) -> None:
        """Undo :meth:`lock_memory_clocks`."""
        self._call("nvmlDeviceResetMemoryLockedClocks", self._handle(index))

    def set_power_limit_mw(self, index: int, milliwatts: int) -> None:
        """Set the power limit (needs root or CAP_SYS_ADMIN)."""
        self._call("nvmlDeviceSetPowerManagementLimit", self._handle(index), milliwatts)
