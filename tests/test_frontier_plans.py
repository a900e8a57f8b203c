"""Plan files written from cached lines, ``plans.delta``, ``--plans chosen`` and plans on demand.

Every plan the fast writer produces must be exactly what :func:`write_plan_file` writes for the
same content (so :func:`read_plan_file` reads it back unchanged); a plan rebuilt from
``plans.delta`` must be byte for byte the file a full run writes; ``FrontierScheduler`` must
serve the same plans from a profile (planned in memory) as from a planner folder.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from coordinator.tasks import LIVE, advance_job
from protocol.exceptions import ConfigError
from protocol.models import JobConfig, JobInfo, RankInfo
from protocol.store import JobStore
from schedulers.frontier import FrontierScheduler
from schedulers.planning.choose import choose_plan, select_point
from schedulers.planning.cli import choose_command
from schedulers.planning.frontier_files import Frontier, FrontierPoint, load_frontier
from schedulers.planning.frontier_plans import PLAN_LOG, ensure_plan_file, plan_from_log
from schedulers.planning.plan_file import read_plan_file, write_plan_file
from schedulers.planning.planner import plan_frontier
from schedulers.planning.synthetic_profile import synthetic_profile, write_synthetic_profile
from tests.helpers import result
from worker_client.simulated.gpu import GRAPHICS_CLOCKS

STAGES, MICRO, UNIT = 3, 4, 0.002


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """The same profile planned twice: every plan file, and only the chosen ones."""
    base = tmp_path_factory.mktemp("plans")
    profile = write_synthetic_profile(base / "profile.csv", STAGES, stride=6, jitter=0.02)
    prof = synthetic_profile(STAGES, stride=6, jitter=0.02)
    full, chosen = base / "all", base / "chosen"
    plan_frontier(prof, STAGES, MICRO, out_dir=full, unit_time=UNIT, p2p_power=30.0)
    plan_frontier(
        prof, STAGES, MICRO, out_dir=chosen, unit_time=UNIT, p2p_power=30.0, plans="chosen"
    )
    return profile, full, chosen


def test_fast_writer_matches_write_plan_file(folders, tmp_path: Path) -> None:
    _, full, _ = folders
    fr = load_frontier(full)
    assert len(fr.points) > 20
    for point in fr.points[:: len(fr.points) // 7]:
        path = fr.path(point)
        plan = read_plan_file(path)
        write_plan_file(tmp_path / "ref.py", plan.stages, plan.header, plan.notes)
        assert path.read_text() == (tmp_path / "ref.py").read_text()
        assert plan.header["plan"] == point.plan
        assert float(plan.header["energy_with_p2p"]) == point.energy_with_p2p


def test_chosen_writes_two_plans_and_the_log_rebuilds_the_others(folders) -> None:
    _, full, chosen = folders
    fr_full, fr_chosen = load_frontier(full), load_frontier(chosen)
    assert [p.plan for p in fr_full.points] == [p.plan for p in fr_chosen.points]
    assert (full / "frontier.csv").read_text() == (chosen / "frontier.csv").read_text()
    written = sorted(p.name for p in chosen.glob("freqs_pipeline_*.py"))
    expected = sorted(
        {select_point(fr_chosen, policy)[0].file for policy in ("no-slowdown", "min-energy")}
    )
    assert written == expected and fr_chosen.meta["plan_files"] == "chosen"
    for point in fr_full.points:
        rebuilt = plan_from_log(fr_chosen, point)
        original = read_plan_file(fr_full.path(point))
        assert rebuilt.stages == original.stages and rebuilt.header == original.header
    point = fr_chosen.points[len(fr_chosen.points) // 3]
    assert not fr_chosen.path(point).exists()
    path = ensure_plan_file(fr_chosen, point)
    assert path.read_bytes() == fr_full.path(point).read_bytes()


def test_perseus_choose_writes_the_plan_it_picks(folders) -> None:
    import click

    from schedulers.planning.cli import choose_command

    _, full, chosen = folders
    fr = load_frontier(chosen)
    target = fr.points[len(fr.points) // 2]
    assert not fr.path(target).exists()
    group = click.Group(commands={"choose": choose_command})
    res = CliRunner().invoke(
        group, ["choose", str(chosen), "--policy", f"deadline {target.iteration_time}"]
    )
    assert res.exit_code == 0, res.output
    picked = choose_plan(chosen, "deadline", target.iteration_time)
    assert picked.file.is_file() and str(picked.file) in res.output
    assert picked.file.read_bytes() == (full / picked.file.name).read_bytes()


def test_bad_plan_log_names_file_and_line(folders, tmp_path: Path) -> None:
    _, _, chosen = folders
    fr = load_frontier(chosen)
    lines = (chosen / PLAN_LOG).read_text().splitlines()
    for k, bad in [(4, "00001 7:x"), (4, "00001 999:1980"), (4, "00002"), (3, "00000 1980")]:
        broken = tmp_path / f"broken{k}"
        broken.mkdir(exist_ok=True)
        for name in ("frontier.csv", "allmax.csv", "frontier.json"):
            (broken / name).write_bytes((chosen / name).read_bytes())
        (broken / PLAN_LOG).write_text("\n".join([*lines[:k], bad, *lines[k + 1 :]]) + "\n")
        with pytest.raises(ConfigError, match=rf"{PLAN_LOG}:{k + 1}: "):
            plan_from_log(load_frontier(broken), fr.points[-1])
    (broken / PLAN_LOG).unlink()
    with pytest.raises(ConfigError, match=r"no plans\.delta"):
        ensure_plan_file(load_frontier(broken), fr.points[1])
    (broken / "frontier.json").unlink()
    with pytest.raises(ConfigError, match=r"frontier\.json: missing num_stages"):
        plan_from_log(load_frontier(broken), fr.points[1])


def _job(pp: int) -> tuple[JobInfo, list[RankInfo]]:
    job = JobInfo(job_id="j", pp_degree=pp, dp_degree=1, tp_degree=1, world_size=pp)
    ranks = [
        RankInfo(
            rank=r, dp_rank=0, pp_rank=r, tp_rank=0, available_frequencies=list(GRAPHICS_CLOCKS)
        )
        for r in range(pp)
    ]
    return job, ranks


def test_frontier_scheduler_from_profile_serves_the_folders_plans(folders) -> None:
    profile, full, chosen = folders
    job, ranks = _job(STAGES)
    from_profile = FrontierScheduler(
        job, ranks, profile=str(profile), microbatches=MICRO, unit_time=UNIT, p2p_power=30.0
    )
    from_folder = FrontierScheduler(job, ranks, frontier_dir=str(full))
    from_log = FrontierScheduler(job, ranks, frontier_dir=str(chosen))
    fr = load_frontier(full)
    assert from_profile.current == from_folder.current == from_log.current
    for target in (fr.points[5].iteration_time, fr.points[-8].iteration_time, 100.0):
        for sched in (from_profile, from_folder, from_log):
            sched.set_target(target)
        assert from_profile.current.plan == select_point(fr, "straggler", target)[0].plan
        assert from_profile.next_schedule() == from_folder.next_schedule()
        assert from_log.next_schedule() == from_folder.next_schedule()
    with pytest.raises(ConfigError, match="exactly one"):
        FrontierScheduler(job, ranks)
    with pytest.raises(ConfigError, match="microbatches"):
        FrontierScheduler(job, ranks, profile=str(profile))
    FrontierScheduler.check_files({"frontier_dir": str(chosen), "policy": "min-energy"})
    FrontierScheduler.check_files({"profile": str(profile), "microbatches": MICRO})


def test_a_target_no_plan_meets_gets_the_fastest_plan_and_a_warning(folders, caplog) -> None:
    _profile, full, _chosen = folders
    job, ranks = _job(STAGES)
    sched = FrontierScheduler(job, ranks, frontier_dir=str(full))
    fastest = min(load_frontier(full).pareto, key=lambda p: p.iteration_time)
    with caplog.at_level(logging.WARNING, logger="schedulers.frontier"):
        sched.set_target(fastest.iteration_time / 10)
    assert sched.current.plan == fastest.plan
    assert "faster than every plan" in caplog.text and fastest.plan in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="schedulers.frontier"):
        sched.set_target(fastest.iteration_time * 10)  # one that some plan meets: no warning
    assert caplog.text == ""


def _copy_chosen(tmp_path: Path, edit_csv: Callable[[list[str]], list[str]] | None = None) -> Path:
    """A planner folder of chosen plans only; ``edit_csv`` rewrites frontier.csv's lines."""
    out = tmp_path / "out"
    plan_frontier(
        synthetic_profile(2, stride=12), 2, 2, out_dir=out, unit_time=0.002, plans="chosen"
    )
    if edit_csv is not None:
        lines = (out / "frontier.csv").read_text().splitlines()
        (out / "frontier.csv").write_text("\n".join(edit_csv(lines)) + "\n")
    return out


def _missing(fr: Frontier) -> FrontierPoint:
    """A point of the frontier whose plan file is not written (a chosen-only folder has some)."""
    return next(p for p in fr.points if not fr.path(p).exists())


@pytest.mark.parametrize(
    ("name", "content", "words"),
    [
        ("frontier.csv", b"\xff\xfeplan,iteration_time", "frontier.csv: not UTF-8 text"),
        ("frontier.json", b"\xff\xfe{}", "frontier.json: not UTF-8 text"),
        ("frontier.json", b"[1, 2]", "frontier.json: expected a JSON object"),
        ("frontier.json", b"[" * 100_000, "frontier.json: invalid JSON: nested too deeply"),
    ],
)
def test_a_frontier_folder_file_that_is_no_text_or_no_object_names_the_file(
    tmp_path: Path, name: str, content: bytes, words: str
) -> None:
    """These ended `perseus choose` and the coordinator's start check with a traceback."""
    out = _copy_chosen(tmp_path)
    (out / name).write_bytes(content)
    with pytest.raises(ConfigError, match=words):
        load_frontier(out)
    with pytest.raises(ConfigError, match=words):
        FrontierScheduler.check_files({"frontier_dir": str(out)})


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("num_stages", "2", "frontier.json: num_stages must be a whole number >= 1, got '2'"),
        ("num_microbatches", True, "num_microbatches must be a whole number >= 1, got True"),
        ("unit_time", float("nan"), "frontier.json: unit_time must be a number, got nan"),
        ("p2p_power", -1.0, "p2p_power must be finite and >= 0, got -1.0"),
        # A billion stages laid out the pipeline until memory ran out.
        ("num_stages", 10**9, "plans.delta:2: num_stages is '2' but .* says '1000000000'"),
        ("num_microbatches", 3, "plans.delta:3: num_microbatches is '2' but"),
    ],
)
def test_frontier_json_parameters_are_checked_before_a_plan_is_rebuilt(
    tmp_path: Path, key: str, value: object, words: str
) -> None:
    out = _copy_chosen(tmp_path)
    meta = json.loads((out / "frontier.json").read_text())
    meta[key] = value
    (out / "frontier.json").write_text(json.dumps(meta))
    fr = load_frontier(out)
    missing = _missing(fr)
    with pytest.raises(ConfigError, match=words):
        plan_from_log(fr, missing)
    assert not fr.path(missing).exists()


@pytest.mark.parametrize("name", ["frontier.json", PLAN_LOG, "frontier.csv", "allmax.csv"])
def test_a_folder_in_a_planner_file_s_place_is_named_as_one(tmp_path: Path, name: str) -> None:
    # is_file() took it for a missing file: frontier.json's parameters "missing", "no
    # plans.delta to rebuild it from", "not a planner output folder".
    out = _copy_chosen(tmp_path)
    fr = load_frontier(out)
    missing = _missing(fr)
    (out / name).unlink()
    (out / name).mkdir()
    with pytest.raises(ConfigError, match=rf"{name}: is a folder, where perseus optimize writes"):
        ensure_plan_file(load_frontier(out), missing)
    assert not fr.path(missing).exists()


@pytest.mark.parametrize("name", ["frontier.json", PLAN_LOG])
def test_a_byte_order_mark_before_a_planner_file_is_read_past(tmp_path: Path, name: str) -> None:
    # An editor's BOM made plans.delta "not a perseus-mq plan log" (frontier.json: "invalid
    # JSON: Unexpected UTF-8 BOM"); frontier.csv was already read past one.
    out = _copy_chosen(tmp_path)
    fr = load_frontier(out)
    missing = _missing(fr)
    want = plan_from_log(fr, missing)
    (out / name).write_bytes(b"\xef\xbb\xbf" + (out / name).read_bytes())
    assert ensure_plan_file(load_frontier(out), missing) == fr.path(missing)
    got = read_plan_file(fr.path(missing))
    assert (got.stages, got.header) == (want.stages, want.header)


def test_a_plan_log_that_is_no_text_names_the_file(tmp_path: Path) -> None:
    out = _copy_chosen(tmp_path)
    log = out / PLAN_LOG
    log.write_bytes(log.read_bytes()[:200] + b"\xff\xfe\n")
    fr = load_frontier(out)
    with pytest.raises(ConfigError, match=r"plans\.delta: not UTF-8 text"):
        plan_from_log(fr, fr.points[-2])


@pytest.mark.parametrize(
    ("row", "words"),
    [
        # `perseus choose` wrote the missing plan file where the column pointed: outside DIR.
        ("00001,0.2,1.0,1.0,100,1.0,0,../../x.py", "field 'file': expected 'freqs_pipeline_0"),
        ("00001,0.2,1.0,1.0,100,1.0,0,/tmp/x.py", "field 'file': expected 'freqs_pipeline_00001"),
        # A negative time was chosen as the no-slowdown plan ("iteration time: -1.0000 s").
        ("00001,-1,1.0,1.0,100,1.0,0,freqs_pipeline_00001.py", "field 'iteration_time': negative"),
        ("00001,0.2,-1.0,1.0,100,1.0,0,freqs_pipeline_00001.py", "field 'energy': negative"),
        # Two rows for one plan were read without a word (which one counts?).
        (
            "00000,0.2,1.0,1.0,100,1.0,0,freqs_pipeline_00000.py",
            "field 'plan': plan 00000 again \\(first at line 2\\)",
        ),
    ],
)
def test_a_frontier_csv_row_out_of_place_names_line_and_field(
    tmp_path: Path, row: str, words: str
) -> None:
    out = _copy_chosen(tmp_path, lambda lines: [*lines[:2], row, *lines[3:]])
    with pytest.raises(ConfigError, match=f"frontier.csv:3: {words}"):
        load_frontier(out)
    res = CliRunner().invoke(choose_command, [str(out), "--policy", "deadline 0.3"])
    assert res.exit_code == 1 and "frontier.csv:3: field" in res.output, res.output


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        # A cell past the header was dropped unsaid (which column moved?).
        (lambda lines: [*lines[:2], lines[2] + ",9", *lines[3:]], "frontier.csv:3: expected 8 "),
        (lambda lines: [*lines[:2], lines[2].rsplit(",", 1)[0], *lines[3:]], "got 7"),
        # After a blank line every line was numbered one short.
        (
            lambda lines: [*lines[:2], "", "x" + lines[2], *lines[3:]],
            "frontier.csv:4: field 'plan': expected a plan number, got 'x00001'",
        ),
    ],
)
def test_a_frontier_csv_row_of_the_wrong_width_or_after_a_blank_names_its_line(
    tmp_path: Path, edit: Any, words: str
) -> None:
    out = _copy_chosen(tmp_path, edit)
    with pytest.raises(ConfigError) as info:
        load_frontier(out)
    assert words in str(info.value)


def test_a_frontier_csv_saved_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    # A spreadsheet's "CSV UTF-8": the header's "plan" was "\ufeffplan", reported missing.
    out = _copy_chosen(tmp_path)
    path = out / "frontier.csv"
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert load_frontier(out).points


def test_choose_refuses_to_name_a_plan_file_that_does_not_parse(tmp_path: Path) -> None:
    # It printed "file: .../freqs_pipeline_N.py" and exit 0; the coordinator refused it later.
    out = _copy_chosen(tmp_path)
    chosen = choose_plan(load_frontier(out), "no-slowdown")
    chosen.file.write_text("[[")
    res = CliRunner().invoke(choose_command, [str(out), "--policy", "no-slowdown"])
    assert res.exit_code == 1, res.output
    assert f"{chosen.file}:1: syntax error" in res.output


def test_choose_names_a_folder_in_the_plan_file_s_place(tmp_path: Path) -> None:
    # The rebuild from plans.delta failed naming its temporary file, and left it there.
    out = _copy_chosen(tmp_path)
    point = select_point(load_frontier(out), "deadline", 10.0)[0]
    path = out / point.file
    path.unlink(missing_ok=True)
    path.mkdir()
    res = CliRunner().invoke(choose_command, [str(out), "--policy", "deadline 10"])
    assert res.exit_code == 1, res.output
    assert f"{path}: not a file" in res.output
    assert not list(out.glob(".*.tmp"))


def _profile_job(store: JobStore, job_id: str, profile: Path, **extra: float) -> None:
    """A FrontierScheduler job planning from ``profile``, its ranks registered in the store."""
    job, ranks = _job(STAGES)
    job = job.model_copy(update={"job_id": job_id})
    args = {"profile": str(profile), "microbatches": MICRO, "unit_time": UNIT, **extra}
    store.create_job(job, JobConfig(scheduler="FrontierScheduler", scheduler_args=args), job_id)
    for rank in ranks:
        store.add_rank(job, rank, token=f"token-{rank.rank}")


def test_a_profile_planned_without_p2p_power_is_logged_once_on_the_worker(
    folders, r, caplog
) -> None:
    """0 W of P2P power makes waiting free: `perseus optimize` warned, the worker did not."""
    profile, _, _ = folders
    store = JobStore(r)
    _profile_job(store, "no-p2p", profile)
    _profile_job(store, "with-p2p", profile, p2p_power=0.0)  # said so: no warning
    LIVE.clear()
    try:
        with caplog.at_level(logging.WARNING, logger="schedulers.frontier"):
            assert advance_job("no-p2p", conn=r) == [1]
            assert advance_job("with-p2p", conn=r) == [1]
            info = store.get_job("no-p2p").info
            for rank in range(STAGES):
                store.add_result(info, result(rank, 1))
            LIVE.clear()  # a --fork worker: rebuilt, version 1 replayed, the results observed
            assert advance_job("no-p2p", conn=r) == []
    finally:
        LIVE.clear()
    notes = [rec.getMessage() for rec in caplog.records if "p2p_power" in rec.getMessage()]
    assert notes == [
        "job no-p2p: FrontierScheduler's p2p_power not given: planning with 0 W while a GPU "
        "waits on its neighbour stage, so waiting counts as free and slower plans look cheaper "
        "than they are (Zeus's example assumed 70 W); measure it with `perseus profile-p2p`"
    ]
