"""Numbers read from text (CSV cells, plan and frontier files, environment values): ASCII only.

Python's ``int()`` and ``float()`` take any Unicode decimal digit (``int("١٢٠٠")`` is 1200,
and so are full-width digits) and underscores between digits (``int("1_200")``), and
``str.isdigit`` is true for superscripts that ``int()`` then refuses (``"²"``). A file or
setting that means a number writes it in ASCII; anything else is a mistake to report, not a
number to guess.
"""

from __future__ import annotations

import re

_INT_RE = re.compile(r"[+-]?[0-9]+")
_UINT_RE = re.compile(r"[0-9]+")
# Digits with an optional point and exponent, or the words float() gives meaning to (the
# callers refuse the non-finite ones with a message of their own).
_FLOAT_RE = re.compile(
    r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf|infinity|nan)",
    re.IGNORECASE,
)


def is_ascii_digits(text: str) -> bool:
    """Whether ``text`` is one or more ASCII digits ``0-9`` and nothing else (no sign)."""
    return _UINT_RE.fullmatch(text) is not None


def ascii_int(text: str) -> int:
    """Parse an optionally signed integer written in ASCII digits (surrounding spaces allowed).

    Raises:
        ValueError: Anything else (other digits, underscores, a point, an empty text).

    """
    stripped = text.strip(" \t\r\n")
    if not _INT_RE.fullmatch(stripped):
        raise ValueError(f"not an integer in ASCII digits: {text!r}")
    return int(stripped)


def ascii_float(text: str) -> float:
    """Parse a decimal number written in ASCII (``1.5``, ``-2e-3``, ``.5``, ``inf``, ``nan``).

    Raises:
        ValueError: Anything else (other digits, underscores, hex, an empty text).

    """
    stripped = text.strip(" \t\r\n")
    if not _FLOAT_RE.fullmatch(stripped):
        raise ValueError(f"not a number in ASCII digits: {text!r}")
    return float(stripped)
