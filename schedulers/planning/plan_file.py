"""Perseus plan files: one frequency plan of a pipeline, as written by lowtime.

A plan file (``freqs_pipeline_%05d.py``) holds one list per pipeline stage of
``(instruction, frequency)`` pairs in execution order, plus ``#`` comment lines::

    # perseus plan 00012
    # iteration_time: 1.2345
    # energy: 456.7
    [
        [("forward", 1980), ("forward", 1965), ("backward", 1980), ...],
        [...],
    ]

Comment lines of the form ``# key: value`` form the header; other comment lines are kept as
notes. A ``# pipeline_schedule: gpipe`` (or ``1f1b``) header names the schedule the plan was
made for; every stage must then follow that schedule's order. The older lowtime format, where
each stage is a plain list of frequencies, is accepted too: instruction names are then
inferred from the header's schedule (synchronous 1F1B without one).

The files look like Python but are never executed: the text is parsed with :func:`ast.parse`
and only list, tuple, string and integer nodes are accepted, so a plan file cannot run code
and every error points at a line.
"""

from __future__ import annotations

import ast
import json
import os
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from protocol.constants import INSTRUCTIONS
from protocol.exceptions import ConfigError
from protocol.numbers import is_ascii_digits
from protocol.pipeline_schedules import (
    DEFAULT_SCHEDULE,
    PIPELINE_SCHEDULES,
    SCHEDULE_HEADER,
    schedules_matching,
    stage_order,
)

#: The instructions a plan may name, in the order a microbatch runs them.
# `# key: value`. The key may not contain spaces, so that lowtime's
# `# Iteration 3: total cost 12.5` stays a note.
_HEADER_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_.-]*):\s*(.*)$")
# Line breaks as Python's parser (and an editor) counts them: str.splitlines() also breaks at
# a form feed, \x1c-\x1e, \x85, \u2028 and \u2029, which put a header's line number past
# the one shown, and read a "# key: value" from the middle of a comment.
_LINE_BREAK_RE = re.compile(r"\r\n|\r|\n")
# Longest source excerpt quoted in an error message.
_EXCERPT_CHARS = 40


@dataclass
class PlanFile:
    """A parsed plan file.

    Attributes:
        stages: ``stages[s]`` lists the ``(instruction, frequency in MHz)`` pairs of pipeline
            stage ``s`` in execution order.
        header: ``# key: value`` comment lines, in file order.
        notes: Every other comment line (without the leading ``#``), in file order.
        path: The file it was read from, if any.

    """

    stages: list[list[tuple[str, int]]]
    header: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    path: Path | None = None

    @property
    def num_stages(self) -> int:
        """Number of pipeline stages."""
        return len(self.stages)

    @property
    def num_microbatches(self) -> int:
        """Number of microbatches per iteration (forward instructions of any stage)."""
        return sum(1 for name, _ in self.stages[0] if name == "forward") if self.stages else 0

    @property
    def source(self) -> str:
        """The file name for messages, or ``<plan>`` when not read from a file."""
        return str(self.path) if self.path is not None else "<plan>"

    @property
    def schedule(self) -> str | None:
        """The pipeline schedule the plan is for, or None if it follows no supported order.

        The ``pipeline_schedule`` header if there is one, else the schedule whose order every
        stage follows (``1f1b`` where both fit, i.e. with one microbatch).
        """
        named = self.header.get(SCHEDULE_HEADER)
        if named is not None:
            return named
        matching = schedules_matching([[n for n, _ in stage] for stage in self.stages])
        return matching[0] if matching else None

    def frequencies(self, stage: int) -> list[int]:
        """Frequencies of one stage, in execution order."""
        return [freq for _, freq in self.stages[stage]]

    def header_float(self, key: str) -> float | None:
        """Return header ``key`` as a float, or None if the header has no such key.

        Raises:
            ConfigError: The value is not a number.

        """
        value = self.header.get(key)
        if value is None:
            return None
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{self.source}: header {key!r} is not a number: {value!r}") from None


def read_plan_file(path: str | os.PathLike[str]) -> PlanFile:
    """Read and validate a plan file.

    Raises:
        ConfigError: The file is missing, unreadable or malformed; the message names the file
            and, where it can, the line.

    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        hint = ""
        if "%05d" in path.name:  # The Perseus docs' placeholder, copied as it is.
            hint = (
                " (%05d stands for a plan's number (freqs_pipeline_00042.py): pick one with "
                "`perseus choose DIR`)"
            )
        raise ConfigError(f"{path}: plan file not found{hint}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: plan file is not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read plan file: {exc.strerror or exc}") from None
    plan = parse_plan_text(text, source=str(path))
    plan.path = path
    return plan


# CPython 3.11 keeps the AST builder's recursion depth in state shared by threads, and a
# thread switch inside ast.parse can leave it wrong: "SystemError: AST constructor recursion
# depth mismatch" (python/cpython#106905, seen here with a worker thread parsing a plan while
# the main thread did). Our own parses take turns; one parse that still hits it is retried.
_PARSE_LOCK = threading.Lock()


def _parse(text: str, source: str) -> ast.Expression:
    with _PARSE_LOCK:
        try:
            return ast.parse(text, filename=source, mode="eval")
        except SystemError:
            return ast.parse(text, filename=source, mode="eval")


def _not_a_plan(text: str) -> str:
    """A hint where the code does not start as a plan does (a CSV or a log given instead)."""
    for line in _LINE_BREAK_RE.split(text):
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            if stripped.startswith("["):
                return ""  # a plan with a slip in it: the line number says where
            return (
                f"; a plan file is one list of stage lists (as `perseus optimize` writes), "
                f"this one starts with {stripped[:40]!r}"
            )
    return ""


def parse_plan_text(text: str, source: str = "<string>") -> PlanFile:
    """Parse the text of a plan file without executing it.

    Args:
        text: The file's contents.
        source: Name used in error messages.

    Raises:
        ConfigError: The text is not a valid plan.

    """
    header, notes, has_code = _read_comments(text)
    if not has_code:
        raise ConfigError(f"{source}: empty plan (no stage lists)")
    try:
        tree = _parse(text, source)
    except SyntaxError as exc:
        raise ConfigError(
            f"{source}:{exc.lineno or '?'}: syntax error: {exc.msg}{_not_a_plan(text)}"
        ) from None
    except (ValueError, MemoryError, RecursionError) as exc:  # e.g. NUL bytes, absurd nesting
        raise ConfigError(f"{source}: cannot parse plan: {exc}") from None
    schedule = header.get(SCHEDULE_HEADER)
    if schedule is not None and schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(
            f"{source}: header {SCHEDULE_HEADER!r} names unsupported schedule {schedule!r} "
            f"(supported: {', '.join(PIPELINE_SCHEDULES)})"
        )
    stages = _Walker(text, source, schedule).stages(tree.body)
    plan = PlanFile(stages=stages, header=header, notes=notes)
    _check_shape_header(plan, text, source)
    return plan


# Header keys that state the plan's shape; the stage lists must agree with them.
_SHAPE_HEADERS = ("num_stages", "num_microbatches")


def _check_shape_header(plan: PlanFile, text: str, source: str) -> None:
    """A ``num_stages`` or ``num_microbatches`` header must be what the stage lists hold.

    A plan cut short (or a stage list pasted in from another plan) still parses; the header
    its planner wrote is what tells.
    """
    found = {"num_stages": plan.num_stages, "num_microbatches": plan.num_microbatches}
    for key in _SHAPE_HEADERS:
        value = plan.header.get(key)
        if value is None:
            continue
        line = _header_line(text, key)
        if not is_ascii_digits(value):
            raise ConfigError(
                f"{source}:{line}: header {key!r} must be a whole number, got {value!r}"
            )
        if int(value) != found[key]:
            holds = "stage lists" if key == "num_stages" else "microbatches per stage"
            raise ConfigError(
                f"{source}:{line}: header {key!r} says {int(value)} but the plan has "
                f"{found[key]} {holds}; the file is cut short or its stage lists come from "
                "another plan"
            )


def _header_line(text: str, key: str) -> int | str:
    """The line of the last ``# key: value`` comment (the one the header keeps)."""
    found: int | str = "?"
    for number, line in enumerate(_LINE_BREAK_RE.split(text), start=1):
        stripped = line.strip()
        if stripped.startswith("#"):
            match = _HEADER_RE.match(stripped[1:].strip())
            if match and match.group(1) == key:
                found = number
    return found


def write_plan_file(
    path: str | os.PathLike[str],
    stages: Sequence[Sequence[tuple[str, int]]],
    header: Mapping[str, object],
    notes: Sequence[str] = (),
) -> None:
    """Write a plan file that :func:`read_plan_file` reads back unchanged.

    Notes come first, then the header (values converted with ``str``), then one line per stage.
    The plan is validated before anything is written, and the file is replaced atomically so
    that a reader never sees half a plan.

    Raises:
        ConfigError: Invalid stages, a header key that is not a plain name, or a note or value
            that would not read back unchanged.

    """
    path = Path(path)
    lines: list[str] = []
    for note in notes:
        if "\n" in note or "\r" in note or note != note.strip() or _HEADER_RE.match(note):
            raise ConfigError(f"{path}: note {note!r} would not read back as the same note")
        lines.append(f"# {note}".rstrip())
    for key, value in header.items():
        text_value = str(value)
        if not _HEADER_RE.match(f"{key}: x") or ":" in key:
            raise ConfigError(f"{path}: header key {key!r} must be a name without spaces")
        if "\n" in text_value or "\r" in text_value or text_value != text_value.strip():
            raise ConfigError(f"{path}: header {key!r} value {text_value!r} would not read back")
        lines.append(f"# {key}: {text_value}".rstrip())
    lines.append("[")
    for stage in stages:
        pairs = ", ".join(f"({json.dumps(name)}, {freq})" for name, freq in stage)
        lines.append(f"    [{pairs}],")
    lines.append("]")
    text = "\n".join(lines) + "\n"
    parse_plan_text(text, source=str(path))  # Refuse to write what we could not read back.
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _read_comments(text: str) -> tuple[dict[str, str], list[str], bool]:
    """Split full-line comments into header and notes; also say whether any code exists."""
    header: dict[str, str] = {}
    notes: list[str] = []
    has_code = False
    for line in _LINE_BREAK_RE.split(text):
        stripped = line.strip()
        if not stripped:
            continue
        if not stripped.startswith("#"):
            has_code = True
            continue
        content = stripped[1:].strip()
        match = _HEADER_RE.match(content)
        if match:
            header[match.group(1)] = match.group(2).strip()
        else:
            notes.append(content)
    return header, notes, has_code


class _Walker:
    """Turns the expression tree of a plan into stages, rejecting every other node."""

    def __init__(self, text: str, source: str, schedule: str | None) -> None:
        self.text = text
        self.source = source
        self.schedule = schedule

    def error(self, node: ast.AST, where: str, message: str) -> ConfigError:
        line = getattr(node, "lineno", "?")
        prefix = f"{self.source}:{line}: " + (f"{where}: " if where else "")
        return ConfigError(prefix + message)

    def excerpt(self, node: ast.AST) -> str:
        segment = ast.get_source_segment(self.text, node) or type(node).__name__
        segment = " ".join(segment.split())
        if len(segment) > _EXCERPT_CHARS:
            segment = segment[: _EXCERPT_CHARS - 3] + "..."
        return segment

    def stages(self, body: ast.expr) -> list[list[tuple[str, int]]]:
        if not isinstance(body, (ast.List, ast.Tuple)):
            raise self.error(body, "", f"expected a list of stage lists, got {self.excerpt(body)}")
        if not body.elts:
            raise self.error(body, "", "empty plan (no stage lists)")
        num_stages = len(body.elts)
        stages: list[list[tuple[str, int]]] = []
        pair_format: bool | None = None  # Every stage must use the same format.
        for s, node in enumerate(body.elts):
            where = f"stage {s}"
            if not isinstance(node, (ast.List, ast.Tuple)):
                raise self.error(node, where, f"expected a list, got {self.excerpt(node)}")
            if not node.elts:
                raise self.error(node, where, "empty stage")
            # A stage starting with an integer is in the old frequency-only format; anything
            # else is read as pairs, so a stray string reports a bad pair.
            first = node.elts[0]
            is_pairs = not (
                isinstance(first, ast.Constant)
                and isinstance(first.value, int)
                and not isinstance(first.value, bool)
            )
            if pair_format is not None and is_pairs != pair_format:
                raise self.error(
                    node, where, "mixes (instruction, frequency) pairs and plain frequency lists"
                )
            pair_format = is_pairs
            if is_pairs:
                stage = [self.pair(item, f"{where}, item {i}") for i, item in enumerate(node.elts)]
                self.check_order(node, where, stage)
            else:
                stage = self.frequency_only(node, where, num_stages, s)
            if stages:
                want, got = _count_forward(stages[0]), _count_forward(stage)
                if got != want:
                    raise self.error(node, where, f"has {got} microbatches but stage 0 has {want}")
            stages.append(stage)
        if self.schedule is not None:
            for s, (node, stage) in enumerate(zip(body.elts, stages, strict=True)):
                self.check_schedule(node, f"stage {s}", stage, num_stages, s)
        return stages

    def check_schedule(
        self,
        node: ast.expr,
        where: str,
        stage: list[tuple[str, int]],
        num_stages: int,
        index: int,
    ) -> None:
        """The stage must follow the order of the schedule the header names."""
        assert self.schedule is not None
        names = [name for name, _ in stage]
        want = stage_order(self.schedule, num_stages, _count_forward(stage), index)
        if names == want:
            return
        i = next(i for i, (a, b) in enumerate(zip(names, want, strict=True)) if a != b)
        others = [
            other
            for other in PIPELINE_SCHEDULES
            if names == stage_order(other, num_stages, _count_forward(stage), index)
        ]
        hint = f" (it follows {others[0]} order)" if others else ""
        raise self.error(
            node,
            where,
            f"item {i} is {names[i]!r} but the header's {SCHEDULE_HEADER} {self.schedule} "
            f"runs {want[i]!r} there{hint}",
        )

    def pair(self, node: ast.expr, where: str) -> tuple[str, int]:
        if not isinstance(node, (ast.Tuple, ast.List)) or len(node.elts) != 2:
            raise self.error(
                node, where, f"expected (instruction, frequency) pair, got {self.excerpt(node)}"
            )
        name_node, freq_node = node.elts
        if not (isinstance(name_node, ast.Constant) and isinstance(name_node.value, str)):
            raise self.error(
                name_node, where, f"expected an instruction name, got {self.excerpt(name_node)}"
            )
        if name_node.value not in INSTRUCTIONS:
            raise self.error(
                name_node,
                where,
                f"bad instruction name {name_node.value!r} (expected 'forward' or 'backward')",
            )
        return name_node.value, self.frequency(freq_node, where)

    def frequency(self, node: ast.expr, where: str) -> int:
        value = node.value if isinstance(node, ast.Constant) else None
        # bool is an int subclass; True is not a frequency.
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise self.error(
                node, where, f"expected a positive integer frequency, got {self.excerpt(node)}"
            )
        return value

    def frequency_only(
        self, node: ast.List | ast.Tuple, where: str, num_stages: int, stage: int
    ) -> list[tuple[str, int]]:
        freqs = [self.frequency(item, f"{where}, item {i}") for i, item in enumerate(node.elts)]
        if len(freqs) % 2:
            raise self.error(
                node,
                where,
                f"odd number of frequencies ({len(freqs)}); a stage has one forward and "
                "one backward per microbatch",
            )
        names = stage_order(self.schedule or DEFAULT_SCHEDULE, num_stages, len(freqs) // 2, stage)
        return list(zip(names, freqs, strict=True))

    def check_order(
        self, node: ast.List | ast.Tuple, where: str, stage: list[tuple[str, int]]
    ) -> None:
        forwards = _count_forward(stage)
        if 2 * forwards != len(stage):
            raise self.error(
                node,
                where,
                f"{forwards} forward but {len(stage) - forwards} backward instructions",
            )
        pending = 0  # Microbatches whose forward ran but whose backward did not.
        for i, (name, _) in enumerate(stage):
            pending += 1 if name == "forward" else -1
            if pending < 0:
                raise self.error(node.elts[i], f"{where}, item {i}", "backward before its forward")


def _count_forward(stage: list[tuple[str, int]]) -> int:
    return sum(1 for name, _ in stage if name == "forward")
