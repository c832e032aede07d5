"""OrbitKV: an external KV cache for LLM inference engines.

`Client` is one session with the host's `orbitkv-server` (the Manager), mirroring the Rust
client: namespaces, lookups with and without leases, put/get through the buffer protocol
(no copies on our side beyond the one into or out of the shared arena), engine blocks saved
and loaded in place, tensor-parallel group lookups, and GPU registration with save/load by
the server's DMA threads. Engine integrations: `orbitkv.vllm` (vLLM KV connector).

Every blocking call releases the GIL. Errors are `OrbitKVError` subclasses carrying `kind`
and, for the server's refusals, `code`.
"""

from __future__ import annotations

from . import _native
from ._native import (
    PREFIX_SEED,
    ChunkKey,
    Disconnected,
    GpuRegistration,
    Hit,
    InvalidArgument,
    KvLayout,
    Lease,
    NamespaceDescriptor,
    OrbitKVError,
    ProtocolError,
    Reserved,
    ServerError,
    Stale,
    Timeout,
    Transfer,
    Unavailable,
    chunk_checksum,
    chunk_digest,
    prefix_digests,
)
from .client import ArenaInfo, Client, GroupPrefix, Namespace, Region, admin, default_socket_path
from .outcome import Outcome

__all__ = [
    "PREFIX_SEED",
    "ArenaInfo",
    "ChunkKey",
    "Client",
    "Disconnected",
    "GpuRegistration",
    "GroupPrefix",
    "Hit",
    "InvalidArgument",
    "KvLayout",
    "Lease",
    "Namespace",
    "NamespaceDescriptor",
    "OrbitKVError",
    "Outcome",
    "ProtocolError",
    "Region",
    "Reserved",
    "ServerError",
    "Stale",
    "Timeout",
    "Transfer",
    "Unavailable",
    "admin",
    "chunk_checksum",
    "chunk_digest",
    "default_socket_path",
    "prefix_digests",
]

# The workspace's version (Cargo.toml), which `orbitkv-server --version` and `orbitkv-ctl
# --version` of the same release print.
__version__: str = _native.__version__
