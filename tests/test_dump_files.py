"""Reading a dump folder back: errors name the file, the item and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.dump import load_prof, load_ranks, load_sched
from protocol.exceptions import ConfigError
from tests.helpers import FREQS


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
