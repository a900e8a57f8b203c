"""Serve a plan chosen from a planner's frontier, and move along the frontier on demand.

``FrontierScheduler`` picks a plan from a ``perseus optimize`` output folder with a policy
(see :mod:`schedulers.planning.choose`) and serves it to every rank. ``set_target(seconds)`` (e.g. a
straggler's iteration time, sent with ``SetTarget``) switches to the least-energy plan that
still meets the target, or the fastest plan if none does; the next ``next_schedule`` returns
it. Profiling results do not change the plan.

``FrontierScheduler3D`` serves the same plans to data/tensor-parallel jobs: every rank of a
stage gets that stage's line (:func:`schedulers.parallel3d.make_3d_parallel`).

Determinism: the choice depends only on the folder's files, the policy and the targets
received, in order. ``frontier.csv`` is read in the constructor; a plan file is read the first
time it is needed (a frontier can hold thousands), so the folder must not change while jobs use
it, which holds for planner output (written once).
"""

from __future__ import annotations

from typing import Any

from protocol.models import FrequencySchedule, JobInfo, ProfilingResult, RankInfo
from protocol.scheduler import FrequencyScheduler
from schedulers.parallel3d import check_rank_infos, make_3d_parallel
from schedulers.planning.choose import parse_policy, select_point
from schedulers.planning.frontier_files import FrontierPoint, load_frontier
from schedulers.planning.plan_file import PlanFile, read_plan_file
from schedulers.point_solution import check_plan_fits


class FrontierScheduler(FrequencyScheduler):
    """Serve the frontier plan a policy picks; ``set_target`` picks again for a new time.

    Args:
        job_info: The training job (pure pipeline parallel: one rank per stage).
        rank_infos: Every rank of the job, in any order.
        frontier_dir: A ``perseus optimize`` output folder.
        policy: ``no-slowdown``, ``min-energy``, ``max-slowdown``, ``deadline`` or
            ``straggler`` (see :mod:`schedulers.planning.choose`); the value may be included, as in
            ``"max-slowdown 1.05"``.
        policy_arg: The policy's value (factor or seconds), if not given in ``policy``.

    Raises:
        ConfigError: Missing or malformed frontier, bad policy, a plan whose number of stages
            is not the job's, or a frequency some rank's GPU does not support.

    """

    def __init__(
        self,
        job_info: JobInfo,
        rank_infos: list[RankInfo],
        frontier_dir: str,
        policy: str = "no-slowdown",
        policy_arg: float | None = None,
    ) -> None:
        super().__init__(job_info, rank_infos)
        self.frontier_dir = frontier_dir
        self.frontier = load_frontier(frontier_dir)
        self.policy, self.policy_arg = parse_policy(policy, policy_arg)
        self._ranks = check_rank_infos(job_info, rank_infos)
        self._plans: dict[str, PlanFile] = {}
        self.target: float | None = None
        point, _, _ = select_point(self.frontier, self.policy, self.policy_arg)
        self._load(point)
        self.current: FrontierPoint = point

    server_path_args = frozenset({"frontier_dir"})

    @classmethod
    def check_files(cls, args: dict[str, Any]) -> None:
        """The frontier folder must load and the policy must pick one of its plans."""
        frontier = load_frontier(args["frontier_dir"])
        policy, value = parse_policy(args.get("policy", "no-slowdown"), args.get("policy_arg"))
        point, _, _ = select_point(frontier, policy, value)
        read_plan_file(frontier.path(point))

    @property
    def plan(self) -> PlanFile:
        """The plan being served."""
        return self._plans[self.current.plan]

    def _load(self, point: FrontierPoint) -> PlanFile:
        """Read (once) and check a plan against the job."""
        if point.plan in self._plans:
            return self._plans[point.plan]
        plan = read_plan_file(self.frontier.path(point))
        check_plan_fits(
            plan,
            self.job_info,
            self._ranks,
            stage_of=lambda info: info.pp_rank,
            name="FrontierScheduler",
        )
        self._plans[point.plan] = plan
        return plan

    @property
    def converged(self) -> bool:
        """The plan changes only on targets: results never require a new version."""
        return True

    def set_target(self, iteration_time: float) -> None:
        """Switch to the least-energy plan that meets ``iteration_time`` seconds.

        If no plan is that fast, the fastest plan is used.

        Raises:
            ConfigError: ``iteration_time`` is not positive, or the new plan does not fit
                the job.

        """
        point, _, _ = select_point(self.frontier, "straggler", iteration_time)
        self._load(point)
        self.current = point
        self.target = iteration_time

    def observe(self, profiling_results: list[ProfilingResult]) -> None:
        """Profiling results do not change the plan (targets do)."""

    def next_schedule(self) -> list[FrequencySchedule]:
        """Return the current plan, one schedule per rank (rank ``r`` runs stage ``pp_rank``)."""
        plan = self.plan
        return [
            FrequencySchedule(rank=info.rank, frequencies=list(plan.stages[info.pp_rank]))
            for info in self._ranks
        ]


FrontierScheduler3D = make_3d_parallel(FrontierScheduler)
