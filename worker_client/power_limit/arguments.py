"""Checks of the power-limit optimizer's arguments, made before anything starts."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from protocol.exceptions import ConfigError

if TYPE_CHECKING:
    from worker_client.power_limit.selectors import OptimumSelector
    from worker_client.power_limit.store import PowerLimitProfileStore


def check_arguments(
    optimum_selector: OptimumSelector | None,
    wait_steps: int,
    warmup_steps: int,
    profile_steps: int,
    pl_step: int,
    profile_path: str | Path | None,
    profile_store: PowerLimitProfileStore | None,
    workload: str | None,
) -> None:
    """Raise naming the first bad argument of :class:`GlobalPowerLimitOptimizer`.

    Raises:
        ConfigError: A count out of range, a selector that is none, ``profile_store``
            without ``workload`` (or the other way round), or a ``profile_path`` whose folder
            does not exist.
    """
    for name, value, low in (
        ("wait_steps", wait_steps, 0),
        ("warmup_steps", warmup_steps, 1),
        ("profile_steps", profile_steps, 1),
        ("pl_step", pl_step, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
    if (profile_store is None) != (workload is None):
        raise ConfigError("profile_store and workload must be given together")
    # Checked now, not when profiling ends hours later (Zeus finds out only then).
    if optimum_selector is not None and (
        isinstance(optimum_selector, type)
        or not callable(getattr(optimum_selector, "select", None))
    ):
        raise ConfigError(
            f"optimum_selector must be a selector such as Energy() or ZeusCost(0.5), got "
            f"{optimum_selector!r}"
        )
    if profile_path is not None and not Path(profile_path).exists():
        folder = Path(profile_path).parent
        if not folder.is_dir():
            raise ConfigError(
                f"profile_path {str(profile_path)!r}: its folder {str(folder)!r} does not "
                "exist, so the profile could not be saved once profiling ends"
            )
