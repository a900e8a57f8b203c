"""Every dotted Python name the README gives (``package.module.attr``) can be imported."""

from __future__ import annotations

import importlib
import re
from typing import Any

from tests.helpers import ROOT

# The project's own packages: a dotted name starting with one of them is a name to import.
_NAME_RE = re.compile(
    r"\b((?:coordinator|protocol|schedulers|worker_client)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)"
)


def _resolve(name: str) -> Any:
    """Import the longest module prefix of ``name``, then take the rest as attributes."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:end]))
        except ImportError:
            continue
        for attr in parts[end:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


def test_every_dotted_name_in_the_readme_resolves() -> None:
    # The Zeus table sent users to schedulers.planning.profile_csv.write_profile_csv, which
    # lives in profile_writer: the import a Zeus user copied failed.
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    names = sorted(set(_NAME_RE.findall(text)))
    assert names, "the README names no module"
    unresolved = []
    for name in names:
        try:
            _resolve(name)
        except (ImportError, AttributeError) as exc:
            unresolved.append(f"{name}: {exc}")
    assert not unresolved, unresolved


_TEST_REF_RE = re.compile(r"\b(tests/[A-Za-z0-9_/]+\.py)(?:::([A-Za-z_][A-Za-z0-9_]*))?")


def test_every_test_file_and_test_the_readme_cites_exists() -> None:
    # The README sent readers to tests/test_outage.py::test_a_rank_starting_rides_through_...
    # after that test had moved to tests/test_outage_clients.py.
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    refs = sorted(set(_TEST_REF_RE.findall(text)))
    assert refs, "the README cites no test"
    missing = []
    for path, test in refs:
        file = ROOT / path
        if not file.is_file():
            missing.append(path)
        elif test and not re.search(rf"^def {test}\(", file.read_text(encoding="utf-8"), re.M):
            missing.append(f"{path}::{test}")
    assert not missing, missing
