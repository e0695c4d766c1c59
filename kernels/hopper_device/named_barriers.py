"""Hardware named barriers (PTX ``bar.sync`` / ``bar.arrive``) between the partitions of a
warp-specialized program, for rendezvous that need no shared memory: unlike an mbarrier's
elected arrive, which Triton precedes with a barrier of the arriving warpgroup, ``bar.arrive``
is one instruction per warp.

A named barrier with a thread count completes once that many threads have reached it; a
``bar.sync`` waits for that, a ``bar.arrive`` counts its threads and goes on. Triton numbers its
own from 0: the program-wide barrier and one per partition (with three partitions it uses 0-2,
offline sm_90a with Triton 3.6 and 3.9; with four, the forward of three consumer warpgroups,
0-3 under 3.9; ``tests/test_hopper_offline.py`` checks the compiled forms), so the ones here
start at ``FIRST_FREE``. Sixteen exist per program."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

FIRST_FREE = gl.constexpr(4)


@gluon.constexpr_function
def _instruction(op, barrier, threads):
    # An inline assembly block returns a value; the register it sets is never read.
    return f"bar.{op} {barrier}, {threads};\n\tmov.u32 $0, 0;"


@gluon.jit
def sync(BARRIER: gl.constexpr, THREADS: gl.constexpr):
    """Wait until THREADS threads (these included) have reached named barrier BARRIER."""
    gl.inline_asm_elementwise(_instruction("sync", BARRIER, THREADS), "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def arrive(BARRIER: gl.constexpr, THREADS: gl.constexpr):
    """Count this partition's threads at named barrier BARRIER (of THREADS) and go on."""
    gl.inline_asm_elementwise(_instruction("arrive", BARRIER, THREADS), "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)
