"""Plain constants every layer shares; no imports, so even the GPU-only scripts can use them."""

from __future__ import annotations

INSTRUCTIONS: tuple[str, str] = ("forward", "backward")
"""The instruction names of a pipeline stage that profiles, plans and schedules use."""

H100_GRAPHICS_CLOCKS: tuple[int, ...] = tuple(range(1980, 344, -15))
"""An H100's graphics clocks, MHz, highest first: 1980 down to 345 in 15 MHz steps."""

MAX_CLOCK_MHZ: int = 10_000
"""Highest GPU clock a profile may name, MHz: 10 GHz, five times an H100's top clock (1980)
and past any GPU's; a larger one (10^20) is a typo or a unit mix-up (Hz or kHz for MHz)."""

MAX_RANK_CLOCKS: int = MAX_CLOCK_MHZ
"""Most clocks a rank may register, and a sweep's ``frequencies`` may list: every whole MHz up
to :data:`MAX_CLOCK_MHZ` (an H100 has 110). The ceiling of ``PERSEUS_MAX_FREQUENCIES``."""

MIN_TARGET_ITERATION_S: float = 1e-6
"""Shortest target iteration time (``perseus target``), seconds: no pipeline iteration is faster
than a microsecond, and a smaller number (1e-300) is a typo, not a target."""

MAX_TARGET_ITERATION_S: float = 24 * 60 * 60.0
"""Longest target iteration time, seconds (a day): a longer one is a typo (1e300)."""

MAX_UNIX_TIME: float = 253402300799.0
"""The last second of the year 9999 (UTC), as a unix time: a later time (1e300) is a typo that
datetime cannot show."""

MAX_ENTRY_FIELDS: int = 64
"""Most fields an input stream entry may have: a message has at most five (``kind``, ``data``,
``job_id``, ``mac``, ``wait_s``). The coordinator dead-letters an entry with more, its fields
packed into one (see :mod:`protocol.deadletter`). Keep it under about 3,990: replaying a dead
letter passes every field through Lua's ``unpack``, which takes at most about 8,000 values."""
