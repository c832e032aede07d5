"""Caller buffers as the native layer takes them: objects with the buffer protocol, which it
holds exported (so they cannot be freed or moved) for the whole call, without copying.

Accepted: anything with the buffer protocol that is C-contiguous (bytes, bytearray,
memoryview, numpy arrays, mmap) and CPU torch tensors (contiguous), which pass as numpy views
of their bytes. Writes need a writable buffer. The native layer checks contiguity and
writability itself and names the argument when it refuses one.
"""

from __future__ import annotations

from typing import Any


def _torch_tensor(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def buffer(obj: Any, what: str = "buffer") -> Any:
    """`obj` itself, or for a CPU torch tensor a uint8 numpy view of its memory (the view
    keeps the tensor referenced)."""
    if not _torch_tensor(obj):
        return obj
    import torch

    from ._native import InvalidArgument

    if obj.device.type != "cpu":
        raise InvalidArgument(
            f"{what} is a {obj.device.type} tensor: CPU buffers only here "
            "(GPU pages go through register_gpu/save/load or orbitkv.gpu)"
        )
    if not obj.is_contiguous():
        raise InvalidArgument(f"{what} is a non-contiguous tensor: pass .contiguous()")
    return obj.detach().reshape(-1).view(torch.uint8).numpy()
