"""What `perseus worker` logs while Redis is down: one line when it goes, one when it is back.

rq logs an ERROR for each failed reconnect of its work loop (every 1 to 5 s) and of its pubsub
thread (every 2 s): a ten-minute outage wrote hundreds of lines, none saying when it ended.
"""

from __future__ import annotations

import re

from coordinator.embedded import EmbeddedRedis
from tests.helpers import start_perseus, stop, wait_for


def test_an_idle_worker_logs_an_outage_once_and_its_end_once(tmp_path):
    with EmbeddedRedis(appendonly=True) as server:
        worker = start_perseus(["worker", "--redis-url", server.url], tmp_path, "w.log")
        log = tmp_path / "w.log"
        try:
            wait_for(lambda: "Listening on perseus" in log.read_text(), 30, "the worker")
            server.restart(downtime=8.0)
            wait_for(lambda: "answers again" in log.read_text(), 30, "the worker's reconnect")
            text = log.read_text()
        finally:
            stop([worker])
    errors = [line for line in text.splitlines() if " ERROR " in line]
    assert not errors, text
    down = re.findall(r"redis unavailable .*", text)
    assert len(down) == 1, text
    assert "retrying" in down[0]
    assert re.search(r"redis answers again after \d+(\.\d+)? s", text), text
