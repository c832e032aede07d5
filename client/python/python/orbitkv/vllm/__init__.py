"""vLLM KV connector: `--kv-transfer-config '{"kv_connector":"OrbitKVConnector",
"kv_connector_module_path":"orbitkv.vllm","kv_role":"kv_both"}'`.

Importing this module imports vLLM (>= 0.32, the `KVConnectorBase_V1` API with the
three-argument constructor).
"""

from .connector import OrbitKVConnector, OrbitKVConnectorMetadata
from .stats import OrbitKVConnectorStats


def _register() -> None:
    """OrbitKV in vLLM's connector registry, by name: vLLM's MultiConnector finds its children's
    classes there (to rebuild their stats in the process that logs them); vLLM imports this
    module wherever a config names it (`kv_connector_module_path`), that process included."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector("OrbitKVConnector", __name__, "OrbitKVConnector")
    except ValueError:  # registered already (a second import under another name)
        pass


_register()

__all__ = ["OrbitKVConnector", "OrbitKVConnectorMetadata", "OrbitKVConnectorStats"]
