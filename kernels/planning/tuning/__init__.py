"""Every tuned constant of the schedule, each beside the measurement that chose it, in one
module per route, every name re-exported here: the planners read ``tuning.NAME`` at call time,
so a test or an A/B sets a constant here (a module that imported a name, as ``warmup`` does,
keeps the value it imported).

All timings are GPU time on one H100 (bf16 unless named, L2 flushed) unless a note names the
H200; ``kernels.schedule`` is the only reader. Tiles are (query rows, key cols) with the warps
and pipeline stages of their launch. Under Triton's interpreter every kernel gets small unequal
tiles instead, so that tiny CPU test shapes still span several tiles, partial tiles and the
causal edge.
"""

from __future__ import annotations

from .gather_route import *  # noqa: F401,F403
from .hopper_backward_route import *  # noqa: F401,F403
from .hopper_forward_route import *  # noqa: F401,F403
from .triton_route import *  # noqa: F401,F403
