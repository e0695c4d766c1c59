"""TMA operands of the Gluon kernels' launches, and the descriptors they are encoded to.

A plan fixes each descriptor operand's box and shared layout (and, for a mask or a bias, the
shape and strides it is read with): a ``TmaSpec``. A call hands ``spec(tensor)``, a
``TmaOperand``, to ``runtime.launch.DescriptorLaunch``. Where the compiled kernel's launcher
encodes descriptors in Python (triton 3.6: a ``TensorDescriptor`` built per operand and
call, then ``make_tensordesc_arg`` filling its 128-byte ``CUtensorMap``), the launch instead
keeps the encoded arguments of each (operand, address, shape, strides) it has seen
(``EncodedDescriptors``) and hands them to the launcher underneath; a descriptor depends on
nothing else, so an address seen again needs no encoding. Elsewhere (the JIT path, compile-only,
another Triton) the operands become ``TensorDescriptor``s as before.
"""

from __future__ import annotations

MAX_ENCODED = 64  # encoded descriptors kept per launch, the oldest dropped first


class TmaSpec:
    """A descriptor operand's box and shared layout, and the shape and strides it reads its
    tensor with (None: the tensor's own)."""

    __slots__ = ("box", "layout", "shape", "strides")

    def __init__(self, box: list, layout, shape: list | None = None,
                 strides: list | None = None):
        self.box, self.layout, self.shape, self.strides = list(box), layout, shape, strides

    def __call__(self, tensor) -> TmaOperand:
        return TmaOperand(tensor, self)


class TmaOperand:
    """A call's tensor with the ``TmaSpec`` it is read by."""

    __slots__ = ("tensor", "spec")

    def __init__(self, tensor, spec: TmaSpec):
        self.tensor, self.spec = tensor, spec

    def geometry(self) -> tuple[list, list]:
        spec, tensor = self.spec, self.tensor
        return (list(tensor.shape) if spec.shape is None else spec.shape,
                list(tensor.stride()) if spec.strides is None else spec.strides)

    def descriptor(self):
        """Gluon's ``TensorDescriptor`` of the operand."""
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        shape, strides = self.geometry()
        return TensorDescriptor(self.tensor, shape, strides, self.spec.box, self.spec.layout)

    def key(self, position: int) -> tuple:
        tensor = self.tensor
        return position, tensor.data_ptr(), tensor.shape, tensor.stride()


def as_descriptor(operand):
    """``operand`` as the Triton JIT path takes it: a ``TmaOperand`` as its descriptor."""
    return operand.descriptor() if operand.__class__ is TmaOperand else operand


class EncodedDescriptors:
    """The launcher underneath a compiled kernel's Python descriptor encoding (triton 3.6's
    ``wrap_handle_tensordesc``), with what it needs to encode a descriptor: ``launch(grid,
    stream, operands, tail)`` encodes each ``TmaOperand`` once per (position, address, shape,
    strides) and launches. ``of(compiled)`` is None where the launcher is not of that form
    (another Triton, scratch buffers, fp4 operands): the launch then takes the usual path."""

    __slots__ = ("raw", "metas", "function", "packed", "cooperative", "pdl", "fill", "to_host",
                 "cache")

    @classmethod
    def of(cls, compiled) -> EncodedDescriptors | None:
        try:
            from triton.backends.nvidia import driver as nvidia
            from triton.runtime import driver
        except ImportError:  # pragma: no cover - no NVIDIA backend
            return None
        run = getattr(compiled, "run", None)
        inner = getattr(run, "launch", None)
        code, closure = getattr(inner, "__code__", None), getattr(inner, "__closure__", None)
        if (code is None or closure is None
                or getattr(nvidia, "_BASE_ARGS_FORMAT", None) != "iiiKKppOOOOOO"
                or not hasattr(nvidia, "TMA_DTYPE_DEVICE_TO_HOST")
                or getattr(run, "global_scratch_size", 1)
                or getattr(run, "profile_scratch_size", 1)):
            return None
        cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in closure)))
        metas = cells.get("tensordesc_meta")
        fill = getattr(driver.active.utils, "fill_tma_descriptor", None)
        if ("launcher" not in cells or not metas or fill is None
                or any(meta is None or meta.get("fp4_padded") for meta in metas)):
            return None
        encoded = cls()
        encoded.raw, encoded.metas, encoded.fill = cells["launcher"], tuple(metas), fill
        encoded.to_host = nvidia.TMA_DTYPE_DEVICE_TO_HOST
        encoded.function, encoded.packed = compiled.function, compiled.packed_metadata
        encoded.cooperative, encoded.pdl = run.launch_cooperative_grid, run.launch_pdl
        encoded.cache = {}
        return encoded

    def encode(self, operand: TmaOperand, meta: dict) -> list:
        """The launcher's arguments of one descriptor: the filled map, then shape and
        strides (as ``make_tensordesc_arg`` gives them, zero padding)."""
        shape, strides = operand.geometry()
        tensor_map = self.fill(operand.tensor.data_ptr(), meta["swizzle"], meta["elem_size"],
                               self.to_host[meta["elem_type"]], meta["block_size"], shape,
                               strides, 0)
        return [tensor_map, *shape, *strides]

    def launch(self, grid: tuple, stream: int, operands: tuple, tail: tuple) -> None:
        args, which, cache = [], 0, self.cache
        for position, operand in enumerate(operands):
            if operand.__class__ is TmaOperand:
                key = operand.key(position)
                encoded = cache.get(key)
                if encoded is None:
                    encoded = cache[key] = self.encode(operand, self.metas[which])
                    if len(cache) > MAX_ENCODED:
                        del cache[next(iter(cache))]
                args.extend(encoded)
                which += 1
            else:
                args.append(operand)
        self.raw(grid[0], grid[1], grid[2], stream, self.function, self.cooperative, self.pdl,
                 None, None, self.packed, None, None, None, *args, *tail)
