"""A time limit per point, for calls that never return.

A point that hangs (a peer's compile that never finishes, a kernel that never ends) cannot be
interrupted from Python: the thread is inside C code. ``PointWatchdog`` runs a timer beside the
point; when it expires first, ``on_timeout`` runs on the timer's thread, which records the
point and replaces the process with one that resumes the sweep (``restart.restart_after_hang``).
A point that ends first cancels the timer. The lock makes the two outcomes exclusive: a point
that ends while the timer is firing waits for ``on_timeout`` and is not reported a second time
(``fired``).
"""

from __future__ import annotations

import threading
from typing import Callable

# The default of ``--point-timeout``: a cold peer compile (flex's backward at 128k) takes
# minutes; a point that gives nothing for half an hour has hung.
DEFAULT_POINT_TIMEOUT_S = 1800.0


class PointWatchdog:
    """``with PointWatchdog(seconds, on_timeout) as dog: ...``; ``seconds`` None or <= 0: off."""

    def __init__(self, seconds: float | None, on_timeout: Callable[[], None]):
        self.seconds = seconds
        self.on_timeout = on_timeout
        self.fired = False
        self._ended = False
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def __enter__(self) -> "PointWatchdog":
        if self.seconds is not None and self.seconds > 0:
            self._timer = threading.Timer(self.seconds, self._fire)
            self._timer.daemon = True
            self._timer.start()
        return self

    def _fire(self) -> None:
        # Held through on_timeout (which replaces the process): a point that ends meanwhile
        # waits in __exit__ instead of going on to write rows beside it.
        with self._lock:
            if self._ended:
                return
            self.fired = True
            self.on_timeout()

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._ended = True
        if self._timer is not None:
            self._timer.cancel()
