"""A small `perseus demo` end to end: measured saving matches the planner's prediction."""

from __future__ import annotations

from click.testing import CliRunner

from coordinator.cli import main
from coordinator.demo import DemoConfig, format_report, run_demo


def test_small_demo_saves_what_the_planner_predicts(tmp_path, redis_url, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_GPU_DIR", str(tmp_path / "gpus"))
    lines: list[str] = []
    config = DemoConfig(
        stages=2,
        microbatches=4,
        redis_url=redis_url,
        out_dir=tmp_path / "out",
        clock_stride=10,
        train_steps=4,
    )
    report = run_demo(config, progress=lines.append)

    assert report.allmax is not None and report.plan is not None
    assert report.plans > 1 and report.predicted_saving_pct > 1.0
    # Energy saving measured in training matches the planner's prediction within 3 points.
    assert abs(report.saving_pct - report.predicted_saving_pct) <= 3.0, format_report(report)
    # The no-slowdown plan is not slower than all-max beyond the planner's rounding.
    slack = report.rounding_s / report.allmax.iteration_time * 100
    assert report.slowdown_pct <= slack, format_report(report)
    assert report.frontier_png is not None and report.frontier_png.read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "out" / "profile.csv").exists()
    assert any("[4/4]" in line for line in lines)
    assert set(report.job_ids) == {"profile", "allmax", "plan"}
    assert report.job_ids["profile"].endswith("+InstructionProfiler+demo-profile")


def test_demo_rejects_bad_arguments():
    result = CliRunner().invoke(main, ["demo", "--stages", "1"])
    assert result.exit_code == 2 and "at least 2 stages" in result.output
    result = CliRunner().invoke(main, ["demo", "--microbatches", "0"])
    assert result.exit_code == 2 and "--microbatches" in result.output
