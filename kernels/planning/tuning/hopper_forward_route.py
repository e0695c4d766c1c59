"""The Hopper forward's tile and the rules of which calls take it."""

from __future__ import annotations

from dataclasses import dataclass


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
# Below that head dim, a bias row beside KeyIntervals that keep at most W keys a row takes the
# Hopper forward too at head dims of at least HOPPER_FORWARD_BIAS_LONG_MIN_HEAD_DIM where the
# call's tiles x estimated key blocks a tile (``kept_key_blocks``) reach
# HOPPER_FORWARD_BIAS_LONG_MIN_VISITS. H200, bf16, D64, top-W causal kv_row, forward as CUDA
# graphs, forced Hopper over the default Triton route in one process (bool read as runs and
# KeyIntervals alike; ``results/nvidia-h200/forced-routes/d64k``): B1 H2/1 L16384 W4096 (8448
# visits) 0.82x the time, L32768 W4096 (16896) 0.84x, B2 H16/4 L8192 W1024 (18432) 0.83x; below
# the bound B1 H2/1 L32768 W1024 (4608) 0.95x, B1 H16/4 L4096 W1024 (4608) 0.93x bool and 1.07x
# intervals, L16384 W1024 (2304) 1.10x, W256 0.97-1.03x. At D32 the Triton route led at 18432
# visits (B1 H16/4 L16384 W1024, 85291d7). Only where a row keeps at most this share of the
# keys (W / Lk): the measured rows kept 1/8-1/4; a bias row over a dense causal walk at D64
# took 0.72x the Triton route's speed (B1 H16/4 L4096), so W = L stays off.
HOPPER_FORWARD_BIAS_LONG_MIN_HEAD_DIM = 64
HOPPER_FORWARD_BIAS_LONG_MIN_VISITS = 8192
HOPPER_FORWARD_BIAS_LONG_MAX_KEPT_SHARE = 0.25
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
