"""benchmarks/bench_trace.py: its wrappers still find what they time, and every step shows up.

The figures are timings and are not checked beyond their order along one version's path.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT, subprocess_env


def test_a_short_trace_times_every_step_in_order(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_trace.py"), "--versions", "14"],
        env=subprocess_env(tmp_path),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = dict(
        (text, float(ms))
        for ms, text in re.findall(r"^\s+(\d+\.\d+)  (.+)$", proc.stdout, flags=re.MULTILINE)
    )
    assert len(rows) == 11, proc.stdout  # every step was traced (none printed as "-")
    worker = [rows[name] for name in rows if name.startswith("worker:")]
    # BLMOVE, fetched, start sent, answered, advance_job, publish, its answer, rq's bookkeeping;
    # the client sees the version once the script ran (before or after the worker reads that).
    assert worker == sorted(worker), proc.stdout
    assert worker[5] < rows["client: the version is visible"] < worker[7], proc.stdout
    chain = worker
    assert rows["coordinator: the round's last batch begins"] < chain[0], proc.stdout
