"""Numbers in files, URLs and variables are ASCII digits: ``str.isdigit`` and ``int()`` are not.

``"²".isdigit()`` is true and ``int("²")`` raises, so a superscript passed the checks and ended
in a traceback; ``int()`` reads Arabic-Indic one as 1, so Arabic-Indic digits were read as numbers.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from protocol.connection import parse_sentinel_url
from protocol.exceptions import ConfigError
from protocol.numbers import ascii_float, ascii_int, is_ascii_digits
from schedulers.planning.choose import parse_policy
from schedulers.planning.frontier_files import load_frontier
from schedulers.planning.planner import plan_frontier
from schedulers.planning.synthetic_profile import synthetic_profile
from worker_client.gpu.nvml import NVML
from worker_client.gpu.p2p_power import parse_devices

SUPERSCRIPT_TWO = "\u00b2"
ARABIC_ONE = "\u0661"


def test_the_parsers_take_ascii_only() -> None:
    assert ascii_int(" 12 ") == 12 and ascii_int("-3") == -3
    assert ascii_float("1.5e3") == 1500.0 and ascii_float(".5") == 0.5
    assert ascii_float("nan") != ascii_float("nan")  # callers refuse it with their own words
    for bad in (ARABIC_ONE, SUPERSCRIPT_TWO, "1_000", "", "0x10", "\uff11", "1.5"):
        with pytest.raises(ValueError, match="ASCII"):
            ascii_int(bad)
    for bad in (ARABIC_ONE, "1_0.5", "", "0x1p3", "\uff11.5"):
        with pytest.raises(ValueError, match="ASCII"):
            ascii_float(bad)
    assert not is_ascii_digits(SUPERSCRIPT_TWO) and not is_ascii_digits("")
    assert is_ascii_digits("0042")


@pytest.mark.parametrize("devices", [f"{SUPERSCRIPT_TWO},1", f"{ARABIC_ONE},0"])
def test_p2p_devices_in_other_digits_are_a_config_error(devices: str) -> None:
    with pytest.raises(ConfigError, match="devices must be two GPU indices"):
        parse_devices(devices)


def test_a_cuda_visible_devices_entry_in_other_digits_ends_the_list_as_cuda_reads_it() -> None:
    nvml = NVML("tests.fake_nvml")
    # CUDA reads ASCII indices only: the list ends at the superscript (int() raised here).
    with pytest.raises(ConfigError, match="makes 1 visible"):
        nvml.cuda_to_nvml(1, f"0,{SUPERSCRIPT_TWO},1")
    assert nvml.visible_count(f"1,{ARABIC_ONE}") == 1


@pytest.mark.parametrize(
    "url",
    [
        f"redis+sentinel://h:{SUPERSCRIPT_TWO}/mymaster",
        f"redis+sentinel://h:{ARABIC_ONE}2/mymaster",  # was port 12
        "redis+sentinel://h:99999999/mymaster",
        f"redis+sentinel://h:26379/mymaster/{ARABIC_ONE}",  # was database 1
    ],
)
def test_a_sentinel_url_with_a_port_or_database_not_in_ascii_digits_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="sentinel URL"):
        parse_sentinel_url(url)


def test_a_frontier_csv_plan_number_in_other_digits_names_the_file_and_line(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    plan_frontier(synthetic_profile(2, stride=12), 2, 2, out_dir=out, unit_time=0.002)
    path = out / "frontier.csv"
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    good = load_frontier(out)
    assert good.point(good.points[0].plan) == good.points[0]
    with pytest.raises(ConfigError, match="no plan"):
        good.point(SUPERSCRIPT_TWO)  # int() raised ValueError
    for field, value, words in (
        ("plan", SUPERSCRIPT_TWO, "field 'plan': expected a plan number"),
        ("iteration_time", f"{ARABIC_ONE}.5", "field 'iteration_time': not a number"),
    ):
        edited = [dict(row) for row in rows]
        edited[0][field] = value
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(edited)
        with pytest.raises(ConfigError) as info:
            load_frontier(out)
        assert str(info.value).startswith(f"{path}:2: {words}"), info.value


@pytest.mark.parametrize(
    ("policy", "value", "says"),
    [
        # int()'s cousin float() read Arabic-Indic one as a deadline of 1 s.
        (f"deadline {ARABIC_ONE}", None, f"policy 'deadline {ARABIC_ONE}': '{ARABIC_ONE}' is not"),
        # The message showed '1-0': the policy's '_' -> '-' spelling was applied to the value.
        ("deadline 1_0", None, "policy 'deadline 1_0': '1_0' is not a number"),
        # A limit of inf s or nan s is none: 'deadline inf (limit inf s)' picked a plan.
        ("deadline inf", None, "deadline SECONDS must be a finite number, got inf"),
        ("max-slowdown infinity", None, "max-slowdown FACTOR must be a finite number, got inf"),
        ("straggler", float("nan"), "straggler SECONDS must be a finite number, got nan"),
    ],
)
def test_a_policy_value_is_a_finite_number_in_ascii_shown_as_typed(
    policy: str, value: float | None, says: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_policy(policy, value)
    assert says in str(info.value)


def test_policies_still_read_their_spellings() -> None:
    assert parse_policy("Max_Slowdown=1.5") == ("max-slowdown", 1.5)
    assert parse_policy(" deadline  2e-1 ") == ("deadline", 0.2)
