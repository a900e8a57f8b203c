"""benchmarks/bench_trace.py: its wrappers still find what they time, and every step shows up.

The figures are timings and are not checked beyond their order along one version's path.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT, subprocess_env


def test_a_short_trace_times_every_step_in_order(tmp_path: Path) -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_trace.py"), "--versions", "14"]
    proc = subprocess.Popen(
        command,
        env=subprocess_env(tmp_path),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a hang is killed with its Redis and services
    )
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out
    rows = dict(
        (text, float(ms)) for ms, text in re.findall(r"^\s+(\d+\.\d+)  (.+)$", out, flags=re.M)
    )
    assert len(rows) == 11, out  # every step was traced (none printed as "-")
    # BLMOVE, fetched, start sent, answered, advance_job, publish, its answer, rq's bookkeeping:
    # one process's calls one after the other. The client sees the version once the script ran.
    worker = [rows[name] for name in rows if name.startswith("worker:")]
    assert len(worker) == 8 and worker == sorted(worker), out
    assert worker[5] < rows["client: the version is visible"], out
    assert rows["coordinator: the round's last batch begins"] < worker[0], out
