"""The constexprs both Hopper kernels name: a consumer warpgroup's size and what a masked tile
tests per pair (MASK_KIND), each read through TMA into a slot beside K (the forward) or Q
(the backward)."""

from triton.experimental.gluon import language as gl

CONSUMER_WARPS = gl.constexpr(4)  # one warpgroup
CONSUMER_THREADS = gl.constexpr(128)
NO_MASK = gl.constexpr(0)
MASK_TILE = gl.constexpr(1)  # bool bytes, one row per query row: [2 x ROWS, BLOCK_N] a slot
MASK_ROW = gl.constexpr(2)  # bool bytes, one row for every query row: [1, BLOCK_N] a slot
# KeyIntervals, an int32 (start, end) pair per key, copied as [1, 2 x BLOCK_N] int32 (newer
# Triton refuses 64-bit descriptors) and read as [1, BLOCK_N] int64 words.
INTERVAL_WORDS = gl.constexpr(3)
# A TMA box's first element must be 16-byte aligned (a box of bias keys starting elsewhere
# faults, "illegal instruction", H200): 8 two-byte or 4 four-byte bias keys.
BIAS_KEY_ALIGN = gl.constexpr(8)
