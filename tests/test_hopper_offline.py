"""The Hopper forward compiled for sm_90a on this machine, with no GPU: Triton compiles a Gluon
kernel for a named target without a device (a stand-in driver answers the target), so the
installed Triton's compiler checks the Gluon code, its role pieces (``ring``, ``tiles``,
``softmax``) and their aggregates, and the shared memory of the shipped tiles, on every
machine. Gluon has no interpreter; what runs on the device is tested on a Hopper GPU
(``tests/test_hopper_route.py``)."""

from __future__ import annotations

import pytest
import torch

from kernels.planning import tuning

GLUON = pytest.importorskip("triton.experimental.gluon")
SM90_SHARED_BYTES = 232448  # what one block may use on an H100 or H200


class _Sm90:
    """A driver that names sm_90 as the target and launches nothing."""

    def is_active(self):
        return True

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def _compile(dtype, head_dim: int, causal: bool):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime import driver

    from kernels.hopper_device.attention_forward import attention_forward

    tile = tuning.HOPPER_FORWARD
    element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
    t = torch.empty(2, 256, 4, head_dim, dtype=dtype)

    def describe(rows):
        box = [1, rows, 1, head_dim]
        return TensorDescriptor(t, list(t.shape), list(t.stride()), box,
                                gl.NVMMASharedLayout.get_default_for(box, element))

    q, kv = describe(tile.rows), describe(tile.block_n)
    lse = torch.empty(8, dtype=torch.float32)
    saved = driver._active
    driver.set_active(_Sm90())
    try:
        return attention_forward.warmup(
            q, kv, kv, q, lse, 1000, 1000, 4, 2, 0.1, 3, 8, 24, grid=(132,), num_warps=4,
            CAUSAL=causal, STAGES=tile.stages, CONSUMER_REGS=tile.consumer_regs,
            LOADER_REGS=tile.loader_regs)
    finally:
        driver._active = saved


@pytest.mark.parametrize("dtype, head_dim, causal", [
    (torch.bfloat16, 128, True), (torch.float16, 64, False)], ids=["bf16-d128-causal",
                                                                     "fp16-d64-full"])
def test_the_hopper_forward_compiles_for_sm90(dtype, head_dim, causal):
    compiled = _compile(dtype, head_dim, causal)
    ptx = compiled.asm["ptx"]
    assert ".target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    assert compiled.metadata.shared <= SM90_SHARED_BYTES
