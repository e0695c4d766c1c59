"""The Hopper backward's tile, its grid order and the rules of which calls take it, and
how a captured backward splits."""

from __future__ import annotations

from dataclasses import dataclass


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
