"""Reading a server's answer over a raw socket, for tests that send what httpx cannot (a head alone,
`Expect: 100-continue`, a stalled body) and time what comes back."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable


async def collect(
    reader: asyncio.StreamReader, started: float, *, enough: Callable[[bytes], bool] | None = None
) -> tuple[bytes, float]:
    """Every byte the server sends within 10 s of `started` (time.monotonic()) until it closes the
    connection, or until `enough(what came so far)` says so; (the bytes, seconds to the first)."""
    received, first_s = b"", math.inf
    while (left_s := started + 10 - time.monotonic()) > 0:
        try:
            piece = await asyncio.wait_for(reader.read(1 << 16), left_s)
        except TimeoutError:
            break
        if not piece:  # the server closed the connection
            break
        first_s = min(first_s, time.monotonic() - started)
        received += piece
        if enough is not None and enough(received):
            break
    return received, first_s
