"""What the power-limit optimizer needs around it: a window monitor and a cross-rank reducer."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Protocol

Reducer = Callable[[float, float], tuple[float, float]]
"""(local time s, local energy J) -> (job time, job energy) across ranks."""


class _WindowResult(Protocol):
    @property
    def time(self) -> float: ...

    @property
    def total_energy(self) -> float: ...


class WindowMonitor(Protocol):
    """What the optimizer needs of a window monitor, e.g. the GPU layer's ``EnergyMonitor``."""

    gpu_indices: list[int]

    def begin_window(self, name: str) -> None:
        """Start a named window."""

    def end_window(self, name: str) -> _WindowResult:
        """End a named window; return its time and energy.

        A monitor without ``cancel_window`` (Zeus's ``ZeusMonitor``) also takes
        ``cancel=True``, which discards the window.
        """


def torch_distributed_reducer(time_s: float, energy_j: float) -> tuple[float, float]:
    """Max of time and sum of energy over ranks if torch.distributed is initialized."""
    torch = sys.modules.get("torch")  # a job that has not imported torch is not distributed
    if torch is None:
        return time_s, energy_j
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return time_s, energy_j
    device = "cpu"
    if dist.get_backend() == "nccl":  # NCCL reduces CUDA tensors only
        device = f"cuda:{torch.cuda.current_device()}"
    t = torch.tensor([time_s], dtype=torch.float64, device=device)
    e = torch.tensor([energy_j], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.all_reduce(e, op=dist.ReduceOp.SUM)
    return float(t.item()), float(e.item())


def torch_distributed_reasons(reason: str | None) -> list[str | None] | None:
    """Every rank's ``reason``, in rank order; None where torch.distributed is not initialized.

    A collective: every rank calls it, each with its own reason (None: nothing went wrong).
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    reasons: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)
    return reasons
