"""Slices of a stacked `[L, ...]` array along its leading axis that share its device memory: no copy.

A decoding loop with unrolled layers reads each layer's weights as a buffer of its own. Slicing the stacked weights
inside the jitted program makes XLA materialise every slice, so the call would hold a second copy of the layers'
weights. `leading_slices` instead makes, outside the program, L arrays whose buffers lie inside the stacked array's
buffer (`leading_prefix`: one array of the first n): the array's DLPack capsule (JAX's own, whose deleter keeps
the stacked buffer alive) re-pointed at slice i (data pointer + i x slice bytes, the slice's shape, row-major
strides) and imported with `jax.dlpack.from_dlpack(..., copy=False)`, which refuses rather than copies. Where that is not possible (an array
over several devices, a backend without DLPack import, a slice not aligned as the backend needs) it returns None
and the caller slices inside its program as before.

The slices are read only: nothing may donate or delete the stacked array while they are in use (the decoding loops
never donate weights). They are kept per stacked array (cached while its Python object lives), so a loop call after
the first makes none.
"""

from __future__ import annotations

import ctypes
import math
import weakref

import jax


class _DLTensor(ctypes.Structure):  # DLPack's DLTensor (dlpack.h), the head of DLManagedTensor
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32),
                ("ndim", ctypes.c_int32), ("dtype_code", ctypes.c_uint8), ("dtype_bits", ctypes.c_uint8),
                ("dtype_lanes", ctypes.c_uint16), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("byte_offset", ctypes.c_uint64)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

_SHAPES: dict[tuple[int, ...], ctypes.Array] = {}  # int64 shape arrays the capsules point at (a few, kept)
_CACHE: dict[int, tuple[weakref.ref, tuple[jax.Array, ...]]] = {}  # id(stacked) -> (its weakref, slices)


class _Capsule:
    """A DLPack producer for one prepared capsule (what `jax.dlpack.from_dlpack` takes)."""

    def __init__(self, capsule, device):
        self.capsule, self.device = capsule, device

    def __dlpack__(self, stream=None, **kwargs):
        return self.capsule

    def __dlpack_device__(self):
        return self.device


def _shape_array(shape: tuple[int, ...]) -> ctypes.Array:
    arr = _SHAPES.get(shape)
    if arr is None:
        arr = _SHAPES[shape] = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    return arr


def _slice(x: jax.Array, i: int, count: int | None = None) -> jax.Array:
    """`x[i]`, or with `count` `x[i:i + count]`, imported over `x`'s buffer."""
    capsule = x.__dlpack__()  # a legacy "dltensor" capsule of x's buffer
    t = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    if t.strides:  # a plain leading-axis slice only of a row-major buffer
        strides = list((ctypes.c_int64 * t.ndim).from_address(t.strides))
        if strides != [int(math.prod(x.shape[d + 1:])) for d in range(x.ndim)]:
            raise ValueError(f"not row-major: strides {strides} of shape {x.shape}")
    shape = tuple(x.shape[1:]) if count is None else (count, *x.shape[1:])
    t.data = t.data + t.byte_offset + i * (x.nbytes // x.shape[0])
    t.byte_offset = 0
    t.ndim = len(shape)
    t.shape = ctypes.addressof(_shape_array(shape))
    t.strides = None  # compact row-major
    return jax.dlpack.from_dlpack(_Capsule(capsule, x.__dlpack_device__()), copy=False)


def leading_slices(x: jax.Array) -> tuple[jax.Array, ...] | None:
    """`(x[0], ..., x[L-1])` as arrays sharing `x`'s device memory, or None where the backend cannot alias them."""
    key = id(x)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is x:
        return hit[1]
    if x.ndim < 1 or x.shape[0] == 0 or not x.is_fully_addressable or len(x.devices()) != 1:
        return None
    try:
        x.block_until_ready()
        out = tuple(_slice(x, i) for i in range(x.shape[0]))
        base = x.unsafe_buffer_pointer()
        step = x.nbytes // x.shape[0]
        if any(s.unsafe_buffer_pointer() != base + i * step for i, s in enumerate(out)):
            return None  # imported as a copy: not what we are here for
    except Exception:  # noqa: BLE001 - no DLPack on this backend, alignment, a layout JAX does not export as is
        return None
    _CACHE[key] = (weakref.ref(x, lambda _, key=key: _CACHE.pop(key, None)), out)
    return out


def leading_prefix(x: jax.Array, count: int) -> jax.Array | None:
    """`x[:count]` as an array sharing `x`'s device memory, or None where the backend cannot alias it."""
    if x.ndim < 1 or not 1 <= count <= x.shape[0] or not x.is_fully_addressable or len(x.devices()) != 1:
        return None
    try:
        x.block_until_ready()
        out = _slice(x, 0, count)
        if out.unsafe_buffer_pointer() != x.unsafe_buffer_pointer():
            return None  # imported as a copy
    except Exception:  # noqa: BLE001 - no DLPack on this backend, alignment, a layout JAX does not export as is
        return None
    return out
