"""Perseus on ``torch.distributed.pipelining``: every action a schedule runs goes through the hook.

:class:`PerseusPipeline` takes a rank's ``Schedule1F1B`` or ``ScheduleGPipe`` (one
``PipelineStage`` per rank) and patches three things on that schedule object and its stage,
nothing else:

* ``schedule.step(...)`` runs between ``on_step_begin`` and ``on_step_end``, so a newer
  schedule version is swapped in only between steps;
* ``stage.forward_one_chunk`` / ``stage.backward_one_chunk`` (what both schedules call for
  every microbatch) run between ``on_instruction_begin`` and ``on_instruction_end``: the planned
  clock is requested before the action, its time (and energy) measured around it. On the last
  stage the forward's window also covers the loss the schedule computes right after it.

Each action is checked against the planner's order for that schedule
(:mod:`protocol.pipeline_schedules`), microbatch index included; a torch whose
schedule runs another order fails at the first differing action with a
:class:`~protocol.exceptions.ScheduleError`, never with a wrong plan. The schedule the
coordinator serves is checked at wrap time and at every new version: a plan made for the
other schedule (``perseus optimize --schedule``) is a clear error naming both.

Supported: ``Schedule1F1B`` and ``ScheduleGPipe`` and subclasses that keep their
``_step_microbatches``. Anything else (``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``,
zero-bubble and V schedules: several stages per rank or split backwards) is refused at wrap
time. ``schedule.eval(...)`` (forward only) runs without the hook.

torch is imported here at module level: this module is only for training processes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    Schedule1F1B,
    ScheduleGPipe,
)

from protocol.exceptions import ConfigError, ScheduleError
from protocol.pipeline_schedules import (
    PIPELINE_SCHEDULES,
    stage_actions,
    stage_order,
)
from worker_client.hook.joining import agree, refuse_to_join
from worker_client.hook.optimizer import PerseusOptimizer
from worker_client.hook.options import refuse_zeus_keywords, whole_number

#: torch schedule class -> the planner's name for its order.
SUPPORTED_SCHEDULES: dict[type, str] = {Schedule1F1B: "1f1b", ScheduleGPipe: "gpipe"}


#: What a rank waits for in the wrap's last agreement (see joining.agree).
_OTHER_PIPELINES = "the other ranks to create their PerseusPipeline"

_NOTHING = object()  # close(): the instance held no attribute of that name before the wrap


class _Wrapped:
    """One of our replacements on a schedule or stage: a second wrap can tell it is there."""

    __slots__ = ("function",)

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)


def schedule_kind(schedule: object) -> str:
    """The planner schedule (``"1f1b"``/``"gpipe"``) a torch pipeline schedule runs.

    A subclass counts as its base only if it runs the base's ``_step_microbatches``: that
    method decides the order of the actions.

    Raises:
        ConfigError: An unsupported schedule, named with the supported ones.

    """
    supported = ", ".join(cls.__name__ for cls in SUPPORTED_SCHEDULES)
    name = type(schedule).__name__
    run = getattr(type(schedule), "_step_microbatches", None)
    for cls, kind in SUPPORTED_SCHEDULES.items():
        if run is getattr(cls, "_step_microbatches", None):
            return kind
    if isinstance(schedule, PipelineScheduleMulti):
        why = "it runs several stages per rank (interleaved, looped or V schedules)"
    elif isinstance(schedule, tuple(SUPPORTED_SCHEDULES)):
        why = "it overrides _step_microbatches, so its action order is unknown to the planner"
    else:
        why = "the planner knows no order for it"
    raise ConfigError(
        f"Perseus does not support {name}: {why}; supported schedules: {supported} "
        f"(planner: perseus optimize --schedule {{{','.join(PIPELINE_SCHEDULES)}}})"
    )


def _check_layout(
    hook: object,
    dp_rank: int | None,
    dp_degree: int | None,
    tp_rank: int,
    tp_degree: int,
    device_id: int | None,
) -> None:
    """Refuse a hook that is no hook, and layout arguments of the wrong type or range.

    ``PerseusPipeline(schedule, "redis://...")`` failed with "'str' object has no attribute
    'pp_rank'", and ``tp_degree=0`` with a ZeroDivisionError.
    """
    if hook is not None and not isinstance(hook, PerseusOptimizer):
        raise ConfigError(
            f"hook must be a PerseusOptimizer or None, got {hook!r} ({type(hook).__name__}); "
            "pass the Redis URL as redis_url=..."
        )
    for name, value, minimum in (
        ("dp_rank", dp_rank, 0),
        ("dp_degree", dp_degree, 1),
        ("tp_rank", tp_rank, 0),
        ("tp_degree", tp_degree, 1),
        ("device_id", device_id, 0),
    ):
        if value is not None:
            whole_number(name, value, minimum)


def _default_device_id(stage: Any) -> int:
    device = torch.device(stage.device)
    if device.type == "cuda":
        return device.index if device.index is not None else torch.cuda.current_device()
    return 0


class PerseusPipeline:
    """Run a rank's ``torch.distributed.pipelining`` schedule under the Perseus hook.

    Create it after ``dist.init_process_group`` and after building the schedule; keep calling
    ``schedule.step(...)`` as before; call :meth:`close` (or use ``with``) at the end.

    Args:
        schedule: This rank's ``Schedule1F1B`` or ``ScheduleGPipe`` (with a ``loss_fn``).
        hook: A hook you built yourself; by default one is built from the stage (rank,
            ``pp_rank = stage.stage_index``, ``pp_degree = stage.num_stages``) and
            ``hook_options``, and closed by :meth:`close`.
        dp_rank: Data parallel rank (needed, with ``dp_degree``, when the world is larger
            than the pipeline).
        dp_degree: Data parallel degree.
        tp_rank: Tensor parallel rank.
        tp_degree: Tensor parallel degree.
        device_id: CUDA index of this rank's GPU (default: the stage's device); the hook
            finds its NVML index through ``CUDA_VISIBLE_DEVICES``.
        **hook_options: :class:`~worker_client.hook.optimizer.PerseusOptimizer` keywords:
            ``redis_url`` (required), ``job_metadata``, ``controller``, ``report_every``, ...

    Raises:
        ConfigError: Unsupported schedule, no ``loss_fn``, or rank layout arguments missing.
        ScheduleError: The schedule the coordinator serves does not follow this schedule's
            order (e.g. a plan made with ``--schedule gpipe`` for a ``Schedule1F1B``).
        PerseusError: Another rank raised one of these (or its hook failed to start): every
            rank raises at once, naming that rank and its error, instead of leaving the
            others waiting in a collective or in the pipeline's first transfer.

    """

    def __init__(
        self,
        schedule: Any,
        hook: PerseusOptimizer | None = None,
        *,
        dp_rank: int | None = None,
        dp_degree: int | None = None,
        tp_rank: int = 0,
        tp_degree: int = 1,
        device_id: int | None = None,
        **hook_options: Any,
    ) -> None:
        # A rank that fails here alone must tell the others, which would otherwise wait in
        # the hook's collectives or in the pipeline's first send for a rank that is gone.
        grouped = dist.is_initialized()  # without a group no other rank waits (nor can hear)
        rank = dist.get_rank() if grouped else 0
        failure: Exception | None = None
        options: dict[str, Any] = {}
        try:
            refuse_zeus_keywords("PerseusPipeline", hook_options)
            _check_layout(hook, dp_rank, dp_degree, tp_rank, tp_degree, device_id)
            stage = self._check_wrappable(schedule)
            self.schedule = schedule
            self.stage = stage
            self.num_stages: int = stage.num_stages
            self.stage_index: int = stage.stage_index
            self.num_microbatches: int = schedule._n_microbatches
            self.actions = stage_actions(
                self.kind, self.num_stages, self.num_microbatches, self.stage_index
            )
            self._names = [name for name, _ in self.actions]
            if hook is None:
                options = self._hook_options(dp_rank, dp_degree, tp_rank, tp_degree, device_id)
                options |= hook_options
            else:
                layout = {"dp_rank": dp_rank is not None, "dp_degree": dp_degree is not None}
                layout |= {"tp_rank": tp_rank != 0, "tp_degree": tp_degree != 1}
                layout["device_id"] = device_id is not None
                given = sorted(hook_options) + [name for name, passed in layout.items() if passed]
                if given:  # the hook was built with its own: these would be ignored unsaid
                    raise ConfigError(f"pass either hook or hook options, not both: {given}")
        except ConfigError as exc:
            failure = exc
        self._owns_hook = hook is None
        if hook is None:
            if failure is not None:
                refuse_to_join(rank, failure)  # the other ranks' hooks raise it too
            hook = PerseusOptimizer(**options)
        self.hook: PerseusOptimizer = hook
        self._checked_version = -1
        try:
            if failure is None:
                self._check_hook_and_plan()
        except (ConfigError, ScheduleError) as exc:
            failure = exc
        try:
            if grouped:
                agree(rank, failure, "no PerseusPipeline created", _OTHER_PIPELINES)
            elif failure is not None:
                raise failure
        except BaseException:
            if self._owns_hook:
                hook.close()
            raise
        self.last_step_actions: list[tuple[str, int]] = []  # What torch ran in the last step.
        self._in_step = False
        self._pending: str | None = None  # The last stage's forward, open until its loss.
        self._patched: list[tuple[Any, str, Any]] = []  # (owner, name, instance attribute)
        self._patch(schedule, "step", self._step)
        self._patch(stage, "forward_one_chunk", self._forward_one_chunk)
        self._patch(stage, "backward_one_chunk", self._backward_one_chunk)
        # The last stage's loss belongs to its forward (as in Perseus's profiles).
        self._loss_ends_forward = stage.is_last and hasattr(schedule, "_maybe_compute_loss")
        if self._loss_ends_forward:
            self._patch(schedule, "_maybe_compute_loss", self._compute_loss)
        self._closed = False

    # --- setup ---------------------------------------------------------------------------------
    def _check_wrappable(self, schedule: Any) -> Any:
        """Refuse a schedule this class cannot wrap; return its stage.

        Raises:
            ConfigError: An unsupported schedule, one already wrapped, or one without a stage
                or a ``loss_fn``.
        """
        self.kind = schedule_kind(schedule)
        if isinstance(vars(schedule).get("step"), _Wrapped):
            # Two wraps would register two jobs for one GPU, each timing every action.
            raise ConfigError(
                f"this {type(schedule).__name__} is already wrapped by a PerseusPipeline; "
                "close() that one first"
            )
        stage = getattr(schedule, "_stage", None)
        if stage is None or not hasattr(stage, "forward_one_chunk"):
            raise ConfigError(
                f"{type(schedule).__name__} has no PipelineStage (this torch "
                f"{torch.__version__} keeps it elsewhere); cannot attach Perseus"
            )
        if isinstance(vars(stage).get("forward_one_chunk"), _Wrapped):
            # Another schedule over this stage is wrapped: a second job for the GPU, and the
            # first close() would take this wrap's patches off the stage.
            raise ConfigError(
                f"the PipelineStage (stage {stage.stage_index}) of this "
                f"{type(schedule).__name__} is already under a PerseusPipeline of another "
                "schedule; close() that one first"
            )
        if getattr(schedule, "_loss_fn", None) is None:
            raise ConfigError(
                f"{type(schedule).__name__} has no loss_fn: it runs forwards only, and Perseus "
                "plans training iterations (forward and backward)"
            )
        return stage

    def _check_hook_and_plan(self) -> None:
        """The hook must be for this stage, and its schedule must follow this schedule's order."""
        hook = self.hook
        if hook.pp_rank != self.stage_index or hook.pp_degree != self.num_stages:
            # A GPipe stage runs the same order whatever the number of stages: a job of
            # another pp_degree would be served a plan for another pipeline, unnoticed.
            raise ConfigError(
                f"the hook is for pp_rank {hook.pp_rank} of pp_degree {hook.pp_degree} but "
                f"the schedule's stage is {self.stage_index} of {self.num_stages}"
            )
        self._check_served_order()

    def _hook_options(
        self,
        dp_rank: int | None,
        dp_degree: int | None,
        tp_rank: int,
        tp_degree: int,
        device_id: int | None,
    ) -> dict[str, Any]:
        """The hook's rank layout, from the stage and the group (without ``hook_options``).

        Raises:
            ConfigError: The layout does not fit the group's size, or ``dp_rank`` is needed.
        """
        world = dist.get_world_size()
        if dp_degree is None:
            dp_degree = world // (self.num_stages * tp_degree)
        if dp_degree * self.num_stages * tp_degree != world:
            raise ConfigError(
                f"world size {world} is not pp {self.num_stages} x dp {dp_degree} x tp "
                f"{tp_degree}; pass dp_degree= and tp_degree="
            )
        if dp_rank is None:
            if dp_degree > 1:
                raise ConfigError(
                    f"world size {world} holds {dp_degree} pipelines: pass dp_rank= (and "
                    "tp_rank=) for this rank, as your device mesh assigns them"
                )
            dp_rank = 0
        return {
            "rank": dist.get_rank(),
            "dp_rank": dp_rank,
            "pp_rank": self.stage_index,
            "tp_rank": tp_rank,
            "device_id": _default_device_id(self.stage) if device_id is None else device_id,
            "dp_degree": dp_degree,
            "pp_degree": self.num_stages,
            "tp_degree": tp_degree,
            "world_size": world,
        }

    def _patch(self, owner: Any, name: str, replacement: Callable[..., Any]) -> None:
        original = getattr(owner, name)
        setattr(self, f"_orig_{name}", original)
        # Whatever the instance itself held (a patch of the user's, say) is put back by close().
        self._patched.append((owner, name, vars(owner).get(name, _NOTHING)))
        # An instance attribute: the class stays as it is.
        setattr(owner, name, _Wrapped(replacement))

    def _check_served_order(self) -> None:
        """The coordinator's schedule for this rank must follow this torch schedule's order."""
        served = self.hook.schedule
        if served.version == self._checked_version:
            return
        names = [name for name, _ in served.frequencies]
        if names != self._names:
            cls = type(self.schedule).__name__
            micro = names.count("forward")
            # This rank's stage, not stage 0: a later stage's order differs from the first's.
            others = [
                kind
                for kind in PIPELINE_SCHEDULES
                if micro >= 1
                and names == stage_order(kind, self.num_stages, micro, self.stage_index)
            ]
            if others and micro != self.num_microbatches:
                what = f"{micro} microbatches in {others[0]} order"
            elif others:
                what = f"{others[0]} order"
            else:
                what = "an order of no supported schedule"
            raise ScheduleError(
                f"rank {self.hook.rank} (stage {self.stage_index}): schedule version "
                f"{served.version} from the coordinator runs {len(names)} instructions in "
                f"{what}, but {cls} runs {self.num_microbatches} microbatches in {self.kind} "
                f"order; plan with `perseus optimize --schedule {self.kind} --microbatches "
                f"{self.num_microbatches}` (or InstructionProfiler schedule={self.kind!r})"
            )
        self._checked_version = served.version

    # --- what the schedule calls ---------------------------------------------------------------
    def _step(self, *args: Any, **kwargs: Any) -> Any:
        step: Callable[..., Any] = self._orig_step  # type: ignore[attr-defined]
        if not self.schedule._has_backward:  # eval(): forward only, not a training iteration
            return step(*args, **kwargs)
        self._check_served_order()
        self.last_step_actions = []
        self._pending = None
        self.hook.on_step_begin()
        self._in_step = True
        try:
            out = step(*args, **kwargs)
            self._close_pending()
            if len(self.last_step_actions) != len(self.actions):
                missing = self.actions[len(self.last_step_actions)]
                raise ScheduleError(
                    f"rank {self.hook.rank} (stage {self.stage_index}): "
                    f"{type(self.schedule).__name__}.step returned after "
                    f"{len(self.last_step_actions)} of {len(self.actions)} actions; "
                    f"next expected: {missing[0]} of microbatch {missing[1]}"
                )
            self.before_step_end()
        except BaseException:
            self._in_step = False
            self.hook.abandon_step()
            raise
        self._in_step = False
        self.hook.on_step_end()
        return out

    def _forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        run: Callable[..., Any] = self._orig_forward_one_chunk  # type: ignore[attr-defined]
        if not self._in_step:
            return run(fwd_chunk_id, *args, **kwargs)
        self._begin("forward", fwd_chunk_id)
        out = run(fwd_chunk_id, *args, **kwargs)
        self.during_instruction("forward", fwd_chunk_id)
        if self._loss_ends_forward:
            self._pending = "forward"  # Closed once the schedule has computed the loss.
        else:
            self.hook.on_instruction_end("forward")
        return out

    def _backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        run: Callable[..., Any] = self._orig_backward_one_chunk  # type: ignore[attr-defined]
        if not self._in_step:
            return run(bwd_chunk_id, *args, **kwargs)
        self._begin("backward", bwd_chunk_id)
        out = run(bwd_chunk_id, *args, **kwargs)
        self.during_instruction("backward", bwd_chunk_id)
        self.hook.on_instruction_end("backward")
        return out

    def _compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        out = self._orig__maybe_compute_loss(*args, **kwargs)  # type: ignore[attr-defined]
        self._close_pending()
        return out

    def _close_pending(self) -> None:
        if self._pending is not None:
            name, self._pending = self._pending, None
            self.hook.on_instruction_end(name)

    def _begin(self, name: str, microbatch: int) -> None:
        self._close_pending()
        done = len(self.last_step_actions)
        expected = self.actions[done] if done < len(self.actions) else None
        if expected != (name, microbatch):
            want = (
                "nothing more" if expected is None else f"{expected[0]} of microbatch {expected[1]}"
            )
            raise ScheduleError(
                f"rank {self.hook.rank} (stage {self.stage_index}): "
                f"{type(self.schedule).__name__} ran {name} of microbatch {microbatch} as "
                f"action {done}, but the planner's {self.kind} order has {want} there "
                f"(torch {torch.__version__})"
            )
        self.last_step_actions.append((name, microbatch))
        self.before_instruction(name, microbatch)
        self.hook.on_instruction_begin(name)

    # --- extension points (the simulated GPU uses them) --------------------------------------
    def before_instruction(self, name: str, microbatch: int) -> None:
        """Called before an action's hook window opens (its input has arrived)."""

    def during_instruction(self, name: str, microbatch: int) -> None:
        """Called inside an action's hook window, after torch computed it."""

    def before_step_end(self) -> None:
        """Called after ``schedule.step`` ran every action, before ``on_step_end``."""

    # --- teardown -------------------------------------------------------------------------------
    def close(self) -> None:
        """Restore the schedule and stage; close the hook if this object built it (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for owner, name, previous in reversed(self._patched):
            if previous is _NOTHING:
                delattr(owner, name)  # The class's method shows through again.
            else:
                setattr(owner, name, previous)
        self._patched.clear()
        if self._owns_hook:
            self.hook.close()

    def __enter__(self) -> PerseusPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
