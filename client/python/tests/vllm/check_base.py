"""Checks `orbitkv.vllm.OrbitKVConnector` against another vLLM release's `KVConnectorBase_V1`
(its base.py alone, taken from that release's wheel, loaded beside the installed vLLM): every
abstract method is implemented, and every method the connector overrides keeps the base's
parameters.

usage: check_base.py VLLM_WHEEL_OR_BASE_PY VERSION
"""

import importlib.util
import inspect
import sys
import zipfile

MEMBER = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"


def main() -> int:
    path, version = sys.argv[1], sys.argv[2]
    if path.endswith(".whl"):
        with zipfile.ZipFile(path) as z:
            source = z.read(MEMBER).decode()
    else:
        source = open(path).read()
    spec = importlib.util.spec_from_loader(f"vllm_base_{version.replace('.', '_')}", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, f"vllm-{version}/{MEMBER}", "exec"), module.__dict__)
    base = module.KVConnectorBase_V1

    from orbitkv.vllm import OrbitKVConnector

    problems = []
    for name in sorted(base.__abstractmethods__):
        impl = getattr(OrbitKVConnector, name, None)
        if impl is None or getattr(impl, "__isabstractmethod__", False):
            problems.append(f"abstract method {name} is not implemented")
    for name, member in vars(OrbitKVConnector).items():
        theirs = getattr(base, name, None)
        if name.startswith("_") or not callable(member) or theirs is None or not callable(theirs):
            continue
        ours_params = list(inspect.signature(member).parameters)
        their_params = list(inspect.signature(theirs).parameters)
        ours_fixed = [p for p in ours_params if p not in ("kwargs", "args")]
        their_fixed = [p for p in their_params if p not in ("kwargs", "args")]
        if ours_fixed != their_fixed:
            problems.append(f"{name}{inspect.signature(member)} differs from vLLM {version}'s {name}{inspect.signature(theirs)}")
    new = sorted(n for n in vars(base) if not n.startswith("_") and callable(getattr(base, n))
                 and n not in vars(OrbitKVConnector))
    print(f"vLLM {version} KVConnectorBase_V1: {len(base.__abstractmethods__)} abstract methods, all implemented"
          if not problems else f"vLLM {version}: {len(problems)} problems")
    print(f"  base methods the connector leaves to the base's defaults: {', '.join(new)}")
    for p in problems:
        print("  PROBLEM:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
