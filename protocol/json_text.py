"""JSON that people write (scheduler arguments, profiles): a key given twice is an error."""

from __future__ import annotations

import json
from typing import Any


class DuplicateKeyError(ValueError):
    """A JSON object names one key twice (``json`` silently keeps the last value)."""


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise DuplicateKeyError(f"key {key!r} is given twice in one object")
        found[key] = value
    return found


def loads_unique(text: str | bytes) -> Any:
    """``json.loads``, refusing an object that names a key twice.

    ``{"microbatches": 2, "microbatches": 3}`` meant one of the two, and which one a user
    sees run should not depend on the order they were typed in.

    Raises:
        json.JSONDecodeError: Not JSON.
        DuplicateKeyError: A key given twice (both are ``ValueError``).
        RecursionError: Nested too deeply.
    """
    return json.loads(text, object_pairs_hook=_unique)
