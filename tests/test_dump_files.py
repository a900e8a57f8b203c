"""Reading a dump folder back: errors name the file, the item and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from coordinator.cli import main
from coordinator.dump import load_prof, load_ranks, load_sched
from coordinator.tasks import advance_job
from protocol.exceptions import ConfigError
from protocol.store import KEEP_SCHEDULES, JobStore
from tests.helpers import FREQS, SNAPSHOTTING, new_job, report_all


def rank(n: int) -> dict[str, object]:
    return {"rank": n, "dp_rank": 0, "pp_rank": n, "tp_rank": 0, "available_frequencies": FREQS}


def test_reads_each_file_kind(tmp_path: Path) -> None:
    (tmp_path / "ranks.json").write_text(json.dumps([rank(0), rank(1)]))
    schedule = {"rank": 1, "version": 3, "frequencies": [["forward", 1980], ["backward", 1965]]}
    (tmp_path / "3.sched.json").write_text(json.dumps([schedule]))
    result = {"rank": 1, "schedule_version": 2, "iter_time": [0.5], "iter_energy": [100.0]}
    (tmp_path / "2.prof.json").write_text(json.dumps([result]))
    assert [r.pp_rank for r in load_ranks(tmp_path)] == [0, 1]
    assert load_sched(str(tmp_path), 3)[0].frequencies == [("forward", 1980), ("backward", 1965)]
    assert load_prof(tmp_path, 2)[0].iter_energy == [100.0]


def test_errors_name_the_file_item_and_field(tmp_path: Path) -> None:
    path = tmp_path / "ranks.json"
    path.write_text(json.dumps([rank(0), dict(rank(1), pp_rank=-1)]))
    with pytest.raises(ConfigError, match=r"ranks\.json: item 1: invalid RankInfo: pp_rank"):
        load_ranks(tmp_path)
    path.write_text('[\n{"rank": 0,\n')
    with pytest.raises(ConfigError, match=r"ranks\.json: not JSON \(.* at line 3\)"):
        load_ranks(tmp_path)
    path.write_text(json.dumps(rank(0)))
    with pytest.raises(ConfigError, match=r"ranks\.json: expected a JSON list of RankInfo"):
        load_ranks(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"7\.sched\.json"):
        load_sched(tmp_path, 7)


def test_a_dump_past_the_kept_versions_says_which_files_it_lacks_and_why(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    # Redis keeps the newest KEEP_SCHEDULES schedules, and a snapshot deletes the results it
    # consumed: the dump had no 1.sched.json or 1.prof.json and did not say so.
    store = JobStore(r)
    new_job(store, "long", SNAPSHOTTING)
    advance_job("long", conn=r, snapshot_every=2)
    latest = KEEP_SCHEDULES + 6
    while store.version("long") < latest:
        report_all(store, "long")
        advance_job("long", conn=r, snapshot_every=2)
    result = CliRunner().invoke(
        main, ["dump", "long", "--out", str(tmp_path), "--redis-url", redis_url]
    )
    assert result.exit_code == 0, result.output
    folder = tmp_path / "long"
    kept = range(latest - KEEP_SCHEDULES + 1, latest + 1)
    assert sorted(int(p.name.split(".")[0]) for p in folder.glob("*.sched.json")) == list(kept)
    gone_sched = [v for v in range(1, latest + 1) if v not in kept]
    gone_prof = [v for v in range(1, latest) if not (folder / f"{v}.prof.json").exists()]
    assert gone_prof  # the snapshots consumed some
    missing = json.loads((folder / "job.json").read_text())["missing"]
    assert missing["sched.json"] == gone_sched
    assert missing["prof.json"] == gone_prof
    said = " ".join(result.output.split())
    assert f"no {gone_sched[0]}.sched.json to {gone_sched[-1]}.sched.json" in said, said
    assert f"newest {KEEP_SCHEDULES}" in said, said
    assert f"no {gone_prof[0]}.prof.json" in said and "snapshot" in said, said
    assert "summaries.json" in said, said
    # A job whose files are all there says nothing of the kind.
    new_job(store, "short", SNAPSHOTTING)
    advance_job("short", conn=r)
    result = CliRunner().invoke(
        main, ["dump", "short", "--out", str(tmp_path), "--redis-url", redis_url]
    )
    assert result.exit_code == 0 and " no " not in result.output, result.output
    assert json.loads((tmp_path / "short" / "job.json").read_text())["missing"] == {}
