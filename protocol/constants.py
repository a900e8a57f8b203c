"""Plain constants every layer shares; no imports, so even the GPU-only scripts can use them."""

from __future__ import annotations

INSTRUCTIONS: tuple[str, str] = ("forward", "backward")
"""The instruction names of a pipeline stage that profiles, plans and schedules use."""

H100_GRAPHICS_CLOCKS: tuple[int, ...] = tuple(range(1980, 344, -15))
"""An H100's graphics clocks, MHz, highest first: 1980 down to 345 in 15 MHz steps."""
