"""Read instruction profile CSV files (the planner's input; writing: ``profile_writer``).

Two forms are accepted, told apart by the header (columns may come in any order, and other
columns are ignored, as the Perseus docs allow any CSV that has the reference columns):

* short, as in the Perseus docs: ``stage,instruction,frequency,time,energy``;
* full, one row per rank: ``rank,dp_rank,pp_rank,tp_rank,stage,instruction,frequency,time,energy``
  (``stage`` must equal ``pp_rank``).

``time`` is seconds per instruction and ``energy`` Joules per instruction, both averaged over
repetitions by the profiler. In the full form, the data- and tensor-parallel replicas of one
stage each report their own rows. The planner needs one figure per GPU of a stage, and every
replica is its own GPU running the same instruction, so replicas are **averaged** (time and
energy alike), clock by clock: every replica of a stage must cover the same clocks, every rank
must keep one (dp, pp, tp) place, and no two ranks may share one. This differs from merging
the results of one *iteration* across a stage's ranks (time: max, energy: sum), which answers a
different question (the whole stage's cost).

Every problem raises :class:`~protocol.exceptions.ConfigError` naming the file, the line
and the field, e.g. ``prof.csv:7: field 'time': must be positive, got -0.1``.
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from protocol.constants import INSTRUCTIONS, MAX_CLOCK_MHZ
from protocol.exceptions import ConfigError
from protocol.numbers import ascii_float, ascii_int

SHORT_COLUMNS = ("stage", "instruction", "frequency", "time", "energy")
RANK_COLUMNS = ("rank", "dp_rank", "pp_rank", "tp_rank")
FULL_COLUMNS = RANK_COLUMNS + SHORT_COLUMNS

# (stage, instruction) -> frequency (MHz) -> (time s, energy J)
ProfileTable = dict[tuple[int, str], dict[int, tuple[float, float]]]


@dataclass(frozen=True)
class ProfileRow:
    """One data row of a profile CSV.

    Attributes:
        stage: Pipeline stage.
        instruction: ``"forward"`` or ``"backward"``.
        frequency: GPU graphics clock, MHz.
        time: Seconds per instruction.
        energy: Joules per instruction.
        line: Line number in the file (1 is the header); 0 for rows built in code.
        rank: Global rank (full form only).
        dp_rank: Data parallel rank (full form only).
        pp_rank: Pipeline parallel rank (full form only).
        tp_rank: Tensor parallel rank (full form only).

    """

    stage: int
    instruction: str
    frequency: int
    time: float
    energy: float
    line: int = 0
    rank: int | None = None
    dp_rank: int | None = None
    pp_rank: int | None = None
    tp_rank: int | None = None


@dataclass
class InstructionProfile:
    """A parsed profile: the raw rows and the per-stage table the planner uses.

    Attributes:
        rows: Rows in file order.
        table: ``table[(stage, instruction)][frequency] = (time, energy)``, replicas averaged.
        replicas: ``replicas[(stage, instruction, frequency)]``: how many rows were averaged.
        path: The file read ("" for profiles built in code).
        full_form: Whether the file had the per-rank columns.

    """

    rows: list[ProfileRow]
    table: ProfileTable
    replicas: dict[tuple[int, str, int], int] = field(default_factory=dict)
    path: str = ""
    full_form: bool = False

    @property
    def stages(self) -> list[int]:
        """Stages present, ascending."""
        return sorted({stage for stage, _ in self.table})

    def frequencies(self, stage: int, instruction: str) -> list[int]:
        """Profiled frequencies of one stage's instruction, highest first."""
        return sorted(self._entry(stage, instruction), reverse=True)

    def time(self, stage: int, instruction: str, frequency: int) -> float:
        """Seconds per instruction at ``frequency``."""
        return self._lookup(stage, instruction, frequency)[0]

    def energy(self, stage: int, instruction: str, frequency: int) -> float:
        """Joules per instruction at ``frequency``."""
        return self._lookup(stage, instruction, frequency)[1]

    def _entry(self, stage: int, instruction: str) -> dict[int, tuple[float, float]]:
        try:
            return self.table[(stage, instruction)]
        except KeyError:
            where = self.path or "profile"
            raise ConfigError(f"{where}: no rows for stage {stage} {instruction}") from None

    def _lookup(self, stage: int, instruction: str, frequency: int) -> tuple[float, float]:
        entry = self._entry(stage, instruction)
        try:
            return entry[frequency]
        except KeyError:
            where = self.path or "profile"
            raise ConfigError(
                f"{where}: stage {stage} {instruction} was not profiled at {frequency} MHz"
            ) from None

    def check_stages(self, num_stages: int) -> None:
        """Raise ConfigError unless stages ``0..num_stages-1`` (and no others) have both kinds.

        Args:
            num_stages: The pipeline's number of stages.

        """
        where = self.path or "profile"
        if num_stages < 1:
            raise ConfigError(f"number of stages must be at least 1, got {num_stages}")
        for row in self.rows:
            if row.stage >= num_stages:
                raise ConfigError(
                    f"{where}:{row.line}: field 'stage': stage {row.stage} is out of range "
                    f"for {num_stages} stage(s)"
                )
        for stage in range(num_stages):
            for inst in INSTRUCTIONS:
                if not self.table.get((stage, inst)):
                    raise ConfigError(
                        f"{where}: field 'stage'/'instruction': no rows for stage {stage} "
                        f"{inst} (the pipeline has {num_stages} stage(s))"
                    )


def build_profile(
    rows: Sequence[ProfileRow], path: str = "", full_form: bool = False
) -> InstructionProfile:
    """Merge rows into an :class:`InstructionProfile`, averaging replicas of a stage.

    Raises:
        ConfigError: Two rows describe the same rank (or, in the short form, the same stage),
            instruction and frequency; or (rows with ranks) a rank's coordinates differ between
            rows, two ranks share (dp, pp, tp), or replicas of a stage cover different clocks.

    """
    where = path or "profile"
    seen: dict[tuple[int | None, int, str, int], int] = {}
    sums: dict[tuple[int, str, int], list[float]] = {}
    for row in rows:
        ident = (row.rank, row.stage, row.instruction, row.frequency)
        if ident in seen:
            who = f"rank {row.rank}" if row.rank is not None else f"stage {row.stage}"
            raise ConfigError(
                f"{where}:{row.line}: field 'frequency': duplicate row for {who} "
                f"{row.instruction} at {row.frequency} MHz (first at line {seen[ident]})"
            )
        seen[ident] = row.line
        acc = sums.setdefault((row.stage, row.instruction, row.frequency), [0.0, 0.0, 0.0])
        acc[0] += row.time
        acc[1] += row.energy
        acc[2] += 1
    _check_ranks(where, rows)
    table: ProfileTable = {}
    replicas: dict[tuple[int, str, int], int] = {}
    for (stage, inst, freq), (t, e, n) in sums.items():
        table.setdefault((stage, inst), {})[freq] = (t / n, e / n)
        replicas[(stage, inst, freq)] = int(n)
    return InstructionProfile(
        rows=list(rows), table=table, replicas=replicas, path=path, full_form=full_form
    )


def _line(row: ProfileRow) -> str:
    return f"line {row.line}" if row.line else "a row built in code"


def _check_ranks(where: str, rows: Sequence[ProfileRow]) -> None:
    """Check the rows that name their rank (the full form).

    One place per rank, one rank per place, and the same clocks for every replica of a stage
    (they are averaged clock by clock).
    """
    first: dict[int, ProfileRow] = {}  # rank -> its first row
    place: dict[tuple[int | None, int, int | None], ProfileRow] = {}  # (dp, pp, tp) -> row
    clocks: dict[tuple[int, str], dict[int, dict[int, ProfileRow]]] = {}
    stage_ranks: dict[int, list[int]] = {}
    for row in rows:
        if row.rank is None:
            continue
        known = first.get(row.rank)
        if known is None:
            coords = (row.dp_rank, row.stage, row.tp_rank)
            other = place.get(coords)
            if other is not None:
                raise ConfigError(
                    f"{where}:{row.line}: field 'rank': ranks {other.rank} ({_line(other)}) "
                    f"and {row.rank} have the same (dp_rank, pp_rank, tp_rank) = {coords}; "
                    "every rank needs its own place"
                )
            first[row.rank] = place[coords] = row
            stage_ranks.setdefault(row.stage, []).append(row.rank)
        else:
            for name in ("stage", "dp_rank", "tp_rank"):
                was, now = getattr(known, name), getattr(row, name)
                if was != now:
                    raise ConfigError(
                        f"{where}:{row.line}: field '{name}': rank {row.rank} has {name} {now} "
                        f"here but {was} at {_line(known)}; a rank belongs to one stage "
                        "and place"
                    )
        clocks.setdefault((row.stage, row.instruction), {}).setdefault(row.rank, {})[
            row.frequency
        ] = row
    for (stage, inst), by_rank in sorted(clocks.items()):
        union: dict[int, ProfileRow] = {}
        for rank in stage_ranks[stage]:
            for freq, row in by_rank.get(rank, {}).items():
                union.setdefault(freq, row)
        for rank in stage_ranks[stage]:
            missing = sorted(set(union) - set(by_rank.get(rank, {})), reverse=True)
            if missing:
                have = union[missing[0]]
                own = sorted(row.line for row in by_rank.get(rank, {}).values())
                its = f"{inst} rows from line {own[0]}" if own else f"no {inst} rows"
                raise ConfigError(
                    f"{where}:{have.line}: field 'frequency': replicas of stage {stage} cover "
                    f"different {inst} clocks: rank {rank} ({its}) has no row at "
                    f"{', '.join(str(f) for f in missing)} MHz, which rank {have.rank} has "
                    f"({_line(have)}); the replicas of a stage are averaged clock by clock, so "
                    "profile every replica at the same clocks (or drop those rows)"
                )


def _fail(path: str, line: int, column: str, problem: str) -> ConfigError:
    return ConfigError(f"{path}:{line}: field '{column}': {problem}")


# A whole number as pandas writes an integer column that ever held a NaN: "1980.0".
_WHOLE_FLOAT_RE = re.compile(r"([+-]?[0-9]+)\.0*")


def _parse_int(path: str, line: int, column: str, text: str, minimum: int) -> int:
    whole = _WHOLE_FLOAT_RE.fullmatch(text.strip(" \t\r\n"))
    try:
        # int() reads Arabic-Indic and other digits, and "1_200"; lowtime and Zeus read
        # "1980.0" as 1980 (int() of pandas' float), so that is taken too.
        value = ascii_int(whole.group(1) if whole else text)
    except ValueError:
        raise _fail(
            path, line, column, f"not an integer (ASCII digits, .0 allowed): {text!r}"
        ) from None
    if value < minimum:
        raise _fail(path, line, column, f"must be >= {minimum}, got {value}")
    return value


def _parse_float(path: str, line: int, column: str, text: str) -> float:
    try:
        value = ascii_float(text)
    except ValueError:
        raise _fail(path, line, column, f"not a number (ASCII digits): {text!r}") from None
    if not math.isfinite(value):
        raise _fail(path, line, column, f"must be finite, got {text.strip()!r}")
    return value


def _records(where: str, text: str) -> list[tuple[int, list[str]]]:
    """The CSV records of ``text``, each with the line it starts on."""
    # One stream: read line by line, a quoted "0.01<newline>5" was glued into 0.015 s.
    reader = csv.reader(io.StringIO(text, newline=""))
    out: list[tuple[int, list[str]]] = []
    start = 1
    try:
        for record in reader:
            out.append((start, record))
            start = reader.line_num + 1
    except csv.Error as exc:  # a NUL byte, a field over csv's size limit, an open quote at EOF
        raise ConfigError(f"{where}:{start}: not CSV: {exc}") from None
    return out


def _refuse_multiline(where: str, line: int, cell: dict[str, str], read: Sequence[str]) -> None:
    """A value the planner reads may not span lines (columns it ignores, notes say, may)."""
    for column in read:
        if "\n" in cell[column].strip() or "\r" in cell[column].strip():
            raise _fail(
                where,
                line,
                column,
                f"a quoted value runs over several lines (a '\"' left open?): {cell[column]!r}",
            )


def _check_header(path: str, header: list[str]) -> tuple[str, ...]:
    """Normalise the header's names; raise ConfigError if a needed column is missing or doubled.

    Columns the planner does not read (a spreadsheet's index column, a ``power`` column) are
    kept in the returned names, so that rows still split by position, and are ignored: the
    Perseus docs take any CSV that has the reference columns.
    """
    names = [h.strip().lower() for h in header]
    full = any(n in RANK_COLUMNS for n in names)
    expected = FULL_COLUMNS if full else SHORT_COLUMNS
    others = [n for n in names if n not in expected]
    missing = [n for n in expected if n not in names]
    dupes = sorted({n for n in names if n in expected and names.count(n) > 1})
    form = ",".join(expected)
    if missing:
        ignored = f" (columns {others} are not read)" if others else ""
        raise _fail(
            path, 1, missing[0], f"header is missing column(s) {missing}{ignored}; expected {form}"
        )
    if dupes:
        raise _fail(path, 1, dupes[0], "column appears more than once in the header")
    return tuple(names)


def profile_warnings(prof: InstructionProfile, unit_time: float) -> list[str]:
    """What makes a profile plan nothing useful, though it is valid (``perseus optimize``).

    Args:
        prof: The profile.
        unit_time: The planner's time unit, seconds: shorter times round down to 0.
    """
    values = [v for row in prof.table.values() for v in row.values()]
    notes = []
    if values and all(energy == 0 for _, energy in values):
        notes.append(
            f"every energy in {prof.path or 'the profile'} is 0 J: a plan can save nothing "
            "(was energy measured? a simulated GPU's counter moves only with the work it runs)"
        )
    short = sum(1 for time, _ in values if time < unit_time)
    if short:
        notes.append(
            f"{short} of {len(values)} instruction times are under unit_time ({unit_time:g} s) "
            "and round down to 0 units: pass a smaller --unit-time"
        )
    return notes


def read_profile_csv(path: str | Path, num_stages: int | None = None) -> InstructionProfile:
    """Read a profile CSV in the short or the full form.

    Args:
        path: The CSV file.
        num_stages: If given, require rows for both instructions of every stage
            ``0..num_stages-1`` and no stage beyond.

    Returns:
        The parsed profile, replicas of a stage averaged.

    Raises:
        ConfigError: Naming the file, line and field of the first problem found.

    """
    where = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read profile {where}: {exc.strerror or exc}") from None
    try:
        # utf-8-sig: a spreadsheet's "CSV UTF-8" export starts with a byte order mark.
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        utf16 = raw[:2] in (b"\xff\xfe", b"\xfe\xff")
        found = "UTF-16 text" if utf16 else f"not UTF-8 text ({exc.reason} at byte {exc.start})"
        raise ConfigError(f"{where}: profile is {found}; save it as UTF-8 (CSV UTF-8)") from None
    records = _records(where, text)
    if not records or not any(cell.strip() for cell in records[0][1]):
        raise ConfigError(f"{where}:1: empty file or header; expected {','.join(SHORT_COLUMNS)}")
    columns = _check_header(where, records[0][1])
    full = "rank" in columns
    rows: list[ProfileRow] = []
    for line, record in records[1:]:
        if not record or not any(cell.strip() for cell in record):
            continue  # Blank lines (e.g. a trailing one) carry nothing.
        if len(record) != len(columns):
            raise ConfigError(
                f"{where}:{line}: expected {len(columns)} fields ({','.join(columns)}), "
                f"got {len(record)}"
            )
        cell = dict(zip(columns, record, strict=True))
        _refuse_multiline(where, line, cell, FULL_COLUMNS if full else SHORT_COLUMNS)
        instruction = cell["instruction"].strip().lower()
        if instruction not in INSTRUCTIONS:
            raise _fail(
                where,
                line,
                "instruction",
                f"unknown instruction {cell['instruction'].strip()!r} (use forward or backward)",
            )
        stage = _parse_int(where, line, "stage", cell["stage"], 0)
        frequency = _parse_int(where, line, "frequency", cell["frequency"], 1)
        if frequency > MAX_CLOCK_MHZ:  # 10^20 was planned and written into plan files
            why = f"{frequency} MHz is past {MAX_CLOCK_MHZ} MHz (10 GHz; an H100 tops at 1980)"
            raise _fail(where, line, "frequency", why + ": a clock in Hz or kHz, or a typo?")
        time = _parse_float(where, line, "time", cell["time"])
        if time <= 0:
            raise _fail(where, line, "time", f"must be positive (seconds), got {time!r}")
        energy = _parse_float(where, line, "energy", cell["energy"])
        if energy < 0:
            raise _fail(where, line, "energy", f"must not be negative (Joules), got {energy!r}")
        ranks: dict[str, int | None] = dict.fromkeys(RANK_COLUMNS)
        if full:
            for name in RANK_COLUMNS:
                ranks[name] = _parse_int(where, line, name, cell[name], 0)
            if ranks["pp_rank"] != stage:
                raise _fail(
                    where,
                    line,
                    "stage",
                    f"stage {stage} does not match pp_rank {ranks['pp_rank']}",
                )
        rows.append(ProfileRow(stage, instruction, frequency, time, energy, line, **ranks))
    if not rows:
        raise ConfigError(f"{where}:2: no data rows after the header")
    profile = build_profile(rows, path=where, full_form=full)
    if num_stages is not None:
        profile.check_stages(num_stages)
    return profile
