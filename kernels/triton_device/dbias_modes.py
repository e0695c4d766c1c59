"""The bias gradient's modes, in one place for the planner and the kernels.

``DbiasMode`` names how the bias gradient is made (``planning.dbias`` chooses one and says why
each exists); its string value is what a schedule prints. A kernel receives a mode as the
integer ``DbiasMode.code`` in its ``DBIAS_MODE`` constexpr and compares it with the constants
below, one per mode, each made from its member's code: the numbers are written nowhere else.
"""

from enum import Enum

import triton.language as tl


class DbiasMode(str, Enum):
    """How the bias gradient is made (``planning.dbias`` says why each exists)."""

    NONE = "none"  # no gradient wanted
    ZERO = "zero"  # key-broadcast bias: exactly zero, no kernel work
    DKDV_ROWS = "dkdv-rows"  # one-row bias: dkdv sums dS over queries, a row per query head
    DKDV_GROUP_ROWS = "dkdv-group-rows"  # ... and over the GQA group: a row per kv head
    DQ_TILES = "dq-tiles"  # full-size tiles stored by dq, one contributor per element
    DQ_TILES_ATOMIC = "dq-tiles-atomic"  # ... several contributors: atomic adds into fp32
    DKDV_TILES_ORDERED = "dkdv-tiles-ordered"  # deterministic, several contributors: dkdv
    # adds the group's heads in order, colliding slices in serialized launches
    PACKED_SUMMED_ROWS = "packed-summed-rows"  # packed launch: a tile's rows share one row
    PACKED_ROWS = "packed-rows"  # packed launch: each tile row owns its own bias row

    def __str__(self) -> str:
        return self.value

    @property
    def code(self) -> int:
        """The kernels' ``DBIAS_MODE`` for this mode: its place in this class."""
        return list(DbiasMode).index(self)


# The kernels' names for the modes: ``DBIAS_MODE == DKDV_ROWS`` and so on.
NONE = tl.constexpr(DbiasMode.NONE.code)
ZERO = tl.constexpr(DbiasMode.ZERO.code)
DKDV_ROWS = tl.constexpr(DbiasMode.DKDV_ROWS.code)
DKDV_GROUP_ROWS = tl.constexpr(DbiasMode.DKDV_GROUP_ROWS.code)
DQ_TILES = tl.constexpr(DbiasMode.DQ_TILES.code)
DQ_TILES_ATOMIC = tl.constexpr(DbiasMode.DQ_TILES_ATOMIC.code)
DKDV_TILES_ORDERED = tl.constexpr(DbiasMode.DKDV_TILES_ORDERED.code)
PACKED_SUMMED_ROWS = tl.constexpr(DbiasMode.PACKED_SUMMED_ROWS.code)
PACKED_ROWS = tl.constexpr(DbiasMode.PACKED_ROWS.code)
