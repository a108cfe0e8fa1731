"""A log line a peer can cause at will, at most once per interval.

What a service ignores because someone sent it garbage deserves a line (the operator
should know), but not a line per message: a flood of garbage would flood the log. The
first is logged at once; the ones held back in an interval are counted in the next line.
"""

from __future__ import annotations

import logging
import time

DEFAULT_INTERVAL_S = 10.0


class ThrottledLog:
    def __init__(self, logger: logging.Logger, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._next = 0.0
        self._held = 0

    def info(self, message: str, *args: object) -> None:
        """`logger.info(message, *args)`, unless a line was logged less than an interval
        ago: then only counted."""
        now = time.monotonic()
        if now < self._next:
            self._held += 1
            return
        self._next = now + self.interval_s
        held, self._held = self._held, 0
        if held:
            message += f" (and {held} more in the last {self.interval_s:g}s)"
        self.logger.info(message, *args)
