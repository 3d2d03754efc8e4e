"""64-bit indexing where a tensor needs it, and the 32-bit kernels everywhere else.

cuTile indexes an array parameter with int32 shapes and strides unless the kernel annotates it
`ct.IndexedWithInt64`, and refuses to launch with a larger size or stride. Offsets are another
matter. A tile moved by a bulk tensor copy (TMA: base address and strides in multiples of 16
bytes) is addressed by 64-bit descriptors, so a tensor of any extent is right with int32
indexing. A tile the compiler moves element by element is addressed with 32-bit offsets, which
wrap past 2**31 bytes: measured on an H100, a q of 2**31 elements one element off 16-byte
alignment came out wrong in its last heads (relative error 1.1). So a tensor needs the wide
kernels if a size or stride passes int32, or if it spans more than 2**31 bytes and is not
bulk-copyable. Each kernel has a twin whose array parameters are all annotated, compiled only
when a call needs it, so the common case keeps its 32-bit address arithmetic.
"""

import dataclasses
import types
from functools import cache

import torch

INT32_MAX = 2**31 - 1
_BULK_COPY_ALIGNMENT = 16  # bytes, of a TMA tensor's base address and strides


def needs_int64(t: torch.Tensor) -> bool:
    """Whether cuTile's default 32-bit indexing cannot address every element of t."""
    # The address is read only for a tensor past 2**31 bytes: torch.compile's fake tensors have none.
    return _layout_needs_int64(tuple(t.shape), t.stride(), t.element_size(), t.data_ptr)


def contiguous_needs_int64(shape: tuple[int, ...], element_size: int) -> bool:
    """needs_int64 of a new contiguous tensor of this shape (one a call allocates, so aligned),
    by arithmetic rather than a tensor: calls with a score modifier check every time."""
    strides, stride = [], 1
    for size in reversed(shape):
        strides.append(stride)
        stride *= size
    return _layout_needs_int64(tuple(shape), tuple(reversed(strides)), element_size, lambda: 0)


def spans_past_int32(t: torch.Tensor) -> bool:
    """Whether t's elements reach more than 2**31 - 1 bytes past its first."""
    return _span_bytes(tuple(t.shape), t.stride(), t.element_size()) > INT32_MAX


def _layout_needs_int64(shape, strides, element_size: int, address) -> bool:
    """The rule of the module docstring: a size or stride past int32, or more than 2**31 bytes
    that bulk copies cannot move (a base address or a stride not a multiple of 16 bytes).
    address: a callable giving the base address, asked only when the span decides nothing."""
    if max(shape, default=0) > INT32_MAX or max(strides, default=0) > INT32_MAX:
        return True
    if _span_bytes(shape, strides, element_size) <= INT32_MAX:
        return False
    bulk_copyable = (
        address() % _BULK_COPY_ALIGNMENT == 0
        and (not strides or strides[-1] == 1)
        and all(stride * element_size % _BULK_COPY_ALIGNMENT == 0
                for size, stride in zip(shape[:-1], strides[:-1], strict=True) if size > 1)
    )  # fmt: skip
    return not bulk_copyable


def _span_bytes(shape, strides, element_size: int) -> int:
    """Bytes from a tensor's first element to the end of its last (0 when it has none)."""
    if 0 in shape:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(shape, strides, strict=True))
    return (last + 1) * element_size


@cache
def wide(kernel):
    """The kernel's twin with int64 shapes and strides for every array parameter (those without
    an annotation: scalars and constants are annotated), of the kernel's own class."""
    import cuda.tile as ct

    function = kernel._pyfunc
    twin = types.FunctionType(
        function.__code__, function.__globals__, function.__name__, function.__defaults__, function.__closure__
    )
    twin.__qualname__ = f"{function.__qualname__}_int64_index"
    twin.__module__ = function.__module__
    twin.__doc__ = function.__doc__
    annotations = dict(function.__annotations__)
    for name in function.__code__.co_varnames[: function.__code__.co_argcount]:
        annotations.setdefault(name, ct.IndexedWithInt64)
    twin.__annotations__ = annotations
    return type(kernel)(twin, **dataclasses.asdict(kernel._compiler_options))
