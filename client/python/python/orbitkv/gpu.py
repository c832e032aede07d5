"""torch CUDA helpers: naming a GPU and sharing KV tensors with the server by CUDA IPC.

Only imported when GPU features are used; importing it needs torch.
"""

from __future__ import annotations

from typing import Any, Tuple

from ._native import InvalidArgument


def device_uuid(device: Any = None) -> str:
    """The `GPU-...` UUID of a torch CUDA device (as `nvidia-smi -L` prints it)."""
    import torch

    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    return "GPU-" + str(torch.cuda.get_device_properties(dev).uuid)


def ipc_triple(tensor: Any) -> Tuple[bytes, int, int]:
    """(64-byte CUDA IPC handle of the allocation, byte offset of `tensor` in it, its bytes)."""
    if not getattr(tensor, "is_cuda", False):
        raise InvalidArgument("register_gpu takes CUDA tensors (or (handle, offset, len) triples)")
    if not tensor.is_contiguous():
        raise InvalidArgument("register_gpu takes contiguous tensors")
    storage = tensor.untyped_storage()
    shared = storage._share_cuda_()
    handle, storage_offset = shared[1], shared[3]
    if len(handle) != 64:
        raise InvalidArgument(f"CUDA IPC handle of {len(handle)} bytes, not 64")
    offset = storage_offset + tensor.storage_offset() * tensor.element_size()
    return bytes(handle), int(offset), tensor.numel() * tensor.element_size()
