"""The scheduler contract: the FrequencyScheduler base class and the registry of scheduler names.

A scheduler decides the frequency schedule of every rank for the next round of iterations and
learns from the profiling results of the previous round. Schedulers are plain deterministic
objects: rq workers rebuild one from Redis by constructing it and replaying every observation
in order (see :mod:`coordinator.replay`), so the same inputs must always give the same schedules.
Long-lived workers keep the rebuilt scheduler and feed it only new observations; schedulers
that implement :meth:`FrequencyScheduler.snapshot` are also restored from a stored state.
Randomness, wall-clock time and I/O outside the constructor break that replay.

Two ways to write one, as in Zeus:

* override :meth:`FrequencyScheduler.observe` and :meth:`FrequencyScheduler.next_schedule`; or
* implement the generator :meth:`FrequencyScheduler._run`, which ``yield``s the next schedules
  and receives the profiling results of those schedules from the ``yield``. When the generator
  returns, its last schedule is served forever.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import types
import typing
from collections.abc import Generator
from typing import Any

from pydantic import PydanticUserError, TypeAdapter, ValidationError

from protocol.exceptions import ConfigError, ProtocolError
from protocol.models import FrequencySchedule, JobInfo, ProfilingResult, RankInfo
from protocol.suggest import did_you_mean


class FrequencyScheduler:
    """Base class of frequency schedulers.

    Args:
        job_info: The training job.
        rank_infos: Every rank of the job, in any order.
    """

    def __init__(self, job_info: JobInfo, rank_infos: list[RankInfo]) -> None:
        self.job_info = job_info
        self.rank_infos = sorted(rank_infos, key=lambda r: r.rank)
        self.world_size = job_info.world_size
        self._generator: Generator[list[FrequencySchedule], list[ProfilingResult], None] | None
        self._generator = None
        self._next: list[FrequencySchedule] | None = None
        self._pending_results: list[ProfilingResult] | None = None
        self._finished = False

    replaying: bool = False
    """True while the worker feeds inputs that some worker fed before (rebuilding the scheduler
    from the journal, or catching up on versions another worker computed). Messages about an
    input (a warning on a target, say) belong in the log once: log them only when False."""

    needs_instruction_energy: bool = False
    """Whether results must carry ``energy_breakdown`` (the hook then measures it itself)."""

    server_path_args: frozenset[str] = frozenset()
    """Arguments that name files or folders on the worker's machine. Only the operator's
    settings may give them: a job that sends one is refused before any path is touched, so
    that no client can make a worker read or write a path of its choosing, or learn whether
    one exists."""

    @property
    def converged(self) -> bool:
        """True once the schedule can only change on a control message, not on results.

        Then the coordinator stops publishing identical versions after each observation
        (which would make a long training run's state grow without bound). Generator-style
        schedulers converge when ``_run`` returns.
        """
        return self._finished

    @classmethod
    def sweep_versions(cls, args: dict[str, Any], frequencies: int) -> int | None:
        """Versions a profiling sweep takes for a rank with ``frequencies`` clocks; None: none.

        The coordinator refuses a rank whose sweep would be longer than its
        ``max_sweep_versions`` setting when the rank registers. Schedulers that sweep clocks
        (one schedule version per clock) override this.
        """
        return None

    @classmethod
    def check_rank(cls, args: dict[str, Any], rank: RankInfo) -> None:
        """Raise ProtocolError if a rank with ``rank``'s clocks cannot run under ``args``.

        The coordinator calls it when each rank registers (a job's registration carries no
        clocks), so that arguments a rank's GPU cannot follow refuse that rank's registration
        instead of failing the job when its first schedule is built, after every rank joined.
        """

    @classmethod
    def check_args(cls, args: dict[str, Any]) -> None:
        """Raise ConfigError if ``args`` cannot work, beyond fitting the signature.

        Called when a coordinator starts and when a job asks for this scheduler, so that a
        bad configuration fails before any training starts.
        """

    @classmethod
    def check_job(cls, args: dict[str, Any], job: JobInfo) -> None:
        """Raise ConfigError if a job of ``job``'s degrees cannot run under ``args``.

        Called when a job registers (after :meth:`check_args`), with the arguments it gets,
        its own or the coordinator's: what depends on the job's shape (a planner's size, its
        stages times the microbatches) then refuses the registration instead of failing the
        job, or running for hours, once its ranks have joined.
        """

    @classmethod
    def absolute_paths(cls, args: dict[str, Any]) -> dict[str, Any]:
        """Return ``args`` with each relative path in :attr:`server_path_args` made absolute.

        Relative to this process's working directory. Called when a coordinator starts, so
        that the files it checks are the ones the rq workers open: a worker resolves a
        relative path against its own working directory, which need not be the
        coordinator's. Schedulers whose path sits inside another argument (a dict) override
        this.
        """
        out = dict(args)
        for name in cls.server_path_args:
            if isinstance(out.get(name), str):
                out[name] = os.path.abspath(out[name])
        return out

    @classmethod
    def check_files(cls, args: dict[str, Any]) -> None:
        """Raise ConfigError if what ``args`` point at (plan files, folders) is unusable.

        Called when a coordinator starts with these settings (the operator's), so that a
        missing or broken file stops it at once instead of failing every job later. Not
        called for arguments a job sends: telling a client whether a server path exists
        would leak it.
        """

    @classmethod
    def check_job_result(cls, result: ProfilingResult, args: dict[str, Any]) -> None:
        """Raise ProtocolError if this scheduler, built with ``args``, cannot use ``result``.

        What the coordinator calls on every result before storing it, with the job's
        scheduler arguments (checked at registration). The default is :meth:`check_result`;
        a scheduler whose arguments decide what a usable result is (how many instructions an
        iteration has, say) extends this one.
        """
        cls.check_result(result)

    @classmethod
    def check_result(cls, result: ProfilingResult) -> None:
        """Raise ProtocolError if this scheduler cannot use ``result``.

        The coordinator calls it on every result before storing it: one that fails is
        dead-lettered with the reason, the job goes on, and the rank may send a good one. A
        result that made the scheduler itself fail would fail the job for good. The default
        checks, for schedulers that need it, that per-instruction energy came with the times.
        """
        if not cls.needs_instruction_energy:
            return
        who = f"rank {result.rank}, schedule version {result.schedule_version}"
        if not result.energy_breakdown:
            raise ProtocolError(
                f"{who}: the result has no energy_breakdown; scheduler {cls.__name__} needs "
                "per-instruction energy (leave PerseusOptimizer's instruction_energy unset)"
            )
        for name in sorted(set(result.time_breakdown) | set(result.energy_breakdown)):
            times = [len(i) for i in result.time_breakdown.get(name, [])]
            energies = [len(i) for i in result.energy_breakdown.get(name, [])]
            if times != energies:
                raise ProtocolError(
                    f"{who}: instruction {name!r} has {sum(times)} times in {len(times)} "
                    f"iterations but {sum(energies)} energies in {len(energies)}"
                )

    def observe(self, profiling_results: list[ProfilingResult]) -> None:
        """Take in the profiling results of the schedule last returned by next_schedule.

        Args:
            profiling_results: One per rank, in any order.
        """
        self._pending_results = profiling_results

    def next_schedule(self) -> list[FrequencySchedule]:
        """Return the schedules of the next round, one per rank (any order)."""
        if self._generator is None:
            self._generator = self._run()
            try:
                self._next = next(self._generator)
            except StopIteration:  # Escaping bare, it named nothing (Zeus names it too).
                self._generator = None
                raise ProtocolError(
                    f"{type(self).__name__}._run returned before yielding a first schedule"
                ) from None
        elif self._pending_results is not None:
            try:
                self._next = self._generator.send(self._pending_results)
            except StopIteration:
                self._finished = True  # Converged: keep serving the last schedule.
        self._pending_results = None
        assert self._next is not None
        return self._next

    def artifacts(self) -> dict[str, bytes]:
        """Files this scheduler produced so far (e.g. a profile), stored with the job in Redis.

        Must be deterministic like the schedules: replays call it again.
        """
        return {}

    def snapshot(self) -> Any:
        """The scheduler's state as msgpack-able data (dicts, lists, numbers, strings, bytes).

        Optional. Returning something lets rq workers store it in Redis every few versions and
        delete the profiling results it has consumed, so a job's Redis memory stops growing:
        a worker that starts afresh constructs the scheduler, calls :meth:`restore` and
        replays only the journal entries after the snapshot. ``None`` (the default, and the
        only choice for generator-style schedulers, whose generator cannot be saved) keeps
        every result for a replay from the start.
        """
        return None

    def restore(self, state: Any) -> None:
        """Continue from what :meth:`snapshot` returned (called right after construction)."""
        raise NotImplementedError(f"{type(self).__name__} returned a snapshot but cannot restore")

    @classmethod
    def takes_target(cls) -> bool:
        """Whether this scheduler implements :meth:`set_target` (the default refuses any)."""
        return cls.set_target is not FrequencyScheduler.set_target

    @classmethod
    def check_target(cls, job_id: str, iteration_time: float) -> None:
        """Raise ProtocolError if this scheduler takes no target (see :meth:`check_result`).

        The coordinator calls it on every target before storing it: stored, a target the
        scheduler cannot take would fail the job for good.
        """
        if not cls.takes_target():
            raise ProtocolError(
                f"job {job_id} runs {cls.__name__}, which takes no target iteration time "
                f"(asked for {iteration_time:g} s)"
            )

    def set_target(self, iteration_time: float) -> None:
        """Aim at a new iteration time in seconds (e.g. a straggler's). Optional.

        Called by the rq worker, in arrival order, before the next schedule is computed.
        Raise ConfigError to refuse a target (schedulers that have no notion of one refuse
        all): the worker logs it and the job goes on as before; it fails the job only if
        another exception escapes.
        """
        raise ConfigError(f"scheduler {type(self).__name__} does not take a target iteration time")

    def _run(self) -> Generator[list[FrequencySchedule], list[ProfilingResult], None]:
        """Yield schedules and receive their profiling results (generator style)."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement _run or override observe/next_schedule"
        )
        yield []  # pragma: no cover - makes this a generator function for type checkers


# Name -> "module:attribute". Import paths rather than imports: the protocol must not import the
# schedulers (they build on it), and picking one scheduler must not import every other's
# dependencies. The coordinator checks job requests against these names.
BUILTIN: dict[str, str] = {
    "PointSolution": "schedulers.point_solution:PointSolution",
    "PointSolution3D": "schedulers.point_solution:PointSolution3D",
    "FrontierScheduler": "schedulers.frontier:FrontierScheduler",
    "FrontierScheduler3D": "schedulers.frontier:FrontierScheduler3D",
    "InstructionProfiler": "schedulers.instruction_profiler:InstructionProfiler",
}


@functools.lru_cache(maxsize=256)
def resolve_scheduler(name: str) -> type[FrequencyScheduler]:
    """Return the scheduler class for a builtin name or a ``module:Class`` path.

    Cached (failures are not): the coordinator resolves a job's scheduler for every entry.

    Raises:
        ConfigError: unknown name, import failure, or not a FrequencyScheduler subclass.
    """
    target = BUILTIN.get(name, name)
    module_name, sep, attr = target.partition(":")
    if not sep:
        known = ", ".join(sorted(BUILTIN))
        raise ConfigError(
            f"unknown scheduler {name!r}{did_you_mean(name, BUILTIN)}; use one of {known} "
            "or 'module:Class'"
        )
    try:
        module = importlib.import_module(module_name)
        cls = getattr(module, attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load scheduler {name!r} from {target!r}: {exc}") from None
    if not (inspect.isclass(cls) and issubclass(cls, FrequencyScheduler)):
        raise ConfigError(f"scheduler {name!r} ({target}) is not a FrequencyScheduler subclass")
    return cls


def check_scheduler_args(name: str, args: dict[str, Any]) -> None:
    """Check that ``args`` fit the scheduler's constructor, with a clear error if not.

    Each argument must be a parameter of the constructor and of its annotated type, without
    conversion (a string is not a number, a bool is not an int; an int is a float); then the
    scheduler's :meth:`FrequencyScheduler.check_args` judges the values.

    Raises:
        ConfigError: Naming the scheduler, the argument and what it expects.
    """
    cls = resolve_scheduler(name)
    if "pfo_settings" in inspect.signature(cls).parameters:
        raise ConfigError(
            f"scheduler {name} takes Zeus's pfo_settings: perseus-mq builds a scheduler as "
            "cls(job_info, rank_infos, **scheduler_args); drop that parameter and take what "
            "you read from it as keyword arguments (see README, Differences from Zeus)"
        )
    try:
        inspect.signature(cls).bind(job_info=None, rank_infos=None, **args)
    except TypeError as exc:
        params = [
            p for p in inspect.signature(cls).parameters if p not in ("job_info", "rank_infos")
        ]
        given = f"scheduler_args {sorted(args)}" if args else "scheduler_args (none given)"
        raise ConfigError(
            f"invalid {given} for scheduler {name}: {exc} "
            f"(it takes: {', '.join(params) or 'nothing'})"
        ) from None
    adapters = _argument_adapters(name)
    for arg, value in args.items():
        if arg not in adapters:
            continue
        expected, adapter = adapters[arg]
        try:
            # Strict: "8" is not 8 and True is not 1. The values are checked, not converted:
            # the constructor gets them as they came (an int where a float is annotated too).
            # Checked as the JSON they arrive as, in which a Path, a tuple or an Enum is
            # written as a string or a list (strict Python mode would want the objects).
            try:
                text = json.dumps(value)
            except (TypeError, ValueError):  # not JSON (bytes from msgpack, say)
                adapter.validate_python(value, strict=True)
            else:
                adapter.validate_json(text, strict=True)
        except ValidationError as exc:
            errors = exc.errors()
            detail = ""
            if len(errors) == 1 and errors[0]["loc"]:  # Several: one per member of a union.
                where = "".join(f"[{part!r}]" for part in errors[0]["loc"])
                detail = f" ({arg}{where}: {errors[0]['msg'].lower()})"
            raise ConfigError(
                f"scheduler {name}: argument {arg!r} must be {expected}, got "
                f"{_short(value)} ({type(value).__name__}){detail}"
            ) from None
    cls.check_args(args)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _type_name(annotation: Any) -> str:
    """``str | None``, ``list[int]``, ``ThenArgs`` (a TypedDict, by its name)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def constructor_signature(cls: type[FrequencyScheduler]) -> inspect.Signature:
    """The scheduler's constructor signature, each annotation evaluated where it can be.

    As :func:`typing.get_type_hints` does, annotations (strings under ``from __future__ import
    annotations``) are evaluated in the constructor's module, but one at a time: an annotation
    naming what only type checkers import stays a string, and the others still count. A class
    that sets ``__signature__`` (the 3D wrappers, which evaluate their scheduler's with this
    function) is taken as it is.
    """
    signature = inspect.signature(cls)
    if "__signature__" in vars(cls):
        return signature
    namespace = getattr(inspect.unwrap(cls.__init__), "__globals__", {})
    params = []
    for param in signature.parameters.values():
        annotation = param.annotation
        if isinstance(annotation, str):
            try:
                annotation = eval(annotation, dict(namespace))  # The module's own code.
            except Exception:  # A name imported only for type checkers: left unchecked.
                pass
        params.append(param.replace(annotation=annotation))
    return signature.replace(parameters=params)


def describe_arguments(cls: type[FrequencyScheduler]) -> list[str]:
    """The scheduler's arguments as ``name: type = default`` (``(required)`` without one).

    Keyword arguments of its constructor, as ``perseus schedulers`` lists them; a parameter
    without an annotation shows no type.
    """
    lines = []
    for param in constructor_signature(cls).parameters.values():
        if param.name in ("job_info", "rank_infos") or param.kind in (
            param.VAR_POSITIONAL,
            param.VAR_KEYWORD,
        ):
            continue
        annotation = param.annotation
        kind = "" if annotation is param.empty else f": {_type_name(annotation)}"
        default = " (required)" if param.default is param.empty else f" = {param.default!r}"
        lines.append(f"{param.name}{kind}{default}")
    return lines


@functools.lru_cache(maxsize=256)
def _argument_adapters(name: str) -> dict[str, tuple[str, TypeAdapter[Any]]]:
    """Argument name -> (type as text, validator) from scheduler ``name``'s constructor.

    A parameter without an annotation, or whose annotation cannot be evaluated or validated
    (a name imported only for type checkers, an arbitrary class), is left unchecked: the
    constructor is its judge.
    """
    out: dict[str, tuple[str, TypeAdapter[Any]]] = {}
    for param in constructor_signature(resolve_scheduler(name)).parameters.values():
        annotation = param.annotation
        if (
            param.name in ("job_info", "rank_infos")
            or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD)
            or annotation is param.empty
            or isinstance(annotation, str)
            or annotation is Any
        ):
            continue
        try:
            out[param.name] = (_type_name(annotation), TypeAdapter(annotation))
        except (PydanticUserError, TypeError):  # e.g. typing.TypedDict before Python 3.12
            continue
    return out


def build_scheduler(
    name: str, job_info: JobInfo, rank_infos: list[RankInfo], args: dict[str, Any]
) -> FrequencyScheduler:
    """Construct scheduler ``name`` for a job."""
    cls = resolve_scheduler(name)
    return cls(job_info=job_info, rank_infos=rank_infos, **args)
