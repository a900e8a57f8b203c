"""An NVML facade that can only read, for code that runs next to real GPUs it must not change.

:class:`ReadOnlyNVML` is an :class:`~worker_client.gpu.nvml.NVML` whose module is wrapped in a
proxy that hands out only reading functions (``nvmlInit``, ``nvmlShutdown``, ``nvmlDeviceGet*``,
``nvmlSystemGet*``, ``nvmlErrorString``) besides non-callable attributes and error classes.
Asking the proxy for any other ``nvml*`` function (``nvmlDeviceSetGpuLockedClocks``,
``nvmlDeviceResetGpuLockedClocks``, ``nvmlDeviceSetPowerManagementLimit``...) raises
:class:`~protocol.exceptions.GPUError`, and so do the facade's write methods. So a
measurement path that holds only a :class:`ReadOnlyNVML` cannot reach an NVML write, and
:func:`assert_read_only` checks that at run time.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

from protocol.exceptions import GPUError
from worker_client.gpu.nvml import NVML, REAL_NVML

# Callable attributes of an NVML module that only read (by name prefix).
READ_PREFIXES: tuple[str, ...] = (
    "nvmlInit",
    "nvmlShutdown",
    "nvmlDeviceGet",
    "nvmlSystemGet",
    "nvmlErrorString",
)

# Known NVML writes, checked by :func:`assert_read_only` (any other non-read function is
# refused as well; these are the ones perseus-mq or Zeus would call).
WRITE_FUNCTIONS: tuple[str, ...] = (
    "nvmlDeviceSetGpuLockedClocks",
    "nvmlDeviceResetGpuLockedClocks",
    "nvmlDeviceSetMemoryLockedClocks",
    "nvmlDeviceResetMemoryLockedClocks",
    "nvmlDeviceSetPowerManagementLimit",
    "nvmlDeviceSetApplicationsClocks",
    "nvmlDeviceResetApplicationsClocks",
    "nvmlDeviceSetPersistenceMode",
    "nvmlDeviceSetComputeMode",
)


def is_read_function(name: str) -> bool:
    """Whether the NVML function ``name`` only reads GPU state."""
    return name.startswith(READ_PREFIXES)


class _ReadOnlyModule:
    """Attribute proxy over an NVML module that refuses every non-reading ``nvml*`` function."""

    def __init__(self, module: ModuleType) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        if (
            callable(value)
            and not isinstance(value, type)
            and name.startswith("nvml")
            and not is_read_function(name)
        ):
            raise GPUError(f"read-only NVML: {name} is a write and is not reachable here")
        return value


class ReadOnlyNVML(NVML):
    """:class:`~worker_client.gpu.nvml.NVML` that can only read (see the module docstring).

    Adds two reads the base facade lacks: :meth:`name` and :meth:`clock_mhz`.

    Args:
        module: Import name of the NVML module (default: the real ``pynvml``).

    Raises:
        GPUError: The module cannot be imported or ``nvmlInit`` fails.

    """

    def __init__(self, module: str = REAL_NVML) -> None:
        super().__init__(module)
        real = self._nvml
        self._nvml = _ReadOnlyModule(real)  # type: ignore[assignment]
        assert_read_only(self)

    def name(self, index: int) -> str:
        """Product name of GPU ``index``."""
        value = self._call("nvmlDeviceGetName", self._handle(index))
        return value.decode() if isinstance(value, bytes) else str(value)

    def clock_mhz(self, index: int, memory: bool = False) -> int:
        """Current graphics (or memory) clock of GPU ``index``, MHz."""
        kind_name = "NVML_CLOCK_MEM" if memory else "NVML_CLOCK_GRAPHICS"
        kind = int(getattr(self._nvml, kind_name, 2 if memory else 0))
        return int(self._call("nvmlDeviceGetClockInfo", self._handle(index), kind))

    def _refuse(self, what: str) -> GPUError:
        return GPUError(f"read-only NVML ({self.module_name}): {what} is not allowed")

    def lock_gpu_clocks(self, index: int, mhz: int) -> None:
        """Refused (read-only)."""
        raise self._refuse("locking graphics clocks")

    def reset_gpu_clocks(self, index: int) -> None:
        """Refused (read-only)."""
        raise self._refuse("resetting graphics clocks")

    def lock_memory_clocks(self, index: int, mhz: int) -> None:
        """Refused (read-only)."""
        raise self._refuse("locking memory clocks")

    def reset_memory_clocks(self, index: int) -> None:
        """Refused (read-only)."""
        raise self._refuse("resetting memory clocks")

    def set_power_limit_mw(self, index: int, milliwatts: int) -> None:
        """Refused (read-only)."""
        raise self._refuse("setting the power limit")


_WRITE_METHODS: tuple[str, ...] = (
    "lock_gpu_clocks",
    "reset_gpu_clocks",
    "lock_memory_clocks",
    "reset_memory_clocks",
    "set_power_limit_mw",
)


def assert_read_only(nvml: NVML) -> None:
    """Check that no NVML write is reachable through ``nvml``.

    Raises:
        AssertionError: ``nvml`` is not a :class:`ReadOnlyNVML`, a write function of its
            module is reachable, or a subclass replaced one of the refusing write methods.

    """
    if not isinstance(nvml, ReadOnlyNVML):
        raise AssertionError(f"expected a ReadOnlyNVML, got {type(nvml).__name__}")
    module = nvml._nvml
    if not isinstance(module, _ReadOnlyModule):
        raise AssertionError("the NVML module of a ReadOnlyNVML is not wrapped")
    for name in WRITE_FUNCTIONS:
        try:
            getattr(module, name)
        except AttributeError:
            continue  # the module does not have it at all
        except GPUError:
            continue
        raise AssertionError(f"NVML write {name} is reachable")
    # Checked by identity, never by calling: a subclass that overrode one could really write.
    for method in _WRITE_METHODS:
        if getattr(type(nvml), method) is not getattr(ReadOnlyNVML, method):
            raise AssertionError(f"{type(nvml).__name__}.{method} overrides the refusing method")


def register_read_only_module(module: str = REAL_NVML) -> str:
    """Register a read-only proxy of NVML module ``module`` and return its import name.

    For code in this process that takes an NVML module *by name* (the training hook): given
    the returned name, it can only read the GPU. A spawned process does not know the name.

    Raises:
        GPUError: ``module`` cannot be imported.

    """
    name = f"perseus_read_only__{module.replace('.', '_')}"
    if name not in sys.modules:
        try:
            real = importlib.import_module(module)
        except ImportError as exc:
            raise GPUError(f"cannot import NVML module {module!r}: {exc}") from None
        sys.modules[name] = _ReadOnlyModule(real)  # type: ignore[assignment]
    return name
