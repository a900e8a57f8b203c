"""Plan files: parsing without eval, the old frequency-only format, errors with line numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.exceptions import ConfigError
from protocol.pipeline_schedules import one_f_one_b_order
from schedulers.planning.plan_file import (
    PlanFile,
    parse_plan_text,
    read_plan_file,
    write_plan_file,
)

F, B = "forward", "backward"

# Synchronous 1F1B for 4 stages x 4 microbatches, written out by hand.
HAND_1F1B_4x4 = [
    [F, F, F, F, B, B, B, B],  # warmup 3, one F/B pair, 3 drain backwards
    [F, F, F, B, F, B, B, B],  # warmup 2
    [F, F, B, F, B, F, B, B],  # warmup 1
    [F, B, F, B, F, B, F, B],  # last stage: no warmup
]


def _stages(num_stages: int, num_microbatches: int) -> list[list[tuple[str, int]]]:
    return [
        [
            (name, 1980 - 15 * ((s + i) % 7))
            for i, name in enumerate(one_f_one_b_order(num_stages, num_microbatches, s))
        ]
        for s in range(num_stages)
    ]


def test_one_f_one_b_order_matches_hand_written() -> None:
    for stage, expected in enumerate(HAND_1F1B_4x4):
        assert one_f_one_b_order(4, 4, stage) == expected


def test_one_f_one_b_order_fewer_microbatches_than_stages() -> None:
    # Warmup is capped by the number of microbatches.
    assert one_f_one_b_order(8, 2, 0) == [F, F, B, B]
    assert one_f_one_b_order(8, 2, 7) == [F, B, F, B]


@pytest.mark.parametrize("args", [(0, 4, 0), (4, 0, 0), (4, 4, 4), (4, 4, -1)])
def test_one_f_one_b_order_rejects_bad_shape(args: tuple[int, int, int]) -> None:
    with pytest.raises(ConfigError):
        one_f_one_b_order(*args)


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "freqs_pipeline_00012.py"
    stages = _stages(4, 3)
    header = {"iteration_time": 1.2345, "energy": 456.7, "unit_time": "0.001"}
    notes = ["perseus plan 00012", "Iteration 3: total cost 12.5", ""]
    write_plan_file(path, stages, header, notes)

    plan = read_plan_file(path)
    assert plan == PlanFile(
        stages=stages,
        header={"iteration_time": "1.2345", "energy": "456.7", "unit_time": "0.001"},
        notes=notes,
        path=path,
    )
    assert plan.num_stages == 4
    assert plan.num_microbatches == 3
    assert plan.header_float("iteration_time") == pytest.approx(1.2345)
    assert plan.header_float("missing") is None
    assert plan.frequencies(0) == [f for _, f in stages[0]]
    # Writing what was read gives the same file again.
    again = tmp_path / "again.py"
    write_plan_file(again, plan.stages, plan.header, plan.notes)
    assert again.read_text() == path.read_text()
    assert not list(tmp_path.glob(".*.tmp"))  # Atomic write leaves no temporary file.


def test_written_file_has_one_line_per_stage(tmp_path: Path) -> None:
    path = tmp_path / "plan.py"
    write_plan_file(path, _stages(3, 2), {"energy": 1.5}, ["perseus plan 00001"])
    lines = path.read_text().splitlines()
    assert lines[0] == "# perseus plan 00001"
    assert lines[1] == "# energy: 1.5"
    assert lines[2] == "["
    assert lines[-1] == "]"
    assert len(lines) == 3 + 3 + 1
    assert lines[3].startswith('    [("forward", ')


def test_header_float_rejects_text() -> None:
    plan = parse_plan_text('# energy: lots\n[[("forward", 1), ("backward", 2)]]', "p.py")
    with pytest.raises(ConfigError, match="energy"):
        plan.header_float("energy")


def test_comments_split_into_header_and_notes() -> None:
    text = (
        "# perseus plan 00003\n"
        "# iteration_time: 2.5\n"
        "# Iteration 3: total cost 12.5\n"
        "[\n"
        "    # stage zero follows\n"
        '    [("forward", 1980), ("backward", 1965)],  # trailing comments are ignored\n'
        '    [("forward", 1500), ("backward", 1410)],\n'
        "]\n"
    )
    plan = parse_plan_text(text)
    assert plan.header == {"iteration_time": "2.5"}
    assert plan.notes == [
        "perseus plan 00003",
        "Iteration 3: total cost 12.5",
        "stage zero follows",
    ]
    assert plan.stages == [[(F, 1980), (B, 1965)], [(F, 1500), (B, 1410)]]
    assert plan.path is None


def test_old_int_format_gets_1f1b_names(tmp_path: Path) -> None:
    freqs = [[1980 - 15 * (s * 8 + i) for i in range(8)] for s in range(4)]
    path = tmp_path / "freqs_pipeline_00000.py"
    path.write_text(
        "# Iteration 0: total cost 3.0\n[\n" + "".join(f"    {f},\n" for f in freqs) + "]\n"
    )
    plan = read_plan_file(path)
    assert plan.num_microbatches == 4
    for s in range(4):
        assert [name for name, _ in plan.stages[s]] == HAND_1F1B_4x4[s]
        assert plan.frequencies(s) == freqs[s]
    assert plan.notes == ["Iteration 0: total cost 3.0"]


def test_tuples_accepted_instead_of_lists() -> None:
    plan = parse_plan_text('(\n    (("forward", 1), ["backward", 2]),\n)')
    assert plan.stages == [[(F, 1), (B, 2)]]


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.py: plan file not found$"):
        read_plan_file(tmp_path / "nope.py")


def test_the_docs_placeholder_for_a_plan_number_is_named(tmp_path: Path) -> None:
    # The Perseus docs' command gives "path/to/freqs_pipeline_%05d.py": copied as it is, the
    # error said only "plan file not found", as if the file had gone.
    with pytest.raises(ConfigError, match="plan file not found") as caught:
        read_plan_file(tmp_path / "freqs_pipeline_%05d.py")
    assert "%05d stands for a plan's number (freqs_pipeline_00042.py)" in str(caught.value)
    assert "perseus choose" in str(caught.value)


def test_a_plan_file_as_zeus_run_optimization_writes_it_is_read(tmp_path: Path) -> None:
    # run_optimization.py writes `f"{stage_freq},\n"` per stage (a list of tuples, as repr
    # gives it) between "[" and "]", then three "# Iteration N ..." comments.
    stages = [
        [(F, 1740), (F, 1725), (B, 1740), (B, 1710)],
        [(F, 1740), (B, 1740), (F, 1725), (B, 1710)],
    ]
    body = "[\n" + "".join(f"{stage},\n" for stage in stages) + "]\n"
    body += "# Iteration 3 cost change: 0.123\n# Iteration 3 total cost: 456.7\n"
    body += "# Iteration 3 total cost with P2P: 789.0\n"
    path = tmp_path / "freqs_pipeline_00003.py"
    path.write_text(body)
    plan = read_plan_file(path)
    assert plan.stages == stages
    assert plan.header == {} and len(plan.notes) == 3
    assert plan.schedule == "1f1b"


GOOD_STAGE = '[("forward", 1980), ("backward", 1980)]'

# (file body, line the error must name, text the message must contain)
MALFORMED: list[tuple[str, int, str]] = [
    ('# only\n[\n    [("forward" 1980)],\n]\n', 3, "syntax error: "),
    # A CSV given as a plan (frontier.csv, a profile): say what a plan file is instead.
    (
        "# a profile\nstage,instruction,frequency,time_s\n0,forward,1980,0.01\n",
        3,  # Python's line: the header parses as a tuple
        "a plan file is one list of stage lists (as `perseus optimize` writes), this one "
        "starts with 'stage,instruction,frequency,time_s'",
    ),
    ("# a dict\n{'forward': 1}\n", 2, "expected a list of stage lists"),
    ("# code\n__import__('os').system('true')\n", 2, "expected a list of stage lists"),
    ("[\n    " + GOOD_STAGE + ",\n    1980,\n]\n", 3, "stage 1: expected a list, got 1980"),
    (
        '[\n    [("forward", 1980), ("forward", 1965),\n     ("backward", 1980), "abc"],\n]\n',
        3,
        'stage 0, item 3: expected (instruction, frequency) pair, got "abc"',
    ),
    ('[\n    [("forward", 1980, 3), ("backward", 1)],\n]\n', 2, "stage 0, item 0: expected"),
    ('[\n    [("forward", 0), ("backward", 1980)],\n]\n', 2, "item 0: expected a positive integer"),
    ('[\n    [("forward", -15), ("backward", 1980)],\n]\n', 2, "got -15"),
    ('[\n    [("forward", 1980.0), ("backward", 1980)],\n]\n', 2, "got 1980.0"),
    ('[\n    [("forward", "1980"), ("backward", 1980)],\n]\n', 2, "positive integer frequency"),
    ('[\n    [("forward", True), ("backward", 1980)],\n]\n', 2, "got True"),
    (
        '[\n    [("forward", 1980),\n     ("bakward", 1980)],\n]\n',
        3,
        "bad instruction name 'bakward'",
    ),
    ('[\n    [("forward", 1980), (3, 1980)],\n]\n', 2, "expected an instruction name, got 3"),
    (
        '[\n    [("forward", 1), ("forward", 2), ("backward", 3)],\n]\n',
        2,
        "stage 0: 2 forward but 1 backward instructions",
    ),
    ('[\n    [("backward", 1), ("forward", 2)],\n]\n', 2, "backward before its forward"),
    (
        "[\n    " + GOOD_STAGE + ",\n"
        '    [("forward", 1), ("forward", 2), ("backward", 3), ("backward", 4)],\n]\n',
        3,
        "stage 1: has 2 microbatches but stage 0 has 1",
    ),
    ("[\n    [1980, 1965],\n    [1980, 1965, 1950],\n]\n", 3, "odd number of frequencies (3)"),
    ("[\n    [1980, 1965],\n    [1980, 1965, 1950, 1935],\n]\n", 3, "has 2 microbatches"),
    ("[\n    " + GOOD_STAGE + ",\n    [1980, 1965],\n]\n", 3, "mixes"),
    ("[\n    [1980, 1965],\n    [],\n]\n", 3, "stage 1: empty stage"),
    ("# header: only\n\n[\n]\n", 3, "empty plan"),
    # The header a planner wrote must agree with the stage lists (a file cut short parsed).
    (
        "# num_stages: 4\n[\n    " + GOOD_STAGE + ",\n    " + GOOD_STAGE + ",\n]\n",
        1,
        "header 'num_stages' says 4 but the plan has 2 stage lists",
    ),
    (
        "# note\n# num_microbatches: 2\n[\n    " + GOOD_STAGE + ",\n]\n",
        2,
        "header 'num_microbatches' says 2 but the plan has 1 microbatches per stage",
    ),
    ("# num_stages: two\n[\n    " + GOOD_STAGE + ",\n]\n", 1, "must be a whole number"),
    ("# num_stages: \u0661\n[\n    " + GOOD_STAGE + ",\n]\n", 1, "must be a whole number"),
    # str.splitlines() broke lines at a form feed or U+2028 in a comment, which no editor
    # (nor Python's parser) does: the header's line was given as 3.
    ("# note \x0c more\n# num_stages: 3\n[\n    " + GOOD_STAGE + ",\n]\n", 2, "says 3"),
    ("# note \u2028 more\n# num_stages: 3\n[\n    " + GOOD_STAGE + ",\n]\n", 2, "says 3"),
]


@pytest.mark.parametrize(("body", "line", "message"), MALFORMED)
def test_malformed_file_names_file_and_line(
    tmp_path: Path, body: str, line: int, message: str
) -> None:
    path = tmp_path / "plan.py"
    path.write_text(body)
    with pytest.raises(ConfigError) as info:
        read_plan_file(path)
    text = str(info.value)
    assert text.startswith(f"{path}:{line}: "), text
    assert message in text


def test_a_header_inside_a_comment_after_a_unicode_line_break_is_part_of_the_note() -> None:
    # Python reads "# a<U+2028># energy: 5" as one comment; splitlines() read a header in it.
    plan = parse_plan_text("# a\u2028# energy: 5\n[\n    " + GOOD_STAGE + ",\n]\n")
    assert plan.header == {} and plan.notes == ["a\u2028# energy: 5"]


def test_a_shape_header_that_agrees_with_the_stage_lists_is_read(tmp_path: Path) -> None:
    path = tmp_path / "plan.py"
    write_plan_file(path, _stages(3, 2), {"num_stages": 3, "num_microbatches": 2})
    plan = read_plan_file(path)
    assert (plan.num_stages, plan.num_microbatches) == (3, 2)


def test_comment_only_file_is_empty_plan(tmp_path: Path) -> None:
    path = tmp_path / "plan.py"
    path.write_text("# perseus plan 00001\n# energy: 3\n")
    with pytest.raises(ConfigError, match=r"plan\.py: empty plan"):
        read_plan_file(path)


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "plan.py"
    path.write_bytes(b"\xff\xfe[[1, 2]]")
    with pytest.raises(ConfigError, match=r"plan\.py: .*UTF-8"):
        read_plan_file(path)


def test_parse_never_executes(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    text = f"[[open({str(marker)!r}, 'w').write('x'), 1]]"
    with pytest.raises(ConfigError):
        parse_plan_text(text, "evil.py")
    assert not marker.exists()


@pytest.mark.parametrize(
    ("header", "notes", "message"),
    [
        ({"bad key": 1}, (), "header key"),
        ({"k": "two\nlines"}, (), "would not read back"),
        ({}, ("energy: 3",), "note"),
        ({}, ("two\nlines",), "note"),
    ],
)
def test_write_rejects_what_would_not_read_back(
    tmp_path: Path, header: dict[str, object], notes: tuple[str, ...], message: str
) -> None:
    path = tmp_path / "plan.py"
    with pytest.raises(ConfigError, match=message):
        write_plan_file(path, _stages(2, 2), header, notes)
    assert not path.exists()


def test_write_rejects_invalid_stages(tmp_path: Path) -> None:
    path = tmp_path / "plan.py"
    with pytest.raises(ConfigError, match="bad instruction name"):
        write_plan_file(path, [[("forwards", 1980), ("backward", 1980)]], {})
    with pytest.raises(ConfigError, match="empty plan"):
        write_plan_file(path, [], {})
    assert not path.exists()


def test_an_instruction_name_with_a_trailing_line_break_is_refused():
    # ``$`` also matches before a final line break: "forward\n" passed the name check.
    from pydantic import ValidationError

    from protocol.models import FrequencySchedule

    with pytest.raises(ValidationError, match="bad instruction name"):
        FrequencySchedule(rank=0, frequencies=[("forward\n", 1000)])
