"""The online softmax of the Hopper forward, in the log2 domain: ``m_i`` the running row max of
s * qk_scale (qk_scale = softmax_scale * log2(e), positive), ``l_i`` the running row sum of
exp2(s * qk_scale - m_i), ``acc`` the unnormalized output. A row that has seen no visible key
has m_i = -inf and shifts by 0 instead (no -inf - -inf); it ends with output 0 and LSE -inf."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

LN2 = gl.constexpr(0.6931471805599453)
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def join_bias(s, qk_scale, bias_row):
    """(the scores, the scale still to apply to them): where ``bias_row`` is not None (a key
    block's [1, BLOCK_N] bias row or [ROWS, BLOCK_N] bias tile, in its dtype), ``s`` scaled
    with the bias added, x log2 e, and 1.0, which the folds' multiplications fold away; else
    ``s`` and ``qk_scale``."""
    if bias_row is not None:
        s = s * qk_scale + bias_row.to(gl.float32) * LOG2E
        qk_scale = 1.0
    return s, qk_scale


@gluon.jit
def fold_scores(s, m_i, l_i, qk_scale, rows, first_col, seqlen_k, diagonal, keep, bias_row,
                MASKED: gl.constexpr, CAUSAL: gl.constexpr, s_layout: gl.constexpr,
                o_layout: gl.constexpr, p_layout: gl.constexpr, dtype: gl.constexpr,
                KEEP_ENDS_KEYS: gl.constexpr):
    """Fold one key block's scores ``s`` into (m_i, l_i). Returns P in the PV product's operand
    layout, the new m_i and l_i, and the factor that rescales the output rows. MASKED blocks
    hide keys past ``seqlen_k`` (not tested where KEEP_ENDS_KEYS and not CAUSAL: ``keep`` is
    then a mask's, read through TMA, which fills keys past the tensor's end with 0), with
    CAUSAL keys past row + ``diagonal``, and where ``keep`` is not None (the block's mask in
    ``s_layout``) the pairs it does not keep. Where ``bias_row`` is not None (the block's
    [1, BLOCK_N] bias row or [ROWS, BLOCK_N] tile, in its dtype), it is added, x log2 e, to
    the scaled scores."""
    BLOCK_N: gl.constexpr = s.shape[1]
    s, qk_scale = join_bias(s, qk_scale, bias_row)
    if MASKED:
        if KEEP_ENDS_KEYS and not CAUSAL:  # a mask's keep, already a bool tensor
            # Offline sm_90a, a tested block's loop: bool tile 1116 -> 898 instructions, mask
            # row 774 -> 699, KeyIntervals 966 -> 743 (with a bias row 1264 -> 1044, 913 ->
            # 836, 1114 -> 895). Causal forms keep the test: without it theirs grew 8-9%.
            visible = keep
        else:
            cols = first_col + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            visible = cols[None, :] < seqlen_k
            if CAUSAL:
                visible = visible & (cols[None, :] <= rows[:, None] + diagonal)
            if keep is not None:
                visible = visible & (keep != 0)
        s = gl.where(visible, s, -float("inf"))
    # qk_scale > 0, so the max of the scaled scores is the scaled max.
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    m_shift = gl.where(m_new == -float("inf"), 0.0, m_new)
    p = gl.exp2(s * qk_scale - m_shift[:, None])
    alpha = gl.exp2(m_i - m_shift)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    p_operand = gl.convert_layout(p.to(dtype), p_layout)
    return p_operand, m_new, l_i, gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))


@gluon.jit
def finish_rows(acc, m_i, l_i, o_layout: gl.constexpr):
    """(the normalized output rows, their natural-log LSE): 0 and -inf for a row that saw no
    key."""
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
    lse = gl.where(empty, -float("inf"), (m_i + gl.log2(l_safe)) * LN2)
    return out, lse
