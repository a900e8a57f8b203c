"""The plan files of a planner folder: written fast, logged compactly, materialized on demand.

Consecutive frontier points differ in a few clocks, so :class:`PlanWriter` keeps each stage's
line of text and rebuilds only the stages whose clocks changed; the text is produced in the
format of :func:`~schedulers.planning.plan_file.write_plan_file` (which :func:`read_plan_file`
reads back unchanged; the tests check it) without parsing each file again.

Every planner run also writes ``plans.delta``, the clocks of every plan as changes from the
previous one::

    # perseus-mq plan deltas v1: plan k = plan k-1 with these node:clock changes
    # num_stages: 2
    # num_microbatches: 2
    # pipeline_schedule: 1f1b
    00000 1980 1980 1965 1980 1980 1980 1980 1965
    00001 3:1950
    00002

Node ``i`` is the ``i``-th instruction in stage-major execution order (stage 0's instructions
first, in the order of the run's pipeline schedule). With ``perseus optimize --plans chosen``
only the chosen plans' files are written; :func:`plan_from_log` rebuilds any other from this
log, and :func:`ensure_plan_file` writes it when a command needs the file (``perseus choose``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TextIO

from protocol.exceptions import ConfigError
from protocol.numbers import ascii_int
from protocol.pipeline_schedules import DEFAULT_SCHEDULE, SCHEDULE_HEADER
from schedulers.planning.frontier_files import Frontier, FrontierPoint, refuse_non_file
from schedulers.planning.pipeline_dag import PipelineShape
from schedulers.planning.plan_file import PlanFile

PLAN_LOG = "plans.delta"
#: What :func:`plan_from_log` needs from ``frontier.json``.
_META_KEYS = ("num_stages", "num_microbatches", "unit_time", "p2p_power")
_LOG_MAGIC = "# perseus-mq plan deltas v1"


def plan_note(plan: str) -> str:
    """The note line at the top of plan ``plan``'s file."""
    return f"perseus-mq frequency plan {plan} (a larger number is a shorter iteration)"


def plan_header(
    point: FrontierPoint, *, unit_time: float, p2p_power: float, shape: PipelineShape
) -> dict[str, object]:
    """The ``# key: value`` header of a frontier point's plan file."""
    return {
        "plan": point.plan,
        "iteration_time": repr(point.iteration_time),
        "energy": repr(point.energy),
        "energy_with_p2p": repr(point.energy_with_p2p),
        "unit_time": repr(unit_time),
        "quant_time": point.quant_time,
        "model_cost": repr(point.model_cost),
        "p2p_power": repr(p2p_power),
        "num_stages": shape.num_stages,
        "num_microbatches": shape.num_microbatches,
        SCHEDULE_HEADER: shape.schedule_name,
    }


def plan_text(lines: Sequence[str], header: Mapping[str, object], note: str) -> str:
    """A plan file's text from its stage lines (see :class:`PlanWriter`)."""
    head = [f"# {note}", *(f"# {key}: {value}" for key, value in header.items())]
    return "\n".join([*head, "[", *lines, "]"]) + "\n"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class PlanWriter:
    """Clocks of the current plan, by node, with each stage's line of text cached.

    Args:
        shape: The pipeline.
        clocks: Clock per node of the first plan.

    """

    def __init__(self, shape: PipelineShape, clocks: Sequence[int]) -> None:
        self.shape = shape
        self.clocks = list(clocks)
        self._pair: dict[tuple[str, int], str] = {}
        self._lines: list[str | None] = [None] * shape.num_stages

    def change(self, moves: Sequence[tuple[int, int]]) -> None:
        """Apply ``(node, clock)`` moves."""
        per_stage = 2 * self.shape.num_microbatches
        for node, clock in moves:
            self.clocks[node] = clock
            self._lines[node // per_stage] = None

    def stage_lines(self) -> list[str]:
        """One ``    [("forward", 1980), ...],`` line per stage."""
        shape, pair = self.shape, self._pair
        per_stage = 2 * shape.num_microbatches
        for s, line in enumerate(self._lines):
            if line is not None:
                continue
            parts = []
            for k, name in enumerate(shape.order[s]):
                key = (name, self.clocks[s * per_stage + k])
                text = pair.get(key)
                if text is None:
                    text = pair[key] = f'("{name}", {key[1]})'
                parts.append(text)
            self._lines[s] = "    [" + ", ".join(parts) + "],"
        return [line for line in self._lines if line is not None]

    def stages(self) -> list[list[tuple[str, int]]]:
        """The current plan as ``(instruction, clock)`` pairs per stage."""
        per_stage = 2 * self.shape.num_microbatches
        return [
            [(name, self.clocks[s * per_stage + k]) for k, name in enumerate(names)]
            for s, names in enumerate(self.shape.order)
        ]

    def write(self, path: Path, header: Mapping[str, object], note: str) -> None:
        """Write the current plan to ``path`` (atomically)."""
        _write_atomic(path, plan_text(self.stage_lines(), header, note))


def write_plan_log(
    path: Path,
    shape: PipelineShape,
    first: Sequence[int],
    deltas: Sequence[Sequence[tuple[int, int]]],
) -> None:
    """Write ``plans.delta``: plan 0's clocks, then each plan's ``node:clock`` changes."""
    lines = [
        f"{_LOG_MAGIC}: plan k = plan k-1 with these node:clock changes",
        f"# num_stages: {shape.num_stages}",
        f"# num_microbatches: {shape.num_microbatches}",
        f"# {SCHEDULE_HEADER}: {shape.schedule_name}",
        "00000 " + " ".join(map(str, first)),
    ]
    for k, moves in enumerate(deltas[1:], start=1):
        lines.append(" ".join([f"{k:05d}", *(f"{v}:{c}" for v, c in moves)]))
    _write_atomic(path, "\n".join(lines) + "\n")


def _check_log_shape(
    path: Path, json_path: Path, num_stages: int, num_microbatches: int, schedule: str
) -> None:
    """The plan log's header must describe the pipeline ``frontier.json`` describes.

    Checked before the pipeline is laid out: an edited ``num_stages`` of a billion made the
    layout take all memory.
    """
    want = {
        "num_stages": str(num_stages),
        "num_microbatches": str(num_microbatches),
        SCHEDULE_HEADER: schedule,
    }
    try:
        with open(path, encoding="utf-8-sig") as handle:
            for number, raw in enumerate(handle, start=1):
                line = raw.strip()
                if number > 1 and not line.startswith("#"):
                    return
                key, sep, value = line.lstrip("#").partition(":")
                key, value = key.strip(), value.strip()
                if number > 1 and sep and key in want and value != want[key]:
                    raise ConfigError(
                        f"{path}:{number}: {key} is {value!r} but {json_path} says "
                        f"{want[key]!r}; the two files come from different runs"
                    )
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the plan log: {exc.strerror or exc}") from None


def read_plan_clocks(path: Path, index: int, shape: PipelineShape) -> list[int]:
    """Clock per node of plan ``index`` from a ``plans.delta`` file.

    Raises:
        ConfigError: The file is missing or malformed, or has no plan ``index``.

    """
    try:
        # utf-8-sig: an editor's byte order mark before the first line is no reason to refuse.
        handle = open(path, encoding="utf-8-sig")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the plan log: {exc.strerror or exc}") from None
    clocks: list[int] = []
    expected = 0
    with handle:
        for number, raw in enumerate(_lines(path, handle), start=1):
            line = raw.strip()
            if number == 1:
                if not line.startswith(_LOG_MAGIC):
                    raise ConfigError(f"{path}:1: not a perseus-mq plan log")
                continue
            if not line or line.startswith("#"):
                continue
            plan, *fields = line.split()
            if plan != f"{expected:05d}":
                raise ConfigError(f"{path}:{number}: expected plan {expected:05d}, got {plan!r}")
            try:
                if expected == 0:
                    clocks = [ascii_int(f) for f in fields]
                    if len(clocks) != shape.num_nodes:
                        raise ValueError(f"{len(clocks)} clocks for {shape.num_nodes} instructions")
                for item in fields if expected else ():
                    node, sep, clock = item.partition(":")
                    if not sep or not 0 <= ascii_int(node) < len(clocks):
                        raise ValueError(f"{item!r} is not node:clock with a node of the plan")
                    clocks[ascii_int(node)] = ascii_int(clock)
            except ValueError as exc:
                raise ConfigError(f"{path}:{number}: bad plan line: {exc}") from None
            if expected == index:
                return clocks
            expected += 1
    raise ConfigError(f"{path}: no plan {index:05d}")


def plan_from_log(frontier: Frontier, point: FrontierPoint) -> PlanFile:
    """Rebuild a point's plan from the folder's ``plans.delta`` (no file is written).

    Raises:
        ConfigError: ``frontier.json`` lacks the run's parameters, or ``plans.delta`` is
            missing or malformed.

    """
    meta = frontier.meta
    missing = [k for k in _META_KEYS if k not in meta]
    if missing:
        raise ConfigError(
            f"{frontier.out_dir / 'frontier.json'}: missing {', '.join(missing)}; cannot "
            f"rebuild plan {point.plan} from {PLAN_LOG}"
        )
    json_path = frontier.out_dir / "frontier.json"
    for key in ("num_stages", "num_microbatches"):
        if not isinstance(meta[key], int) or isinstance(meta[key], bool) or meta[key] < 1:
            raise ConfigError(f"{json_path}: {key} must be a whole number >= 1, got {meta[key]!r}")
    for key in ("unit_time", "p2p_power"):
        value = meta[key]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
            raise ConfigError(f"{json_path}: {key} must be a number, got {value!r}")
        if not 0 <= value < float("inf"):
            raise ConfigError(f"{json_path}: {key} must be finite and >= 0, got {value!r}")
    schedule = str(meta.get(SCHEDULE_HEADER, DEFAULT_SCHEDULE))
    log = frontier.out_dir / PLAN_LOG
    _check_log_shape(log, json_path, meta["num_stages"], meta["num_microbatches"], schedule)
    shape = PipelineShape(meta["num_stages"], meta["num_microbatches"], schedule)
    clocks = read_plan_clocks(log, point.index, shape)
    writer = PlanWriter(shape, clocks)
    header = plan_header(
        point, unit_time=float(meta["unit_time"]), p2p_power=float(meta["p2p_power"]), shape=shape
    )
    return PlanFile(
        stages=writer.stages(),
        header={k: str(v) for k, v in header.items()},
        notes=[plan_note(point.plan)],
        path=frontier.path(point),
    )


def ensure_plan_file(frontier: Frontier, point: FrontierPoint) -> Path:
    """Return the point's plan file, writing it from ``plans.delta`` first if it is missing.

    Raises:
        ConfigError: The file is missing and the folder has no usable plan log.

    """
    path = frontier.path(point)
    if path.is_file():
        return path
    if path.exists():  # a folder: the write below failed naming its temporary file, left behind
        raise ConfigError(f"{path}: not a file (the plan file's name is taken)")
    refuse_non_file(frontier.out_dir / PLAN_LOG)
    if not (frontier.out_dir / PLAN_LOG).is_file():
        raise ConfigError(f"{path}: plan file missing and no {PLAN_LOG} to rebuild it from")
    plan = plan_from_log(frontier, point)
    schedule = plan.header.get(SCHEDULE_HEADER, DEFAULT_SCHEDULE)
    shape = PipelineShape(plan.num_stages, plan.num_microbatches, schedule)
    writer = PlanWriter(shape, [c for stage in plan.stages for _, c in stage])
    writer.write(path, plan.header, plan.notes[0])
    return path


def _lines(path: Path, handle: TextIO) -> Iterator[str]:
    """The lines of an open text file; bytes that are no UTF-8 are a ConfigError naming it."""
    try:
        yield from handle
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason})") from None
