"""Serve a plan chosen from a planner's frontier, and move along the frontier on demand.

``FrontierScheduler`` picks a plan from a frontier with a policy (see
:mod:`schedulers.planning.choose`) and serves it to every rank. ``set_target(seconds)`` (e.g. a
straggler's iteration time, sent with ``SetTarget``) switches to the least-energy plan that
still meets the target, or the fastest plan if none does; the next ``next_schedule`` returns
it. Profiling results do not change the plan.

The frontier comes from one of two places:

* ``frontier_dir``: a ``perseus optimize`` output folder. ``frontier.csv`` and ``allmax.csv``
  are read in the constructor; a plan is read the first time it is needed (a frontier can hold
  thousands), from its file or, for a folder written with ``--plans chosen``, rebuilt from
  ``plans.delta``;
* ``profile`` (with ``microbatches``, ``unit_time``, ``p2p_power``, ``solver``, ``schedule``):
  an instruction profile CSV, planned in memory with the planner's core
  (:func:`~schedulers.planning.frontier_compute.compute_frontier`) whenever an rq worker
  rebuilds the scheduler. With the compiled core this takes a fraction of a second for an 8x32
  pipeline, so a target never waits for a planner run, and no folder needs sharing.

``FrontierScheduler3D`` serves the same plans to data/tensor-parallel jobs: every rank of a
stage gets that stage's line (:func:`schedulers.parallel3d.make_3d_parallel`).

Determinism: the choice depends only on the folder's files (or the profile and the planning
parameters), the policy and the targets received, in order; the folder must not change while
jobs use it, which holds for planner output (written once).
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any

from protocol.exceptions import ConfigError
from protocol.models import FrequencySchedule, JobInfo, ProfilingResult, RankInfo
from protocol.pipeline_schedules import DEFAULT_SCHEDULE, check_schedule
from protocol.scheduler import FrequencyScheduler
from schedulers.parallel3d import check_rank_infos, make_3d_parallel
from schedulers.planning.choose import parse_policy, select_point
from schedulers.planning.frontier_compute import (
    SOLVERS,
    ComputedFrontier,
    compute_frontier,
    p2p_unset_note,
)
from schedulers.planning.frontier_files import Frontier, FrontierPoint, load_frontier
from schedulers.planning.frontier_plans import plan_from_log
from schedulers.planning.pipeline_dag import MAX_INSTRUCTIONS, check_job_instructions
from schedulers.planning.plan_file import PlanFile, read_plan_file
from schedulers.planning.profile_csv import read_profile_csv
from schedulers.point_solution import check_plan_fits

logger = logging.getLogger(__name__)


# FrontierScheduler's arguments that only planning from a profile reads.
_PLANNING_ARGS = (
    "microbatches",
    "unit_time",
    "p2p_power",
    "solver",
    "schedule",
    "max_instructions",
)


def _read_plan(frontier: Frontier, point: FrontierPoint) -> PlanFile:
    """A folder's plan: its file, else rebuilt from the folder's ``plans.delta``."""
    path = frontier.path(point)
    return read_plan_file(path) if path.is_file() else plan_from_log(frontier, point)


class FrontierScheduler(FrequencyScheduler):
    """Serve the frontier plan a policy picks; ``set_target`` picks again for a new time.

    Args:
        job_info: The training job (pure pipeline parallel: one rank per stage).
        rank_infos: Every rank of the job, in any order.
        frontier_dir: A ``perseus optimize`` output folder (or give ``profile``).
        policy: ``no-slowdown``, ``min-energy``, ``max-slowdown``, ``deadline`` or
            ``straggler`` (see :mod:`schedulers.planning.choose`); the value may be included, as in
            ``"max-slowdown 1.05"``.
        policy_arg: The policy's value (factor or seconds), if not given in ``policy``.
        profile: An instruction profile CSV to plan from, instead of ``frontier_dir``.
        microbatches: Microbatches per iteration (with ``profile``).
        unit_time: The planner's time unit, s (with ``profile``).
        p2p_power: GPU power while blocked on P2P communication, W (with ``profile``). Left
            out, the plans count 0 W (waiting is free), and the worker that computes the
            job's first version logs a warning that says so.
        solver: The planner's solver (with ``profile``; see ``perseus optimize --solver``).
        schedule: The pipeline schedule the training runs, ``"1f1b"`` or ``"gpipe"`` (with
            ``profile``).
        max_instructions: Refuse a pipeline of more instructions, ``2 * pp_degree *
            microbatches`` (with ``profile``): the planner's time grows about with their
            square. Checked when the coordinator starts (for one stage) and when a job
            registers (for its stages).

    Raises:
        ConfigError: Neither or both of ``frontier_dir`` and ``profile``; a missing or malformed
            frontier or profile; a pipeline of more than ``max_instructions`` instructions;
            bad policy; a plan whose number of stages is not the job's, or
            a frequency some rank's GPU does not support.

    """

    def __init__(
        self,
        job_info: JobInfo,
        rank_infos: list[RankInfo],
        frontier_dir: str | None = None,
        policy: str = "no-slowdown",
        policy_arg: float | None = None,
        *,
        profile: str | None = None,
        microbatches: int | None = None,
        unit_time: float = 0.001,
        p2p_power: float | None = None,
        solver: str = "auto",
        schedule: str = DEFAULT_SCHEDULE,
        max_instructions: int = MAX_INSTRUCTIONS,
    ) -> None:
        super().__init__(job_info, rank_infos)
        args = {"frontier_dir": frontier_dir, "policy": policy, "policy_arg": policy_arg}
        args |= {"profile": profile, "microbatches": microbatches, "unit_time": unit_time}
        args |= {"p2p_power": p2p_power, "solver": solver, "schedule": schedule}
        args |= {"max_instructions": max_instructions}
        self.check_args(args)
        self.check_job(args, job_info)  # Before the profile is read.
        self.frontier_dir = frontier_dir
        self.policy, self.policy_arg = parse_policy(policy, policy_arg)
        self._ranks = check_rank_infos(job_info, rank_infos)
        self._computed: ComputedFrontier | None = None
        # Logged with the first schedule computed for real (not again in a replay).
        self._p2p_unset = profile is not None and p2p_power is None
        self._served = False
        if profile is not None:
            assert microbatches is not None  # check_args
            self._computed = compute_frontier(
                read_profile_csv(profile, num_stages=job_info.pp_degree),
                job_info.pp_degree,
                int(microbatches),
                p2p_power=float(p2p_power or 0.0),
                unit_time=float(unit_time),
                solver=solver,
                schedule=schedule,
                max_instructions=max_instructions,
            )
            self.frontier = self._computed.frontier(Path(profile), self._computed.base_meta())
        else:
            assert frontier_dir is not None
            self.frontier = load_frontier(frontier_dir)
        self._plans: dict[str, PlanFile] = {}
        self.target: float | None = None
        point, _, _ = select_point(self.frontier, self.policy, self.policy_arg)
        self._load(point)
        self.current: FrontierPoint = point

    server_path_args = frozenset({"frontier_dir", "profile"})

    @classmethod
    def check_args(cls, args: dict[str, Any]) -> None:
        """Check what needs no file: one source, the policy, the planning arguments.

        With ``profile``: ``microbatches`` given and >= 1, a known solver and schedule,
        ``unit_time`` > 0, ``p2p_power`` >= 0, and ``max_instructions`` >= 1 and at least
        the instructions of one stage (:meth:`check_job` checks the job's stages). The types
        were checked against the constructor's annotations before
        (:func:`protocol.scheduler.check_scheduler_args`).
        """
        name = cls.__name__
        given = [k for k in ("frontier_dir", "profile") if args.get(k) is not None]
        if len(given) != 1:
            raise ConfigError(
                f"{name}: needs exactly one of frontier_dir (a perseus optimize folder) and "
                f"profile (a profile CSV to plan from); got {given or 'neither'}"
            )
        try:
            parse_policy(args.get("policy", "no-slowdown"), args.get("policy_arg"))
            check_schedule(args.get("schedule", DEFAULT_SCHEDULE))
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None
        if args.get("profile") is None:
            cls._check_no_planning_args(args)
            return
        microbatches = args.get("microbatches")
        if microbatches is None:
            raise ConfigError(
                f"{name}: profile needs microbatches (microbatches per iteration, as given to "
                "perseus optimize --microbatches)"
            )
        if microbatches < 1:
            raise ConfigError(f"{name}: microbatches must be >= 1, got {microbatches}")
        if not args.get("unit_time", 0.001) > 0:
            raise ConfigError(f"{name}: unit_time must be positive, got {args['unit_time']}")
        if args.get("p2p_power") is not None and not args["p2p_power"] >= 0:
            raise ConfigError(f"{name}: p2p_power must be >= 0 W, got {args['p2p_power']}")
        solver = args.get("solver", "auto")
        if solver not in SOLVERS:
            raise ConfigError(f"{name}: unknown solver {solver!r}; use one of {', '.join(SOLVERS)}")
        cls._check_size(args, None)

    @classmethod
    def check_job(cls, args: dict[str, Any], job: JobInfo) -> None:
        """Planning from a profile: the job's stages times ``microbatches`` within the bound."""
        if args.get("profile") is not None:
            cls._check_size(args, job.pp_degree)

    @classmethod
    def _check_size(cls, args: dict[str, Any], stages: int | None) -> None:
        """Raise ConfigError for a pipeline over ``max_instructions`` (None: 1 stage, unsaid)."""
        check_job_instructions(
            cls.__name__,
            stages,
            int(args["microbatches"]),
            args.get("max_instructions", MAX_INSTRUCTIONS),
            raise_with=f"set {cls.__name__}'s scheduler argument max_instructions",
        )

    @classmethod
    def _check_no_planning_args(cls, args: dict[str, Any]) -> None:
        """Refuse planning arguments beside ``frontier_dir``, which were ignored.

        The folder's plans were made by ``perseus optimize`` with its own arguments: a
        ``schedule`` of ``gpipe`` beside a 1f1b folder served the 1f1b plans without a word.
        A value equal to the default is let through (it changes nothing).
        """
        # The defaults are __init__'s own, one place to change them (FrontierScheduler's:
        # cls may be its 3D wrapper, whose __init__ takes **kwargs).
        params = inspect.signature(FrontierScheduler.__init__).parameters
        given = [
            key
            for key in _PLANNING_ARGS
            if args.get(key, params[key].default) != params[key].default
        ]
        if given:
            verb = "plans" if len(given) == 1 else "plan"
            raise ConfigError(
                f"{cls.__name__}: {', '.join(map(repr, given))} {verb} from a profile only; "
                "with frontier_dir the folder's plans were made by `perseus optimize` with its "
                "own --microbatches, --schedule, --unit-time, --p2p-power and --solver: leave "
                "them out, or give profile instead of frontier_dir"
            )

    @classmethod
    def check_files(cls, args: dict[str, Any]) -> None:
        """The frontier folder (or profile) must load and the policy must pick one of its plans."""
        if args.get("profile") is not None:
            read_profile_csv(args["profile"])
            return
        frontier = load_frontier(args["frontier_dir"])
        policy, value = parse_policy(args.get("policy", "no-slowdown"), args.get("policy_arg"))
        point, _, _ = select_point(frontier, policy, value)
        _read_plan(frontier, point)

    @property
    def plan(self) -> PlanFile:
        """The plan being served."""
        return self._plans[self.current.plan]

    def _load(self, point: FrontierPoint) -> PlanFile:
        """Read (once) and check a plan against the job."""
        if point.plan in self._plans:
            return self._plans[point.plan]
        if self._computed is not None:
            plan = self._computed.plan(point.index)
        else:
            plan = _read_plan(self.frontier, point)
        check_plan_fits(
            plan,
            self.job_info,
            self._ranks,
            stage_of=lambda info: info.pp_rank,
            name="FrontierScheduler",
            real_job=getattr(self, "real_job_info", None),  # Set by the 3D wrapper.
        )
        self._plans[point.plan] = plan
        return plan

    @property
    def converged(self) -> bool:
        """The plan changes only on targets: results never require a new version."""
        return True

    def set_target(self, iteration_time: float) -> None:
        """Switch to the least-energy plan that meets ``iteration_time`` seconds.

        If no plan is that fast, the fastest plan is used, with a warning in the worker's log
        (not again when a worker replays the target).

        Raises:
            ConfigError: ``iteration_time`` is not positive, or the new plan does not fit
                the job.

        """
        point, _, note = select_point(self.frontier, "straggler", iteration_time)
        if note and not self.replaying:  # Only when no plan meets the target; once.
            logger.warning("job %s: %s (plan %s)", self.job_info.job_id, note, point.plan)
        self._load(point)
        self.current = point
        self.target = iteration_time

    def observe(self, profiling_results: list[ProfilingResult]) -> None:
        """Profiling results do not change the plan (targets do)."""

    def next_schedule(self) -> list[FrequencySchedule]:
        """Return the current plan, one schedule per rank (rank ``r`` runs stage ``pp_rank``)."""
        if self._p2p_unset and not self._served and not self.replaying:
            note = p2p_unset_note(f"{type(self).__name__}'s p2p_power")
            logger.warning("job %s: %s", self.job_info.job_id, note)
        self._served = True
        plan = self.plan
        return [
            FrequencySchedule(rank=info.rank, frequencies=list(plan.stages[info.pp_rank]))
            for info in self._ranks
        ]


FrontierScheduler3D = make_3d_parallel(FrontierScheduler)
