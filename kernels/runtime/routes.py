"""Which kernels a call's launches took, for whoever asks.

``with kernels.record_routes() as routes:`` notes, for every attention call that runs inside
the block, the forward's route (``hopper``: the Gluon kernel; ``triton``: the Triton loop;
``gather``: decode over the kept keys) and the backward's (``fused``, ``dq+dkdv``, ``packed``,
``hopper``), as the launchers carry the call out, not as a schedule predicts it. A benchmark
row names the kernels behind its number this way, and a test of a forced route counts its
launches, so a silent fallback shows. Outside such a block a launch pays one test of an empty
list.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The logs of the ``record_routes`` blocks open now, innermost last.
_open: list["RouteLog"] = []


@dataclass
class RouteLog:
    """The routes taken while the block ran, one entry per launch of that part, in order."""

    forward: list[str] = field(default_factory=list)
    backward: list[str] = field(default_factory=list)

    def __enter__(self) -> "RouteLog":
        _open.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _open.remove(self)

    def describe(self) -> str:
        """``forward hopper; backward fused``: each part's distinct routes in the order first
        taken (joined by ``+`` where calls took several), parts that ran nothing left out."""
        parts = [f"{name} {'+'.join(dict.fromkeys(taken))}"
                 for name, taken in (("forward", self.forward), ("backward", self.backward))
                 if taken]
        return "; ".join(parts)


def record_routes() -> RouteLog:
    """A context manager whose log collects the routes of the calls made inside it."""
    return RouteLog()


def note_route(part: str, route: str) -> None:
    """Record that ``part`` (``"forward"`` or ``"backward"``) ran ``route``, in every open log
    (none outside a ``record_routes`` block: a loop over an empty list)."""
    for log in _open:
        getattr(log, part).append(route)
