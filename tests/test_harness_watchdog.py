"""``dmbench.watchdog.PointWatchdog``: fires once for a point that outlives it, never for one
that ends first, and is off for None or 0."""

from __future__ import annotations

import threading
import time

from dmbench.watchdog import PointWatchdog


def test_fires_for_a_point_that_outlives_it():
    fired = threading.Event()
    with PointWatchdog(0.05, fired.set) as dog:
        assert fired.wait(10)
    assert dog.fired


def test_silent_for_a_point_that_ends_first():
    calls = []
    with PointWatchdog(0.2, lambda: calls.append(1)) as dog:
        pass
    time.sleep(0.4)
    assert not dog.fired and calls == []


def test_off_without_a_limit():
    for seconds in (None, 0):
        with PointWatchdog(seconds, lambda: (_ for _ in ()).throw(AssertionError)) as dog:
            time.sleep(0.05)
        assert not dog.fired and dog._timer is None
