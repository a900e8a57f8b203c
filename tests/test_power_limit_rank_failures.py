"""A power-limit optimizer that fails on one rank fails every rank at once, naming it (gloo)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.power_limit_rank import run_two_ranks

LOST = "GPUError: the energy sampler thread failed: GPU is lost"


@pytest.mark.parametrize("option", ["fail-window", "fail-window-carry"])
def test_a_window_that_fails_on_one_rank_stops_every_rank_naming_it(
    tmp_path: Path, option: str
) -> None:
    # Rank 1's monitor failed to end the 250 W window (its sampler died; with
    # carry_across_epochs at an epoch end): rank 1 raised alone and rank 0 waited in the
    # limit's all-reduce (gloo's "Connection closed by peer" once rank 1 was gone).
    outputs = run_two_ranks(
        tmp_path,
        [str(tmp_path / "profile0.json")],
        [str(tmp_path / "profile1.json"), "300", option],
    )
    lines = [out.splitlines() for out in outputs]
    assert lines[1][0] == LOST, outputs
    assert lines[0][0] == (
        f"PerseusError: another rank could not measure power limit 250 W (rank 1: {LOST}): "
        "no rank records it (a step begin after this error profiles it again)"
    ), outputs
    # Every rank kept 300 W only, and would profile 250 W again.
    assert [line[1] for line in lines] == ["Ready(250,1) 1"] * 2
    assert not (tmp_path / "profile0.json").exists()


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
