"""SGLang HiCache storage backend: `--hicache-storage-backend dynamic
--hicache-storage-backend-extra-config '{"backend_name":"orbitkv","module_path":"orbitkv.sglang",
"class_name":"OrbitKVStorage","interface_v1":1}'`.

Importing this module imports SGLang (0.5.23: its `HiCacheStorage` base class).
"""

from .storage import OrbitKVStorage, StorageStats

__all__ = ["OrbitKVStorage", "StorageStats"]
