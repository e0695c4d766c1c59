"""The Hopper route's forward: which problems it covers and which the schedule sends to it
(its launch: ``hopper_forward_launch``). The kernel is ``hopper_device.attention_forward``
(Gluon, sm_90a).

It covers a forward with no mask or a bool mask, and no bias, a bias of one row per (batch,
head) or a full bias (a row per query row) that TMA can read (``problem.tma_bias``; the loader
copies each block's row beside K, or each warpgroup's tile of it: ``forward_bias_gap``)
(causal or not, any lengths,
GQA/MQA) in fp16 or bf16 at head dims up to 128 that are multiples of 8, with q, k and v laid out
for TMA, on a GPU of compute capability 9.0. A mask's keys must be contiguous and its other strides
multiples of 16 bytes (``problem.tma_mask``): the kernel walks each 128-row tile's activity list
(``activity.BlockLists`` of 128 x 128 tiles, full blocks first) and reads what the blocks it tests
per pair test through TMA (``mask_kind``): a bool mask's bytes, a row of them for a mask shared by
every query row, or KeyIntervals' (start, end) pairs.
The schedule takes the route where its tiles are full enough (``takes_hopper``; with a mask, a
prepared one whose tiles are mostly full: ``few_partial_tiles``), and
``kernel_options['forward_route']`` forces either route. Anything else runs the Triton route,
which stays whole: a call whose tensors' addresses are not 16-byte aligned falls back to it
too (``hopper_forward_launch.HopperForwardLaunch.takes``).
"""
from __future__ import annotations

import torch

from ..runtime.arith import ceil_div
from . import tuning
from .key_walk import tile_key_blocks
from .problem import Problem

try:
    # Imported to check that this Triton has Gluon's Hopper support (``runtime.tma`` makes
    # the descriptors).
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401

    from ..hopper_device.attention_forward import attention_forward
    GLUON_MISSING = None
except ImportError as exc:  # a Triton without Gluon's Hopper modules
    attention_forward = None
    GLUON_MISSING = f"this Triton has no Gluon Hopper support ({exc})"

HOPPER = (9, 0)
# The kernel's MASK_KIND values (``attention_forward``'s constants of the same names).
NO_MASK, MASK_TILE, MASK_ROW, INTERVAL_WORDS = 0, 1, 2, 3
# The kernel's tile orders (``tiles.ORDER_HEADS``, ``tiles.ORDER_BALANCED``).
TILE_ORDERS = {"heads": 0, "balanced": 1}
MAX_HEAD_DIM = 128
MAX_TILES = 2**31 - 1  # work tiles are counted in int32
# A full bias's tiles (32 KB at two warpgroups) beside a mask tile's slots (32 KB) and the ring
# fit in 227 KB of shared memory up to this padded head dim (offline sm_90a).
FULL_BIAS_MASK_TILE_MAX_BLOCK_D = 64


def hopper_gap(problem: Problem, documents: bool = False) -> str | None:
    """Why the Hopper forward does not cover ``problem`` (one line), or None where it does;
    with ``documents``, walking a packed batch's documents in their own tiles (its mask
    unread: ``documents_gap``)."""
    gap = documents_gap(problem) if documents else None
    if gap is None:
        gap = hopper_operands_gap(problem, reads_mask=not documents)
    if gap is None and problem.bias is not None:
        gap = bias_row_gap(problem) if documents else forward_bias_gap(problem)
        if gap is None and not problem.tma_bias:
            gap = ("it reads a bias row through TMA: the keys contiguous, and batch and head "
                   "strides multiples of 16 bytes" if problem.bias.one_row else
                   "it reads a full bias through TMA: the keys contiguous, and the batch, head "
                   "and query strides multiples of 16 bytes")
    return gap


def forward_bias_gap(problem: Problem) -> str | None:
    """Why the Hopper forward does not take ``problem``'s bias (one line), or None: a bias of
    one row per (batch, head), (.., .., 1, Lk), copied beside K, or a full bias, a row per
    query row (.., .., Lq, Lk), copied in each warpgroup's [64, 128] tiles
    (``hopper_device.bias.ForwardBias``); not one broadcast along the keys. A full bias beside
    a bool mask per query row takes head dims up to 64: at 128 its tiles, the mask's slots
    and the ring do not fit in shared memory together."""
    bias = problem.bias
    if bias.one_row or bias.shape[3] == 1:
        return bias_row_gap(problem)
    if (problem.mask is not None and not key_row_mask(problem)
            and problem.block_d > FULL_BIAS_MASK_TILE_MAX_BLOCK_D):
        return (f"a full bias beside a bool mask per query row takes head dims up to "
                f"{FULL_BIAS_MASK_TILE_MAX_BLOCK_D}: their tiles and the ring exceed shared "
                f"memory at {problem.shape.head_dim}")
    return None


def full_bias(problem: Problem) -> bool:
    """The bias is a full one, a row per query row (``forward_bias_gap``)."""
    return problem.bias is not None and not problem.bias.one_row


def bias_row_gap(problem: Problem) -> str | None:
    """Why the Hopper kernels do not take ``problem``'s bias (one line), or None: they read a
    bias of one row per (batch, head), (.., .., 1, Lk)."""
    bias = problem.bias
    if not bias.one_row or bias.shape[3] == 1:
        return ("it takes a bias of one row per (batch, head), (.., .., 1, Lk); not yet a bias "
                "with a row per query or one broadcast along the keys")
    return None


def documents_gap(problem: Problem) -> str | None:
    """Why the Hopper forward cannot walk ``problem``'s mask as documents (one line), or None:
    it takes a packed batch's documents (``dmattn_varlen_func`` without a mask of the
    caller's). Their tile table is kept by the plan of prepared intervals, or made per
    call from the offsets of unprepared ones (``ForwardPlan.call_documents``)."""
    if problem.documents is None:
        return ("its mask is not a packed batch's documents (dmattn_varlen_func without "
                "attn_mask)")
    return None


def hopper_operands_gap(problem: Problem, reads_mask: bool = True) -> str | None:
    """What both Hopper kernels need of a call, bias aside (one line), or None: a Hopper GPU,
    16-bit q, k, v and a mask that TMA reads (where ``reads_mask``), a head dim it tiles, and
    a grid it fits."""
    shape = problem.shape
    if GLUON_MISSING:
        return GLUON_MISSING
    if problem.interpreted or problem.capability is None:
        return "it runs on a CUDA GPU only, not under Triton's interpreter"
    if problem.capability != HOPPER:
        return (f"it needs a GPU of compute capability 9.0 (Hopper), this one is "
                f"{problem.capability[0]}.{problem.capability[1]}")
    if problem.dtype not in (torch.float16, torch.bfloat16):
        return f"it takes float16 or bfloat16, not {str(problem.dtype).replace('torch.', '')}"
    if problem.mask is not None and reads_mask:
        if not problem.tma_mask:
            return ("it reads the mask through TMA: the keys contiguous, and the strides of "
                    "its other axes multiples of 16 bytes")
    if shape.head_dim > MAX_HEAD_DIM or shape.head_dim % 8:
        return f"it takes head dims up to {MAX_HEAD_DIM} that are multiples of 8, not {shape.head_dim}"
    if not problem.tma_operands:
        return ("it reads q, k and v through TMA: the last dim contiguous and every other "
                "stride a multiple of 16 bytes")
    if not problem.softmax_scale > 0:
        return f"it takes a positive softmax_scale, not {problem.softmax_scale}"
    tiles = ceil_div(shape.seqlen_q, tuning.HOPPER_FORWARD.tile_rows) * shape.batch * shape.heads_q
    if tiles > MAX_TILES:
        return f"it takes at most {MAX_TILES} tiles of 128 query rows x heads x batch, not {tiles}"
    return None


def three_consumer_gap(problem: Problem) -> str | None:
    """Why ``tuning.HOPPER_FORWARD_THREE`` (three consumer warpgroups) does not cover a call
    the Hopper forward covers, or None."""
    if problem.mask is not None and not key_row_mask(problem):
        return ("three consumer warpgroups take a mask of one key row (KeyIntervals, or a bool "
                "mask of one row for every query row), not a bool mask per query row: its "
                "192-row box is not a power of two")
    # H200, the full-bias fuzz (80 forced calls, three warpgroups): 3-5 of the 19 calls with
    # a bool mask row and a full bias went wrong, in one warpgroup's rows, a different set in
    # each run (a race; compute-sanitizer's racecheck does not see TMA's writes). The same
    # calls pass with two warpgroups, with KeyIntervals, or with a bias row.
    if full_bias(problem) and problem.mask is not None and not problem.intervals:
        return ("three consumer warpgroups take no full bias beside a bool mask row: that "
                "form races on the H200")
    if problem.shape.head_dim > tuning.HOPPER_FORWARD_THREE_MAX_HEAD_DIM:
        return (f"three consumer warpgroups take head dims up to "
                f"{tuning.HOPPER_FORWARD_THREE_MAX_HEAD_DIM}, not {problem.shape.head_dim}")
    return None


def takes_three_consumers(problem: Problem) -> bool:
    """The schedule's default for a call on the Hopper forward: three consumer warpgroups
    (``tuning.HOPPER_FORWARD_THREE``) where they cover it without a mask or bias and both
    lengths reach ``tuning.HOPPER_FORWARD_THREE_MIN_LENGTH`` (the tuning note beside it has
    the measurements)."""
    least = tuning.HOPPER_FORWARD_THREE_MIN_LENGTH
    return (three_consumer_gap(problem) is None and problem.mask is None
            and problem.bias is None
            and problem.shape.seqlen_q >= least and problem.shape.seqlen_k >= least)


def mean_key_blocks(problem: Problem, tile: tuning.HopperTile = tuning.HOPPER_FORWARD) -> float:
    """The mean number of key blocks a work tile of the Hopper forward walks without a mask:
    ``key_walk.tile_key_blocks``' active blocks, at least one (as the kernel's
    ``tiles.WorkTiles.key_blocks`` walks them)."""
    shape = problem.shape
    rows = tile.tile_rows
    row_tiles = ceil_div(shape.seqlen_q, rows)
    blocks = sum(max(tile_key_blocks(i * rows, rows, shape.seqlen_q, shape.seqlen_k,
                                     tile.block_n, problem.is_causal)[0], 1)
                 for i in range(row_tiles))
    return blocks / row_tiles


def list_tile(tile: tuning.HopperTile = tuning.HOPPER_FORWARD) -> tuple[int, int]:
    """(query rows, key cols) of the tiles whose activity lists the masked kernel walks."""
    return tile.tile_rows, tile.block_n


def key_row_mask(problem: Problem) -> bool:
    """The mask is read as one row of keys for every query row: KeyIntervals (their words), or
    a bool mask of one row (MASK_ROW)."""
    return problem.mask is not None and (problem.intervals or problem.mask.one_row)


def mask_kind(problem: Problem) -> int:
    """The kernel's MASK_KIND for the problem's mask (``attention_forward``)."""
    if problem.mask is None:
        return NO_MASK
    if problem.intervals:
        return INTERVAL_WORDS
    return MASK_ROW if problem.mask.one_row else MASK_TILE


def may_take_masks(problem: Problem) -> bool:
    """Whether a call of this problem's mask may take the masked Hopper forward, as far as a
    prepared mask knows it (no q, k, v yet): its lists' tile is then built with the others."""
    return (problem.mask is not None and GLUON_MISSING is None
            and problem.capability == HOPPER
            and problem.dtype in (torch.float16, torch.bfloat16)
            and problem.shape.head_dim <= MAX_HEAD_DIM)


def few_partial_tiles(problem: Problem) -> bool:
    """Whether the mask's counted share of partial tiles in the masked kernel's lists is at most
    ``tuning.HOPPER_FORWARD_MASK_PARTIAL_SHARE`` (False where it was not counted: a mask read
    by the call, or prepared during a CUDA graph capture)."""
    if problem.activity is None:
        return False
    share = problem.activity.partial_share(*list_tile(), transposed=False)
    return share is not None and share <= tuning.HOPPER_FORWARD_MASK_PARTIAL_SHARE


def kept_key_blocks(problem: Problem, tile: tuning.HopperTile = tuning.HOPPER_FORWARD
                    ) -> float | None:
    """The key blocks a tile of the Hopper forward walks under KeyIntervals that keep at most W
    keys per row (``Problem.row_kept``), by the estimate min(the unmasked walk, W / block_n +
    1) (with a key order the kept keys are block-dense), or None for other masks. No sync, so
    it holds for intervals built per call (``topk_intervals`` in a model's layers)."""
    if not problem.intervals or problem.row_kept is None:
        return None
    return min(mean_key_blocks(problem, tile), ceil_div(problem.row_kept, tile.block_n) + 1)


def long_kept_walks(problem: Problem) -> bool:
    """Whether ``kept_key_blocks`` reaches ``tuning.HOPPER_FORWARD_INTERVALS_MIN_KEY_BLOCKS``."""
    blocks = kept_key_blocks(problem)
    return blocks is not None and blocks >= tuning.HOPPER_FORWARD_INTERVALS_MIN_KEY_BLOCKS


def many_kept_block_visits(problem: Problem, tile: tuning.HopperTile = tuning.HOPPER_FORWARD
                           ) -> bool:
    """Whether a call with a bias row below ``tuning.HOPPER_FORWARD_BIAS_MIN_HEAD_DIM`` still
    takes the Hopper forward: a head dim of at least
    ``tuning.HOPPER_FORWARD_BIAS_LONG_MIN_HEAD_DIM``, KeyIntervals whose rows keep at most
    ``tuning.HOPPER_FORWARD_BIAS_LONG_MAX_KEPT_SHARE`` of the keys, and tiles x
    ``kept_key_blocks`` of at least ``tuning.HOPPER_FORWARD_BIAS_LONG_MIN_VISITS``."""
    blocks = kept_key_blocks(problem, tile)
    shape = problem.shape
    if (blocks is None or shape.head_dim < tuning.HOPPER_FORWARD_BIAS_LONG_MIN_HEAD_DIM
            or problem.row_kept > tuning.HOPPER_FORWARD_BIAS_LONG_MAX_KEPT_SHARE
            * shape.seqlen_k):
        return False
    tiles = ceil_div(shape.seqlen_q, tile.tile_rows) * shape.batch * shape.heads_q
    return tiles * blocks >= tuning.HOPPER_FORWARD_BIAS_LONG_MIN_VISITS


def takes_hopper(problem: Problem) -> bool:
    """The schedule's default: the Hopper forward where it covers the problem, the query rows
    fill its tiles and each tile walks enough key blocks to hide its prologue and epilogue; a
    bias row at head dims where it leads (``tuning.HOPPER_FORWARD_BIAS_MIN_HEAD_DIM``, or
    ``many_kept_block_visits``), a full bias only with ``tuning.HOPPER_FORWARD_FULL_BIAS``. A
    mask takes it where its counted tiles are mostly full (``few_partial_tiles``) or its
    intervals' kept keys make long walks (``long_kept_walks``)."""
    if (problem.mask is not None
            and not (few_partial_tiles(problem) or long_kept_walks(problem))):
        return False
    if (problem.bias is not None
            and problem.shape.head_dim < tuning.HOPPER_FORWARD_BIAS_MIN_HEAD_DIM
            and not many_kept_block_visits(problem)):
        return False
    if full_bias(problem) and not tuning.HOPPER_FORWARD_FULL_BIAS:
        return False
    return (problem.shape.seqlen_q >= tuning.HOPPER_FORWARD_MIN_QUERIES
            and hopper_gap(problem) is None
            and mean_key_blocks(problem) >= tuning.HOPPER_FORWARD_MIN_KEY_BLOCKS)


def takes_documents(problem: Problem) -> bool:
    """The schedule's default for a packed batch's documents (``documents_gap``): walked in
    their own tiles where the Hopper forward covers them, the packed rows fill at least
    ``tuning.HOPPER_FORWARD_MIN_QUERIES``, and a bias row only at head dims where it leads
    (``tuning.HOPPER_FORWARD_BIAS_MIN_HEAD_DIM``). No key-block floor: the Triton route walks
    the packed rows' tiles across document edges. H200, varlen.yaml (16k and 64k packed
    tokens, documents of median 256 and 1024 tokens, causal, D128, with and without a kv_row
    bias): 0.68-0.74x the Triton route's forward time."""
    if (problem.bias is not None
            and problem.shape.head_dim < tuning.HOPPER_FORWARD_BIAS_MIN_HEAD_DIM):
        return False
    return (problem.shape.seqlen_q >= tuning.HOPPER_FORWARD_MIN_QUERIES
            and hopper_gap(problem, documents=True) is None)


def tile_order(problem: Problem, options: dict) -> str:
    """How the Hopper forward deals its work tiles to its programs: 'balanced' (causal tiles
    longest first, heads inner, dealt back and forth) or 'heads' (a head's tiles consecutive);
    ``options['forward_tile_order']`` forces it, else 'balanced' for a causal call, or one
    with KeyIntervals (whose walks grow and shrink with the rows' kept keys), whose K and V
    take at most ``tuning.HOPPER_FORWARD_BALANCED_MAX_KV_BYTES``."""
    forced = options.get("forward_tile_order")
    if forced is not None:
        return forced
    shape = problem.shape
    kv_bytes = (2 * shape.batch * shape.heads_kv * shape.seqlen_k * shape.head_dim
                * problem.dtype.itemsize)
    uneven = problem.is_causal or problem.intervals
    return ("balanced" if uneven and kv_bytes <= tuning.HOPPER_FORWARD_BALANCED_MAX_KV_BYTES
            else "heads")
