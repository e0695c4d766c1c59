"""What runs for one attention problem, decided in one place.

``kernels.planning.problem.Problem`` describes a call: sizes, dtype, device, the mask's and bias's
layouts, causality, scale, what the backward must produce and the mask's counted activity.
``schedule(problem, options)`` is a pure function of it. Its ``Schedule`` names every
decision: the forward's tile, GQA packing and key splits; the backward's route (one fused
launch, dq then dkdv, or the packed decode launch), each launch's tile and stages, dq's key
splits, dkdv's head shares, and the bias gradient's mode. The launchers
(``forward.ForwardPlan``, ``backward.BackwardPlan``, ``backward_packed.PackedBackwardPlan``) only
carry a Schedule out. ``str(schedule)`` prints it.

The forward's decisions are made in ``forward_schedule``, the backward's in
``backward_schedule``; this module joins them, and names the tiles one activity map serves.
``options`` (``kernel_options`` of ``dmattn_func``) forces a decision; see ``OPTION_NAMES``.
The tuned constants are in ``kernels.planning.tuning``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from . import tuning
from .backward_schedule import (BackwardRoute, BackwardSchedule, PackedBackward, backward_tiles,
                                schedule_backward, wide_tile_possible)
from .forward_schedule import (FORWARD_ROUTES, ForwardSchedule, forward_list_tiles,
                               schedule_forward)
from .hopper_backward import backward_list_tile
from .problem import Problem


def activity_tiles(problem: Problem, forward: ForwardSchedule) -> tuple[tuple[int, int], ...]:
    """Every (query rows, key cols) tile whose active-tile lists the forward and the general
    backward walk: one activity map of the mask must serve them all, dkdv's tile either way
    ``kernel_options['dkdv_wide_tile']`` may force it and the forward's either way a bias
    picks it (a prepared mask's map is built before any call's options and bias are known)."""
    choices = [{}]
    if wide_tile_possible(problem):
        choices += [{"dkdv_wide_tile": False}, {"dkdv_wide_tile": True}]
    tiles = list(forward_list_tiles(problem, forward))
    for options in choices:
        dkdv, dq = backward_tiles(problem, options)
        tiles += [(dkdv.block_m, dkdv.block_n), (dq.block_m, dq.block_n)]
    hopper_tile = backward_list_tile(problem)
    if hopper_tile is not None:
        tiles.append(hopper_tile)
    return tuple(dict.fromkeys(tiles))


def backward_items(backward: BackwardSchedule) -> list[tuple[str, object]]:
    """(name, value) of what ``Schedule.__str__`` prints of the backward: the packed launch's
    tile, key splits and skipping, or the general route, bias-gradient mode and launches."""
    launches = backward.launches
    if isinstance(launches, tuning.HopperBackwardTile):
        split = [("split_heads", True)] if backward.split_heads else []
        return [("route", backward.route), ("tile", launches), *split]
    if isinstance(launches, PackedBackward):
        return [("packed", launches.tile), ("packed_key_splits", launches.key_splits),
                ("packed_skips_dead_blocks", launches.skips_dead_blocks)]
    return [("route", backward.route), ("dbias", backward.dbias_mode),
            *((f.name, getattr(launches, f.name)) for f in fields(launches))]


@dataclass(frozen=True)
class Schedule:
    problem: Problem
    forward: ForwardSchedule
    backward: BackwardSchedule

    def __str__(self) -> str:
        s = self.problem.shape
        lines = [f"problem: B{s.batch} Lq{s.seqlen_q} Lk{s.seqlen_k} H{s.heads_q}/{s.heads_kv} "
                 f"D{s.head_dim} {str(self.problem.dtype).replace('torch.', '')}"
                 f"{' causal' if self.problem.is_causal else ''}"
                 f"{' mask' + str(self.problem.mask.shape) if self.problem.mask else ''}"
                 f"{' bias' + str(self.problem.bias.shape) if self.problem.bias else ''}"]
        forward = [("route", self.forward.route)]
        forward += [(f.name, getattr(self.forward, f.name)) for f in fields(self.forward)
                    if f.name not in ("hopper", "gather", "tile_order", "documents")
                    or getattr(self.forward, f.name)]
        for part, items in (("forward", forward), ("backward", backward_items(self.backward))):
            lines.append(f"{part}: " + ", ".join(f"{name}={value}" for name, value in items))
        return "\n".join(lines)


# kernel_options: name -> what it forces.
OPTION_NAMES = {
    "forward_route": "the forward's route: 'triton', 'hopper' (Gluon, sm_90a) or 'gather' "
                     "(decode over the kept keys alone)",
    "backward": "the backward route: 'fused', 'dq+dkdv', 'packed' or 'hopper' (Gluon, sm_90a)",
    "forward_tile_order": "how the Hopper forward deals its work tiles to its programs: "
                          "'heads' (a head's tiles consecutive) or 'balanced' (causal tiles "
                          "longest first, heads inner, dealt back and forth)",
    "forward_consumers": "the Hopper forward's consumer warpgroups: 2, or 3 (64-row "
                         "warpgroups over 128-key blocks; head dims up to 64, a mask of one "
                         "key row at most, no packed documents; by default without a mask "
                         "or bias at lengths from 8192)",
    "forward_key_splits": "the forward's key splits (split-K), an int >= 1",
    "dq_key_splits": "dq's key splits, an int >= 1",
    "dkdv_head_shares": "dkdv's shares of a GQA group's heads, an int dividing the group",
    "forward_key_scan": "whether the forward reads unprepared intervals itself, True or False",
    "forward_documents": "whether the Hopper forward walks a packed batch's documents (varlen) "
                         "each in its own tiles, True or False",
    "backward_documents": "whether the Hopper backward walks a packed batch's documents "
                          "(varlen) each in its own key blocks, True or False",
    "dkdv_wide_tile": "whether dkdv takes its 64 x 128 tile (16-bit, 64 < head dim <= 128), "
                      "True or False",
    "backward_dq_spread": "whether the Hopper backward stages dQ with its columns spread over "
                          "the shared memory banks (head dim 128), True or False",
    "backward_split_heads": "whether the Hopper backward gives each query head of a GQA group "
                            "its own programs, True or False",
}


def normalize_options(options) -> dict:
    """``kernel_options`` checked, with the route as a BackwardRoute: a ValueError or TypeError
    names the option and what it takes."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TypeError(f"kernel_options must be a dict or None, got {type(options).__name__}")
    out = {}
    for name, value in options.items():
        if name not in OPTION_NAMES:
            raise ValueError(f"kernel_options: unknown option {name!r}; known: "
                             + ", ".join(sorted(OPTION_NAMES)))
        if name == "forward_route":
            if value not in FORWARD_ROUTES:
                raise ValueError(f"kernel_options['forward_route']: expected 'triton', "
                                 f"'hopper' or 'gather', got {value!r}")
        elif name == "forward_tile_order":
            if value not in ("heads", "balanced"):
                raise ValueError(f"kernel_options['forward_tile_order']: expected 'heads' or "
                                 f"'balanced', got {value!r}")
        elif name == "forward_consumers":
            if value not in (2, 3) or type(value) is not int:
                raise ValueError(f"kernel_options['forward_consumers']: expected 2 or 3, got "
                                 f"{value!r}")
        elif name == "backward":
            try:
                value = BackwardRoute(value)
            except ValueError:
                raise ValueError(f"kernel_options['backward']: expected one of 'fused', "
                                 f"'dq+dkdv', 'packed', 'hopper', got {value!r}") from None
        elif name in ("forward_key_scan", "dkdv_wide_tile", "forward_documents",
                      "backward_documents", "backward_dq_spread", "backward_split_heads"):
            if type(value) is not bool:
                raise ValueError(f"kernel_options[{name!r}]: expected {OPTION_NAMES[name]}, "
                                 f"got {value!r}")
        elif type(value) is not int or value < 1:
            raise ValueError(f"kernel_options[{name!r}]: expected {OPTION_NAMES[name]}, "
                             f"got {value!r}")
        out[name] = value
    return out


def schedule(problem: Problem, options: dict | None = None) -> Schedule:
    """The schedule of ``problem``; ``options`` (already normalized) force decisions."""
    options = options or {}
    return Schedule(problem, schedule_forward(problem, options),
                    schedule_backward(problem, options))
