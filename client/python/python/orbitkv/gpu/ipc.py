"""Naming a GPU and sharing torch CUDA tensors with the Manager by CUDA IPC."""

from __future__ import annotations

from typing import Any, Tuple

from .._native import InvalidArgument


def device_uuid(device: Any = None) -> str:
    """The `GPU-...` UUID of a torch CUDA device (as `nvidia-smi -L` prints it)."""
    import torch

    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    return "GPU-" + str(torch.cuda.get_device_properties(dev).uuid)


def _cuda_ipc_handle(shareable: bytes) -> bytes:
    """The `cudaIpcMemHandle_t` in PyTorch's shareable handle: a version byte, a kind byte
    (`c`: a cudaMalloc'd block; `e`: an expandable segment) and then the kind's handle."""
    if len(shareable) == 64:
        return shareable
    if len(shareable) == 66 and shareable[1:2] == b"c":
        return shareable[2:]
    if len(shareable) >= 2 and shareable[1:2] == b"e":
        raise InvalidArgument(
            "the tensor lies in an expandable segment, which CUDA IPC cannot share: run the engine "
            "with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False, or use orbitkv.gpu.EngineCopies"
        )
    raise InvalidArgument(f"unknown PyTorch shareable CUDA handle ({len(shareable)} bytes, {shareable[:2]!r})")


def ipc_triple(tensor: Any) -> Tuple[bytes, int, int]:
    """(64-byte CUDA IPC handle of the allocation, byte offset of `tensor` in it, its bytes)."""
    if not getattr(tensor, "is_cuda", False):
        raise InvalidArgument("register_gpu takes CUDA tensors (or (handle, offset, len) triples)")
    if not tensor.is_contiguous():
        raise InvalidArgument("register_gpu takes contiguous tensors")
    storage = tensor.untyped_storage()
    shared = storage._share_cuda_()
    handle, storage_offset = _cuda_ipc_handle(bytes(shared[1])), shared[3]
    offset = storage_offset + tensor.storage_offset() * tensor.element_size()
    return bytes(handle), int(offset), tensor.numel() * tensor.element_size()
