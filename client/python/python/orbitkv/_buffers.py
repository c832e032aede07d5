"""Caller buffers resolved to (address, length) for the native layer, without copying.

Accepted: anything with the buffer protocol that is C-contiguous (bytes, bytearray,
memoryview, numpy arrays, mmap) and CPU torch tensors (contiguous). Writes need a writable
buffer. The returned keepalive must stay referenced for the duration of the native call.
"""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from ._native import InvalidArgument


def _torch_tensor(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def resolve(obj: Any, writable: bool, what: str = "buffer") -> Tuple[int, int, Any]:
    """(address, length in bytes, keepalive) of `obj`'s memory."""
    if _torch_tensor(obj):
        if obj.device.type != "cpu":
            raise InvalidArgument(
                f"{what} is a {obj.device.type} tensor: CPU buffers only here "
                "(GPU pages go through register_gpu/save/load or orbitkv.gpu)"
            )
        if not obj.is_contiguous():
            raise InvalidArgument(f"{what} is a non-contiguous tensor: pass .contiguous()")
        return obj.data_ptr(), obj.numel() * obj.element_size(), obj
    try:
        view = memoryview(obj)
    except TypeError:
        raise InvalidArgument(
            f"{what} of type {type(obj).__name__} has no buffer protocol "
            "(bytes, bytearray, memoryview, numpy array or CPU torch tensor)"
        ) from None
    if not view.c_contiguous:
        raise InvalidArgument(f"{what} is not C-contiguous")
    if writable and view.readonly:
        raise InvalidArgument(f"{what} is read-only ({type(obj).__name__}); pass a writable buffer")
    if view.nbytes == 0:
        return 0, 0, view
    arr = np.frombuffer(view.cast("B") if view.ndim != 1 or view.format != "B" else view, dtype=np.uint8)
    return int(arr.ctypes.data), view.nbytes, (view, arr)
