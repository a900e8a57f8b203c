"""make_3d_parallel: the pipeline view, result merging and schedule fan-out."""

from __future__ import annotations

import inspect
import itertools

import pytest

from protocol.exceptions import ConfigError, ProtocolError
from protocol.models import FrequencySchedule, JobInfo, ProfilingResult, RankInfo
from protocol.scheduler import FrequencyScheduler
from schedulers.parallel3d import check_rank_infos, make_3d_parallel, merge_stage_results
from tests.helpers import make_settings


class Recorder(FrequencyScheduler):
    """Pure-pipeline test scheduler: remembers what it sees, lowers clocks each round."""

    def __init__(self, job_info: JobInfo, rank_infos: list[RankInfo], step: int = 15) -> None:
        super().__init__(job_info, rank_infos)
        self.step = step
        self.observed: list[list[ProfilingResult]] = []
        self.targets: list[float] = []

    def observe(self, profiling_results: list[ProfilingResult]) -> None:
        self.observed.append(profiling_results)

    def next_schedule(self) -> list[FrequencySchedule]:
        version = len(self.observed) + 1
        return [
            FrequencySchedule(
                rank=info.rank,
                frequencies=[
                    ("forward", info.available_frequencies[0] - self.step * version),
                    ("backward", 1000 + 10 * info.rank),
                ],
                version=version,
            )
            for info in self.rank_infos
        ]

    def set_target(self, iteration_time: float) -> None:
        self.targets.append(iteration_time)


Recorder3D = make_3d_parallel(Recorder)


def job(pp: int, dp: int = 1, tp: int = 1) -> JobInfo:
    return JobInfo(job_id="j", pp_degree=pp, dp_degree=dp, tp_degree=tp, world_size=pp * dp * tp)


def ranks(pp: int, dp: int = 1, tp: int = 1) -> list[RankInfo]:
    """Ranks with pp outermost (rank = (p*dp + d)*tp + t), all at 1980..1500 MHz."""
    return [
        RankInfo(
            rank=rank,
            dp_rank=d,
            pp_rank=p,
            tp_rank=t,
            available_frequencies=list(range(1980, 1499, -15)),
        )
        for rank, (p, d, t) in enumerate(itertools.product(range(pp), range(dp), range(tp)))
    ]


def res(rank: int, times: list[float], energies: list[float], version: int = 1) -> ProfilingResult:
    return ProfilingResult(
        rank=rank, schedule_version=version, iter_time=times, iter_energy=energies
    )


def test_class_identity_and_signature() -> None:
    assert Recorder3D.__name__ == "Recorder3D"
    assert issubclass(Recorder3D, Recorder)
    assert (Recorder3D.__doc__ or "").startswith("[3D-parallel] Pure-pipeline test scheduler")
    assert list(inspect.signature(Recorder3D).parameters) == ["job_info", "rank_infos", "step"]
    assert make_3d_parallel(Recorder, name="Custom").__name__ == "Custom"


def test_cannot_wrap_twice_or_wrap_non_scheduler() -> None:
    with pytest.raises(ConfigError, match="already 3D-parallel"):
        make_3d_parallel(Recorder3D)
    with pytest.raises(ConfigError, match="not a FrequencyScheduler"):
        make_3d_parallel(int)  # type: ignore[type-var]


def test_wrapped_scheduler_sees_a_pure_pipeline() -> None:
    infos = ranks(4, dp=2)
    # The last rank of stage 2 supports fewer clocks; the stage gets the intersection.
    infos[5] = infos[5].model_copy(update={"available_frequencies": [1950, 1800, 1700, 1234]})
    infos[4] = infos[4].model_copy(update={"available_frequencies": [1500, 1700, 1950, 1965]})
    sched = Recorder3D(job(4, dp=2), list(reversed(infos)), step=30)
    assert sched.step == 30
    view = sched.job_info
    assert (view.pp_degree, view.dp_degree, view.tp_degree, view.world_size) == (4, 1, 1, 4)
    assert view.job_id == "j"
    assert sched.world_size == 4
    assert [(r.rank, r.pp_rank, r.dp_rank, r.tp_rank) for r in sched.rank_infos] == [
        (s, s, 0, 0) for s in range(4)
    ]
    assert sched.rank_infos[2].available_frequencies == [1950, 1700]  # highest first
    assert sched.rank_infos[0].available_frequencies == list(range(1980, 1499, -15))
    # make_3d_parallel is typed as returning the wrapped class, which lacks these attributes.
    assert getattr(sched, "real_job_info").world_size == 8  # noqa: B009
    assert [r.rank for r in getattr(sched, "real_rank_infos")] == list(range(8))  # noqa: B009


def test_no_common_frequency() -> None:
    infos = ranks(2, dp=2)
    infos[3] = infos[3].model_copy(update={"available_frequencies": [900]})
    with pytest.raises(ConfigError, match=r"stage 1 \(\[2, 3\]\) have no GPU frequency in common"):
        Recorder3D(job(2, dp=2), infos)


def test_schedules_fan_out_to_every_rank() -> None:
    infos = ranks(4, dp=2)
    sched = Recorder3D(job(4, dp=2), infos)
    schedules = sched.next_schedule()
    assert len(schedules) == 8
    assert [s.rank for s in schedules] == list(range(8))
    for s, info in zip(schedules, infos, strict=True):
        stage = info.pp_rank
        assert s.frequencies == [("forward", 1965), ("backward", 1000 + 10 * stage)]
        assert s.version == 1


def test_fan_out_with_tensor_parallel_interleaved_layout() -> None:
    # A layout where pp is the fastest-changing coordinate: rank r is stage r % 2.
    infos = [
        RankInfo(rank=r, dp_rank=0, pp_rank=r % 2, tp_rank=r // 2, available_frequencies=[1980])
        for r in range(6)
    ]
    sched = Recorder3D(job(2, tp=3), infos, step=0)
    by_rank = {s.rank: s.frequencies for s in sched.next_schedule()}
    assert [by_rank[r][1][1] for r in range(6)] == [1000, 1010] * 3


def test_observe_merges_each_stage_with_max_time_and_summed_energy() -> None:
    sched = Recorder3D(job(2, dp=2), ranks(2, dp=2))
    sched.next_schedule()
    results = [
        # stage 0 = ranks 0, 1; stage 1 = ranks 2, 3
        res(3, [1.5, 2.0], [30.0, 40.0]),
        res(0, [1.0, 2.5], [10.0, 20.0]),
        res(2, [1.7, 1.9], [5.0, 6.0]),
        res(1, [1.2, 2.4], [11.0, 21.0]),
    ]
    results[1].time_breakdown = {"forward": [[0.1, 0.4], [0.2, 0.2]]}
    results[3].time_breakdown = {"forward": [[0.3, 0.1], [0.1, 0.5]]}
    results[1].energy_breakdown = {"forward": [[1.0, 2.0], [3.0, 4.0]]}
    results[3].energy_breakdown = {"forward": [[0.5, 0.25], [1.0, 1.0]]}
    sched.observe(results)

    (merged,) = sched.observed
    assert [m.rank for m in merged] == [0, 1]
    stage0, stage1 = merged
    assert stage0.iter_time == [1.2, 2.5]
    assert stage0.iter_energy == [21.0, 41.0]
    assert stage1.iter_time == [1.7, 2.0]
    assert stage1.iter_energy == [35.0, 46.0]
    assert stage0.time_breakdown == {"forward": [[0.3, 0.4], [0.2, 0.5]]}
    assert stage0.energy_breakdown == {"forward": [[1.5, 2.25], [4.0, 5.0]]}
    assert stage1.time_breakdown == {} and stage1.energy_breakdown == {}
    assert stage0.schedule_version == stage1.schedule_version == 1

    # The next schedule reflects the observation and fans out again.
    second = sched.next_schedule()
    assert {s.version for s in second} == {2}
    assert [s.frequencies[0][1] for s in second] == [1950] * 4


def test_observe_missing_ranks_named() -> None:
    sched = Recorder3D(job(2, dp=2), ranks(2, dp=2))
    with pytest.raises(ProtocolError, match=r"no profiling results from ranks \[1, 3\]"):
        sched.observe([res(0, [1.0], [1.0]), res(2, [1.0], [1.0])])
    assert sched.observed == []


def test_observe_unknown_and_duplicate_ranks() -> None:
    sched = Recorder3D(job(2, dp=2), ranks(2, dp=2))
    good = [res(r, [1.0], [1.0]) for r in range(4)]
    with pytest.raises(ProtocolError, match="unknown rank 9"):
        sched.observe([*good, res(9, [1.0], [1.0])])
    with pytest.raises(ProtocolError, match="two results from rank 2"):
        sched.observe([*good, res(2, [1.0], [1.0])])


def test_observe_version_mismatch() -> None:
    sched = Recorder3D(job(2, dp=2), ranks(2, dp=2))
    results = [res(r, [1.0], [1.0]) for r in range(4)]
    results[1] = res(1, [1.0], [1.0], version=2)
    with pytest.raises(ProtocolError, match="stage 0: ranks report different schedule versions"):
        sched.observe(results)


def test_merge_rejects_shape_mismatches() -> None:
    with pytest.raises(ProtocolError, match="different numbers of iterations"):
        merge_stage_results(0, [res(0, [1.0], [1.0]), res(1, [1.0, 2.0], [1.0, 2.0])])
    a, b = res(0, [1.0], [1.0]), res(1, [1.0], [1.0])
    a.time_breakdown = {"forward": [[0.1, 0.2]]}
    b.time_breakdown = {"forward": [[0.1]]}
    with pytest.raises(ProtocolError, match="different shapes"):
        merge_stage_results(0, [a, b])
    b.time_breakdown = {"backward": [[0.1, 0.2]]}
    with pytest.raises(ProtocolError, match="covers different instructions"):
        merge_stage_results(0, [a, b])
    with pytest.raises(ProtocolError, match="no profiling results"):
        merge_stage_results(0, [])


def test_set_target_passes_through() -> None:
    sched = Recorder3D(job(2, dp=2), ranks(2, dp=2))
    sched.set_target(3.25)
    assert sched.targets == [3.25]


def test_set_target_rejected_when_wrapped_rejects() -> None:
    class Plain(FrequencyScheduler):
        def next_schedule(self) -> list[FrequencySchedule]:
            return []

    with pytest.raises(ConfigError, match="Plain3D does not take a target"):
        make_3d_parallel(Plain)(job(2), ranks(2)).set_target(1.0)


def test_wrapped_scheduler_returning_wrong_stages() -> None:
    class Broken(Recorder):
        def next_schedule(self) -> list[FrequencySchedule]:
            return super().next_schedule()[:-1]

    sched = make_3d_parallel(Broken)(job(3, dp=2), ranks(3, dp=2))
    with pytest.raises(ProtocolError, match="one schedule for each of 3 stages"):
        sched.next_schedule()


def test_generator_style_scheduler_wrapped() -> None:
    class TwoRounds(FrequencyScheduler):
        def _run(self):
            seen = yield [
                FrequencySchedule(rank=i.rank, frequencies=[("forward", 1980)], version=1)
                for i in self.rank_infos
            ]
            slowest = max(seen, key=lambda r: r.iter_time[0]).rank
            yield [
                FrequencySchedule(
                    rank=i.rank,
                    frequencies=[("forward", 1980 if i.rank == slowest else 1500)],
                    version=2,
                )
                for i in self.rank_infos
            ]

    sched = make_3d_parallel(TwoRounds)(job(2, dp=2), ranks(2, dp=2))
    assert {s.version for s in sched.next_schedule()} == {1}
    # Stage 1 holds the slowest rank (3), so only stage 1's ranks keep the top clock.
    sched.observe(
        [res(0, [1.0], [1.0]), res(1, [1.1], [1.0]), res(2, [0.9], [1.0]), res(3, [2.0], [1.0])]
    )
    second = {s.rank: s.frequencies[0][1] for s in sched.next_schedule()}
    assert second == {0: 1500, 1: 1500, 2: 1980, 3: 1980}


def test_a_generator_that_yields_no_first_schedule_is_named() -> None:
    # Zeus raises "The _run generator raised StopIteration on its first next call"; here the
    # bare StopIteration escaped, and the job failed as "StopIteration: " with no words.
    class Nothing(FrequencyScheduler):
        def _run(self):
            return
            yield

    with pytest.raises(ProtocolError, match=r"Nothing\._run returned before yielding a first"):
        Nothing(job(2), ranks(2)).next_schedule()


def test_missing_rank_infos_rejected() -> None:
    with pytest.raises(ProtocolError, match=r"ranks \[3\] have not registered"):
        Recorder3D(job(2, dp=2), ranks(2, dp=2)[:3])
    with pytest.raises(ProtocolError, match="registered twice"):
        Recorder3D(job(2, dp=2), [*ranks(2, dp=2), ranks(2, dp=2)[0]])
    # Two pipelines whose ranks all said dp_rank=0: ranks 0 and 1 are both dp 0 of stage 0.
    same = [r.model_copy(update={"dp_rank": 0}) for r in ranks(2, dp=2)]
    with pytest.raises(
        ProtocolError, match="ranks 0 and 1 both registered as dp_rank 0, pp_rank 0"
    ):
        Recorder3D(job(2, dp=2), same)


@pytest.mark.timeout(60)
def test_a_job_at_the_default_world_size_limit_is_checked_at_once() -> None:
    # Duplicates were counted rank by rank: 40,000 ranks took 99 s, and a job of
    # max_world_size's default (100,000) held its rq worker about ten minutes per build.
    size = make_settings("redis://localhost:1").max_world_size
    infos = [
        RankInfo(rank=i, dp_rank=i, pp_rank=0, tp_rank=0, available_frequencies=[1980])
        for i in range(size)
    ]
    assert len(check_rank_infos(job(1, dp=size), infos)) == size
    with pytest.raises(ProtocolError, match=r"ranks \[7\] registered twice"):
        check_rank_infos(job(1, dp=size), [*infos, infos[7]])


def test_messages_about_a_5000_rank_job_name_a_few_ranks_and_count_them_all() -> None:
    # Every rank was listed: a job's error (stored, sent to every rank's watcher) and the
    # dead letters grew by kilobytes per thousand ranks.
    size = 5_000
    big, infos = job(1, dp=size), ranks(1, dp=size)
    short = "[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, ... and 4,989 more (4,999 in all)]"
    with pytest.raises(ProtocolError) as info:
        check_rank_infos(big, infos[:1])
    assert str(info.value) == f"job j: ranks {short} have not registered"
    with pytest.raises(ProtocolError) as info:
        check_rank_infos(big, infos + infos)
    assert "... and 4,990 more (5,000 in all)] registered twice" in str(info.value)
    assert len(str(info.value)) < 200

    sched = Recorder3D(big, infos)
    with pytest.raises(ProtocolError) as info:
        sched.observe([res(0, [1.0], [1.0])])
    assert str(info.value) == f"job j: no profiling results from ranks {short}"
    results = [res(r, [1.0], [1.0], version=1 + r % 2) for r in range(size)]
    with pytest.raises(ProtocolError) as info:
        merge_stage_results(0, results)
    said = str(info.value)
    assert said.startswith("stage 0: ranks report different schedule versions (1: ranks ["), said
    assert "(2,500 in all)]" in said and len(said) < 400, said
    lonely = [r.model_copy(update={"available_frequencies": [r.rank + 1]}) for r in infos]
    with pytest.raises(ConfigError) as refused:
        Recorder3D(big, lonely)
    assert "(5,000 in all)]) have no GPU frequency in common" in str(refused.value)
    assert len(str(refused.value)) < 200
