"""The test suite itself stops on Ctrl-C, whatever a test left installed in its process."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT, subprocess_env


def test_ctrl_c_stops_the_suite_after_an_in_process_rq_worker(redis_url: str) -> None:
    """rq's worker installs its own SIGINT and SIGTERM handlers and never puts them back.

    After a test that ran one in the pytest process, Ctrl-C (or `timeout`'s SIGTERM) only
    asked that long-gone worker to stop: the suite ran on to its end, about 12 minutes.
    """
    probe = "tests/interrupt_probe.py"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", probe],
        cwd=ROOT,
        env=subprocess_env(REDIS_URL=redis_url),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "RAN AFTER CTRL-C" not in run.stdout, run.stdout
    assert run.returncode == 2, run.stdout + run.stderr  # pytest's "interrupted"
    assert "KeyboardInterrupt" in run.stdout
