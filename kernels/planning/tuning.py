"""Every tuned constant of the schedule, each beside the measurement that chose it.

All timings are GPU time on one H100 (bf16 unless named, L2 flushed); ``kernels.schedule`` is
the only reader. Tiles are (query rows, key cols) with the warps and pipeline stages of their
launch. Under Triton's interpreter every kernel gets small unequal tiles instead, so that tiny
CPU test shapes still span several tiles, partial tiles and the causal edge.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tile:
    """A kernel's tile and launch options."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}"


# -- forward tiles, by padded head dim
# Interpreter: the same tiles as the interpreted dq kernel.
FORWARD_INTERPRETED = Tile(32, 16, 4, 1)
# fp32 tiles take twice the shared memory; fp32 is for accuracy checks, not speed.
FORWARD_FP32 = Tile(64, 32, 4, 2)
FORWARD_FP32_WIDE = Tile(64, 32, 4, 1)  # head dims above 128
# D <= 64: 64-row blocks were 1.4-1.6x faster than 128 (L16384 H2/1: twice the programs for
# few heads, and a shorter critical path on causal rows).
FORWARD_D64 = Tile(64, 64, 4, 3)
# 64 < D <= 128: with a mask, 128-row tiles amortize the list walk better (0.66 vs 0.74 ms at
# B2 H16/4 L4096 causal); without one, 64-row tiles win (0.37 vs 0.44 ms).
FORWARD_D128_MASKED = Tile(128, 64, 8, 3)
FORWARD_D128 = Tile(64, 64, 4, 3)
# KeyIntervals without a bias at D = 128 (at least 64 query rows): the no-mask tile wins there
# too. H100, B1 H16/4 bf16 causal, ms per forward, 128x64 w8 s3 -> 64x64 w4 s3 (dmbench fwd,
# median of 20, two rounds alike): documents as varlen 16k W2048 0.259 -> 0.230, 16k W8192
# 0.946 -> 0.880, 64k W2048 1.005 -> 0.931, 64k W8192 2.294 -> 2.119; documents as intervals
# 16k W8192 0.88 -> 0.83; sliding W4096 16k 1.082 -> 1.015, W256 (B2 L4096) 0.111 -> 0.103;
# top-2048 intervals 8k 0.486 -> 0.447, 32k 1.920 -> 1.766. With a per-key bias it loses
# (top-2048 8k 0.537 -> 0.617, documents 16k W8192 0.974 -> 1.336; with 2 stages 0.91-1.07),
# and with a bool mask (sliding W1024 8k 0.214 -> 0.282, topk W2048 8k 0.93 -> 1.10).
FORWARD_D128_INTERVALS = Tile(64, 64, 4, 3)
FORWARD_D256 = Tile(64, 32, 4, 2)
# KeyIntervals masks take the same tiles as bool masks. Read as one int64 word per key
# (``score.mask_keeps``), the D80 forward compiles without spills at 128x64 w8 s3. B1 H16/4
# L4096 topk W1024 kv_row causal, H100, ms per call (30 calls per sample, median of 5):
#   D80:  128x64 w8 s3 0.233, s2 0.253, 128x32 w8 s3 0.276; bool mask 0.254
#   D96:  128x64 w8 s3 0.234, s2 0.258; bool 0.257
#   D192: 64x32 w4 s2 0.533, 64x16 w4 s2 0.649; bool 0.505
#   D256: 64x32 w4 s2 0.480, 64x16 w4 s2 0.663; bool 0.451
# (Read as two int32 loads at key stride 2 they had needed 128x64 s2 at D80/D96 and 64x16 at
# D192, and stayed 1.2-1.3x the bool mask's time.)

# -- backward tiles: dkdv keeps a key block resident and walks query blocks (block_m query rows
# per step, block_n keys per program); dq the reverse.
DKDV_INTERPRETED = Tile(16, 32, 4, 1)  # unequal, so the causal split runs with BLOCK_M != BLOCK_N
DQ_INTERPRETED = Tile(32, 16, 4, 1)
BACKWARD_FP32 = Tile(32, 32, 4, 1)
DKDV_D64 = DQ_D64 = Tile(64, 64, 4, 3)
# 64 < D <= 128: 64-key dkdv blocks give twice the programs of 128-key ones, which decides the
# backward when B * Hk is small (B1 H8/2 L2048: 32 programs on 132 SMs), and 32 query rows a
# shorter critical path; 32x64 with 4 warps beat 64x128 with 8 warps on every probed case.
DKDV_BLOCK_N = 64
DKDV_D128 = Tile(32, DKDV_BLOCK_N, 4, 3)
# Decode-sized Lq (at most DKDV_DECODE_ROWS rows) wastes less in 16-row steps.
DKDV_DECODE_ROWS = 16
DKDV_D128_DECODE = Tile(16, DKDV_BLOCK_N, 4, 3)
# On a grid of a few programs (L256: 16) each program's walk is the whole kernel: 16-key blocks,
# 4x the programs, took it from 53 to 32 us; at 64 programs (L1024) they gain under 10%, at 256
# they lose. "Small" is a DKDV_BLOCK_N grid of at most a quarter of the multiprocessors.
DKDV_D128_SMALL_GRID = Tile(32, 16, 4, 3)
DKDV_SMALL_GRID_SHARE = 4
DQ_D128 = Tile(64, 32, 4, 3)
# ... but on a grid of enough 128-key programs, 64 query rows x 128 keys with 8 warps wins
# (``backward_schedule.dkdv_takes_wide_tile``). Backward (dq + dkdv) time, wide / 32x64 w4,
# H100 bf16 D128 causal unless "full"; median of 3-4 interleaved rounds;
# p = B * Hk * ceil(Lk / 128):
#   no mask: B2 H16/4 L8192 full 0.888, causal 0.932 (fp16 0.931); B1 H32/8 L8192 0.925
#   no mask, p 64-128: B1 H16/4 L2048 0.914, B1 H8/2 L4096 0.870, L3072 0.713, L4096 0.856
#   no mask, few query rows: B1 H16/4 Lk8192 Lq256 0.828, Lq128 0.926, Lq64 0.853
#   top-1024 kv_row bias: B1 H16/4 L4096 0.888 (D80 0.966, D96 0.990), L8192 0.912;
#     B1 H12/6 L2048 (p 96) 0.951, B1 H16/4 L2048 (p 64) 1.046
#   sliding 1024 kv_row: B2 H16/4 L8192 0.947
#   p 16-32 (B1 H8/2 L1024 and L2048, B1 H16/4 L1024): 1.006-1.335, so small grids keep 32x64.
# Two stages instead of three: 1.052 on the full L8192 row (masks with mostly partial tiles get
# two anyway, ``DKDV_PARTIAL_TILES_STAGES``).
DKDV_D128_WIDE = Tile(64, 128, 8, 3)
DKDV_INTERPRETED_WIDE = Tile(16, 64, 4, 1)  # what kernel_options['dkdv_wide_tile'] forces there
DKDV_WIDE_MIN_PROGRAMS_PER_SM = 0.45  # 60 programs on 132 multiprocessors
DKDV_WIDE_MIN_ROWS = 64
# A prepared mask whose active wide tiles hold more pairs than this times its active narrow
# tiles keeps the narrow tile: block_topk masks (whole 64-key blocks per row) took 1.07-1.20x
# as long with the wide tile (B2 H16/4 and H32/8, L4096 and L8192, W1024 kv_row).
DKDV_WIDE_MAX_EXTRA_WORK = 1.15
# 128 < D <= 256: 64x64 tiles with 8 warps against 32x32 with 4 (dkdv us, H100, bf16, causal,
# kv_row bias; topk rows take topk_intervals masks): D256 B1 H16/4 L4096 topk W1024 120 vs 156,
# L16384 1722 vs 2297; D256 B2 H16/4 L8192 no mask 776 vs 999; D160 B2 H8/2 L4096 topk 160 vs
# 162. 32x64 with 8 warps came between (143, 2142, 1020, 173); one stage was slower everywhere.
DKDV_D256 = Tile(64, 64, 8, 2)
DQ_D256 = Tile(64, 16, 4, 2)
# dkdv's pipeline stages at 64 < D <= 128 in 16-bit where more than half its tiles are partial
# (each loads a mask tile beside q and dO): 2 stages beat 3 by 5-14% (topk masks at D 80, 96,
# 128 and L4096; B2 H16/4 L4096; L16384), where on full tiles 3 stayed ahead (H32/8 L8192
# block_topk by 6%, no mask at L8192 by 4%). A mask read within the call has no count and gets
# 2, as a dynamic (topk) mask's tiles are mostly partial.
DKDV_PARTIAL_TILES_STAGES = 2
DKDV_PARTIAL_SHARE_FOR_FEWER_STAGES = 0.5

# -- the packed decode backward
# It takes calls whose GQA group has at most this many query rows (Lq x G).
PACKED_MAX_ROWS = 16
PACKED_INTERPRETED = Tile(0, 16, 4, 1)  # block_m follows the rows; small key blocks and shares
PACKED_WIDE = Tile(0, 32, 4, 2)  # fp32 or D > 128: a program holds K, V, dk and dv tiles
# B1 H32/8 D128, GPU time at Lk 4096 / 65536 / 524288: 8 warps 21.0 / 203 / 1531 us, 4 warps
# 25.3 / 226 / 1700; 128-key blocks (8 warps, 2 stages) 30.3 / 223 / 1664; 32-key blocks
# 26.8 / 209 / 1528.
PACKED_D128 = Tile(0, 64, 8, 3)
# With at most this share of a prepared mask's key blocks live, the packed launch branches
# around dead blocks; above it, it reads every block and predicates K and V per key. The branch
# costs the loop its software pipelining: at B1 H32/8 Lq1 Lk65536 D128 a topk mask (nearly
# every block live) took 331 us with the branch and 241 with the predicate; a block-sparse one
# with 1/16 of the blocks live took 157 and 233.
PACKED_LIVE_SHARE_FOR_BRANCH = 0.5

# Unprepared KeyIntervals in a forward-only call, up to this many keys per program (Lk, or
# Lk / key splits: each split reads its own share): each program reads the intervals of its
# reachable keys and walks the key blocks between its first and last visible key
# (``forward_schedule.scan_keys``), in place of the read and list-compaction launches. Decode
# with splits, B1 H32/8 Lk65536 top-4096: scan / list 0.93.
# H100, CUDA-graph replays, bf16 D128 causal kv_row bias, scan / list time:
#   B1 H16/4 top-1024:   L256 0.71, L1024 0.81, L2048 0.88, L4096 0.90, L8192 0.90
#   B1 H8/2 sliding 256: L1024 0.86, L2048 0.77, L4096 0.89, L8192 1.02, L16384 1.30
# (each program reads every reachable key's interval: O(Lk) per program, which a sliding
# window's few blocks per program do not repay at long Lk).
FORWARD_SCAN_MAX_KEYS = 4096
# ... except for head dims strictly between these (D80, D96 padded to 128): B1 H16/4 L4096
# top-1024, scan / list D80 1.04, D64 0.87, D256 0.95 (an earlier loop layout of the scan:
# D96 1.07, D192 0.81).
FORWARD_SCAN_SKIPS_HEAD_DIMS = (64, 128)
# Keys per step of that read (int32 start and end: 8 KB a step from L2).
FORWARD_SCAN_CHUNK = 1024

# -- grids
# Split-K (forward, dq, packed) only where the grid fills less than half the multiprocessors,
# aiming at this many programs per multiprocessor, at most MAX_KEY_SPLITS shares. From half a
# wave up, partial buffers and their merge cost more than the idle multiprocessors (B1 H8/2
# L2048 with a mask: 128 programs on 132). Shares fill one wave of this many programs per
# multiprocessor and no more: the decode forward (D128, 64x64 tile, 2 resident per
# multiprocessor) at B8 H32/8 Lq1 bf16, us at Lk32768 / 131072, 5 shares (320 programs) 263 / 987,
# 4 shares (256) 253 / 954 (SDPA 253 / 948); B4 H16/4 Lk65536, 17 shares 146, 16 shares 139
# (H200, one process).
SPLIT_PROGRAMS_PER_SM = 2
MAX_KEY_SPLITS = 128
# The fewest key blocks per share: the forward's and packed launch's 64-key blocks, 4; dq's
# 32-key blocks, 8 (a share of fewer than ~256 keys saves less than its partials cost: L256
# has 8 dq blocks and does not split).
MIN_BLOCKS_PER_SPLIT = 4
DQ_MIN_BLOCKS_PER_SPLIT = 8
# dq and dkdv run as one launch when together they fill at most this many waves: at L256 (128
# programs on 132 SMs) the backward took 224 instead of 264 us; from two waves up the fused
# kernel lost (211 vs 174 us at L1024, 1504 vs 1316 at L4096), as dkdv then rebuilds delta and
# each program is sized for the larger kind.
FUSE_MAX_WAVES = 1
# dkdv splits its GQA group's heads into shares (fp32 partials, summed by the last share of a
# key block) while its grid stays within this many waves (B1 H8/2 L2048: 64 programs on 132).
DKDV_SHARE_WAVES = 2
# A causal grid runs in chunks of rows of at least this many programs per multiprocessor;
# probed with 2, 4, 8 and the whole grid as one chunk on causal dense, gqa, seqlen and window
# rows: 8 was best or within noise of the best everywhere.
CHUNK_PROGRAMS_PER_SM = 8


# -- the Hopper route's forward (``hopper_device.attention_forward``)
@dataclass(frozen=True)
class HopperTile:
    """A Hopper forward program: ``consumers`` (two or three) consumer warpgroups of ``rows``
    query rows each, key blocks of ``block_n``, a K/V ring of ``stages`` slots, and the
    registers per thread that the consumers and the loader warp take (``setmaxnreg``).
    ``overlap``: each warpgroup runs a block's PV product during the next block's softmax
    (else it retires it first, ``forward_consumer._serial_key_blocks``)."""

    rows: int
    block_n: int
    stages: int
    consumer_regs: int
    loader_regs: int
    consumers: int = 2
    overlap: bool = True

    @property
    def tile_rows(self) -> int:
        """Query rows per work tile: a ``rows`` for each consumer warpgroup."""
        return self.consumers * self.rows

    def __str__(self) -> str:
        serial = "" if self.overlap else " serial"
        return f"{self.tile_rows}x{self.block_n} s{self.stages}{serial}"


# Two 64-row warpgroups over 128-key blocks, a two-slot ring: 160 KB of shared memory at head
# dim 128 (Q 32 KB, each K or V slot 32 KB); 168 registers at launch, 0 spills (ptxas, sm_90a).
HOPPER_FORWARD = HopperTile(64, 128, 2, 240, 24)
# Three 64-row warpgroups (FlashAttention-3's forward at head dim 64 takes three, 192 x 128
# causal), where the products are short and a third warpgroup's softmax can hide under the
# other two's products; 160 registers a consumer thread, the most three warpgroups and a loader
# get (3 x 128 x 160 + 128 x 24 of 64K). Over 128-key blocks each block's PV product retires
# before the next block's scores (``overlap=False``; offline sm_90a: 0 spills dense, 8 B with a
# bias row): overlapped, the score tile, P, the next P and O are live together and spill (240
# B causal). The overlapped walk over 64-key blocks in a four-slot ring fits (0 spills, 115 KB)
# but led nowhere. H200, bf16, D64 B2 H16/4, forward alone in one dmbench run each (d037f3c),
# over two warpgroups' Hopper forward: this tile L8192 non-causal 1.12x (1.097 against 1.231
# ms; SDPA's cuDNN 1.129), causal 1.05x (0.583 / 0.612); L4096 non-causal 1.02x, causal 0.98x;
# with a kv_row bias L8192 1.07x / 0.94x, L4096 0.97x / 0.84x. The 64-key overlapped tile:
# 0.97-1.03x everywhere. Head dims up to 64, no mask, no packed documents.
HOPPER_FORWARD_THREE = HopperTile(64, 128, 2, 160, 24, consumers=3, overlap=False)
HOPPER_FORWARD_THREE_MAX_HEAD_DIM = 64
# The default takes HOPPER_FORWARD_THREE for a call without a mask or bias whose query rows
# and keys both number at least this (``hopper_forward.takes_three_consumers``). Under key-row
# masks (forced, 192-row lists) it lost to two warpgroups: top-W W1024 with a kv_row bias, B1
# H16/4, D32/D64, CUDA graphs (85291d7), 0.88-0.93x bool and intervals at L16384, 0.91-0.93x
# bool and 0.69x intervals at L4096.
HOPPER_FORWARD_THREE_MIN_LENGTH = 8192
# Where a call takes the Hopper forward: at least this many query rows, and its tiles walk at
# least this many key blocks on average (``hopper_forward.mean_key_blocks``), else the
# per-tile prologue and epilogue dominate. TFLOP/s on an H200, B8 H16 D128 bf16, Hopper
# against Triton route (SDPA): L512 full (4 blocks) 390 against 302 (451); L512 causal (2.5)
# 97 against 187 (241); L1024 causal (4.5, B16) 310 against 280 (411).
HOPPER_FORWARD_MIN_QUERIES = 512
# A bias row ((.., .., 1, Lk): the loader copies each key block's row beside K, and the
# consumers add it, x log2 e, to the scaled scores) takes the Hopper forward by default at head
# dims of at least this (the kernel's 128-wide tiles). H200, bf16, forward alone, Triton route
# over Hopper route in one process: D128 B2 H16/4 L8192 causal 1.23x, non-causal 1.30x; with a
# prepared band, B1 H32/8 L8192 W2048 1.20x, L16384 W4096 1.37x; D64 B1 H16/4 L4096 causal 0.72x.
HOPPER_FORWARD_BIAS_MIN_HEAD_DIM = 72
# Whether a full bias (a row per query row) takes the Hopper forward by default, where it also
# meets the rules above (``hopper_forward.takes_hopper``); ``kernel_options['forward_route']``
# 'hopper' takes it either way. Each warpgroup's [64, 128] tile of the bias comes through a
# slot of its own (``hopper_device.bias.ForwardBias``), 16 KB a block beside K's and V's 32 KB
# each at head dim 128; one slot, so a tile's load waits for the former tile's scores. Off: it
# trails the Triton route, bias.yaml fwd as CUDA graphs (B1 H8/2 L2048 D128 causal, 85291d7),
# forced Hopper over default 1.06-1.08x the time dense (kv_full, q_full, shared: 42.7-44.5
# against 40.1-41.7 us), 1.15-1.19x under a sliding window.
HOPPER_FORWARD_FULL_BIAS = False
# Whether preparing KeyIntervals recognizes those that are exactly packed documents
# (``masks.found_documents``), so that the Hopper kernels walk them as they walk varlen's own.
# H200, varlen.yaml's intervals rows (16k and 64k packed tokens, causal, D128, GQA 4, without
# a bias), fwd+bwd: 0.79-0.84x the time of the Triton forward and the Hopper backward over the
# intervals' lists, measured with the backward over documents.
FIND_DOCUMENTS = True
# Whether preparing a bool mask whose every key is kept by one run of query rows (causal,
# sliding windows, documents, a top-W mask of a per-key bias) gives calls the KeyIntervals of
# the same pairs (``masks.key_runs``), with a key order where it cuts the rows their key blocks
# span by at least BOOL_MASK_RUNS_ORDER_GAIN. H200, forward of a prepared causal top-W mask
# of a kv_row bias, D128 bf16, one process: B2 H16/4 L8192 W1024 0.846 ms read as runs against
# 2.077 as a bool mask (the dense Hopper forward 0.881), B1 H16/4 L8192 W2048 0.733 against
# 1.059; models-fwd at 32k W2048: the same mask as key-ordered intervals 2.14 ms against 14.5
# (bwd 7.6 against 24.2).
BOOL_MASK_RUNS = True
BOOL_MASK_RUNS_ORDER_GAIN = 1.5
# ... and where that order saves at least this many (query row, key) pairs walked, its key
# blocks' rows saved times 128 keys times the query heads and batches each mask head serves:
# below it the kernels' time does not follow the pairs, and an eager call pays the order's
# host time (the row copies of K, V and the bias). H200, bias.yaml's B1 H8/2 L2048 D128 W256
# causal top-W bool mask prepared (the order saves 9.2M pairs), forward in one dmbench run
# (804ae76, this tree against itself with the order off): eager 0.145 / 0.154 ms with the
# order, 0.079 / 0.077 without (no bias / kv_row bias; sdpa 0.070); as CUDA graphs 0.054 /
# 0.058 against 0.051 / 0.064. seqlen.yaml's B1 H16/4 L4096 W1024 saves 52M pairs.
BOOL_MASK_RUNS_ORDER_LEAST_SAVED_PAIRS = 1 << 24


# -- the Hopper route's backward (``hopper_device.attention_backward``)
@dataclass(frozen=True)
class HopperBackwardTile:
    """A Hopper backward program: ``block_n`` keys (two consumer warpgroups of half each),
    query blocks of ``block_m`` rows in a ring of ``stages`` slots, and the registers per
    thread the consumers and the loader warp take (``setmaxnreg``)."""

    block_m: int
    block_n: int
    stages: int
    consumer_regs: int
    loader_regs: int

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n} s{self.stages}"


# 198,000 bytes of shared memory at head dim 128 (K, V 32 KB each; two slots of Q, dO, LSE and
# delta 65 KB; two dS^T tiles 32 KB; dQ's float32 staging 32 KB); ptxas (sm_90a, offline)
# spills none at D128 non-causal and D64, 68 bytes at D128 causal. Three slots fit (231 KB)
# and ran no faster on the H200 (B2 H16 L8192 D128: 6.22 / 6.25 ms; D64 alike). A bool mask
# (its bytes beside Q) takes 214 KB, KeyIntervals 198 KB; with a bias row 288-376 bytes spill.
HOPPER_BACKWARD = HopperBackwardTile(64, 128, 2, 240, 24)
# Causal Hopper backward programs start in the order of their key block, longest walk first
# (``tiles.KeyBlockWork``), in groups of (batch, key head)s whose programs fill about this many
# waves, so that the programs in flight add dQ into fewer heads' rows (None: one order over
# all). H200, bf16, B x L = 16384 causal, backward alone, one process, None / 1 / 2 / 4 waves:
#   D128 H16: L1024 0.801 / 0.628 / 0.609 / 0.635 ms; L2048 1.263 / 0.945 / 0.917 / 0.922;
#             L4096 1.688 / 1.767 / 1.675 / 1.527; L8192 2.869 / 3.021 / 2.876 / 2.749
#   D64 H16/4: L1024 0.363 / 0.382 / 0.359 / 0.360; L2048 0.558 / 0.622 / 0.559 / 0.558
# Without groups the programs in flight at L2048 spread their reduce-adds over all 128 heads'
# dQ rows (134 MB of float32, more than the L2 holds).
HOPPER_BACKWARD_CAUSAL_GROUP_WAVES: float | None = 4
# KeyIntervals in their key order (``hopper_backward.ordered_walks``) run non-causal, their first
# key blocks walking nearly every query block: their programs start in the order of their key
# block, in groups of units filling about this many waves (None: one order over all units).
# Counted on the CPU (walks of 64-row steps, +2 a program, 132 multiprocessors, split heads),
# the grid's last program ends at, by unit / by key block over all units / sorted longest
# first (the even share): B2 H16/4 L8192 W1024 475 / 390 / 390 (389); B1 H16/4 L16384 W1024
# 583 / 416 / 415 (414); B1 H12/4 D64 L32768 W2048 1374 / 1108 / 1039 (1038); by key block in
# groups of 4 or 8 units: 462 and 437 at L8192. H200, bf16, kv_row bias, split heads, the
# backward's time in one process (CUDA events around autograd.grad, the key order's gathers
# included), by unit / all units / 8 waves / 16 waves, us: B2 H16/4 L8192 D128 W1024 2034 /
# 1979 / 1803 / 1827; B1 H16/4 L16384 D128 W1024 2242 / 1895 / 2230 / 1904; B1 H12/4 D64
# W2048 L8192 1064 / 950 / 920 / 937, L32768 3103 / 2581 / 3086 / 2938. All units: 1.03-1.20x
# the order by unit, and within 10% of the best of the four everywhere.
HOPPER_BACKWARD_ORDERED_GROUP_WAVES: float | None = None
# Where the schedule's default takes the Hopper backward: the mean number of BLOCK_M query
# blocks a key block's program walks (``hopper_backward.mean_query_blocks``; a mask's lists
# not counted) at least this. H200, bf16, backward alone, B x L = 16384, H16, Hopper over the
# Triton backward in one process (cuDNN in brackets):
#   D128 non-causal, walk 8-256 (L512-16384): 1.17, 1.27, 1.41, 1.37, 1.44, 1.48x (0.87-1.01x)
#   D128 causal, walk 17 (L2048): 0.89x; 33-129 (L4096-16384): 1.37, 1.46, 1.33x (0.98-1.06x)
#   D64 H16/4 non-causal, walk 16 (L1024): 0.74x; 32-256: 1.02, 1.07, 1.09, 1.14x
#   D64 H16/4 causal, walk 17 (L2048): 0.93x; 33-129: 1.07, 1.10, 1.15x
# Below a walk of 8 nothing was measured. Causal walks are shorter near the diagonal, where the
# pairs are tested. A bool mask (random 50%, L8192 causal 1.48x), a band (W1024 L8192 1.28x)
# and a bias row with its gradient (L8192: D128 causal 1.41x, D64 1.25x) lead alike; at L2048
# causal they are 1.13x, 1.00x and 0.93x (walk 17, measured before the grouped order).
# With the grouped causal order (4 waves, above), one process, Hopper over the best Triton
# backward ('dq+dkdv'): D128 H16 causal, walk 5 (B32 L512) 0.76x, 9 (B16 L1024) 1.10x, 17
# (B8 L2048) 1.20x; D128 H16 non-causal L1024 1.24x, L2048 1.35x; D64 H16/4 causal walk 9
# 0.83x, 17 1.02x. So head dims > 64 take walks of 8 and more, causal or not.
HOPPER_BACKWARD_MIN_QUERY_BLOCKS = 24
HOPPER_BACKWARD_WIDE_MIN_QUERY_BLOCKS = 8  # head dims > 64
# A program walks its key block for each query head of its GQA group in turn, so a grid of few
# programs, or of long causal walks over few heads, waits on its longest program
# (``hopper_backward.longest_walk_share``: the longest walk over the even share of a
# multiprocessor). The default takes the Hopper backward up to this share. H200, headdim.yaml
# (B1 H16/4 L4096 causal, top-W1024 mask and kv_row bias; share 2.0), Triton's backward over
# Hopper's in one run: D32 0.81x, D64 0.88x, D80 0.98x, D96 0.98x, D128 0.93x; models.yaml at
# shares of about 1.0 (B1 H16/4, H28/4, H32/8, H64/8 at L8192, D128 causal): 1.25-1.41x.
HOPPER_BACKWARD_MAX_LONGEST_WALK_SHARE = 1.5
# Key-ordered top-W intervals (``hopper_backward.ordered_walks``) take the Hopper backward only
# where their kept pairs, batch x query heads x query rows x W, are at least this many: below
# it the eager call is bound by host time, and the Hopper route's (one launch before its kernel
# and one after, descriptors, split-head accumulators) exceeds the Triton backward's. H200,
# bf16, D128, top-W bool mask prepared with a kv_row bias, eager bwd / fwd+bwd ms, the Hopper
# backward (split heads) against the Triton backward ('dq+dkdv') in one dmbench run (6c02448):
# B1 H8/2 L2048 W1024 (16.8M pairs) 0.233 / 0.618 against 0.185 / 0.434; L4096 W512 (16.8M)
# 0.643 / 1.046 against 0.647 / 1.079; L4096 W1024 (33.5M) 0.682 / 1.251 against 0.562 /
# 1.074; in one process (63dd48d), B1 H8/2 L2048 W256 (4.2M) bwd 0.686 against 0.475, and
# B1 H16/4 L4096 W1024 (67M) D80 0.740 against 1.065, D128 0.754 against 0.932. The same row
# read 0.23-0.38 ms across two runs: eager rows this short vary by up to 1.6x.
HOPPER_BACKWARD_MIN_ORDERED_PAIRS = 1 << 26
# Whether the Hopper backward of key-ordered top-W intervals gives each query head of a GQA
# group its own programs (``backward_schedule.split_heads``). Counted on the CPU (one program
# per multiprocessor, in query-block steps): B2 H16/4 L8192 W1024 the grid's last program ends
# at 688 steps where the even share is 371, with one head per program at 461; Doge's B1 H12/4
# L32768 D64 W2048 at 1987 against 1011, split 1291. H200, bf16, a kv_row bias, backward GPU
# time split over whole groups in one process: B2 H16/4 L8192 D128 W1024 1628 / 1979 us
# (fwd+bwd 2119 / 2465), B1 H16/4 L16384 W1024 1975 / 2702, B1 H12/4 D64 L8192 W2048 602 /
# 752, L32768 2632 / 3611 (fwd+bwd 3730 / 4707); unordered intervals (B2 L4096 W1024,
# causal) lose, 1042 / 876, so they keep whole groups.
HOPPER_BACKWARD_SPLIT_ORDERED_HEADS = True
# Whether a grid whose longest walk outlasts the even share by more than
# HOPPER_BACKWARD_MAX_LONGEST_WALK_SHARE with whole GQA groups, and not with a program per query
# head, takes the Hopper backward split (``hopper_backward.splitting_balances``) rather than
# the Triton backward. Counted on the CPU (one program per multiprocessor, in query-block
# steps): B1 H16/4 L4096 causal, the grid's last program ends at 258 steps whole and 138 split.
# H200, bf16, backward GPU time in one process, split / the default before (Triton's, or the
# Hopper backward of whole groups where a mask took it): headdim.yaml's B1 H16/4 L4096 causal
# top-W1024 bool mask and kv_row bias D32 262 / 468 us, D64 285 / 487, D80 446 / 713, D96
# 452 / 716, D128 447 / 691; its KeyIntervals D128 542 / 655; gqa.yaml's B2 L2048 337 / 374;
# window.yaml's B1 H2/1 D64 L16384 W1024 495 / 911; dense causal B1 H16/4 L4096 371 / 489,
# B2 L2048 245 / 294, B2 L1024 94 / 115; dense B2 H16/4 non-causal L1024 127 / 159, L833 108 /
# 132, L512 48 / 54. Off by default: in eager dmbench rows (H200, acbbafd, results/nvidia-h200/
# split-heads-eager) those grids read slower than the Triton backward's published rows, the
# wall time above the GPU time (gqa B2 L2048 bwd 0.81 against 0.38 ms; headdim fwd+bwd D32-D80
# 1.06-1.54 against 0.68-1.17 ms): the split path's host cost is not yet measured or bounded.
# ``kernel_options['backward_split_heads'] = True`` forces it.
HOPPER_BACKWARD_SPLIT_LONG_WALKS = False
# Under a CUDA graph capture, whose replays carry no host time, a grid that fails
# HOPPER_BACKWARD_MAX_LONGEST_WALK_SHARE with whole GQA groups takes the Hopper backward split
# where a program per query head brings its longest walk within
# HOPPER_BACKWARD_CAPTURED_MAX_SPLIT_SHARE (``hopper_backward.splitting_balances``). H200,
# bf16, D128, bias.yaml's B1 H8/2 L2048 causal (shares 7.8 whole, 1.9 split), bwd as CUDA
# graphs in one dmbench run (804ae76), the split Hopper backward against the default Triton
# backward ('dq+dkdv'): no mask 95.6 / 126.4 us (fwd+bwd 126.2 / 156.9), a kv_row bias 99.2 /
# 142.8 (137.6 / 181.1), the W256 sliding mask 49.7 / 54.2, with a kv_row bias 55.9 / 58.9;
# fa4 reads 88 us on the dense row (bias-bwd-cuda-graph). The whole of bias.yaml's bwd as
# graphs with the split on (d037f3c, the kernel made and compiled inside the first capture, 80
# rows ok), against it off in one run: no mask 96 / 127 us, kv_row 99 / 143, the per-key top-W
# mask 114 / 150, with kv_row 142 / 167; the sliding mask 53 / 55; the block top-W mask loses,
# 58 / 51 (kv_row 67 / 57); the other biases (no Hopper backward) within 1%.
HOPPER_BACKWARD_SPLIT_CAPTURED = True
HOPPER_BACKWARD_CAPTURED_MAX_SPLIT_SHARE = 2.0
# A masked captured backward is split only where the prepared mask's active Hopper backward
# tiles hold at least this share of the unmasked walks' pairs (``hopper_backward
# .active_walk_share``): the per-key top-W mask above keeps every causal tile active (share 1.0),
# the sliding W256 mask 0.33 and the block top-W mask 0.09, whose short walks the dense walks'
# shares misjudge.
HOPPER_BACKWARD_CAPTURED_MIN_ACTIVE_SHARE = 0.5
# deterministic=True (dQ's adds ordered by a lock per query block): non-causal walk 32 (L2048)
# 0.96x, 128 (L8192) 1.13x; causal 0.79x (L2048) and 0.89x (L8192) stay on Triton's.
HOPPER_BACKWARD_DETERMINISTIC_MIN_QUERY_BLOCKS = 64
# A call with a bool mask takes the Hopper forward where its prepared mask's share of partial
# 128 x 128 tiles (tested per pair; the full ones are not) is at most this; a mask read by the
# call, whose share is not counted, keeps the Triton route. A partial tile costs the Hopper
# consumers 32 two-byte shared loads and a select per thread and block; the Triton route
# amortizes its test over a packed GQA group. H200, bf16 D128 causal, forward, Triton route
# over Hopper route (one process): sliding windows, share 0.06 (L16384 W4096 H32/8) 1.37-1.43x,
# ~0.11 (L8192 W2048) 1.23x, ~0.2 (D64 L8192 W1024 H16) 1.02x; top-W masks (every tile
# partial) 0.76-1.09x, a random 10% (1, Hq) mask at D64 0.55x.
HOPPER_FORWARD_MASK_PARTIAL_SHARE = 0.15
HOPPER_FORWARD_MIN_KEY_BLOCKS = 4
# KeyIntervals whose rows keep at most W keys each (``KeyIntervals._row_kept``: top-W selections,
# bool masks read as runs) take the Hopper forward, shares uncounted, where a tile walks at least
# this many key blocks by the estimate min(the unmasked walk, W / 128 + 1): with a key order the
# kept keys are block-dense. H200, bf16, causal, kv_row bias, intervals.yaml forward, one process
# per shard, Hopper over Triton route: D80-D128 W1024 at L2048-32k (estimate 8.5-9) 0.73-0.97x;
# W256 at L2048 (estimate 3; counted 4.0 with the order, 2.8 sliding) 1.12-1.86x; L1024 W1024
# (4.5) 1.20-2.77x. D64 and D32 lost at W <= 1024 (1.08-1.37x; the bias rule keeps them off).
HOPPER_FORWARD_INTERVALS_MIN_KEY_BLOCKS = 6
# A causal Hopper forward deals its tiles longest first, heads inner, back and forth over the
# programs (``hopper_device.tiles.ORDER_BALANCED``) where K and V take at most this many bytes
# (B x Hk x Lk x D x 2 x element size), else a head's tiles consecutively (ORDER_HEADS: K and V
# shared in L2 by the programs in flight). Of few tiles per program, ORDER_HEADS's longest
# program walks up to twice the mean. H200, D128 bf16 GQA 4:1, CUDA-graph GPU time, balanced
# over heads (one process): K+V 2-34 MB 0.56-0.91x (B1 H8/2 L8192 0.373 -> 0.211 ms, 653
# TFLOP/s; B8 H16/4 L2048 0.82x), 67 MB 0.96, 0.96, 1.01x, 134-268 MB 1.01-1.02x. KeyIntervals
# (causal or not) take the same rule: key-ordered top-W intervals (non-causal once causality is
# folded in) B2 H16/4 L4096 W1024 0.82x, L8192 0.96x (0.99x without a bias), B1 L16384 W2048
# 0.91x, B1 H32/8 L32768 (K+V 134 MB, over the bound) 1.07x; bool masks not causal (block-sparse,
# random, a mask row) 0.99-1.01x, so they keep ORDER_HEADS (H200, one process, forced Hopper).
HOPPER_FORWARD_BALANCED_MAX_KV_BYTES = 96 << 20


# -- decode's gather route (``gather_decode``)
# Query rows it takes at most (decode; speculative or chunked decode).
GATHER_MAX_ROWS = 16
# It takes KeyIntervals by default where their lists are bounded to at most this share of the
# keys (``KeyIntervals.max_kept``, or the keys ``prepare_mask`` counted): below it the kept rows it
# reads cost less than the key blocks the tile walk reads. At 1/16 and 1/32 it ran 3.5-4.5x
# the tile walk (H200, B8 H32/8 Lq1 D128, before the list pass was spread over chunks).
GATHER_MAX_KEPT_SHARE = 1 / 8
# A decode-sized bool mask takes the route whatever it keeps. Read by the call, no count of its
# kept keys exists on the host, and the tile walk reads the whole mask and every key block any
# row keeps: H200, B8 H32/8 Lq1 Lk32768 W2048 bool with a kv_row bias, the tile walk took 0.38
# ms per call (a prepared mask's gather step 0.040, dense SDPA with the mask 0.28); a gather
# step whose list pass ran in the call took about 0.06 ms (change 64, eager). Prepared, it
# takes the same route, so that preparing never changes a call's bits (the prepared count
# sizes the lists). Not yet measured: masks keeping more than 1/8 of the keys, which the tile
# walk took before (decode.yaml's triton-per-call rows, and a prepared dense mask).
GATHER_TAKES_BOOL_MASKS = True
GATHER = Tile(0, 64, 4, 2)  # block_m follows the pack and the rows
GATHER_INTERPRETED = Tile(0, 16, 4, 1)
# Shares per list (``gather_decode.gather_splits``). CUDA-graph replays of B8 H32/8 Lq1 D128
# intervals steps, us at Lk8192 W512 / 32768 W2048 / 32768 W4096 / 131072 W4096 (H200):
# 2 per SM, 4 blocks 36.3 / 67.1 / 89.4 / 128.2; 4 per SM, 2 blocks 31.8 / 62.3 / 80.8 / 120.5;
# 8 per SM 32-36 / 62-69 / 88 / 128; 32-key blocks or 3 stages no better; 16 per SM, 1 block
# 31.5 / 80.6 / 100.2 / 143.5. The shares round down to whole waves: at 4 per SM (117
# registers) 132 SMs hold 528 programs, and 64 lists x 9 shares (rounded up) left a second
# wave of 48; 8 shares took the all-kept B8 H32/8 Lk32768 bool step from 0.409 to 0.276 ms
# (CUDA graphs, one process), the W2048 steps 0.032 -> 0.031 ms.
GATHER_MIN_BLOCKS_PER_SPLIT = 2
GATHER_PROGRAMS_PER_SM = 4
# Keys per program of the list pass. One program per list row walking 32k keys in 1024-key
# steps took 54 us (intervals) and 39 us (bool) of a 92 us decode step (H200, B8 H32/8
# Lq1 Lk32768 W2048): a (row, chunk) grid spreads it over the GPU.
GATHER_LIST_CHUNK = 1024
GATHER_LIST_WARPS = 4
# Whether the gather route builds its lists in one launch (``gather_kernels._kept_list_kernel``:
# each (row, chunk) program adds the counts the chunks before it publish) rather than two (the
# chunks' counts, then their keys): the same lists. The two launches cost ~9 us of GPU and ~27
# us of eager host time a decode step (H200, B8 H32/8 Lk32768 W2048 bool read by the call:
# eager 0.122 ms against 0.086 prepared, as CUDA graphs 0.049 against 0.040). Off: its lists
# equal the two passes' on the H200 (64-key chunks, and B8 H32/8 Lk131072 at once), but as
# CUDA graphs it saves nothing (85291d7, per-call step us at Lk8192 / 32768 W2048 / 32768
# W4096 / 131072 W4096: one pass 26.9 / 51.7 / 70.0 / 90.9, two 25.0 / 49.0 / 67.3 / 86.9);
# 4096 or 8192 keys per program with 8 warps changed neither by more than 2 us except 8192 at
# Lk131072 (+8 us). The per-call step at Lk131072 stays 26 us over the prepared one whatever
# the lists' form: not yet profiled.
GATHER_ONE_LIST_PASS = False
