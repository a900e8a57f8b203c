"""What an InstructionProfiler does once profiled with ``then``: plan in the job's folder, choose.

Each job plans in a folder of its own (``<then out_dir>/<job id>/``) from the profile it
measured (:data:`MEASURED_PROFILE` there). The planner runs once per profile and parameters:
their hash is recorded in :data:`PLAN_MARKER` after it finished, so a worker that replays the
job's journal chooses from the frontier already there.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from typing_extensions import Required, TypedDict

from protocol.exceptions import ConfigError
from schedulers.planning.choose import ChosenPlan, choose_plan, parse_policy
from schedulers.planning.frontier_files import FRONTIER_CSV
from schedulers.planning.pipeline_dag import MAX_INSTRUCTIONS, check_job_instructions
from schedulers.planning.plan_file import PlanFile, read_plan_file
from schedulers.planning.planner import plan_frontier
from schedulers.planning.profile_csv import read_profile_csv

#: Marker file in a job's planner folder: the hash of the CSV and parameters it was planned from.
PLAN_MARKER = ".instruction_profiler.json"
#: The measured profile (full form) a job's planner folder is planned from.
MEASURED_PROFILE = "measured_profile.csv"
_THEN_KEYS = {"p2p_power", "unit_time", "policy", "policy_arg", "out_dir", "max_instructions"}


class ThenArgs(TypedDict, total=False):
    """``then``: plan and serve a plan once profiled (only ``out_dir`` is required)."""

    out_dir: Required[str]
    p2p_power: float
    unit_time: float
    policy: str
    policy_arg: float | None
    max_instructions: int


def plan_in_folder(
    folder: Path, then: dict[str, Any], num_stages: int, microbatches: int, schedule: str
) -> tuple[ChosenPlan, PlanFile, bool]:
    """Plan from ``folder``'s measured profile (unless done for it already) and choose a plan.

    Args:
        folder: The job's planner folder, holding :data:`MEASURED_PROFILE`.
        then: The checked ``then`` (:func:`check_then`).
        num_stages: Pipeline stages of the job.
        microbatches: Microbatches per iteration.
        schedule: The pipeline schedule planned for.

    Returns:
        The chosen plan, its plan file, and whether the planner ran (False: cached).

    Raises:
        ConfigError: The chosen plan does not fit the job.
    """
    measured = folder / MEASURED_PROFILE
    params = {
        "num_stages": num_stages,
        "num_microbatches": microbatches,
        "p2p_power": then["p2p_power"],
        "unit_time": then["unit_time"],
        "schedule": schedule,
    }
    digest = hashlib.sha256(measured.read_bytes())
    digest.update(json.dumps(params, sort_keys=True).encode())
    key = digest.hexdigest()
    marker = folder / PLAN_MARKER
    planned = False
    if not (_marker_key(marker) == key and (folder / FRONTIER_CSV).is_file()):
        marker.unlink(missing_ok=True)  # An interrupted planner run must not look cached.
        profile = read_profile_csv(measured, num_stages=num_stages)
        plan_frontier(
            profile,
            num_stages,
            microbatches,
            out_dir=folder,
            p2p_power=then["p2p_power"],
            unit_time=then["unit_time"],
            schedule=schedule,
            max_instructions=then["max_instructions"],
        )
        marker.write_text(
            json.dumps({"key": key, "profile": str(measured), **params}, indent=1) + "\n"
        )
        planned = True
    chosen = choose_plan(folder, then["policy"], then["policy_arg"])
    plan = read_plan_file(chosen.file)
    if plan.num_stages != num_stages:
        raise ConfigError(f"{plan.source}: plan has {plan.num_stages} stages, job has {num_stages}")
    return chosen, plan, planned


def write_if_changed(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically; leave an identical file (and its mtime) alone."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_file() and path.read_bytes() == data:
        return  # A replay: keep the file as it was.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _marker_key(marker: Path) -> str | None:
    try:
        return str(json.loads(marker.read_text())["key"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_then_size(then: dict[str, Any], stages: int | None, microbatches: int) -> None:
    """Raise ConfigError unless planning ``stages`` x ``microbatches`` is within the bound.

    Args:
        then: The checked ``then`` (:func:`check_then`), whose ``max_instructions`` bounds it.
        stages: The job's stages; None where no job is known yet (checked for 1 stage).
        microbatches: Microbatches per iteration.
    """
    check_job_instructions(
        "then", stages, microbatches, then["max_instructions"], "set then's max_instructions"
    )


def check_then(then: ThenArgs | dict[str, Any] | None) -> dict[str, Any] | None:
    """Validate ``then`` and fill in its defaults."""
    if then is None:
        return None
    unknown = sorted(set(then) - _THEN_KEYS)
    if unknown:
        raise ConfigError(f"then: unknown key(s) {unknown}; use {sorted(_THEN_KEYS)}")
    if not then.get("out_dir"):
        raise ConfigError("then: 'out_dir' (the planner's output folder) is required")
    p2p_power = float(then.get("p2p_power", 0.0))
    unit_time = float(then.get("unit_time", 0.001))
    if not p2p_power >= 0:
        raise ConfigError(f"then: p2p_power must be >= 0 W, got {p2p_power}")
    if not unit_time > 0:
        raise ConfigError(f"then: unit_time must be positive, got {unit_time}")
    max_instructions = int(then.get("max_instructions", MAX_INSTRUCTIONS))
    if max_instructions < 1:
        raise ConfigError(f"then: max_instructions must be >= 1, got {max_instructions}")
    raw_arg = then.get("policy_arg")
    policy, policy_arg = parse_policy(
        str(then.get("policy", "no-slowdown")), None if raw_arg is None else float(raw_arg)
    )
    return {
        "out_dir": str(then["out_dir"]),
        "p2p_power": p2p_power,
        "unit_time": unit_time,
        "policy": policy,
        "policy_arg": policy_arg,
        "max_instructions": max_instructions,
    }
