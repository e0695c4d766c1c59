"""From checked inputs to launches: the ``Problem`` of a call, its ``Schedule`` (every decision,
with the tuned constants), the tile activity of its mask, and the plans that carry a Schedule's
forward and backward launches out, with the kernels' arguments as NamedTuples (``operands``)."""
