"""Power-limit profile files and selector arguments as a Zeus user hands them over.

Corrupt files, file permissions, selector arguments of the wrong type and the CLI's file
errors; the GPUs are the in-process fake NVML (tests/fake_nvml_power.py).
"""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from click.testing import CliRunner

from protocol.exceptions import ConfigError, ProtocolError
from tests import fake_nvml_power as fake
from tests.fake_nvml_power import ReplayMonitor, ReplayTraining, run_steps
from worker_client.power_limit.cli import power_limit_group
from worker_client.power_limit.optimizer import (
    Done,
    GlobalPowerLimitOptimizer,
    MaxSlowdownConstraint,
    PowerLimitMeasurement,
    PowerLimitProfile,
    ZeusCost,
)
from worker_client.power_limit.profile import (
    load_profile_file,
    save_profile_file,
)
from worker_client.power_limit.selectors import Energy
from worker_client.power_limit.store import MAX_PLAUSIBLE_POWER_LIMIT_W, PowerLimitProfileStore

TABLE = {300: (0.100, 280.0), 250: (0.104, 245.0), 200: (0.115, 198.0)}
# Measurements (limit W, time s, energy J) where the selectors disagree.
MEASURED = [
    PowerLimitMeasurement(power_limit=pl, time=t, energy=e)
    for pl, t, e in ((300, 10.0, 1000.0), (250, 10.2, 900.0), (200, 11.0, 850.0))
]


@pytest.fixture
def training() -> ReplayTraining:
    fake.reset(num_gpus=1, min_limit_mw=200_000, max_limit_mw=300_000)
    return ReplayTraining(TABLE, [0])


def make(training: ReplayTraining, **kwargs: Any) -> GlobalPowerLimitOptimizer:
    args: dict[str, Any] = dict(wait_steps=0, warmup_steps=1, profile_steps=2, pl_step=50)
    args.update(kwargs)
    args.setdefault("restore_on_exit", False)
    return GlobalPowerLimitOptimizer(ReplayMonitor(training), **args)


@pytest.mark.parametrize(
    "content",
    [
        b"\x1f\x8b\x08\x00\x00\x00\x00\x00",  # a gzipped file where the JSON was expected
        b"\x80\x81 not text",
        b"\xff\xfe\x00",  # looks like UTF-16, then is cut short
    ],
)
def test_a_profile_file_that_is_not_text_is_a_config_error_naming_it(
    training: ReplayTraining, tmp_path: Path, content: bytes
) -> None:
    path = tmp_path / "profile.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match="not JSON text") as info:
        load_profile_file(path)
    assert str(path) in str(info.value)
    with pytest.raises(ConfigError, match=str(path)):
        make(training, profile_path=path)
    result = CliRunner().invoke(power_limit_group, ["show", "--file", str(path)])
    assert result.exit_code == 1 and "not JSON text" in result.output, result.output


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_the_profile_file_gets_the_permissions_the_umask_gives(
    training: ReplayTraining, tmp_path: Path, umask: int
) -> None:
    # Training runs as root (power limits need it); the file must stay readable to others
    # (perseus power-limit show --file, a Zeus run), as the file Zeus's open() writes is.
    path = tmp_path / "profile.json"
    old = os.umask(umask)
    try:
        opt = make(training, profile_path=path)
        run_steps(opt, training, 12)
        assert isinstance(opt.state, Done)
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
        path.chmod(0o600)  # a rewrite (e.g. perseus power-limit export) gives it the same
        profile = load_profile_file(path)
        save_profile_file(profile, path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    finally:
        os.umask(old)
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]  # no temporary file left


def test_a_profile_file_that_cannot_be_written_is_named_not_its_temporary_file(
    tmp_path: Path,
) -> None:
    # The error named /proc/.profile.json.<pid>.<hex>.tmp, a file the user never named.
    profile = PowerLimitProfile(measurements=MEASURED)
    with pytest.raises(OSError) as info:
        save_profile_file(profile, "/proc/profile.json")
    assert info.value.filename == "/proc/profile.json", info.value
    missing = tmp_path / "no" / "profile.json"
    with pytest.raises(OSError) as info:
        save_profile_file(profile, missing, make_folders=False)
    assert info.value.filename == str(missing) and not missing.parent.exists()
    save_profile_file(profile, missing)  # a rank's default: the folders are made
    assert load_profile_file(missing).measurements == MEASURED


def test_selector_arguments_of_the_wrong_type_are_config_errors_naming_them() -> None:
    # A NaN world size made every cost NaN: ZeusCost then kept the first (maximum) limit.
    for bad in (float("nan"), 1.5, 2.0, True, "2", None):
        with pytest.raises(ConfigError, match="world_size must be an integer >= 1"):
            ZeusCost(0.5, world_size=bad)  # type: ignore[arg-type]
    for bad in ("0.5", None, True, [0.5]):  # a string from a config file, an unset option
        with pytest.raises(ConfigError, match=r"eta_knob must be a number in \[0, 1\]"):
            ZeusCost(bad)  # type: ignore[arg-type]
    for bad in ("1.1", None, True):
        with pytest.raises(ConfigError, match=r"factor .* must be a number, at least 1\.0"):
            MaxSlowdownConstraint(bad)  # type: ignore[arg-type]
    # What a user passes from numpy or an integer knob is fine.
    assert ZeusCost(np.float32(0.5), world_size=np.int64(1)).select(MEASURED) == 250
    assert ZeusCost(1, world_size=1).select(MEASURED) == 200
    assert MaxSlowdownConstraint(np.float64(1.1)).select(MEASURED) == 200
    assert MaxSlowdownConstraint(2).select(MEASURED) == 200


def test_export_to_a_path_that_cannot_be_written_is_a_clean_cli_error(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    PowerLimitProfileStore(r).save("bert", PowerLimitProfile(measurements=MEASURED))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = blocker / "profile.json"  # its folder is a file
    result = CliRunner().invoke(
        power_limit_group, ["export", "bert", str(out), "--redis-url", redis_url]
    )
    assert result.exit_code == 1, result.output
    assert f"cannot write {out}" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize(
    ("content", "named"),
    [
        (
            '{"measurements": [{"power_limit": 300, "energy": 1.0, "time": 1.0}], '
            '"optimal_power_limit": 99999999999999999999999}',
            "optimal_power_limit: Input should be less than or equal to 4294967",
        ),
        (
            '{"measurements": [{"power_limit": 18446744073709551616, "energy": 1, "time": 1}]}',
            "measurements[0].power_limit: Input should be less than or equal to 4294967",
        ),
        ("[" * 100_000, "not JSON (nested too deeply)"),
    ],
    ids=["optimal limit past 64 bits", "measured limit past 64 bits", "deep nesting"],
)
def test_import_of_a_profile_redis_cannot_hold_is_a_clean_error_naming_the_field(
    r: redis.Redis, redis_url: str, tmp_path: Path, content: str, named: str
) -> None:
    """Such files passed validation and ended `perseus power-limit import` with a traceback
    (msgpack's OverflowError packing for Redis; json's RecursionError)."""
    path = tmp_path / "zeus.json"
    path.write_text(content)
    result = CliRunner().invoke(
        power_limit_group, ["import", str(path), "bert", "--redis-url", redis_url]
    )
    assert result.exit_code == 1, result.output
    assert f"bad power-limit profile {path}: {named}" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert PowerLimitProfileStore(r).load("bert") is None


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (
            '"power_limit": true',
            "measurements[0].power_limit: Input should be a valid integer (got true)",
        ),
        (
            '"power_limit": "250"',
            'measurements[0].power_limit: Input should be a valid integer (got "250")',
        ),
        ('"energy": false', "measurements[0].energy: Input should be a valid number (got false)"),
        ('"time": "1.5"', 'measurements[0].time: Input should be a valid number (got "1.5")'),
    ],
    ids=["limit true", "limit string", "energy false", "time string"],
)
def test_a_boolean_or_string_for_a_number_in_a_profile_file_is_refused_naming_it(
    r: redis.Redis, redis_url: str, tmp_path: Path, fields: str, named: str
) -> None:
    """`"power_limit": true` was read as a 1 W limit (pydantic's lax mode turns true into 1)."""
    measurement = {"power_limit": "250", "energy": "900.0", "time": "10.0"}  # JSON texts
    name, value = fields.split(": ")
    measurement[name.strip('"')] = value
    inner = ", ".join(f'"{k}": {v}' for k, v in measurement.items())
    path = tmp_path / "zeus.json"
    path.write_text(f'{{"measurements": [{{{inner}}}]}}')
    with pytest.raises(ConfigError) as info:
        load_profile_file(path)
    assert str(info.value) == f"bad power-limit profile {path}: {named}"
    result = CliRunner().invoke(
        power_limit_group, ["import", str(path), "bert", "--redis-url", redis_url]
    )
    assert result.exit_code == 1 and named in result.output, result.output
    assert PowerLimitProfileStore(r).load("bert") is None


def test_a_limit_written_as_a_whole_float_is_that_limit(
    training: ReplayTraining, tmp_path: Path
) -> None:
    """`"power_limit": 300.0` (hand-edited, another tool's writer) is 300 W, as Zeus reads it."""
    path = tmp_path / "edited.json"
    path.write_text(
        '{"measurements": [{"power_limit": 300.0, "energy": 1000.0, "time": 10.0}, '
        '{"power_limit": 2.5e2, "energy": 900.0, "time": 10.2}], "optimal_power_limit": 250.0}'
    )
    profile = load_profile_file(path)
    assert [m.power_limit for m in profile.measurements] == [300, 250]
    assert all(type(m.power_limit) is int for m in profile.measurements)
    assert profile.optimal_power_limit == 250 and type(profile.optimal_power_limit) is int
    opt = make(training, profile_path=path, optimum_selector=MaxSlowdownConstraint(1.05))
    assert opt.state == Done(optimal_power_limit=250_000)
    assert training.step_limits == []  # no profiling
    for written, named in (
        ("300.5", "measurements[0].power_limit: Input should be a valid integer (got 300.5)"),
        ("-0.0", "measurements[0].power_limit: Input should be greater than or equal to 1"),
    ):
        path.write_text(
            f'{{"measurements": [{{"power_limit": {written}, "energy": 1.0, "time": 1.0}}]}}'
        )
        with pytest.raises(ConfigError) as info:
            load_profile_file(path)
        assert str(info.value) == f"bad power-limit profile {path}: {named}"
    path.write_text(
        '{"measurements": [{"power_limit": 300, "energy": 1.0, "time": 1.0}], '
        '"optimal_power_limit": 300.5}'
    )
    with pytest.raises(ConfigError, match=r": optimal_power_limit: .*valid integer \(got 300.5\)"):
        load_profile_file(path)


@pytest.mark.parametrize("updated_at", ["NaN", "Infinity", "1e400", "-5", "true"])
def test_a_profile_file_with_an_impossible_time_of_update_is_refused(
    tmp_path: Path, updated_at: str
) -> None:
    path = tmp_path / "zeus.json"
    path.write_text(
        '{"measurements": [{"power_limit": 250, "energy": 900.0, "time": 10}], '
        f'"updated_at": {updated_at}}}'
    )
    with pytest.raises(ConfigError, match=rf"^bad power-limit profile {path}: updated_at: "):
        load_profile_file(path)
    path.write_text(
        '{"measurements": [{"power_limit": 250, "energy": 900, "time": 10}], "updated_at": 1}'
    )
    assert load_profile_file(path).measurements[0].energy == 900.0  # JSON integers are numbers


def test_a_workload_name_with_a_trailing_line_break_is_refused():
    # ``$`` also matches before a final line break: "bert\n" became part of a key name.
    from worker_client.power_limit.store import check_workload

    assert check_workload("bert") == "bert"
    with pytest.raises(ConfigError, match="workload name"):
        check_workload("bert\n")


def test_a_profile_file_that_cannot_be_written_after_profiling_is_a_warning(
    training: ReplayTraining, r: redis.Redis, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Training goes on at the optimum and Redis still gets the profile.

    The OSError (disk full, a read-only mount, here a folder that took the file's name) ended
    training with a traceback once every limit was measured, before Redis got the profile.
    """
    path = tmp_path / "profile.json"
    store = PowerLimitProfileStore(r)
    opt = make(training, profile_path=path, profile_store=store, workload="bert")
    path.mkdir()
    with caplog.at_level("WARNING", logger="worker_client.power_limit"):
        run_steps(opt, training, 12)
    assert opt.state == Done(optimal_power_limit=250_000)
    assert fake.STATE.gpus[0].limit_mw == 250_000
    assert training.step_limits[-1] == 250  # training went on at the optimum
    warned = [rec.getMessage() for rec in caplog.records if rec.levelname == "WARNING"]
    assert len(warned) == 1 and f"cannot write the power-limit profile {path}: " in warned[0]
    stored = store.load("bert")
    assert stored is not None and stored.measurements == opt.measurements
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


class _BrokenSelector:
    """A user's selector with a bug."""

    def select(self, measurements: Any) -> int:
        raise ZeroDivisionError("a bug in the user's selector")


def test_a_selector_that_fails_after_profiling_loses_no_measurement(
    training: ReplayTraining, r: redis.Redis, tmp_path: Path
) -> None:
    """Its error is raised, and every limit's measurement is kept, in the file and in Redis.

    They were lost with the error: the next run profiled every limit again.
    """
    path = tmp_path / "profile.json"
    store = PowerLimitProfileStore(r)
    opt = make(
        training,
        optimum_selector=_BrokenSelector(),
        profile_path=path,
        profile_store=store,
        workload="bert",
    )
    with pytest.raises(ZeroDivisionError, match="a bug in the user's selector"):
        run_steps(opt, training, 12)
    measured = load_profile_file(path)
    assert measured.measurements == opt.measurements and len(measured.measurements) == 3
    assert measured.optimal_power_limit is None
    stored = store.load("bert")
    assert stored is not None and stored.measurements == opt.measurements
    # With the selector mended, the next start chooses from the file without profiling again.
    again = make(training, optimum_selector=ZeusCost(eta_knob=0.5), profile_path=path)
    assert again.state == Done(optimal_power_limit=250_000)


def test_an_update_time_past_year_9999_is_refused_naming_it(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """`"updated_at": 1e300` was imported, then `perseus power-limit show` (the list and the
    profile) ended with a traceback: datetime's OverflowError formatting the time."""
    path = tmp_path / "zeus.json"
    path.write_text(
        '{"measurements": [{"power_limit": 300, "energy": 1, "time": 1}], "updated_at": 1e300}'
    )
    runner = CliRunner()
    result = runner.invoke(
        power_limit_group, ["import", str(path), "bert", "--redis-url", redis_url]
    )
    assert result.exit_code == 1, result.output
    assert f"bad power-limit profile {path}: updated_at: Input should be less than" in (
        result.output
    )
    assert PowerLimitProfileStore(r).load("bert") is None
    result = runner.invoke(power_limit_group, ["show", "--file", str(path)])
    assert result.exit_code == 1 and "updated_at" in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_show_lists_a_stored_profile_whose_time_is_out_of_range(
    r: redis.Redis, redis_url: str
) -> None:
    """A workload indexed at a time datetime cannot show (stored before updated_at had a
    bound) made `perseus power-limit show` fail for every workload with a traceback."""
    PowerLimitProfileStore(r).save("bert", PowerLimitProfile(measurements=MEASURED[:1]))
    r.zadd("perseus:powerlimit:index", {"bert": 1e300})
    result = CliRunner().invoke(power_limit_group, ["show", "--redis-url", redis_url])
    assert result.exit_code == 0, result.output
    assert "bert" in result.output and "out of range" in result.output


def test_a_profile_file_that_names_a_key_twice_is_refused_naming_it(tmp_path: Path) -> None:
    # json keeps the last of the two: the 300 W measurement vanished without a word.
    path = tmp_path / "profile.json"
    rows = [f'[{{"power_limit": {w}, "energy": 1, "time": 1}}]' for w in (300, 200)]
    path.write_text(f'{{"measurements": {rows[0]}, "measurements": {rows[1]}}}')
    with pytest.raises(ConfigError, match="'measurements' is given twice") as info:
        load_profile_file(path)
    assert str(path) in str(info.value)


def test_a_profile_that_measures_one_limit_twice_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    rows = [{"power_limit": 300, "energy": e, "time": 1} for e in (1, 2)]
    path.write_text(json.dumps({"measurements": rows}))
    with pytest.raises(
        ConfigError, match=r"measurements\[1\]: power_limit 300 W is measured twice"
    ):
        load_profile_file(path)


def test_a_stored_limit_chosen_anew_by_another_selector_says_so(
    training: ReplayTraining, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The log said "using a stored power-limit profile: 200 W" while the file (and
    # `perseus power-limit show`) said 300 W: this run's selector chose again, unsaid.
    path = tmp_path / "profile.json"
    rows = [{"power_limit": w, "energy": e, "time": 1.0} for w, e in ((300, 90.0), (200, 80.0))]
    stored = {"measurements": rows, "optimal_power_limit": 300, "selector": "Time()"}
    path.write_text(json.dumps(stored))
    with caplog.at_level(logging.INFO, logger="worker_client.power_limit.optimizer"):
        make(training, profile_path=path, optimum_selector=Energy())
    said = [
        r.getMessage() for r in caplog.records if "stored power-limit profile" in r.getMessage()
    ]
    assert said == [
        "using a stored power-limit profile: 200 W, chosen now by Energy() "
        "(stored with it: 300 W, chosen by Time())"
    ], said


@pytest.mark.parametrize(
    ("document", "where", "watts"),
    [
        (
            {"measurements": [{"power_limit": 300_000, "energy": 1000.0, "time": 10.0}]},
            "measurements[0].power_limit is 300000 W",
            "300 W",
        ),
        (
            {
                "measurements": [
                    {"power_limit": 300, "energy": 1000.0, "time": 10.0},
                    {"power_limit": 250, "energy": 900.0, "time": 10.2},
                ],
                "optimal_power_limit": 250_000,
            },
            "optimal_power_limit is 250000 W",
            "250 W",
        ),
    ],
    ids=["measured limit", "optimal limit"],
)
def test_a_profile_file_in_milliwatts_is_refused_saying_so(
    r: redis.Redis,
    redis_url: str,
    tmp_path: Path,
    document: dict[str, Any],
    where: str,
    watts: str,
) -> None:
    """NVML takes milliwatts, Zeus's profile watts: 300000 was imported as a 300 kW limit."""
    path = tmp_path / "zeus.json"
    path.write_text(json.dumps(document))
    runner = CliRunner()
    for args in (
        ["import", str(path), "bert", "--redis-url", redis_url],
        ["show", "--file", str(path)],
    ):
        result = runner.invoke(power_limit_group, args)
        assert result.exit_code == 1, result.output
        said = " ".join(result.output.split())
        assert f"bad power-limit profile {path}: {where}" in said, said
        assert f"above {MAX_PLAUSIBLE_POWER_LIMIT_W} W" in said, said
        assert "milliwatts" in said and f"divide by 1000 ({watts})" in said, said
        assert result.exception is None or isinstance(result.exception, SystemExit)
    assert PowerLimitProfileStore(r).load("bert") is None
    # The ceiling itself is a limit (a file of watts still loads).
    document["measurements"][0]["power_limit"] = MAX_PLAUSIBLE_POWER_LIMIT_W
    document.pop("optimal_power_limit", None)
    path.write_text(json.dumps(document))
    assert load_profile_file(path).measurements[0].power_limit == MAX_PLAUSIBLE_POWER_LIMIT_W


def test_a_stored_profile_in_milliwatts_is_refused_naming_the_workload(
    r: redis.Redis, redis_url: str
) -> None:
    """One imported before `import` checked: shown as 300000 W, and used as such."""
    store = PowerLimitProfileStore(r)
    store.save(
        "bert",
        PowerLimitProfile(measurements=[MEASURED[0].model_copy(update={"power_limit": 300_000})]),
    )
    with pytest.raises(ProtocolError, match=r"'bert': measurements\[0\]\.power_limit is 300000 W"):
        store.load("bert")
    result = CliRunner().invoke(power_limit_group, ["show", "bert", "--redis-url", redis_url])
    assert result.exit_code == 1 and "divide by 1000 (300 W)" in result.output, result.output


def test_show_refuses_a_workload_and_a_file_together(tmp_path: Path) -> None:
    # `show bert --file p.json` showed the file and ignored the workload without a word.
    path = tmp_path / "p.json"
    path.write_text('{"measurements": [{"power_limit": 300, "energy": 1, "time": 1}]}')
    result = CliRunner().invoke(power_limit_group, ["show", "bert", "--file", str(path)])
    assert result.exit_code == 2, result.output
    assert "give a WORKLOAD or --file, not both" in result.output
