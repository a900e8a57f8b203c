"""Writing instruction profiles: the short form the planner reads, the full per-rank form."""

from __future__ import annotations

import csv
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.constants import INSTRUCTIONS
from schedulers.planning.profile_csv import FULL_COLUMNS, SHORT_COLUMNS, ProfileRow

if TYPE_CHECKING:
    from protocol.models import OfflineProfilingResult


def _write(path: str | Path, header: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    # repr() of a float round-trips exactly, so a written profile reads back identical.
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(header)
        for row in rows:
            writer.writerow([repr(v) if isinstance(v, float) else v for v in row])


def write_profile_rows(
    path: str | Path, rows: Iterable[tuple[int, str, int, float, float] | ProfileRow]
) -> None:
    """Write the short form ``stage,instruction,frequency,time,energy``.

    Args:
        path: Destination file (overwritten).
        rows: ``(stage, instruction, frequency, time, energy)`` tuples or ProfileRows.

    """

    def plain(row: tuple[int, str, int, float, float] | ProfileRow) -> tuple[object, ...]:
        if isinstance(row, ProfileRow):
            return (row.stage, row.instruction, row.frequency, row.time, row.energy)
        return tuple(row)

    _write(path, SHORT_COLUMNS, (plain(r) for r in rows))


def profile_rows_from_results(results: Iterable[OfflineProfilingResult]) -> list[ProfileRow]:
    """Flatten per-rank offline profiling results into full-form rows (stage = pp_rank).

    Rows are ordered by rank, then forward before backward, then frequency highest first.
    """
    out: list[ProfileRow] = []
    for res in sorted(results, key=lambda r: r.rank):
        for inst in INSTRUCTIONS:
            times: dict[int, float] = getattr(res, f"{inst}_time")
            energies: dict[int, float] = getattr(res, f"{inst}_energy")
            for freq in sorted(times, reverse=True):
                out.append(
                    ProfileRow(
                        stage=res.pp_rank,
                        instruction=inst,
                        frequency=freq,
                        time=float(times[freq]),
                        energy=float(energies[freq]),
                        rank=res.rank,
                        dp_rank=res.dp_rank,
                        pp_rank=res.pp_rank,
                        tp_rank=res.tp_rank,
                    )
                )
    return out


def write_profile_csv(path: str | Path, results: Iterable[OfflineProfilingResult]) -> None:
    """Write the full (per-rank) form from offline profiling results.

    Args:
        path: Destination file (overwritten).
        results: One result per rank.

    """
    rows = profile_rows_from_results(results)
    _write(
        path,
        FULL_COLUMNS,
        (
            (
                r.rank,
                r.dp_rank,
                r.pp_rank,
                r.tp_rank,
                r.stage,
                r.instruction,
                r.frequency,
                r.time,
                r.energy,
            )
            for r in rows
        ),
    )
