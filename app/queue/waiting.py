"""WaitingCount: what one process knows of the jobs waiting, for the queue limit of an enqueue."""

from __future__ import annotations

import math
import time


class WaitingCount:
    """What this process knows of the number of jobs waiting (queued or scheduled), so that an
    enqueue counts them only when the queue may be near its limit.

    Counting reads one index entry per job waiting: 1.6 ms of PostgreSQL per upload beside 9,900
    queued jobs. In the limit's last tenth (at least MARGIN jobs) every enqueue counts (uploads
    written at the same moment each see the count before the others, so a burst may still pass it
    by as many). Below that, a count at most REFRESH_S old, plus the jobs this process queued since,
    decides; jobs other processes queued in that time go unseen, so the limit can be passed only by
    more than a tenth of it (MARGIN at least) queued within REFRESH_S."""

    REFRESH_S = 1.0
    MARGIN = 100

    def __init__(self) -> None:
        self._count: int | None = None
        self._at = -math.inf

    def must_count(self, limit: int) -> bool:
        """Whether the next enqueue must count the jobs waiting, for a queue limit of `limit`."""
        if self._count is None or time.monotonic() - self._at > self.REFRESH_S:
            return True
        return self._count >= limit - max(self.MARGIN, limit // 10)

    def counted(self, count: int) -> None:
        """An enqueue counted `count` jobs waiting (at most the limit)."""
        self._count, self._at = count, time.monotonic()

    def added(self) -> None:
        """This process queued one more job."""
        if self._count is not None:
            self._count += 1

    @property
    def known(self) -> int | None:
        """The jobs waiting as this process knows them: the last count, plus what it queued since."""
        return self._count
