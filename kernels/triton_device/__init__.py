"""The Triton device code: every ``@triton.jit`` kernel and helper. The NamedTuples of their
arguments are built on the host (``planning.operands``). Imports nothing of ``kernels`` outside
this folder; a second device family (Gluon, for Hopper) stands beside it as a sibling folder."""
