"""What a launch is compiled for: the canonical stand-in of its arguments (``compile_form``),
what Triton specializes each value on (``specialization``), and the count of the distinct
compilations the launches of this process have needed (``compiled_forms``)."""

from __future__ import annotations

import torch

# -- what a launch is compiled for
# Triton specializes each int argument on == 1 and on divisibility by 16, and caches one
# compiled kernel per pattern. Lengths and the strides that follow them change pattern from one
# length to the next (1000 and 1024 differ; so do the strides of a (B, H, L, L) mask at
# L = 1000 and 1001), and each new pattern cost ~3 s of compiling per kernel on the H100 host,
# ~10 s for a masked forward and backward. ``compile_form`` gives each launch a canonical
# stand-in of its arguments, by the rules of ``planning.operands``, and the kernel is compiled
# for the stand-in and run with the real values: a kernel compiled for an int it knows nothing
# about is correct for every value of it. The value 1 is kept: Triton folds it into the code (a
# single key split, one head share), and a stand-in is never 1 unless the value is, so no
# parameter compiled as the constant 1 is handed another value.
#
# Compiled for sm_90 without a GPU (``triton.compile`` to PTX), the forward, dq, dkdv, fused
# and packed kernels came out identical, line for line, to their compilation for the real
# values in every case tried (dense, bool mask with per-key bias, full bias, KeyIntervals,
# decode Lq 1 and 4, the fused route; lengths 1000, 2001, 2048, 4001, 4096): the canonical
# form changes what is compiled how often, never the code that runs. Of the small launches,
# the mask's activity pass came out identical too (its lengths travel in a ``Sizes``); the
# list compaction and the intervals' activity pass read or write the small activity map with
# byte accesses where 2- to 8-byte ones were used at some lengths.
UNKNOWN_INT = 17  # neither 1 nor a multiple of 16: compiled for as an unknown int32
_INT32 = range(-2**31, 2**31)


def _unknown(value: int) -> int:
    # int64 values keep their own type (and divisibility): a stand-in must keep the width.
    return value if value == 1 or value not in _INT32 else UNKNOWN_INT


def compile_form(value):
    """The canonical stand-in of a launch argument (see ``planning.operands`` for the rules)."""
    if value.__class__ is int:
        return _unknown(value)
    if not isinstance(value, tuple):
        return value  # tensors, floats, None
    fields = getattr(value, "_fields", None)
    if fields is None:
        return tuple(compile_form(item) for item in value)
    kept = getattr(value, "KEPT_FIELDS", ())
    aligned = getattr(value, "ALIGNED_FIELDS", ())
    aligned_values = [getattr(value, name) for name in aligned]
    # An int64 stride among them (the batch stride of a (B, 4, 32768, 32768) mask is 2**32) is
    # kept whatever happens, and must not cost the others their alignment: it did at seqlen
    # L32768 (the mask's rows read without vectors, forward 23.7 against 14.0 ms on an H200).
    keep_aligned = all(v % 16 == 0 for v in aligned_values)
    condition = getattr(value, "ALIGNED_ONLY_IF", None)
    if condition is not None and getattr(value, condition[0]) != condition[1]:
        keep_aligned = False
    items = []
    for name, item in zip(fields, value):
        if name in kept or (keep_aligned and name in aligned):
            items.append(item)
        else:
            items.append(compile_form(item))
    return value.__class__(*items)


_free_positions: dict = {}  # kernel -> positions of its ``do_not_specialize`` parameters


def _unspecialized_positions(kernel) -> frozenset:
    """The positions of ``kernel``'s ``do_not_specialize`` parameters (a JIT function keeps
    them as given, names or positions; the interpreter's wrapper in its ``kwargs``)."""
    positions = _free_positions.get(kernel)
    if positions is None:
        given = getattr(kernel, "do_not_specialize", None)
        if given is None:
            given = getattr(kernel, "kwargs", {}).get("do_not_specialize")
        names = list(getattr(kernel, "arg_names", ()))
        positions = _free_positions[kernel] = frozenset(
            item if item.__class__ is int else names.index(item) for item in given or ())
    return positions


def unspecialized(kernel, form: tuple) -> tuple:
    """``form`` (a launch's arguments in the kernel's order, as ``compile_form`` gives them)
    with the int32 values of ``kernel``'s ``do_not_specialize`` parameters as ``UNKNOWN_INT``,
    1 included: Triton compiles such a parameter as an unknown int32 whatever its value, so a
    length at which one becomes 1 (a row's blocks) is no new form."""
    positions = _unspecialized_positions(kernel)
    if not positions:
        return form
    return tuple(UNKNOWN_INT if i in positions and value.__class__ is int and value in _INT32
                 else value for i, value in enumerate(form))


def is_descriptor(value) -> bool:
    """A host-side TMA tensor descriptor (Gluon's ``TensorDescriptor``)."""
    return hasattr(value, "block_shape") and hasattr(value, "layout") and hasattr(value, "base")


def specialization(value):
    """What Triton compiles ``value`` for: ints as 1, a multiple of 16 or other (with their
    width), tensors by dtype and 16-byte alignment, floats by type, tuples item by item."""
    if value.__class__ is int:
        width = "i32" if value in _INT32 else "i64"
        return 1 if value == 1 else (width, value % 16 == 0)
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() & 15
    if is_descriptor(value):  # compiled for its dtype, box and shared layout, never its sizes
        return "tensordesc", value.base.dtype, tuple(value.block_shape), value.layout
    if isinstance(value, tuple):
        return tuple(specialization(item) for item in value)
    if value.__class__ is float:
        return float
    return value


# Every (kernel, specialization, options) a launch has been compiled for in this process, the
# interpreter's included (it compiles nothing, but records what would be compiled), so that
# tests and ``dmbench compile-cost`` can count the compiles a call needs.
_compiled_forms: set = set()


def compiled_forms() -> int:
    """How many distinct kernel compilations the launches so far have needed."""
    return len(_compiled_forms)


def _form_key(kernel, args: tuple, options: dict) -> tuple:
    return (getattr(kernel, "__name__", repr(kernel)), specialization(args),
            tuple(sorted(options.items())))


def note_form(kernel, args: tuple, options: dict) -> bool:
    """Record that ``kernel`` is compiled for ``args`` (a compile form) and ``options``: True
    the first time in this process."""
    key = _form_key(kernel, args, options)
    if key in _compiled_forms:
        return False
    _compiled_forms.add(key)
    return True
