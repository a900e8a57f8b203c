"""The GPU power limits an optimizer profiles and sets: their ladder, range and NVML writes."""

from __future__ import annotations

import hashlib
import logging
from typing import NoReturn

from protocol.exceptions import ConfigError, GPUError, PerseusError
from worker_client.gpu.nvml import NVML
from worker_client.power_limit.monitor import (
    Reducer,
    WindowMonitor,
    torch_distributed_reasons,
    torch_distributed_reducer,
)

logger = logging.getLogger(__name__)


def power_limit_ladder(max_mw: int, min_mw: int, pl_step: int) -> list[int]:
    """Zeus's profiled limits (mW): ``max_mw`` down by ``pl_step`` W, none below ``min_mw``."""
    return list(range(max_mw, min_mw - 1, -pl_step * 1000))


def format_watts(milliwatts: int) -> str:
    """A limit for a message: ``250 W``."""
    return f"{milliwatts / 1000:g} W"


def limit_to_set(watts: int, ladder: list[int], min_mw: int) -> int:
    """The limit (mW) to set for a selector's choice of ``watts`` among ``ladder``'s limits.

    Measured at a limit of the ladder, recorded in whole watts: the one measured. A loaded
    profile's limit outside the GPUs' range (``min_mw`` to ``ladder[0]``) is clamped to it,
    with a warning.
    """
    chosen = next((mw for mw in ladder if mw // 1000 == watts), watts * 1000)
    clamped = min(max(chosen, min_mw), ladder[0])
    if clamped != chosen:
        logger.warning(
            "profile's limit %s is outside this GPU's range; using %s",
            format_watts(chosen),
            format_watts(clamped),
        )
    return clamped


def _ladder_mark(ladder: list[int]) -> float:
    """A 40-bit number naming ``ladder``: exact in a float64, so a reducer carries it intact."""
    digest = hashlib.sha256(",".join(map(str, ladder)).encode()).digest()
    return float(int.from_bytes(digest[:5], "big"))


def ranks_without_profile(
    ladder: list[int],
    pl_step: int,
    found: bool,
    reducer: Reducer,
    failure: Exception | None = None,
) -> int:
    """How many ranks found no stored profile; refuse ranks that failed or differ.

    Every rank calls this, with the same reductions, so all of them decide alike; a rank that
    raised alone would leave the others waiting for ever in profiling's collectives. The
    first reduction sums the ranks that failed to start (a bad profile file on one node's
    disk, say): each raises, this one with its own error, the others naming it and its error
    where the reducer is :func:`torch_distributed_reducer` (one more collective gathers the
    errors, only then). Profiling pairs every rank's window of a limit in one all-reduce, so
    every rank must walk the same ladder: GPUs with another power limit range (or another
    ``pl_step``) would pair one rank's 250 W window with another's 300 W one and leave the
    rank with more limits waiting for ever. The second reduction compares the ladders (max and
    min of a mark of each) and counts the ranks without a profile.

    Args:
        ladder: This rank's limits, mW, highest first (empty if it failed).
        pl_step: The step between them, W.
        found: This rank found a stored profile.
        reducer: The all-reduce (max of the first value, sum of the second).
        failure: What stopped this rank, if anything.

    Raises:
        ConfigError: Some rank must profile and the ranks' ladders differ, or another rank
            failed (on every rank).
        Exception: This rank's own failure, on its rank.
    """
    mark = _ladder_mark(ladder)
    highest, failed = reducer(mark, float(failure is not None))
    why = " (their own error says why)"
    if failed > 0:
        why = _failed_ranks(failure, reducer) or why
    if failure is not None:
        raise failure
    if failed > 0:
        raise ConfigError(
            f"{round(failed)} other rank(s) could not start their power-limit optimizer{why}: "
            "no rank profiles"
        )
    lowest, missing = reducer(-mark, float(not found))
    if missing > 0 and highest != -lowest:
        raise ConfigError(
            "the ranks would profile different power limits (this rank: "
            f"{format_watts(ladder[0])} down to {format_watts(ladder[-1])} in {pl_step} W "
            f"steps, {len(ladder)} limits): their GPUs' power limit ranges or their pl_step "
            "differ, and each limit is measured by all ranks together; give every rank GPUs "
            "of one kind and the same pl_step"
        )
    return round(missing)


def refuse_to_start(error: Exception, reducer: Reducer | None = None) -> NoReturn:
    """Raise ``error`` on a rank that fails before it creates its power-limit optimizer.

    Joins the first collectives of the other ranks'
    :class:`~worker_client.power_limit.optimizer.GlobalPowerLimitOptimizer` constructors
    (:func:`ranks_without_profile`'s), so that they raise at once, naming this rank and
    ``error``, instead of waiting there: a rank whose ``EnergyMonitor`` could not start (NVML,
    a GPU index its node lacks) failed alone before. Give the ``reducer`` the other ranks give
    their optimizer.
    """
    ranks_without_profile([], 0, False, reducer or torch_distributed_reducer, error)
    raise AssertionError("ranks_without_profile raises the failure it is given")  # pragma: no cover


def _failed_ranks(failure: Exception | None, reducer: Reducer) -> str | None:
    """`` (rank N: Error: why; ...)``: every rank's failure, gathered (a collective).

    Only with :func:`torch_distributed_reducer`, whose group every rank is in; None with
    another reducer, or outside torch.distributed.
    """
    if reducer is not torch_distributed_reducer:
        return None
    mine = f"{type(failure).__name__}: {failure}" if failure is not None else None
    reasons = torch_distributed_reasons(mine)
    if reasons is None:
        return None
    named = "; ".join(f"rank {r}: {text}" for r, text in enumerate(reasons) if text)
    return f" ({named})" if named else None


def refuse_failed_window(
    power_limit_mw: int, failure: Exception | None, reducer: Reducer
) -> NoReturn:
    """Raise on every rank once some rank could not measure its window of a limit.

    Every rank calls this after the limit's reduction came back NaN (a failed rank reduces
    NaN energy, which makes the sum NaN everywhere): the rank that failed raises its own
    error, the others a :class:`PerseusError` naming it and its error where the reducer is
    :func:`torch_distributed_reducer` (one more collective gathers the errors).

    Args:
        power_limit_mw: The limit whose window failed, mW.
        failure: What stopped this rank's window, if it was this rank's.
        reducer: The optimizer's reducer.

    Raises:
        Exception: ``failure`` itself, on its rank.
        PerseusError: On every other rank.
    """
    why = _failed_ranks(failure, reducer) or " (its own error says why, or its energy was NaN)"
    if failure is not None:
        raise failure
    raise PerseusError(
        f"another rank could not measure power limit {format_watts(power_limit_mw)}{why}: "
        "no rank records it (a step begin after this error profiles it again)"
    )


def agree_on_optimum(
    power_limit_mw: int, failure: Exception | None, reducer: Reducer, *, at_start: bool = False
) -> None:
    """Return once every rank set the optimal limit; else raise on every rank.

    A collective: every rank calls it once it has tried to set the limit profiling chose (or
    a loaded profile's), so that a write NVML refuses on one rank (the others then trained on
    at another limit, silently) is every rank's error, and ranks whose optima differ (loaded
    profiles of other runs) log a warning that says so. The rank that failed raises its own
    error, the others a :class:`PerseusError` naming it and its error where the reducer is
    :func:`torch_distributed_reducer` (one more collective gathers the errors, only then).

    Args:
        power_limit_mw: The optimal limit, mW.
        failure: What stopped this rank setting it, if anything.
        reducer: The optimizer's reducer.
        at_start: The optimizer's constructor sets it (from a loaded profile).

    Raises:
        Exception: ``failure`` itself, on its rank.
        PerseusError: On every other rank.
    """
    highest, failed = reducer(float(power_limit_mw), float(failure is not None))
    if failed == 0 and failure is None:
        # Every rank set its optimum: the lowest too (a second collective, on every rank alike).
        lowest = -reducer(-float(power_limit_mw), 0.0)[0]
        if lowest != highest:
            # Stored profiles that differ (a stale profile_path on one node, say) set other
            # limits on some ranks, unsaid; GPUs of other kinds may rightly do so too.
            logger.warning(
                "the ranks' optimal power limits differ: %s to %s (this rank: %s): they loaded "
                "profiles of other runs (profile_path), or have other selectors or GPU kinds",
                format_watts(int(lowest)),
                format_watts(int(highest)),
                format_watts(power_limit_mw),
            )
        return
    why = _failed_ranks(failure, reducer) or " (its own error says why)"
    if failure is not None:
        raise failure
    then = (
        "no rank starts its optimizer"
        if at_start
        else "the profile is saved, and a step begin after this error sets the limit again"
    )
    raise PerseusError(
        f"another rank could not set the optimal power limit {format_watts(power_limit_mw)}"
        f"{why}: {then}"
    )


def _is_permission_error(exc: GPUError) -> bool:
    text = str(exc).lower()
    return "no permission" in text or "insufficient permission" in text


def monitored_gpus(
    monitor: WindowMonitor, nvml: NVML | None
) -> tuple[list[int], NVML, dict[int, int]]:
    """The monitored GPUs, the NVML facade for their limits, and each one's NVML index.

    Args:
        monitor: The optimizer's monitor (``gpu_indices``: CUDA indices).
        nvml: The NVML facade given (default: ``monitor.nvml`` or the real one).

    Returns:
        ``(gpu_indices, nvml, nvml_of)``: ``nvml_of`` maps a monitored index to NVML's.

    Raises:
        ConfigError: The monitor has no GPUs, or one is not a visible CUDA device.
        GPUError: NVML cannot be opened.
    """
    gpu_indices = list(monitor.gpu_indices)
    if not gpu_indices:
        raise ConfigError("the monitor has no GPUs")
    nvml = nvml or getattr(monitor, "nvml", None) or NVML()
    # Limits go to NVML's indices: an EnergyMonitor knows them; a ZeusMonitor's CUDA
    # indices are mapped through CUDA_VISIBLE_DEVICES.
    nvml_indices = getattr(monitor, "nvml_indices", None)
    if nvml_indices is None:
        nvml_indices = [nvml.cuda_to_nvml(i) for i in gpu_indices]
    return gpu_indices, nvml, dict(zip(gpu_indices, nvml_indices, strict=True))


def common_range(nvml: NVML, nvml_of: dict[int, int]) -> tuple[int, int]:
    """The (min, max) power limit in mW that the GPUs ``nvml_of`` maps to NVML share.

    Raises:
        ConfigError: Their ranges differ (one optimizer needs GPUs of one kind).
    """
    ranges = {i: nvml.power_limit_constraints_mw(n) for i, n in nvml_of.items()}
    if len(set(ranges.values())) > 1:
        listed = ", ".join(f"GPU {i}: {lo}-{hi} mW" for i, (lo, hi) in ranges.items())
        raise ConfigError(
            f"power limit ranges differ across the monitored GPUs ({listed}); one "
            "optimizer needs GPUs of one kind (monitor them with one optimizer each)"
        )
    return ranges[next(iter(nvml_of))]


def set_power_limit(nvml: NVML, nvml_of: dict[int, int], milliwatts: int) -> None:
    """Set every GPU of ``nvml_of`` (monitor index -> NVML index) to ``milliwatts``.

    Raises:
        GPUError: NVML failed; without the privilege, the message says which one is needed.
    """
    for i, n in nvml_of.items():
        # Reading needs no privilege: write (root or CAP_SYS_ADMIN) only what changes, so
        # a job whose optimum is the current limit never needs the privilege at all.
        if nvml.power_limit_mw(n) == milliwatts:
            continue
        try:
            nvml.set_power_limit_mw(n, milliwatts)
        except GPUError as exc:
            if not _is_permission_error(exc):
                raise
            raise GPUError(
                f"not allowed to set GPU {i}'s power limit to {format_watts(milliwatts)}: "
                "nvmlDeviceSetPowerManagementLimit needs root or the CAP_SYS_ADMIN "
                "capability (run training as root, or grant CAP_SYS_ADMIN, e.g. "
                f"`docker run --cap-add SYS_ADMIN`); NVML said: {exc}"
            ) from None
