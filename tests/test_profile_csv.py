"""Profile CSV reader/writer: both forms round-trip; every bad input names file, line, field."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.exceptions import ConfigError
from protocol.models import OfflineProfilingResult
from schedulers.planning.profile_csv import (
    FULL_COLUMNS,
    SHORT_COLUMNS,
    build_profile,
    read_profile_csv,
)
from schedulers.planning.profile_writer import write_profile_csv, write_profile_rows

SHORT_ROWS = [
    (0, "forward", 1980, 0.0123456789012345, 8.5),
    (0, "forward", 1500, 0.015, 7.25),
    (0, "backward", 1980, 0.025, 17.0),
    (0, "backward", 1500, 0.031, 14.5),
    (1, "forward", 1980, 0.02, 12.0),
    (1, "backward", 1980, 0.04, 24.0),
]


def _result(rank: int, dp: int, pp: int, scale: float) -> OfflineProfilingResult:
    return OfflineProfilingResult(
        rank=rank,
        dp_rank=dp,
        pp_rank=pp,
        tp_rank=0,
        forward_time={1980: 0.01 * scale, 1005: 0.02 * scale},
        forward_energy={1980: 5.0 * scale, 1005: 3.0 * scale},
        backward_time={1980: 0.02 * scale, 1005: 0.04 * scale},
        backward_energy={1980: 10.0 * scale, 1005: 6.0 * scale},
    )


def test_short_form_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "p.csv"
    write_profile_rows(path, SHORT_ROWS)
    assert path.read_text().splitlines()[0] == ",".join(SHORT_COLUMNS)
    prof = read_profile_csv(path, num_stages=2)
    assert not prof.full_form
    assert [
        (r.stage, r.instruction, r.frequency, r.time, r.energy) for r in prof.rows
    ] == SHORT_ROWS
    assert prof.table[(0, "forward")][1980] == (0.0123456789012345, 8.5)  # Exact floats.
    assert prof.frequencies(0, "backward") == [1980, 1500]
    assert prof.stages == [0, 1]
    assert prof.rows[0].line == 2
    # Writing what was read gives the same file.
    again = tmp_path / "q.csv"
    write_profile_rows(again, prof.rows)
    assert again.read_text() == path.read_text()


def test_full_form_round_trip_and_replica_average(tmp_path: Path) -> None:
    results = [
        _result(0, 0, 0, 1.0),
        _result(1, 0, 1, 2.0),
        _result(2, 1, 0, 3.0),
        _result(3, 1, 1, 4.0),
    ]
    path = tmp_path / "full.csv"
    write_profile_csv(path, results)
    assert path.read_text().splitlines()[0] == ",".join(FULL_COLUMNS)
    prof = read_profile_csv(path, num_stages=2)
    assert prof.full_form
    assert len(prof.rows) == 16
    assert {r.rank for r in prof.rows} == {0, 1, 2, 3}
    # Stage 0 = ranks 0 and 2 (scales 1 and 3): both time and energy are averaged.
    t, e = prof.table[(0, "forward")][1980]
    assert t == pytest.approx(0.02) and e == pytest.approx(10.0)
    assert prof.replicas[(0, "forward", 1980)] == 2
    t, e = prof.table[(1, "backward")][1005]
    assert t == pytest.approx(0.04 * 3) and e == pytest.approx(6.0 * 3)
    # Rows carry their ranks and read back exactly.
    row = next(r for r in prof.rows if r.rank == 3 and r.instruction == "backward")
    assert (row.dp_rank, row.pp_rank, row.tp_rank, row.stage) == (1, 1, 0, 1)
    assert row.time == 0.02 * 4.0


def test_columns_in_any_order_and_case(tmp_path: Path) -> None:
    path = tmp_path / "p.csv"
    path.write_text(
        "Energy, time ,frequency,instruction,stage\n5.0,0.01,1980,Forward,0\n"
        "9.0,0.02,1980,backward,0\n\n"
    )
    prof = read_profile_csv(path, num_stages=1)
    assert prof.table[(0, "forward")] == {1980: (0.01, 5.0)}


def test_other_columns_are_ignored(tmp_path: Path) -> None:
    """The Perseus docs take any CSV that has the reference columns (lowtime reads it by name).

    A pandas ``to_csv`` without ``index=False`` adds a nameless index column; a profiler may add
    its own (``power``). Both forms read as if those columns were not there.
    """
    path = tmp_path / "p.csv"
    path.write_text(
        ",stage,instruction,frequency,time,energy,power\n"
        "0,0,forward,1980,0.01,5.0,500\n1,0,backward,1980,0.02,9.0,450\n"
    )
    prof = read_profile_csv(path, num_stages=1)
    assert not prof.full_form
    assert prof.table == {(0, "forward"): {1980: (0.01, 5.0)}, (0, "backward"): {1980: (0.02, 9.0)}}
    path.write_text(
        "host," + ",".join(FULL_COLUMNS) + ",,\n"
        "a,0,0,0,0,0,forward,1980,0.01,5.0,x,y\nb,0,0,0,0,0,backward,1980,0.02,9.0,x,y\n"
    )
    prof = read_profile_csv(path)
    assert prof.full_form
    assert prof.table[(0, "backward")] == {1980: (0.02, 9.0)}
    # A row must still have one field per header column.
    path.write_text(",stage,instruction,frequency,time,energy\n0,forward,1980,0.01,5.0\n")
    with pytest.raises(ConfigError, match=r"p\.csv:2: expected 6 fields"):
        read_profile_csv(path)


def test_whole_numbers_written_as_floats_read_as_integers(tmp_path: Path) -> None:
    # pandas writes an integer column that ever held a NaN as floats (1980.0); lowtime's and
    # Zeus's planners read it with int(row["frequency"]). It was refused here.
    path = tmp_path / "p.csv"
    path.write_text(
        ",".join(FULL_COLUMNS) + "\n"
        "0.0,0.0,0.0,0.0,0.0,forward,1980.0,0.01,5.0\n0,0,0,0,0,backward,1980.00,0.02,9.0\n"
    )
    prof = read_profile_csv(path, num_stages=1)
    assert prof.table == {(0, "forward"): {1980: (0.01, 5.0)}, (0, "backward"): {1980: (0.02, 9.0)}}
    assert all(type(f) is int for entry in prof.table.values() for f in entry)
    path.write_text(HEADER + "0,forward,1980.5,0.01,5.0\n")
    with pytest.raises(ConfigError, match=r"p\.csv:2: field 'frequency': not an integer"):
        read_profile_csv(path)


def _write(tmp_path: Path, text: str, name: str = "bad.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _refusal(path: Path) -> str:
    """The message of the :class:`ConfigError` that reading ``path`` raises."""
    with pytest.raises(ConfigError) as info:
        read_profile_csv(path)
    return str(info.value)


HEADER = "stage,instruction,frequency,time,energy\n"
FULL_HEADER = ",".join(FULL_COLUMNS) + "\n"


@pytest.mark.parametrize(
    ("text", "line", "field", "words"),
    [
        ("stage,instruction,frequency,time\n0,forward,1980,0.1\n", 1, "energy", "missing"),
        (
            HEADER.replace("energy", "joules"),
            1,
            "energy",
            "missing column(s) ['energy'] (columns ['joules'] are not read)",
        ),
        ("rank,stage,instruction,frequency,time,energy\n", 1, "dp_rank", "missing"),
        (HEADER + "0,forward,1980,0.1,1\n0,forward,fast,0.1,1\n", 3, "frequency", "integer"),
        (HEADER + "0,forward,1980,abc,1\n", 2, "time", "not a number"),
        (HEADER + "0,forward,1980,0.1,x\n", 2, "energy", "not a number"),
        (HEADER + "0,forward,1980,0,1\n", 2, "time", "positive"),
        (HEADER + "0,forward,1980,-0.5,1\n", 2, "time", "positive"),
        (HEADER + "0,forward,1980,0.1,-1\n", 2, "energy", "negative"),
        (HEADER + "0,forward,1980,nan,1\n", 2, "time", "finite"),
        (HEADER + "0,recompute,1980,0.1,1\n", 2, "instruction", "forward or backward"),
        (HEADER + "-1,forward,1980,0.1,1\n", 2, "stage", ">= 0"),
        # A clock of 10^20 MHz was planned and written into plan files.
        (HEADER + "0,forward,1" + "0" * 20 + ",0.1,1\n", 2, "frequency", "past 10000 MHz"),
        (HEADER + "0,forward,1980,0.1,1\n0,forward,10001.0,0.1,1\n", 3, "frequency", "10001 MHz"),
        (HEADER + "0,forward,1980,0.1,1\n0,forward,1980,0.2,1\n", 3, "frequency", "duplicate"),
        (FULL_HEADER + "0,0,1,0,0,forward,1980,0.1,1\n", 2, "stage", "pp_rank"),
        (FULL_HEADER + "0,0,x,0,0,forward,1980,0.1,1\n", 2, "pp_rank", "integer"),
        # int() and float() read any Unicode digit: Arabic-Indic 1980 was 1980 MHz, 0 stage 0.
        (HEADER + "0,forward,\u0661\u0669\u0668\u0660,0.1,1\n", 2, "frequency", "ASCII"),
        (HEADER + "\u0660,forward,1980,0.1,1\n", 2, "stage", "ASCII"),
        (HEADER + "0,forward,1980,\u0660.\u0661,1\n", 2, "time", "ASCII"),
        (HEADER + "0,forward,1980,0.1,\uff11\uff12\n", 2, "energy", "ASCII"),  # full-width
        (HEADER + "0,forward,1_980,0.1,1\n", 2, "frequency", "ASCII"),
        (HEADER + "0,forward,1980,0.1,1_0\n", 2, "energy", "ASCII"),
        (HEADER + "0,forward,\u00b9\u00b2,0.1,1\n", 2, "frequency", "ASCII"),  # superscripts
        (FULL_HEADER + "\u0660,0,0,0,0,forward,1980,0.1,1\n", 2, "rank", "ASCII"),
    ],
)
def test_bad_input_names_file_line_and_field(
    tmp_path: Path, text: str, line: int, field: str, words: str
) -> None:
    path = _write(tmp_path, text)
    message = _refusal(path)
    assert f"{path}:{line}:" in message
    assert f"'{field}'" in message
    assert words in message


def test_wrong_field_count_and_empty_file(tmp_path: Path) -> None:
    path = _write(tmp_path, HEADER + "0,forward,1980,0.1\n")
    with pytest.raises(ConfigError, match=r"bad\.csv:2: expected 5 fields"):
        read_profile_csv(path)
    path = _write(tmp_path, "")
    with pytest.raises(ConfigError, match=r"bad\.csv:1: empty"):
        read_profile_csv(path)
    path = _write(tmp_path, HEADER)
    with pytest.raises(ConfigError, match="no data rows"):
        read_profile_csv(path)
    with pytest.raises(ConfigError, match="cannot read profile"):
        read_profile_csv(tmp_path / "nope.csv")


def test_stage_coverage_when_num_stages_given(tmp_path: Path) -> None:
    path = _write(
        tmp_path, HEADER + "0,forward,1980,0.1,1\n0,backward,1980,0.2,2\n1,forward,1980,0.1,1\n"
    )
    read_profile_csv(path)  # Fine without a number of stages.
    with pytest.raises(
        ConfigError,
        match=r"field 'stage'/'instruction': no rows for stage 1 "
        r"backward",
    ):
        read_profile_csv(path, num_stages=2)
    with pytest.raises(ConfigError, match="no rows for stage 1 forward"):
        read_profile_csv(
            _write(tmp_path, HEADER + "0,forward,1980,0.1,1\n0,backward,1980,0.2,2\n", "other.csv"),
            num_stages=2,
        )
    with pytest.raises(ConfigError, match=r"bad\.csv:4: field 'stage': stage 1 is out of range"):
        read_profile_csv(path, num_stages=1)


def test_build_profile_without_file() -> None:
    from schedulers.planning.profile_csv import ProfileRow

    prof = build_profile([ProfileRow(*row) for row in SHORT_ROWS])
    assert prof.time(1, "forward", 1980) == 0.02
    assert prof.energy(0, "backward", 1500) == 14.5
    with pytest.raises(ConfigError, match="not profiled at 1234 MHz"):
        prof.time(0, "forward", 1234)
    with pytest.raises(ConfigError, match="no rows for stage 5"):
        prof.frequencies(5, "forward")


def _full(*rows: str) -> str:
    return FULL_HEADER + "".join(r + "\n" for r in rows)


# rank,dp_rank,pp_rank,tp_rank,stage,instruction,frequency,time,energy
@pytest.mark.parametrize(
    ("text", "line", "field", "words"),
    [
        # dp replicas 0 and 1 of stage 0: rank 1 lacks forward at 1500 MHz (rank 0, line 3).
        (
            _full(
                "0,0,0,0,0,forward,1980,0.1,1",
                "0,0,0,0,0,forward,1500,0.2,1",
                "1,1,0,0,0,forward,1980,0.1,1",
            ),
            3,
            "frequency",
            "rank 1 (forward rows from line 4) has no row at 1500 MHz, which rank 0 has (line 3)",
        ),
        # A rank with forward rows but no backward rows, while its replica has both.
        (
            _full(
                "0,0,0,0,0,forward,1980,0.1,1",
                "0,0,0,0,0,backward,1980,0.2,1",
                "1,1,0,0,0,forward,1980,0.1,1",
            ),
            3,
            "frequency",
            "different backward clocks: rank 1 (no backward rows) has no row at 1980 MHz",
        ),
        # The same rank in two stages.
        (
            _full("0,0,0,0,0,forward,1980,0.1,1", "0,0,1,0,1,backward,1980,0.2,1"),
            3,
            "stage",
            "rank 0 has stage 1 here but 0 at line 2",
        ),
        # The same rank with two tp ranks.
        (
            _full("0,0,0,0,0,forward,1980,0.1,1", "0,0,0,1,0,backward,1980,0.2,1"),
            3,
            "tp_rank",
            "rank 0 has tp_rank 1 here but 0 at line 2",
        ),
        # Two ranks in one place.
        (
            _full("0,0,0,0,0,forward,1980,0.1,1", "1,0,0,0,0,forward,1980,0.1,1"),
            3,
            "rank",
            "ranks 0 (line 2) and 1 have the same (dp_rank, pp_rank, tp_rank) = (0, 0, 0)",
        ),
    ],
)
def test_full_form_replicas_must_agree(
    tmp_path: Path, text: str, line: int, field: str, words: str
) -> None:
    path = _write(tmp_path, text)
    message = _refusal(path)
    assert message.startswith(f"{path}:{line}: field '{field}': ")
    assert words in message


def test_utf8_byte_order_mark_is_read(tmp_path: Path) -> None:
    path = tmp_path / "excel.csv"
    path.write_bytes(b"\xef\xbb\xbf" + (HEADER + "0,forward,1980,0.1,1\n").encode())
    assert read_profile_csv(path).table[(0, "forward")] == {1980: (0.1, 1.0)}


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ((HEADER + "0,forward,1980,0.1,1\n").encode("utf-16"), "is UTF-16 text"),
        (HEADER.encode() + b"0,forward,1980,0.1,\xff\n", "not UTF-8 text (invalid start byte"),
    ],
)
def test_not_utf8_names_the_file(tmp_path: Path, data: bytes, words: str) -> None:
    path = tmp_path / "wide.csv"
    path.write_bytes(data)
    message = _refusal(path)
    assert message.startswith(f"{path}: profile ")
    assert words in message


def test_a_quoted_value_over_several_lines_is_refused_not_glued(tmp_path: Path) -> None:
    # Read line by line, the pieces of "0.01<newline>5" were glued into a time of 0.015 s.
    path = _write(tmp_path, HEADER + "0,forward,1980,0.1,1\n" + '0,backward,1980,"0.01\n5",3\n')
    message = _refusal(path)
    assert message.startswith(f"{path}:3: field 'time': ")
    assert "runs over several lines" in message


def test_lines_are_counted_in_the_file_past_a_multiline_note(tmp_path: Path) -> None:
    # A column the planner ignores may hold a note over several lines; errors after it name
    # the line in the file, not the record's number.
    text = (
        "stage,instruction,frequency,time,energy,note\n"
        '0,forward,1980,0.1,1,"first\nsecond\nthird"\n'
        "0,backward,1980,-0.2,2,\n"
    )
    path = _write(tmp_path, text)
    assert _refusal(path).startswith(f"{path}:5: field 'time': ")
    rows = read_profile_csv(_write(tmp_path, text.replace("-0.2", "0.2"))).rows
    assert [r.line for r in rows] == [2, 5]
