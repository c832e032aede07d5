"""Engines' KV dtype names (torch's, and vLLM's cache dtypes) as OrbitKV dtypes."""

from __future__ import annotations

from typing import Any

_DTYPES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
    "fp8": "fp8_e4m3",
    "fp8_e4m3": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
    "float8_e5m2": "fp8_e5m2",
}


def okv_dtype(name: Any) -> str:
    """The OrbitKV dtype of `name` (`torch.bfloat16`, `"fp8"`, ...); ValueError naming it if
    there is none."""
    key = str(name).replace("torch.", "")
    try:
        return _DTYPES[key]
    except KeyError:
        raise ValueError(f"KV cache dtype {key!r} has no OrbitKV dtype") from None
