"""vLLM KV connector: `--kv-transfer-config '{"kv_connector":"OrbitKVConnector",
"kv_connector_module_path":"orbitkv.vllm","kv_role":"kv_both"}'`.

Importing this module imports vLLM (>= 0.32, the `KVConnectorBase_V1` API with the
three-argument constructor).
"""

from .connector import OrbitKVConnector, OrbitKVConnectorMetadata
from .stats import OrbitKVConnectorStats

__all__ = ["OrbitKVConnector", "OrbitKVConnectorMetadata", "OrbitKVConnectorStats"]
