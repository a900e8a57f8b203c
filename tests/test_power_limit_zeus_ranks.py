"""Issue 15's point 8 across two real ranks: ranks whose GPUs, arguments or profiles differ.

Zeus's optimizer let each rank walk its own ladder or choose alone; here every rank refuses at
once, naming the rank and what differs, or chooses from the same measurements. Each rank is a
process of its own over gloo (tests/power_limit_rank.py) on the fake NVML: no real GPU.
"""

from __future__ import annotations

from pathlib import Path

from protocol.models import PowerLimitMeasurement, PowerLimitProfile
from tests.power_limit_rank import TABLE as RANK_TABLE
from tests.power_limit_rank import run_two_ranks


def test_ranks_whose_gpus_have_different_limit_ranges_are_refused(tmp_path: Path) -> None:
    # Rank 0's GPU goes to 300 W, rank 1's to 250 W: each rank walked its own ladder, so the
    # all-reduce of rank 1's 250 W window paired with rank 0's 300 W one (a "250 W"
    # measurement holding 300 W energy), rank 1 chose from 2 limits and went on training while
    # rank 0 waited in the all-reduce of its third limit. Every rank now refuses at once.
    outputs = run_two_ranks(
        tmp_path,
        *(
            [str(tmp_path / f"profile{rank}.json"), str(max_w)]
            for rank, max_w in [(0, 300), (1, 250)]
        ),
    )
    for out in outputs:
        assert out.startswith("ConfigError: "), outputs
        assert "different power limits" in out
    assert "300 W down to 200 W" in outputs[0] and "250 W down to 200 W" in outputs[1]


def test_a_bad_profile_file_on_one_rank_stops_every_rank_instead_of_hanging(
    tmp_path: Path,
) -> None:
    # Rank 0's node holds a profile file that is no profile, rank 1's none (local disks):
    # rank 0 raised before the construction's all-reduce, and rank 1 waited in it for ever.
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    outputs = run_two_ranks(tmp_path, [str(bad)], [str(tmp_path / "none.json")])
    assert outputs[0].startswith("ConfigError: ") and "bad.json" in outputs[0], outputs
    assert outputs[1].startswith("ConfigError: 1 other rank(s) could not start"), outputs


def test_a_rank_with_a_bad_argument_stops_every_rank_naming_it(tmp_path: Path) -> None:
    # Rank 0's profile_path names a folder its node lacks: it raised while checking its
    # arguments, before the construction's all-reduce, and rank 1 waited there (gloo's
    # "Connection closed by peer" once rank 0's process was gone, its timeout while it lived).
    missing = tmp_path / "no-such-folder" / "profile.json"
    outputs = run_two_ranks(tmp_path, [str(missing)], [str(tmp_path / "profile.json")])
    why = f"ConfigError: profile_path {str(missing)!r}: its folder"
    assert outputs[0].startswith(why), outputs
    assert outputs[1].startswith("ConfigError: 1 other rank(s) could not start"), outputs
    assert f"(rank 0: {why}" in outputs[1], outputs


def test_ranks_given_different_selectors_all_choose_a_limit(tmp_path: Path) -> None:
    # Rank 0 passes Energy(), rank 1 leaves the default: once the last limit was measured,
    # only rank 1 reduced the GPU count for its default selector, and waited there alone.
    outputs = run_two_ranks(
        tmp_path,
        *([str(tmp_path / f"profile{rank}.json"), "300", *extra] for rank, extra in
          [(0, ["energy"]), (1, [])]),
    )  # fmt: skip
    # Each chose with its own selector from the same measurements (3 limits).
    assert [out.split() for out in outputs] == [["Done(200)", "3"], ["Done(250)", "3"]]


def test_ranks_that_loaded_profiles_of_other_runs_say_their_limits_differ(tmp_path: Path) -> None:
    # A stale profile on one node's disk: the ranks trained at 250 W and 300 W, unsaid.
    from worker_client.power_limit.profile import save_profile_file

    measured = [
        PowerLimitMeasurement(power_limit=w, time=2 * t, energy=4 * t * p)
        for w, (t, p) in RANK_TABLE.items()
    ]
    save_profile_file(PowerLimitProfile(measurements=measured), tmp_path / "p0.json")
    save_profile_file(PowerLimitProfile(measurements=measured[:1]), tmp_path / "p1.json")
    same = run_two_ranks(tmp_path, *([str(tmp_path / "p0.json")] for _ in range(2)), stderr=True)
    assert [out.split()[0] for out in same] == ["Done(250)"] * 2, same
    assert not any("limits differ" in out for out in same), same
    (tmp_path / "pg").unlink(missing_ok=True)
    outputs = run_two_ranks(
        tmp_path, [str(tmp_path / "p0.json")], [str(tmp_path / "p1.json")], stderr=True
    )
    assert [out.split()[0] for out in outputs] == ["Done(250)", "Done(300)"], outputs
    for out, mine in zip(outputs, ("250 W", "300 W"), strict=True):
        assert f"optimal power limits differ: 250 W to 300 W (this rank: {mine})" in out, out
