"""The simulated GPU under torch's own pipeline schedules (engine="torch-pipelining")."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from coordinator.cli import main
from coordinator.demo import DemoConfig, format_report, run_demo
from protocol.store import JobStore
from schedulers.planning.pipeline_dag import PipelineShape
from schedulers.planning.plan_file import parse_plan_text, read_plan_file, write_plan_file
from tests.helpers import wait_for
from worker_client.simulated.gpu import synthetic_instruction_table
from worker_client.simulated.training import SimulatedRankConfig, launch_simulated_job

CLOCKS = [1980, 1800, 1500]


def mixed_plan(tmp_path, schedule: str, stages: int, micro: int) -> tuple[str, PipelineShape]:
    """A plan with a different clock per (stage, position), so the replayed times differ."""
    shape = PipelineShape(stages, micro, schedule)
    lines = [
        [(name, CLOCKS[(s + k) % len(CLOCKS)]) for k, name in enumerate(shape.order[s])]
        for s in range(stages)
    ]
    path = tmp_path / f"{schedule}.py"
    write_plan_file(path, lines, {"pipeline_schedule": schedule})
    return path.read_text(), shape


@pytest.mark.parametrize(("schedule", "dp"), [("1f1b", 1), ("gpipe", 1), ("gpipe", 2)])
def test_torch_schedule_on_simulated_gpus_follows_the_dag(
    schedule, dp, hook_service, redis_url, r, tmp_path, monkeypatch
):
    # As on a host that lends this process one GPU: simulated ranks drive simulated GPUs
    # 0..N-1 whatever CUDA_VISIBLE_DEVICES says (the rank processes inherit it).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    _coord, start_worker = hook_service
    start_worker()
    stages, micro = (4, 8) if dp == 1 else (2, 4)
    table = synthetic_instruction_table(stages, blocking_power_w=90.0)
    plan_text, shape = mixed_plan(tmp_path, schedule, stages, micro)
    clocks = [clock for s in range(stages) for _, clock in _pairs(plan_text, s)]
    times = [table[(s, name, f)][0] for (s, name, _), f in zip(shape.nodes, clocks, strict=True)]
    energies = [table[(s, name, f)][1] for (s, name, _), f in zip(shape.nodes, clocks, strict=True)]
    makespan = shape.makespan(times)
    records = launch_simulated_job(
        stages,
        micro,
        dp,
        table,
        redis_url,
        steps=3,
        report_every=3,
        time_scale=0.01,
        engine="torch-pipelining",
        schedule=schedule,
        scheduler="PointSolution3D",
        scheduler_args={"plan_text": plan_text},
        timeout=180,
    )
    assert len(records) == stages * dp
    for rec in records:
        s = rec["pp_rank"]
        own = [i for i, node in enumerate(shape.nodes) if node[0] == s]
        compute_t, compute_e = sum(times[i] for i in own), sum(energies[i] for i in own)
        assert [tuple(p) for p in rec["schedules"]["1"]] == _pairs(plan_text, s)
        for it, energy in zip(rec["iter_time"], rec["iter_energy"], strict=True):
            # Virtual clocks ride along torch's own sends: the iteration is the DAG's.
            assert it == pytest.approx(makespan, rel=1e-9)
            assert energy == pytest.approx(compute_e + 90.0 * (makespan - compute_t), abs=3e-3)
        assert rec["compute_time"][0] == pytest.approx(compute_t)
        if s == stages - 1:
            assert len(rec["losses"]) == 3 and rec["losses"][2] < rec["losses"][0]
    # Every rank's result (measured in profile units) reached the coordinator.
    store = JobStore(r)
    job_id = records[0]["job_id"]
    wait_for(lambda: len(store.results(job_id, 1)) == stages * dp, 20, "every rank's result")
    results = store.results(job_id, 1)
    for res in results:
        assert res.iter_time == pytest.approx([makespan] * 3, rel=1e-9)


def _pairs(plan_text: str, stage: int) -> list[tuple[str, int]]:
    return parse_plan_text(plan_text).stages[stage]


def test_engine_and_schedule_are_checked() -> None:
    base = {"rank": 0, "world_size": 2, "num_stages": 2, "microbatches": 2}
    common = {"init_method": "tcp://x", "redis_url": "redis://x", "table": [], "steps": 1}
    with pytest.raises(ValueError, match="engine must be one of"):
        SimulatedRankConfig(**base, **common, engine="deepspeed")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unsupported pipeline schedule 'zb'"):
        SimulatedRankConfig(**base, **common, schedule="zb")


def test_demo_through_torch_gpipe_saves_what_the_planner_predicts(tmp_path, redis_url, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_GPU_DIR", str(tmp_path / "gpus"))
    config = DemoConfig(
        stages=2,
        microbatches=4,
        redis_url=redis_url,
        out_dir=tmp_path / "out",
        clock_stride=10,
        train_steps=3,
        engine="torch-pipelining",
        schedule="gpipe",
    )
    report = run_demo(config, progress=lambda line: None)
    assert report.plans > 1 and report.predicted_saving_pct > 1.0
    assert abs(report.saving_pct - report.predicted_saving_pct) <= 3.0, format_report(report)
    slack = report.rounding_s / report.allmax.iteration_time * 100  # type: ignore[union-attr]
    assert report.slowdown_pct <= slack, format_report(report)
    plan = read_plan_file(tmp_path / "out" / "frontier" / f"freqs_pipeline_{report.chosen_plan}.py")
    assert plan.header["pipeline_schedule"] == "gpipe"


def test_demo_refuses_fewer_microbatches_than_stages_for_torch_1f1b():
    args = ["demo", "--engine", "torch-pipelining", "--stages", "4", "--microbatches", "2"]
    result = CliRunner().invoke(main, args)
    assert (
        result.exit_code == 2
        and "Schedule1F1B needs at least as many microbatches" in result.output
    )
