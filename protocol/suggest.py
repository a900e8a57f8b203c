"""The nearest known name to a misspelt one, for error messages ("did you mean X?")."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest_name(name: str, known: Iterable[str]) -> str | None:
    """The known name most like ``name`` (difflib's ratio, at least 0.6), or None.

    Args:
        name: What was given (a setting's name, a scheduler's).
        known: The names it may have meant.
    """
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return close[0] if close else None


def did_you_mean(name: str, known: Iterable[str], prefix: str = "") -> str:
    """`` (did you mean PREFIX+X?)`` for the nearest known name X, or an empty string.

    Args:
        name: What was given, without ``prefix``.
        known: The names it may have meant, without ``prefix``: names that all share a
            prefix are compared without it (PERSEUS_FOO is not close to PERSEUS_PLAN).
        prefix: Put back in front of the name suggested.
    """
    close = closest_name(name, known)
    return f" (did you mean {prefix}{close}?)" if close else ""
