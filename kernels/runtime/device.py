"""The GPU a call runs on, as planning asks about it per call: its multiprocessor count and
compute capability, looked up once per device, and the interpreter's stand-ins for them."""

from __future__ import annotations

import torch

# The interpreter pretends to have this many multiprocessors, so that small CPU test shapes
# (decode rows over a few hundred keys) take the split paths too.
INTERPRETED_MULTIPROCESSORS = 16


def _properties(device: torch.device):
    """The GPU's properties, looked up once per device (a lookup costs microseconds, and
    planning asks per call)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _device_properties:
        _device_properties[index] = torch.cuda.get_device_properties(index)
    return _device_properties[index]


_device_properties: dict = {}


def multiprocessors(device: torch.device, interpreted: bool) -> int:
    """Multiprocessor count, which sizes grids and key splits (see ``tuning`` for the
    interpreter's)."""
    if interpreted:
        return INTERPRETED_MULTIPROCESSORS
    return _properties(device).multi_processor_count


def capability(device: torch.device, interpreted: bool) -> tuple[int, int] | None:
    """The GPU's compute capability, (9, 0) on Hopper; None under the interpreter."""
    if interpreted or device.type != "cuda":
        return None
    properties = _properties(device)
    return (properties.major, properties.minor)
