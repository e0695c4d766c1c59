"""The Triton device code: every ``@triton.jit`` kernel and helper, and the NamedTuples of their
arguments (``operands``). Imports nothing of ``kernels`` outside this folder; a second device
family (Gluon, for Hopper) stands beside it as a sibling folder."""
