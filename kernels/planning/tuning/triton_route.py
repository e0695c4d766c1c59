"""The Triton route's tiles and grids: forward, backward (dq, dkdv, the packed decode
backward), the forward's key scan, and how grids split keys and rows."""

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
