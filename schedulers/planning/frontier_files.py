"""The files a planner run leaves in its output folder, and reading them back.

``perseus optimize ... --out DIR`` writes:

* ``freqs_pipeline_%05d.py``: one plan per solver step; a larger number means a shorter
  quantized iteration (plan ``00000`` is the solver's slowest, least-model-cost point);
* ``frontier.csv``: one row per plan, columns

  - ``plan``: plan id (the file number);
  - ``iteration_time``: *the* iteration time of the plan, shown everywhere (plots, ``perseus
    choose``, the demo) and compared by the choice policies: the pipeline's longest dependency
    path with the profile's unrounded instruction times at the plan's clocks, seconds;
  - ``energy``: computation energy of one iteration of one pipeline (one GPU per stage),
    summed from the *profile* at the plan's clocks (not from the fitted cost models), J;
  - ``energy_with_p2p``: ``energy`` plus ``p2p_power`` times the time the GPUs spend blocked
    on communication, ``num_stages * iteration_time - sum of instruction times``, J;
  - ``quant_time``: the solver's internal iteration time, in units of ``unit_time`` (each
    instruction's time rounded *down*), so ``iteration_time`` exceeds ``quant_time *
    unit_time`` by less than ``rounding_bound`` (see ``frontier.json``); it may also be well
    below it, as lowtime gives each instruction the slowest clock that fits its solver
    duration, and durations fall between clocks;
  - ``model_cost``: the fitted cost models' total (what the solver minimises), J;
  - ``dominated``: ``1`` if another plan is no slower and uses no more energy
    (``energy_with_p2p``), one of them strictly, or if the plan repeats an earlier plan's
    clocks exactly (consecutive solver steps can round to the same clocks; the first is
    kept); such a plan is not on the Pareto frontier in the time and energy shown, and no
    policy chooses it. ``0`` otherwise;
  - ``file``: the plan file name;

* ``allmax.csv``: the same columns, one ``allmax`` row: every instruction at its highest
  profiled clock (running without Perseus), the reference the policies compare against;
* ``frontier.json``: run parameters and diagnostics (unit time, rounding bound, cost model fits,
  timings);
* ``profile.csv``: the profile the plans were computed from, replicas averaged (short form), so
  that the folder alone is enough to choose and plot plans;
* ``plans.delta``: every plan's clocks as changes from the previous plan;
* with ``--plot`` (or ``perseus choose --plot``): ``frontier.png`` and ``timeline_<plan>.png``.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Collection
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from protocol.exceptions import ConfigError
from protocol.numbers import ascii_float, is_ascii_digits

FRONTIER_CSV = "frontier.csv"
FRONTIER_JSON = "frontier.json"
ALLMAX_CSV = "allmax.csv"
PROFILE_CSV = "profile.csv"
PLAN_PATTERN = "freqs_pipeline_%05d.py"
FRONTIER_PNG = "frontier.png"
#: What an earlier run (or ``perseus choose --plot``) may have left that a new run replaces;
#: ``frontier_*.png`` and ``plan.png`` are names older versions used.
STALE_PATTERNS = (
    "freqs_pipeline_*.py",
    "frontier.png",
    "frontier_*.png",
    "timeline_*.png",
    "plan.png",
    "plans.delta",
    "frontier.csv",
    "allmax.csv",
    "frontier.json",
    "profile.csv",
)
ALLMAX = "allmax"
CSV_COLUMNS = (
    "plan",
    "iteration_time",
    "energy",
    "energy_with_p2p",
    "quant_time",
    "model_cost",
    "dominated",
    "file",
)


def plan_id(index: int) -> str:
    """Plan id of frontier point ``index`` (``0`` is the slowest)."""
    return f"{index:05d}"


def timeline_png_name(plan: str) -> str:
    """File name of plan ``plan``'s timeline picture."""
    return f"timeline_{plan}.png"


def remove_stale_outputs(out_dir: Path) -> list[Path]:
    """Delete the files an earlier planner run left in ``out_dir``; return what went.

    Only the planner's own file names (:data:`STALE_PATTERNS`) are touched, so pointing
    ``--out`` at a folder that holds other files is safe.
    """
    gone = [p for pattern in STALE_PATTERNS for p in out_dir.glob(pattern) if p.is_file()]
    for path in gone:
        path.unlink()
    return gone


def plan_file_name(index: int) -> str:
    """File name of frontier point ``index``."""
    return PLAN_PATTERN % index


@dataclass(frozen=True)
class FrontierPoint:
    """One row of ``frontier.csv`` (see the module docstring for the columns)."""

    plan: str
    iteration_time: float
    energy: float
    energy_with_p2p: float
    quant_time: int
    model_cost: float | None = None
    file: str = ""
    dominated: bool = False

    @property
    def index(self) -> int:
        """Plan number (-1 for ``allmax``)."""
        return -1 if self.plan == ALLMAX else int(self.plan)


@dataclass
class Frontier:
    """A planner output folder, read back.

    Attributes:
        out_dir: The folder.
        points: The plans, slowest (plan ``00000``) first.
        allmax: The all-max-clock reference.
        meta: ``frontier.json`` (empty if the file is absent).

    """

    out_dir: Path
    points: list[FrontierPoint]
    allmax: FrontierPoint
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def pareto(self) -> list[FrontierPoint]:
        """The plans no other plan dominates (the ones policies choose from)."""
        return [p for p in self.points if not p.dominated]

    @property
    def rounding_bound(self) -> float:
        """Most the solver's quantized time differs from ``iteration_time``, seconds."""
        value = self.meta.get("rounding_bound", 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise ConfigError(
                f"{self.out_dir / FRONTIER_JSON}: rounding_bound must be a number, got {value!r}"
            )
        return float(value)

    def path(self, point: FrontierPoint) -> Path:
        """Path of a plan's file."""
        return self.out_dir / point.file

    def point(self, plan: str) -> FrontierPoint:
        """Return the point with plan id ``plan`` (``"12"`` and ``"00012"`` both work)."""
        wanted = plan if plan == ALLMAX else plan_id(int(plan)) if is_ascii_digits(plan) else plan
        for p in [*self.points, self.allmax]:
            if p.plan == wanted:
                return p
        raise ConfigError(f"{self.out_dir / FRONTIER_CSV}: no plan {plan!r}")


def mark_dominated(
    points: list[FrontierPoint], repeats: Collection[int] = ()
) -> list[FrontierPoint]:
    """Return ``points`` with ``dominated`` set (see the module docstring), in the same order.

    A plan is dominated if another is no slower and uses no more ``energy_with_p2p``, one of
    the two strictly; plans equal in both are kept, except those listed in ``repeats``.

    Args:
        points: The plans.
        repeats: Indices into ``points`` of plans that repeat an earlier plan exactly (same
            clocks), marked dominated so that the frontier counts each plan once.
    """
    order = sorted(
        range(len(points)), key=lambda i: (points[i].iteration_time, points[i].energy_with_p2p)
    )
    flags = [False] * len(points)
    before = math.inf  # Least energy among strictly faster plans.
    k = 0
    while k < len(order):
        j = k
        t = points[order[k]].iteration_time
        while j < len(order) and points[order[j]].iteration_time == t:
            j += 1
        group_min = points[order[k]].energy_with_p2p  # Sorted by energy within a time.
        for i in order[k:j]:
            e = points[i].energy_with_p2p
            flags[i] = before <= e or group_min < e or i in repeats
        before = min(before, group_min)
        k = j
    return [replace(p, dominated=f) for p, f in zip(points, flags, strict=True)]


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _write_rows(path: Path, rows: list[FrontierPoint]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(CSV_COLUMNS)
        for p in rows:
            writer.writerow([_cell(getattr(p, c)) for c in CSV_COLUMNS])
    tmp.replace(path)


def write_frontier_csv(path: Path, points: list[FrontierPoint]) -> None:
    """Write ``frontier.csv``: the plans in plan order."""
    _write_rows(path, points)


def write_allmax_csv(path: Path, allmax: FrontierPoint) -> None:
    """Write ``allmax.csv``: the all-max-clock reference row."""
    _write_rows(path, [allmax])


def write_frontier_json(path: Path, meta: dict[str, Any]) -> None:
    """Write ``frontier.json`` (sorted keys, indented, for people to read)."""
    path.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def point_dict(point: FrontierPoint) -> dict[str, Any]:
    """Return a point as a plain dict (for JSON)."""
    return asdict(point)


def _parse_row(where: str, line: int, row: dict[str, str], expect: str) -> FrontierPoint:
    def number(name: str, *, optional: bool = False) -> float | None:
        text = (row.get(name) or "").strip()
        if not text and optional:
            return None
        try:
            value = ascii_float(text)  # float() reads Arabic-Indic and full-width digits
        except ValueError:
            raise ConfigError(f"{where}:{line}: field '{name}': not a number: {text!r}") from None
        if not math.isfinite(value):
            raise ConfigError(f"{where}:{line}: field '{name}': not finite: {text!r}")
        if value < 0 and name != "model_cost":  # times and energies (a fit's cost may not)
            raise ConfigError(f"{where}:{line}: field '{name}': negative: {text!r}")
        return value

    plan = (row.get("plan") or "").strip()
    if plan != expect and not (expect == "plan" and is_ascii_digits(plan)):
        wanted = "a plan number" if expect == "plan" else repr(expect)
        raise ConfigError(f"{where}:{line}: field 'plan': expected {wanted}, got {plan!r}")
    dominated = (row.get("dominated") or "").strip()
    if dominated not in ("0", "1"):
        raise ConfigError(f"{where}:{line}: field 'dominated': expected 0 or 1, got {dominated!r}")
    # The plan's own file in this folder: `perseus choose` writes it there when it is missing,
    # so '../x' or '/x' made it write outside the folder.
    file = (row.get("file") or "").strip()
    own = "" if plan == ALLMAX else plan_file_name(int(plan))
    if file != own:
        raise ConfigError(f"{where}:{line}: field 'file': expected {own!r}, got {file!r}")
    return FrontierPoint(
        plan=plan if plan == ALLMAX else plan_id(int(plan)),
        iteration_time=float(number("iteration_time") or 0.0),
        energy=float(number("energy") or 0.0),
        energy_with_p2p=float(number("energy_with_p2p") or 0.0),
        quant_time=int(number("quant_time") or 0),
        model_cost=number("model_cost", optional=True),
        file=file,
        dominated=dominated == "1",
    )


def _read_rows(path: Path, expect: str) -> list[FrontierPoint]:
    where = str(path)
    try:
        # utf-8-sig: a spreadsheet saving the file puts a byte order mark before "plan".
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read: {exc.strerror or exc}") from None
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        missing = [c for c in CSV_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ConfigError(
                f"{where}:1: header is missing column(s) {missing} "
                "(written by an older perseus optimize? run it again)"
            )
        points: list[FrontierPoint] = []
        lines: dict[str, int] = {}
        for row in reader:
            i = reader.line_num  # the file's line: blank lines are skipped, not counted
            names = list(reader.fieldnames or [])
            extra = row.pop(None, None) or []  # cells past the header (DictReader's restkey)
            short = sum(1 for value in row.values() if value is None)  # cells it lacks
            if extra or short:
                raise ConfigError(
                    f"{where}:{i}: expected {len(names)} fields ({','.join(names)}), "
                    f"got {len(names) + len(extra) - short}"
                )
            point = _parse_row(where, i, row, expect)
            if point.plan in lines:
                raise ConfigError(
                    f"{where}:{i}: field 'plan': plan {point.plan} again (first at line "
                    f"{lines[point.plan]})"
                )
            lines[point.plan] = i
            points.append(point)
        return points
    except csv.Error as exc:  # e.g. a NUL byte, or a field past csv's size limit
        raise ConfigError(f"{where}:{reader.line_num}: not CSV: {exc}") from None


def refuse_non_file(path: Path) -> None:
    """Raise ConfigError if ``path`` exists but is no file (a folder in a file's place).

    ``is_file()`` alone took such a file for a missing one: "missing", or "no plans.delta to
    rebuild it from", where the name is there and is the wrong kind.
    """
    if path.exists() and not path.is_file():
        kind = "a folder" if path.is_dir() else "not a regular file"
        raise ConfigError(
            f"{path}: is {kind}, where perseus optimize writes a file (remove it and run "
            "perseus optimize again)"
        )


def load_frontier(out_dir: str | Path) -> Frontier:
    """Read ``frontier.csv``, ``allmax.csv`` (and ``frontier.json`` if present) from a folder.

    Raises:
        ConfigError: The folder or a CSV is missing, or a CSV is malformed.

    """
    out = Path(out_dir)
    if not out.is_dir():
        raise ConfigError(f"{out}: no such folder (run `perseus optimize ... --out {out}`)")
    for name in (FRONTIER_CSV, ALLMAX_CSV, FRONTIER_JSON):
        refuse_non_file(out / name)
    for name in (FRONTIER_CSV, ALLMAX_CSV):
        if not (out / name).is_file():
            raise ConfigError(
                f"{out / name}: missing; {out} is not a planner output folder "
                f"(run `perseus optimize ... --out {out}`)"
            )
    points = sorted(_read_rows(out / FRONTIER_CSV, "plan"), key=lambda p: p.index)
    if not points:
        raise ConfigError(f"{out / FRONTIER_CSV}: no plans")
    if all(p.dominated for p in points):
        raise ConfigError(
            f"{out / FRONTIER_CSV}: every one of its {len(points)} plans is marked dominated "
            "(column 'dominated' = 1), so no policy has a plan to choose; perseus optimize "
            "leaves at least one at 0 (was the file truncated or edited? run it again)"
        )
    allmax = _read_rows(out / ALLMAX_CSV, ALLMAX)
    if len(allmax) != 1:
        raise ConfigError(
            f"{out / ALLMAX_CSV}: expected exactly one 'allmax' row, found {len(allmax)}"
        )
    meta: dict[str, Any] = {}
    json_path = out / FRONTIER_JSON
    if json_path.is_file():
        try:
            # utf-8-sig: an editor may save it with a byte order mark, which json refuses.
            meta = json.loads(json_path.read_text(encoding="utf-8-sig"))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{json_path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"{json_path}: not UTF-8 text ({exc.reason} at byte {exc.start})"
            ) from None
        except RecursionError:
            raise ConfigError(f"{json_path}: invalid JSON: nested too deeply") from None
        if not isinstance(meta, dict):
            raise ConfigError(
                f"{json_path}: expected a JSON object (the run's parameters), got "
                f"{type(meta).__name__}"
            )
    return Frontier(out_dir=out, points=points, allmax=allmax[0], meta=meta)
