"""torch CUDA paths: naming a GPU and sharing KV tensors with the Manager by CUDA IPC
(`ipc`), the engine's own copies through its CUDA-registered mapping of the arena
(`EngineCopies`), paged KV caches (`GpuKvCache`) and their block copies by either path
(`GpuBlockCopies`).

Only imported when GPU features are used; importing it needs torch only when used.
"""

from __future__ import annotations

from .block_copies import GpuBlockCopies
from .engine_copies import EngineCopies
from .ipc import device_uuid, ipc_triple
from .kv_cache import GpuKvCache

__all__ = ["EngineCopies", "GpuBlockCopies", "GpuKvCache", "device_uuid", "ipc_triple"]
