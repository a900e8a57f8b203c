"""How `perseus status` prints its snapshot: one line per job, its state first, in columns."""

from __future__ import annotations

from typing import Any

from coordinator.status import format_snapshot


def job(job_id: str, state: str, **kw: Any) -> dict[str, Any]:
    """A job row of :func:`coordinator.status.snapshot`."""
    row = {"job_id": job_id, "ranks": 1, "alive": 1, "world_size": 1, "version": 1}
    row.update(results_for_version=0, idle_s=0, error="", waiting_on=[], state=state)
    return {**row, **kw}


def snap(*jobs: dict[str, Any]) -> dict[str, Any]:
    """A snapshot with these jobs and nothing else."""
    rq = {"queue": "perseus", "queued": 0, "workers": 0, "failed": 0}
    return {"jobs": list(jobs), "streams": [], "rq": rq}


def test_status_names_each_job_state_in_its_table():
    first = {"version": 1, "time_s": 0.5, "energy_j": 0.0}
    text = format_snapshot(
        snap(
            job("a", "starting", version=0),
            job("b", "failed", error="boom"),
            job("c", "running", first=first, latest=first),
        )
    )
    assert "starting: -" in text and "failed: boom" in text
    assert "running: 0.5000 s/it, no energy measured (v1)" in text


def test_status_without_energy_shows_the_latest_versions_time_against_v1():
    first = {"version": 1, "time_s": 0.5, "energy_j": 0.0}
    latest = {"version": 3, "time_s": 0.55, "energy_j": 0.0}
    text = format_snapshot(snap(job("c", "running", version=3, first=first, latest=latest)))
    assert "running: 0.5500 s/it v3: +10.0% time vs v1, no energy measured" in text


def test_status_columns_stay_in_line_with_long_job_ids():
    long_id = "2026-11-26-12-24-59.035+dp1+pp2+tp1+InstructionProfiler+demo-profile-0123abcd"
    text = format_snapshot(snap(job("short", "starting"), job(long_id, "starting")))
    lines = [line for line in text.splitlines() if "starting" in line]
    assert len(lines) == 2 and len({line.index(" 1/1") for line in lines}) == 1, lines


def test_status_says_when_rq_is_suspended():
    held = snap()
    held["rq"]["suspended"] = True
    assert "SUSPENDED (`rq suspend`): no new versions until `rq resume`" in format_snapshot(held)
    assert "SUSPENDED" not in format_snapshot(snap())


def test_a_stalled_job_names_a_few_of_the_ranks_it_waits_on_and_counts_the_rest():
    """Every rank was named: 100,000 silent ranks made a status line of about 600 kB."""
    stalled = job("wide", "stalled", world_size=5000, waiting_on=list(range(3, 5000)))
    text = format_snapshot(snap(stalled))
    assert (
        "stalled: waiting on silent ranks 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, ... and 4,987 more "
        "(4,997 in all)" in text
    ), text[:600]
    assert len(text) < 600, len(text)


def test_a_stalled_job_counts_silent_ranks_and_closed_ones_apart():
    waiting = [*range(20), 40, 41]
    stalled = job("wide", "stalled", world_size=50, waiting_on=waiting, closed_ranks=[40, 41])
    text = format_snapshot(snap(stalled))
    assert (
        "stalled: waiting on silent ranks 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, ... and 10 more "
        "(20 in all) and ranks 40, 41 whose hook closed" in text
    ), text[:600]
    ten = job("ten", "stalled", world_size=10, waiting_on=list(range(10)))
    assert "silent ranks 0, 1, 2, 3, 4, 5, 6, 7, 8, 9\n" in format_snapshot(snap(ten)) + "\n"
