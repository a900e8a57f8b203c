"""A power-limit optimizer that fails on one rank fails every rank at once, naming it (gloo)."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.models import PowerLimitMeasurement, PowerLimitProfile
from tests.power_limit_rank import TABLE, run_two_ranks
from worker_client.power_limit.profile import load_profile_file, save_profile_file

LOST = "GPUError: the energy sampler thread failed: GPU is lost"


def test_a_monitor_that_fails_on_one_rank_stops_every_rank_naming_it(tmp_path: Path) -> None:
    # Rank 1's EnergyMonitor could not start (README's usage: the monitor first, then the
    # optimizer): rank 1 raised before its optimizer existed and rank 0 waited in the
    # optimizer's first all-reduce. Handed to refuse_to_start, its error reaches rank 0 there.
    outputs = run_two_ranks(
        tmp_path,
        [str(tmp_path / "profile0.json")],
        [str(tmp_path / "profile1.json"), "300", "fail-monitor"],
    )
    why = "ConfigError: gpu_indices [1] must be distinct CUDA indices < 1"
    assert outputs[1].startswith(why), outputs
    assert outputs[0].startswith(
        f"ConfigError: 1 other rank(s) could not start their power-limit optimizer (rank 1: {why})"
    ), outputs


SET = "GPUError: NVML nvmlDeviceSetPowerManagementLimit on GPU 0 failed: lost"


@pytest.mark.parametrize(
    ("option", "why"),
    [
        pytest.param(option, why, id=option)
        for option, why in [
            ("fail-window", LOST),
            ("fail-window-carry", LOST),
            ("fail-set", SET),
            ("fail-set-epoch", SET),
            ("fail-max", SET),
            ("fail-set-carry", SET),
            ("fail-cancel", LOST),
        ]
    ],
)
def test_a_window_limit_or_cancel_that_fails_on_one_rank_stops_every_rank_naming_it(
    tmp_path: Path, option: str, why: str
) -> None:
    # Rank 1's monitor failed to end the 250 W window (its sampler died; with
    # carry_across_epochs at an epoch end), or its NVML could not set 250 W (after 300 W was
    # measured, at a step begin after an epoch end, or as its paused warm-up resumed) or
    # restore 300 W at an epoch end, or its monitor could not cancel the 250 W window at an
    # epoch end (Zeus's default mode). Rank 1 raised alone, at that step begin or epoch end,
    # and rank 0 waited in 250 W's all-reduce (gloo's "Connection closed by peer" once rank 1
    # was gone). Now both raise in that all-reduce, rank 0 naming rank 1's error.
    outputs = run_two_ranks(
        tmp_path,
        [str(tmp_path / "profile0.json")],
        [str(tmp_path / "profile1.json"), "300", option],
    )
    lines = [out.splitlines() for out in outputs]
    assert lines[1][0] == why, outputs
    assert lines[0][0] == (
        f"PerseusError: another rank could not measure power limit 250 W (rank 1: {why}): "
        "no rank records it (a step begin after this error profiles it again)"
    ), outputs
    # Every rank kept 300 W only, and would profile 250 W again.
    assert [line[1] for line in lines] == ["Ready(250,1) 1"] * 2
    assert not (tmp_path / "profile0.json").exists()


def test_a_maximum_that_cannot_be_set_on_one_rank_stops_every_rank_at_start(tmp_path: Path) -> None:
    # Rank 1's GPU was left at 250 W and NVML could not raise it to 300 W as its optimizer
    # started: rank 1's constructor raised alone, after the last collective of rank 0's, which
    # then waited in 300 W's all-reduce. Now every constructor raises, naming it.
    outputs = run_two_ranks(
        tmp_path,
        [str(tmp_path / "profile0.json")],
        [str(tmp_path / "profile1.json"), "300", "fail-start"],
    )
    assert outputs[1].startswith(SET), outputs
    assert outputs[0].startswith(
        f"ConfigError: 1 other rank(s) could not start their power-limit optimizer (rank 1: {SET})"
    ), outputs


def test_an_optimum_that_cannot_be_set_on_one_rank_stops_every_rank_naming_it(
    tmp_path: Path,
) -> None:
    # Every limit measured, rank 1's NVML could not set the optimum (250 W): rank 1 raised
    # alone without saving the profile, while rank 0 saved its own and trained on at 250 W,
    # rank 1's GPU at 200 W, with no collective left to tell it. Now every rank saves the
    # profile, then raises, and the next step begin sets the optimum on every rank again.
    outputs = run_two_ranks(
        tmp_path,
        [str(tmp_path / "profile0.json"), "300", "go-on"],
        [str(tmp_path / "profile1.json"), "300", "fail-optimum"],
    )
    lines = [out.splitlines() for out in outputs]
    assert lines[1][0] == SET, outputs
    assert lines[0][0] == (
        f"PerseusError: another rank could not set the optimal power limit 250 W (rank 1: {SET}): "
        "the profile is saved, and a step begin after this error sets the limit again"
    ), outputs
    assert [line[1:] for line in lines] == [["Done(250) 3", "250"]] * 2
    profiles = [load_profile_file(tmp_path / f"profile{rank}.json") for rank in (0, 1)]
    assert [p.optimal_power_limit for p in profiles] == [250, 250]
    assert profiles[0].measurements == profiles[1].measurements


def test_a_loaded_optimum_that_cannot_be_set_on_one_rank_stops_every_rank_at_start(
    tmp_path: Path,
) -> None:
    # Both ranks loaded a profile whose optimum is 250 W; rank 1's NVML could not set it: its
    # constructor raised alone, after the last collective of rank 0's, which trained on at
    # 250 W (rank 1's GPU at 300 W). Now every constructor raises, naming it.
    measured = [
        PowerLimitMeasurement(power_limit=w, time=2 * t, energy=4 * t * p)
        for w, (t, p) in TABLE.items()
    ]
    for rank in (0, 1):
        save_profile_file(
            PowerLimitProfile(measurements=measured), tmp_path / f"profile{rank}.json"
        )
    outputs = run_two_ranks(
        tmp_path,
        [str(tmp_path / "profile0.json")],
        [str(tmp_path / "profile1.json"), "300", "fail-optimum-loaded"],
    )
    assert outputs[1].startswith(SET), outputs
    assert outputs[0].startswith(
        f"PerseusError: another rank could not set the optimal power limit 250 W (rank 1: {SET})"
    ), outputs


def test_a_selector_that_fails_on_one_rank_stops_every_rank_naming_it(tmp_path: Path) -> None:
    # Rank 1's selector raised once every limit was measured, alone: rank 0 chose 250 W and
    # waited in the all-reduce that agrees on it (gloo's "Connection closed by peer" once
    # rank 1 was gone). Now rank 1's error reaches rank 0 there.
    outputs = run_two_ranks(
        tmp_path,
        [str(tmp_path / "profile0.json")],
        [str(tmp_path / "profile1.json"), "300", "fail-selector"],
    )
    why = "ConfigError: the selector's table is missing on this node"
    lines = [out.splitlines() for out in outputs]
    assert lines[1][0] == why, outputs
    assert lines[0][0].startswith(
        f"PerseusError: another rank could not set the optimal power limit 250 W (rank 1: {why})"
    ), outputs
    # Every limit measured is kept: rank 1 saved them without an optimum.
    assert load_profile_file(tmp_path / "profile1.json").optimal_power_limit is None


def test_a_rank_that_closes_alone_returns_at_once_and_the_others_fail_in_their_collective(
    tmp_path: Path,
) -> None:
    # close() takes no collective: rank 1, closing mid-profiling while rank 0 trains on,
    # restores its maximum and returns. Rank 0's next all-reduce (250 W's) waits for rank 1,
    # as any collective does, and fails once rank 1 leaves the group (here: exits), rather
    # than waiting out the group's timeout (README: call close() on every rank).
    outputs = run_two_ranks(
        tmp_path,
        [str(tmp_path / "profile0.json")],
        [str(tmp_path / "profile1.json"), "300", "close-early"],
    )
    assert outputs[1] == "closed Ready(250,1) 300\n", outputs
    first, *_, last = outputs[0].splitlines()
    assert first.startswith(("DistBackendError", "RuntimeError")), outputs  # gloo's read error
    assert last == "Ready(250,1) 1", outputs  # 300 W measured together; 250 W not reduced
