"""The Hopper forward compiled for sm_90a on this machine, with no GPU: Triton compiles a Gluon
kernel for a named target without a device (a stand-in driver answers the target), so the
installed Triton's compiler checks the Gluon code, its role pieces (``ring``, ``tiles``,
``softmax``) and their aggregates, and the shared memory of the shipped tiles, on every
machine. Gluon has no interpreter; what runs on the device is tested on a Hopper GPU
(``tests/test_hopper_route.py``)."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from kernels.hopper_device import named_barriers
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


def _describer(dtype, head_dim: int):
    """A maker of descriptors over a (2, 256, 4, head_dim) tensor with boxes of ``rows`` rows."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
    t = torch.empty(2, 256, 4, head_dim, dtype=dtype)

    def describe(rows):
        box = [1, rows, 1, head_dim]
        return TensorDescriptor(t, list(t.shape), list(t.stride()), box,
                                gl.NVMMASharedLayout.get_default_for(box, element))
    return describe


def _compile(dtype, head_dim: int, causal: bool, kind: int = 0, bias: bool = False,
             documents: bool = False, tile: tuning.HopperTile = tuning.HOPPER_FORWARD,
             bias_tile: bool = False):
    """The forward of MASK_KIND ``kind`` (``hopper_forward``'s constants), with a bias row
    where ``bias`` (a full bias's tiles where ``bias_tile`` too), over packed documents where
    ``documents``, of ``tile``."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime import driver

    from kernels.hopper_device.attention_forward import attention_forward
    from kernels.planning import hopper_forward as host

    describe = _describer(dtype, head_dim)
    q, kv = describe(tile.rows), describe(tile.block_n)
    lse = torch.empty(8, dtype=torch.float32)
    # (mask descriptor, list table, list strides, list and mask head divisors, mask batches)
    mask_args = (kv, lse, 0, 0, 0, 1, 1, 0)
    if kind != host.NO_MASK:
        rows, block_n = host.list_tile(tile)
        if kind == host.INTERVAL_WORDS:
            mask, box = torch.empty(1, 2, 512, dtype=torch.int32), [1, 1, 2 * block_n]
        else:
            rows = rows if kind == host.MASK_TILE else 1
            mask, box = torch.empty(1, 2, rows, 256, dtype=torch.uint8), [1, 1, rows, block_n]
        layout = (gl.NVMMASharedLayout.get_default_for(box, gl.uint8) if kind == host.MASK_TILE
                  else gl.NVMMASharedLayout(swizzle_byte_width=0,
                                            element_bitwidth=8 * mask.element_size(),
                                            rank=len(box)))
        mask_desc = TensorDescriptor(mask, list(mask.shape), list(mask.stride()), box, layout)
        mask_args = (mask_desc, torch.empty(8, dtype=torch.int32), 0, 40, 10, 2, 2, 0)
    # (the bias rows' descriptor, query heads per bias head, 1 if its batch is read)
    bias_args = (kv, 1, 0)
    if bias and bias_tile:
        full = torch.empty(2, 2, 1024, 1024, dtype=dtype)
        box = [1, 1, tile.rows, tile.block_n]
        bias_args = (TensorDescriptor(full, list(full.shape), list(full.stride()), box,
                                      gl.NVMMASharedLayout.get_default_for(
                                          box, {torch.bfloat16: gl.bfloat16,
                                                torch.float16: gl.float16}[dtype])), 2, 1)
    elif bias:
        rows = torch.empty(2, 2, 1, 1024, dtype=dtype)
        box = [1, 1, 1, tile.block_n]
        bias_args = (TensorDescriptor(rows, list(rows.shape), list(rows.stride()), box,
                                      gl.NVMMASharedLayout(swizzle_byte_width=0,
                                                           element_bitwidth=16, rank=4)), 2, 1)
    # (the tile table, cu_q, cu_k, the output, its row stride, the head dim)
    document_args = (lse, lse, lse, lse, 0, 0)
    if documents:
        offsets = torch.empty(5, dtype=torch.int32)
        document_args = (torch.empty(64, dtype=torch.int32), offsets, offsets,
                         torch.empty(8, dtype=dtype), 4 * head_dim, head_dim)
    saved = driver._active
    driver.set_active(_Sm90())
    try:
        return attention_forward.warmup(
            q, kv, kv, q, lse, *mask_args, *bias_args, *document_args, 1000, 1000, 4, 2, 0.1,
            3, 8, 24, 1, grid=(132,), num_warps=4, CAUSAL=causal, MASK_KIND=kind,
            HAS_BIAS=bias, DOCUMENTS=documents, STAGES=tile.stages, CONSUMERS=tile.consumers,
            OVERLAP=tile.overlap, CONSUMER_REGS=tile.consumer_regs,
            LOADER_REGS=tile.loader_regs, BIAS_TILE=bias_tile)
    finally:
        driver._active = saved


def _compile_backward(dtype, head_dim: int, causal: bool, kind: int = 0,
                      deterministic: bool = False, bias: bool = False, grouped: bool = False,
                      documents: bool = False, spread: bool = False, split: bool = False):
    """The backward of MASK_KIND ``kind`` (none, a bool mask's bytes or KeyIntervals' words,
    with lists), its dQ ordered where ``deterministic``, with a bias row and its gradient
    summed over the group where ``bias``, its causal grid ordered in groups where
    ``grouped``, over packed documents where ``documents``, its dQ staged spread where
    ``spread``, a program per query head (dK and dV reduce-added) where ``split``."""
    from kernels.planning import hopper_forward as host
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime import driver

    from kernels.hopper_device.attention_backward import attention_backward
    tile = tuning.HOPPER_BACKWARD

    describe = _describer(dtype, head_dim)
    rows = torch.empty(2 * 2 * 8, 1024, dtype=torch.float32)
    flat = TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [1, tile.block_m],
                            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32,
                                                 rank=2))
    acc = torch.empty(2, 8, 1000, head_dim, dtype=torch.float32)
    acc_box = [1, 1, tile.block_m, head_dim // 4]
    acc_desc = TensorDescriptor(acc, list(acc.shape), list(acc.stride()), acc_box,
                                gl.NVMMASharedLayout.get_default_for(acc_box, gl.float32))
    table = torch.empty(2, 1, 8, 2 + 16, dtype=torch.int32)  # (Bm, Hm, key blocks, ...)
    if kind == host.MASK_TILE:
        mask = torch.empty(2, 1, 1024, 1024, dtype=torch.uint8)
        mask_box = [1, 1, tile.block_m, tile.block_n]
        mask_desc = TensorDescriptor(mask, list(mask.shape), list(mask.stride()), mask_box,
                                     gl.NVMMASharedLayout.get_default_for(mask_box, gl.uint8))
        list_args = (table, *table.stride()[:3], 8, 8, 1, 0, 0)
    elif kind == host.INTERVAL_WORDS:
        mask_desc = torch.empty(2, 1, 1, 1024, dtype=torch.int64)
        list_args = (table, *table.stride()[:3], 8, 8, 1, 1024, 1024)
    else:  # stand-ins the kernel never reads
        mask_desc, list_args = flat, (rows, 0, 0, 0, 1, 1, 0, 0, 0)
    dkv_descs = ((acc_desc, acc_desc) if split
                 else (describe(tile.block_n // 2), describe(tile.block_n // 2)))
    bias_row = torch.empty(2, 4, 1, 1000, dtype=dtype)
    bias_grad = torch.empty(2, 2, 1, 1000, dtype=torch.float32)
    saved = driver._active
    driver.set_active(_Sm90())
    try:
        return attention_backward.warmup(
            describe(tile.block_m), describe(tile.block_n), describe(tile.block_n),
            describe(tile.block_m), acc_desc, *dkv_descs, flat, mask_desc, *list_args,
            bias_row, 4 * 1000, 1000, 1, 2, bias_grad, 2 * 1000, 1000,
            torch.empty(64, dtype=torch.int32), torch.empty(64, dtype=torch.int32),
            torch.empty(9, dtype=torch.int32), torch.empty(9, dtype=torch.int32),
            torch.empty(1, 1000, 4, head_dim, dtype=dtype),
            torch.empty(1, 1000, 4, head_dim, dtype=dtype), 4 * head_dim, head_dim,
            1000, 1000, 8, 4, 2, 3, 0.1, 0.07, grid=(64,),
            num_warps=4, CAUSAL=causal, GROUPED_ORDER=grouped, DOCUMENTS=documents,
            MASK_KIND=kind,
            DETERMINISTIC=deterministic,
            HAS_BIAS=bias, BIAS_GRAD=bias, BIAS_GROUP_SUM=not split, DQ_SPREAD=spread,
            SPLIT_HEADS=split,
            STAGES=tile.stages,
            CONSUMER_REGS=tile.consumer_regs, LOADER_REGS=tile.loader_regs)
    finally:
        driver._active = saved


def _spill_bytes(ptx: str) -> int:
    """The bytes of spill stores and loads that Triton's own ptxas reports (``-v``) for this
    PTX on sm_90a."""
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        ptxas = get_ptxas(90)  # Triton 3.9 picks its ptxas by architecture
    except TypeError:
        ptxas = get_ptxas()
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder, "kernel.ptx")
        source.write_text(ptx)
        done = subprocess.run([ptxas.path, "-v", "--gpu-name=sm_90a", str(source), "-o",
                               str(Path(folder, "kernel.cubin"))], capture_output=True,
                              text=True, check=True)
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", done.stderr))


def _compile_apart(dtype: str, head_dim: int, causal: bool, masked) -> dict:
    """``_compile`` in a fresh process without TRITON_INTERPRET: under the interpreter the
    ``triton.jit`` functions of ``triton.language`` that Gluon code calls (``gl.max``) are
    interpreter objects its compiler cannot call."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, __file__, dtype, str(head_dim), str(int(causal)),
                           str(masked)], env=env, cwd=root, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# Spilled bytes (ptxas -v, sm_90a) of the forms that run near their register budget, as
# Triton 3.9 compiles them; under 3.6 (the GPU's) the three-warpgroup forms spill none and
# the full bias at head dim 128 36 B (64 B with KeyIntervals). Three warpgroups get 160
# registers a consumer thread (3 x 128 x 160 + 128 x 24 of 64K); a full bias's [64, 128] tile
# adds 32 registers of bias to the score, P and O registers of two.
SPILL_BOUNDS = {"biased-three-forward": 8, "three-row-forward": 40,
                "full-biased-three-forward": 96, "full-biased-forward": 48,
                "full-biased-intervals-forward": 64}


@pytest.mark.parametrize("dtype, head_dim, causal, masked", [
    ("bfloat16", 128, True, 0), ("float16", 64, False, 0), ("bfloat16", 128, True, 1),
    ("bfloat16", 128, False, 2), ("bfloat16", 128, True, 3),
    ("bfloat16", 128, True, "backward"), ("float16", 64, False, "backward"),
    ("bfloat16", 128, True, "masked-backward"), ("float16", 64, False, "masked-backward"),
    ("bfloat16", 128, True, "intervals-backward"),
    ("bfloat16", 128, True, "deterministic-backward"),
    ("bfloat16", 128, True, "biased-backward"), ("bfloat16", 128, True, "grouped-backward"),
    ("bfloat16", 128, True, "biased-forward"),
    ("float16", 64, False, "biased-masked-forward"),
    ("bfloat16", 128, True, "documents-forward"),
    ("float16", 64, False, "biased-documents-forward"),
    ("bfloat16", 128, True, "documents-backward"),
    ("float16", 64, False, "biased-documents-backward"),
    ("bfloat16", 128, False, "spread-backward"),
    ("bfloat16", 128, False, "biased-split-grouped-intervals-backward"),
    ("bfloat16", 64, True, "three-forward"), ("float16", 64, False, "biased-three-forward"),
    ("bfloat16", 64, True, "overlapped-three-forward"),
    ("bfloat16", 64, False, "biased-three-intervals-forward"),
    ("float16", 64, True, "three-row-forward"),
    ("bfloat16", 128, True, "full-biased-forward"),
    ("bfloat16", 128, False, "full-biased-intervals-forward"),
    ("float16", 64, True, "full-biased-masked-forward"),
    ("bfloat16", 64, False, "full-biased-three-forward")],
    ids=["bf16-d128-causal", "fp16-d64-full", "bf16-d128-causal-bool-mask",
         "bf16-d128-full-mask-row", "bf16-d128-causal-interval-words",
         "backward-bf16-d128-causal", "backward-fp16-d64-full",
         "masked-backward-bf16-d128-causal", "masked-backward-fp16-d64-full",
         "intervals-backward-bf16-d128-causal", "deterministic-backward-bf16-d128-causal",
         "biased-backward-bf16-d128-causal", "grouped-backward-bf16-d128-causal",
         "biased-forward-bf16-d128-causal",
         "biased-masked-forward-fp16-d64-full", "documents-forward-bf16-d128-causal",
         "biased-documents-forward-fp16-d64-full", "documents-backward-bf16-d128-causal",
         "biased-documents-backward-fp16-d64-full", "spread-backward-bf16-d128-full",
         "biased-split-grouped-intervals-backward-bf16-d128-full",
         "three-forward-bf16-d64-causal", "biased-three-forward-fp16-d64-full",
         "overlapped-three-forward-bf16-d64-causal",
         "biased-three-intervals-forward-bf16-d64-full", "three-row-forward-fp16-d64-causal",
         "full-biased-forward-bf16-d128-causal", "full-biased-intervals-forward-bf16-d128-full",
         "full-biased-masked-forward-fp16-d64-causal", "full-biased-three-forward-bf16-d64-full"])
def test_the_hopper_kernels_compile_for_sm90(dtype, head_dim, causal, masked):
    compiled = _compile_apart(dtype, head_dim, causal, masked)
    assert compiled["target"]
    assert compiled["wgmma"] and compiled["tma"]
    assert compiled["shared"] <= SM90_SHARED_BYTES
    # Triton's own named barriers (the program's and each partition's) stay below the first
    # one ours take (``hopper_device.named_barriers``): the forward's two turn barriers, each
    # of both consumer warpgroups.
    first_free = named_barriers.FIRST_FREE.value
    assert compiled["barriers"]
    ours = {(op, number, threads) for op, number, threads in compiled["barriers"]
            if number >= first_free}
    assert all(threads == 256 for _, _, threads in ours), ours
    if "backward" not in str(masked):  # a turn barrier per consumer warpgroup
        consumers = (0, 1, 2) if "three" in str(masked) else (0, 1)
        assert {(op, number) for op, number, _ in ours} == {
            (op, first_free + w) for op in ("sync", "arrive") for w in consumers}
    if compiled["spills"] is not None:  # three warpgroups, a full bias: spills bounded
        assert compiled["spills"] <= SPILL_BOUNDS.get(str(masked), 0), compiled["spills"]
    # dQ's staging stores (``hopper_device.dq_columns``): a 64-bit store of a warp takes 2
    # wavefronts at best; the 128-byte swizzle alone leaves a two-way conflict (ncu on the
    # H200: 4 per STS.64), which the spread columns remove.
    if masked == "backward" and head_dim == 128:
        assert compiled["staging_wavefronts"] == 4.0
    if masked == "spread-backward":
        assert compiled["staging_wavefronts"] == 2.0


if __name__ == "__main__":  # one form, compiled by ``_compile_apart``'s child process
    name, dim, is_causal, form = sys.argv[1:5]
    if form.endswith("backward"):
        from kernels.planning import hopper_forward as host
        kind = (host.MASK_TILE if form == "masked-backward" else
                host.INTERVAL_WORDS if "intervals" in form else host.NO_MASK)
        kernel = _compile_backward(getattr(torch, name), int(dim), bool(int(is_causal)), kind,
                                   deterministic=form == "deterministic-backward",
                                   bias=form.startswith("biased"),
                                   grouped="grouped" in form,
                                   documents="documents" in form,
                                   spread=form == "spread-backward", split="split" in form)
    elif form.endswith("forward"):
        from kernels.planning import hopper_forward as host
        kind = (host.MASK_TILE if form.endswith("biased-masked-forward") else
                host.INTERVAL_WORDS if "intervals" in form else
                host.MASK_ROW if "-row-" in form else host.NO_MASK)
        tile = tuning.HOPPER_FORWARD
        if "three" in form:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from hopper_helpers import OVERLAPPED_THREE
            tile = (OVERLAPPED_THREE if form.startswith("overlapped")
                    else tuning.HOPPER_FORWARD_THREE)
        kernel = _compile(getattr(torch, name), int(dim), bool(int(is_causal)), kind,
                          bias="biased" in form, documents="documents" in form,
                          tile=tile, bias_tile=form.startswith("full-biased"))
    else:
        kernel = _compile(getattr(torch, name), int(dim), bool(int(is_causal)), int(form))
    ptx = kernel.asm["ptx"]
    barriers = [(op, int(number), int(threads or 0)) for op, number, threads in re.findall(
        r"\bbar(?:rier)?\.(sync|arrive)\s+(\d+)(?:,\s*(\d+))?;", ptx)]
    staging = None
    if form in ("backward", "spread-backward") and dim == "128":  # dQ's 16 staging stores
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from ptx_banks import wavefronts_per_store
        staging = wavefronts_per_store(ptx, 16)
    print(json.dumps({"target": ".target sm_90a" in ptx, "wgmma": "wgmma.mma_async" in ptx,
                      "tma": "cp.async.bulk.tensor" in ptx, "shared": kernel.metadata.shared,
                      "barriers": sorted(set(barriers)), "staging_wavefronts": staging,
                      "spills": (_spill_bytes(ptx) if "three" in form or "full" in form
                                 else None)}))
