"""Subprocess environments in which named packages cannot be imported (torch, say)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from tests.helpers import subprocess_env

IMPORT_BLOCKER = """
import sys

class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {names!r}:
            raise ImportError(name + " {reason}")
        return None

sys.meta_path.insert(0, _Blocked())
"""


def blocking_env(tmp_path: Path, names: Iterable[str], reason: str, **extra: str) -> dict[str, str]:
    """A subprocess environment in which the top-level packages ``names`` cannot be imported.

    A ``sitecustomize`` on ``PYTHONPATH`` installs the block, so processes those spawn (rq's
    work horses, P2P ranks) are blocked too. Importing one raises ``ImportError(name + reason)``.
    """
    site = tmp_path / "blocked-site"
    site.mkdir(exist_ok=True)
    text = IMPORT_BLOCKER.format(names=set(names), reason=reason)
    (site / "sitecustomize.py").write_text(text)
    env = subprocess_env(tmp_path, **extra)
    env["PYTHONPATH"] = os.pathsep.join((str(site), env["PYTHONPATH"]))
    return env
