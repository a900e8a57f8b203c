"""Scheduler arguments are checked against the constructor's annotations and the scheduler's own
rules when the coordinator starts and when a job registers: a wrong type or an unusable value is
a ConfigError naming the scheduler and the argument, not a Python error in every job."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from coordinator.cli import main
from coordinator.job_config import job_config
from protocol import keys
from protocol.constants import MAX_RANK_CLOCKS
from protocol.exceptions import ConfigError, ProtocolError
from protocol.models import JobInfo, RankInfo, RegisterJob
from protocol.scheduler import check_scheduler_args, resolve_scheduler
from protocol.store import JobStore
from schedulers.planning.plan_file import write_plan_file
from schedulers.planning.profile_writer import write_profile_rows
from schedulers.profiler_args import check_writable
from tests.helpers import FREQS, make_settings
from worker_client.hook.session import CoordinatorClient

PROFILE_ROWS = [
    (stage, inst, freq, (0.01 if inst == "forward" else 0.02) * 1980 / freq, 1.0)
    for stage in range(2)
    for inst in ("forward", "backward")
    for freq in (1980, 1500, 1005)
]


@pytest.fixture
def profile(tmp_path: Path) -> str:
    """A valid 2-stage profile: the start check reads it (check_files) without complaint."""
    path = tmp_path / "p2.csv"
    write_profile_rows(path, PROFILE_ROWS)
    return str(path)


WRONG_TYPES = [
    ("PointSolution", {"solution_path": 5}, "'solution_path' must be str | None, got 5 (int)"),
    ("PointSolution3D", {"plan_text": ["x"]}, "'plan_text' must be str | None, got ['x'] (list)"),
    ("InstructionProfiler", {"microbatches": "8"}, "'microbatches' must be int, got '8' (str)"),
    ("InstructionProfiler", {"microbatches": True}, "'microbatches' must be int, got True (bool)"),
    ("InstructionProfiler", {"microbatches": 8.0}, "'microbatches' must be int, got 8.0 (float)"),
    (
        "InstructionProfiler",
        {"microbatches": 8, "then": "/x"},
        "'then' must be ThenArgs | None, got '/x' (str)",
    ),
    (
        "InstructionProfiler",
        {"microbatches": 8, "then": {"out_dir": "o", "p2p_power": "abc"}},
        "'then' must be ThenArgs | None, got {'out_dir': 'o', 'p2p_power': 'abc'} (dict) "
        "(then['p2p_power']: input should be a valid number)",
    ),
    (
        "InstructionProfiler",
        {"microbatches": 8, "frequencies": [1980, "1500"]},
        "'frequencies' must be list[int] | None, got [1980, '1500'] (list) "
        "(frequencies[1]: input should be a valid integer)",
    ),
    (
        "FrontierScheduler3D",
        {"frontier_dir": "d", "policy": "max-slowdown", "policy_arg": "1.05"},
        "'policy_arg' must be float | None, got '1.05' (str)",
    ),
    (
        "FrontierScheduler",
        {"frontier_dir": "d", "unit_time": False},
        "'unit_time' must be float, got False (bool)",
    ),
]


@pytest.mark.parametrize(("name", "args", "words"), WRONG_TYPES)
def test_a_wrong_type_is_refused_naming_scheduler_argument_and_type(
    name: str, args: dict[str, Any], words: str
) -> None:
    with pytest.raises(ConfigError) as info:
        check_scheduler_args(name, args)
    assert str(info.value) == f"scheduler {name}: argument {words}"


def test_instruction_profiler_checks_its_counts_and_then_before_any_job() -> None:
    for args, words in (
        ({"microbatches": 0}, "microbatches must be >= 1, got 0"),
        ({"microbatches": 2, "stop_after_rises": 0}, "stop_after_rises must be >= 1"),
        ({"microbatches": 2, "schedule": "zb"}, "zb"),
        ({"microbatches": 2, "then": {"out_dir": "o", "bogus": 1}}, "unknown key(s) ['bogus']"),
    ):
        with pytest.raises(ConfigError) as info:
            check_scheduler_args("InstructionProfiler", args)
        assert words in str(info.value)


def test_a_job_sending_a_wrong_type_is_refused_at_registration() -> None:
    settings = make_settings("redis://localhost:1", "")
    message = RegisterJob(
        request_id="r1",
        job=JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2),
        scheduler="InstructionProfiler",
        scheduler_args={"microbatches": "8"},
    )
    with pytest.raises(ConfigError, match="'microbatches' must be int, got '8' \\(str\\)"):
        job_config(settings, message)


def test_a_job_naming_no_scheduler_where_there_is_no_default_is_told_how_to_name_one() -> None:
    """It read only that the job must choose one: not where, nor from what."""
    settings = make_settings("redis://localhost:1", "")
    message = RegisterJob(
        request_id="r1", job=JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    )
    with pytest.raises(ProtocolError) as info:
        job_config(settings, message)
    said = str(info.value)
    assert "this coordinator has no default scheduler (PERSEUS_SCHEDULER is empty)" in said
    assert "PerseusOptimizer's scheduler= and scheduler_args=" in said
    assert "InstructionProfiler, PointSolution" in said and "`perseus schedulers`" in said
    assert "--scheduler NAME --scheduler-args JSON" in said


def test_a_job_naming_a_misspelt_scheduler_is_told_the_nearest_name() -> None:
    settings = make_settings("redis://localhost:1", "")
    message = RegisterJob(
        request_id="r1",
        job=JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1),
        scheduler="InstructionProfilr",
        scheduler_args={"microbatches": 8},
    )
    with pytest.raises(ProtocolError, match=r"\(did you mean InstructionProfiler\?\)"):
        job_config(settings, message)
    # Nothing near: no guess.
    with pytest.raises(ConfigError) as caught:
        resolve_scheduler("Zzz")
    assert "did you mean" not in str(caught.value)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ({}, "needs exactly one of frontier_dir (a perseus optimize folder) and profile"),
        ({"profile": ...}, "profile needs microbatches (microbatches per iteration"),
        ({"profile": ..., "microbatches": 4, "solver": "bogus"}, "unknown solver 'bogus'; use"),
        ({"profile": ..., "microbatches": 0}, "microbatches must be >= 1, got 0"),
        ({"profile": ..., "microbatches": 4, "unit_time": 0}, "unit_time must be positive, got 0"),
        ({"profile": ..., "microbatches": 4, "p2p_power": -1}, "p2p_power must be >= 0 W, got -1"),
        ({"profile": ..., "microbatches": 4, "schedule": "zb"}, "unsupported pipeline schedule"),
        ({"frontier_dir": "d", "policy": "fastest"}, "unknown policy 'fastest'"),
        # Planning arguments go with profile: a frontier folder was planned with its own, and
        # a schedule of gpipe beside a 1f1b folder was ignored, the 1f1b plans served.
        ({"frontier_dir": "d", "schedule": "gpipe"}, "'schedule' plans from a profile only"),
        (
            {"frontier_dir": "d", "microbatches": 8, "p2p_power": 70},
            "'microbatches', 'p2p_power' plan from a profile only",
        ),
        ({"frontier_dir": "d", "solver": "python"}, "the folder's plans were made by"),
    ],
)
def test_frontier_scheduler_start_check_catches_what_every_job_would_fail_on(
    profile: str, args: dict[str, Any], words: str
) -> None:
    args = {k: profile if v is ... else v for k, v in args.items()}
    for name in ("FrontierScheduler", "FrontierScheduler3D"):
        settings = make_settings("redis://localhost:1", name, scheduler_args=args)
        with pytest.raises(ConfigError) as info:
            settings.check_scheduler()  # What the coordinator runs when it starts.
        assert str(info.value).startswith(f"{name}: ")
        assert words in str(info.value)


def test_good_arguments_still_pass(profile: str) -> None:
    # JSON numbers: an int is a float; None is "not given".
    good = {"profile": profile, "microbatches": 4, "unit_time": 1, "p2p_power": 75}
    make_settings("redis://localhost:1", "FrontierScheduler", scheduler_args=good).check_scheduler()
    check_scheduler_args("FrontierScheduler3D", {"frontier_dir": "d", "policy_arg": None})
    check_scheduler_args(
        "InstructionProfiler",
        {"microbatches": 8, "frequencies": [1980], "then": {"out_dir": "o", "p2p_power": 70}},
    )
    # A module:Class scheduler is checked the same way, from its own annotations.
    check_scheduler_args("tests.toy_schedulers:StepDown", {"microbatches": 3, "delay": 0})
    with pytest.raises(ConfigError, match="'delay' must be float, got 'x' \\(str\\)"):
        check_scheduler_args("tests.toy_schedulers:StepDown", {"delay": "x"})


def test_arguments_are_checked_as_the_json_they_arrive_as() -> None:
    """A path comes as a string and a tuple as a list: both fit; "8" still is no int."""
    name = "tests.toy_schedulers:JsonShaped"
    check_scheduler_args(name, {"folder": "/tmp/x", "pair": [3, 4], "scale": 2})
    with pytest.raises(ConfigError, match="argument 'pair' must be tuple"):
        check_scheduler_args(name, {"pair": [3, "4"]})
    with pytest.raises(ConfigError, match="argument 'scale' must be float, got True"):
        check_scheduler_args(name, {"scale": True})


def test_a_typed_dict_argument_is_checked_key_by_key() -> None:
    # What InstructionProfiler's `then` could be annotated with to have p2p_power checked too.
    name = "tests.toy_schedulers:TypedArgs"
    with pytest.raises(ConfigError) as info:
        check_scheduler_args(name, {"then": {"out_dir": "o", "p2p_power": "abc"}})
    assert str(info.value) == (
        f"scheduler {name}: argument 'then' must be ThenArgs | None, got "
        "{'out_dir': 'o', 'p2p_power': 'abc'} (dict) "
        "(then['p2p_power']: input should be a valid number)"
    )
    with pytest.raises(ConfigError, match=r"then\['out_dir'\]: field required"):
        check_scheduler_args(name, {"then": {}})
    # An annotation only type checkers can evaluate leaves the arguments to the constructor.
    check_scheduler_args(name, {"then": {"out_dir": "o", "p2p_power": 70}, "where": 5})


def test_coordinator_start_names_the_argument(redis_url: str) -> None:
    result = CliRunner().invoke(
        main,
        [
            "coordinator",
            "--redis-url",
            redis_url,
            "--scheduler",
            "PointSolution",
            "--scheduler-args",
            '{"solution_path": 5}',
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 2, result.output
    assert "scheduler PointSolution: argument 'solution_path' must be str | None" in result.output


def test_relative_server_paths_are_made_absolute_when_the_coordinator_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An rq worker opens a path from its own working directory: the coordinator checks a
    relative path against its own, so the jobs must get the path it checked, made absolute
    (a worker started elsewhere failed every job with 'plan file not found')."""
    (tmp_path / "plans").mkdir()
    steps = [("forward", 1980), ("forward", 1980), ("backward", 1980), ("backward", 1980)]
    write_plan_file(tmp_path / "plans" / "plan.py", [steps, steps], {"plan": 0})
    write_profile_rows(tmp_path / "p2.csv", PROFILE_ROWS)
    then = {"out_dir": "planned", "p2p_power": 70}
    cases = [
        ("PointSolution3D", {"solution_path": "plans/plan.py"}),
        ("FrontierScheduler", {"profile": "p2.csv", "microbatches": 4}),
        ("InstructionProfiler", {"microbatches": 4, "out_path": "prof.csv", "then": then}),
    ]
    expected = [
        {"solution_path": str(tmp_path / "plans" / "plan.py")},
        {"profile": str(tmp_path / "p2.csv"), "microbatches": 4},
        {
            "microbatches": 4,
            "out_path": str(tmp_path / "prof.csv"),
            "then": {"out_dir": str(tmp_path / "planned"), "p2p_power": 70},
        },
    ]
    elsewhere = tmp_path / "worker"
    elsewhere.mkdir()
    message = RegisterJob(
        request_id="r1", job=JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2)
    )
    for (name, args), want in zip(cases, expected, strict=True):
        monkeypatch.chdir(tmp_path)  # the coordinator's working directory
        settings = make_settings("redis://localhost:1", name, scheduler_args=args)
        settings.check_scheduler()
        monkeypatch.chdir(elsewhere)  # a worker's
        config = job_config(settings, message)
        assert config.scheduler_args == want, name
        resolve_scheduler(name).check_files(config.scheduler_args)  # what the worker opens
    assert then == {"out_dir": "planned", "p2p_power": 70}  # the caller's dict is left alone


def test_missing_arguments_are_named_and_an_empty_set_reads_as_none_given() -> None:
    """A job naming InstructionProfiler without arguments read 'invalid scheduler_args []',
    as if it had sent an empty list."""
    with pytest.raises(ConfigError) as info:
        check_scheduler_args("InstructionProfiler", {})
    assert str(info.value).startswith(
        "invalid scheduler_args (none given) for scheduler InstructionProfiler: missing a "
        "required argument: 'microbatches' (it takes: microbatches, warmup_iters,"
    )
    with pytest.raises(ConfigError, match=r"^invalid scheduler_args \['bogus', 'microbatches'\]"):
        check_scheduler_args("InstructionProfiler", {"microbatches": 4, "bogus": 1})


def test_a_job_sending_arguments_without_a_scheduler_is_refused_not_run_without_them(
    service: Any, r: redis.Redis, redis_url: str
) -> None:
    """Arguments sent without a scheduler were dropped without a word: the job registered
    and ran the coordinator's default scheduler with the coordinator's arguments."""
    client = CoordinatorClient(redis_url, reply_timeout=5)
    job = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    with pytest.raises(ProtocolError) as info:
        client.register_job(job, None, {"microbatches": 8})
    words = "scheduler_args ['microbatches'] sent without a scheduler"
    assert words in str(info.value)
    dead = r.xrange(keys.DEADLETTER_STREAM)
    assert words.encode() in dead[-1][1][b"reason"]
    assert not r.zcard(keys.JOBS_INDEX)
    # No arguments (or an empty set) still gets the coordinator's scheduler and arguments.
    assert client.register_job(job, None, {})


def test_a_plan_text_that_does_not_parse_is_refused_when_the_job_registers(
    service: Any, r: redis.Redis, redis_url: str
) -> None:
    """It failed the job only once its ranks had registered, at the first version (with a
    traceback in the worker's log for each such job)."""
    client = CoordinatorClient(redis_url, reply_timeout=5)
    job = JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2)
    bad = "[[('forward', 1800)], [('forward', 1800)]]"
    with pytest.raises(ProtocolError, match="<plan_text>") as info:
        client.register_job(job, "PointSolution", {"plan_text": bad})
    assert "backward" in str(info.value)
    assert not r.zcard(keys.JOBS_INDEX)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        # Registered before, then the job failed when its last rank joined.
        ({"microbatches": 2, "frequencies": []}, "frequencies is empty"),
        ({"microbatches": 2, "frequencies": [1980, -5]}, "must be positive clocks in MHz, got -5"),
        ({"microbatches": 2, "frequencies": [1980, 1980]}, "lists 1980 MHz more than once"),
        # A worker built 2 x 2**28 instruction names per stage (gigabytes) for such a job.
        ({"microbatches": 2**28}, "microbatches must be <= 65536, got 268435456"),
        # Counted for duplicates one clock at a time: 200,000 (a 1 MiB entry) held the
        # coordinator for minutes.
        (
            {"microbatches": 2, "frequencies": list(range(MAX_RANK_CLOCKS + 1, 0, -1))},
            f"frequencies lists {MAX_RANK_CLOCKS + 1} clocks, more than {MAX_RANK_CLOCKS}",
        ),
    ],
)
def test_a_job_sending_unusable_profiler_values_is_refused_at_registration(
    args: dict[str, Any], words: str
) -> None:
    settings = make_settings("redis://localhost:1", "")
    message = RegisterJob(
        request_id="r1",
        job=JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2),
        scheduler="InstructionProfiler",
        scheduler_args=args,
    )
    with pytest.raises(ConfigError) as info:
        job_config(settings, message)
    assert words in str(info.value)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ({"out_path": "{tmp}"}, "out_path {tmp} is a folder; name the CSV file to write"),
        ({"out_path": "{tmp}/file/p.csv"}, "out_path {tmp}/file/p.csv: {tmp}/file is not a folder"),
        (
            {"then": {"out_dir": "{tmp}/file"}},
            "then['out_dir'] {tmp}/file is a file; name a folder (it is made if missing)",
        ),
    ],
)
def test_profiler_outputs_that_cannot_be_written_stop_the_coordinator_start(
    tmp_path: Path, args: dict[str, Any], words: str
) -> None:
    # Written only when the sweep ends: the job failed then, its whole sweep done.
    (tmp_path / "file").write_text("x")
    args = {
        key: {k: v.format(tmp=tmp_path) for k, v in value.items()}
        if isinstance(value, dict)
        else value.format(tmp=tmp_path)
        for key, value in args.items()
    }
    settings = make_settings(
        "redis://localhost:1", "InstructionProfiler", scheduler_args={"microbatches": 2, **args}
    )
    with pytest.raises(ConfigError) as info:
        settings.check_scheduler()
    assert str(info.value) == words.format(tmp=tmp_path)


def test_profiler_outputs_in_folders_not_made_yet_are_fine(tmp_path: Path) -> None:
    args = {
        "microbatches": 2,
        "out_path": str(tmp_path / "new" / "p.csv"),
        "then": {"out_dir": str(tmp_path / "plans" / "here")},
    }
    settings = make_settings("redis://localhost:1", "InstructionProfiler", scheduler_args=args)
    settings.check_scheduler()
    assert not (tmp_path / "new").exists()  # checked, not made


@pytest.mark.parametrize(("name", "dp"), [("PointSolution", 1), ("PointSolution3D", 2)])
def test_a_rank_whose_gpu_lacks_a_clock_of_the_plan_is_refused_when_it_registers(
    service: Any, r: redis.Redis, redis_url: str, name: str, dp: int
) -> None:
    """Found by the constructor only, the job failed at its first schedule, after every rank
    had registered (a `failed` job left in Redis, and a training run that had started)."""
    client = CoordinatorClient(redis_url, reply_timeout=10)
    assert 1600 not in FREQS
    plan = "[[('forward', 1980), ('backward', 1965)], [('forward', 1600), ('backward', 1980)]]"
    job = JobInfo(pp_degree=2, dp_degree=dp, tp_degree=1, world_size=2 * dp)
    job_id = client.register_job(job, name, {"plan_text": plan})
    for rank in range(dp):  # stage 0's ranks: every clock of its line is theirs
        info = RankInfo(rank=rank, dp_rank=rank, pp_rank=0, tp_rank=0, available_frequencies=FREQS)
        assert client.register_rank(job_id, info).ok
    stage1 = RankInfo(rank=dp, dp_rank=0, pp_rank=1, tp_rank=0, available_frequencies=FREQS)
    with pytest.raises(ProtocolError) as info:
        client.register_rank(job_id, stage1)
    words = str(info.value)
    assert f"rank {dp} (stage 1)" in words and "1600 MHz" in words, words
    assert "<plan_text>" in words and "instruction 0 (forward)" in words, words
    assert b"1600 MHz" in r.xrange(keys.DEADLETTER_STREAM)[-1][1][b"reason"]
    assert len(JobStore(r).ranks(job_id)) == dp


@pytest.mark.parametrize("folder", [False, True])
def test_a_folder_that_takes_no_files_is_refused_even_where_access_says_yes(folder: bool) -> None:
    # os.access said yes to root for /proc (no file can be made there): the coordinator
    # started, and the sweep's CSV failed the job when the sweep ended.
    # It said "cannot write in /proc (No such file or directory)", naming /proc, not the path.
    path = Path("/proc/perseus-x" + ("" if folder else ".csv"))
    made = "folder" if folder else "file"
    with pytest.raises(ConfigError) as info:
        check_writable("out_path", path, folder)
    assert str(info.value).startswith(
        f"out_path {path}: cannot make this {made}, as nothing can be made in /proc ("
    ), info.value


def test_an_existing_folder_that_takes_no_files_is_named() -> None:
    with pytest.raises(ConfigError, match=r"^dump /proc: cannot write in this folder \("):
        check_writable("dump", Path("/proc"), folder=True)
