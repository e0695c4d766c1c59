"""Decode's gather route: which calls take it, its tile, shares and list passes."""

from __future__ import annotations

from .triton_route import Tile


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
# Whether the second list pass reads the chunks' bits a word at a time
# (``gather_kernels._kept_word_keys_kernel``: popcounts, then one kept key per word a step)
# rather than a key at a time (``_kept_keys_kernel``: a scan over every key of a chunk), and
# the words a program of it takes (one a thread at 4 warps). The key-at-a-time pass is bound by
# its instructions: ncu, H200, B8 H32/8 Lk131072 W4096 bool, 8192 programs of 1024 keys, 18.8
# us at 1.2% of DRAM's bandwidth, 70% SM throughput, 56% of the LSU pipes, 40 registers. Off
# until measured on a GPU.
GATHER_WORD_KEYS = False
GATHER_KEYS_WORDS = 128
