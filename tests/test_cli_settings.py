"""Settings as the perseus commands read them: variables, values and bounds, one line each."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from coordinator.cli import main
from coordinator.cli_common import load_settings
from coordinator.settings import (
    MAX_ENTRY_BYTES_LIMIT,
    MAX_SWEEP_VERSIONS_LIMIT,
    MAX_WORLD_SIZE_LIMIT,
    unknown_variables,
)
from protocol.connection import DEFAULT_REDIS_URL


@pytest.mark.parametrize("command", [["status"], ["jobs", "list"], ["deadletter", "list"]])
def test_a_malformed_settings_variable_is_one_clear_line(redis_url, command):
    result = CliRunner().invoke(
        main, [*command, "--redis-url", redis_url], env={"PERSEUS_SCHEDULER_ARGS": "{bad"}
    )
    assert result.exit_code == 2, result.output
    said = "PERSEUS_SCHEDULER_ARGS = '{bad': not JSON: Expecting property name"
    assert said in result.output
    assert isinstance(result.exception, SystemExit)  # click's exit, no traceback


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (["status"], True, "characters): not JSON: nested too deeply"),
        (
            ["coordinator"],
            True,
            "Invalid value for PERSEUS_SCHEDULER_ARGS: not JSON: nested too deeply",
        ),
        (
            ["coordinator", "--scheduler-args"],
            False,
            "--scheduler-args: not JSON: nested too deeply",
        ),
    ],
    ids=["variable, status", "variable, coordinator", "option"],
)
def test_scheduler_args_nested_thousands_deep_are_one_clear_line(redis_url, args, env, said):
    """json gives up with a RecursionError, which came out as a traceback."""
    deep = "[" * 100_000
    argv = [*args, *([] if env else [deep]), "--redis-url", redis_url]
    result = CliRunner().invoke(main, argv, env={"PERSEUS_SCHEDULER_ARGS": deep} if env else {})
    assert result.exit_code == 2, result.output
    assert said in result.output
    assert isinstance(result.exception, SystemExit)  # click's exit, no traceback


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (["status"], True, "PERSEUS_SCHEDULER_ARGS = '{\"m\": 2, \"m\": 3}': key 'm' is given"),
        (["coordinator"], True, "Invalid value for PERSEUS_SCHEDULER_ARGS: key 'm' is given twice"),
        (["coordinator", "--scheduler-args"], False, "--scheduler-args: key 'm' is given twice"),
    ],
    ids=["variable, status", "variable, coordinator", "option"],
)
def test_scheduler_args_that_name_a_key_twice_are_refused(redis_url, args, env, said):
    """json keeps the last value: {"m": 2, "m": 3} ran with 3, whatever the user meant."""
    twice = '{"m": 2, "m": 3}'
    argv = [*args, *([] if env else [twice]), "--redis-url", redis_url]
    result = CliRunner().invoke(main, argv, env={"PERSEUS_SCHEDULER_ARGS": twice} if env else {})
    assert result.exit_code == 2, result.output
    assert said in result.output


@pytest.mark.parametrize("command", [["power-limit", "show"], ["jobs", "list"]])
def test_a_mistyped_variable_stops_every_command(redis_url, command):
    """power-limit reads no settings: it used the default URL whatever the typo said."""
    result = CliRunner().invoke(main, command, env={"PERSEUS_REDIS_ULR": redis_url})
    assert result.exit_code == 2, result.output
    assert "unknown environment variable PERSEUS_REDIS_ULR" in result.output
    assert "did you mean PERSEUS_REDIS_URL?" in result.output


def test_a_hint_names_only_a_variable_close_to_the_unknown_one():
    # Every name starts with PERSEUS_: that alone made PERSEUS_FOO "close" to PERSEUS_PLAN.
    assert unknown_variables({"PERSEUS_FOO": "1"}) == ["unknown environment variable PERSEUS_FOO"]
    hinted = unknown_variables({"PERSEUS_SCHEDULR": "x"})
    assert hinted == [
        "unknown environment variable PERSEUS_SCHEDULR (did you mean PERSEUS_SCHEDULER?)"
    ]


def test_zeus_server_variables_are_named_as_not_read(redis_url):
    # A Zeus deployment's ZEUS_PFO_SCHEDULER / _ARGS were ignored unsaid: the coordinator
    # started with no default scheduler, and jobs that named none were refused later.
    env = {
        "ZEUS_PFO_SCHEDULER": "PointSolution",
        "ZEUS_PFO_MAX_JOB_IDLE_TIME": "60",
        "PERSEUS_MAX_JOB_IDLE_TIME": "120",
        "ZEUS_PFO_FOO": "1",
        "ZEUS_PFO_REDIS_URL": "redis://elsewhere:6379/0",
    }
    result = CliRunner().invoke(main, ["status", "--redis-url", redis_url], env=env)
    assert result.exit_code == 0, result.output
    assert (
        "note: ZEUS_PFO_SCHEDULER is Zeus's server variable, not read here: set "
        "PERSEUS_SCHEDULER instead (not set)" in result.output
    )
    assert "PERSEUS_MAX_JOB_IDLE_TIME instead (set: that value is used)" in result.output
    # Zeus's server has no FOO setting either: not called one of its variables.
    assert (
        "note: ZEUS_PFO_FOO has the prefix of Zeus's server variables, but neither Zeus nor "
        "perseus has a setting FOO; not read here" in result.output
    )
    assert (
        "note: ZEUS_PFO_REDIS_URL has the prefix of Zeus's server variables, but Zeus has no "
        "setting REDIS_URL; not read here: set PERSEUS_REDIS_URL instead (not set)" in result.output
    )


def test_an_invalid_setting_is_named_with_its_value_on_one_line(redis_url):
    env = {"PERSEUS_MAX_JOB_IDLE_TIME": "abc", "PERSEUS_STREAM_MAXLEN": "5"}
    result = CliRunner().invoke(main, ["status", "--redis-url", redis_url], env=env)
    assert result.exit_code == 2, result.output
    assert "PERSEUS_MAX_JOB_IDLE_TIME = 'abc': Input should be a valid integer" in result.output
    assert "PERSEUS_STREAM_MAXLEN = '5': Input should be greater than or equal to 100" in (
        result.output
    )
    assert "errors.pydantic.dev" not in result.output


def test_settings_must_be_at_least_a_millisecond_and_counts_fit_redis(redis_url):
    # 1e-300 s made the sweep loop spin; a MAXLEN past 2**63 failed every XADD at run time.
    env = {
        "PERSEUS_RECONCILE_INTERVAL": "1e-300",
        "PERSEUS_STALL_TIMEOUT": "0.0001",
        "PERSEUS_STREAM_MAXLEN": "10000000000000000000000",
        "PERSEUS_STREAM_HARD_CAP": str(2**63),
    }
    result = CliRunner().invoke(main, ["status", "--redis-url", redis_url], env=env)
    assert result.exit_code == 2, result.output
    for name in ("RECONCILE_INTERVAL", "STALL_TIMEOUT"):
        assert f"PERSEUS_{name} = " in result.output
    assert result.output.count("Input should be greater than or equal to 0.001") == 2
    assert result.output.count("Input should be less than or equal to 9223372036854775807") == 2


def test_max_frequencies_has_a_ceiling_that_the_error_states(redis_url):
    # 10**18 was taken: a limit that let a rank register a clock list of any length.
    env = {"PERSEUS_MAX_FREQUENCIES": str(10**18)}
    result = CliRunner().invoke(main, ["status", "--redis-url", redis_url], env=env)
    assert result.exit_code == 2, result.output
    assert f"PERSEUS_MAX_FREQUENCIES = '{10**18}': must be at most 10000" in result.output
    assert "an H100 has 110 clocks" in result.output
    env = {"PERSEUS_MAX_FREQUENCIES": "10000"}
    result = CliRunner().invoke(main, ["status", "--redis-url", redis_url], env=env)
    assert result.exit_code == 0, result.output


def test_settings_must_be_finite_and_within_a_year(redis_url):
    # An interval of inf never swept; a time-out of 10^23 s failed Redis's EXPIRE later.
    env = {
        "PERSEUS_RECONCILE_INTERVAL": "inf",
        "PERSEUS_FINISHED_RETENTION": "nan",
        "PERSEUS_JOB_TIMEOUT": "99999999999999999999999",
    }
    result = CliRunner().invoke(main, ["status", "--redis-url", redis_url], env=env)
    assert result.exit_code == 2, result.output
    assert "PERSEUS_RECONCILE_INTERVAL = 'inf': Input should be a finite number" in result.output
    assert "PERSEUS_FINISHED_RETENTION = 'nan': Input should be a finite number" in result.output
    assert "PERSEUS_JOB_TIMEOUT = '99999999999999999999999': Input should be less than" in (
        result.output
    )


@pytest.mark.parametrize(
    "args",
    [
        ["status", "--silent-after", "nan"],
        ["status", "--watch", "--interval", "nan"],
        ["status", "--watch", "--interval", "inf"],
        ["optimize", "--unit-time", "nan"],
        ["optimize", "--p2p-power", "nan"],
        ["profile-p2p", "--seconds", "nan"],
        ["profile-p2p", "--sim-blocking-power", "inf"],
    ],
)
def test_number_options_refuse_nan_and_infinity_naming_the_option(args):
    # click's FloatRange lets NaN through (every comparison with it is false): --interval nan
    # ended `perseus status --watch` in a traceback from time.sleep.
    outcome = CliRunner().invoke(main, args)
    assert outcome.exit_code == 2, outcome.output
    assert "finite" in outcome.output and args[-2] in outcome.output, outcome.output


def test_another_tools_url_variable_is_named_when_the_default_redis_is_used(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # REDIS_URL (redis-py users' habit, rq's --url default) is not read: a command without
    # --redis-url or PERSEUS_REDIS_URL went to localhost unsaid ("jobs: 0" from status).
    monkeypatch.setenv("REDIS_URL", "redis://elsewhere:6379/0")
    monkeypatch.delenv("PERSEUS_REDIS_URL", raising=False)
    assert load_settings().redis_url == DEFAULT_REDIS_URL
    assert capsys.readouterr().err == (
        "note: REDIS_URL is set, but perseus reads only --redis-url or PERSEUS_REDIS_URL: "
        f"using {DEFAULT_REDIS_URL}\n"
    )
    load_settings(redis_url="redis://given:6379/0")
    monkeypatch.setenv("PERSEUS_REDIS_URL", "redis://given:6379/0")
    load_settings()
    assert capsys.readouterr().err == ""  # a URL was given: nothing to say


def test_variables_are_checked_whatever_their_case(redis_url):
    # Settings are read whatever the case (pydantic-settings, as Zeus's settings were), so
    # perseus_scheduler worked while a misspelt perseus_schedulr went unsaid, and so did
    # zeus_pfo_scheduler, which Zeus's server reads as ZEUS_PFO_SCHEDULER.
    assert unknown_variables({"perseus_schedulr": "x"}) == [
        "unknown environment variable perseus_schedulr (did you mean PERSEUS_SCHEDULER?)"
    ]
    assert unknown_variables({"perseus_scheduler": "PointSolution"}) == []
    # The simulated GPU's variables are read as written: another case is not read at all.
    assert unknown_variables({"perseus_sim_gpu_dir": "/tmp/x"}) == [
        "unknown environment variable perseus_sim_gpu_dir (did you mean PERSEUS_SIM_GPU_DIR?)"
    ]
    # Two spellings of one setting: pydantic-settings would take either, unsaid.
    assert unknown_variables({"PERSEUS_SCHEDULER": "a", "perseus_scheduler": "b"}) == [
        "PERSEUS_SCHEDULER and perseus_scheduler are one setting spelt two ways: keep one"
    ]
    env = {"zeus_pfo_scheduler": "PointSolution", "perseus_max_job_idle_time": "60"}
    result = CliRunner().invoke(main, ["status", "--redis-url", redis_url], env=env)
    assert result.exit_code == 0, result.output
    assert "note: zeus_pfo_scheduler is Zeus's server variable, not read here" in result.output
    assert "set PERSEUS_SCHEDULER instead (not set)" in result.output
    env = {"ZEUS_PFO_MAX_JOB_IDLE_TIME": "60", "perseus_max_job_idle_time": "60"}
    result = CliRunner().invoke(main, ["status", "--redis-url", redis_url], env=env)
    assert "PERSEUS_MAX_JOB_IDLE_TIME instead (set: that value is used)" in result.output
    # The URL read from perseus_redis_url is no default that another tool's variable hides.
    env = {"perseus_redis_url": redis_url, "REDIS_URL": "redis://elsewhere:1/0"}
    result = CliRunner().invoke(main, ["status"], env=env)
    assert result.exit_code == 0, result.output
    assert "REDIS_URL is set" not in result.output


@pytest.mark.parametrize(
    ("name", "ceiling", "why"),
    [
        ("MAX_WORLD_SIZE", MAX_WORLD_SIZE_LIMIT, "ranks per job"),
        ("MAX_SWEEP_VERSIONS", MAX_SWEEP_VERSIONS_LIMIT, "one version per clock swept"),
        ("MAX_ENTRY_BYTES", MAX_ENTRY_BYTES_LIMIT, "decodes an entry whole"),
    ],
)
def test_the_limits_on_clients_have_ceilings_that_the_error_states(redis_url, name, ceiling, why):
    # Each took 10**18 and then used it: a job of 10**18 ranks, entries of any size decoded.
    env = {f"PERSEUS_{name}": str(ceiling + 1)}
    result = CliRunner().invoke(main, ["status", "--redis-url", redis_url], env=env)
    assert result.exit_code == 2, result.output
    assert f"PERSEUS_{name} = '{ceiling + 1}': must be at most {ceiling} (" in result.output
    assert why in result.output
    env = {f"PERSEUS_{name}": str(ceiling)}
    result = CliRunner().invoke(main, ["status", "--redis-url", redis_url], env=env)
    assert result.exit_code == 0, result.output
