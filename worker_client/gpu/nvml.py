"""The one boundary between perseus-mq and NVML.

Everything that reads or writes GPU state goes through :class:`NVML`, which wraps a module
with the ``pynvml`` function names (the real one from ``nvidia-ml-py``, the simulated GPU in
:mod:`worker_client.simulated.gpu`, or a recording fake in the tests) and turns every NVML
error into :class:`~protocol.exceptions.GPUError` with the call and device named.

Modules are chosen by import name (``"pynvml"``) so that a side process can load the same one.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

from protocol.exceptions import ConfigError, GPUError
from protocol.numbers import is_ascii_digits

REAL_NVML = "pynvml"
# The simulated GPU is loaded by name like NVML, so the GPU layer never imports it.
SIMULATED_NVML = "worker_client.simulated.gpu"


def _is_nvml_error(module: ModuleType, exc: BaseException) -> bool:
    error_cls = getattr(module, "NVMLError", None)
    return isinstance(error_cls, type) and isinstance(exc, error_cls)


def _visible_entries(visible: str, count: int) -> list[str]:
    """The entries of ``CUDA_VISIBLE_DEVICES`` that CUDA reads: up to the first it cannot.

    Args:
        visible: The variable's value.
        count: GPUs of the machine (an index past them ends the list too).
    """
    entries: list[str] = []
    for raw in visible.split(","):
        entry = raw.strip()
        if is_ascii_digits(entry) and int(entry) >= count:
            break
        if not (is_ascii_digits(entry) or entry.startswith(("GPU-", "MIG-"))):
            break
        entries.append(entry)
    return entries


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
            no_driver = ("NVML_ERROR_LIBRARY_NOT_FOUND", "NVML_ERROR_DRIVER_NOT_LOADED")
            if code is not None and code in {getattr(self._nvml, n, None) for n in no_driver}:
                hint = (
                    f" (NVML module {self.module_name!r} finds no NVIDIA driver here; on a "
                    "machine without a GPU, use controller='dry-run' or 'simulated' and "
                    f"nvml_module={SIMULATED_NVML!r})"
                )
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

    def visible_count(self, visible: str | None = None) -> int:
        """How many GPUs CUDA numbers (``CUDA_VISIBLE_DEVICES``, default: the environment's)."""
        if visible is None:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        count = self.device_count()
        return count if visible is None else len(_visible_entries(visible, count))

    def uuid(self, index: int) -> str:
        """The GPU's UUID (``GPU-...``), by which ``CUDA_VISIBLE_DEVICES`` may name it."""
        value = self._dev("nvmlDeviceGetUUID", index)
        return value.decode() if isinstance(value, bytes) else str(value)

    def cuda_to_nvml(self, ordinal: int, visible: str | None = None) -> int:
        """The NVML index of this process's CUDA device ``ordinal``.

        CUDA numbers only the GPUs that ``CUDA_VISIBLE_DEVICES`` lists, in its order (NVML
        indices, or UUIDs and unique ``GPU-`` prefixes of them), and ignores the list from its
        first entry it cannot read or that names no GPU; NVML numbers every GPU of the
        machine. Without the variable both number alike. Indices in the variable follow
        ``CUDA_DEVICE_ORDER``, whose default (FASTEST_FIRST) can differ from NVML's PCI order
        on a machine of mixed GPUs: set it to PCI_BUS_ID there.

        Args:
            ordinal: CUDA device index (what ``torch.cuda.set_device`` takes).
            visible: ``CUDA_VISIBLE_DEVICES`` (default: this process's environment).

        Raises:
            ConfigError: ``ordinal`` is not a visible device, a UUID matches no GPU or
                several, or the entry is a MIG instance (its clocks are its GPU's).
        """
        if visible is None:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            return ordinal
        entries = _visible_entries(visible, self.device_count())
        where = f"CUDA_VISIBLE_DEVICES={visible!r}"
        if not 0 <= ordinal < len(entries):
            raise ConfigError(
                f"device_id {ordinal} is not a visible CUDA device: {where} makes "
                f"{len(entries)} visible (device_id is CUDA's index, as for torch.cuda)"
            )
        entry = entries[ordinal]
        if is_ascii_digits(entry):
            return int(entry)
        if entry.startswith("MIG-"):
            raise ConfigError(
                f"device_id {ordinal} is MIG instance {entry} ({where}): clocks and power "
                "limits belong to the whole GPU, which perseus-mq does not split"
            )
        found = [i for i in range(self.device_count()) if self.uuid(i).startswith(entry)]
        if len(found) != 1:
            what = "no GPU" if not found else f"GPUs {found}"
            raise ConfigError(f"device_id {ordinal} is {entry} ({where}), which matches {what}")
        return found[0]

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
