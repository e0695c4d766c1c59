"""The output rows of a packed sequence's last tile, written from registers: a TMA box
cannot stop at a sequence's end, and the rows past it are the next sequence's."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .gluon_compat import aggregate


@aggregate
class OutputRows:
    """The output (1, packed rows, Hq, D) as a pointer, for the rows of a sequence's last
    tile, which a TMA box cannot stop at the sequence's end (DOCUMENTS)."""
    base: gl.tensor
    row_stride: gl.tensor
    head_dim: gl.tensor

    @gluon.constexpr_function
    def __init__(self, base, row_stride, head_dim):
        self.base = base
        self.row_stride = row_stride
        self.head_dim = head_dim

    @gluon.jit
    def store(self, out, q_base, first_row, seqlen_q, q_head, o_layout: gl.constexpr):
        """Rows [first_row, seqlen_q) of ``out`` (ROWS x BLOCK_D, o_layout) at packed rows
        from ``q_base`` + ``first_row``, the head dim's columns only."""
        ROWS: gl.constexpr = out.shape[0]
        BLOCK_D: gl.constexpr = out.shape[1]
        rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
        cols = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, o_layout))
        at = (self.base + (q_base + rows).to(gl.int64)[:, None] * self.row_stride
              + q_head * self.head_dim + cols[None, :])
        gl.store(at, out, mask=(rows < seqlen_q)[:, None] & (cols < self.head_dim)[None, :])
