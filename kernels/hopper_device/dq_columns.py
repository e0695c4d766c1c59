"""dQ's float32 partial staged for its TMA reduce-adds with its columns spread over the banks.

A consumer warpgroup stages its [64, D / 2] float32 partial of dQ as two [64, 32] quarters of
D, each a 128-byte-swizzled tile (one 128-byte row per query row). In the wgmma accumulator a
thread holds two adjacent columns of a row (8 bytes, one STS.64), the four threads of a quad
the row's 8 columns c = 8j + 4a + b (a = 0, 1; b = 0..3) of one j. A 64-bit store is served
half a warp at a time: rows r..r+3 of one j. Their columns sit in 16-byte chunks 2j and
2j + 1, and the 128-byte swizzle XORs a chunk with the row (mod 8), so four rows reach only
four distinct chunks: two wavefronts per half warp where one suffices (ncu, H200, B2 H16 L8192
D128: 4 wavefronts per STS.64 against 2 ideal, 67M excess of 772M shared wavefronts).

``spread_columns`` reorders a quarter's columns to a * 16 + j * 4 + b, so a quad's two chunks
are j and j + 4: XORed with four rows they give eight distinct chunks, one wavefront per half
warp. The accumulator in global memory then holds every 32 columns in that order, and the
cast to dQ puts them back (``triton_device.backward_finish``)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

SPREAD_QUARTER = gl.constexpr(32)  # the quarter of D that is spread: head dim 128


@gluon.jit
def spread_columns(quarter):
    """A [rows, 32] quarter of dQ's partial with column 8j + 4a + b moved to a * 16 + j * 4
    + b (a register relabelling: a thread's columns stay its own)."""
    ROWS: gl.constexpr = quarter.shape[0]
    gl.static_assert(quarter.shape[1] == SPREAD_QUARTER, "a spread quarter has 32 columns")
    return quarter.reshape([ROWS, 4, 2, 4]).permute((0, 2, 1, 3)).reshape([ROWS, 32])
