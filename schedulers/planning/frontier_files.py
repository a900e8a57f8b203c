"""The files a planner run leaves in its output folder, and reading them back.

``perseus optimize ... --out DIR`` writes:

* ``freqs_pipeline_%05d.py``: one plan per frontier point; a larger number means a shorter
  iteration (plan ``00000`` is the slowest, least-energy end of the frontier);
* ``frontier.csv``: one row per plan plus an ``allmax`` row (every instruction at its highest
  profiled clock, i.e. running without Perseus), columns

  - ``plan``: plan id (the file number) or ``allmax``;
  - ``iteration_time``: the solver's estimate, quantized time x unit time, seconds. Each
    instruction's time is rounded *down* to whole units, so this undershoots the profile's
    longest path (``profile_time``) by less than ``rounding_bound`` (see ``frontier.json``).
    It can also exceed ``profile_time``: where the solver's duration for an instruction falls
    between two clocks, the instruction runs at the slowest clock that fits, finishing early.
    The choice policies compare this column, the quantity the frontier is optimal in;
  - ``energy``: computation energy of one iteration of one pipeline (one GPU per stage),
    summed from the *profile* at the plan's clocks (not from the fitted cost models), J;
  - ``energy_with_p2p``: ``energy`` plus ``p2p_power`` times the time the GPUs spend blocked
    on communication, ``num_stages * profile_time - sum of instruction times``, J;
  - ``profile_time``: the pipeline's longest dependency path with the profile's (unrounded)
    instruction times at the plan's clocks, seconds;
  - ``quant_time``: the solver's quantized iteration time, in units;
  - ``model_cost``: the fitted cost models' total (what the solver minimises), J; empty for
    ``allmax``;
  - ``file``: the plan file name (empty for ``allmax``);

* ``frontier.json``: run parameters and diagnostics (unit time, rounding bound, cost model fits,
  timings);
* ``profile.csv``: the profile the plans were computed from, replicas averaged (short form), so
  that the folder alone is enough to choose and plot plans.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from protocol.exceptions import ConfigError

FRONTIER_CSV = "frontier.csv"
FRONTIER_JSON = "frontier.json"
PROFILE_CSV = "profile.csv"
PLAN_PATTERN = "freqs_pipeline_%05d.py"
ALLMAX = "allmax"
CSV_COLUMNS = (
    "plan",
    "iteration_time",
    "energy",
    "energy_with_p2p",
    "profile_time",
    "quant_time",
    "model_cost",
    "file",
)


def plan_id(index: int) -> str:
    """Plan id of frontier point ``index`` (``0`` is the slowest)."""
    return f"{index:05d}"


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
    profile_time: float
    quant_time: int
    model_cost: float | None = None
    file: str = ""

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
    def rounding_bound(self) -> float:
        """Most the quantized iteration time can undershoot the real one, seconds."""
        return float(self.meta.get("rounding_bound", 0.0))

    def path(self, point: FrontierPoint) -> Path:
        """Path of a plan's file."""
        return self.out_dir / point.file

    def point(self, plan: str) -> FrontierPoint:
        """Return the point with plan id ``plan`` (``"12"`` and ``"00012"`` both work)."""
        wanted = plan if plan == ALLMAX else plan_id(int(plan)) if plan.isdigit() else plan
        for p in [*self.points, self.allmax]:
            if p.plan == wanted:
                return p
        raise ConfigError(f"{self.out_dir / FRONTIER_CSV}: no plan {plan!r}")


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)
    return str(value)


def write_frontier_csv(path: Path, points: list[FrontierPoint], allmax: FrontierPoint) -> None:
    """Write ``frontier.csv``: the plans in plan order, then the ``allmax`` row."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(CSV_COLUMNS)
        for p in [*points, allmax]:
            writer.writerow([_cell(getattr(p, c)) for c in CSV_COLUMNS])
    tmp.replace(path)


def write_frontier_json(path: Path, meta: dict[str, Any]) -> None:
    """Write ``frontier.json`` (sorted keys, indented, for people to read)."""
    path.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def point_dict(point: FrontierPoint) -> dict[str, Any]:
    """Return a point as a plain dict (for JSON)."""
    return asdict(point)


def _parse_row(where: str, line: int, row: dict[str, str]) -> FrontierPoint:
    def number(name: str, *, optional: bool = False) -> float | None:
        text = (row.get(name) or "").strip()
        if not text and optional:
            return None
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(f"{where}:{line}: field '{name}': not a number: {text!r}") from None
        if not math.isfinite(value):
            raise ConfigError(f"{where}:{line}: field '{name}': not finite: {text!r}")
        return value

    plan = (row.get("plan") or "").strip()
    if plan != ALLMAX and not plan.isdigit():
        raise ConfigError(f"{where}:{line}: field 'plan': expected a number or 'allmax'")
    return FrontierPoint(
        plan=plan if plan == ALLMAX else plan_id(int(plan)),
        iteration_time=float(number("iteration_time") or 0.0),
        energy=float(number("energy") or 0.0),
        energy_with_p2p=float(number("energy_with_p2p") or 0.0),
        profile_time=float(number("profile_time") or 0.0),
        quant_time=int(number("quant_time") or 0),
        model_cost=number("model_cost", optional=True),
        file=(row.get("file") or "").strip(),
    )


def load_frontier(out_dir: str | Path) -> Frontier:
    """Read ``frontier.csv`` (and ``frontier.json`` if present) from a planner folder.

    Raises:
        ConfigError: The folder or ``frontier.csv`` is missing, or the CSV is malformed.

    """
    out = Path(out_dir)
    csv_path = out / FRONTIER_CSV
    where = str(csv_path)
    if not out.is_dir():
        raise ConfigError(f"{out}: no such folder (run `perseus optimize ... --out {out}`)")
    if not csv_path.is_file():
        raise ConfigError(
            f"{where}: missing; {out} is not a planner output folder "
            f"(run `perseus optimize ... --out {out}`)"
        )
    with open(csv_path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in CSV_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ConfigError(f"{where}:1: header is missing column(s) {missing}")
        rows = [_parse_row(where, i, row) for i, row in enumerate(reader, start=2)]
    allmax = [p for p in rows if p.plan == ALLMAX]
    points = sorted((p for p in rows if p.plan != ALLMAX), key=lambda p: p.index)
    if len(allmax) != 1:
        raise ConfigError(f"{where}: expected exactly one 'allmax' row, found {len(allmax)}")
    if not points:
        raise ConfigError(f"{where}: no plans")
    meta: dict[str, Any] = {}
    json_path = out / FRONTIER_JSON
    if json_path.is_file():
        try:
            meta = json.loads(json_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{json_path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
    return Frontier(out_dir=out, points=points, allmax=allmax[0], meta=meta)
