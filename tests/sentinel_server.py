"""A redis-server in sentinel mode watching a test's master, for ``redis+sentinel://`` URLs."""

from __future__ import annotations

import subprocess
from pathlib import Path

from coordinator.embedded import redis_server_binary

SENTINEL_SERVICE = "perseus"  # the master's name for the sentinels of start_sentinel


def start_sentinel(
    folder: Path,
    port: int,
    master_port: int,
    quorum: int = 2,
    master_password: str = "",
    down_after_ms: int = 1000,
) -> subprocess.Popen:
    """A redis-server in sentinel mode on ``port`` watching the master on ``master_port``.

    ``down_after_ms``: how long the master may not answer before the sentinel takes it as
    down (and names no master: redis-py's Sentinel refuses one flagged down).
    """
    folder.mkdir(parents=True, exist_ok=True)
    conf = folder / "sentinel.conf"
    auth = f"sentinel auth-pass {SENTINEL_SERVICE} {master_password}\n" if master_password else ""
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {folder}\nlogfile {folder / 'sentinel.log'}\n"
        f"sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {master_port} {quorum}\n{auth}"
        f"sentinel down-after-milliseconds {SENTINEL_SERVICE} {down_after_ms}\n"
        f"sentinel failover-timeout {SENTINEL_SERVICE} 5000\n"
        f"sentinel parallel-syncs {SENTINEL_SERVICE} 1\n"
    )
    return subprocess.Popen(
        [str(redis_server_binary()), str(conf), "--sentinel"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
