"""The one boundary between perseus-mq and NVML.

Everything that reads or writes GPU state goes through :class:`NVML`, which wraps a module
with the ``pynvml`` function names (the real one from ``nvidia-ml-py``, the simulated GPU in
:mod:`worker_client.simulated.gpu`, or a recording fake in the tests) and turns every NVML
error into :class:`~protocol.exceptions.GPUError` with the call and device named.

Modules are chosen by import name (``"pynvml"``) so that a side process can load the same one.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from protocol.exceptions import GPUError

REAL_NVML = "pynvml"
# The simulated GPU is loaded by name like NVML, so the GPU layer never imports it.
SIMULATED_NVML = "worker_client.simulated.gpu"


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
        self._handles: dict[int, Any] = {}
        self._call("nvmlInit")

    def _call(self, name: str, *args: Any, device: int | None = None) -> Any:
        try:
            return getattr(self._nvml, name)(*args)
        except Exception as exc:
            if not _is_nvml_error(self._nvml, exc):
                raise
            code = getattr(exc, "value", None)
            hint = ""
            if code == getattr(self._nvml, "NVML_ERROR_NO_PERMISSION", None):
                hint = " (no permission: run as root or grant CAP_SYS_ADMIN, see README)"
            where = f" on GPU {device}" if device is not None else ""
            extra = f" {args[1:]}" if len(args) > 1 else ""
            raise GPUError(f"NVML {name}{extra}{where} failed: {exc}{hint}", code) from None

    def _handle(self, index: int) -> Any:
        # Handles are stable for the life of the NVML session: look each up once.
        if index not in self._handles:
            self._handles[index] = self._call("nvmlDeviceGetHandleByIndex", index, device=index)
        return self._handles[index]

    def _dev(self, name: str, index: int, *args: Any) -> Any:
        return self._call(name, self._handle(index), *args, device=index)

    def shutdown(self) -> None:
        """Release NVML."""
        self._handles.clear()
        self._call("nvmlShutdown")

    # --- reads -----------------------------------------------------------------------------
    def device_count(self) -> int:
        """Number of visible GPUs."""
        return int(self._call("nvmlDeviceGetCount"))

    def memory_clocks(self, index: int) -> list[int]:
        """Supported memory clocks (MHz), highest first."""
        clocks = self._dev("nvmlDeviceGetSupportedMemoryClocks", index)
        return sorted((int(c) for c in clocks), reverse=True)

    def graphics_clocks(self, index: int, memory_clock: int | None = None) -> list[int]:
        """Supported graphics clocks (MHz) at ``memory_clock`` (default: the max), highest first."""
        if memory_clock is None:
            memory_clock = self.memory_clocks(index)[0]
        clocks = self._dev("nvmlDeviceGetSupportedGraphicsClocks", index, memory_clock)
        return sorted({int(c) for c in clocks}, reverse=True)

    def total_energy_mj(self, index: int) -> int | None:
        """Energy since the driver loaded, millijoules; None if the GPU has no counter."""
        try:
            return int(self._dev("nvmlDeviceGetTotalEnergyConsumption", index))
        except GPUError as exc:
            if exc.code == getattr(self._nvml, "NVML_ERROR_NOT_SUPPORTED", object()):
                return None
            raise

    def power_mw(self, index: int) -> int:
        """Current power draw, milliwatts."""
        return int(self._dev("nvmlDeviceGetPowerUsage", index))

    def power_limit_constraints_mw(self, index: int) -> tuple[int, int]:
        """(min, max) settable power limit, milliwatts."""
        low, high = self._dev("nvmlDeviceGetPowerManagementLimitConstraints", index)
        return int(low), int(high)

    def power_limit_mw(self, index: int) -> int:
        """Current power limit, milliwatts."""
        return int(self._dev("nvmlDeviceGetPowerManagementLimit", index))

    # --- writes (never call these against a real GPU on a lent device machine) ---------------
    def lock_gpu_clocks(self, index: int, mhz: int) -> None:
        """Lock the graphics clock to exactly ``mhz``."""
        self._dev("nvmlDeviceSetGpuLockedClocks", index, mhz, mhz)

    def reset_gpu_clocks(self, index: int) -> None:
        """Undo :meth:`lock_gpu_clocks`."""
        self._dev("nvmlDeviceResetGpuLockedClocks", index)

    def lock_memory_clocks(self, index: int, mhz: int) -> None:
        """Lock the memory clock to exactly ``mhz``."""
        self._dev("nvmlDeviceSetMemoryLockedClocks", index, mhz, mhz)

    def reset_memory_clocks(self, index: int) -> None:
        """Undo :meth:`lock_memory_clocks`."""
        self._dev("nvmlDeviceResetMemoryLockedClocks", index)

    def set_power_limit_mw(self, index: int, milliwatts: int) -> None:
        """Set the power limit (needs root or CAP_SYS_ADMIN)."""
        self._dev("nvmlDeviceSetPowerManagementLimit", index, milliwatts)
