"""Click parameter types the commands share; no Redis here (the device recipe's CLI uses them)."""

from __future__ import annotations

import math
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
