"""Instruction orders of the pipeline schedules the planner supports: 1F1B and GPipe.

Each stage runs one forward and one backward per microbatch; a schedule fixes the order in
which a stage runs them. Both supported schedules run one stage per rank and take microbatches
in order per kind (the ``k``-th forward of a stage is microbatch ``k``), so the order of
instruction names determines the whole schedule:

* ``1f1b`` (synchronous 1F1B, PyTorch's ``Schedule1F1B``, Megatron, DeepSpeed): stage ``s`` of
  ``S`` runs ``min(S - s - 1, M)`` warm-up forwards, then alternates forward and backward,
  then drains the remaining backwards.
* ``gpipe`` (fill-drain, PyTorch's ``ScheduleGPipe``): every forward, then every backward.

The names are what ``perseus optimize --schedule`` takes and plan files record in their
``pipeline_schedule`` header.
"""

from __future__ import annotations

from collections.abc import Sequence

from protocol.exceptions import ConfigError

#: Supported schedules; the first is the default everywhere.
PIPELINE_SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe")
DEFAULT_SCHEDULE = PIPELINE_SCHEDULES[0]
#: Plan-file header key that names a plan's schedule.
SCHEDULE_HEADER = "pipeline_schedule"


def check_schedule(schedule: str) -> str:
    """Return ``schedule`` if supported.

    Raises:
        ConfigError: Not one of :data:`PIPELINE_SCHEDULES`.

    """
    if schedule not in PIPELINE_SCHEDULES:
        supported = ", ".join(PIPELINE_SCHEDULES)
        raise ConfigError(f"unsupported pipeline schedule {schedule!r}; supported: {supported}")
    return schedule


def _check_shape(num_stages: int, num_microbatches: int, stage: int, schedule: str) -> None:
    if num_stages < 1 or num_microbatches < 1 or not 0 <= stage < num_stages:
        raise ConfigError(
            f"invalid {schedule} shape: {num_stages} stages, {num_microbatches} microbatches, "
            f"stage {stage}"
        )


def one_f_one_b_order(num_stages: int, num_microbatches: int, stage: int) -> list[str]:
    """Instruction names of one stage under synchronous 1F1B scheduling.

    Stage ``s`` of ``S`` first runs ``min(S - s - 1, M)`` warm-up forwards, then alternates
    forward and backward for the remaining microbatches, then drains the warm-up backwards.

    Args:
        num_stages: Number of pipeline stages ``S``.
        num_microbatches: Microbatches per iteration ``M``.
        stage: The stage ``s`` (0 is the first stage).

    Returns:
        ``2 * M`` instruction names.

    Raises:
        ConfigError: Arguments out of range.

    """
    _check_shape(num_stages, num_microbatches, stage, "1F1B")
    warmup = min(num_stages - stage - 1, num_microbatches)
    steady = num_microbatches - warmup
    return ["forward"] * warmup + ["forward", "backward"] * steady + ["backward"] * warmup


def gpipe_order(num_stages: int, num_microbatches: int, stage: int) -> list[str]:
    """Instruction names of one stage under GPipe (fill-drain): all forwards, then backwards.

    Raises:
        ConfigError: Arguments out of range.

    """
    _check_shape(num_stages, num_microbatches, stage, "GPipe")
    return ["forward"] * num_microbatches + ["backward"] * num_microbatches


def stage_order(schedule: str, num_stages: int, num_microbatches: int, stage: int) -> list[str]:
    """Instruction names of one stage under ``schedule`` (see :data:`PIPELINE_SCHEDULES`).

    Raises:
        ConfigError: Unsupported schedule or arguments out of range.

    """
    if check_schedule(schedule) == "gpipe":
        return gpipe_order(num_stages, num_microbatches, stage)
    return one_f_one_b_order(num_stages, num_microbatches, stage)


def stage_actions(
    schedule: str, num_stages: int, num_microbatches: int, stage: int
) -> list[tuple[str, int]]:
    """``(instruction, microbatch)`` of one stage in execution order under ``schedule``."""
    return with_microbatches(stage_order(schedule, num_stages, num_microbatches, stage))


def with_microbatches(names: Sequence[str]) -> list[tuple[str, int]]:
    """Number each instruction by its microbatch: the ``k``-th of each kind is microbatch ``k``."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        out.append((name, seen.get(name, 0)))
        seen[name] = seen.get(name, 0) + 1
    return out


def schedules_matching(stages: Sequence[Sequence[str]], num_stages: int | None = None) -> list[str]:
    """The supported schedules whose order every stage follows (stage ``s`` is ``stages[s]``).

    Both schedules coincide for one microbatch (``forward, backward``), so more than one
    can match; none matches a malformed plan.

    Args:
        stages: Instruction names per stage, in execution order.
        num_stages: The pipeline's stage count, when ``stages`` lists only some stages of it
            (stage ``s`` is still ``stages[s]``); default ``len(stages)``.

    """
    total = len(stages) if num_stages is None else num_stages
    if not stages or total < len(stages):
        return []
    micro = sum(1 for name in stages[0] if name == "forward")
    if micro < 1:
        return []
    return [
        schedule
        for schedule in PIPELINE_SCHEDULES
        if all(
            list(names) == stage_order(schedule, total, micro, s) for s, names in enumerate(stages)
        )
    ]
