"""The tile scheduler and the key-block walk of the Hopper forward, and the backward's
programs (``KeyBlockWork``: a key block each, walking the query blocks that see it).

A work tile is TILE_ROWS = CONSUMERS x ROWS query rows of one (batch, query head), a ROWS each
for the forward's two or three consumer warpgroups. A persistent grid of at most one program
per multiprocessor walks the ``num_tiles`` = ``row_tiles`` x ``batch_heads`` tiles in one of
two orders (``order``, a runtime value, so one compiled kernel has both):

- ``ORDER_HEADS``: a head's row tiles are consecutive and program i takes tiles i, i + grid,
  ... (programs in flight share K and V in L2);
- ``ORDER_BALANCED``: causal tiles sorted longest first, heads inner, dealt to the programs
  back and forth (round k forwards where k is even, backwards where odd), so that each
  program's sum of key blocks is near the mean. A causal walk of few tiles per program is
  otherwise as long as its longest program's: B1 H8 L4096 (256 tiles on 132 programs) takes
  61 blocks in ORDER_HEADS where the mean is 33; dealt back and forth, 33.

Each tile walks key blocks [0, num_blocks); the first ``unmasked_blocks`` of them every row of
the tile sees whole, so they need no test per pair.

With DOCUMENTS (sequences packed end to end, batch 1) a work tile is TILE_ROWS rows of one
sequence and one query head, in that sequence's own coordinates: ``documents`` is an int32
table, its count of tiles first, then per tile (sequence, row tile) in the order the tiles
are dealt (``planning.documents.document_tiles``: the longest walks first), heads inner; the
offsets ``cu_q`` and ``cu_k`` place each sequence's rows and keys in the packed tensors."""



from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .gluon_compat import aggregate

ORDER_HEADS = gl.constexpr(0)
ORDER_BALANCED = gl.constexpr(1)


@aggregate
class WorkTiles:
    seqlen_q: gl.tensor
    seqlen_k: gl.tensor
    heads_q: gl.tensor
    group: gl.tensor
    row_tiles: gl.tensor
    batch_heads: gl.tensor
    num_tiles: gl.tensor
    order: gl.tensor
    documents: gl.tensor
    cu_q: gl.tensor
    cu_k: gl.tensor
    TILE_ROWS: gl.constexpr
    BLOCK_N: gl.constexpr
    CAUSAL: gl.constexpr
    DOCUMENTS: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, seqlen_q, seqlen_k, heads_q, group, row_tiles, batch_heads, num_tiles,
                 order, documents, cu_q, cu_k, TILE_ROWS, BLOCK_N, CAUSAL, DOCUMENTS):
        self.seqlen_q = seqlen_q
        self.seqlen_k = seqlen_k
        self.heads_q = heads_q
        self.group = group
        self.row_tiles = row_tiles
        self.batch_heads = batch_heads
        self.num_tiles = num_tiles
        self.order = order
        self.documents = documents
        self.cu_q = cu_q
        self.cu_k = cu_k
        self.TILE_ROWS = gl.constexpr(TILE_ROWS)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.CAUSAL = gl.constexpr(CAUSAL)
        self.DOCUMENTS = gl.constexpr(DOCUMENTS)

    @gluon.jit
    def tile_count(self):
        """How many work tiles the grid walks: with DOCUMENTS the table's count (written on
        the device, so no count is read back) x heads."""
        if self.DOCUMENTS:
            count = gl.load(self.documents) * self.batch_heads
        else:
            count = self.num_tiles
        return count

    @gluon.jit
    def visits(self):
        """How many tiles this program walks."""
        program = gl.program_id(0)
        programs = gl.num_programs(0)
        num_tiles = self.tile_count()
        if self.order == ORDER_BALANCED:
            # Every program takes one tile of each whole round; of the last, partial round
            # (its tiles dealt from the end where the round is odd) only some do.
            rounds = num_tiles // programs
            left = num_tiles - rounds * programs
            if rounds % 2 == 0:
                last = program < left
            else:
                last = program >= programs - left
            count = rounds + last.to(gl.int32)
        else:
            count = gl.cdiv(gl.maximum(num_tiles - program, 0), programs)
        return count

    @gluon.jit
    def tile(self, visit):
        """The work tile of this program's ``visit``-th visit."""
        program = gl.program_id(0)
        programs = gl.num_programs(0)
        if (self.order == ORDER_BALANCED) & (visit % 2 == 1):
            tile = visit * programs + programs - 1 - program
        else:
            tile = visit * programs + program
        return tile

    @gluon.jit
    def coordinates(self, tile):
        """(batch, query head, key head, first query row, batch x heads row) of work tile
        ``tile``, then its sequence's span (``span``). In ORDER_HEADS a head's row tiles are
        consecutive, so that the programs in flight share K and V in L2; with CAUSAL each
        head's longest rows come first. (Every head's longest rows first, heads inner, dealt
        as ORDER_HEADS deals, was 3% slower causal at B2 H16 L8192 on an H200: no K/V shared
        in flight.) In ORDER_BALANCED, and with DOCUMENTS, the heads are inner."""
        if self.DOCUMENTS:
            bh = tile % self.batch_heads
            entry = self.documents + 1 + 2 * (tile // self.batch_heads)
            sequence = gl.load(entry)
            row_tile = gl.load(entry + 1)
        else:
            sequence = 0
            if self.order == ORDER_BALANCED:
                bh = tile % self.batch_heads
                row_tile = tile // self.batch_heads
            else:
                bh = tile // self.row_tiles
                row_tile = tile % self.row_tiles
            if self.CAUSAL:
                row_tile = self.row_tiles - 1 - row_tile
        q_head = bh % self.heads_q
        q_base, k_base, seqlen_q, seqlen_k = self.span(sequence)
        return (bh // self.heads_q, q_head, q_head // self.group, row_tile * self.TILE_ROWS, bh,
                q_base, k_base, seqlen_q, seqlen_k)

    @gluon.jit
    def span(self, sequence):
        """(its first packed query row, its first packed key, query rows, keys) of a tile's
        sequence: with DOCUMENTS from the offsets, else (0, 0, seqlen_q, seqlen_k)."""
        if self.DOCUMENTS:
            result = sequence_span(self.cu_q, self.cu_k, sequence)
        else:
            result = (0, 0, self.seqlen_q, self.seqlen_k)
        return result

    @gluon.jit
    def key_blocks(self, q_start, seqlen_q, seqlen_k):
        """How many key blocks the tile of rows [q_start, q_start + TILE_ROWS) of a sequence of
        ``seqlen_q`` rows and ``seqlen_k`` keys walks, and how many of the first of them every
        row sees whole (no test per pair): the host's ``planning.key_walk.tile_key_blocks``,
        but a tile whose rows see no key still walks block 0, all hidden, so that every row is
        written. With CAUSAL the keys end at the last row's diagonal."""
        if self.CAUSAL:
            visible_end = gl.minimum(seqlen_k, q_start + self.TILE_ROWS + seqlen_k - seqlen_q)
            num_blocks = gl.cdiv(gl.maximum(visible_end, 1), self.BLOCK_N)
            unmasked_blocks = gl.maximum(q_start + seqlen_k - seqlen_q + 1,
                                         0) // self.BLOCK_N
            unmasked_blocks = gl.minimum(unmasked_blocks, seqlen_k // self.BLOCK_N)
        else:
            num_blocks = gl.cdiv(gl.maximum(seqlen_k, 1), self.BLOCK_N)
            unmasked_blocks = seqlen_k // self.BLOCK_N
        return num_blocks, unmasked_blocks


@aggregate
class BlockLists:
    """A masked call's active key blocks per work tile, from the mask's activity lists
    (``planning.activity.BlockLists``: per (mask batch, mask head, row tile of TILE_ROWS rows) a
    row of int32 (count, full count, block indices...), the full blocks first). A tile walks
    max(count, 1) blocks: one whose rows see no key walks block 0 with its mask, which hides
    every pair, so that every row is written. Position 0 and the positions from ``full`` on
    are tested per pair; the loader brings a mask tile for exactly those."""
    table: gl.tensor
    batch_stride: gl.tensor
    head_stride: gl.tensor
    row_stride: gl.tensor
    list_head_div: gl.tensor
    mask_head_div: gl.tensor
    mask_batches: gl.tensor

    @gluon.constexpr_function
    def __init__(self, table, batch_stride, head_stride, row_stride, list_head_div,
                 mask_head_div, mask_batches):
        self.table = table
        self.batch_stride = batch_stride
        self.head_stride = head_stride
        self.row_stride = row_stride
        self.list_head_div = list_head_div
        self.mask_head_div = mask_head_div
        self.mask_batches = mask_batches

    @gluon.jit
    def row(self, batch, q_head, row_tile):
        """(the tile's list row, its mask batch, its mask head): query head h reads list head
        h // list_head_div and mask head h // mask_head_div (they differ where the mask's
        head axis has stride 0); the batch stride is 0 where one table serves the batch, and
        ``mask_batches`` 0 where the mask does."""
        mask_head = q_head // self.mask_head_div
        mask_batch = batch * self.mask_batches
        row = (self.table + batch.to(gl.int64) * self.batch_stride
               + (q_head // self.list_head_div).to(gl.int64) * self.head_stride
               + row_tile.to(gl.int64) * self.row_stride)
        return row, mask_batch, mask_head

    @gluon.jit
    def counts(self, row):
        """(active blocks, full blocks) of a list row; the tile walks max(count, 1)."""
        return gl.load(row), gl.load(row + 1)

    @gluon.jit
    def block(self, row, position, count):
        """The key block at ``position`` of a list row of ``count`` blocks (block 0 for an
        empty list's one walk)."""
        return gl.load(row + 2 + position, mask=position < count, other=0)


@aggregate
class KeyBlockWork:
    """The program's key block and the query blocks that see it. A grid of (key blocks) x
    (batch x key heads) programs: without causality a (batch, key head)'s key blocks start
    together (its Q and dO rows are read from L2 by all of them); with causality programs
    start in the order of their key block, those walking the most query blocks first (H200,
    B2 H16/4 L4096 D64: 1.08 -> 0.82 ms; with it, non-causal D128 L8192 ran 4% slower). With
    GROUPED_ORDER the (batch, key head)s go in groups of ``order_group``, each group's
    programs in the order of their key block: causal, the programs in flight add dQ into fewer
    heads' rows (``tuning.HOPPER_BACKWARD_CAUSAL_GROUP_WAVES``; H200, B8 H16 L2048 D128: 1.26
    -> 0.92 ms); for KeyIntervals in their key order, which run non-causal and whose first key
    blocks walk the most query blocks, the longest walks start first
    (``tuning.HOPPER_BACKWARD_ORDERED_GROUP_WAVES``). With SPLIT_HEADS a program walks one query head of the group (a grid of
    (key blocks) x (batch x query heads), ordered as above with query heads in place of key
    heads): a key block's walks over the group's heads, otherwise one after another in one
    program, run in parallel programs, and its dK and dV are the sums of their partials."""
    seqlen_q: gl.tensor
    seqlen_k: gl.tensor
    heads_q: gl.tensor
    heads_kv: gl.tensor
    group: gl.tensor
    order_group: gl.tensor
    kv_head: gl.tensor
    key_block: gl.tensor
    q_base: gl.tensor
    k_base: gl.tensor
    q_shift: gl.tensor
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    CAUSAL: gl.constexpr
    GROUPED_ORDER: gl.constexpr
    DOCUMENTS: gl.constexpr
    SPLIT_HEADS: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, seqlen_q, seqlen_k, heads_q, heads_kv, group, order_group, kv_head,
                 key_block, q_base, k_base, q_shift, BLOCK_M, BLOCK_N, CAUSAL, GROUPED_ORDER,
                 DOCUMENTS, SPLIT_HEADS):
        """With DOCUMENTS, the program's sequence as ``document_key_block`` gives it: its
        query rows from query block 0's first (``seqlen_q``) and its keys (``seqlen_k``), the
        program's key head and key block, query block 0's first packed row (``q_base``), the
        sequence's first packed key (``k_base``) and the rows before its first (``q_shift``);
        without, those five are stand-ins never read."""
        self.seqlen_q = seqlen_q
        self.seqlen_k = seqlen_k
        self.heads_q = heads_q
        self.heads_kv = heads_kv
        self.group = group
        self.order_group = order_group
        self.kv_head = kv_head
        self.key_block = key_block
        self.q_base = q_base
        self.k_base = k_base
        self.q_shift = q_shift
        self.BLOCK_M = gl.constexpr(BLOCK_M)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.CAUSAL = gl.constexpr(CAUSAL)
        self.GROUPED_ORDER = gl.constexpr(GROUPED_ORDER)
        self.DOCUMENTS = gl.constexpr(DOCUMENTS)
        self.SPLIT_HEADS = gl.constexpr(SPLIT_HEADS)

    @gluon.jit
    def coordinates(self):
        """(batch, key head, first key) of this program (with DOCUMENTS batch 0 and the key in
        the sequence's own coordinates)."""
        if self.DOCUMENTS:
            result = (self.kv_head * 0, self.kv_head, self.key_block * self.BLOCK_N)
        else:
            result = self._grid_coordinates()
        return result

    @gluon.jit
    def _grid_unit(self):
        """(the program's unit, its key block): the unit is its (batch, key head), or with
        SPLIT_HEADS its (batch, query head), counted batch-major."""
        key_blocks = gl.cdiv(self.seqlen_k, self.BLOCK_N)
        pid = gl.program_id(0)
        units = gl.num_programs(0) // key_blocks
        if self.GROUPED_ORDER:
            programs = self.order_group * key_blocks  # a full group's
            first_unit = (pid // programs) * self.order_group
            units_here = gl.minimum(units - first_unit, self.order_group)  # the last: fewer
            local = pid % programs
            unit = first_unit + local % units_here
            key_block = local // units_here
        elif self.CAUSAL:
            unit = pid % units
            key_block = pid // units
        else:
            unit = pid // key_blocks
            key_block = pid % key_blocks
        return unit, key_block

    @gluon.jit
    def _grid_coordinates(self):
        unit, key_block = self._grid_unit()
        if self.SPLIT_HEADS:
            result = (unit // self.heads_q, (unit % self.heads_q) // self.group,
                      key_block * self.BLOCK_N)
        else:
            result = (unit // self.heads_kv, unit % self.heads_kv, key_block * self.BLOCK_N)
        return result

    @gluon.jit
    def group_heads(self):
        """[first, stop) of the GQA group's query heads (0 .. group - 1) this program walks:
        all of them, or with SPLIT_HEADS its own one."""
        first = 0
        stop = self.group
        if self.SPLIT_HEADS:
            unit, key_block = self._grid_unit()
            first = (unit % self.heads_q) % self.group
            stop = first + 1
        return first, stop

    @gluon.jit
    def batch_heads(self):
        """B x Hk."""
        if self.DOCUMENTS:
            result = self.heads_kv
        else:
            result = gl.num_programs(0) // gl.cdiv(self.seqlen_k, self.BLOCK_N)
            if self.SPLIT_HEADS:
                result = result // self.group
        return result

    @gluon.jit
    def packed_row(self, first_row):
        """The packed query row of the program's row ``first_row`` (DOCUMENTS: counted from
        query block 0's first), else ``first_row``."""
        result = first_row
        if self.DOCUMENTS:
            result = self.q_base + first_row
        return result

    @gluon.jit
    def packed_key(self, key):
        """The packed key of the program's key ``key`` (DOCUMENTS), else ``key``."""
        result = key
        if self.DOCUMENTS:
            result = self.k_base + key
        return result

    @gluon.jit
    def head_walk(self, lists, batch, q_head, first_key, MASKED: gl.constexpr):
        """Query head ``q_head``'s walk over this key block: (list row, mask batch, mask head,
        start, stop, full). MASKED: positions [0, count) of the head's activity list, the
        first ``full`` of them whole blocks (``query_block`` reads each); else the query
        blocks [first, stop) of ``query_blocks`` (the list values then unused)."""
        if MASKED:
            row, mask_batch, mask_head = lists.row(batch, q_head, first_key // self.BLOCK_N)
            count, full = lists.counts(row)
            start = 0
            stop = count
        else:
            row = lists.table
            mask_batch = batch
            mask_head = q_head
            start, stop = self.query_blocks(first_key)
            full = stop
        return row, mask_batch, mask_head, start, stop, full

    @gluon.jit
    def query_block(self, lists, row, position, stop, MASKED: gl.constexpr):
        """The query block at ``position`` of a walk (``head_walk``)."""
        block = position
        if MASKED:
            block = lists.block(row, position, stop)
        return block

    @gluon.jit
    def query_blocks(self, first_key):
        """[first, stop) query blocks with a row that may see a key of the block: with
        causality (bottom-right) row r sees keys up to r + Lk - Lq."""
        stop = gl.cdiv(self.seqlen_q, self.BLOCK_M)
        first = 0
        if self.CAUSAL:
            first = gl.maximum(first_key - (self.seqlen_k - self.seqlen_q), 0) // self.BLOCK_M
            first = gl.minimum(first, stop)
        return first, stop


@gluon.jit
def document_key_block(documents, cu_q, cu_k, heads_kv, BLOCK_N: gl.constexpr,
                       ROW_ALIGN: gl.constexpr):
    """The backward program's key block of packed documents: (key head, key block of its
    sequence, query block 0's first packed row, the sequence's first packed key, the rows
    before the sequence's first in query block 0, query rows from query block 0's first,
    keys). ``documents`` is an int32 table, its count of key blocks first, then per key block
    (sequence, key block) in the order the programs start them
    (``planning.documents.document_key_blocks``), key heads inner. Query block 0 starts at the
    ROW_ALIGN boundary at or before the sequence's first row: a TMA box of the loader's
    float32 rows must start 16-byte aligned. A program past the count has no rows and no
    keys, so it walks nothing and writes nothing."""
    pid = gl.program_id(0)
    entry = pid // heads_kv
    active = entry < gl.load(documents)
    at = documents + 1 + 2 * gl.where(active, entry, 0)  # entry 0 always exists
    first_row, k_base, seqlen_q, seqlen_k = sequence_span(cu_q, cu_k, gl.load(at))
    shift = first_row % ROW_ALIGN
    return (pid % heads_kv, gl.load(at + 1), first_row - shift, k_base, shift,
            gl.where(active, seqlen_q + shift, 0), gl.where(active, seqlen_k, 0))


@gluon.jit
def sequence_span(cu_q, cu_k, sequence):
    """(its first packed query row, its first packed key, query rows, keys) of packed
    sequence ``sequence``, from the int32 offsets ``cu_q`` and ``cu_k``."""
    q_base = gl.load(cu_q + sequence)
    k_base = gl.load(cu_k + sequence)
    return (q_base, k_base, gl.load(cu_q + sequence + 1) - q_base,
            gl.load(cu_k + sequence + 1) - k_base)
