"""Run by tests/test_hook_threads.py: a training script that ends without calling close().

Usage: python -m tests.exit_without_close REDIS_URL PORT. Prints the job id and the schedule
version of the result it built last, then ends as a script that forgot ``close()`` does.
"""

from __future__ import annotations

import logging
import sys

import torch.distributed as dist

from tests.helpers import make_hook, step_until
from worker_client.gpu.frequency import DryRunFrequencyController


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    url, port = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    hook = make_hook(url, DryRunFrequencyController(0), report_every=1)
    step_until(hook, lambda: hook._last_result is not None, 60, "a result built")
    last = hook._last_result
    assert last is not None
    print(hook.job_id, last.schedule_version, flush=True)


if __name__ == "__main__":
    main()
