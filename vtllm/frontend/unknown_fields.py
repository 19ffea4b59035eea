"""A bounded, rate-limited log of the request-body fields an endpoint ignores.

SDKs send fields we do not use, so unknown fields are not an error; but a client can send
100k distinct names, so the log remembers a bounded number of recently reported names,
writes at most a few lines per interval (saying how many it held back), and clips every
name it prints.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

logger = logging.getLogger(__name__)


class UnknownFieldLog:
    """Warns about ignored body fields with bounded memory and output.

    A (request type, field) pair is reported once while it stays among the last
    ``remember`` reported; at most ``max_lines`` lines are written per ``interval_s``;
    each line names at most ``max_names`` fields, each clipped to ``max_name_chars``."""

    def __init__(
        self,
        remember: int = 1024,
        max_lines: int = 10,
        interval_s: float = 60.0,
        max_names: int = 5,
        max_name_chars: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.remember = remember
        self.max_lines = max_lines
        self.interval_s = interval_s
        self.max_names = max_names
        self.max_name_chars = max_name_chars
        self.clock = clock
        self._reported: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._window_start = -float("inf")
        self._lines_in_window = 0
        self._held_back = 0

    def __len__(self) -> int:
        return len(self._reported)

    def report(self, request_type: str, names: Iterable[str]) -> None:
        fresh = []
        for name in names:
            key = (request_type, _clip(name, self.max_name_chars))
            if key in self._reported:
                self._reported.move_to_end(key)
                continue
            self._reported[key] = None
            if len(self._reported) > self.remember:
                self._reported.popitem(last=False)
            fresh.append(key[1])
        if not fresh:
            return
        now = self.clock()
        if now - self._window_start >= self.interval_s:
            self._window_start, self._lines_in_window = now, 0
        if self._lines_in_window >= self.max_lines:
            self._held_back += 1
            return
        self._lines_in_window += 1
        shown = ", ".join(repr(n) for n in fresh[: self.max_names])
        more = f" and {len(fresh) - self.max_names} more" if len(fresh) > self.max_names else ""
        held = ""
        if self._held_back:
            held = f" ({self._held_back} such warnings held back by the rate limit)"
            self._held_back = 0
        logger.warning("%s: ignoring unknown fields %s%s%s", request_type, shown, more, held)


def _clip(name: str, limit: int) -> str:
    return name if len(name) <= limit else f"{name[:limit]}...({len(name)} chars)"
