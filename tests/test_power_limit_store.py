"""Power-limit profiles kept across runs: selectors, the Redis store, ranks that disagree, the CLI.

NVML is the in-process fake (tests/fake_nvml_power.py): no real GPU setting is ever written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from click.testing import CliRunner

from protocol import keys
from protocol.exceptions import ConfigError, CoordinatorUnavailableError, ProtocolError
from tests.helpers import subprocess_env
from worker_client.power_limit.cli import power_limit_group
from worker_client.power_limit.optimizer import (
    Energy,
    MaxSlowdownConstraint,
    PowerLimitMeasurement,
    PowerLimitProfile,
    Time,
    ZeusCost,
)
from worker_client.power_limit.profile import save_profile_file
from worker_client.power_limit.store import PowerLimitProfileStore

RESULTS = {300: (10.0, 1000.0), 250: (10.2, 900.0), 200: (11.0, 850.0), 160: (14.0, 950.0)}
MEASUREMENTS = [
    PowerLimitMeasurement(power_limit=pl, time=t, energy=e) for pl, (t, e) in RESULTS.items()
]


@pytest.mark.parametrize(
    ("selector", "expected_limit"),
    [
        (Energy(), 200),
        (Time(), 300),
        (ZeusCost(1.0), 200),  # pure energy
        (ZeusCost(0.0), 300),  # pure time
        (ZeusCost(0.5), 250),  # 0.5*900 + 0.5*300*10.2 = 1980 is the least
        (ZeusCost(0.5, world_size=2), 300),  # time counts double: 3500 < 3510
        (MaxSlowdownConstraint(1.0), 300),
        (MaxSlowdownConstraint(1.1), 200),  # times up to 11.0 s allowed
        (MaxSlowdownConstraint(1.5), 160),
    ],
)
def test_selectors(selector: Any, expected_limit: int) -> None:
    assert selector.select(MEASUREMENTS) == expected_limit


def test_selectors_need_measurements() -> None:
    for selector in (Energy(), Time(), ZeusCost(0.5), MaxSlowdownConstraint(1.1)):
        with pytest.raises(ValueError, match="no power limit measurements"):
            selector.select([])
    with pytest.raises(ValueError, match="finite"):
        PowerLimitMeasurement(power_limit=300, time=float("nan"), energy=1.0)


# --- Redis store --------------------------------------------------------------------------------
def profile(optimal: int = 250) -> PowerLimitProfile:
    return PowerLimitProfile(measurements=MEASUREMENTS, optimal_power_limit=optimal, selector="x")


def test_store_round_trip(r: redis.Redis) -> None:
    store = PowerLimitProfileStore(r)
    assert store.load("bert") is None
    store.save("bert", profile())
    loaded = store.load("bert")
    assert loaded is not None
    assert loaded.measurements == MEASUREMENTS
    assert loaded.optimal_power_limit == 250
    assert loaded.updated_at > 0
    assert r.type(keys.power_limit_profile("bert")) == b"string"
    assert msgpack.unpackb(r.get(keys.power_limit_profile("bert")))["optimal_power_limit"] == 250
    assert r.zscore(keys.POWER_LIMIT_INDEX, "bert") == pytest.approx(loaded.updated_at)

    pipe = r.pipeline(transaction=True)
    store.save("gpt", profile(300), pipeline=pipe)
    assert store.load("gpt") is None  # queued, not run
    pipe.execute()
    summaries = store.list_profiles()
    assert [(s.workload, s.optimal_power_limit, s.num_measurements) for s in summaries] == [
        ("bert", 250, 4),
        ("gpt", 300, 4),
    ]
    assert store.delete("bert") is True
    assert store.delete("bert") is False
    assert store.load("bert") is None
    assert r.zrange(keys.POWER_LIMIT_INDEX, 0, -1) == [b"gpt"]


def test_store_errors(r: redis.Redis) -> None:
    store = PowerLimitProfileStore(r)
    for bad in ("a:b", "", "with space"):
        with pytest.raises(ConfigError, match="workload name"):
            store.save(bad, profile())
    r.set(keys.power_limit_profile("junk"), b"\x00not msgpack")
    r.zadd(keys.POWER_LIMIT_INDEX, {"junk": 1.0})
    with pytest.raises(ProtocolError, match="junk"):
        store.load("junk")
    assert [(s.workload, s.optimal_power_limit) for s in store.list_profiles()] == [("junk", None)]
    down = PowerLimitProfileStore.from_url("redis://127.0.0.1:1/0", timeout=0.5)
    with pytest.raises(CoordinatorUnavailableError):
        down.load("bert")
    with pytest.raises(CoordinatorUnavailableError):
        down.save("bert", profile())


def test_cli_show_and_delete(r: redis.Redis, redis_url: str) -> None:
    store = PowerLimitProfileStore(r)
    runner = CliRunner()
    result = runner.invoke(power_limit_group, ["show", "--redis-url", redis_url])
    assert result.exit_code == 0, result.output
    assert "no power-limit profiles stored" in result.output

    store.save("bert", profile(250))
    store.save("gpt", profile(300))
    result = runner.invoke(power_limit_group, ["show"], env={"PERSEUS_REDIS_URL": redis_url})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["workload", "limit", "(W)", "measurements", "updated"]
    assert lines[2].split()[:3] == ["bert", "250", "4"]
    assert lines[3].split()[:3] == ["gpt", "300", "4"]

    result = runner.invoke(power_limit_group, ["show", "bert", "--redis-url", redis_url])
    assert result.exit_code == 0, result.output
    assert "optimal 250 W" in result.output
    rows = [line.split() for line in result.output.splitlines()[3:]]
    assert rows[1][:4] == ["*", "250", "10.200", "900.0"]
    assert rows[0][:3] == ["300", "10.000", "1000.0"]

    result = runner.invoke(power_limit_group, ["show", "bert", "--json", "--redis-url", redis_url])
    assert json.loads(result.output)["optimal_power_limit"] == 250

    result = runner.invoke(power_limit_group, ["show", "nope", "--redis-url", redis_url])
    assert result.exit_code == 1
    assert "no power-limit profile stored for 'nope'" in result.output

    result = runner.invoke(power_limit_group, ["delete", "bert", "--redis-url", redis_url])
    assert result.exit_code == 0, result.output
    assert store.load("bert") is None
    result = runner.invoke(power_limit_group, ["delete", "bert", "--redis-url", redis_url])
    assert result.exit_code == 1

    result = runner.invoke(power_limit_group, ["show", "--redis-url", "redis://127.0.0.1:1/0"])
    assert result.exit_code == 1
    assert "Redis" in result.output


def test_ranks_that_disagree_on_a_stored_profile_all_profile_again(tmp_path: Path) -> None:
    # Rank 0 finds a profile, rank 1 none (a node's local disk, a Redis store one rank could
    # not reach): rank 0 skipped to Done while rank 1 profiled, so their collectives no longer
    # paired up and rank 1 waited in its next all-reduce for ever.
    save_profile_file(
        PowerLimitProfile(
            measurements=[
                PowerLimitMeasurement(power_limit=pl, time=t, energy=e)
                for pl, (t, e) in RESULTS.items()
            ]
        ),
        tmp_path / "found.json",
    )
    init = tmp_path / "pg"
    root = Path(__file__).resolve().parent.parent
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.power_limit_rank", str(rank), str(init), str(path)],
            cwd=root,
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, path in enumerate([tmp_path / "found.json", tmp_path / "missing.json"])
    ]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
            outputs.append((out, err))
    finally:
        for proc in procs:
            proc.kill()
    # Both profiled every limit (3 of them) and chose the same limit.
    assert [out.split() for out, _ in outputs] == [["Done(250)", "3"], ["Done(250)", "3"]]
    assert "another rank found no power-limit profile" in outputs[0][1]


def test_cli_import_export_zeus_files(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    zeus_file = tmp_path / "zeus.json"
    rows = [{"power_limit": pl, "energy": e, "time": t} for pl, (t, e) in RESULTS.items()]
    zeus_file.write_text(json.dumps({"measurements": rows}, indent=4))
    runner = CliRunner()
    url = ["--redis-url", redis_url]

    result = runner.invoke(power_limit_group, ["show", "--file", str(zeus_file)])
    assert result.exit_code == 0, result.output
    assert "no limit chosen" in result.output
    assert result.output.splitlines()[3].split()[:3] == ["300", "10.000", "1000.0"]

    result = runner.invoke(power_limit_group, ["import", str(zeus_file), "resnet", *url])
    assert result.exit_code == 0, result.output
    stored = PowerLimitProfileStore(r).load("resnet")
    assert stored is not None
    assert stored.measurements == MEASUREMENTS
    assert stored.optimal_power_limit is None
    result = runner.invoke(power_limit_group, ["show", *url])
    # The list said "?" where `show resnet` says "no limit chosen".
    assert result.output.splitlines()[2].split()[:4] == ["resnet", "none", "chosen", "4"]

    out = tmp_path / "out" / "back.json"
    # A missing folder was made without a word, as no cp or shell redirection does.
    result = runner.invoke(power_limit_group, ["export", "resnet", str(out), *url])
    assert result.exit_code == 1
    assert f"cannot write {out}: no folder {out.parent}" in result.output
    assert not out.parent.exists()
    # It named the hidden temporary file (/proc/.back.json.<pid>.<hex>.tmp).
    result = runner.invoke(power_limit_group, ["export", "resnet", "/proc/back.json", *url])
    assert result.exit_code == 1
    assert result.output.startswith("Error: cannot write /proc/back.json: "), result.output
    assert ".tmp" not in result.output
    out.parent.mkdir()
    result = runner.invoke(power_limit_group, ["export", "resnet", str(out), *url])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["measurements"] == rows

    zeus_file.write_text('{"measurements": [{"power_limit": 300, "energy": 1}]}')
    result = runner.invoke(power_limit_group, ["import", str(zeus_file), "resnet", *url])
    assert result.exit_code == 1
    assert f"{zeus_file}: measurements[0].time: Field required" in result.output
    result = runner.invoke(power_limit_group, ["export", "nope", str(out), *url])
    assert result.exit_code == 1
    assert "no power-limit profile stored for 'nope'" in result.output
