"""pyproject.toml's extras: Zeus's install command works as written."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_zeus_perseus_extra_is_provided_and_named_in_the_readme() -> None:
    # Zeus's docs say `pip install '.[perseus]'`: pip only warned that perseus-mq "does not
    # provide the extra 'perseus'", which reads as if something were left out.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert "perseus" in extras
    # Nothing the plain install lacks: the extra is there for Zeus's command only.
    assert set(extras["perseus"]) <= set(project["dependencies"])
    assert "[perseus]" in (ROOT / "README.md").read_text()
