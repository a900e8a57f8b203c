"""benchmarks/bench_hook_overhead.py on CPU torch and the simulated GPU (``--simulate``).

The figures are timings and are not checked; what is checked is that each variant does what
its row claims: how often it waits for the GPU and how many clock changes it requests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from protocol.pipeline_schedules import stage_order
from tests.helpers import ROOT, subprocess_env


def _clock_changes_per_step() -> int:
    """F and B run at different clocks: every switch, the step's wrap-around included."""
    order = stage_order("1f1b", 4, 8, 0)
    return sum(a != b for a, b in zip(order, order[1:] + order[:1], strict=True))


def test_simulated_run_reports_every_variant(tmp_path: Path) -> None:
    out = tmp_path / "hook.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_hook_overhead.py"),
            "--simulate",
            "--rounds",
            "2",
            "--block",
            "2",
            "--layers",
            "1",
            "--json",
            str(out),
        ],
        env=subprocess_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    rows = figures["variants"]
    assert list(rows) == [
        "bare",
        "sync only",
        "steady",
        "steady events",
        "measure",
        "measure+ie",
        "measure+ie counter",
        "events",
        "events spin",
    ]
    assert figures["steps"] == 2  # the first round is a warm-up
    assert all(row["p50_ms"] > 0 for row in rows.values())
    changes = _clock_changes_per_step()
    # Measuring waits at both ends of each instruction and of the step; after the window only
    # clock changes wait; the event variants never wait on the training thread.
    assert rows["sync only"]["syncs_per_step"] == 2 * 16 + 2
    assert rows["measure"]["syncs_per_step"] == rows["measure+ie"]["syncs_per_step"] == 34
    assert rows["steady"]["syncs_per_step"] == changes
    for variant in ("steady events", "events", "events spin"):
        assert rows[variant]["syncs_per_step"] == 0, variant
    hooked = [v for v in rows if v not in ("bare", "sync only")]
    assert all(rows[v]["requests_per_step"] == changes for v in hooked)
    assert rows["measure+ie counter"]["energy_source"] == "CounterEnergySource"
    # Both timing methods measured both instructions.
    for variant in ("measure", "events"):
        assert set(figures["instruction_ms"][variant]) == {"forward", "backward"}
    assert "instruction times measured by events" in proc.stdout
