"""Click parameter types the commands share; no Redis here (the device recipe's CLI uses them)."""

from __future__ import annotations

import math
import os
from typing import Any

import click


class FiniteFloatRange(click.FloatRange):
    """click's ``FloatRange`` that also refuses NaN and infinity, naming the option.

    click's own lets NaN through (every comparison with it is false), and infinity wherever
    no maximum is set: ``perseus status --watch --interval nan`` then ended in a traceback
    from ``time.sleep``, and ``perseus deadletter purge --older-than inf`` in one from ``int``.
    """

    name = "finite float range"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """The number, if finite and in range; else click's usage error naming the option."""
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return super().convert(number, param, ctx)


class OutputFile(click.Path):
    """click's ``Path`` for a file the command writes at its end, checked when it is parsed.

    click's own (``dir_okay=False, writable=True``) looks only at a file that exists: a file
    in a folder that does not exist (or that this user may not write in) failed at the end,
    after the command's work (``perseus profile-p2p --csv``: after the measurement).
    """

    def __init__(self) -> None:
        super().__init__(dir_okay=False, writable=True)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """The path, if its folder exists and can be written in; else a usage error."""
        path = super().convert(value, param, ctx)
        folder = os.path.dirname(os.path.abspath(os.fsdecode(path)))
        if not os.path.isdir(folder):
            what = "is not a folder" if os.path.exists(folder) else "does not exist"
            self.fail(f"{os.fsdecode(path)!r}: its folder {folder!r} {what}", param, ctx)
        if not os.access(folder, os.W_OK | os.X_OK):
            self.fail(f"{os.fsdecode(path)!r}: no permission to write in {folder!r}", param, ctx)
        return path
